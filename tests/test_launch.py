import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers.runtime import workers
from helpers.runtime.bootstrap import NO_DEATH_SIGNAL_ENV
from helpers.runtime.launch import GRACE_S, WorkerError, WorkerTimeout, check_importable, ranks_peak_rss, run, run_command
from helpers.runtime.rig import cpu_rig
from tests import workers as bad

REPO = Path(__file__).resolve().parent.parent


def _children_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split()[2] != "Z":
                    alive.append(pid)
        except (ProcessLookupError, FileNotFoundError):
            pass
    return alive


def _spawned_children():
    me = os.getpid()
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().split()
                with open(f"/proc/{d}/cmdline") as f:
                    cmd = f.read()
                if int(fields[3]) == me and fields[2] != "Z" and "resource_tracker" not in cmd:
                    out.append(int(d))
            except (FileNotFoundError, ProcessLookupError):
                pass
    return out


def test_results_come_back_in_rank_order():
    out = run(workers.whoami, rig=cpu_rig())
    assert [r["rank"] for r in out] == [0, 1]
    assert all(r["world"] == 2 and r["backend"] == "gloo" and r["threads"] == 1 for r in out)
    assert run(workers.all_reduce_sum, 2.0, rig=cpu_rig()) == [6.0, 6.0]


@pytest.mark.full  # a launcher fault test
def test_rank_exception_reaches_caller_with_traceback():
    with pytest.raises(WorkerError) as info:
        run(bad.fail_on_rank_one, "the message from rank one", timeout=60, rig=cpu_rig())
    text = str(info.value)
    assert "rank 1 raised ValueError: the message from rank one" in text
    assert "Traceback" in text and "fail_on_rank_one" in text
    assert _spawned_children() == []


@pytest.mark.full  # a launcher fault test
def test_hanging_rank_is_named_and_killed():
    with pytest.raises(WorkerTimeout, match=r"rank\(s\) \[1\] did not finish within 20 s"):
        run(bad.hang_on_rank_one, timeout=20, rig=cpu_rig())  # room for a slow start on a busy machine
    assert _spawned_children() == []


@pytest.mark.full  # a launcher fault test
def test_rank_that_dies_is_reported():
    with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
        run(bad.exit_hard_on_rank_one, timeout=60, rig=cpu_rig())
    assert _spawned_children() == []


@pytest.mark.full  # a launcher fault test
def test_a_native_crash_comes_back_with_the_python_stack_it_happened_in():
    with pytest.raises(WorkerError) as info:
        run(bad.crash_in_native_code_on_rank_one, timeout=60, rig=cpu_rig())
    text = str(info.value)
    assert f"rank 1 was killed by signal {int(signal.SIGSEGV)}" in text
    assert "Segmentation fault" in text and "crash_in_native_code_on_rank_one" in text  # faulthandler's stack
    assert _spawned_children() == []


@pytest.mark.full  # a launcher fault test
def test_no_children_after_success():
    pids = run(bad.pid_then_sleep, 0.1, rig=cpu_rig())
    assert _children_alive(pids) == []


def test_ranks_peak_rss_is_the_largest_finished_child():
    """A child that touched 300 MiB peaked at least there (VmHWM), in bytes, once it has ended (notebook 13)."""
    subprocess.run([sys.executable, "-c", "b = b'x' * (300 * 2**20)"], check=True)
    assert ranks_peak_rss() >= 300 * 2**20


def test_notebook_function_is_refused_before_spawning():
    def local_worker():
        return 1

    with pytest.raises(ValueError, match="Move it into a module"):
        check_importable(local_worker)
    with pytest.raises(ValueError, match="Move it into a module"):
        run(lambda: 1, rig=cpu_rig())


def test_too_many_ranks_is_refused():
    rig = cpu_rig()
    with pytest.raises(ValueError, match=f"{rig.max_ranks + 1} ranks asked for"):
        run(workers.whoami, nranks=rig.max_ranks + 1, rig=rig)


def test_unpicklable_argument_is_refused():
    with pytest.raises(ValueError, match="cannot be sent"):
        run(workers.all_reduce_sum, (x for x in range(3)), rig=cpu_rig())


@pytest.fixture
def ctrl_c_raises():
    """Ctrl-C raises KeyboardInterrupt here, as in a notebook kernel, even when the test run was started in the
    background, where the shell makes processes ignore SIGINT."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.full  # a launcher fault test
def test_keyboard_interrupt_leaves_no_children(ctrl_c_raises):
    import threading

    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        run(bad.hang_on_rank_one, timeout=60, rig=cpu_rig())
    assert _spawned_children() == []


# --- faults a caller can meet (issue: engine core, launcher) -------------------------------------------------------

def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (every rank inherits its caller's environment)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read()
            with open(f"/proc/{d}/stat") as f:
                state = f.read().split()[2]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if marker.encode() in env and state != "Z" and int(d) != os.getpid():
            found.append(int(d))
    return found


def _start_caller(mode: str, marker: str, tmp: Path, extra_env: dict | None = None) -> subprocess.Popen:
    """A caller that starts ranks; its temp folders go to `tmp` (it is killed: it cannot remove its own)."""
    env = dict(os.environ, LAB_TEST_MARKER=marker, TMPDIR=str(tmp), **(extra_env or {}))
    caller = subprocess.Popen([sys.executable, "-m", "tests.orphan_caller", mode], env=env, stdout=subprocess.PIPE,
                              cwd=REPO)
    assert caller.stdout.readline().strip() == b"READY"
    return caller


def _wait_gone(marker: str, seconds: float = 10.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        left = _processes_with(marker)
        if not left:
            return []
        time.sleep(0.1)
    return _processes_with(marker)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.full  # a launcher fault test
@pytest.mark.parametrize("death_signal", [True, False], ids=["death-signal", "lifeline-only"])
@pytest.mark.parametrize("delay", [0.0, 0.3, 1.0, 3.0])
def test_no_rank_outlives_a_killed_caller(delay, death_signal, tmp_path):
    """SIGKILL the caller at several moments after it starts its ranks (before, during and after they import
    torch): no rank may survive. Without the Linux death signal the lifeline pipe alone must do it (macOS)."""
    marker = f"orphan-{uuid.uuid4().hex}"
    extra = {} if death_signal else {NO_DEATH_SIGNAL_ENV: "1"}
    caller = _start_caller("sleepy", marker, tmp_path, extra)
    time.sleep(delay)
    caller.kill()
    caller.wait()
    assert _wait_gone(marker) == [], f"ranks outlived their caller (killed {delay} s after start)"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.full  # a launcher fault test
def test_second_interrupt_during_cleanup_still_ends_everything(tmp_path):
    """Ranks that ignore SIGTERM; Ctrl-C, then Ctrl-C again during the grace period: the caller ends promptly and
    takes every rank with it."""
    marker = f"stubborn-{uuid.uuid4().hex}"
    caller = _start_caller("stubborn", marker, tmp_path)
    deadline = time.monotonic() + 30
    while len(_processes_with(marker)) < 3 and time.monotonic() < deadline:  # the caller and both ranks
        time.sleep(0.1)
    time.sleep(1.0)
    caller.send_signal(signal.SIGINT)
    time.sleep(0.5)
    caller.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    try:
        caller.wait(timeout=20)
    finally:
        caller.kill()  # a failure here must not leave the caller behind for the next tests
    assert time.monotonic() - t0 < GRACE_S, "the second Ctrl-C must not wait out the grace period"
    assert _wait_gone(marker) == []


@pytest.mark.full  # a launcher fault test
def test_result_the_caller_cannot_read_names_the_rank():
    with pytest.raises(WorkerError, match="rank 0 returned a result the caller cannot read"):
        run(bad.return_unreadable, rig=cpu_rig(), timeout=60)
    with pytest.raises(WorkerError, match="return value cannot be sent back"):
        run(bad.return_unpicklable, rig=cpu_rig(), timeout=60)
    assert _spawned_children() == []


@pytest.mark.full  # a launcher fault test
def test_import_error_inside_a_rank_comes_back_with_its_traceback():
    from tests import fragile_module

    with pytest.raises(WorkerError) as info:
        run(fragile_module.worker, rig=cpu_rig(), timeout=60)
    text = str(info.value)
    assert "ImportError: this module refuses to load inside a rank" in text and "Traceback" in text


def test_every_rank_gets_the_callers_rig():
    rig = cpu_rig(budget_gib=0.75, threads=1)
    out = run(bad.child_rig, rig=rig, timeout=60)
    assert out == [{"kind": "cpu", "budget": rig.capacity_bytes[0], "threads": 1}] * 2


@pytest.mark.full  # a launcher fault test
def test_torchrun_entry_takes_json_arguments(tmp_path):
    """The docstring's example, as written."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "helpers.runtime.launch",
           "helpers.runtime.workers:all_reduce_sum", "--args", "[2.0]"]
    proc = run_command(cmd, timeout_s=120, cwd=REPO,
                       env=dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1", TMPDIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "6.0"


@pytest.mark.full  # a launcher fault test
def test_a_hung_torchrun_rank_is_stopped_with_what_it_printed(tmp_path):
    """torchrun starts each worker in a session of its own: killing torchrun alone (subprocess.run's timeout) left the
    doctor's hung train_ddp.py rank running forever. run_command stops torchrun, torchrun stops its workers."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "helpers.runtime.launch",
           "tests.workers:hang_on_rank_one"]
    marker = f"hung-torchrun-{uuid.uuid4().hex}"  # this run's processes only, not another test's
    with pytest.raises(subprocess.TimeoutExpired) as hung:
        run_command(cmd, timeout_s=20, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1", LAB_FORCE_CPU="1",
                                                          TMPDIR=str(tmp_path), LAB_TEST_MARKER=marker))
    assert "shutting down workers" in hung.value.stderr
    # torchrun stops its workers as it exits (within about a second here): polled for 30 s, not slept on for 1
    assert _wait_gone(marker, seconds=30.0) == []


def test_native_windows_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(RuntimeError, match="run the course inside WSL2"):
        run(workers.whoami, rig=cpu_rig())
    assert _spawned_children() == []
