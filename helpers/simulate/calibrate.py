"""Calibrate the simulator on the rig you have: every figure it needs, measured here and now: the model's costs
(`helpers.simulate.calibrate_model`; importable from here too) and the rig's (`measure_rig`: links, collectives,
and on the CPU rig how the virtual devices share the cores, as a `RigModel`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.hardware import COLLECTIVES, COMPUTE_TASKS, FREE_LINK, Collectives, Link, SharedCores, fit_link
from helpers.measure import synchronize
from helpers.simulate.calibrate_model import (Reading, WholeModelTimer, copy_seconds_per_byte,  # noqa: F401
                                              forward_backward_seconds, measure_workload, optimizer_seconds,
                                              split_backward_overhead, spread_said, typical_slowdown,
                                              whole_model_seconds)  # model's names: here too
from helpers.simulate.workload import Workload


def thread_slowdown(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                    rounds: int = 7) -> Reading:
    """How much slower forward + backward of (`x`, `y`) runs on two threads of this process at once (each on its
    own copy of `model`) than on one alone: shared caches and memory bandwidth, and the GIL between operators.
    Timed as the bench times it beside its rows (`WholeModelTimer.slowdown`), `rounds` rounds of alone then
    together."""
    timer = WholeModelTimer(model, x, y, loss_fn)
    for _ in range(rounds):
        timer.sample(x.shape[0])
        timer.sample_together(x.shape[0])
    model.zero_grad(set_to_none=True)
    return timer.slowdown()


def broadcast_message_seconds(device: torch.device, repeats: int, nbytes: int = 4 * 2**20,
                              messages: int = 64) -> float:
    """Rank worker: what each further tensor adds to a broadcast sent tensor by tensor, as ZeroRedundancyOptimizer
    sends parameters (every broadcast issued with async_op=True, then all waited for): `nbytes` as `messages`
    tensors against `nbytes` in one, the difference per extra message. A fit over message sizes cannot give it:
    its intercept is decided by the large messages' noise (docs/bench.md, `broadcast_message_seconds`)."""
    import torch.distributed as dist

    from helpers.pipeline.comm import timed_across_ranks

    whole = torch.zeros(nbytes // 4, device=device)
    parts = list(whole.chunk(messages))

    def tensor_by_tensor() -> None:
        for work in [dist.broadcast(t, src=0, async_op=True) for t in parts]:
            work.wait()

    split = timed_across_ranks(tensor_by_tensor, repeats, device)
    one = timed_across_ranks(lambda: dist.broadcast(whole, src=0), repeats, device)
    return max(0.0, (split - one) / (messages - 1))


def fit_small_messages(sizes: Sequence[float], seconds: Sequence[float], name: str) -> Link:
    """`fit_link` for small messages, whose bytes can be lost in the latency's noise (the times need not grow with
    the size, or grow so steeply that the line's intercept falls to zero, which no backend's message costs): then the
    link is all latency, the median time."""
    try:
        link = fit_link(sizes, seconds, name)
    except ValueError:
        link = None
    if link is None or link.latency_s <= 0:
        return Link(statistics.median(seconds), float("inf"), f"{name} (latency only)")
    return link


FSDP2_HOST_ROUNDS = 15  # rounds of `fsdp2_host_samples` (one sample each): fewer leave its median too noisy


def fsdp2_host_samples(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                       repeats: int) -> list[float]:
    """Rank worker: the host work `fully_shard` does around each collective it issues, beyond the collective and
    the copies the simulator models. A sharded copy of `model` (each layer, then the whole) trains on (`x`, `y`),
    in turns with the same computation unsharded and with the same all-gathers (forward, and again in backward
    for every unit resharded after forward) and reduce-scatters made by hand; the difference, less the copies in
    and out of the collectives' buffers at this device's measured copy speed, shared over the collectives.
    What the profiler found it to be on the course's CPU rig: DTensor dispatch, copies slower than a plain copy,
    the collectives' wrappers, page faults (docs/bench.md, `fsdp2_host_samples`). One sample per round, each
    round's own difference: the compute is subtracted within a round, so the minute's speed cancels (take their
    median, not the difference of the medians)."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.pipeline.stages import as_layers

    device, world = x.device, dist.get_world_size()
    sharded = copy.deepcopy(model)
    mesh = init_device_mesh(device.type, (world,))
    # each layer with parameters its own unit, the whole model the root unit (holding no parameters of its own here)
    layers = [layer for layer in as_layers(sharded) if any(True for _ in layer.parameters())]
    units = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]  # bytes gathered
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    buffers = {n: (torch.zeros(n // 4 // world * world, device=device),
                   torch.zeros(n // 4 // world, device=device)) for n in set(units)}
    gathers = units * 2  # every unit but the root (no parameters here) is resharded after forward

    def by_hand() -> None:
        for n in gathers:
            dist.all_gather_into_tensor(*buffers[n])
        for n in reversed(units):
            dist.reduce_scatter_tensor(buffers[n][1], buffers[n][0])

    def train(m: nn.Module) -> Callable[[], None]:
        return lambda: loss_fn(m(x), y).backward()

    work = {"sharded": train(sharded), "plain": train(model), "collectives": by_hand}
    times: dict[str, list[float]] = {name: [] for name in work}
    for r in range(1 + repeats):  # interleaved, so that a slow moment hits all three; the first round warms up
        for name, fn in work.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            if r:
                times[name].append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    shard_bytes = sum(gathers) / world + sum(units)  # copy-in of the shard, copy-out of what was gathered
    copies = (shard_bytes + sum(units)) * copy_seconds_per_byte(device)  # + gradients into the reduce-scatter
    # each round's difference: a slow moment slows the three of one round alike and cancels
    return [(s - p - c - copies) / (len(gathers) + len(units))
            for s, p, c in zip(times["sharded"], times["plain"], times["collectives"])]


COLLECTIVE_KINDS = ("allgather", "reducescatter", "broadcast")  # measured besides the link benchmark's all-reduce
RECEIVE_POSTS = 40  # exchanges `receive_post_seconds` times on each rank (after 2 untimed)


def receive_post_seconds(model: nn.Module, x: torch.Tensor, posts: int = RECEIVE_POSTS) -> float:
    """Rank worker, two ranks: what posting a receive costs a rank's thread while both ranks compute between
    exchanges, as a pipeline's stages do. Each rank runs `model`'s forward on `x`, then posts one send of the
    forward's hidden state (the embedding's output: what crosses a stage boundary) to the other rank and one receive
    from it in one `batch_isend_irecv`, as the process engine does, and waits for the receive; returns the mean
    seconds of the posts over both ranks. On the CPU rig gloo's post blocks most of its time (likely on the
    connection's lock, which its transport thread holds while it reads and writes; not shown) and moves from launch
    to launch (docs/bench.md, `receive_post_seconds`); NCCL only enqueues on the stream."""
    import torch.distributed as dist

    from helpers.runtime.strict import plain_backend

    device, peer = x.device, 1 - dist.get_rank()
    with torch.no_grad():
        hidden = model[0](x)
    wire = "cpu" if plain_backend() == "gloo" else device  # gloo carries host tensors
    out, inbox = hidden.to(wire).contiguous(), torch.empty_like(hidden, device=wire)
    total, pending = 0.0, []
    dist.barrier()
    for k in range(posts + 2):
        with torch.no_grad():
            model(x)
        for work in pending:
            work.wait()
        t0 = time.perf_counter()
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, inbox, peer)])
        total += time.perf_counter() - t0 if k >= 2 else 0.0
        works[-1].wait()
        pending = works[:-1]
    for work in pending:
        work.wait()
    synchronize(device)
    mean = torch.tensor([total / posts], dtype=torch.float64, device=device)  # NCCL: cuda tensors only
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def process_calibration_worker(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable, rounds: int,
                               sizes: Sequence[int], repeats: int) -> dict:
    """Rank worker, two ranks: (1) forward + backward timed on each rank alone (the other waits), then on both at
    once, `rounds` times: the ratios together / alone; (2) the collectives FSDP2 and ZeRO-1 use besides the
    all-reduce, as they run on this backend: all-gather into a tensor of n bytes, reduce-scatter of n bytes,
    broadcast of n bytes, the median of `repeats` for each size n, and a broadcast's cost per tensor when sent
    tensor by tensor (`broadcast_message_seconds`); (3) what posting a receive costs while both ranks compute
    (`receive_post_seconds`)."""
    import torch.distributed as dist

    from helpers.pipeline.comm import timed_across_ranks
    from helpers.runtime.launch import rank_device
    from helpers.runtime.strict import plain_backend
    from helpers.training.support import carries

    device = rank_device()
    model, x, y = model.to(device), x.to(device), y.to(device)
    rank, world = dist.get_rank(), dist.get_world_size()

    def step() -> float:
        return sum(forward_backward_seconds(lambda: loss_fn(model(x), y), device))

    step()
    ratios = []
    for _ in range(rounds):
        alone = 0.0
        for turn in range(world):
            dist.barrier()
            if turn == rank:
                alone = step()
            dist.barrier()
        dist.barrier()
        together = step()
        pair = torch.tensor([alone, together], dtype=torch.float64, device=device)  # NCCL: cuda tensors only
        dist.all_reduce(pair)
        ratios.append(float(pair[1] / pair[0]))
    backend = plain_backend()
    kinds = [k for k in COLLECTIVE_KINDS if carries(backend, device.type, k)]  # gloo on one GPU: broadcast only
    samples: dict[str, tuple[list[int], list[float]]] = {k: ([], []) for k in kinds}
    for n in sizes:
        full = torch.zeros(n // 4 // world * world, device=device)
        shard = torch.zeros(full.numel() // world, device=device)
        for kind, fn in (("allgather", lambda: dist.all_gather_into_tensor(full, shard)),
                         ("reducescatter", lambda: dist.reduce_scatter_tensor(shard, full)),
                         ("broadcast", lambda: dist.broadcast(full, src=0))):
            if kind in samples:
                samples[kind][0].append(full.numel() * 4)
                samples[kind][1].append(timed_across_ranks(fn, repeats, device))
    sharded = all(k in samples for k in ("allgather", "reducescatter"))  # else FSDP2 cannot run on this rig
    return {"ratios": ratios, "collectives": samples, "receive_post_s": receive_post_seconds(model, x),
            "broadcast_message_s": broadcast_message_seconds(device, max(repeats, 5)),
            "fsdp2_host_s": Reading.median_of(fsdp2_host_samples(model, x[:1], y[:1], loss_fn,
                                                                 max(repeats, FSDP2_HOST_ROUNDS))).at_least(0.0)
            if sharded else 0.0}


def process_calibration(rig, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                        sizes: Sequence[int], rounds: int = 7, repeats: int = 3) -> dict:
    """`process_calibration_worker` on two ranks of `rig`; rank 0's answer. `model` must be a stack of layers
    (`nn.Sequential`, as `build_stack` makes): its first layer's output is the message a stage boundary carries
    (`receive_post_seconds`), refused here before any rank starts."""
    import copy

    from helpers.runtime.launch import run

    if not isinstance(model, nn.Sequential) or len(model) < 2:
        raise ValueError(f"the calibration needs the model as a stack of layers (nn.Sequential, as "
                         f"helpers.models.build_stack makes), got {type(model).__name__}: its first layer's output "
                         "is what a pipeline sends between stages")

    return run(process_calibration_worker, copy.deepcopy(model).cpu(), x.cpu(), y.cpu(), loss_fn, rounds,
               list(sizes), repeats, rig=rig)[0]


@dataclass(frozen=True)
class RigModel:
    """This rig as the simulator sees it, measured in this run: the multi-process engines' point-to-point link and
    collectives (fitted), the threaded engine's link, and on the CPU rig how the virtual devices share the cores."""

    p2p: Link
    collectives: Collectives
    threads_link: Link
    thread_cores: SharedCores | None  # None: every device is hardware of its own (GPUs)
    process_cores: SharedCores | None
    copy_bandwidth: float = float("inf")  # bytes/s one device copies memory at
    samples: tuple = ()  # the link benchmark's LinkSamples
    fsdp2_host_s: float = 0.0  # fully_shard's host work per collective (fsdp2_host_samples' median; a Reading if measured)
    split_overhead: float = 0.0  # a split backward beyond a plain one, minus 1 (split_backward_overhead; a Reading)

    @property
    def host_computes(self) -> bool:
        """CPU rig: the host thread does the compute itself, so it cannot issue work ahead of it (FSDP2's implicit
        forward prefetch needs a GPU)."""
        return self.process_cores is not None

    def with_core_slowdown(self, slowdown: float | None, engine: str = "threads") -> RigModel:
        """This rig with `engine`'s busy-core slowdown ("threads" or "processes") measured elsewhere (e.g.
        `WholeModelTimer.slowdown`, in the minutes of the runs predicted); unchanged for None, or where the devices
        do not share cores."""
        field_name = {"threads": "thread_cores", "processes": "process_cores"}[engine]
        cores = getattr(self, field_name)
        if slowdown is None or cores is None:
            return self
        return replace(self, **{field_name: replace(cores, slowdown=slowdown)})

    def with_receive_post(self, seconds: float | None) -> RigModel:
        """This rig with posting a receive measured elsewhere (the point-to-point link's `receive_s`: e.g. inside the
        launch of the runs predicted, `WholeModelTimer.receive_post_s`); unchanged for None."""
        return self if seconds is None else replace(self, p2p=replace(self.p2p, receive_s=seconds))

    def with_fsdp2_host(self, seconds: float | None) -> RigModel:
        """This rig with FSDP2's host work per collective measured elsewhere (e.g. inside the launches of the FSDP2
        row predicted, `WholeModelTimer.launch_reading`); unchanged for None."""
        return self if seconds is None else replace(self, fsdp2_host_s=seconds)

    def calibrated(self, workload: Workload) -> Workload:
        """`workload` with this rig's measured copy bandwidth and split backward's overhead."""
        return replace(workload, copy_bandwidth=self.copy_bandwidth, split_overhead=self.split_overhead)

    def simulate(self, workload: Workload, job, engine: str = "processes"):
        """`job` on `workload` as this rig runs it with `engine` ("threads": one process, or "processes"): the
        engine's link, the measured collectives and copy bandwidth, FSDP2's forward prefetch only where the host
        runs ahead of the device (where it computes itself, it also waits for each of FSDP2's collectives), and on
        the CPU rig the sharing of the cores."""
        from helpers.simulate.strategies import simulate

        if engine not in ("threads", "processes"):
            raise ValueError(f"unknown engine {engine!r}; choose 'threads' or 'processes'")
        if job.entry.fully_sharded or job.entry.shards[0]:  # fully_shard (FSDP2, ZeRO-2) and DeepSpeed's ZeRO-3
            job = replace(job, forward_prefetch=not self.host_computes, host_waits=self.host_computes,
                          fsdp2_host_s=self.fsdp2_host_s if job.entry.fully_sharded else 0.0)  # measured for FSDP2
        threads = engine == "threads"
        return simulate(self.calibrated(workload), job, self.threads_link if threads else self.p2p, self.collectives,
                        self.thread_cores if threads else self.process_cores)

    def describe(self) -> list[str]:
        """The calibration as the bench prints it, each measured reading with its spread (`spread_said`)."""
        lines = [f"point-to-point (processes): {self.p2p}", f"collectives (processes): {self.collectives}",
                 f"threaded engine's hand-over: {self.threads_link}",
                 f"memory copies: {self.copy_bandwidth / 1e9:.3g} GB/s",
                 f"FSDP2's host work: {self.fsdp2_host_s * 1e3:.2f} ms per collective{spread_said(self.fsdp2_host_s)}",
                 f"split backward (input pass + weight pass): {1 + self.split_overhead:.3g}x a plain backward"
                 f"{spread_said(self.split_overhead)}"]
        if self.thread_cores is not None:
            lines += [f"{name}: {cores}{spread_said(cores.slowdown)}"
                      for name, cores in (("threads", self.thread_cores), ("processes", self.process_cores))]
        return lines


def links_from_samples(samples: Sequence) -> tuple[Link, Link, Link]:
    """(point-to-point, all-reduce, threaded engine's link) fitted to `link_benchmark`'s samples; the all-reduce
    as the time of one all-reduce of n bytes. On the CPU rig the threaded engine hands tensors over in memory: no
    copy, a free link."""
    by_path: dict[str, list] = {}
    for s in samples:
        by_path.setdefault(s.path, []).append(s)

    def pick(prefix: str) -> list:
        return next((v for k, v in by_path.items() if k.startswith(prefix)), [])

    def fit(path: list) -> Link:
        return fit_link([s.bytes for s in path], [s.seconds for s in path], path[0].path)

    p2p, allreduce, copy = pick("processes: point-to-point"), pick("processes: all-reduce"), pick("threads:")
    if not p2p or not allreduce:
        raise ValueError("the link benchmark has no point-to-point or all-reduce samples to fit")
    return fit(p2p), fit(allreduce), fit(copy) if copy else replace(FREE_LINK, name="in-memory hand-over (no copy)")


def measure_rig(rig, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                sizes: Sequence[int] | None = None, repeats: int = 3, rounds: int = 7) -> RigModel:
    """Links, collectives and (CPU rig) core sharing, measured with `model` on (`x`, `y`) as the compute that shares
    the cores: `link_benchmark` (point-to-point, all-reduce), then all-gather, reduce-scatter and broadcast (on gloo
    they do not cost what the ring's formulas say; the broadcast's latency: the measured cost of each further
    tensor, what ZeRO-1 pays per tensor) and the busy-core slowdown of two processes in one more launch, what
    posting a receive costs while both compute (`receive_post_seconds`, the point-to-point link's `receive_s`), and
    the busy-core slowdown of two threads here; what a split backward costs beyond a plain one
    (`split_backward_overhead`). On gloo the collectives add and copy on the CPU, so they take cores too."""
    from helpers.pipeline.comm import default_sizes, link_benchmark

    sizes = list(sizes) if sizes else default_sizes()
    samples = link_benchmark(rig, sizes, repeats)
    p2p, allreduce, threads_link = links_from_samples(samples)
    measured = process_calibration(rig, model, x, y, loss_fn, sizes, rounds, repeats)
    p2p = replace(p2p, receive_s=measured["receive_post_s"])
    # a collective the backend cannot run here (gloo on one GPU: all-gather, reduce-scatter) is never simulated on
    # this rig (FSDP2 and ZeRO-2 are refused there): it keeps the all-reduce's fit, by name only
    fits = {kind: fit_link(*measured["collectives"][kind], name=kind) if kind in measured["collectives"] else
            replace(allreduce, name=f"{kind} (not measured: not run on this rig)") for kind in COLLECTIVE_KINDS}
    fits["broadcast"] = replace(fits["broadcast"], latency_s=measured["broadcast_message_s"])
    backend = allreduce.name.split("(")[-1].rstrip(")") if "(" in allreduce.name else "measured"
    collectives = Collectives(replace(allreduce, name="allreduce"), fits["allgather"], fits["reducescatter"],
                              fits["broadcast"], 2, f"collectives ({backend})")
    thread_cores = process_cores = None
    copy_bandwidth = copy_seconds_per_byte(x.device) ** -1
    if rig.is_cpu:
        from helpers.runtime.rig import usable_cores

        cores = max(1, usable_cores() // rig.threads_per_device)
        thread_cores = SharedCores(cores, thread_slowdown(model, x, y, loss_fn, rounds), COMPUTE_TASKS)
        process_cores = SharedCores(cores, typical_slowdown(measured["ratios"]).at_least(1.0),
                                    COMPUTE_TASKS | COLLECTIVES)
    return RigModel(p2p, collectives, threads_link, thread_cores, process_cores, copy_bandwidth, tuple(samples),
                    measured["fsdp2_host_s"], split_backward_overhead(model, x, y, loss_fn, rounds))
