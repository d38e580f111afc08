import os

import pytest

from helpers.runtime import workers
from helpers.runtime.launch import WorkerError, WorkerTimeout, check_importable, run
from helpers.runtime.rig import cpu_rig
from tests import workers as bad


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


def test_rank_exception_reaches_caller_with_traceback():
    with pytest.raises(WorkerError) as info:
        run(bad.fail_on_rank_one, "the message from rank one", timeout=60, rig=cpu_rig())
    text = str(info.value)
    assert "rank 1 raised ValueError: the message from rank one" in text
    assert "Traceback" in text and "fail_on_rank_one" in text
    assert _spawned_children() == []


def test_hanging_rank_is_named_and_killed():
    with pytest.raises(WorkerTimeout, match=r"rank\(s\) \[1\] did not finish within 5 s"):
        run(bad.hang_on_rank_one, timeout=5, rig=cpu_rig())
    assert _spawned_children() == []


def test_rank_that_dies_is_reported():
    with pytest.raises(WorkerError, match="rank 1 exited with code 3"):
        run(bad.exit_hard_on_rank_one, timeout=60, rig=cpu_rig())
    assert _spawned_children() == []


def test_no_children_after_success():
    pids = run(bad.pid_then_sleep, 0.1, rig=cpu_rig())
    assert _children_alive(pids) == []


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


def test_keyboard_interrupt_leaves_no_children():
    import signal
    import threading

    threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        run(bad.hang_on_rank_one, timeout=60, rig=cpu_rig())
    assert _spawned_children() == []
