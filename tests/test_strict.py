"""Device-strict ranks (helpers.runtime.strict): on the CPU rig a tensor made without `device=` fails in a collective
or a send as it fails under NCCL on GPUs, and the engines, the bench's calibration and the scripts run in that mode
(the suite sets LAB_DEVICE_STRICT=1 for every rank it starts)."""
from pathlib import Path

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


def test_ranks_started_from_notebooks_run_strict_but_the_named_exceptions():
    """Ranks a notebook's kernel starts ran non-strict in CI, so a forgotten device= in a notebook's own rank code
    passed on the CPU rig. Now every notebook's ranks run strict (conftest.py keeps LAB_DEVICE_STRICT for the
    kernels) except these, each for its reason (found by running every notebook that starts ranks strict)."""
    import conftest

    notebooks = {p.name for p in (Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")}
    assert set(conftest.NOT_STRICT) <= notebooks
    assert all(len(reason) > 40 for reason in conftest.NOT_STRICT.values()), "each exception says why"
    assert set(conftest.NOT_STRICT) == {"06_1f1b.ipynb", "11_train_your_hf_model.ipynb"}, \
        "a new exception needs its reason here"
