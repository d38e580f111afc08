"""Test-wide settings, inherited by the notebook kernels and every rank the tests start: widgets print static
snapshots; every rank runs device-strict (helpers.runtime.strict: a tensor made without device= fails a collective,
as under NCCL), the ranks a notebook's kernel starts included. The kernel itself stays a learner's (strict mode only
acts in ranks and scripts). The notebooks whose ranks cannot run strict are in NOT_STRICT, each with its reason
(tests/test_strict.py checks the list).

Two tiers. `pytest` runs the fast tier, which proves an install in minutes: the unit tests of every module, each
engine and strategy once against one device on a tiny model, and notebook 00. `pytest --full` runs everything: every
notebook, the slow parity matrices, the launcher's fault tests, the scripts, the doctor, the bench, and the stress
test that runs notebooks 04-07 five times in a row (`-m repeat`). A test joins the full tier with `@pytest.mark.full`;
a notebook joins the fast tier by being listed in FAST_NOTEBOOKS.
"""
import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("LAB_STATIC_WIDGETS", "1")
os.environ.setdefault("LAB_DEVICE_STRICT", "1")

# Every temp folder of the session (pytest's tmp_path, the ranks', the notebooks' kernels', torchrun's) goes into one
# folder of its own, so that what a test leaves behind is seen (a failure at the end) and removed.
SESSION_TMP = Path(tempfile.mkdtemp(prefix="lab-tests-"))
os.environ["TMPDIR"] = str(SESSION_TMP)
tempfile.tempdir = None  # re-read TMPDIR

FAST_NOTEBOOKS = {"00_start_here.ipynb"}
NOT_STRICT = {  # notebook -> why the ranks it starts run without device-strict mode
    "11_train_your_hf_model.ipynb": "its DDP script (section 3, the learner's own lines) calls from_pretrained inside "
                                    "each rank, which transformers refuses under a meta default device; on GPUs the "
                                    "same line is right",
    "06_1f1b.ipynb": "section 5's allocator probe times GPipe and 1F1B inside one rank: strict mode's default-device "
                     "hook (Python work on every torch call) slows it past its timeout and into what it measures",
}


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="the full tier too: every notebook, the slow parity matrices, the launcher's fault tests, "
                          "the scripts, the doctor and the bench (README: Tests)")


def pytest_configure(config):
    config.addinivalue_line("markers", "full: runs only with --full (the full tier)")
    config.addinivalue_line("markers", "repeat: the full tier's stress test (notebooks 04-07 five times in a row, about "
                                       "17 minutes); CI leaves it out to keep its run under 30 minutes")


def pytest_sessionfinish(session, exitstatus):
    """Fail a run that left folders in the temp directory (pytest's tmp_path folders excepted: it removes them, and
    PyTorch's compile cache); then remove the session's temp folder whatever happened."""
    from helpers.runtime.scratch import remove_scratch_dirs

    remove_scratch_dirs()  # this process's scratch folders, which would go at exit
    left = sorted(p.name for p in SESSION_TMP.iterdir()  # pytest's own, and PyTorch's compile cache, are theirs
                  if not p.name.startswith(("pytest-of-", "torchinductor_")))
    shutil.rmtree(SESSION_TMP, ignore_errors=True)
    if left and session.exitstatus == 0:
        print(f"\nthe tests left these in the temp directory: {left}")
        session.exitstatus = 1


def _stop_kernels_as_jupyterlab_does() -> None:
    """nbval kills each notebook's kernel (`shutdown_kernel(now=True)`: SIGKILL), so the kernel's exit handlers never
    run and its scratch folders stay. JupyterLab asks a kernel to shut down (closing or restarting a notebook); the
    tests do the same, so a kernel that would not exit cleanly for a learner is seen here too."""
    from nbval.kernel import RunningKernel

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)
        del self.km

    RunningKernel.stop = stop


_stop_kernels_as_jupyterlab_does()


def _is_notebook(item) -> bool:
    path = getattr(item, "path", None)
    return path is not None and path.suffix == ".ipynb"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """nbval starts a notebook's kernel while setting up its first cell: without LAB_DEVICE_STRICT for the notebooks
    in NOT_STRICT (see above)."""
    strict = os.environ.pop("LAB_DEVICE_STRICT", None) if _is_notebook(item) and item.path.name in NOT_STRICT \
        else None
    try:
        yield
    finally:
        if strict is not None:
            os.environ["LAB_DEVICE_STRICT"] = strict


def _is_full(item) -> bool:
    return item.get_closest_marker("full") is not None or (_is_notebook(item) and item.path.name not in FAST_NOTEBOOKS)


@pytest.hookimpl(tryfirst=True)  # before -m filters: `pytest --full -m full` selects the full tier alone
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _is_full(item) and item.get_closest_marker("full") is None:
            item.add_marker(pytest.mark.full)
    if config.getoption("--full"):
        return
    fast = [item for item in items if not _is_full(item)]
    deselected = [item for item in items if _is_full(item)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = fast
