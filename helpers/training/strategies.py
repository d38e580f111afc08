"""The ways of spreading a model over devices, each applied to a rank's module by a small `apply_*` function over
the job's DeviceMesh, as torchtitan composes them. The one training loop (helpers.training.loop) then runs
whatever they return.

- `apply_ddp`: DistributedDataParallel over the mesh's "dp" group; a comm hook puts every gradient bucket's
  all-reduce on the timeline (timed with CUDA events on GPUs: the end is when the GPU finished, not when the host
  queued it). ZeRO-1 is DDP plus `ZeroRedundancyOptimizer` (`make_optimizer(..., zero1=True)`).
- `apply_fsdp`: FSDP2 `fully_shard` per layer and on the whole module, applied on the meta device; each rank then
  allocates only its shards and fills them with one device's weights (`reshard_after_forward=False` is ZeRO-2-like).
- `apply_pipeline`: one stage of a pipeline: our interpreter over point-to-point messages on the "pp" group, or
  torch.distributed.pipelining's schedules.
- `sum_replica_grads`: DP x PP, each stage's gradients summed over its replicas in one flat all-reduce.
"""
from __future__ import annotations

import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from helpers.memory import DeviceMemory
from helpers.models.data import lm_loss_sum
from helpers.models.layered import LayeredModel, Stage
from helpers.pipeline.comm import Wire
from helpers.pipeline.interpreter import MicroBatch, run_stage
from helpers.pipeline.schedules import make_schedule
from helpers.pipeline.stages import StageExecutor
from helpers.pipeline.transports import P2PTransport
from helpers.timeline import Recorder

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

PipelineStep = Callable[[Sequence[MicroBatch], float], "torch.Tensor | None"]


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


def allreduce_hook(rec: Recorder, group):
    """A DDP comm hook: PyTorch's default (average the bucket over the group), each bucket recorded as an
    `allreduce` span from the moment backward handed it over to the moment the collective finished."""

    def hook(state, bucket):
        mark = rec.start()
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        fut = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def done(f):
            rec.finish(mark, "allreduce", bucket.index())
            return f.value()[0]

        return fut.then(done)

    return hook


def apply_ddp(module: nn.Module, group, device: torch.device, bucket_mb: float, rec: Recorder) -> nn.Module:
    """Replicate `module` over `group`; gradients are averaged bucket by bucket during backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
              bucket_cap_mb=bucket_mb)
    ddp.register_comm_hook(None, allreduce_hook(rec, group))
    return ddp


def apply_fsdp(module: Stage, model: LayeredModel, first_layer: int, mesh, device: torch.device,
               reshard_after_forward: bool) -> nn.Module:
    """Shard the meta-device `module` (layers first_layer.. of `model`) layer by layer, then allocate this rank's
    shards on `device` and fill them with exactly the values one device would hold (one layer at a time is
    materialised in host memory to cut its shards out)."""
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our layers do no in-place ops on outputs
    for layer in module.layers:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    module.to_empty(device=device)
    rank, world = mesh.get_local_rank(), mesh.size()
    reference = model.meta_layers()
    with torch.no_grad():
        for offset, layer in enumerate(module.layers):
            i = first_layer + offset
            model.materialize(reference, [i], torch.device("cpu"))
            full = dict(reference[i].named_parameters())
            for name, param in layer.named_parameters():
                chunks = full[name].chunk(world, dim=0)
                if rank < len(chunks):
                    param.to_local().copy_(chunks[rank])
            for name, buf in layer.named_buffers():
                buf.copy_(dict(reference[i].named_buffers())[name])
            reference[i] = None
    return module


def make_optimizer(name: str, params, lr: float, zero1: bool = False):
    """None, SGD or Adam; with `zero1`, Adam/SGD state sharded over the ranks by ZeroRedundancyOptimizer."""
    if name == "none":
        return None
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[name]
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=lr)
    return cls(params, lr=lr)


def sum_replica_grads(params: list[nn.Parameter], group, rec: Recorder) -> None:
    """DP x PP: add up each stage's gradients over its replicas, one all-reduce of a flat buffer (one bucket). Sum,
    not mean: every replica's loss is already divided by the kept tokens of the global batch."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    with rec.span("allreduce"):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


# --- pipelines -----------------------------------------------------------------------------------------------------

def _instrument_stage(pstage, rec: Recorder) -> None:
    """Put torch.distributed.pipelining's per-micro-batch work on our timeline: its stage runs each micro-batch
    through forward_one_chunk / backward_one_chunk, so wrapping those two methods records every span (the library's
    sends and receives happen outside them and stay invisible)."""
    forward, backward = pstage.forward_one_chunk, pstage.backward_one_chunk

    def forward_one_chunk(fwd_chunk_id: int, *args, **kwargs):
        with rec.span("forward", fwd_chunk_id):
            return forward(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(bwd_chunk_id: int, *args, **kwargs):
        with rec.span("backward", bwd_chunk_id):
            return backward(bwd_chunk_id, *args, **kwargs)

    pstage.forward_one_chunk, pstage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _torch_pipeline(module: Stage, stage: int, p: int, schedule: str, m: int, device, group, rec: Recorder,
                    track: Callable) -> PipelineStep:
    """torch.distributed.pipelining on the same stage. Its loss is our token loss over the global batch's kept
    tokens, with its own 1/m scaling switched off, so both engines compute the same gradients."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pstage = PipelineStage(module, stage, p, device, group=group)
    _instrument_stage(pstage, rec)
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    normalizer = [1.0]
    sched = cls(pstage, m, loss_fn=lambda out, target: lm_loss_sum(out, target) / normalizer[0], scale_grads=False)

    def step(microbatches: Sequence[MicroBatch], norm: float) -> torch.Tensor | None:
        normalizer[0] = norm
        with track():
            if stage == 0:
                sched.step(torch.cat([mb.inputs for mb in microbatches]))
                return None
            if stage == p - 1:
                losses: list[torch.Tensor] = []
                sched.step(target=torch.cat([mb.targets for mb in microbatches]), losses=losses)
                return torch.stack([l.detach() for l in losses]).sum()
            sched.step()
            return None

    return step


def apply_pipeline(module: Stage, stage: int, p: int, schedule: str, m: int, engine: str, group,
                   shapes: dict[str, tuple], wire: Wire, overlap: bool, device: torch.device, rec: Recorder,
                   track: Callable) -> PipelineStep:
    """Stage `stage` of a `p`-stage pipeline over `group` (whose rank i is stage i). The returned step runs one
    global batch's micro-batches and returns this stage's summed loss shares (last stage) or None."""
    if engine == "torch":
        return _torch_pipeline(module, stage, p, schedule, m, device, group, rec, track)
    ex = StageExecutor(module, device, stage, rec, track, computes_loss=stage == p - 1)
    actions = make_schedule(schedule, p, m)[stage]
    transport = P2PTransport(group, stage, shapes, wire, device, rec, overlap)
    return lambda microbatches, norm: run_stage(ex, actions, transport, microbatches, p, norm)
