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
    assert "cpu:0" in out and "cpu:1" in out and "/ 1.00 GiB" in out
    (label0, used0, cap0), (_, used1, _) = monitor.snapshot()
    assert label0 == "cpu:0" and cap0 == 2**30
    assert used0 == used1 == 2 * (64 * 64 + 64) * 4  # weights + grads of each layer
    assert monitor.peak[1] > used1  # activations counted at their peak


def test_cpu_monitor_needs_a_ledger():
    with pytest.raises(ValueError, match="pass ledger="):
        MemoryMonitor(cpu_rig())
