"""The pieces a notebook's GPU plan is made of: what a model, a step, a pipeline or a group of ranks keeps on each GPU.

A notebook declares its own plan in the cell after its parameters (`check_plan(..., phases=...)`): a function of
the rig that lists its heaviest moments (`Phase`), each the parts alive then, built with these functions from the
notebook's own constants. Nothing here knows any notebook. The notebook process gives its cached memory back before
ranks start (`helpers.runtime.launch.run` empties PyTorch's cache), so a phase with ranks counts the notebook's live
tensors only.
"""
from __future__ import annotations

from typing import Sequence

from helpers.catalog import strategy as catalog_entry
from helpers.gpu_sizes.footprint import Footprint, ModelSpec, Replay, held, n_layers, stage_bytes, training_step
from helpers.gpu_sizes.plans import NOTEBOOK, Part
from helpers.models.stack import StackConfig
from helpers.partition import equal_count_split
from helpers.pipeline.schedules import layout_for, make_schedule, peak_in_flight


def halves(spec: ModelSpec) -> tuple[range, range]:
    """Where the notebooks cut in two: `len(model) // 2`; the training jobs' equal-count split agrees for an even
    number of layers and puts the extra layer first otherwise."""
    n = n_layers(spec)
    (cut,) = equal_count_split(n, 2)
    return range(0, cut), range(cut, n)


def keep(what: str, spec: ModelSpec, grads: bool = True, optimizer: str | None = None, device: int = 0,
         layers: Sequence[int] | None = None, process: str = NOTEBOOK) -> Part:
    """A model (or its `layers`) alive on `device` between steps."""
    return Part(what, device, held(stage_bytes(spec, 1, layers).params, grads, optimizer), process)


def keep_split(what: str, spec: ModelSpec, grads: bool = True, optimizer: str | None = None) -> list[Part]:
    """A two-stage copy of the model alive between steps: stage s on device s."""
    return [keep(f"{what}, stage {s}", spec, grads, optimizer, s, layers) for s, layers in enumerate(halves(spec))]


def step(what: str, spec: ModelSpec, batch: int, optimizer: str = "sgd", device: int = 0,
         layers: Sequence[int] | None = None, in_flight: int = 1, keeps_outputs: bool = False, autocast: bool = False,
         process: str = NOTEBOOK, state_shards: int = 1) -> Part:
    """A model training one step (its weights, grads and state included) at micro-batch `batch`. A whole block
    stack's step is recorded for the GPU suite to rerun alone."""
    stage = stage_bytes(spec, batch, layers, autocast=autocast)
    alone = isinstance(spec, StackConfig) and layers is None and in_flight == 1 and state_shards == 1
    return Part(what, device, training_step(stage, optimizer, in_flight, keeps_outputs, autocast, state_shards),
                process, Replay(spec, batch, optimizer, autocast) if alone else None)


def stage_ranges(spec: ModelSpec, schedule: str, cuts: Sequence[int] | None = None) -> list[range]:
    """The layers of each stage of `schedule` on two devices, cut at `cuts` (default: in two halves, or in equal
    stages for a schedule with several stages per device)."""
    stages, n = layout_for(schedule, 2).stages, n_layers(spec)
    if cuts is None:
        cuts = [len(halves(spec)[0])] if stages == 2 else [round(k * n / stages) for k in range(1, stages)]
    bounds = [0, *cuts, n]
    if len(bounds) - 1 != stages:
        raise ValueError(f"{schedule} runs {stages} stages on two devices; cuts {list(cuts)} make {len(bounds) - 1}")
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def device_layers(spec: ModelSpec, schedule: str, cuts: Sequence[int] | None = None) -> list[list[int]]:
    """The layers each of the two devices holds under `schedule`'s layout (all its stages)."""
    layout, ranges = layout_for(schedule, 2), stage_ranges(spec, schedule, cuts)
    return [[i for c in range(layout.chunks) for i in ranges[layout.stage(d, c)]] for d in range(2)]


def keep_pipeline(what: str, spec: ModelSpec, schedule: str, cuts: Sequence[int] | None = None,
                  grads: bool = True, optimizer: str | None = None) -> list[Part]:
    """A pipeline's copy of the model alive between steps, each device holding its stages under `schedule`."""
    return [keep(f"{what}, device {d}", spec, grads, optimizer, d, layers)
            for d, layers in enumerate(device_layers(spec, schedule, cuts))]


def pipeline(what: str, spec: ModelSpec, batch: int, m: int, schedule: str = "gpipe", optimizer: str = "sgd",
             ranks: bool = False, autocast: bool = False, torch_engine: bool = False,
             cuts: Sequence[int] | None = None) -> list[Part]:
    """A pipeline step over two devices, global batch `batch` in `m` micro-batches, cut at `cuts` (see
    `stage_ranges`): each device holds its stages' weights and, at every moment of its action list, the saved
    activations of the (chunk, micro-batch) pairs whose forward ran and whose backward (or, where it is split, its
    weight pass) has not yet freed them; a stage that is not the last also keeps each one's output until its
    gradient comes back. The plan takes the heaviest moment of the walk (GPipe: all m; 1F1B: p on the first device;
    ZB-H1's last device: 2; the V shapes: up to 5 half-stage chunks). `ranks`: one process per device (else threads
    of the notebook). torch.distributed.pipelining also allocates, per stage and micro-batch, a receive buffer for
    activations and one for gradients (counted on every stage)."""
    layout, ranges = layout_for(schedule, 2), stage_ranges(spec, schedule, cuts)
    mb, last = batch // m, layout.stages - 1
    boundary = max(stage_bytes(spec, mb, r).output for r in ranges[:-1])  # what crosses between stages
    parts = []
    for d, (actions, layers) in enumerate(zip(make_schedule(schedule, 2, m), device_layers(spec, schedule, cuts))):
        chunks = [stage_bytes(spec, mb, ranges[layout.stage(d, c)], autocast=autocast) for c in range(layout.chunks)]
        casts = [c.params // 2 if autocast else 0 for c in chunks]  # autocast's 16-bit weight copies per micro-batch
        held_by = [c.activations + casts[k] + (c.output if layout.stage(d, k) != last else 0)
                   for k, c in enumerate(chunks)]
        peak = peak_in_flight(actions, held_by.__getitem__)
        fp = training_step(stage_bytes(spec, mb, layers, autocast=autocast), optimizer, autocast=autocast,
                           activations_held=peak)
        if torch_engine:
            fp = fp + Footprint(workspace=2 * layout.chunks * m * boundary)
        parts.append(Part(f"{what}, device {d}", d, fp, f"rank {d}" if ranks else NOTEBOOK))
    return parts


def data_parallel(what: str, spec: ModelSpec, batch: int, strategy: str, optimizer: str = "adam",
                  world: int = 2, autocast: bool = False) -> list[Part]:
    """One rank per device, each with a replica (DDP, ZeRO-1) or a shard (FSDP2) and batch / world sequences (in one
    step: accumulation steps hold less). DDP copies gradients into its buckets (as many bytes again); ZeRO-1 keeps
    1/N of the optimizer state; FSDP2 keeps 1/N of weights, grads and state, gathers whole layers around the one
    computing (two gathered: the current and the prefetched; ZeRO-2-like `reshard_after_forward=False` keeps every
    gathered layer from forward to backward) and reduce-scatters each layer's whole gradient (two in flight)."""
    stage = stage_bytes(spec, batch // world, autocast=autocast)
    parts = []
    for r in range(world):
        if catalog_entry(strategy).bucketed:
            fp = training_step(stage, optimizer, autocast=autocast, state_shards=world if strategy == "zero1" else 1)
            fp = fp + Footprint(grads=stage.params)  # the buckets
        else:
            whole, layer = training_step(stage, optimizer, autocast=autocast), stage.largest_layer_params
            gathered = stage.params if strategy == "zero2" else 2 * layer
            fp = Footprint(whole.weights // world + gathered, whole.grads // world + 2 * layer,
                           whole.optimizer // world, whole.activations, whole.workspace)
        parts.append(Part(f"{what}, rank {r}", r, fp, f"rank {r}"))
    return parts


def small_ranks(what: str, nbytes: int, world: int = 2) -> list[Part]:
    """Ranks that compute on small tensors (link benchmarks, demo spans): their contexts matter, not their bytes."""
    return [Part(f"{what}, rank {r}", r, Footprint(workspace=nbytes), f"rank {r}") for r in range(world)]


def training_ranks(what: str, plan) -> list[Part]:
    """The ranks of a fine-tuning run as the training-memory planner accounts them (a
    `helpers.finetune.memory_plan.TrainingPlan`), one process per GPU."""
    return [Part(f"{what}, rank {d.device}", d.device, Footprint(
        weights=d.frozen_bytes + d.trainable_bytes, grads=d.gradient_bytes, optimizer=d.optimizer_bytes,
        activations=d.activation_bytes, workspace=max(d.workspace_bytes, d.step_bytes - d.activation_bytes)),
        f"rank {d.device}") for d in plan.devices]


def generation(what: str, placement) -> list[Part]:
    """A model generating as the inference planner places it (a `helpers.inference.plan` placement): weights, KV cache
    and workspace per device, in the notebook's process."""
    return [Part(f"{what}, device {d.device}", d.device, Footprint(weights=d.weights_bytes, activations=d.kv_cache_bytes,
                                                                   workspace=d.workspace_bytes))
            for d in placement.devices]
