"""Run a worker function on N ranks, from a notebook or under torchrun.

`run(worker, ...)` spawns one process per rank, gives each a free 127.0.0.1 port, the rig's backend, one intra-op
thread on CPU (a virtual device) or one GPU on CUDA, and returns each rank's return value. A rank that raises
brings its traceback back; a rank that hangs is named after `timeout`; no child outlives the call.

The same worker runs under torchrun unchanged: `torchrun --nproc-per-node 2 -m helpers.runtime.launch helpers.parallel:ddp_worker`.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from helpers.runtime.rig import Rig, detect_rig

DEFAULT_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """A rank raised; the message carries the rank's own exception and traceback."""


class WorkerTimeout(TimeoutError):
    """Some ranks did not finish in time; the message names them."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_importable(fn: Callable) -> None:
    """Spawned processes import the worker by name: refuse functions they cannot find, and say why."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", repr(fn))
    where = f"`{qualname}` (module {module})"
    if module in (None, "__main__", "__mp_main__") or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"worker {where} is defined in the notebook or inside another function; spawned processes start "
            "fresh and can only run functions they can import. Move it into a module of helpers/ (or any .py "
            "file on the path) and import it from there.")
    try:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker {where} cannot be imported by a fresh process: {exc}") from None


def check_ranks(rig: Rig, nranks: int, oversubscribe: bool) -> None:
    """Refuse more ranks than the rig hosts, before anything starts."""
    if nranks < 1:
        raise ValueError(f"nranks must be at least 1, got {nranks}")
    if nranks > rig.max_ranks and not oversubscribe:
        what = f"{rig.max_ranks} cores" if rig.is_cpu else f"room for {rig.max_ranks} rank(s)"
        raise ValueError(
            f"{nranks} ranks asked for, but this {rig.kind} rig has {what}. Use fewer ranks, or pass "
            f"oversubscribe=True to share them (the result is still correct, timings then mean little).")


def rank_device(rig: Rig | None = None) -> torch.device:
    """The device of the calling rank: its GPU on CUDA rigs, the CPU on the CPU rig."""
    rig = rig or detect_rig()
    if rig.is_cpu:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(f"cuda:{local % torch.cuda.device_count()}")


def _die_with_parent() -> None:
    """Linux: the kernel kills this child if the notebook kernel dies, so no rank is ever orphaned."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def init_rank(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Rig:
    """Join the process group from torchrun-style env vars; pin CPU ranks to one thread, CUDA ranks to one GPU."""
    rig = detect_rig()
    if rig.is_cpu:
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(rank_device(rig))
    if not dist.is_initialized():
        dist.init_process_group(backend or rig.backend, timeout=timedelta(seconds=timeout_s))
    return rig


def _child(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, kwargs: dict,
           conn: mpc.Connection, timeout_s: float) -> None:
    _die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    code = 0
    try:
        init_rank(backend, timeout_s)
        # plain pickle: torch's multiprocessing reducers would share tensors through this process, which exits
        conn.send_bytes(pickle.dumps((rank, "ok", fn(*args, **kwargs))))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the notebook
        code = 1
        conn.send_bytes(pickle.dumps((rank, "error", f"{type(exc).__name__}: {exc}\n\n{traceback.format_exc()}")))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown: FSDP2 workers otherwise abort there now and then


def _stop_all(procs: list[mp.process.BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _collect(procs: list, conns: list, timeout_s: float) -> list[Any]:
    """Wait for every rank's pipe. A rank that dies closes its pipe (EOF), so a crash is noticed at once."""
    results: dict[int, Any] = {}
    pending = {c: r for r, c in enumerate(conns)}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise WorkerTimeout(
                f"rank(s) {sorted(pending.values())} did not finish within {timeout_s:.0f} s (finished: "
                f"{sorted(results)}). A rank that waits for a message or collective its peer never sends hangs "
                "like this.")
        for conn in mpc.wait(list(pending), left):
            rank = pending.pop(conn)
            try:
                _, status, payload = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(5)
                raise WorkerError(f"rank {rank} exited with code {procs[rank].exitcode} without a result "
                                  "(killed, out of memory, or crashed in native code)") from None
            if status == "error":
                raise WorkerError(f"rank {rank} raised {payload}")
            results[rank] = payload
    return [results[r] for r in range(len(conns))]


def run(fn: Callable, *args: Any, nranks: int = 2, timeout: float = DEFAULT_TIMEOUT_S, rig: Rig | None = None,
        oversubscribe: bool = False, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nranks` processes; return the list of their return values, rank order."""
    rig = rig or detect_rig()
    check_ranks(rig, nranks, oversubscribe)
    check_importable(fn)
    try:
        pickle.dumps((fn, args, kwargs))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the worker's arguments cannot be sent to another process: {exc}") from None
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, conns = [], []
    try:
        for rank in range(nranks):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(rank, nranks, port, rig.backend, fn, args, kwargs, child_end,
                                                 timeout), daemon=True, name=f"lab-rank{rank}")
            p.start()
            child_end.close()
            procs.append(p)
            conns.append(parent_end)
        return _collect(procs, conns, timeout)
    finally:  # success, error, timeout or KeyboardInterrupt: no child survives
        _stop_all(procs)
        for c in conns:
            c.close()


def _resolve(target: str) -> Callable:
    module, _, name = target.partition(":")
    if not name:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: every rank calls the worker with the same JSON-free string arguments."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", help="worker as MODULE:FUNCTION, e.g. helpers.parallel:ddp_worker")
    parser.add_argument("args", nargs="*", help="positional string arguments for the worker")
    ns = parser.parse_args(argv)
    fn = _resolve(ns.target)
    init_rank()
    try:
        result = fn(*ns.args)
        if dist.get_rank() == 0:
            print(result)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
