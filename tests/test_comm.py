import pytest
import torch

from helpers.pipeline.comm import Wire, link_benchmark, resolve_dtype, send_to
from helpers.pipeline.transports import still_running
from helpers.runtime.rig import cpu_rig


def test_wire_halves_bytes_and_round_trips():
    t = torch.randn(4, 8)
    assert Wire.of("bf16").bytes(t) * 2 == Wire.of("fp32").bytes(t) == t.numel() * 4
    back = Wire.of("fp16").unpack(Wire.of("fp16").pack(t))
    assert back.dtype == torch.float32 and torch.allclose(back, t, rtol=1e-3, atol=1e-3)
    assert Wire.of("bf16").pack(torch.arange(3)).dtype == torch.int64  # token ids travel untouched
    assert send_to(t, torch.device("cpu")).get() is t


@pytest.mark.parametrize("bad", ["int8", torch.int8, torch.int64, "fp8"])
def test_unsendable_dtype_is_refused(bad):
    with pytest.raises(ValueError, match="cannot send activations as"):
        resolve_dtype(bad)


def test_link_benchmark_measures_every_engine_link_at_each_size():
    samples = link_benchmark(cpu_rig(), [4096, 65536], repeats=2)
    paths = {s.path for s in samples}
    assert paths == {"processes: point-to-point (gloo)", "processes: all-reduce (gloo)"}
    for path in paths:
        assert [s.bytes for s in samples if s.path == path] == [4096, 65536]
    assert all(s.seconds > 0 and s.gb_per_s > 0 for s in samples)


def test_bad_link_sizes_are_refused_before_spawning():
    with pytest.raises(ValueError, match=r"multiples of 4 bytes .*\[6, 0\]"):
        link_benchmark(cpu_rig(), [4096, 6, 0])


def test_sent_tensors_are_released_when_their_work_completes():
    """P2PTransport kept every sent tensor to the end of the step; it now drops each one whose work has completed
    when it posts the next exchange (real c10d works, completed or not, as NCCL's report through their events)."""
    from torch._C._distributed_c10d import _create_work_from_future

    done, running = torch.futures.Future(), torch.futures.Future()
    done.set_result(None)
    sent = [(torch.ones(4), _create_work_from_future(done)), (torch.ones(4), _create_work_from_future(running))]
    assert still_running(sent) == sent[1:]
    running.set_result(None)
    assert still_running(sent) == []
