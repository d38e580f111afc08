"""Device-strict ranks (helpers.runtime.strict): on the CPU rig a tensor made without `device=` fails in a collective
or a send as it fails under NCCL on GPUs, and the engines, the bench's calibration and the scripts run in that mode
(the suite sets LAB_DEVICE_STRICT=1 for every rank it starts)."""
import pytest
import torch

from helpers.runtime import workers
from helpers.runtime.launch import WorkerError, run
from helpers.runtime.rig import cpu_rig
from helpers.runtime.strict import strict_requested
from tests import workers as bad


def test_the_suite_runs_every_rank_device_strict():
    assert strict_requested(), "conftest.py sets LAB_DEVICE_STRICT=1"
    out = run(bad.rank_defaults, rig=cpu_rig())
    assert all(r == {"default_device": "meta", "backend": "cpu:gloo"} for r in out), out


@pytest.mark.parametrize("kind", ["all_reduce", "send"])
def test_a_tensor_made_without_device_fails_as_under_nccl(kind):
    with pytest.raises(WorkerError, match="No backend type associated with device type meta"):
        run(bad.collective_without_device, kind, rig=cpu_rig(), timeout=60)
    assert run(workers.all_reduce_sum, 2.0, rig=cpu_rig()) == [6.0, 6.0]  # with device= it works


def test_the_bench_calibration_runs_device_strict():
    """The calibration's all-reduce of (alone, together) was made without device=: under NCCL it raised "No backend
    type associated with device type cpu" and the bench lost its whole run."""
    from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
    from helpers.simulate.calibrate import process_calibration

    cfg = StackConfig(hidden=32, n_blocks=2, heads=2, seq_len=8, vocab=64)
    x, y = SyntheticTokens(4, cfg.seq_len, cfg.vocab).batch(0, 4)
    out = process_calibration(cpu_rig(), build_stack(cfg), x, y, lm_loss, sizes=[4096], rounds=1, repeats=1)
    assert len(out["ratios"]) == 1 and out["ratios"][0] > 0
    assert torch.get_default_device().type == "cpu"  # the caller itself is not strict


@pytest.mark.parametrize("value, strict", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                           ("", False), ("false", False)])
def test_the_strict_flag_takes_the_usual_truthy_values_in_the_library_and_the_scripts(monkeypatch, value, strict):
    """scripts/_common.py accepted only "1": LAB_DEVICE_STRICT=true started the scripts' ranks non-strict while the
    library's ranks were strict. Both now use one parser."""
    import sys
    from pathlib import Path

    scripts = str(Path(__file__).resolve().parent.parent / "scripts")
    sys.path.insert(0, scripts)
    try:
        import _common
    finally:
        sys.path.remove(scripts)
    monkeypatch.setenv("LAB_DEVICE_STRICT", value)
    assert _common.strict_requested is strict_requested and strict_requested() is strict
