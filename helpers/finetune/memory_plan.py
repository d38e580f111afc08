"""Will my fine-tune fit? Per-GPU training memory for full fine-tuning, LoRA and QLoRA under DDP, FSDP2 and a pipeline.

The planner prices a Hugging Face decoder exactly where exactness is possible and names every estimate:

- parameters: counted on the meta device by `helpers.inference.plan.model_shape` (the inference planner's shapes and
  weight formats: NF4 with its quantization constants, bf16, ...); the LoRA adapters are counted from the shapes of
  the adapted `nn.Linear` modules (r x in for A, out x r for B, as peft builds them). Exact.
- gradients and optimizer state: from data/training_memory.json (AdamW's two moments, bitsandbytes' 8-bit AdamW, the
  mixed-precision master copy). Exact for the tensors; allocator rounding is left to the runtime reserve.
- activations: what autograd saves, derived term by term in `layer_saved_bytes` from what a Llama-style decoder layer
  saves (measured with `helpers.memory.MemoryLedger` on a small model; tests/test_plan_train.py checks the formula
  against the ledger). With checkpointing, the layer inputs plus one layer recomputed during backward.
- workspace (estimates, each named): the loss's logits and their gradients, one layer's transient tensors, the
  dequantized 4-bit weight, FSDP2's gathered layers and gradient buffers, pipeline boundary buffers.
- reserve: the CUDA context and an allocator margin per GPU (data/inference.json, as the inference planner uses).

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
from functools import lru_cache
from typing import Sequence

from torch import nn

from helpers.course import load_data
from helpers.inference.plan import (Gpu, ModelShape, WeightFormat, _check_workload, _largest, _span,
                                    activation_workspace_bytes, check_gpus, describe_gpus, known_formats,
                                    meta_model, model_shape, placement_units, weight_format)
from helpers.memory import fmt_bytes

METHODS = ("full", "lora", "qlora")
STRATEGIES = ("ddp", "fsdp2", "pipeline")
OFFLOADS = ("none", "cpu")
PRECISIONS = ("mixed", "pure")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_DTYPE = {"full": "bf16", "lora": "bf16", "qlora": "nf4-torchao"}  # QLoRA as the course's scripts run it
TORCHAO_NF4 = "nf4-torchao"
FP32 = 4  # bytes: RMSNorm's upcast input, rsqrt, the attention log-sum-exp, the fp32 loss
INT64 = 8  # bytes: token ids the embedding saves, labels the loss saves


@lru_cache(maxsize=1)
def training_data() -> dict:
    """data/training_memory.json (read once; treat it as read-only)."""
    return load_data("training_memory")


def known_optimizers() -> list[str]:
    return sorted(training_data()["optimizers"])


def default_lora_rank() -> int:
    return training_data()["lora"]["default_rank"]


# --- parameters, exactly ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Unit:
    """One placement unit (embedding, decoder layer, final norm, head) priced for training."""

    name: str
    kind: str  # as the inference planner's Layer.kind: "embedding", "decoder", "norm", "head", "buffers"
    params: int  # parameters of the base model
    frozen_bytes: int  # frozen parameters in the base format (quantization constants included) and buffers
    constants_bytes: int  # of which quantization constants (kept whole on every GPU under FSDP2)
    buffer_bytes: int  # of which buffers (the rotary inverse frequencies): never sharded
    trainable: tuple[int, ...]  # the element count of each trainable tensor (all parameters, or LoRA's A and B)
    largest_quantized: int = 0  # elements of the largest quantized weight: dequantized whole for each matmul

    @property
    def trainable_params(self) -> int:
        return sum(self.trainable)

    @property
    def packed_bytes(self) -> int:
        """Frozen parameter bytes FSDP shards and all-gathers: all but the constants and buffers."""
        return self.frozen_bytes - self.constants_bytes - self.buffer_bytes


@dataclass(frozen=True)
class TrainShape:
    """A decoder prepared for one fine-tuning method: which parameters train, which stay frozen, in which format."""

    base: ModelShape  # the inference planner's shape in the base format (bf16, nf4, ...)
    method: str
    lora_rank: int | None
    lora_targets: tuple[str, ...]
    units: tuple[Unit, ...]
    decoder_linears: tuple[str, ...]  # the last name part of each nn.Linear in a decoder layer

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def format(self) -> WeightFormat:
        return self.base.format

    @property
    def compute_bytes(self) -> int:
        """Bytes per activation value: the compute dtype of the base format (2 for bf16, fp16 and 4-bit bases)."""
        return self.base.format.activation_bytes

    @property
    def trainable_params(self) -> int:
        return sum(u.trainable_params for u in self.units)

    @property
    def frozen_params(self) -> int:
        return 0 if self.method == "full" else self.base.params

    @property
    def total_params(self) -> int:
        """The trained module's parameters: the base model plus its LoRA adapters."""
        return self.base.params + (0 if self.method == "full" else self.trainable_params)

    @property
    def decoders(self) -> list[Unit]:
        return [u for u in self.units if u.kind == "decoder"]

    @property
    def max_position_embeddings(self) -> int | None:
        return getattr(self.base.config, "max_position_embeddings", None)


def _linears(module: nn.Module, head: nn.Module | None) -> list[tuple[str, nn.Linear]]:
    """(last name part, module) of every nn.Linear under `module` except the head: the quantizable, adaptable ones."""
    return [(name.rpartition(".")[2], m) for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and m is not head]


def resolve_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """"all" (every linear of the decoder layers), "attention" (q, k, v, o) or module names, comma separated."""
    presets = training_data()["lora"]["targets"]
    if isinstance(targets, str):
        key = targets.strip().lower()
        names = presets[key] if key in presets else [t.strip() for t in targets.split(",") if t.strip()]
    else:
        names = [str(t).strip() for t in targets]
    if not names:
        raise ValueError(f"no LoRA targets in {targets!r}: use {', '.join(presets)}, or module names such as "
                         "'q_proj,v_proj'")
    return tuple(dict.fromkeys(names))


def training_shape(model="llama-2-7b", method: str = "qlora", dtype: str | WeightFormat | None = None,
                   lora_rank: int | None = None, lora_targets: str | Sequence[str] = "all") -> TrainShape:
    """Every placement unit of `model` with its frozen bytes and trainable tensors under `method`.

    full: every parameter trains, in the compute dtype `dtype` (default bf16). lora: the base stays frozen in `dtype`
    (default bf16) and each targeted linear of every decoder layer gets A (r x in) and B (out x r). qlora: as lora, on a
    base whose decoder linears are quantized (`dtype` default nf4-torchao, what the course runs: 4 bits, an 8-bit scale
    per 64 weights; nf4 and nf4-dq are bitsandbytes').
    """
    method = _check_method(method)
    fmt = weight_format(dtype or DEFAULT_DTYPE[method])
    if method == "qlora" and not fmt.quantized:
        raise ValueError(f"qlora trains adapters on a quantized base: use a quantized --dtype "
                         f"({', '.join(f for f in known_formats() if weight_format(f).quantized)}), not {fmt.name}; "
                         "for a 16-bit base choose --method lora")
    if method != "qlora" and fmt.quantized:
        raise ValueError(f"{method} needs a base in a float format (bf16, fp16, fp32), not {fmt.name}: "
                         "for adapters on a quantized base choose --method qlora")
    rank = None if method == "full" else _check_rank(default_lora_rank() if lora_rank is None else lora_rank)
    targets = () if method == "full" else resolve_targets(lora_targets)
    return _training_shape(model_shape(model, fmt), method, rank, targets)


@lru_cache(maxsize=64)
def _training_shape(base: ModelShape, method: str, rank: int | None, targets: tuple[str, ...]) -> TrainShape:
    model = meta_model(base.config)
    head = model.get_output_embeddings()
    decoder = next(m for layer, (_, m) in zip(base.layers, placement_units(model)) if layer.kind == "decoder")
    available = sorted({part for part, _ in _linears(decoder, head)})
    unknown = [t for t in targets if t not in available]
    if unknown:
        raise ValueError(f"no linear layer named {', '.join(unknown)} in {base.name}'s decoder layers; LoRA can "
                         f"target {', '.join(available)} (or 'all', 'attention')")
    fmt, units = base.format, []
    for layer, (_, module) in zip(base.layers, placement_units(model)):
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        linears = _linears(module, head) if layer.kind == "decoder" else []
        quantized = [m.weight.shape for _, m in linears] if fmt.quantized else []
        constants = sum(fmt.tensor_bytes(s, True) - math.ceil(math.prod(s) * fmt.weight_bits / 8) for s in quantized)
        if fmt.name.startswith(TORCHAO_NF4):  # torchao keeps the scales inside the NF4 tensor: FSDP2 shards them too
            constants = 0
        if method == "full":
            params = [p.numel() for p in module.parameters()] if layer.params else []
            units.append(Unit(layer.name, layer.kind, layer.params, buffers, 0, buffers, tuple(params)))
            continue
        adapters = [n for part, m in linears if part in targets for n in (rank * m.in_features, m.out_features * rank)]
        units.append(Unit(layer.name, layer.kind, layer.params, layer.weight_bytes, constants, buffers,
                          tuple(adapters), max((math.prod(s) for s in quantized), default=0)))
    return TrainShape(base, method, rank, targets, tuple(units), tuple(available))


# --- activations: what autograd saves ----------------------------------------------------------------------------

def _norm_saved(hidden: int, a: int, input_needs_grad: bool, weight_trains: bool) -> int:
    """Bytes per token LlamaRMSNorm saves: x32 = x.to(fp32); var = x32.pow(2).mean(-1); y = x32 * rsqrt(var + eps);
    out = weight * y.to(dtype).

    - x32 (4 x hidden: the input itself in fp32, an fp32 copy otherwise), saved by pow and by the rsqrt multiply,
      and rsqrt's output (one fp32 per token), when gradient must flow to the input;
    - y in the compute dtype (a x hidden), saved by `weight * y` only when the weight trains.
    """
    return (FP32 * hidden + FP32 if input_needs_grad else 0) + (a * hidden if weight_trains else 0)


def _linear_inputs(width: int, names: set[str], trains: set[str], adapted: set[str], a: int, c: int,
                   rank: int) -> tuple[bool, int]:
    """What the linears `names`, all reading one tensor of `width` features, make autograd keep.

    Returns (whether the shared input itself is saved, further bytes per token). A trainable nn.Linear saves its input
    for the weight's gradient; a frozen one saves nothing (the input's gradient needs only the weight). peft's LoRA
    layer runs lora_B(lora_A(x)): lora_A saves x and lora_B saves lora_A's output (rank values per token). When the
    adapters' dtype (`c` bytes) differs from the compute dtype (`a`), peft casts x for each adapted layer
    (`_cast_input_dtype`): one copy per adapted layer instead of the shared input.
    """
    mine = names & adapted
    shared = bool(names & trains) or (bool(mine) and c == a)
    copies = len(mine) * c * width if c != a else 0
    return shared, copies + len(mine) * rank * c


def layer_saved_bytes(shape: TrainShape, a: int, c: int, input_needs_grad: bool) -> int:
    """Bytes per token one Llama-style decoder layer saves for backward (no checkpointing), term by term:

    - input RMSNorm (`_norm_saved`);
    - q, k, v projections: their shared input (the normed hidden state) or peft's copies, plus LoRA's rank values;
    - SDPA (flash / memory-efficient kernel) when gradient flows through attention: q (after RoPE), k and v (kv
      heads only: transformers passes enable_gqa without a mask), its output, and an fp32 log-sum-exp per head.
      RoPE's multiplies save only cos and sin (shared by all layers: counted once, in `saved_activation_bytes`);
    - o projection: reads SDPA's saved output (the transpose is a view), so only peft's copy and LoRA's rank values;
    - post-attention RMSNorm; gate and up projections' shared input;
    - SiLU saves the gate output, `silu(g) * u` saves silu(g) and u (each intermediate-sized);
    - down projection: saves the product (intermediate-sized) when it trains or is adapted.

    `a`: bytes of the compute dtype; `c`: bytes of the adapters as the forward sees them; `input_needs_grad`: False
    for the first layer of a LoRA model (the frozen embedding's output needs no gradient, so that RMSNorm saves
    nothing). Residual adds, views and transposes save nothing.
    """
    b = shape.base
    h, q, kv, i, heads, r = (b.hidden, b.heads * b.head_dim, b.kv_heads * b.head_dim, b.intermediate, b.heads,
                             shape.lora_rank or 0)
    full = shape.method == "full"
    trains = set(LLAMA_LINEARS) if full else set()
    adapted = set() if full else set(shape.lora_targets)
    grad_from = trains | adapted
    saved = _norm_saved(h, a, input_needs_grad, full)
    shared, extra = _linear_inputs(h, {"q_proj", "k_proj", "v_proj"}, trains, adapted, a, c, r)
    saved += (a * h if shared else 0) + extra
    attention_grad = input_needs_grad or bool({"q_proj", "k_proj", "v_proj"} & grad_from)
    if attention_grad:
        saved += a * (2 * q + 2 * kv) + FP32 * heads
    shared, extra = _linear_inputs(q, {"o_proj"}, trains, adapted, a, c, r)
    saved += (a * q if shared and not attention_grad else 0) + extra
    mid_grad = attention_grad or "o_proj" in grad_from
    saved += _norm_saved(h, a, mid_grad, full)
    shared, extra = _linear_inputs(h, {"gate_proj", "up_proj"}, trains, adapted, a, c, r)
    saved += (a * h if shared else 0) + extra
    gate_grad, up_grad = mid_grad or "gate_proj" in grad_from, mid_grad or "up_proj" in grad_from
    saved += a * i * (2 * gate_grad + up_grad)  # silu saves g; the product saves silu(g) (for u) and u (for g)
    shared, extra = _linear_inputs(i, {"down_proj"}, trains, adapted, a, c, r)
    return saved + (a * i if shared else 0) + extra


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one device for one micro-batch: `saved` is what autograd holds at the end of the forward
    (what helpers.memory.MemoryLedger counts); `recompute` is the layer checkpointing recomputes during backward."""

    saved: int
    recompute: int = 0

    @property
    def peak(self) -> int:
        return self.saved + self.recompute


def saved_activation_bytes(shape: TrainShape, context: int, batch: int, *, checkpointing: bool,
                           compute_bytes: int | None = None, adapter_bytes: int | None = None,
                           layers: Sequence[int] | None = None, embedding: bool = True,
                           loss: bool = True) -> Activations:
    """Activations of `batch` sequences of `context` tokens through the decoder layers `layers` (default all), the
    embedding (if `embedding`) and the final norm, head and loss (if `loss`).

    Outside the layers: the embedding saves the token ids when it trains (int64); the final RMSNorm as a layer's; the
    head saves its input when it trains; transformers' loss saves the fp32 log-softmax of all batch x context
    positions, the int64 labels and one fp32 scalar; RoPE's cos and sin (context x head_dim each, shared by every
    layer). With checkpointing (non-reentrant, on every decoder layer) a layer keeps only its input (compute dtype),
    cos and sin are held inside the checkpoints (not counted), and backward recomputes one layer at a time: that
    layer's saved tensors are `recompute`.
    """
    b = shape.base
    a = compute_bytes or shape.compute_bytes
    c = adapter_bytes or a
    full = shape.method == "full"
    layers = range(len(shape.decoders)) if layers is None else layers
    tokens = context * batch
    per_token = 0
    if embedding and full:
        per_token += INT64
    if loss:
        per_token += _norm_saved(b.hidden, a, True, full) + (a * b.hidden if full else 0) + FP32 * b.vocab + INT64
    grads = [full or j > 0 for j in layers]  # the layer's input needs a gradient
    layer_bytes = [layer_saved_bytes(shape, a, c, g) for g in grads]
    if checkpointing:
        saved = tokens * (per_token + a * b.hidden * len(layer_bytes)) + (FP32 if loss else 0)
        return Activations(saved, tokens * max(layer_bytes, default=0))
    rope = 2 * context * b.head_dim * a if layer_bytes else 0
    return Activations(tokens * (per_token + sum(layer_bytes)) + rope + (FP32 if loss else 0))


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

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

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
                "host_ram_bytes": self.host_bytes, "host_ram_parts_bytes": dict(self.host)}


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
        host = f" (host RAM {fmt_bytes(self.plan.host_ram_bytes)})" if self.plan.host_ram_bytes else ""
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
    def host_fits(self) -> bool:
        return self.request.host_ram_bytes is None or self.host_ram_bytes <= self.request.host_ram_bytes

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
        if self.suggestions:
            lines.append("What would fit (one change each, cheapest first; re-planned):")
            lines += [f"  - {x.change} [{x.flags}]: {x.outcome()}" for x in self.suggestions]
        return "\n".join(lines)


def _check_method(method: str) -> str:
    key = str(method).strip().lower()
    if key not in METHODS:
        raise ValueError(f"unknown fine-tuning method {method!r}: choose full (every weight trains), lora (adapters on "
                         "a 16-bit base) or qlora (adapters on a 4-bit base)")
    return key


def _check_rank(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"the LoRA rank must be a whole number of at least 1 (the adapters' inner size; QLoRA uses "
                         f"{default_lora_rank()}), got {rank!r}")
    return rank


def _check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def check_request(request: TrainingRequest) -> TrainingRequest:
    """The request with names normalised and the GPUs resolved; ValueError, in the user's terms, for bad input."""
    method = _check_method(request.method)
    strategy = _check_choice("strategy", request.strategy, STRATEGIES)
    offload = _check_choice("offload", request.offload, OFFLOADS)
    optimizer = _check_choice("optimizer", request.optimizer, known_optimizers())
    precision = _check_choice("precision", request.precision, PRECISIONS)
    _check_workload(request.context, request.batch, "prompt")
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


def _moment_bytes(tensors: Sequence[int], state_bytes: int, optimizer: str) -> int:
    """Bytes of the optimizer's moments for trainable tensors of these element counts."""
    spec = training_data()["optimizers"][optimizer]
    q = spec["quantized_moments"]
    if q is None:
        return spec["moment_tensors"] * state_bytes * sum(tensors)
    per_tensor = (n * q["bits"] // 8 + math.ceil(n / q["block"]) * q["absmax_bits"] // 8
                  if n >= q["min_elements"] else n * q["small_tensor_bytes"] for n in tensors)
    return spec["moment_tensors"] * sum(per_tensor)


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
             "optimizer_state": _moment_bytes(tensors, size.state, request.optimizer)
             + (trainable * size.state if size.held != size.state else 0),  # the fp32 master copy
             "optimizer_step_temporaries":
                 training_data()["optimizers"][request.optimizer]["step_temporaries"] * trainable * size.state}
    host = {}
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
    return GpuTraining(device, request.gpus[device], held or _span([u.name for u in mine]),
                       parts["frozen_weights"] + whole, sum(u.constants_bytes for u in mine),
                       parts["trainable_weights"], parts["gradients"], parts["optimizer_state"],
                       checkpointed if request.checkpointing else full, checkpointed, full,
                       _workspace(request, shape, size, mine, first_stage, last_stage),
                       parts["optimizer_step_temporaries"], host)


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
    best = _largest(lambda c: _fits(dataclasses.replace(r, context=c)), r.context - 1)
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

