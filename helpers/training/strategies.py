"""The ways of spreading a model over devices, each applied to a rank's module by a small `apply_*` function over
the job's DeviceMesh, as torchtitan composes them (`apply_ddp`; ZeRO-1 is DDP plus `make_optimizer(..., zero1=True)`;
`apply_fsdp`; `apply_pipeline`; DP x PP adds `sum_replica_grads`). The one training loop (helpers.training.loop) then
runs whatever they return."""
from __future__ import annotations

import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from helpers.catalog import schedule_entry
from helpers.models.data import lm_loss_sum
from helpers.models.layered import LayeredModel, Stage, tie_parameters_
from helpers.pipeline.comm import Wire
from helpers.pipeline.interpreter import MicroBatch, communication_plan, run_stage
from helpers.pipeline.schedules import Layout, layout_for, make_schedule, weights_in_groups
from helpers.pipeline.stages import StageExecutor, stage_ranges
from helpers.pipeline.transports import P2PTransport
from helpers.dtypes import DTYPES
from helpers.precision import Precision
from helpers.runtime.launch import release_host_memory
from helpers.runtime.host import mark_offloaded, preparing_on
from helpers.timeline import Recorder

PipelineStep = Callable[[Sequence[MicroBatch], float, float], "torch.Tensor | None"]
TiedPair = tuple[tuple[int, str], tuple[int, str]]


def allreduce_hook(rec: Recorder, group, wire: Wire = Wire()):
    """A DDP comm hook: PyTorch's default (average the bucket over the group), each bucket recorded as an
    `allreduce` span from the moment backward handed it over to the moment the collective finished (on GPUs, when the
    GPU finished it, not when the host queued it). A `wire` in
    another dtype sends the bucket in it and copies the result back (PyTorch's `bf16_compress_hook`, on any backend:
    half the bytes in bf16, and gloo reduces bf16 too)."""

    def hook(state, bucket):
        mark = rec.start()
        buffer = bucket.buffer()
        sent = wire.pack(buffer.div_(dist.get_world_size(group)))
        fut = dist.all_reduce(sent, group=group, async_op=True).get_future()

        def done(f):
            rec.finish(mark, "allreduce", bucket.index())
            reduced = f.value()[0]
            return reduced if sent is buffer else buffer.copy_(reduced)  # no cast sent: reduced in place

        return fut.then(done)

    return hook


def apply_ddp(module: nn.Module, group, device: torch.device, bucket_mb: float, rec: Recorder,
              wire: Wire = Wire()) -> nn.Module:
    """Replicate `module` over `group`; gradients are averaged bucket by bucket during backward, sent as `wire`
    carries them."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None, process_group=group,
              bucket_cap_mb=bucket_mb, gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, allreduce_hook(rec, group, wire))
    return ddp


def tied_pairs(model: LayeredModel) -> list[TiedPair]:
    """The model's tied weights as ((layer, name), (layer, name)) pairs; none for models without ties."""
    return list(getattr(model, "tied_parameters", lambda: [])())


def weights_in(module: nn.Module, model: LayeredModel, precision: Precision) -> nn.Module:
    """`module` in the job's weight dtype, unless the model keeps its own dtypes (a LoRA model: frozen base in its
    dtype or NF4, adapters in fp32)."""
    return module if getattr(model, "own_dtypes", False) else module.to(precision.weights)


def apply_fsdp(module: Stage, model: LayeredModel, first_layer: int, mesh, device: torch.device,
               reshard_after_forward: bool, precision: Precision = Precision(), offload: bool = False) -> nn.Module:
    """Shard the meta-device `module` (layers first_layer.. of `model`) layer by layer, then allocate this rank's
    shards on `device` and fill them with exactly the values one device would hold (one layer at a time is
    materialised in host memory to cut its shards out). Mixed precision is FSDP2's own `MixedPrecisionPolicy`:
    parameters gathered in the autocast dtype, gradients reduced in fp32. Tied weights are one parameter again
    (FSDP2 needs a shared parameter in one unit: the layers holding it are left to the root's unit).
    `offload`: FSDP2's `CPUOffloadPolicy`: shards, their gradients and the optimizer step stay in host memory, each
    unit copied to `device` for its all-gather (pinned host memory on GPUs; on the CPU rig the copy is to the same
    memory, so it runs the same code and moves nothing). `reshard_after_forward=False` is ZeRO-2-like."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # our layers do no in-place ops on outputs
    module = weights_in(module, model, precision)
    pairs = [((i - first_layer, a), (j - first_layer, b)) for (i, a), (j, b) in tied_pairs(model)]
    tie_parameters_(module.layers, pairs)
    tied_layers = {i for pair in pairs for i, _ in pair}
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision.autocast], reduce_dtype=torch.float32) \
        if precision.autocast else MixedPrecisionPolicy()
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    for i, layer in enumerate(module.layers):
        if i not in tied_layers and any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp,
                        offload_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=policy)
    module.to_empty(device=torch.device("cpu") if offload else device)
    rank, world = mesh.get_local_rank(), mesh.size()
    reference = model.meta_layers()
    with host_threads(), preparing_on(device):  # QLoRA's quantization on the rank's GPU, where it has one
        for offset, layer in enumerate(module.layers):
            model.materialize(reference, [first_layer + offset], torch.device("cpu"))
            fill_shards(layer, reference[first_layer + offset], rank, world)
            reference[first_layer + offset] = None
            release_host_memory()
    if offload:  # FSDP2 offloads parameters only: buffers (rotary frequencies) belong on the compute device
        mark_offloaded(module)  # the shards and their gradients are host memory, which NCCL does not serve
        for sub in module.modules():
            for name, buf in sub.named_buffers(recurse=False):
                setattr(sub, name, buf.to(device))
    return module


@contextmanager
def host_threads() -> Iterator[None]:
    """Run a block (reading and quantizing a checkpoint on the host) with this rank's share of the machine's cores:
    torchrun sets OMP_NUM_THREADS=1, and torchao's NF4 quantization of a 70B base on one thread per rank would take
    hours. The caller's thread count is restored after."""
    import os

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fill_shards(sharded: nn.Module, full: nn.Module, rank: int, world: int) -> None:
    """Give every parameter of `sharded` (a module after `fully_shard` and `to_empty`) this rank's dim-0 chunk of
    the same-named parameter of `full` (one device's values, on the host), and every buffer of `full` whole: how a
    rank fills its shards one layer at a time, so the whole model is never in its memory. Names of `full` only:
    `full` may be a part (the root without its decoder layers). A parameter `fully_shard` did not shard (one
    process) gets the whole tensor."""
    from torch.distributed.tensor import DTensor

    params = dict(sharded.named_parameters())
    buffers = dict(sharded.named_buffers())
    with torch.no_grad():
        for name, value in full.named_parameters():
            param = params[name]
            chunks = value.chunk(world, dim=0) if isinstance(param, DTensor) else (value,)
            if rank >= len(chunks):  # fewer rows than ranks: FSDP2 gives this rank an empty shard
                continue
            local = param.to_local() if isinstance(param, DTensor) else param
            if hasattr(local, "__tensor_flatten__"):
                _assign_shard(sharded, name, param, chunks[rank])
            else:
                local.copy_(chunks[rank])
        for name, value in full.named_buffers():
            buffers[name].copy_(value)


def _assign_shard(layer: nn.Module, name: str, param: nn.Parameter, shard: torch.Tensor) -> None:
    """Give a sharded parameter that is a tensor subclass (an NF4 weight: 4-bit codes, scales, their mean, a lookup
    table) its shard by replacing the parameter: copying into the meta-built one would fill only the parts FSDP2
    shards. FSDP2 adopts the new parameter at its lazy init (`reset_sharded_param`, as after
    `load_state_dict(assign=True)`). The new parameter keeps the old one's `requires_grad` (False for a frozen
    base), as it must: `nn.Parameter` alone would make it trainable. Unsharded (one process): the whole tensor."""
    from torch.distributed.tensor import DTensor

    device = param.to_local().device if isinstance(param, DTensor) else param.device
    # torchao's NF4 `chunk` returns views of the whole weight and its `.to` is a no-op on the same device: under CPU
    # offload every rank would keep the whole NF4 weight alive through its shard. A clone holds this rank's share.
    local = _own_copy(shard) if shard.device == device else shard.to(device)
    owner, _, leaf = name.rpartition(".")
    if isinstance(param, DTensor):
        local = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False)
    setattr(layer.get_submodule(owner) if owner else layer, leaf,
            nn.Parameter(local, requires_grad=param.requires_grad))


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A tensor subclass (NF4) rebuilt from copies of its inner tensors: no view of a larger tensor kept alive."""
    names, meta = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: getattr(t, n).clone() for n in names}, meta, t.size(), t.stride())


def make_optimizer(name: str, params, lr: float, zero1: bool = False, in_backward: bool = False):
    """None, SGD, Adam, AdamW or torchao's 8-/4-bit AdamW over the parameters that train (a frozen base has none of
    its own); with `zero1`, the state sharded over the ranks by ZeroRedundancyOptimizer; with `in_backward`, one
    optimizer per parameter stepped in backward (helpers.training.memory_techniques.OptimizerInBackward)."""
    from helpers.training.memory_techniques import LOW_BIT, OptimizerInBackward, low_bit_adamw

    if name == "none":
        return None
    params = [p for p in params if p.requires_grad]
    if name in LOW_BIT:
        make = lambda ps: low_bit_adamw(name, ps, lr)  # noqa: E731
    else:
        cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
        make = lambda ps: cls(ps, lr=lr)  # noqa: E731
    if in_backward:
        return OptimizerInBackward(params, make)
    if zero1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, lr=lr)
    return make(params)


def clip_gradients(params, max_norm: float, optimizer, scaler) -> torch.Tensor:
    """Scale the gradients so their global norm is at most `max_norm` (unscaled first under loss scaling); FSDP2's
    DTensor shards give the norm of the whole model's gradients. Returns the norm before clipping."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm)


def step_optimizer(optimizer, scaler) -> None:
    """One optimizer step; with a gradient scaler, skipped on every rank alike when any rank overflowed."""
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


class TiedCopies:
    """The copies of tied weights (embedding and head) that live on this rank when they sit on different pipeline
    stages, as Megatron keeps them: identical at the start, and after every backward each copy's gradient becomes
    the sum of both, so they stay identical after any number of optimizer steps."""

    def __init__(self, params: list[nn.Parameter], groups: list):
        self.params, self.groups = params, groups

    def sync(self, rec: Recorder) -> None:
        for p, group in zip(self.params, self.groups):
            with rec.span("allreduce"):
                dist.all_reduce(p.grad, group=group)


def tied_copies(model: LayeredModel, module: Stage, owned: list[int], job, mesh) -> TiedCopies:
    """Create, on every rank in the same order, one group per replica and tied pair whose two uses sit on
    different devices; return this rank's copies and their groups. Checks the copies are equal to begin with. Two
    uses on one device (one stage, or the first and last stage of a V-shaped schedule) are one weight already.
    `owned[k]`: the global index of module.layers[k]."""
    params, groups = [], []
    if job.pp == 1:
        return TiedCopies([], [])
    ranges = stage_ranges(job.n_layers, job.cut())
    device_of = {i: job.layout.device_of(s) for s, (lo, hi) in enumerate(ranges) for i in range(lo, hi)}
    position = {index: k for k, index in enumerate(owned)}
    my_rank = dist.get_rank()
    for (i, name_i), (j, name_j) in tied_pairs(model):
        di, dj = device_of[i], device_of[j]
        if di == dj:  # both on one device: `materialize` made them one weight
            continue
        for replica in range(job.dp):
            ranks = [replica * job.pp + di, replica * job.pp + dj]
            group = dist.new_group(ranks)
            if my_rank in ranks:
                index, name = (i, name_i) if my_rank == ranks[0] else (j, name_j)
                param = module.layers[position[index]].get_parameter(name)
                _check_tied_in_sync(param, group, (i, name_i), (j, name_j))
                params.append(param)
                groups.append(group)
    return TiedCopies(params, groups)


def _check_tied_in_sync(param: nn.Parameter, group, first: tuple[int, str], second: tuple[int, str]) -> None:
    """Both copies of a tied weight must start equal (loaded from the same checkpoint tensor)."""
    with torch.no_grad():
        mine = param.detach().float()
        other = mine.clone()
        dist.all_reduce(other, op=dist.ReduceOp.MAX, group=group)
        low = mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        if not torch.equal(other, low):
            raise ValueError(f"tied weights out of sync: layer {first[0]}'s {first[1]} and layer {second[0]}'s "
                             f"{second[1]} differ (max |diff| {(other - low).abs().max().item():.3g}); they must "
                             "be loaded from one tensor")


def sum_replica_grads(params: list[nn.Parameter], group, rec: Recorder) -> None:
    """DP x PP: add up each stage's gradients over its replicas, one all-reduce of a flat buffer (one bucket). Sum,
    not mean: every replica's loss is already divided by the kept tokens of the global batch."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    with rec.span("allreduce"):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


# --- pipelines -----------------------------------------------------------------------------------------------------

class _ChunkContexts(nn.Module):
    """A stage for torch.distributed.pipelining, which passes a stage only the hidden state: the micro-batch's
    context (masks, positions) is looked up by the chunk it runs, and autocast applied around it."""

    def __init__(self, stage: Stage, precision: Precision, device: torch.device):
        super().__init__()
        self.stage, self.precision, self.device = stage, precision, device
        self.contexts: list = []
        self.current: int = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ctx = self.contexts[self.current] if self.contexts else None
        with self.precision.context(self.device):
            return self.stage(h, ctx) if ctx is not None else self.stage(h)


def _instrument_stage(pstage, rec: Recorder, wrapper: _ChunkContexts, stage: int) -> None:
    """Put torch.distributed.pipelining's per-micro-batch work on our timeline: its stage runs each micro-batch
    through forward_one_chunk / backward_one_chunk (and, for zero-bubble schedules, backward_weight_one_chunk), so
    wrapping those methods records every span (the library's sends and receives happen outside them and stay
    invisible), and tells the stage which context is current."""
    def recorded(method, span: str):
        def run(chunk_id: int, *args, **kwargs):
            if span == "forward":
                wrapper.current = chunk_id
            with rec.span(span, chunk_id, stage):
                return method(chunk_id, *args, **kwargs)
        return run

    for name, span in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                       ("backward_weight_one_chunk", "weight")):
        setattr(pstage, name, recorded(getattr(pstage, name), span))


def _torch_pipeline(chunks: Sequence[Stage], device_index: int, layout: Layout, schedule: str, m: int, device,
                    group, rec: Recorder, track: Callable, precision: Precision) -> PipelineStep:
    """torch.distributed.pipelining on the same stages (one `PipelineStage` per chunk). Its loss is our token loss
    over the global batch's kept tokens (times the loss scale), with its own 1/m scaling switched off, so both
    engines compute the same gradients."""
    from torch.distributed import pipelining

    stages = layout.stages_of(device_index)
    wrappers = [_ChunkContexts(chunk, precision, device) for chunk in chunks]
    pstages = [pipelining.PipelineStage(w, k, layout.stages, device, group=group) for w, k in zip(wrappers, stages)]
    for pstage, wrapper, k in zip(pstages, wrappers, stages):
        _instrument_stage(pstage, rec, wrapper, k)
    cls = getattr(pipelining, schedule_entry(schedule).torch_class)
    factor = [1.0]  # loss scale / normalizer of the current step
    loss_fn = lambda out, target: lm_loss_sum(out, target) * factor[0]  # noqa: E731
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
    sched = cls(pstages if multi else pstages[0], m, loss_fn=loss_fn, scale_grads=False)
    first, last = 0 in stages, layout.stages - 1 in stages

    def step(microbatches: Sequence[MicroBatch], norm: float, loss_scale: float = 1.0) -> torch.Tensor | None:
        factor[0] = loss_scale / norm
        for w in wrappers:
            w.contexts = [mb.context for mb in microbatches] if microbatches[0].context is not None else []
        args = (torch.cat([mb.inputs for mb in microbatches]),) if first else ()
        losses: list[torch.Tensor] = []
        kwargs = {"target": torch.cat([mb.targets for mb in microbatches]), "losses": losses} if last else {}
        with track():
            sched.step(*args, **kwargs)
        return torch.stack([l.detach() for l in losses]).sum() / loss_scale if last else None

    return step


def apply_pipeline(chunks: Stage | Sequence[Stage], stage: int, p: int, schedule: str, m: int, engine: str, group,
                   shapes: dict[int, tuple], wire: Wire, overlap: bool, device: torch.device, rec: Recorder,
                   track: Callable, precision: Precision = Precision(), batched_weights: int = 1) -> PipelineStep:
    """Device `stage` of a `p`-device pipeline over `group` (whose rank i is device i), holding the model stage
    `chunks` (or, for schedules with several stages per device, one module per chunk, in chunk order). The returned
    step runs one global batch's micro-batches and returns this device's summed loss shares (where the last stage
    runs) or None. `shapes[b]`: what crosses boundary b. `batched_weights`: our engine runs the weight passes that
    many micro-batches at a time (`weights_in_groups`)."""
    chunks = [chunks] if isinstance(chunks, Stage) else list(chunks)
    layout = layout_for(schedule, p)
    if engine == "torch":
        return _torch_pipeline(chunks, stage, layout, schedule, m, device, group, rec, track, precision)
    executors = [StageExecutor(chunk, device, k, rec, track, computes_loss=k == layout.stages - 1,
                               precision=precision) for chunk, k in zip(chunks, layout.stages_of(stage))]
    full = weights_in_groups(make_schedule(schedule, p, m), batched_weights)
    actions, plan = full[stage], communication_plan(full)[stage]
    transport = P2PTransport(group, stage, shapes, wire, device, rec, overlap, layout)
    return lambda microbatches, norm, loss_scale=1.0: run_stage(executors, actions, transport, microbatches, layout,
                                                               norm, loss_scale, plan, batched_weights > 1)
