import pytest
import torch
from torch import nn

from helpers.memory import ledger_for
from helpers.monitor import MemoryMonitor, frontend_attached
from helpers.runtime.rig import cpu_rig


def test_no_frontend_under_tests():
    assert not frontend_attached()


def test_static_snapshot_draws_the_ledger(capsys):
    a, b = nn.Linear(64, 64), nn.Linear(64, 64)
    ledger = ledger_for([a, b], ["cpu:0", "cpu:1"])
    monitor = MemoryMonitor(cpu_rig(budget_gib=1.0), ledger).start()
    x = torch.randn(8, 64, requires_grad=True)
    with ledger.track_activations("cpu:1"):
        b(a(x)).sum().backward()
    monitor.stop()
    out = capsys.readouterr().out
    assert "cpu:0" in out and "cpu:1" in out and "/ 1.00 GiB" in out and "P params" in out
    r0, r1 = monitor.readings()
    assert r0.label == "cpu:0" and r0.capacity == 2**30
    assert r0.parts == r1.parts == {"params": (64 * 64 + 64) * 4, "grads": (64 * 64 + 64) * 4, "optimizer": 0,
                                    "activations": 0}  # activations freed after backward
    assert monitor.peak[1] > r1.counted  # activations counted at their peak
    assert monitor.scale == max(monitor.peak)  # bars drawn to the largest total, not to the 1 GiB capacity


def test_cpu_monitor_needs_a_ledger():
    with pytest.raises(ValueError, match="pass ledger="):
        MemoryMonitor(cpu_rig())


def test_gpu_readings_tolerate_nvml_without_a_reading(monkeypatch):
    """NVML may answer 'N/A' for a GPU (nvitop returns the string): the panel shows N/A instead of failing."""
    import nvitop

    from helpers.monitor import Reading, nvml_used

    class NoReading:  # what nvitop gives for a GPU whose memory NVML cannot read
        def __init__(self, index):
            self.index = index

        def memory_used(self):
            return "N/A" if self.index == 1 else 123

    monkeypatch.setattr(nvitop, "CudaDevice", NoReading)
    assert nvml_used([0, 1]) == [123, None]
    r = Reading("cuda:1", {"params": 10}, 100, allocated=10, reserved=20, nvml=None)
    assert "nvidia-smi N/A" in r.text() and r.total == 20
