"""The one training loop every multi-process strategy runs, and `run_training`, which checks a job and starts it.

A rank: lays the world out on a (dp, pp) DeviceMesh, builds only what it owns (its stage; FSDP2: its shards) from
the meta device, applies the job's strategies (helpers.training.strategies), then runs the same loop for all of
them: warm-up step (its gradients are the parity check, its state the memory report), timed steps (synchronised,
each the slowest rank's), one recorded step (timeline and activation peak).
"""
from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from helpers.memory import DeviceMemory, cuda_peak_bytes, grad_bytes, ledger_for, optimizer_state_bytes, param_bytes
from helpers.models.data import SyntheticTokens, kept_tokens, lm_loss_sum
from helpers.models.layered import Stage, boundary_shapes, owned_layers
from helpers.pipeline.comm import Wire
from helpers.pipeline.interpreter import MicroBatch
from helpers.pipeline.stages import stage_ranges
from helpers.runtime.launch import rank_device, run
from helpers.runtime.rig import Rig
from helpers.timeline import Event, Recorder, gather_events
from helpers.training.job import TrainJob, check_job
from helpers.training.strategies import (apply_ddp, apply_fsdp, apply_pipeline, make_optimizer,
                                         sum_replica_grads)


@dataclass
class TrainResult:
    loss: float  # the global batch's loss at the first step: comparable with one device's
    step_s: float  # median over steps of the slowest rank's step time
    step_times: list[float]  # every timed step (slowest rank), for pooling rounds
    events: list[Event]  # every rank's timeline of the last step; device = global rank
    memory: list[DeviceMemory]  # per rank: state after a step, activations at their peak
    grads: list[torch.Tensor] = field(default_factory=list)  # first step, whole model, parameters() order
    cuda_peak: list[int | None] = field(default_factory=list)  # per rank, torch.cuda.max_memory_allocated

    @property
    def peak_activations(self) -> list[int]:
        return [m.activations for m in self.memory]


def run_training(job: TrainJob, rig: Rig, timeout: float = 300.0, oversubscribe: bool = False) -> TrainResult:
    """Check `job` against `rig`, run it on dp x pp ranks, and combine what the ranks return."""
    check_job(job, rig, oversubscribe)
    parts = run(train_worker, job, nranks=job.world, rig=rig, timeout=timeout, oversubscribe=oversubscribe)
    per_step = [max(p["times"][i] for p in parts) for i in range(len(parts[0]["times"]))]
    replica0 = sorted((p for p in parts if p["dp"] == 0), key=lambda p: p["pp"])
    return TrainResult(loss=parts[0]["loss"], step_s=statistics.median(per_step), step_times=per_step,
                       events=parts[0]["events"], memory=[p["memory"] for p in parts],
                       grads=[g for p in replica0 for g in p["grads"]], cuda_peak=[p["cuda_peak"] for p in parts])


# --- inside a rank -----------------------------------------------------------------------------------------------

def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _replica_batch(job: TrainJob, replica: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This replica's share of the global batch, and the kept tokens of the *global* batch (every rank builds the
    same seeded data, so it knows them without communicating)."""
    seq = job.sequence_length()
    x, y = SyntheticTokens(job.batch, seq, job.layered.vocab_size, seed=job.data_seed).batch(0, job.batch)
    per = job.batch // job.dp
    return (x[replica * per:(replica + 1) * per].to(device), y[replica * per:(replica + 1) * per].to(device),
            kept_tokens(y))


def _microbatches(job: TrainJob, x: torch.Tensor, y: torch.Tensor) -> list[MicroBatch]:
    model = job.layered
    return [MicroBatch(xi, yi, model.context(xi, None)) for xi, yi in zip(x.chunk(job.microbatches),
                                                                        y.chunk(job.microbatches))]


def _local_state(module: nn.Module, optimizer) -> DeviceMemory:
    opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local shard
    return DeviceMemory(param_bytes(module.parameters()), grad_bytes(module.parameters()),
                        optimizer_state_bytes(opt) if opt is not None else 0)


def _first_grads(module: nn.Module) -> list[torch.Tensor]:
    """This rank's gradients in parameters() order; sharded ones (FSDP2) gathered whole (a collective)."""
    out = []
    for p in module.parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out.append(g.detach().cpu().clone())
    return out


def _pipeline_step(job: TrainJob, module: Stage, mesh, stage: int, device, rec: Recorder, track: Callable,
                   microbatches: list[MicroBatch], normalizer: int) -> Callable[[], torch.Tensor]:
    """One global batch through this rank's stage; the replicas' gradients summed when dp > 1."""
    bounds = job.cut()
    mb_size = job.batch // job.dp // job.microbatches
    shapes_dtypes = boundary_shapes(job.layered, bounds, mb_size, job.sequence_length())
    shapes = {"act": shapes_dtypes[stage - 1][0] if stage > 0 else None,
              "grad": shapes_dtypes[stage][0] if stage < job.pp - 1 else None}
    compute = shapes_dtypes[min(stage, len(shapes_dtypes) - 1)][1]
    wire = Wire(dtype=Wire.of(job.wire).dtype, compute=compute)
    step = apply_pipeline(module, stage, job.pp, job.schedule, job.microbatches, job.engine, mesh.get_group("pp"),
                          shapes, wire, job.overlap, device, rec, track)

    def run_step() -> torch.Tensor:
        share = step(microbatches, normalizer)
        if job.dp > 1:
            sum_replica_grads(list(module.parameters()), mesh.get_group("dp"), rec)
        return share * normalizer if share is not None else torch.zeros((), device=device)

    return run_step


def _data_parallel_step(job: TrainJob, wrapped: nn.Module, rec: Recorder, ledger, microbatches: list[MicroBatch],
                        normalizer: int) -> Callable[[], torch.Tensor]:
    """Forward and backward of this rank's shard, as `job.microbatches` accumulation steps; gradients are
    synchronised on the last one only (DDP's no_sync, FSDP2's set_requires_gradient_sync)."""
    share_of = normalizer / job.dp  # DDP and FSDP2 average over the replicas: undo it, to sum token losses

    def sync_context(last: bool):
        if hasattr(wrapped, "no_sync") and not last:
            return wrapped.no_sync()
        if hasattr(wrapped, "set_requires_gradient_sync"):
            wrapped.set_requires_gradient_sync(last)
        return nullcontext()

    def run_step() -> torch.Tensor:
        total = torch.zeros((), device=microbatches[0].inputs.device)
        for k, mb in enumerate(microbatches):
            with sync_context(k == len(microbatches) - 1):
                with rec.span("forward", k), ledger.track_activations("device"):
                    loss = lm_loss_sum(wrapped(mb.inputs), mb.targets) / share_of
                with rec.span("backward", k):
                    loss.backward()
            total = total + loss.detach() * share_of
        return total

    return run_step


def _build(job: TrainJob, mesh, replica: int, stage: int, device, rec: Recorder):
    """This rank's module (only what it owns materialised), its ledger, step function and optimizer."""
    model = job.layered
    n = len(model.meta_layers())
    a, b = stage_ranges(n, job.cut())[stage] if job.pp > 1 else (0, n)
    sharded = job.dp > 1 and job.data_parallel in ("zero2", "fsdp2")
    if sharded:
        module = apply_fsdp(Stage(model.meta_layers()[a:b]), model, a, mesh["dp"], device,
                            reshard_after_forward=job.data_parallel == "fsdp2")
    else:
        module = Stage(owned_layers(model, range(a, b), device)[a:b])
    ledger = ledger_for([module], ["device"])
    x, y, normalizer = _replica_batch(job, replica, device)
    microbatches = _microbatches(job, x, y)
    if job.pp > 1:
        step = _pipeline_step(job, module, mesh, stage, device, rec, ledger.trackers()[0], microbatches, normalizer)
        wrapped = module
    else:
        wrapped = module if sharded or job.dp == 1 else apply_ddp(module, mesh.get_group("dp"), device,
                                                                   job.bucket_mb, rec)
        step = _data_parallel_step(job, wrapped, rec, ledger, microbatches, normalizer)
    optimizer = make_optimizer(job.optimizer, wrapped.parameters(), job.lr,
                               zero1=job.dp > 1 and job.data_parallel == "zero1")
    ledger.optimizer = getattr(optimizer, "optim", optimizer)
    return module, ledger, step, optimizer, normalizer


def train_worker(job: TrainJob) -> dict:
    """One rank of any job (started by `run_training`, or under torchrun)."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != job.world:
        raise ValueError(f"a {job.dp} x {job.pp} mesh has {job.world} devices but the world has "
                         f"{dist.get_world_size()} ranks")
    rank, device = dist.get_rank(), rank_device()
    mesh = init_device_mesh(device.type, (job.dp, job.pp), mesh_dim_names=("dp", "pp"))
    replica, stage = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    rec = Recorder(rank, device)
    module, ledger, step, optimizer, normalizer = _build(job, mesh, replica, stage, device, rec)
    times, grads, loss, memory = [], [], float("nan"), DeviceMemory()
    for i in range(job.steps + 2):  # warm-up (parity, memory), timed steps, one recorded step
        if i == job.steps + 1:
            rec.clear()
            ledger.reset_peaks()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
        module.zero_grad(set_to_none=False)
        dist.barrier()
        _synchronize(device)
        t0 = time.perf_counter()
        token_loss = step()
        if i == 0:
            total = token_loss.detach().clone().reshape(1)
            dist.all_reduce(total)
            loss = total.item() / normalizer
            grads = _first_grads(module) if job.return_grads else []
        if optimizer is not None:
            with rec.span("optimizer"):
                optimizer.step()
        _synchronize(device)
        if 0 < i <= job.steps:
            times.append(time.perf_counter() - t0)
        if i == 0:
            memory = _local_state(module, optimizer)
    memory.activations = ledger.device("device").activations
    events = gather_events(rec.events())
    return {"dp": replica, "pp": stage, "loss": loss, "times": times, "memory": memory,
            "events": events if rank == 0 else [], "grads": grads if replica == 0 else [],
            "cuda_peak": cuda_peak_bytes(device)}


def torchrun_job(hidden: int = 64, n_blocks: int = 4, **fields) -> str:
    """torchrun entry: JSON keyword arguments become TrainJob fields on a small block stack, e.g.
    `torchrun --nproc-per-node 4 -m helpers.runtime.launch helpers.training.loop:torchrun_job
    --kwargs '{"dp": 2, "pp": 2, "batch": 16, "schedule": "1f1b", "microbatches": 2}'`; across machines add
    --nnodes/--node-rank/--rdzv-endpoint. torchrun already started the processes, so on the CPU rig they may share
    cores."""
    from helpers.models.stack import StackConfig
    from helpers.runtime.rig import detect_rig

    job = TrainJob(StackConfig(hidden=hidden, n_blocks=n_blocks, heads=2), **fields)
    rig = detect_rig()
    check_job(job, rig, oversubscribe=rig.is_cpu)
    out = train_worker(job)
    return (f"rank {dist.get_rank()}: replica {out['dp']}, stage {out['pp']}, loss {out['loss']:.4f}, "
            f"step {statistics.median(out['times']) * 1e3:.1f} ms")
