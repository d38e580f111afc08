"""The one training loop every multi-process strategy runs, and `run_training`, which checks a job and starts it.

A rank: lays the world out on a (dp, pp) DeviceMesh, builds only what it owns (its stage; FSDP2: its shards) from
the meta device, applies the job's strategies (helpers.training.strategies), then runs the same loop for all of
them: warm-up step (its gradients are the parity check, its state the memory report), timed steps (synchronised,
each the slowest rank's, with the seconds each rank spent in forward and backward), one recorded step (timeline and
activation peak).
"""
from __future__ import annotations

import gc
import statistics
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from helpers.catalog import strategy as catalog_entry
from helpers.sizing.ledger import (DeviceMemory, MemoryLedger, cuda_peak_bytes, grad_bytes, optimizer_state_bytes,
                                   param_bytes)
from helpers.activation_checkpointing import checkpoint_in_place
from helpers.models.data import SyntheticTokens, kept_tokens, lm_loss_sum
from helpers.models.text import batch_rows, load_rows
from helpers.models.layered import Stage, boundary_shapes, microbatch_seed, owned_layers, with_seed
from helpers.measure import synchronize
from helpers.pipeline.comm import Wire
from helpers.pipeline.interpreter import MicroBatch
from helpers.pipeline.stages import stage_ranges
from helpers.precision import Autocast, make_scaler
from helpers.runtime.launch import rank_device, run
from helpers.runtime.live import publish
from helpers.runtime.host import to_device
from helpers.runtime.rig import Rig
from helpers.timeline import PHASES, Event, Recorder, gather_events, phase_seconds
from helpers.training.checkpoint import rank_checkpointer
from helpers.training.job import TrainJob, check_job
from helpers.training.memory_techniques import ChunkedLossStage, OptimizerInBackward, offloaded_activations
from helpers.training.strategies import (apply_ddp, apply_fsdp, apply_pipeline, clip_gradients, make_optimizer,
                                         step_optimizer, sum_replica_grads, tied_copies, weights_in)


@dataclass
class TrainResult:
    loss: float  # the global batch's loss at the first step: comparable with one device's
    step_s: float  # median over steps of the slowest rank's step time
    step_times: list[float]  # every timed step (slowest rank), for pooling rounds
    phase_times: list[dict[str, float]]  # every timed step's `phase_seconds`, summed over ranks
    events: list[Event]  # every rank's timeline of the last step; device = global rank
    memory: list[DeviceMemory]  # per rank: state after a step, activations at their peak
    grads: list[torch.Tensor] = field(default_factory=list)  # first step, whole model, parameters() order
    cuda_peak: list[int | None] = field(default_factory=list)  # per rank, torch.cuda.max_memory_allocated
    losses: list[float] = field(default_factory=list)  # every step's loss (after each optimizer step's update)
    state: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # trained weights by layer (return_state)
    first_step: int = 0  # the step the run started from: a checkpoint's when it resumed; losses[k] is step first+k
    save_blocked: list[float] = field(default_factory=list)  # seconds each checkpoint save blocked the step (rank 0)
    # per rank, the median timed step's CPU seconds: of the rank's own thread (compute and the host work around it),
    # and of its whole process (with gloo's threads). Unlike the step's wall time, other processes on the cores do
    # not stretch them: wall - CPU is what the rank waited (messages, collectives, a core)
    thread_cpu_s: list[float] = field(default_factory=list)
    process_cpu_s: list[float] = field(default_factory=list)
    # the recorded step's time (slowest rank; None if the run ended before it): the same step as the timed ones, only
    # its peak memory and timeline are kept, so it is one more sample of the step (the bench pools it with them)
    recorded_step_s: float | None = None
    # per rank, the peak of saved activations kept in host memory (activation_offload; 0 without it)
    host_activations: list[int] = field(default_factory=list)
    # per rank, optimizer state kept in host memory after a step (DeepSpeed's ZeRO-Offload; 0 without it)
    host_state: list[int] = field(default_factory=list)

    @property
    def peak_activations(self) -> list[int]:
        return [m.activations for m in self.memory]


def run_training(job: TrainJob, rig: Rig, timeout: float = 300.0, oversubscribe: bool = False,
                 restarts: int = 0) -> TrainResult:
    """Check `job` against `rig`, run it on dp x pp ranks, and combine what the ranks return. `restarts`: start all
    ranks again after a rank fails, up to this many times (with `job.checkpoint`, they resume from the latest
    checkpoint)."""
    return run_trainings([job], rig, timeout, oversubscribe, restarts)[0]


def run_trainings(jobs: Sequence[TrainJob], rig: Rig, timeout: float = 300.0, oversubscribe: bool = False,
                  restarts: int = 0) -> list[TrainResult]:
    """Several jobs of one world size in one launch, the same ranks running them one after the other: a comparison
    pays one start-up of the processes instead of one per job (DeepSpeed's jobs each pay their own: `launches`).
    Every job is checked before anything starts; `timeout` is per job."""
    if not jobs:
        return []
    worlds = sorted({job.world for job in jobs})
    if len(worlds) > 1:
        raise ValueError(f"jobs launched together need one world size, got {worlds}: launch them separately")
    for job in jobs:
        check_job(job, rig, oversubscribe)
    results: dict[int, TrainResult] = {}
    for group in launches(jobs):
        parts = run(train_workers, [jobs[i] for i in group], nranks=worlds[0], rig=rig, timeout=timeout * len(group),
                    oversubscribe=oversubscribe, restarts=restarts)
        results.update((i, combine_ranks([rank[k] for rank in parts])) for k, i in enumerate(group))
    return [results[i] for i in range(len(jobs))]


def launches(jobs: Sequence[TrainJob]) -> list[list[int]]:
    """Which jobs share a launch (indices, in order): all but DeepSpeed's in one, each DeepSpeed job in its own.
    DeepSpeed keeps process-wide state from one engine to the next that `engine.destroy()` does not all undo (its
    communication backend, ZeRO-3's module hooks and parameter bookkeeping), and a ZeRO-3 engine built on ranks that
    had just run a ZeRO-2 one has crashed there in native code (SIGSEGV)."""
    plain = [i for i, job in enumerate(jobs) if not job.deepspeed]
    return ([plain] if plain else []) + [[i] for i, job in enumerate(jobs) if job.deepspeed]


def combine_ranks(parts: list[dict]) -> TrainResult:
    """One job's result from what its ranks returned (`train_worker`)."""
    per_step = [max(p["times"][i] for p in parts) for i in range(min(len(p["times"]) for p in parts))]
    phases = [{phase: sum(p["phases"][i][phase] for p in parts) for phase in PHASES} for i in range(len(per_step))]
    replica0 = [p for p in parts if p["dp"] == 0]
    by_layer = sorted((i, g) for p in replica0 for i, g in p["grads"])
    first_loss = parts[0]["losses"][0] if parts[0]["losses"] else float("nan")  # none: resumed at its last step
    return TrainResult(loss=first_loss, step_s=statistics.median(per_step) if per_step else float("nan"),
                       step_times=per_step,
                       phase_times=phases, events=parts[0]["events"], memory=[p["memory"] for p in parts],
                       grads=[g for _, grads in by_layer for g in grads], cuda_peak=[p["cuda_peak"] for p in parts],
                       losses=parts[0]["losses"], state={i: s for p in replica0 for i, s in p["state"].items()},
                       thread_cpu_s=[statistics.median(p["cpu"][0]) for p in parts if p["cpu"][0]],
                       process_cpu_s=[statistics.median(p["cpu"][1]) for p in parts if p["cpu"][1]],
                       first_step=parts[0]["first_step"], save_blocked=parts[0]["save_blocked"],
                       recorded_step_s=max(p["recorded"] for p in parts)
                       if all(p["recorded"] is not None for p in parts) else None,
                       host_activations=[p["host"] for p in parts], host_state=[p["host_state"] for p in parts])


# --- inside a rank -----------------------------------------------------------------------------------------------

@dataclass
class _Batch:
    """This replica's micro-batches and the kept tokens of the *global* batch (every rank builds the same seeded
    data, so it knows them without communicating)."""

    microbatches: list[MicroBatch]
    normalizer: int
    first_index: int  # the global index of this replica's first micro-batch (dropout seeds)


def global_batch(job: TrainJob, step: int, rows: torch.Tensor | None):
    """(inputs, targets, mask) of the global batch at `step`: the job's token windows in order, or the same
    synthetic batch every step."""
    seq = job.sequence_length()
    if rows is not None:
        chunk = batch_rows(rows, step, job.batch)
        return chunk[:, :seq], chunk[:, 1:seq + 1], None
    data = SyntheticTokens(job.batch, seq, job.layered.vocab_size, seed=job.data_seed, padding=job.padding)
    return data.masked_batch(0, job.batch)


def _replica_batch(job: TrainJob, replica: int, device: torch.device, step: int = 0,
                   rows: torch.Tensor | None = None) -> _Batch:
    x, y, mask = global_batch(job, step, rows)
    shares = job.shares or (job.batch // job.dp,) * job.dp
    rows = slice(sum(shares[:replica]), sum(shares[:replica + 1]))
    # copy=True: on the CPU rig a slice of the token windows would otherwise stay a view of the whole corpus, and the
    # ledger would count the corpus among the activations when the embedding saves its input ids (full training)
    xs = x[rows].to(device, copy=True).chunk(job.microbatches)
    ys = y[rows].to(device, copy=True).chunk(job.microbatches)
    masks = mask[rows].to(device).chunk(job.microbatches) if mask is not None else [None] * job.microbatches
    model = job.layered
    mbs = [MicroBatch(xi, yi, model.context(xi, mi)) for xi, yi, mi in zip(xs, ys, masks)]
    return _Batch(mbs, kept_tokens(y), replica * job.microbatches)


def _seeded(batch: _Batch, data_seed: int, step: int) -> list[MicroBatch]:
    """The micro-batches with this step's dropout seeds in their contexts."""
    return [MicroBatch(mb.inputs, mb.targets,
                       with_seed(mb.context, microbatch_seed(data_seed, step, batch.first_index + k)))
            for k, mb in enumerate(batch.microbatches)]


def _local_state(r: "_Rank", job: TrainJob) -> tuple[DeviceMemory, int]:
    """What the rank holds after a step, on its device and (DeepSpeed's offloaded optimizer) on the host. The
    optimizer stepped in backward freed each gradient as it stepped: its gradients are the most it held at once."""
    if job.deepspeed:
        from helpers.training.deepspeed_zero import state_bytes

        return state_bytes(r.wrapped, job)
    module, optimizer = r.module, r.optimizer
    opt = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's local shard
    grads = optimizer.peak_grad_bytes if isinstance(optimizer, OptimizerInBackward) else \
        grad_bytes(module.parameters())
    return DeviceMemory(param_bytes(module.parameters()), grads,
                        optimizer_state_bytes(opt) if opt is not None else 0), 0


def _gathered(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` whole (a collective every rank joins for a sharded one), gathered through the rank's device: NCCL serves
    no host memory, where CPU offload keeps the shards and their gradients (PyTorch's full-state-dict gather also
    copies them to the device first). One tensor at a time, so the device holds one whole tensor more."""
    return to_device(t, device).full_tensor() if hasattr(t, "full_tensor") else t


def _trained_state(module: Stage, owned: list[int], device: torch.device,
                   deepspeed: bool = False) -> dict[int, dict[str, torch.Tensor]]:
    """This rank's trained weights by global layer index (`owned[k]` is module.layers[k]'s; sharded ones gathered
    whole: FSDP2's DTensors one by one, DeepSpeed's ZeRO-3 partitions a layer at a time, on every rank together).
    Frozen parameters (a LoRA model's base) are left out: they are the checkpoint's."""
    if deepspeed:
        from helpers.training.deepspeed_zero import gathered
    out = {}
    for index, layer in zip(owned, module.layers):
        tensors = {}
        frozen = {name for name, p in layer.named_parameters() if not p.requires_grad}
        if frozen and len(frozen) == len(list(layer.parameters())):
            continue
        with gathered(layer) if deepspeed else nullcontext():
            for name, t in layer.state_dict().items():
                if name in frozen:
                    continue
                tensors[name] = _gathered(t, device).detach().cpu().clone()
        out[index] = tensors
    return out


def _first_grads(module: Stage, owned: list[int], scale: float, device: torch.device,
                 deepspeed: bool = False) -> list[tuple[int, list[torch.Tensor]]]:
    """This rank's gradients as (global layer index, the layer's gradients in parameters() order) (a weight two
    layers share, like tied embeddings, appears in both; frozen ones have none), unscaled; sharded ones (FSDP2,
    DeepSpeed's partitions) gathered whole."""
    if deepspeed:
        from helpers.training.deepspeed_zero import full_grad
    out = []
    for index, layer in zip(owned, module.layers):
        grads = []
        for p in (p for p in layer.parameters() if p.requires_grad):
            grad = full_grad(p) if deepspeed else _gathered(p.grad, device)
            grads.append(grad.detach().float().cpu() / scale)
        out.append((index, grads))
    return out


class _Rank:
    """Everything one rank of a job holds: its mesh coordinates, what it owns, and one training step."""

    def __init__(self, job: TrainJob):
        from torch.distributed.device_mesh import init_device_mesh

        self.job, self.rank, self.device = job, dist.get_rank(), rank_device()
        self.mesh = init_device_mesh(self.device.type, (job.dp, job.pp), mesh_dim_names=("dp", "pp"))
        self.replica, self.stage = self.mesh.get_local_rank("dp"), self.mesh.get_local_rank("pp")
        self.rec = Recorder(self.rank, self.device, job.slowdown[self.rank] if job.slowdown else 1.0)
        self.precision = job.precision
        model = job.layered
        ranges = stage_ranges(job.n_layers, job.cut())
        # the (first, end) layers of each stage this rank runs, in chunk order (one stage unless the schedule puts
        # several on a device); the layers it owns, in that order
        self.chunk_ranges = [ranges[k] for k in job.layout.stages_of(self.stage)] if job.pp > 1 else \
            [(0, job.n_layers)]
        self.owned = [i for a, b in self.chunk_ranges for i in range(a, b)]
        self.module = self._materialise(model)
        self.ledger = MemoryLedger(["device", "host"] if job.activation_offload else ["device"])
        self.ledger.assign("device", self.module)
        self.rows = load_rows(job.data) if job.data is not None else None
        self.batch, self._step = _replica_batch(job, self.replica, self.device, 0, self.rows), 0
        self.tied = tied_copies(model, self.module, self.owned, job, self.mesh)
        self.scaler = make_scaler(self.precision, self.device, dist.group.WORLD)
        if job.pp > 1:
            self.wrapped, self.step_fn = self.module, self._pipeline()
        else:
            self.wrapped, self.step_fn = self._data_parallel()
        if job.deepspeed:  # the engine partitions the job's optimizer (or, offloaded, steps its CPU Adam)
            self.optimizer = self.wrapped.optimizer
        else:
            self.optimizer = make_optimizer(job.optimizer, self.wrapped.parameters(), job.lr,
                                            zero1=job.dp > 1 and job.data_parallel == "zero1",
                                            in_backward=job.optimizer_in_backward)
        self.ledger.optimizer = getattr(self.optimizer, "optim", self.optimizer)

    def release_groups(self) -> None:
        """Destroy the process groups this job created (its mesh's, its tied weights'), on every rank alike. Ranks
        that run several jobs (`run_trainings`) otherwise keep each job's groups and their backend's threads: 3
        per group on gloo, 99 threads in a rank after the bench's 31-job probe launch."""
        if self.job.deepspeed:
            self.wrapped.destroy()  # its hooks and buffers, before the next job on these ranks
        groups = {id(g): g for g in [*self.mesh.get_all_groups(), *self.tied.groups]}
        for group in groups.values():
            if group is not dist.group.WORLD and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        gc.collect()  # a destroyed group's backend, and its threads, end when the last reference cycle to it goes

    def batch_at(self, step: int) -> _Batch:
        """This replica's batch at `step` (a new one each step when the job trains on token windows)."""
        if self.rows is not None and step != self._step:
            self.batch, self._step = _replica_batch(self.job, self.replica, self.device, step, self.rows), step
        return self.batch

    def _materialise(self, model) -> Stage:
        job = self.job
        if job.fully_sharded:
            meta = self._stage(model.meta_layers())
            self._checkpoint(meta)
            return apply_fsdp(meta, model, 0, self.mesh["dp"], self.device,
                              reshard_after_forward=catalog_entry(job.data_parallel).reshard_after_forward,
                              precision=self.precision, offload=job.offload == "cpu")
        layers = owned_layers(model, self.owned, self.device)
        return self._checkpoint(weights_in(self._stage([layers[i] for i in self.owned]), model, self.precision))

    def _stage(self, layers) -> Stage:
        """The rank's layers as one stage; with `job.loss_chunks`, one that returns the loss of the targets it is
        given, its head run on chunks of tokens (helpers.training.memory_techniques)."""
        chunks = self.job.loss_chunks
        return ChunkedLossStage(layers, chunks) if chunks is not None and self.job.pp == 1 else Stage(layers)

    def saving(self):
        """Where forward's saved tensors go: the device's ledger, or (activation_offload) host memory, counted as
        the ledger's host."""
        if self.job.activation_offload:
            return offloaded_activations(self.ledger, pin_memory=self.device.type == "cuda")
        return self.ledger.track_activations("device")

    def _checkpoint(self, stage: Stage) -> Stage:
        """With `job.activation_checkpointing`, every layer between the embedding and the head (the blocks, the final
        norm) recomputes its activations in backward; applied before FSDP2 shards them."""
        if self.job.activation_checkpointing:
            for layer in list(stage.layers)[1:-1]:
                checkpoint_in_place(layer)
        return stage

    def chunks(self) -> list[Stage]:
        """This rank's pipeline stages, in chunk order, sharing the layers of `module`."""
        starts = [0, *accumulate(b - a for a, b in self.chunk_ranges)]
        return [Stage(self.module.layers[s:e]) for s, e in zip(starts, starts[1:])]

    @property
    def loss_scale(self) -> float:
        return self.scaler.get_scale() if self.scaler is not None else 1.0

    def _pipeline(self) -> Callable[[int], torch.Tensor]:
        """One global batch through this rank's stage; tied copies and the replicas' gradients summed after it."""
        job, stage = self.job, self.stage
        mb_size = job.batch // job.dp // job.microbatches
        planned = boundary_shapes(job.layered, job.cut(), mb_size, job.sequence_length(), self.precision.weights)
        shapes = {b: shape for b, (shape, _) in enumerate(planned)}
        first = job.layout.stage(stage)
        wire = Wire.of(job.wire, compute=planned[min(first, len(planned) - 1)][1])
        step = apply_pipeline(self.chunks(), stage, job.pp, job.schedule, job.microbatches, job.engine,
                              self.mesh.get_group("pp"), shapes, wire, job.overlap, self.device, self.rec,
                              self.ledger.trackers()[0], self.precision, job.batched_weights)

        def run_step(i: int) -> torch.Tensor:
            batch = self.batch_at(i)
            share = step(_seeded(batch, job.data_seed, i), batch.normalizer, self.loss_scale)
            self.tied.sync(self.rec)
            if job.dp > 1:
                sum_replica_grads(list(self.module.parameters()), self.mesh.get_group("dp"), self.rec)
            return share * batch.normalizer if share is not None else torch.zeros((), device=self.device)

        return run_step

    def _data_parallel(self) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
        """Forward and backward of this rank's shard, as `job.microbatches` accumulation steps; gradients are
        synchronised on the last one only (DDP's no_sync, FSDP2's set_requires_gradient_sync)."""
        job = self.job
        sharded = job.fully_sharded
        if job.deepspeed:
            return self._deepspeed()
        wrapped = self.module if sharded else Autocast(self.module, self.precision, self.device)
        if job.dp > 1 and not sharded:
            wrapped = apply_ddp(wrapped, self.mesh.get_group("dp"), self.device, job.bucket_mb, self.rec,
                                Wire.of(job.wire, compute=self.precision.weights))

        def sync_context(last: bool):
            if hasattr(wrapped, "no_sync") and not last:
                return wrapped.no_sync()
            if hasattr(wrapped, "set_requires_gradient_sync"):
                wrapped.set_requires_gradient_sync(last)
            return nullcontext()

        return wrapped, partial(self._accumulate, wrapped, lambda loss: (loss * self.loss_scale).backward(),
                                sync_context)

    def _deepspeed(self) -> tuple[nn.Module, Callable[[int], torch.Tensor]]:
        """DeepSpeed's engine over this rank's module and the job's optimizer, one step: each micro-batch's
        backward through the engine (which reduces the gradients at the last), the engine told of each one but the
        last (`step()` there only counts it); the last one's step is `optimizer_step`'s. DeepSpeed averages over
        replicas as DDP does, and is told not to divide by the accumulation steps: the loss is already a share."""
        from helpers.training import deepspeed_zero

        job = self.job
        optimizer = make_optimizer(job.optimizer, self.module.parameters(), job.lr) if job.offload is None else None
        engine = deepspeed_zero.initialize(self.module, job, optimizer)

        @contextmanager
        def counted(last: bool) -> Iterator[None]:  # the engine told of each micro-batch but the last
            yield
            if not last:
                engine.step()

        return engine, partial(self._accumulate, engine, lambda loss: engine.backward(loss, scale_wrt_gas=False),
                               counted)

    def _accumulate(self, wrapped: nn.Module, backward: Callable[[torch.Tensor], None],
                    around: Callable[[bool], AbstractContextManager], i: int) -> torch.Tensor:
        """Step `i`'s micro-batches through `wrapped`, each one's forward and `backward` inside `around(last)`: the
        summed loss (DDP, FSDP2 and DeepSpeed average over replicas: undone, to sum tokens)."""
        total = torch.zeros((), device=self.device)
        batch = self.batch_at(i)
        share_of = batch.normalizer / self.job.dp
        mbs = _seeded(batch, self.job.data_seed, i)
        for k, mb in enumerate(mbs):
            with around(k == len(mbs) - 1):
                with self.rec.span("forward", k), self.saving():
                    loss = self._loss(wrapped, mb) / share_of
                with self.rec.span("backward", k):
                    backward(loss)
            total = total + loss.detach() * share_of
        return total

    def _loss(self, wrapped: nn.Module, mb: MicroBatch) -> torch.Tensor:
        """The micro-batch's summed loss: from the logits, or (loss_chunks) from the stage that computes it."""
        if self.job.loss_chunks is not None:
            return wrapped(mb.inputs, mb.context, mb.targets)
        out = wrapped(mb.inputs, mb.context) if mb.context is not None else wrapped(mb.inputs)
        return lm_loss_sum(out, mb.targets)

    def optimizer_step(self) -> None:
        if self.optimizer is None:  # gradients only (parity checks, timing forward and backward)
            return
        with self.rec.span("optimizer"):
            if self.job.deepspeed:  # clips (gradient_clipping) and steps at the accumulation boundary
                self.wrapped.step()
                return
            if self.job.max_grad_norm is not None:
                clip_gradients(self.wrapped.parameters(), self.job.max_grad_norm, self.optimizer, self.scaler)
            step_optimizer(self.optimizer, self.scaler)


def train_worker(job: TrainJob) -> dict:
    """One rank of any job (started by `run_training`, or under torchrun)."""
    if dist.get_world_size() != job.world:
        raise ValueError(f"a {job.dp} x {job.pp} mesh has {job.world} devices but the world has "
                         f"{dist.get_world_size()} ranks")
    r = _Rank(job)
    publish(r.ledger, title=job.title)  # to a memory panel, if one watches (helpers.monitor)
    times, phases, grads, losses, memory, host_state = [], [], [], [], DeviceMemory(), 0
    cpu: tuple[list[float], list[float]] = ([], [])  # the timed steps' thread and process CPU seconds
    recorded = None  # the recorded step's seconds
    checkpoints = rank_checkpointer(job, r.module, r.owned, r.optimizer, r.scaler)
    first = checkpoints.resume() if checkpoints is not None else 0
    for i in range(first, job.timed_steps + 2):  # warm-up (parity, memory), timed steps, one recorded step
        r.rec.clear()  # each step's spans alone: a timed step's phases, the recorded step's timeline
        if i == job.timed_steps + 1:
            r.ledger.reset_peaks()
            if r.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(r.device)
        r.module.zero_grad(set_to_none=False)
        dist.barrier()
        synchronize(r.device)
        c0, t0 = _cpu_seconds(), time.perf_counter()
        token_loss = r.step_fn(i)
        if i == 0 and job.return_grads:
            grads = _first_grads(r.module, r.owned, r.loss_scale, r.device, job.deepspeed)
        r.optimizer_step()
        synchronize(r.device)
        seconds = time.perf_counter() - t0
        if 0 < i <= job.timed_steps:
            times.append(seconds)
            for spent, was, now in zip(cpu, c0, _cpu_seconds()):
                spent.append(now - was)
            phases.append(phase_seconds(r.rec.events()))
        elif i == job.timed_steps + 1:
            recorded = seconds
        total = token_loss.detach().float().clone().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / r.batch_at(i).normalizer)
        if i == 0:
            memory, host_state = _local_state(r, job)
        if checkpoints is not None:
            checkpoints.after_step(i + 1, job.timed_steps + 2)
    if checkpoints is not None:
        checkpoints.close()
    memory.activations = r.ledger.device("device").activations
    events = gather_events(r.rec.events())
    state = _trained_state(r.module, r.owned, r.device, job.deepspeed) if job.return_state else {}
    r.release_groups()
    return {"dp": r.replica, "pp": r.stage, "losses": losses, "times": times, "phases": phases, "memory": memory,
            "events": events if r.rank == 0 else [], "grads": grads if r.replica == 0 else [],
            "cuda_peak": cuda_peak_bytes(r.device), "state": state if r.replica == 0 else {}, "cpu": cpu,
            "first_step": first, "save_blocked": checkpoints.blocked if checkpoints is not None else [],
            "recorded": recorded, "host": r.ledger.device("host").activations if job.activation_offload else 0,
            "host_state": host_state}


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far of the calling thread and of the whole process (user + system)."""
    return time.thread_time(), time.process_time()


def train_workers(jobs: Sequence[TrainJob]) -> list[dict]:
    """Several jobs, one after the other, on the same ranks (started by `run_trainings`)."""
    return [train_worker(job) for job in jobs]


def torchrun_job(hidden: int = 64, n_blocks: int = 4, **fields) -> str:
    """torchrun entry: JSON keyword arguments become TrainJob fields on a small block stack, e.g.
    `torchrun --nproc-per-node 4 -m helpers.runtime.launch helpers.training.loop:torchrun_job
    --kwargs '{"dp": 2, "pp": 2, "batch": 16, "schedule": "1f1b", "microbatches": 2}'`; across machines add
    --nnodes/--node-rank/--rdzv-endpoint. `"checkpoint": {"folder": DIR, "every": 2}` checkpoints the run and resumes
    it from DIR (with --max-restarts, after a rank dies). torchrun already started the processes, so on the CPU rig
    they may share cores. Rank 0 says its first loss, its step time and every loss from the step it started at."""
    from helpers.models.stack import StackConfig
    from helpers.runtime.rig import detect_rig
    from helpers.training.checkpoint import CheckpointSpec

    if isinstance(fields.get("checkpoint"), dict):
        fields["checkpoint"] = CheckpointSpec(**fields["checkpoint"])
    job = TrainJob(StackConfig(hidden=hidden, n_blocks=n_blocks, heads=2), **fields)
    rig = detect_rig()
    check_job(job, rig, oversubscribe=rig.is_cpu)
    out = train_worker(job)
    step = f"step {statistics.median(out['times']) * 1e3:.1f} ms" if out["times"] else "no timed step"
    return (f"rank {dist.get_rank()}: replica {out['dp']}, stage {out['pp']}, loss {out['losses'][0]:.4f}, {step}; "
            f"losses from step {out['first_step']}: {out['losses']}")
