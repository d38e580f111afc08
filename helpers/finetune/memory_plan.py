"""Will my fine-tune fit? Per-GPU training memory for full fine-tuning, LoRA and QLoRA under DDP, FSDP2 and a pipeline.

The planner prices a Hugging Face decoder exactly where exactness is possible and names every estimate:

- parameters: counted on the meta device by `helpers.sizing.shape.model_shape` (the inference planner's shapes and
  weight formats: NF4 with its quantization constants, bf16, ...); the LoRA adapters are counted from the shapes of
  the adapted `nn.Linear` modules (r x in for A, out x r for B, as peft builds them). Exact.
- gradients and optimizer state: from data/training_memory.json (AdamW's two moments, bitsandbytes' 8-bit AdamW, the
  mixed-precision master copy). Exact for the tensors; allocator rounding is left to the runtime reserve.
- activations: what autograd saves, derived term by term in `layer_saved_bytes` from what a Llama-style decoder layer
  saves (measured with `helpers.sizing.ledger.MemoryLedger` on a small model; tests/test_plan_train.py checks the
  formula against the ledger). With checkpointing, the layer inputs plus one layer recomputed during backward.
- workspace (estimates, each named): the loss's logits and their gradients, one layer's transient tensors, the
  dequantized 4-bit weight, FSDP2's gathered layers and gradient buffers, pipeline boundary buffers.
- reserve: the CUDA context and an allocator margin per GPU (data/inference.json, as the inference planner uses).
- loading (host RAM, per rank): what a rank holds while it streams its weights from the safetensors checkpoint (built
  on the meta device, sharded, then filled one unit at a time, as the scripts and `helpers` load): its shards with CPU
  offload, the largest unit it reads at once, torchao's NF4 quantization workspace for its largest weight (measured
  bytes per element) and the process itself (measured on the CPU rig). tests/test_streamed_load.py checks it within
  15% of each rank's VmHWM.

Strategies (N GPUs; the assumptions the figures rest on):
- DDP: a full replica per GPU, each GPU runs `batch` sequences; DistributedDataParallel's gradient buckets are a second
  copy of the gradients (gradient_as_bucket_view=False, its default).
- FSDP2 (`fully_shard` per decoder layer and on the root): parameters, gradients and optimizer state sharded 1/N per
  GPU; bitsandbytes' quantization constants are not parameters, so every GPU keeps all of them (torchao's NF4, the
  course's, keeps them inside the sharded tensor: sharded with the codes); two decoder layers
  are all-gathered at once (the running one and the prefetched next) and the root (embedding, final norm, head) stays
  gathered from its forward to its backward. With CPU offload (CPUOffloadPolicy) the shards, gradients and optimizer
  state live in pinned host RAM and the optimizer step runs there; the GPU keeps the gathered layers, activations and
  the constants.
- pipeline: one stage per GPU, decoder layers split evenly (earlier stages take the remainder), the embedding on the
  first stage and the final norm, head and loss on the last. `batch` is the micro-batch; under 1F1B stage j of p holds
  the activations of min(m, p - j) micro-batches (m micro-batches per step, `grad_accum`).

Precision: compute in the base format's activation dtype (bf16 by default). "mixed" keeps the optimizer in fp32
(FSDP2: fp32 shards with a bf16 all-gather; DDP and pipeline, full fine-tuning: bf16 weights and gradients, fp32
master copy and moments, ZeRO's 16 bytes per parameter; LoRA outside FSDP2: peft's fp32 adapters). "pure" keeps
everything in the compute dtype (answer.ai's --precision bf16).

Attention is assumed to run a fused SDPA kernel (flash or memory-efficient: no context x context scores saved) on
unpadded sequences (no attention mask: packed or equal-length batches, so transformers lets SDPA handle GQA without
repeating K and V); the activation model knows Llama-style decoders (q/k/v/o_proj, gate/up/down_proj), which every
bundled model is.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Sequence

from helpers.inference.plan import activation_workspace_bytes
from helpers.sizing.gpus import Gpu, check_gpus, check_workload, describe_gpus, largest_fitting
from helpers.sizing.shape import WeightFormat, span
from helpers.sizing.state import known_optimizers, moment_bytes, training_data
from helpers.sizing.training import (FP32, LLAMA_LINEARS, TORCHAO_NF4, TrainShape, Unit, check_method,
                                     saved_activation_bytes, training_shape)
from helpers.units import fmt_bytes

PLAN_STRATEGIES = ("ddp", "fsdp2", "pipeline")  # the catalog's ddp and fsdp2, and a pipeline of one stage per GPU
OFFLOADS = ("none", "cpu")
PRECISIONS = ("mixed", "pure")


# --- the plan -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TrainingRequest:
    """Everything the planner is asked; `plan_training` checks it before planning."""

    model: object = "llama-2-7b"  # a name, an id or a directory (str), or a transformers config
    method: str = "qlora"
    context: int = 2048
    batch: int = 1
    gpus: tuple[Gpu, ...] = ()  # empty: two RTX 3090s
    strategy: str = "fsdp2"
    offload: str = "none"
    checkpointing: bool = True
    lora_rank: int | None = None  # None: data/training_memory.json's default (64)
    lora_targets: str = "all"
    optimizer: str = "adamw"
    precision: str = "mixed"
    dtype: str | WeightFormat | None = None  # the base's weight format; None: bf16 (full, lora) or nf4-torchao (qlora)
    grad_accum: int | None = None  # micro-batches per optimizer step; None: 1, or the number of stages (pipeline)
    host_ram_bytes: int | None = None  # None: host RAM is reported, not checked

    @property
    def micro_batches(self) -> int:
        return self.grad_accum or (len(self.gpus) if self.strategy == "pipeline" else 1)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: each data-parallel replica runs `batch` x micro-batches."""
        replicas = 1 if self.strategy == "pipeline" else len(self.gpus)
        return self.batch * self.micro_batches * replicas


@dataclass(frozen=True)
class GpuTraining:
    """What one GPU holds during a training step, by part. `peak_bytes` is the most it needs at once: the state
    plus, during forward and backward, activations and workspace, or, during the optimizer step, its temporaries."""

    device: int
    gpu: Gpu
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
    def reserve_bytes(self) -> int:
        return self.gpu.reserve_bytes

    @property
    def state_bytes(self) -> int:
        return self.frozen_bytes + self.trainable_bytes + self.gradient_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return self.state_bytes + max(self.activation_bytes + self.workspace_bytes, self.step_bytes) \
            + self.reserve_bytes

    @property
    def free_bytes(self) -> int:
        return self.gpu.capacity_bytes - self.peak_bytes

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


@dataclass(frozen=True)
class Suggestion:
    """One change to the request, re-planned."""

    change: str  # in words
    flags: str  # the command-line flags that make it
    plan: "TrainingPlan"

    @property
    def fits(self) -> bool:
        return self.plan.fits

    def outcome(self) -> str:
        """'fits, 3.2 GiB left on the fullest GPU (host RAM 48 GiB)' or 'does not fit (short 1.1 GiB on a GPU)'."""
        free = min(d.free_bytes for d in self.plan.devices)
        host = f" (host RAM {fmt_bytes(self.plan.host_peak_bytes)} at its peak)" \
            if self.plan.request.host_ram_bytes is not None or self.plan.host_ram_bytes else ""
        if self.fits:
            return f"fits, {fmt_bytes(free)} left on the fullest GPU{host}"
        return f"does not fit ({fmt_bytes(-free)} short on the fullest GPU{host})" if free < 0 else \
            f"does not fit in host RAM{host}"

    def as_dict(self) -> dict:
        return {"change": self.change, "flags": self.flags, "fits": self.fits,
                "peak_bytes_per_gpu": [d.peak_bytes for d in self.plan.devices],
                "free_bytes_per_gpu": [d.free_bytes for d in self.plan.devices],
                "host_ram_bytes": self.plan.host_ram_bytes}


@dataclass(frozen=True)
class TrainingPlan:
    """A training request accounted per GPU (and in host RAM), with what would fit when it does not."""

    request: TrainingRequest
    shape: TrainShape
    devices: tuple[GpuTraining, ...]
    suggestions: tuple[Suggestion, ...] = ()

    @property
    def host_ram_bytes(self) -> int:
        return sum(d.host_bytes for d in self.devices)

    @property
    def loading_host_bytes(self) -> int:
        """The most host RAM one rank needs while it loads (its shards kept on the host with CPU offload, the
        largest unit it reads at once, quantization's workspace, the process itself); ranks on one machine add up."""
        return max(d.loading_bytes for d in self.devices)

    @property
    def host_peak_bytes(self) -> int:
        """Host RAM the run needs at its peak on one machine: every rank streaming its weights at once (their loading
        figures add up), or the training's offloaded shards, whichever is larger."""
        return max(self.host_ram_bytes, sum(d.loading_bytes for d in self.devices))

    @property
    def host_fits(self) -> bool:
        return self.request.host_ram_bytes is None or self.host_peak_bytes <= self.request.host_ram_bytes

    @property
    def fits(self) -> bool:
        return self.host_fits and all(d.free_bytes >= 0 for d in self.devices)

    def as_dict(self) -> dict:
        r, s = self.request, self.shape
        return {"fits": self.fits, "model": s.name, "method": s.method, "dtype": s.format.name,
                "strategy": r.strategy, "offload": r.offload, "checkpointing": r.checkpointing,
                "context": r.context, "batch": r.batch, "micro_batches": r.micro_batches,
                "global_batch": r.global_batch, "lora_rank": s.lora_rank, "lora_targets": list(s.lora_targets),
                "optimizer": r.optimizer, "precision": r.precision,
                "params": {"total": s.total_params, "frozen": s.frozen_params, "trainable": s.trainable_params},
                "devices": [d.as_dict() for d in self.devices],
                "host_ram_bytes": self.host_ram_bytes, "host_ram_available_bytes": r.host_ram_bytes,
                "loading_host_ram_bytes_per_rank": self.loading_host_bytes,
                "host_ram_peak_bytes": self.host_peak_bytes,
                "suggestions": [x.as_dict() for x in self.suggestions]}

    def rows(self) -> list[dict]:
        return [{"device": d.label, "frozen": fmt_bytes(d.frozen_bytes), "trainable": fmt_bytes(d.trainable_bytes),
                 "grads": fmt_bytes(d.gradient_bytes), "optimizer": fmt_bytes(d.optimizer_bytes),
                 "activations": fmt_bytes(d.activation_bytes), "workspace": fmt_bytes(d.workspace_bytes),
                 "reserve": fmt_bytes(d.reserve_bytes), "peak": fmt_bytes(d.peak_bytes),
                 "free": fmt_bytes(d.free_bytes), "capacity": fmt_bytes(d.gpu.capacity_bytes),
                 "layers": d.layers} for d in self.devices]

    def describe(self) -> str:
        """Header lines, the per-GPU table, the activations both ways, host RAM, and the suggestions."""
        from helpers.report import table

        r, s = self.request, self.shape
        adapters = "" if s.method == "full" else f", LoRA rank {s.lora_rank} on {','.join(s.lora_targets)}"
        lines = [f"{s.name}, {s.method} ({s.format.name} base{adapters}): {s.total_params:,} parameters, "
                 f"{s.trainable_params:,} trainable, {s.frozen_params:,} frozen",
                 f"{r.strategy}{' + CPU offload' if r.offload == 'cpu' else ''} on {describe_gpus(r.gpus)}; context "
                 f"{r.context} x batch {r.batch} x {r.micro_batches} micro-batch(es) (global batch {r.global_batch}); "
                 f"{r.optimizer}, {r.precision} precision, checkpointing {'on' if r.checkpointing else 'off'}: "
                 f"{'fits' if self.fits else 'does NOT fit'}",
                 table(self.rows())]
        for d in self.devices:
            estimates = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in d.workspace.items())
            constants = f"quantization constants {fmt_bytes(d.constants_bytes)} (in frozen); " \
                if d.constants_bytes else ""
            lines.append(f"{d.label}: activations {fmt_bytes(d.activations_checkpointed_bytes)} with checkpointing, "
                         f"{fmt_bytes(d.activations_full_bytes)} without; {constants}optimizer step temporaries "
                         f"{fmt_bytes(d.step_bytes)}; workspace (estimates): {estimates or '-'}")
        if self.host_ram_bytes or r.host_ram_bytes:
            parts = ", ".join(f"{k.replace('_', ' ')} {fmt_bytes(sum(d.host.get(k, 0) for d in self.devices))}"
                              for k in self.devices[0].host)
            lines.append(f"host RAM (pinned, CPU offload), all GPUs' shards: {fmt_bytes(self.host_ram_bytes)}"
                         + ("" if r.host_ram_bytes is None else f" of {fmt_bytes(r.host_ram_bytes)}")
                         + (f" ({parts})" if parts else ""))
        worst = max(self.devices, key=lambda d: d.loading_bytes)
        lines.append(f"host RAM while loading, per rank: {fmt_bytes(worst.loading_bytes)} ("
                     + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in worst.loading.items()) + "); the machine's peak, "
                     f"all {len(self.devices)} ranks at once or the offloaded shards: {fmt_bytes(self.host_peak_bytes)}"
                     + ("" if r.host_ram_bytes is None else f" of {fmt_bytes(r.host_ram_bytes)}"))
        if self.suggestions:
            lines.append("What would fit (one change each, cheapest first; re-planned):")
            lines += [f"  - {x.change} [{x.flags}]: {x.outcome()}" for x in self.suggestions]
        return "\n".join(lines)


def _check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def check_request(request: TrainingRequest) -> TrainingRequest:
    """The request with names normalised and the GPUs resolved; ValueError, in the user's terms, for bad input."""
    method = check_method(request.method)
    strategy = _check_choice("strategy", request.strategy, PLAN_STRATEGIES)
    offload = _check_choice("offload", request.offload, OFFLOADS)
    optimizer = _check_choice("optimizer", request.optimizer, known_optimizers())
    precision = _check_choice("precision", request.precision, PRECISIONS)
    check_workload(request.context, request.batch)
    gpus = tuple(check_gpus(list(request.gpus) or None))
    if offload == "cpu" and strategy != "fsdp2":
        raise ValueError(f"CPU offload keeps FSDP2's shards in host RAM: use --strategy fsdp2 with --offload cpu "
                         f"(not {strategy})")
    if request.grad_accum is not None and (isinstance(request.grad_accum, bool) or
                                           not isinstance(request.grad_accum, int) or request.grad_accum < 1):
        raise ValueError(f"gradient accumulation must be a whole number of micro-batches, at least 1, got "
                         f"{request.grad_accum!r}")
    if request.host_ram_bytes is not None and request.host_ram_bytes <= 0:
        raise ValueError(f"host RAM must be positive, got {request.host_ram_bytes!r}")
    return dataclasses.replace(request, method=method, strategy=strategy, offload=offload, optimizer=optimizer,
                               precision=precision, gpus=gpus)


def _check_fits_model(request: TrainingRequest, shape: TrainShape) -> None:
    longest = shape.max_position_embeddings
    if longest is not None and request.context > longest:
        raise ValueError(f"context {request.context} is longer than {shape.name} handles "
                         f"(max_position_embeddings {longest}): train on at most {longest} tokens per sequence")
    if not set(LLAMA_LINEARS) <= set(shape.decoder_linears):
        raise ValueError(f"the activation model knows Llama-style decoder layers ({', '.join(LLAMA_LINEARS)}); "
                         f"{shape.name}'s layers have {', '.join(shape.decoder_linears)}")
    stages = len(request.gpus)
    if request.strategy == "pipeline" and stages > len(shape.decoders):
        raise ValueError(f"a pipeline of {stages} stages needs at least {stages} decoder layers; {shape.name} has "
                         f"{len(shape.decoders)}")


def _stages(shape: TrainShape, stages: int) -> list[list[int]]:
    """Unit indices per pipeline stage: decoder layers split evenly (earlier stages take the remainder), everything
    before the first decoder layer on the first stage and everything after the last on the last."""
    decoders = [k for k, u in enumerate(shape.units) if u.kind == "decoder"]
    share, extra = divmod(len(decoders), stages)
    groups, start = [], 0
    for j in range(stages):
        size = share + (j < extra)
        groups.append(decoders[start:start + size])
        start += size
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


def _gpu(request: TrainingRequest, shape: TrainShape, device: int, units: list[int], in_flight: int,
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
             "optimizer_state": moment_bytes(tensors, size.state, request.optimizer)
             + (trainable * size.state if size.held != size.state else 0),  # the fp32 master copy
             "optimizer_step_temporaries":
                 training_data()["optimizers"][request.optimizer]["step_temporaries"] * trainable * size.state}
    host = {}
    loading = _loading(request, shape, size, mine, parts["frozen_weights"] + parts["trainable_weights"])
    if request.offload == "cpu":  # the shards, their gradients and the optimizer (and its step) live on the host
        host, parts = parts, dict.fromkeys(parts, 0)
    whole = sum(u.constants_bytes + u.buffer_bytes for u in mine)  # never sharded, never offloaded

    decoders = [k for k, u in enumerate(shape.units) if u.kind == "decoder"]
    options = dict(compute_bytes=size.compute, adapter_bytes=size.adapters_in_forward(request),
                   layers=[decoders.index(k) for k in units if k in decoders], embedding=first_stage, loss=last_stage)
    with_ckpt = saved_activation_bytes(shape, request.context, request.batch, checkpointing=True, **options)
    without = saved_activation_bytes(shape, request.context, request.batch, checkpointing=False, **options)
    checkpointed, full = with_ckpt.saved * in_flight + with_ckpt.recompute, without.saved * in_flight

    held = {"ddp": "all (a replica)", "fsdp2": f"all (1/{shards} of each)"}.get(request.strategy)
    return GpuTraining(device, request.gpus[device], held or span([u.name for u in mine]),
                       parts["frozen_weights"] + whole, sum(u.constants_bytes for u in mine),
                       parts["trainable_weights"], parts["gradients"], parts["optimizer_state"],
                       checkpointed if request.checkpointing else full, checkpointed, full,
                       _workspace(request, shape, size, mine, first_stage, last_stage),
                       parts["optimizer_step_temporaries"], host, loading)


def _read_at_once(request: TrainingRequest, shape: TrainShape, mine: list[Unit]) -> list[list[Unit]]:
    """The groups of units a rank reads from the checkpoint at once. FSDP2 (the scripts, `apply_fsdp`): one
    decoder layer at a time, then the root unit (embedding, final norm, head) together; a pipeline stage
    (`materialize` of the stage's layers) and a DDP replica (`from_pretrained`): everything the GPU holds."""
    if request.strategy != "fsdp2":
        return [mine]
    decoders = [[u] for u in mine if u.kind == "decoder"]
    return decoders + [[u for u in mine if u.kind != "decoder"]]


def _loading(request: TrainingRequest, shape: TrainShape, size: _Bytes, mine: list[Unit], shard: int) -> dict:
    """One rank's host RAM at the peak of loading, by part: with CPU offload its shards (allocated before the first
    layer is read, on the host: `shard`, the frozen and trainable weights' share); the largest group of units read
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
    largest = max((u.largest_quantized for u in mine), default=0)
    if quantized and largest:
        peaks = data["nf4_quantization"]["peak_bytes_per_element"]
        parts["NF4 quantization workspace"] = int(largest * peaks["fp32" if load == FP32 else "bf16"])
    parts["process"] = data["host_loading"]["process_bytes"]
    return parts


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
    if last_stage:  # the logits the output holds, the gradient of the fp32 log-softmax and of its input
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
    if request.strategy == "pipeline":
        boundaries = (not first_stage) + (not last_stage)
        space["stage boundary"] = boundaries * 2 * tokens * b.hidden * a  # the activation and its gradient
    return space


def _plan(request: TrainingRequest) -> TrainingPlan:
    shape = training_shape(request.model, request.method, request.dtype, request.lora_rank, request.lora_targets)
    _check_fits_model(request, shape)
    n = len(request.gpus)
    if request.strategy == "pipeline":
        groups = _stages(shape, n)
        devices = [_gpu(request, shape, j, g, min(request.micro_batches, n - j), j == 0, j == n - 1)
                   for j, g in enumerate(groups)]
    else:
        everything = list(range(len(shape.units)))
        devices = [_gpu(request, shape, j, everything, 1, True, True) for j in range(n)]
    return TrainingPlan(request, shape, tuple(devices))


def plan_training(model="llama-2-7b", method: str = "qlora", context: int = 2048, batch: int = 1,
                  gpus: Sequence[Gpu] | str | None = None, strategy: str = "fsdp2", offload: str = "none",
                  checkpointing: bool = True, lora_rank: int | None = None, lora_targets: str = "all",
                  optimizer: str = "adamw", precision: str = "mixed", dtype: str | WeightFormat | None = None,
                  grad_accum: int | None = None, host_ram_bytes: int | None = None) -> TrainingPlan:
    """Per-GPU memory of fine-tuning `model` (a bundled name, a Hugging Face id, a directory holding a config.json, or
    a transformers config) with `method` on `gpus` (default two RTX 3090s), and, when it does not fit, the changes
    that would (`TrainingPlan.suggestions`, each re-planned, cheapest first). `dtype`: a format's name, or a
    `WeightFormat` (e.g. NF4 computing in fp32, as on the CPU rig)."""
    request = check_request(TrainingRequest(
        model=model if hasattr(model, "model_type") else str(model), method=method, context=context, batch=batch, gpus=tuple(check_gpus(gpus)),
        strategy=strategy, offload=offload, checkpointing=checkpointing, lora_rank=lora_rank,
        lora_targets=lora_targets, optimizer=optimizer, precision=precision, dtype=dtype, grad_accum=grad_accum,
        host_ram_bytes=host_ram_bytes))
    plan = _plan(request)
    return plan if plan.fits else dataclasses.replace(plan, suggestions=suggestions(plan))


# --- when it does not fit ---------------------------------------------------------------------------------------

def _fits(request: TrainingRequest) -> bool:
    try:
        return _plan(request).fits
    except ValueError:
        return False


def _candidates(plan: TrainingPlan) -> list[tuple[str, str, TrainingRequest]]:
    """One-change alternatives, cheapest first. First the changes that train the same model (same data, same global
    batch): checkpointing (about one more forward per step), a smaller micro-batch with more accumulation (less work
    per kernel), FSDP2 sharding (more communication), CPU offload (every layer crosses PCIe each step); then the
    changes to what is trained: 8-bit AdamW, a smaller LoRA rank, a lighter method (lora, then qlora), and last a
    shorter context (the model sees less text per sequence). Searches (micro-batch, rank, context) keep the largest
    value that fits."""
    r = plan.request
    out = []
    if not r.checkpointing:
        out.append(("turn activation checkpointing on (about one more forward per step)", "--checkpointing",
                    dataclasses.replace(r, checkpointing=True)))
    if r.batch > 1:
        smaller = [d for d in range(r.batch - 1, 0, -1) if r.batch % d == 0]
        best = next((d for d in smaller if _fits(dataclasses.replace(
            r, batch=d, grad_accum=r.micro_batches * r.batch // d))), smaller[-1])
        accum = r.micro_batches * r.batch // best
        out.append((f"micro-batch {best} with {accum} accumulation steps (global batch {r.global_batch} kept)",
                    f"--batch {best} --grad-accum {accum}",
                    dataclasses.replace(r, batch=best, grad_accum=accum)))
    if r.strategy != "fsdp2":
        out.append(("shard weights, gradients and optimizer state with FSDP2", "--strategy fsdp2",
                    dataclasses.replace(r, strategy="fsdp2", grad_accum=None if r.strategy == "pipeline"
                                        else r.grad_accum)))
    if r.offload == "none":
        out.append(("FSDP2 with CPU offload (shards, gradients and the optimizer step in host RAM)",
                    ("" if r.strategy == "fsdp2" else "--strategy fsdp2 ") + "--offload cpu",
                    dataclasses.replace(r, strategy="fsdp2", offload="cpu",
                                        grad_accum=None if r.strategy == "pipeline" else r.grad_accum)))
    if r.optimizer != "adamw-8bit":
        out.append(("8-bit AdamW (bitsandbytes)", "--optimizer adamw-8bit",
                    dataclasses.replace(r, optimizer="adamw-8bit")))
    rank = plan.shape.lora_rank
    if rank and rank > 1:
        ranks = [rank // 2**k for k in range(1, rank.bit_length()) if rank // 2**k >= 1]
        best = next((k for k in ranks if _fits(dataclasses.replace(r, lora_rank=k))), ranks[-1])
        out.append((f"LoRA rank {best} instead of {rank}", f"--lora-rank {best}",
                    dataclasses.replace(r, lora_rank=best)))
    lighter = {"full": ["lora", "qlora"], "lora": ["qlora"]}.get(plan.shape.method, [])
    for method in lighter:
        out.append((f"{method} instead of {plan.shape.method}", f"--method {method}",
                    dataclasses.replace(r, method=method, dtype=None if method == "qlora" else r.dtype)))
    best = largest_fitting(lambda c: _fits(dataclasses.replace(r, context=c)), r.context - 1)
    if best:  # 0: not even one token fits
        out.append((f"context {best} tokens instead of {r.context}", f"--context {best}",
                    dataclasses.replace(r, context=best)))
    return out


def _replan(candidates: list[tuple[str, str, TrainingRequest]]) -> list[Suggestion]:
    out = []
    for change, flags, request in candidates:
        try:
            out.append(Suggestion(change, flags, _plan(request)))
        except ValueError:  # a change this model cannot take (e.g. a pipeline deeper than its layers)
            continue
    return out


def suggestions(plan: TrainingPlan) -> tuple[Suggestion, ...]:
    """What would fit: each one-change alternative re-planned, cheapest first (see `_candidates`). When no single
    change fits, the cheapest combination found greedily is appended: apply the cheapest change that lowers the
    fullest GPU's peak, re-plan, repeat until it fits or nothing helps."""
    single = _replan(_candidates(plan))
    if any(s.fits for s in single):
        return tuple(single)
    current, steps = plan, []
    while not current.fits:
        worst = max(d.peak_bytes for d in current.devices)
        better = [s for s in _replan(_candidates(current)) if max(d.peak_bytes for d in s.plan.devices) < worst
                  or (s.plan.host_fits and not current.host_fits)]
        if not better:
            break
        steps.append(better[0])
        current = better[0].plan
    if steps:
        single.append(Suggestion(" + ".join(s.change for s in steps), " ".join(s.flags for s in steps), current))
    return tuple(single)

