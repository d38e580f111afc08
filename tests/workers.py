"""Workers that misbehave on purpose, for the launcher tests."""
import os
import signal
import time

import torch.distributed as dist


def fail_on_rank_one(message: str) -> int:
    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.barrier()  # rank 0 would wait forever: the launcher must not
    return dist.get_rank()


def regroup_after_a_restart(pause_s: float) -> int:
    """Under `torchrun --max-restarts 1`: on the first start rank 1 dies by SIGKILL once a second group is up; on the
    restart rank 0 makes that group again `pause_s` late, so rank 1 reads whatever torchrun's store holds for rank 0
    before rank 0 writes: the killed start's address, unless every start of the workers has keys of its own
    (helpers.runtime.launch.round_store). Returns the restart count."""
    restarts = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if restarts and dist.get_rank() == 0:
        time.sleep(pause_s)
    dist.barrier(group=dist.new_group(backend="gloo"))
    if not restarts and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()  # rank 0's first start fails here, and torchrun restarts both
    return restarts


def hang_on_rank_one() -> int:
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def pid_then_sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def exit_hard_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


def crash_in_native_code_on_rank_one() -> int:
    """A segmentation fault, as a bug in a C++ extension gives: Python's except clauses never see it."""
    if dist.get_rank() == 1:
        import faulthandler
        faulthandler._sigsegv()
    return dist.get_rank()


def ignore_sigterm_and_hang() -> int:
    """A rank that ignores SIGTERM: only SIGKILL ends it."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(600)
    return dist.get_rank()


def _refuse_to_load():
    raise RuntimeError("this object cannot be rebuilt in the caller")


class Unreadable:
    """Pickles fine in the rank, fails to unpickle in the caller."""

    def __reduce__(self):
        return _refuse_to_load, ()


def return_unreadable() -> Unreadable:
    return Unreadable()


def return_unpicklable():
    return lambda: None


def child_rig() -> dict:
    """What a rank detects on its own: it must agree with the rig the caller passed."""
    import torch

    from helpers.runtime.rig import detect_rig

    rig = detect_rig()
    return {"kind": rig.kind, "budget": rig.capacity_bytes[0], "threads": torch.get_num_threads()}


def collective_without_device(kind: str) -> list:
    """A tensor made without device= handed to a collective or a send: under NCCL it is a host tensor and fails."""
    import torch

    t = torch.ones(2)  # no device=: the mistake device-strict ranks must catch on CPU
    if kind == "all_reduce":
        dist.all_reduce(t)
    elif dist.get_rank() == 0:
        dist.send(t, 1)
    else:
        dist.recv(t, 0)
    return t.tolist()


def rank_defaults() -> dict:
    """Where a rank's tensors land without device=, and its process group's backend."""
    import torch

    return {"default_device": str(torch.empty(1).device), "backend": str(dist.get_backend())}


def cores_of_threads() -> dict:
    """The cores this rank's main thread may run on, and those of each of its other threads (gloo's among them;
    a thread that ended meanwhile is left out)."""
    me, others = os.getpid(), []
    for tid in os.listdir("/proc/self/task"):
        try:
            if int(tid) != me:
                others.append(sorted(os.sched_getaffinity(int(tid))))
        except OSError:
            pass
    return {"main": sorted(os.sched_getaffinity(0)), "others": others}


def tensor_parallel_shards(path: str) -> dict:
    """What a tensor-parallel rank holds after `load_sharded`: each parameter's local shape, its bytes in all, and
    its half of the first query projection."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.inference.tensor_parallel import load_sharded
    from helpers.models.hf import HFModel
    from helpers.runtime.launch import rank_device

    device = rank_device()
    hf = load_sharded(HFModel(path), init_device_mesh(device.type, (dist.get_world_size(),)), device)
    local = {n: (p.to_local() if hasattr(p, "to_local") else p) for n, p in hf.named_parameters()}
    return {"shapes": {n: tuple(t.shape) for n, t in local.items()},
            "bytes": sum(t.numel() * t.element_size() for t in local.values()),
            "q": local["model.layers.0.self_attn.q_proj.weight"].detach().cpu().clone()}


def _wait_until_shown(folder: str, rank: int, size: int, timeout_s: float = 60.0) -> None:
    """Poll `folder/rank{N}` (the largest size the panel has shown for this rank, written by the test) until it
    reaches `size`; a panel that never shows it fails the rank after `timeout_s`, far beyond a few report intervals."""
    path, deadline = os.path.join(folder, f"rank{rank}"), time.monotonic() + timeout_s
    while not (os.path.exists(path) and int(open(path).read() or 0) >= size):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the panel never showed rank {rank} at {size} bytes of activations")
        time.sleep(0.02)


def growing_ledger(steps: int, pause_s: float, die_on_rank: int | None = None, shown: str | None = None) -> int:
    """Publish a ledger to the memory panel and keep more activations alive at each step, pausing between steps so
    a panel can see every size: for `pause_s`, or, with `shown` (a folder), until the panel has shown the size;
    rank `die_on_rank` exits hard after the first step (no final report)."""
    import torch
    from torch import nn

    from helpers.sizing.ledger import ledger_for
    from helpers.runtime.launch import rank_device
    from helpers.runtime.live import publish

    device = rank_device()
    layer = nn.Linear(32, 32, device=device)
    ledger = ledger_for([layer], ["device"])
    publish(ledger, title="growing")
    x = torch.randn(16, 32, device=device, requires_grad=True)
    kept = []
    for step in range(steps):
        with ledger.track_activations("device"):
            kept.append(torch.tanh(layer(x) * (step + 1)))  # its graph keeps the saved tensors alive
        if shown is None:
            time.sleep(pause_s)
        else:
            _wait_until_shown(shown, dist.get_rank(), ledger.live_activations("device"))
        if step == 0 and dist.get_rank() == die_on_rank:
            os._exit(3)
    return ledger.live_activations("device")


def trainings_resumed_after_kills(runs: list, results: str) -> list[dict]:
    """`runs`: (TrainJob, LAB_KILL_AT or None) pairs, trained one after the other on the same ranks (what
    `helpers.training.loop.train_workers` does) with one rank killed where a run says so. Each run's result is kept
    in `results` (a folder) as soon as it is done, so the ranks the launcher restarts (`restarts=`: one per kill) skip
    the runs already done and the killed run resumes from its checkpoint: many strategies' kills and resumes, one
    process start-up per kill."""
    import pickle
    from pathlib import Path

    from helpers.training.checkpoint import KILL_ENV
    from helpers.training.loop import train_worker

    out = []
    for i, (job, kill) in enumerate(runs):
        kept = Path(results) / f"run{i}.rank{dist.get_rank()}.pkl"
        if not kept.exists():
            os.environ.pop(KILL_ENV, None)
            if kill:
                os.environ[KILL_ENV] = kill
            kept.write_bytes(pickle.dumps(train_worker(job)))
        out.append(pickle.loads(kept.read_bytes()))
    return out


def threads_after_each_job(jobs: list) -> list[int]:
    """The rank's native threads (gloo's included) after each of `jobs`, run one after the other as
    `run_trainings` runs them (Linux: /proc/self/task)."""
    from helpers.training.loop import train_worker

    counts = []
    for job in jobs:
        train_worker(job)
        counts.append(len(os.listdir("/proc/self/task")))
    return counts
