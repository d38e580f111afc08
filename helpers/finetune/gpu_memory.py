"""One GPU's share of a training plan (`helpers.finetune.memory_plan`), part by part: weights, gradients, optimizer
state, activations, workspace and reserve, and what its rank holds in host RAM while it loads; the figures and the
assumptions they rest on are the planner's module docstring's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from helpers.finetune.training_request import TrainingRequest
from helpers.partition import equal_count_split
from helpers.sizing.activations import activation_workspace_bytes
from helpers.sizing.gpus import GpuShare
from helpers.sizing.shape import span
from helpers.sizing.state import training_data
from helpers.sizing.training import (FP32, INT64, TORCHAO_NF4, Activations, TrainShape, Unit, chunked_loss_tokens,
                                     saved_activation_bytes)


@dataclass(frozen=True)
class GpuTraining(GpuShare):
    """What one GPU holds during a training step, by part. `peak_bytes` is the most it needs at once: the state
    plus, during forward and backward, activations and workspace, or, during the optimizer step, its temporaries."""

    layers: str
    frozen_bytes: int  # frozen weights (quantization constants included) and buffers
    constants_bytes: int  # of which quantization constants
    trainable_bytes: int  # trainable weights as the model holds them
    gradient_bytes: int  # gradients (with DDP's bucket copy)
    optimizer_bytes: int  # moments, and the fp32 master copy where the model holds 16-bit weights
    activation_bytes: int  # under the chosen checkpointing
    activations_checkpointed_bytes: int
    activations_full_bytes: int
    workspace: dict = field(default_factory=dict)  # name -> bytes, each an estimate
    step_bytes: int = 0  # optimizer-step temporaries on this GPU
    host: dict = field(default_factory=dict)  # part -> bytes CPU offload keeps in host RAM for this GPU's shard
    loading: dict = field(default_factory=dict)  # part -> bytes of this rank's host RAM at the peak of its load

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def loading_bytes(self) -> int:
        """This rank's host RAM at the peak of streaming its weights from the checkpoint (see `_loading`)."""
        return sum(self.loading.values())

    @property
    def label(self) -> str:
        return f"cuda:{self.device} {self.gpu.name}"

    @property
    def workspace_bytes(self) -> int:
        return sum(self.workspace.values())

    @property
    def state_bytes(self) -> int:
        return self.frozen_bytes + self.trainable_bytes + self.gradient_bytes + self.optimizer_bytes

    in_backward: bool = False  # the optimizer steps during backward (optimizer-in-backward): beside the activations

    @property
    def used_bytes(self) -> int:
        if self.in_backward:
            return self.state_bytes + self.activation_bytes + self.workspace_bytes + self.step_bytes
        return self.state_bytes + max(self.activation_bytes + self.workspace_bytes, self.step_bytes)

    @property
    def peak_bytes(self) -> int:
        return self.used_bytes + self.reserve_bytes

    def as_dict(self) -> dict:
        return {"name": self.label, "gpu": self.gpu.name, "capacity_bytes": self.gpu.capacity_bytes,
                "layers": self.layers, "frozen_weights_bytes": self.frozen_bytes,
                "quant_constants_bytes": self.constants_bytes, "trainable_weights_bytes": self.trainable_bytes,
                "gradients_bytes": self.gradient_bytes, "optimizer_state_bytes": self.optimizer_bytes,
                "activations_bytes": self.activation_bytes,
                "activations_with_checkpointing_bytes": self.activations_checkpointed_bytes,
                "activations_without_checkpointing_bytes": self.activations_full_bytes,
                "workspace_bytes": self.workspace_bytes,
                "workspace_estimates_bytes": dict(self.workspace), "optimizer_step_temporaries_bytes": self.step_bytes,
                "reserve_bytes": self.reserve_bytes, "peak_bytes": self.peak_bytes, "free_bytes": self.free_bytes,
                "host_ram_bytes": self.host_bytes, "host_ram_parts_bytes": dict(self.host),
                "loading_host_ram_bytes": self.loading_bytes, "loading_host_ram_parts_bytes": dict(self.loading)}


def pipeline_stages(shape: TrainShape, stages: int) -> list[list[int]]:
    """Unit indices per pipeline stage: decoder layers split evenly (earlier stages take the remainder), everything
    before the first decoder layer on the first stage and everything after the last on the last."""
    decoders = [k for k, u in enumerate(shape.units) if u.kind == "decoder"]
    edges = [0, *equal_count_split(len(decoders), stages), len(decoders)]
    groups = [decoders[a:b] for a, b in zip(edges, edges[1:])]
    groups[0] = list(range(decoders[0])) + groups[0]
    groups[-1] += list(range(decoders[-1] + 1, len(shape.units)))
    return groups


def _sharded(tensors: Sequence[int], shards: int) -> list[int]:
    """Each tensor's local shard (FSDP2 splits dim 0; the element count is split here, padding ignored)."""
    return [math.ceil(n / shards) for n in tensors]


@dataclass(frozen=True)
class _Bytes:
    """Bytes per value the plan uses for one request (see the module docstring's precision paragraph)."""

    compute: int  # activations, and the weights FSDP2 all-gathers
    state: int  # the optimizer's parameters and moments: fp32 ("mixed") or the compute dtype ("pure")
    held: int  # the trainable weights as the model keeps them (and so their gradients outside FSDP2)
    grad: int  # a gradient value: FSDP2 reduce-scatters into reduce_dtype shards (the state dtype)

    @classmethod
    def of(cls, request: TrainingRequest, shape: TrainShape) -> "_Bytes":
        a = shape.compute_bytes
        state = training_data()["precision"][request.precision]["state_bytes"] or a
        fsdp = request.strategy == "fsdp2"
        held = a if shape.method == "full" and not fsdp else state  # full, replicated: 16-bit weights + fp32 master
        return cls(a, state, held, state if fsdp else held)

    def adapters_in_forward(self, request: TrainingRequest) -> int:
        """FSDP2 all-gathers the adapters in param_dtype; elsewhere the forward sees them as they are held."""
        return self.compute if request.strategy == "fsdp2" else self.held


def optimizer_state_bytes(tensors: Sequence[int], state_bytes: int, optimizer: str) -> int:
    """Bytes of `optimizer`'s moments (data/training_memory.json "optimizers") for trainable tensors of these
    element counts (each GPU's shard), `state_bytes` per value where they are not quantized. Quantized blockwise
    (bitsandbytes' and torchao's low-bit AdamW): per tensor of at least min_elements values (torchao: also a whole
    number of blocks) the codes (bits per value), one scale per block and the lookup table; smaller tensors keep
    small_tensor_bytes per value (bitsandbytes: fp32), or the parameter's dtype (torchao: zeros_like)."""
    spec = training_data()["optimizers"][optimizer]
    q = spec["quantized_moments"]
    if q is None:
        return spec["moment_tensors"] * state_bytes * sum(tensors)
    total = 0
    for n in tensors:
        if n >= q["min_elements"] and (not q.get("whole_blocks") or n % q["block"] == 0):
            total += math.ceil(n * q["bits"] / 8) + math.ceil(n / q["block"]) * q["absmax_bits"] // 8 \
                + q.get("qmap_entries", 0) * q.get("qmap_bits", 0) // 8
        else:
            total += n * (q["small_tensor_bytes"] or state_bytes)
    return spec["moment_tensors"] * total


def step_temporary_bytes(tensors: Sequence[int], state_bytes: int, optimizer: str, in_backward: bool) -> int:
    """The optimizer step's temporaries: foreach AdamW's sqrt(exp_avg_sq) for every tensor it steps at once (the
    whole group, or one tensor when it steps in backward), plus per-tensor work (torchao: fp32 moments of the
    tensor being stepped, an estimate) for the largest tensor."""
    spec = training_data()["optimizers"][optimizer]
    at_once = max(tensors, default=0) if in_backward else sum(tensors)
    return spec["step_temporaries"] * at_once * state_bytes \
        + spec.get("largest_tensor_temporaries_bytes_per_element", 0) * max(tensors, default=0)


def gpu_training(request: TrainingRequest, shape: TrainShape, device: int, units: list[int], in_flight: int,
                 first_stage: bool, last_stage: bool) -> GpuTraining:
    """One GPU's parts for the units it holds (all of them for DDP and FSDP2, sharded 1/N by FSDP2; a stage's)."""
    size = _Bytes.of(request, shape)
    shards = len(request.gpus) if request.strategy == "fsdp2" else 1
    mine = [shape.units[k] for k in units]
    tensors = _sharded([n for u in mine for n in u.trainable], shards)
    trainable = sum(tensors)
    parts = {"frozen_weights": math.ceil(sum(u.packed_bytes for u in mine) / shards),
             "trainable_weights": trainable * size.held,
             "gradients": trainable * size.grad * (2 if request.strategy == "ddp" else 1),  # DDP: + its buckets
             "optimizer_state": optimizer_state_bytes(tensors, size.state, request.optimizer)
             + (trainable * size.state if size.held != size.state else 0),  # the fp32 master copy
             "optimizer_step_temporaries": step_temporary_bytes(tensors, size.state, request.optimizer,
                                                                request.uses("optimizer-in-backward"))}
    if request.uses("optimizer-in-backward"):  # one unit's gradient shard alive until its parameters are stepped
        parts["gradients"] = max(sum(_sharded(unit, shards)) for unit in _fsdp_units(mine)) * size.grad
    host = {}
    weights = [math.ceil(b / shards) for u in mine for b in u.frozen_tensors] + [n * size.held for n in tensors]
    pinned = {"weights": pinned_rounding(weights) if request.pins_host_memory else 0,
              "gradients": pinned_rounding(n * size.grad for n in tensors) if request.pins_host_memory else 0}
    loading = _loading(request, shape, size, mine, parts["frozen_weights"] + parts["trainable_weights"],
                       pinned["weights"])
    if request.offload == "cpu":  # the shards, their gradients and the optimizer (and its step) live on the host
        host, parts = parts, dict.fromkeys(parts, 0)
        if request.pins_host_memory:
            host["pinned_rounding"] = pinned["weights"] + pinned["gradients"]
    whole = sum(u.constants_bytes + u.buffer_bytes for u in mine)  # never sharded, never offloaded

    decoders = [k for k, u in enumerate(shape.units) if u.kind == "decoder"]
    options = dict(compute_bytes=size.compute, adapter_bytes=size.adapters_in_forward(request),
                   layers=[decoders.index(k) for k in units if k in decoders], embedding=first_stage, loss=last_stage,
                   chunked_loss=request.uses("chunked-loss"))
    with_ckpt = saved_activation_bytes(shape, request.context, request.batch, activation_checkpointing=True, **options)
    without = saved_activation_bytes(shape, request.context, request.batch, activation_checkpointing=False,
                             **options)
    offload = request.uses("activation-offload")
    checkpointed, full = (_on_gpu(acts, in_flight, offload) for acts in (with_ckpt, without))
    workspace = _workspace(request, shape, size, mine, first_stage, last_stage)
    if offload:  # everything forward saves in pinned host RAM, one copy per save; backward brings it back
        chosen = with_ckpt if request.activation_checkpointing else without
        copies, lump = offloaded_copies(request, shape, size.compute, chosen, first_stage, last_stage)
        host["activations (offloaded)"] = (sum(copies) + lump) * in_flight
        host["activations' pinned rounding"] = pinned_rounding(copies) * in_flight
        workspace["offloaded activations brought back"] = max(chosen.largest_layer, chosen.saved - chosen.layers)

    held = {"ddp": "all (a replica)", "fsdp2": f"all (1/{shards} of each)"}.get(request.strategy)
    return GpuTraining(device, request.gpus[device], held or span([u.name for u in mine]),
                       parts["frozen_weights"] + whole, sum(u.constants_bytes for u in mine),
                       parts["trainable_weights"], parts["gradients"], parts["optimizer_state"],
                       checkpointed if request.activation_checkpointing else full, checkpointed, full,
                       workspace, parts["optimizer_step_temporaries"], host, loading,
                       request.uses("optimizer-in-backward"))


def _fsdp_units(mine: list[Unit]) -> list[list[int]]:
    """The trainable tensors of each FSDP2 unit: a decoder layer each, and the root holding everything else together
    (embedding, final norm, head: `fully_shard` on the model, as scripts/train_fsdp2.py wraps it). FSDP2
    reduce-scatters a unit's gradients into one buffer that its parameters' gradients are views of, so with the step
    in backward the largest unit's whole shard is alive at once; at Llama-3-8B that is the root's (two 525M-number
    matrices), twice a lone embedding's."""
    root = [n for u in mine if u.kind != "decoder" for n in u.trainable]
    return [list(u.trainable) for u in mine if u.kind == "decoder"] + [root]


def _on_gpu(acts: Activations, in_flight: int, offload: bool) -> int:
    """Activation bytes on the GPU for `in_flight` micro-batches (and the layer recomputed under checkpointing).
    With activation offload nothing forward saves stays: the course's `offloaded_activations` wraps the whole
    forward and the loss (the training loop and scripts/train_fsdp2.py alike), so the embedding's ids, the final
    norm's tensors and the loss's log-softmax leave with the decoder layers' (tests/test_memory_techniques.py
    measures every saved byte leaving the device); the layer checkpointing recomputes saves inside the checkpoint's
    own hooks, on the GPU. What backward brings back is workspace (`gpu_training`)."""
    return acts.recompute if offload else acts.saved * in_flight + acts.recompute


def offloaded_copies(request: TrainingRequest, shape: TrainShape, a: int, acts: Activations, first_stage: bool,
                     last_stage: bool) -> tuple[list[int], int]:
    """The host copies activation offload makes for one micro-batch: like save_on_cpu, the course's
    `offloaded_activations` copies a tensor once for every operation that saves it, where `saved_activation_bytes`
    counts its storage once. Returns the copies tensor by tensor (each a pinned allocation), and the bytes known only
    as a sum (decoder layers without checkpointing). Outside the layers (as `saved_activation_bytes` lists them): the
    embedding's token ids; the final RMSNorm's fp32 input, saved by pow and by the rsqrt multiply, and rsqrt's
    output, saved by rsqrt and by that multiply (two copies each), and its output before the weight when the weight
    trains; then the chunked loss' checkpoint inputs (the head's input, the labels), or the head's input when it
    trains, the fp32 log-softmax (saved by log_softmax and by nll_loss: two copies), the labels and nll_loss' total
    weight. Checkpointed decoder layers: each one's input, once. Without checkpointing, the layers' saved tensors and
    RoPE's cos and sin are counted once per storage: a lower bound (q, k and v each copy their shared input, each
    RMSNorm its input twice)."""
    full = shape.method == "full"
    tokens, h = request.context * request.batch, shape.base.hidden
    once = [tokens * INT64] if first_stage and full else []
    twice = []
    if last_stage:
        twice = [tokens * FP32 * h, tokens * FP32]
        once += twice + ([tokens * a * h] if full else [])
        if request.uses("chunked-loss"):
            once += [tokens * a * h, tokens * INT64, FP32]
        else:
            twice.append(tokens * FP32 * shape.base.vocab)
            once += ([tokens * a * h] if full else []) + [twice[-1], tokens * INT64, FP32]
    layers = acts.saved - sum(once)  # what the decoder layers keep (and, without checkpointing, RoPE's cos and sin)
    if request.activation_checkpointing and acts.largest_layer:
        return once + twice + [acts.largest_layer] * round(layers / acts.largest_layer), 0
    return once + twice, layers


def _read_at_once(request: TrainingRequest, shape: TrainShape, mine: list[Unit]) -> list[list[Unit]]:
    """The groups of units a rank reads from the checkpoint at once. FSDP2 (the scripts, `apply_fsdp`): one
    decoder layer at a time, then the root unit (embedding, final norm, head) together; a pipeline stage
    (`materialize` of the stage's layers) and a DDP replica (`from_pretrained`): everything the GPU holds."""
    if request.strategy != "fsdp2":
        return [mine]
    decoders = [[u] for u in mine if u.kind == "decoder"]
    return decoders + [[u for u in mine if u.kind != "decoder"]]


def pinned_rounding(sizes: Iterable[int]) -> int:
    """What pinned host buffers of these byte sizes take beyond their sizes: CUDA's caching host allocator, which
    serves `pin_memory()` and a non-blocking copy to the host alike, rounds every allocation up to a power of two
    (ATen/core/CachingHostAllocator.h, `allocate`: c10::llvm::PowerOf2Ceil(size) up to pinned_max_round_threshold,
    unlimited unless PYTORCH_CUDA_ALLOC_CONF sets it). FSDP2's CPU offload pins each parameter's shard on its own
    (_fsdp_param.py: `local_tensor.cpu().pin_memory()`) and copies each gradient's shard to the host with
    `.to("cpu", non_blocking=True)` (_fsdp_collectives.py), which allocates pinned memory; Adam's moments are
    `zeros_like` of the shards, which does not carry pinning over (TensorBase::options() holds dtype, device and
    layout only): not pinned, not rounded."""
    return sum((1 << (n - 1).bit_length()) - n for n in sizes if n > 0)


def _loading(request: TrainingRequest, shape: TrainShape, size: _Bytes, mine: list[Unit], shard: int,
             rounding: int = 0) -> dict:
    """One rank's host RAM at the peak of loading, by part: with CPU offload its shards (allocated before the first
    layer is read, on the host: `shard`, the frozen and trainable weights' share, pinned on GPUs, so with the
    allocator's `rounding` beside them: `pinned_rounding`); the largest group of units read
    at once (`_read_at_once`), in the dtype it is loaded in (the compute dtype for a frozen base, the optimizer's for
    full fine-tuning), with its NF4 copy and its adapters beside it; torchao's NF4 quantization of its largest
    weight (measured bytes per element); and the process itself (Python, torch, transformers, peft, the process
    group: measured on the CPU rig; a GPU process adds the CUDA libraries)."""
    data = training_data()
    load = size.state if shape.method == "full" else size.compute
    quantized = shape.format.name.startswith(TORCHAO_NF4)

    def read(group: list[Unit]) -> int:
        adapters = 0 if shape.method == "full" else sum(u.trainable_params for u in group) * size.state
        return sum(u.params for u in group) * load + (sum(u.packed_bytes for u in group) if quantized else 0) \
            + adapters

    parts = {"shards kept on the host": shard if request.offload == "cpu" else 0,
             "largest unit read": max(read(g) for g in _read_at_once(request, shape, mine))}
    if rounding:
        parts["their pinned rounding"] = rounding
    largest = max((u.largest_quantized for u in mine), default=0)
    if quantized and largest:
        parts["NF4 quantization workspace"] = quantization_bytes(largest, "fp32" if load == FP32 else "bf16")
    parts["process"] = data["host_loading"]["process_bytes"]
    return parts


def quantization_bytes(elements: int, dtype: str) -> int:
    """torchao's NF4 quantization workspace for one weight of `elements` values in `dtype` ('bf16', 'fp32'): a
    chunk's nearest-level table and the whole weight's packed result (data/training_memory.json nf4_quantization)."""
    q = training_data()["nf4_quantization"]
    return int(q["per_chunk_element"][dtype] * min(elements, q["chunk_elements"]) + q["per_element"][dtype] * elements)


def _gathered_bytes(unit: Unit, a: int) -> int:
    """A unit's parameters as FSDP2 all-gathers them: the packed frozen bytes and the trainable ones in bf16."""
    return unit.packed_bytes + unit.trainable_params * a


def dequantization_bytes(format_name: str, compute_bytes: int) -> float:
    """Bytes per element held at the peak of dequantizing one quantized weight: torchao's NF4 (nf4-torchao), as
    measured (data/training_memory.json nf4_dequantization: int64 indices and halves, about 14 in bf16); the
    bitsandbytes formats dequantize in one CUDA kernel that writes the 16-bit result only."""
    if format_name.startswith(TORCHAO_NF4):
        peaks = training_data()["nf4_dequantization"]["peak_bytes_per_element"]
        return peaks["fp32" if compute_bytes == FP32 else "bf16"]
    return compute_bytes


def _workspace(request: TrainingRequest, shape: TrainShape, size: _Bytes, mine: list[Unit], first_stage: bool,
               last_stage: bool) -> dict:
    """Transient memory beside the saved activations, each an estimate named for what it is."""
    a, b = size.compute, shape.base
    tokens = request.context * request.batch
    space = {"layer transient": activation_workspace_bytes(b, request.context, request.batch)}
    if last_stage and request.uses("chunked-loss"):  # one chunk recomputed: its logits, fp32 log-softmax, gradients
        chunk = chunked_loss_tokens(tokens)
        space[f"logits (one chunk of {chunk} tokens)"] = chunk * b.vocab * (a + 3 * FP32)
    elif last_stage:  # the logits the output holds, the gradient of the fp32 log-softmax and of its input
        space["logits"] = tokens * b.vocab * (a + 2 * FP32)
    quantized = max((u.largest_quantized for u in mine), default=0)
    if quantized:
        space["dequantized weight"] = int(quantized * dequantization_bytes(shape.format.name, a))
    if request.strategy == "fsdp2":
        decoders = [u for u in mine if u.kind == "decoder"]
        per_layer = training_data()["fsdp2"]["decoder_layers_in_flight"]
        space["gathered layers"] = per_layer * max(_gathered_bytes(u, a) for u in decoders)
        space["gathered root"] = sum(_gathered_bytes(u, a) for u in mine if u.kind != "decoder")
        space["gradient reduce-scatter"] = max(u.trainable_params for u in decoders) * (a + size.grad)
    if request.pipelined:
        boundaries = (not first_stage) + (not last_stage)
        space["stage boundary"] = boundaries * 2 * tokens * b.hidden * a  # the activation and its gradient
    return space
