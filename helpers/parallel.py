"""Data parallelism with what PyTorch ships, and DP x PP on a 2-D DeviceMesh.

- `ddp`: DistributedDataParallel; a comm hook records every gradient bucket's all-reduce on the timeline.
- `zero1`: DDP + `ZeroRedundancyOptimizer` (optimizer state sharded).
- `zero2`: FSDP2 `fully_shard(reshard_after_forward=False)`: gradients and optimizer state sharded, parameters kept
  gathered from forward to backward (ZeRO-2-like).
- `fsdp2`: FSDP2 `fully_shard` (ZeRO-3: parameters sharded too, gathered per block when needed).
- `dp_x_pp`: pipeline stages inside each data-parallel replica (our multi-process engine), gradients all-reduced
  across replicas, ranks laid out on a (dp, pp) DeviceMesh.
Every strategy runs through `helpers.runtime.launch.run` (or torchrun) and is checked against one device.
"""
from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from helpers.runtime.launch import rank_device, run
from helpers.memory import DeviceMemory, fmt_bytes, ledger_for, training_state_bytes
from helpers.models import StackConfig, SyntheticTokens, build_stack, count_params, lm_loss
from helpers.timeline import Event, Recorder, gather_events

DP_STRATEGIES = ("ddp", "zero1", "zero2", "fsdp2")

DEEPSPEED_EQUIVALENT = {  # what to put in a DeepSpeed config for the same memory layout
    "ddp": '"zero_optimization": {"stage": 0}',
    "zero1": '"zero_optimization": {"stage": 1}',
    "zero2": '"zero_optimization": {"stage": 2}',
    "fsdp2": '"zero_optimization": {"stage": 3}',
}

PYTORCH_API = {
    "ddp": "DistributedDataParallel",
    "zero1": "DDP + torch.distributed.optim.ZeroRedundancyOptimizer",
    "zero2": "FSDP2 fully_shard(reshard_after_forward=False)",
    "fsdp2": "FSDP2 fully_shard (reshard_after_forward=True)",
}


def zero_formula(strategy: str, n_params: int, world: int, weight_bytes: int = 4, grad_bytes: int = 4,
                 optim_bytes: int = 8) -> DeviceMemory:
    """Per-device training state from the ZeRO paper (Rajbhandari et al. 2020), fp32 Adam by default:
    DDP replicates all; ZeRO-1 shards optimizer state; ZeRO-2 also gradients; ZeRO-3 (FSDP) also parameters."""
    shard = {"ddp": (1, 1, 1), "zero1": (1, 1, world), "zero2": (1, world, world), "fsdp2": (world, world, world)}
    if strategy not in shard:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(shard)}")
    w, g, o = shard[strategy]
    return DeviceMemory(params=n_params * weight_bytes // w, grads=n_params * grad_bytes // g,
                        optimizer=n_params * optim_bytes // o)


@dataclass(frozen=True)
class DPJob:
    """A data-parallel training run: every rank rebuilds the same seeded model and data."""

    strategy: str
    cfg: StackConfig
    batch: int = 32  # global batch, split evenly over the ranks
    steps: int = 3
    lr: float = 1e-3
    model_seed: int = 0
    data_seed: int = 0
    return_grads: bool = False
    bucket_mb: float = 25.0  # DDP gradient bucket size (PyTorch's default)


@dataclass
class DPResult:
    loss: float
    step_s: float
    step_times: list[float]
    events: list[Event]
    memory: list[DeviceMemory]  # per rank, after one step
    grads: list[torch.Tensor] = field(default_factory=list)  # full gradients, model.parameters() order


def check_dp_job(job: DPJob, world: int, capacity_bytes: int | None = None) -> None:
    """Refuse before spawning: unknown strategy, indivisible batch, a replica that cannot fit, nothing to shard."""
    if job.strategy not in DP_STRATEGIES:
        raise ValueError(f"unknown strategy {job.strategy!r}; choose one of {DP_STRATEGIES}")
    if job.batch % world:
        raise ValueError(f"global batch {job.batch} is not divisible by the data-parallel size {world}")
    with torch.device("meta"):
        model = build_stack(job.cfg)
    if job.strategy in ("zero2", "fsdp2"):
        shardable_children(model)
    if job.strategy in ("ddp", "zero1") and capacity_bytes is not None:
        n = count_params(model)
        need = training_state_bytes(n, "fp32 + Adam") if job.strategy == "ddp" else zero_formula("zero1", n, world)
        if need.total > capacity_bytes:
            raise ValueError(
                f"{job.strategy} keeps a full replica on every device: {fmt_bytes(need.total)} of weights, gradients "
                f"and Adam state, but a device has {fmt_bytes(capacity_bytes)}. Shard it (strategy 'zero2' or "
                "'fsdp2') or split it into pipeline stages (notebooks 05-06).")


def shardable_children(model: nn.Module) -> list[nn.Module]:
    """The layers FSDP2 shards one by one: direct children that own parameters."""
    children = [c for c in model.children() if any(True for _ in c.parameters())]
    if not children:
        raise ValueError(f"{type(model).__name__} has no child layers with parameters to shard: FSDP2 needs a "
                         "model built from layers (e.g. an nn.Sequential of blocks)")
    return children


def _allreduce_timeline_hook(rec: Recorder):
    """A DDP comm hook: the default all-reduce, with each bucket's span recorded as an `allreduce` event."""

    def hook(state, bucket):
        t0 = time.perf_counter()
        world = dist.get_world_size()
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()

        def done(f):
            rec.add("allreduce", t0, time.perf_counter(), bucket.index())
            return f.value()[0]

        return fut.then(done)

    return hook


def _wrap(job: DPJob, model: nn.Module, rec: Recorder):
    """The model and optimizer for the job's strategy."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if job.strategy in ("ddp", "zero1"):
        ddp = DDP(model, bucket_cap_mb=job.bucket_mb)
        ddp.register_comm_hook(None, _allreduce_timeline_hook(rec))
        if job.strategy == "ddp":
            return ddp, torch.optim.Adam(ddp.parameters(), lr=job.lr)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=job.lr)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our layers do no in-place ops on outputs
    mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    reshard = job.strategy == "fsdp2"
    for child in shardable_children(model):
        fully_shard(child, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.Adam(model.parameters(), lr=job.lr)


def _local_state_bytes(model: nn.Module, optimizer) -> DeviceMemory:
    from helpers.memory import grad_bytes, optimizer_state_bytes, param_bytes

    opt = optimizer.optim if hasattr(optimizer, "optim") else optimizer  # ZeroRedundancyOptimizer's local shard
    return DeviceMemory(param_bytes(model.parameters()), grad_bytes(model.parameters()),
                        optimizer_state_bytes(opt))


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        g = p.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()  # collective: every rank calls it
        out.append(g.detach().cpu().clone())
    return out


def data_parallel_worker(job: DPJob) -> dict:
    """One rank of a data-parallel job: warm-up, timed steps, one recorded step; memory after a step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = rank_device()
    model = build_stack(job.cfg, seed=job.model_seed).to(device)
    rec = Recorder(rank, device)
    wrapped, optimizer = _wrap(job, model, rec)
    x, y = SyntheticTokens(job.batch, job.cfg.seq_len, job.cfg.vocab, seed=job.data_seed).batch(0, job.batch)
    per = job.batch // world
    x, y = x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device)
    ledger = ledger_for([model], ["device"])
    times, first_loss, grads, memory = [], None, [], None
    for i in range(job.steps + 2):  # first step: parity and memory; then timed steps; last one recorded
        if i == job.steps + 1:
            rec.clear()
            ledger.reset_peaks()
        optimizer.zero_grad(set_to_none=False)
        dist.barrier()
        t0 = time.perf_counter()
        with rec.span("forward"), ledger.track_activations("device"):
            loss = lm_loss(wrapped(x), y)
        with rec.span("backward"):
            loss.backward()
        if i == 0:
            global_loss = loss.detach().clone()
            dist.all_reduce(global_loss)
            first_loss = global_loss.item() / world
            grads = _full_grads(model) if job.return_grads else []
        with rec.span("optimizer"):
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if 0 < i <= job.steps:
            times.append(time.perf_counter() - t0)
        if i == 0:
            memory = _local_state_bytes(model, optimizer)
    memory.activations = ledger.device("device").activations
    return {"loss": first_loss, "times": times, "events": gather_events(rec.events()), "memory": memory,
            "grads": grads if rank == 0 else []}


def run_data_parallel(job: DPJob, rig, nranks: int = 2, timeout: float = 300.0) -> DPResult:
    """Check, then run the job on `nranks` ranks; the step time is the slowest rank's, median over steps."""
    check_dp_job(job, nranks, rig.capacity_bytes[0])
    parts = run(data_parallel_worker, job, nranks=nranks, rig=rig, timeout=timeout)
    per_step = [max(p["times"][i] for p in parts) for i in range(len(parts[0]["times"]))]
    return DPResult(parts[0]["loss"], statistics.median(per_step), per_step, parts[0]["events"],
                    [p["memory"] for p in parts], parts[0]["grads"])


# --- DP x PP ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HybridJob:
    """dp replicas, each a pipeline of pp stages; ranks laid out on a (dp, pp) DeviceMesh, rank = d * pp + s."""

    cfg: StackConfig
    dp: int = 2
    pp: int = 2
    boundaries: tuple[int, ...] = ()
    schedule: str = "1f1b"
    microbatches: int = 4
    batch: int = 32  # global batch over all replicas
    steps: int = 2
    model_seed: int = 0
    data_seed: int = 0
    return_grads: bool = False

    @property
    def world(self) -> int:
        return self.dp * self.pp

    def cut(self) -> tuple[int, ...]:
        """The job's boundaries, or an even split of the layers into pp stages."""
        if self.boundaries:
            return self.boundaries
        from helpers.partition import equal_count_split

        return equal_count_split(self.cfg.n_blocks + 2, self.pp)


def check_hybrid_job(job: HybridJob, world: int) -> None:
    """Refuse before spawning: a mesh that is not the world, batches that do not divide, a bad pipeline."""
    from helpers.mp_engine import PipelineJob, check_job

    if job.dp * job.pp != world:
        raise ValueError(f"a {job.dp} x {job.pp} mesh has {job.dp * job.pp} devices but the world has {world} ranks")
    if job.batch % job.dp:
        raise ValueError(f"global batch {job.batch} is not divisible by the data-parallel size {job.dp}")
    check_job(PipelineJob(job.cfg, job.cut(), job.schedule, job.microbatches, job.batch // job.dp))


def average_grads(params: list[nn.Parameter], group) -> None:
    """Average gradients over `group` with one all-reduce of a flat buffer (one bucket, as DDP would)."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat.div_(dist.get_world_size(group))
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def dp_x_pp_worker(job: HybridJob) -> dict:
    """One rank of DP x PP: a pipeline stage of one replica; gradients averaged over the replicas of its stage."""
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.pipeline.comm import Wire
    from helpers.mp_engine import _Links, _our_step, pipeline_groups
    from helpers.pipeline.schedules import make_schedule
    from helpers.pipeline.stages import StageExecutor, stage_ranges

    world = dist.get_world_size()
    if world != job.world:
        raise ValueError(f"a {job.dp} x {job.pp} mesh has {job.world} devices but the world has {world} ranks")
    device = rank_device()
    mesh = init_device_mesh(device.type, (job.dp, job.pp), mesh_dim_names=("dp", "pp"))
    d, s = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    pp_ranks = mesh["pp"].mesh.tolist()  # global ranks of this replica's stages
    dp_group = mesh.get_group("dp")
    layers = list(build_stack(job.cfg, seed=job.model_seed))
    a, b = stage_ranges(len(layers), job.cut())[s]
    stage = nn.Sequential(*layers[a:b]).to(device)
    per = job.batch // job.dp
    x, y = SyntheticTokens(job.batch, job.cfg.seq_len, job.cfg.vocab, seed=job.data_seed).batch(0, job.batch)
    x, y = x[d * per:(d + 1) * per].to(device), y[d * per:(d + 1) * per].to(device)
    xs, ys = list(x.chunk(job.microbatches)), list(y.chunk(job.microbatches))
    rank = dist.get_rank()
    rec = Recorder(rank, device)
    ledger = ledger_for([stage], ["stage"])
    last = s == job.pp - 1
    ex = StageExecutor(stage, device, rank, rec, ledger.trackers()[0], lm_loss if last else None)
    with torch.no_grad():
        shape_in = nn.Sequential(*layers[:a])(xs[0]).shape if s > 0 else None
        shape_out = nn.Sequential(*layers[:b])(xs[0]).shape if not last else None
    # every rank creates every replica's link groups, in the same order
    groups = pipeline_groups([[r * job.pp + k for k in range(job.pp)] for r in range(job.dp)])
    links = _Links(s, job.pp, shape_in, shape_out, Wire(), device, True, job.microbatches, rec, pp_ranks, groups)
    actions = make_schedule(job.schedule, job.pp, job.microbatches)[s]
    times, losses = [], []
    for i in range(job.steps + 2):
        stage.zero_grad(set_to_none=False)
        if i == job.steps + 1:
            rec.clear()
        dist.barrier()
        t0 = time.perf_counter()
        loss = _our_step(ex, actions, links, xs, ys, job.microbatches)
        with rec.span("allreduce"):
            average_grads(list(stage.parameters()), dp_group)
        if 0 < i <= job.steps:
            times.append(time.perf_counter() - t0)
        if i == 0:
            losses.append(loss)
    grads = [p.grad.detach().cpu().clone() for p in stage.parameters()] if job.return_grads and d == 0 else []
    return {"dp": d, "pp": s, "loss": losses[0], "times": times, "events": gather_events(rec.events()),
            "grads": grads, "peak_activations": ledger.device("stage").activations}


@dataclass
class HybridResult:
    loss: float  # mean over replicas of the pipeline loss = the global batch's loss
    step_s: float
    events: list[Event]
    peak_activations: list[int]  # per rank
    grads: list[torch.Tensor]  # full model gradients (replica 0's stages in order)


def run_dp_x_pp(job: HybridJob, rig, timeout: float = 300.0) -> HybridResult:
    """Check, then run on dp * pp ranks (on the CPU rig, 2 cores are then shared by 4 ranks: timings mean little)."""
    check_hybrid_job(job, job.world)
    parts = run(dp_x_pp_worker, job, nranks=job.world, rig=rig, timeout=timeout,
                oversubscribe=rig.is_cpu)
    losses = [p["loss"] for p in parts if p["pp"] == job.pp - 1]
    per_step = [max(p["times"][i] for p in parts) for i in range(len(parts[0]["times"]))]
    return HybridResult(sum(losses) / len(losses), statistics.median(per_step), parts[0]["events"],
                        [p["peak_activations"] for p in parts],
                        [g for p in sorted(parts, key=lambda p: p["pp"]) if p["dp"] == 0 for g in p["grads"]])


def torchrun_dp_x_pp(dp: str = "2", pp: str = "2", batch: str = "16") -> str:
    """Entry point for torchrun (string arguments): `torchrun --nproc-per-node 4 -m helpers.runtime.launch
    helpers.parallel:torchrun_dp_x_pp 2 2 16`; across machines add --nnodes/--node-rank/--rdzv-endpoint."""
    job = HybridJob(StackConfig(hidden=64, n_blocks=4, heads=2), dp=int(dp), pp=int(pp), batch=int(batch))
    check_hybrid_job(job, dist.get_world_size())
    out = dp_x_pp_worker(job)
    return f"rank {dist.get_rank()}: replica {out['dp']}, stage {out['pp']}, step {statistics.median(out['times']):.3f} s"



# --- which strategy for two GPUs ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanOption:
    strategy: str
    per_device_bytes: int
    fits: bool


def plan_two_gpus(n_params: int, activation_bytes_per_sample: float, global_batch: int, capacity_bytes: int,
                  checkpoint_fraction: float, recipe: str = "mixed precision + Adam",
                  microbatches: int = 8) -> list[PlanOption]:
    """Per-device bytes of each way to train on two GPUs, from the ZeRO formulas and linear activations:
    DDP (full replica, half the batch each), FSDP2/ZeRO-3 (state halved, full model's activations for half the
    batch), a 2-stage 1F1B pipeline (state halved, half the layers x 2 micro-batches of batch/m in flight), and
    that pipeline with every block checkpointed (activations x `checkpoint_fraction`, see
    `memory.checkpointed_fraction`)."""
    state = training_state_bytes(n_params, recipe).total
    a = activation_bytes_per_sample
    options = [
        ("DDP (replicate)", state + a * global_batch / 2),
        ("FSDP2 / ZeRO-3 (shard)", state / 2 + a * global_batch / 2),
        ("pipeline 1F1B, 2 stages", state / 2 + (a / 2) * 2 * global_batch / microbatches),
        ("pipeline 1F1B + checkpointing", state / 2 + (a / 2) * 2 * global_batch / microbatches * checkpoint_fraction),
    ]
    return [PlanOption(name, int(b), b <= capacity_bytes) for name, b in options]


def choose_two_gpus(options: list[PlanOption]) -> str:
    """The first option that fits, in order of simplicity; else the honest answer."""
    for opt in options:
        if opt.fits:
            return opt.strategy
    return "does not fit two GPUs: more GPUs or machines (DP x PP, torchrun), or CPU offload"
