"""The first code a spawned rank runs: `python -m helpers.runtime.bootstrap ...`, started by
`helpers.runtime.launch.run`.

Standard library only, on purpose. The rank must tie its life to the caller's *before* anything slow happens
(importing torch takes a second or more): a caller killed in that window would otherwise leave a rank running
the worker to the end. So, in this order:
1. Linux: ask the kernel for SIGKILL when the parent dies (`prctl(PR_SET_PDEATHSIG)`);
2. every system: a thread blocks on a *lifeline* pipe whose write end only the caller holds; when the caller dies,
   the kernel closes it, the read returns end-of-file and the rank kills itself (macOS has no death signal);
3. check that the parent is still the caller (if it died before step 1, we were re-parented: exit at once);
4. only then read the payload (worker, arguments, the caller's rig and sys.path), import the worker and run it.
Every failure, an import error included, goes back to the caller with its traceback through the result pipe; a
crash in native code (SIGSEGV, SIGABRT) prints the Python stack of every thread to the rank's stderr.
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import faulthandler
import os
import pickle
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

PR_SET_PDEATHSIG = 1
NO_DEATH_SIGNAL_ENV = "LAB_LAUNCH_NO_DEATH_SIGNAL"  # tests: prove the lifeline alone suffices (as on macOS)


def set_death_signal() -> bool:
    """Linux: SIGKILL this process when its parent dies. Returns False where the kernel offers no such signal."""
    if not sys.platform.startswith("linux") or os.environ.get(NO_DEATH_SIGNAL_ENV) == "1":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


def _watch_lifeline(fd: int) -> None:
    """Block until the caller's end of the lifeline closes (the caller died or cleaned up), then die at once."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    os.kill(os.getpid(), signal.SIGKILL)


def tie_to_parent(parent_pid: int, lifeline_fd: int) -> None:
    """Steps 1-3 above: after this returns, no death of the caller can leave this process running."""
    set_death_signal()
    threading.Thread(target=_watch_lifeline, args=(lifeline_fd,), daemon=True, name="lifeline").start()
    if os.getppid() != parent_pid:  # the caller died before we could tie ourselves to it
        os._exit(1)


def _send(conn: Connection, rank: int, status: str, payload: object) -> None:
    try:
        data = pickle.dumps((rank, status, payload))
    except Exception as exc:  # noqa: BLE001 - an unpicklable result is the worker's error, reported as such
        data = pickle.dumps((rank, "error", f"the worker's return value cannot be sent back to the caller: "
                                            f"{type(exc).__name__}: {exc}"))
    conn.send_bytes(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of helpers.runtime.launch.run (not for direct use)")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--lifeline", type=int, required=True)
    parser.add_argument("--result", type=int, required=True)
    parser.add_argument("--payload", required=True)
    parser.add_argument("--rank", type=int, required=True)
    ns = parser.parse_args(argv)
    faulthandler.enable(all_threads=True)  # a crash in native code prints every thread's Python stack to stderr,
    tie_to_parent(ns.parent, ns.lifeline)  # whose tail the caller shows: the crash is located, not just named
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller handles Ctrl-C and stops every rank itself
    conn = Connection(ns.result, readable=False)
    code = 1
    finish = None
    try:
        with open(ns.payload, "rb") as f:
            outer = pickle.load(f)  # plain types only: sys.path first, so the worker's module can be found
        sys.path[:] = outer["sys_path"]
        fn, args, kwargs, rig = pickle.loads(outer["body"])
        from helpers.runtime.launch import finish_rank, run_rank  # torch is imported here, after the ties above

        finish = finish_rank
        _send(conn, ns.rank, "ok", run_rank(fn, args, kwargs, rig, outer["timeout_s"], outer.get("live")))
        code = 0
    except BaseException as exc:  # noqa: BLE001 - everything, import errors included, must reach the caller
        _send(conn, ns.rank, "error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")
    finally:
        conn.close()
        if finish is not None:
            finish()  # after the report: a peer failing on the torn-down group is not the cause
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: FSDP2 workers otherwise abort there now and then


if __name__ == "__main__":
    main()
