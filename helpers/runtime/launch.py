"""Run a worker function on N ranks, from a notebook or under torchrun.

`run(worker, *args, nranks=2)` starts one process per rank, gives each a free 127.0.0.1 port, the caller's rig
(force-CPU included), one intra-op thread per CPU virtual device or its own GPU, and returns each rank's return
value in rank order. A rank that raises, fails to import the worker, or returns something that cannot come back
raises `WorkerError` naming the rank, with its traceback; a rank that hangs raises `WorkerTimeout` naming it; a
rank that dies in native code brings back the end of its stderr. No rank outlives the call, nor the caller: see
`helpers.runtime.bootstrap` for how a rank ties its life to the caller's before it imports torch. While a memory
panel watches (`helpers.monitor.MemoryMonitor(rig, ranks=True)`), each rank also reports what it holds as it runs
(`helpers.runtime.live`); otherwise ranks do not report at all.

The same worker runs under torchrun, with JSON arguments:
    torchrun --nproc-per-node 2 -m helpers.runtime.launch helpers.runtime.workers:all_reduce_sum --args '[2.0]'
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pickle
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from helpers.runtime import live
from helpers.runtime.rig import CPU_BUDGET_ENV, FORCE_CPU_ENV, Rig, claim_cpu_device, detect_rig, pin_to_device_cores
from helpers.runtime.strict import enter_device_strict_mode, strict_backend, strict_requested

DEFAULT_TIMEOUT_S = 120.0
GRACE_S = 5.0  # how long a rank may take to exit after SIGTERM before it is killed
STDERR_TAIL = 3000  # characters of a crashed rank's stderr shown in the error


class WorkerError(RuntimeError):
    """A rank failed; the message names the rank and carries its own exception and traceback."""


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
        _import(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"worker {where} cannot be imported by a fresh process: {exc}") from None


def check_system() -> None:
    """Refuse native Windows before anything starts: PyTorch's distributed backends there lack what the engines use
    (NCCL is absent, gloo's Windows build is limited), and a rank is started with an inherited pipe, which Windows
    cannot pass. WSL2 is Linux, and works."""
    if sys.platform == "win32":
        raise RuntimeError("multi-process runs need Linux or macOS: on Windows, run the course inside WSL2 (see "
                           "README, 'Supported systems'); the in-process engines (threads) work everywhere")


def check_ranks(rig: Rig, nranks: int, oversubscribe: bool) -> None:
    """Refuse more ranks than the rig hosts, before anything starts."""
    if nranks < 1:
        raise ValueError(f"nranks must be at least 1, got {nranks}")
    if nranks <= rig.max_ranks:
        return
    if rig.is_cpu and oversubscribe:
        return
    if rig.is_cpu:
        raise ValueError(
            f"{nranks} ranks asked for, but this CPU rig has room for {rig.max_ranks} virtual devices. Use fewer "
            "ranks, or pass oversubscribe=True to let ranks share cores (results stay exact; timings then mean "
            "little).")
    raise ValueError(
        f"{nranks} ranks asked for, but this {rig.kind} rig has room for {rig.max_ranks}: on GPUs each rank needs "
        "a GPU of its own (NCCL refuses two ranks on one GPU). Use fewer ranks, or the CPU rig (LAB_FORCE_CPU=1) "
        "with oversubscribe=True to try the structure.")


def rank_device(rig: Rig | None = None) -> torch.device:
    """The device of the calling rank: its own GPU on the two-GPU rig, cuda:0 on the one-GPU rig, CPU otherwise."""
    rig = rig or detect_rig()
    if rig.is_cpu:
        return torch.device("cpu")
    if rig.kind == "one_gpu":
        return torch.device("cuda:0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local >= count:
        raise RuntimeError(f"local rank {local} has no GPU of its own: this machine shows {count} GPU(s) "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); NCCL "
                           "cannot put two ranks on one GPU. Start at most one rank per GPU.")
    return torch.device(f"cuda:{local}")


def init_rank(rig: Rig | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> Rig:
    """Join the process group from torchrun-style env vars, the way PyTorch's own engines expect it: CPU ranks
    pinned to their threads; CUDA ranks bound to their GPU *before* init, and NCCL given `device_id` so that its
    communicator is created now, on every rank together, not lazily on a first send that could wait forever."""
    rig = rig or detect_rig()
    device = rank_device(rig)
    backend = rig.backend
    if rig.is_cpu:
        claim_cpu_device(rig)
        if strict_requested():  # CI: fail here as NCCL would fail on GPUs (helpers.runtime.strict)
            enter_device_strict_mode()
            backend = strict_backend(device, backend)
    else:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        eager = {"device_id": device} if rig.backend == "nccl" else {}
        join_group(backend, timedelta(seconds=timeout_s), **eager)
    local = [os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")]
    if rig.is_cpu and all(local):  # after joining: the group's threads, started meanwhile, stay free to move
        pin_to_device_cores(int(local[0]), int(local[1]), rig.threads_per_device)
    return rig


def join_group(backend: str, timeout: timedelta | None = None, **kwargs: Any) -> None:
    """`dist.init_process_group(backend)` from torchrun-style env vars; under torchrun's elastic agent, on a store of
    this start of the workers alone (`round_store`), so that workers restarted by `--max-restarts` never read what the
    workers before them wrote. `kwargs`: init_process_group's (NCCL's `device_id`)."""
    options: dict[str, Any] = {"timeout": timeout} if timeout else {}
    store = round_store(timeout or default_pg_timeout)
    if store is not None:
        options.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    dist.init_process_group(backend, **options, **kwargs)


ROUND_KEYS = "lab-round"  # the agent store's keys of the workers' handshake (`round_store`)


def round_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's elastic agent (TORCHELASTIC_USE_AGENT_STORE=True), the agent's store seen through a prefix
    that this start of the workers alone uses; None otherwise (env:// as usual: the course's launcher gives every
    start a fresh port, and rank 0 hosts the store).

    Why: PyTorch's c10d rendezvous shares one TCPStore, created by the agent at its first rendezvous, with every
    start of the workers, and `torch.distributed.rendezvous` hands workers that store without a per-attempt prefix
    (its comment still says a new store is made for every retry; torch 2.13's `DynamicRendezvousHandler` makes it
    once). A restarted worker then finds its peers' addresses of the previous start still there: gloo's
    connectFullMesh reads the killed worker's address and fails with "Connection refused" (NCCL reads the previous
    unique id the same way). pytorch/pytorch#135712 (fixed then by a store per retry) and #167288 (open, the same
    symptom with NCCL). TORCHELASTIC_RESTART_COUNT cannot name the start: each agent counts its own restarts, and an
    agent that restarts healthy workers because another node rejoined does not count it (#135712, #108158). So the
    workers agree on a fresh token: rank 0 draws it and answers each rank's fresh random hello with it until that
    rank acknowledges this token; nothing a previous start left can match either side's fresh value."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    token = _agree_on_token(store, rank, world, time.monotonic() + timeout.total_seconds())
    return dist.PrefixStore(f"{ROUND_KEYS}/{token}", store)


def _agree_on_token(store: dist.Store, rank: int, world: int, deadline: float) -> str:
    """The token rank 0 drew for this start of the workers (`round_store`), on every rank."""
    def value(key: str) -> str | None:
        key = f"{ROUND_KEYS}/{key}"
        return store.get(key).decode() if store.check([key]) else None

    def wait_a_little(what: str) -> None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: no answer from {what} on torchrun's store (MASTER_ADDR:MASTER_PORT)")
        time.sleep(0.01)

    fresh = secrets.token_hex(8)
    if rank != 0:
        store.set(f"{ROUND_KEYS}/hello/{rank}", fresh)
        while not (reply := value(f"reply/{rank}") or "").startswith(fresh + ":"):
            wait_a_little("rank 0")
        token = reply.split(":", 1)[1]
        store.set(f"{ROUND_KEYS}/ack/{rank}", token)
        return token
    waiting = set(range(1, world))
    while waiting:
        for peer in sorted(waiting):
            hello = value(f"hello/{peer}")
            if hello is not None:
                store.set(f"{ROUND_KEYS}/reply/{peer}", f"{hello}:{fresh}")
            if value(f"ack/{peer}") == fresh:
                waiting.discard(peer)
        if waiting:
            wait_a_little(f"rank(s) {sorted(waiting)}")
    return fresh


def run_rank(fn: Callable, args: tuple, kwargs: dict, rig: Rig, timeout_s: float, live_folder: str | None = None
             ) -> Any:
    """Inside a spawned rank (called by the bootstrap): join the group with the caller's rig, run the worker (while a
    memory panel watches, reporting to it: `helpers.runtime.live`). The group is left standing: the bootstrap reports
    the result first and then calls `finish_rank`, so that a rank's own error reaches the caller before its peers
    fail on the torn-down group."""
    init_rank(rig, timeout_s)
    with live.reporting(live_folder, dist.get_rank(), rank_device(rig)):
        return fn(*args, **kwargs)


def finish_rank() -> None:
    """Leave the process group (a spawned rank's last step before `os._exit`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class _Rank:
    """A started rank: its process, the pipe its result comes back on, and the files its output goes to."""

    rank: int
    proc: subprocess.Popen
    conn: Connection
    stdout: Path
    stderr: Path

    def output(self, path: Path) -> str:
        try:
            return path.read_text(errors="replace")
        except OSError:
            return ""


def _child_env(rig: Rig, rank: int, world: int, port: int, attempt: int = 0) -> dict[str, str]:
    """The caller's environment, plus the rendezvous, the caller's rig (so a rank never re-detects it) and the
    restart count."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
               LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), PYTHONUNBUFFERED="1",
               LAB_RESTART_COUNT=str(attempt))
    if rig.is_cpu:
        env.update({FORCE_CPU_ENV: "1", CPU_BUDGET_ENV: str(rig.capacity_bytes[0] / 2**30),
                    "OMP_NUM_THREADS": str(rig.threads_per_device)})
    # every rank is on this machine: gloo talks over loopback (left to itself it resolves the hostname, which fails
    # on some laptops, e.g. a Mac with an unresolvable .local name)
    env.setdefault("GLOO_SOCKET_IFNAME", "lo0" if sys.platform == "darwin" else "lo")
    return env


def _start(rank: int, world: int, port: int, rig: Rig, payload: Path, lifeline_r: int, workdir: Path,
           attempt: int = 0) -> _Rank:
    result_r, result_w = os.pipe()
    out, err = workdir / f"rank{rank}.out", workdir / f"rank{rank}.err"
    cmd = [sys.executable, "-m", "helpers.runtime.bootstrap", "--parent", str(os.getpid()),
           "--lifeline", str(lifeline_r), "--result", str(result_w), "--payload", str(payload), "--rank", str(rank)]
    try:
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(cmd, env=_child_env(rig, rank, world, port, attempt), stdin=subprocess.DEVNULL,
                                    stdout=fo, stderr=fe, pass_fds=(lifeline_r, result_w), close_fds=True,
                                    start_new_session=True)  # Ctrl-C in a terminal reaches only the caller
    finally:
        os.close(result_w)
    return _Rank(rank, proc, Connection(result_r, writable=False), out, err)


def _crash_message(r: _Rank) -> str:
    code = r.proc.wait()
    tail = r.output(r.stderr)[-STDERR_TAIL:].strip()
    how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
    return (f"rank {r.rank} {how} without a result (killed, out of memory, or crashed in native code)"
            + (f"; the end of its stderr:\n{tail}" if tail else ""))


def _receive(r: _Rank) -> tuple[bool, Any]:
    """(True, result) or (False, the error message naming the rank)."""
    try:
        data = r.conn.recv_bytes()
    except EOFError:
        return False, _crash_message(r)
    try:
        _, status, payload = pickle.loads(data)
    except Exception as exc:  # noqa: BLE001 - e.g. a class the caller cannot import
        return False, f"rank {r.rank} returned a result the caller cannot read: {type(exc).__name__}: {exc}"
    if status == "error":
        return False, f"rank {r.rank} raised {payload}"
    return True, payload


def _first_line(message: str) -> str:
    return message.splitlines()[0][:300] if message else ""


def _collect(ranks: list[_Rank], timeout_s: float, settle_s: float = 1.0) -> list[Any]:
    """Wait for every rank's pipe. A rank that dies closes its pipe (end of file), so a crash is noticed at once.
    After the first failure the others get `settle_s` to report: the first failure is the cause, the rest (peers
    losing their connection) are listed after it."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    pending = {r.conn: r for r in ranks}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if errors:
            left = min(left, settle_s)
        if left <= 0:
            break
        ready = wait(list(pending), left)
        if not ready and errors:
            break
        for conn in ready:
            r = pending.pop(conn)
            ok, value = _receive(r)
            if ok:
                results[r.rank] = value
            else:
                errors.append(value)
    if errors:
        others = "".join(f"\n  then {_first_line(e)}" for e in errors[1:])
        raise WorkerError(errors[0] + (f"\n\nOther ranks failed after it:{others}" if others else ""))
    if pending:
        raise WorkerTimeout(
            f"rank(s) {sorted(r.rank for r in pending.values())} did not finish within {timeout_s:.0f} s "
            f"(finished: {sorted(results)}). A rank that waits for a message or collective its peer never "
            "sends hangs like this.")
    return [results[r.rank] for r in ranks]


def _signal_all(ranks: list[_Rank], sig: int) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            try:
                os.killpg(r.proc.pid, sig)  # the rank's whole session: anything it started goes too
            except (ProcessLookupError, PermissionError):
                pass


def stop_all(ranks: list[_Rank], grace_s: float = GRACE_S) -> None:
    """SIGTERM every rank, SIGKILL what is left after `grace_s`. A Ctrl-C during the grace kills at once instead of
    interrupting the clean-up (which would leave ranks behind); the interrupt is raised again once all are gone."""
    interrupted: BaseException | None = None
    hurry = threading.Event()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, lambda *_: hurry.set())
    try:
        _signal_all(ranks, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(r.proc.poll() is None for r in ranks):
            try:
                if hurry.is_set() or time.monotonic() > deadline:
                    _signal_all(ranks, signal.SIGKILL)
                time.sleep(0.02)
            except KeyboardInterrupt as exc:  # run() called off the main thread: no handler of ours
                interrupted = exc
                hurry.set()
        for r in ranks:
            r.proc.wait()
            r.conn.close()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if interrupted is not None or hurry.is_set():
        raise interrupted or KeyboardInterrupt()


def _relay_output(ranks: list[_Rank]) -> None:
    """What the ranks printed, shown where the caller prints (in a notebook: under the cell)."""
    for r in ranks:
        text = r.output(r.stdout).strip()
        if text:
            print("\n".join(f"[rank {r.rank}] {line}" for line in text.splitlines()))


def release_cached_gpu_memory(rig: Rig) -> None:
    """Give the GPU memory this process's caching allocator keeps for later tensors back to the driver, so the ranks
    about to start on the same GPUs can use it (without this a notebook would hold its largest step's memory while
    its ranks run; helpers.gpu_sizes plans with it released). CUDA is not touched on the CPU rig, nor initialised
    here on a GPU rig."""
    if rig.is_cuda and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def run(fn: Callable, *args: Any, nranks: int = 2, timeout: float = DEFAULT_TIMEOUT_S, rig: Rig | None = None,
        oversubscribe: bool = False, restarts: int = 0, **kwargs: Any) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nranks` processes; return the list of their return values, rank order.
    `restarts`: when a rank dies or fails, stop them all and start every rank again, up to this many times (torchrun's
    --max-restarts; each attempt sees LAB_RESTART_COUNT, as torchrun's workers see TORCHELASTIC_RESTART_COUNT): a
    worker that resumes from its latest checkpoint then finishes the run."""
    check_system()
    rig = rig or detect_rig()
    check_ranks(rig, nranks, oversubscribe)
    check_importable(fn)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if not isinstance(restarts, int) or restarts < 0:
        raise ValueError(f"restarts must be a whole number >= 0, got {restarts!r}")
    try:
        body = pickle.dumps((fn, args, kwargs, rig))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"the worker's arguments cannot be sent to another process: {exc}") from None
    release_cached_gpu_memory(rig)
    for attempt in range(restarts + 1):
        try:
            return _run_once(body, nranks, timeout, rig, attempt)
        except WorkerError as exc:
            if attempt == restarts:
                raise
            print(f"restarting every rank ({attempt + 1} of {restarts}) after: {_first_line(str(exc))}", flush=True)
    raise AssertionError("unreachable")


def _run_once(body: bytes, nranks: int, timeout: float, rig: Rig, attempt: int) -> list[Any]:
    """One start of every rank (`run`); `attempt` counts the restarts before it."""
    port = free_port()
    ranks: list[_Rank] = []
    lifeline_r, lifeline_w = os.pipe()
    live_folder = live.new_run(nranks)  # None unless a memory panel watches
    with tempfile.TemporaryDirectory(prefix="lab-run-") as tmp:
        workdir = Path(tmp)
        payload = workdir / "payload.pkl"
        payload.write_bytes(pickle.dumps({"sys_path": list(sys.path), "body": body, "timeout_s": timeout,
                                          "live": live_folder}))
        try:
            for rank in range(nranks):
                ranks.append(_start(rank, nranks, port, rig, payload, lifeline_r, workdir, attempt))
            os.close(lifeline_r)
            lifeline_r = -1
            results = _collect(ranks, timeout)
            _relay_output(ranks)
            return results
        finally:  # success, error, timeout or Ctrl-C: no rank survives
            stop_all(ranks)
            live.end_run(live_folder)
            for fd in (lifeline_r, lifeline_w):
                if fd >= 0:
                    os.close(fd)


# --- torchrun ------------------------------------------------------------------------------------------------------

def ranks_peak_rss() -> int:
    """The largest peak resident memory, in bytes, of any rank (any child process) this process started and that has
    ended: each one's VmHWM, as getrusage(RUSAGE_CHILDREN) keeps the largest (Linux counts KiB, macOS bytes). What a
    rank's host RAM must fit in, measured after the run: a rank reports its device memory live, not its host RAM."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def release_host_memory() -> None:
    """Hand the memory freed by the layer just loaded back to the operating system (glibc's `malloc_trim`): the
    allocator otherwise keeps freed blocks of a layer's temporaries (NF4 quantization's, above all) in its heap, and
    a rank's resident memory grows layer after layer although nothing is alive (seen on the CPU rig: 10 to 45 MB more
    per small layer). Elsewhere than glibc, nothing."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def run_command(cmd: list[str], timeout_s: float, grace_s: float = 30.0, **popen: Any
                ) -> subprocess.CompletedProcess:
    """Run a command that starts ranks (torchrun and its workers), capturing its output. Past `timeout_s`, or if the
    caller is interrupted, it gets SIGTERM, on which torchrun stops its workers (each in a session of its own, out of
    reach of a group kill); what is left after `grace_s` is killed. `subprocess.run` would SIGKILL torchrun alone and
    leave a hung rank running forever. A timeout raises `subprocess.TimeoutExpired` carrying what the command
    printed, so the report says where it stopped."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **popen) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException as exc:
            proc.terminate()
            try:
                out, err = proc.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(cmd, timeout_s, out, err) from None
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _import(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def main(argv: list[str] | None = None) -> None:
    """torchrun entry point: every rank calls the worker with the same JSON-typed arguments; rank 0 prints the
    result as JSON (or its repr when it is not JSON)."""
    parser = argparse.ArgumentParser(prog="python -m helpers.runtime.launch",
                                     description="Run MODULE:FUNCTION on every rank torchrun started.")
    parser.add_argument("target", help="worker as MODULE:FUNCTION, e.g. helpers.runtime.workers:all_reduce_sum")
    parser.add_argument("--args", default="[]", help="JSON list of positional arguments, e.g. '[2.0]'")
    parser.add_argument("--kwargs", default="{}", help='JSON object of keyword arguments, e.g. \'{"n": 4}\'')
    ns = parser.parse_args(argv)
    args, kwargs = json.loads(ns.args), json.loads(ns.kwargs)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise SystemExit("--args must be a JSON list and --kwargs a JSON object")
    module, _, name = ns.target.partition(":")
    if not name:
        raise SystemExit(f"expected MODULE:FUNCTION, got {ns.target!r}")
    fn = _import(module, name)
    init_rank()
    try:
        result = fn(*args, **kwargs)
        if dist.get_rank() == 0:
            try:
                print(json.dumps(result))
            except TypeError:
                print(repr(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
