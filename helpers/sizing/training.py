"""A decoder prepared for fine-tuning, priced: which parameters train and which stay frozen (full, LoRA, QLoRA), in
which weight format, and what autograd saves per decoder layer, term by term (`layer_saved_bytes`,
`saved_activation_bytes`: Llama-style decoders, fused SDPA, unpadded sequences; tests/test_plan_train.py checks them
against helpers.sizing.ledger.MemoryLedger). The training planner (helpers.finetune.memory_plan) builds on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from torch import nn

from helpers.sizing.shape import (ModelShape, WeightFormat, known_formats, meta_model, model_shape, placement_units,
                                  weight_format)
from helpers.sizing.state import training_data

METHODS = ("full", "lora", "qlora")
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TORCHAO_NF4 = "nf4-torchao"  # torchao's NF4: 4-bit codes, an 8-bit scale per 64 values, a factor per 256 scales
DEFAULT_DTYPE = {"full": "bf16", "lora": "bf16", "qlora": TORCHAO_NF4}  # QLoRA as the course's scripts run it
FP32 = 4  # bytes: RMSNorm's upcast input, rsqrt, the attention log-sum-exp, the fp32 loss
INT64 = 8  # bytes: token ids the embedding saves, labels the loss saves


def default_lora_rank() -> int:
    return training_data()["lora"]["default_rank"]


def check_method(method: str) -> str:
    key = str(method).strip().lower()
    if key not in METHODS:
        raise ValueError(f"unknown fine-tuning method {method!r}: choose full (every weight trains), lora (adapters on "
                         "a 16-bit base) or qlora (adapters on a 4-bit base)")
    return key


def check_rank(rank) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"the LoRA rank must be a whole number of at least 1 (the adapters' inner size; QLoRA uses "
                         f"{default_lora_rank()}), got {rank!r}")
    return rank


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
    frozen_tensors: tuple[int, ...] = ()  # bytes of each storage of the sharded frozen parameters (`_frozen_tensors`)

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
    method = check_method(method)
    fmt = weight_format(dtype or DEFAULT_DTYPE[method])
    if method == "qlora" and not fmt.quantized:
        raise ValueError(f"qlora trains adapters on a quantized base: use a quantized --dtype "
                         f"({', '.join(f for f in known_formats() if weight_format(f).quantized)}), not {fmt.name}; "
                         "for a 16-bit base choose --method lora")
    if method != "qlora" and fmt.quantized:
        raise ValueError(f"{method} needs a base in a float format (bf16, fp16, fp32), not {fmt.name}: "
                         "for adapters on a quantized base choose --method qlora")
    rank = None if method == "full" else check_rank(default_lora_rank() if lora_rank is None else lora_rank)
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
    fmt, units, seen = base.format, [], set()
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
        frozen = _frozen_tensors(module, {id(m) for _, m in linears}, fmt, seen)
        adapters = [n for part, m in linears if part in targets for n in (rank * m.in_features, m.out_features * rank)]
        units.append(Unit(layer.name, layer.kind, layer.params, layer.weight_bytes, constants, buffers,
                          tuple(adapters), max((math.prod(s) for s in quantized), default=0), frozen))
    return TrainShape(base, method, rank, targets, tuple(units), tuple(available))


def _frozen_tensors(module: nn.Module, quantizable: set[int], fmt: WeightFormat, seen: set[int]) -> tuple[int, ...]:
    """Bytes of each storage the frozen parameters of `module` hold, unsharded (a tied weight once, where it is
    seen first), which FSDP2 shards and CPU offload pins one by one: a parameter in the base format, and for a
    quantized linear weight its packed codes plus, for torchao's NF4, each scale tensor it keeps inside (its
    `_pin_memory` pins quantized_data, quantized_scalers and quantization_factor separately: torchao
    nf4_tensor.py, nf4_pin_memory over _INNER_TENSOR_NAMES_FOR_SHARDING). bitsandbytes' constants are not
    parameters (never sharded, never offloaded): left out. They add up to the unit's `packed_bytes`."""
    out = []
    for owner in module.modules():
        for pname, p in owner.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not (fmt.quantized and id(owner) in quantizable and pname == "weight"):
                out.append(fmt.tensor_bytes(p.shape, False))
                continue
            out.append(math.ceil(p.numel() * fmt.weight_bits / 8))
            if fmt.name.startswith(TORCHAO_NF4):
                out += [math.ceil(math.ceil(p.numel() / every) * bits / 8) for every, bits in fmt.scales]
    return tuple(out)


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
    (what helpers.sizing.ledger.MemoryLedger counts); `recompute` is the layer checkpointing recomputes during
    backward."""

    saved: int
    recompute: int = 0
    layers: int = 0  # of `saved`, what the decoder layers keep (activation offload moves it to host RAM)
    largest_layer: int = 0  # of `layers`, the most one decoder layer keeps (offloading keeps it on the GPU)

    @property
    def peak(self) -> int:
        return self.saved + self.recompute


def saved_activation_bytes(shape: TrainShape, context: int, batch: int, *, activation_checkpointing: bool,
                           compute_bytes: int | None = None, adapter_bytes: int | None = None,
                           layers: Sequence[int] | None = None, embedding: bool = True,
                           loss: bool = True, chunked_loss: bool = False) -> Activations:
    """Activations of `batch` sequences of `context` tokens through the decoder layers `layers` (default all), the
    embedding (if `embedding`) and the final norm, head and loss (if `loss`).

    Outside the layers: the embedding saves the token ids when it trains (int64); the final RMSNorm as a layer's; the
    head saves its input when it trains; transformers' loss saves the fp32 log-softmax of all batch x context
    positions, the int64 labels and one fp32 scalar; RoPE's cos and sin (context x head_dim each, shared by every
    layer). With checkpointing (non-reentrant, on every decoder layer) a layer keeps only its input (compute dtype),
    cos and sin are held inside the checkpoints (not counted), and backward recomputes one layer at a time: that
    layer's saved tensors are `recompute`. `chunked_loss`: the head and loss run per chunk under checkpoint, so the
    loss keeps the head's input (compute dtype) and the labels instead of the fp32 log-softmax of every position
    (the chunk recomputed in backward is the workspace's: `chunked_loss_tokens`).
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
    if loss and chunked_loss:
        per_token += _norm_saved(b.hidden, a, True, full) + a * b.hidden + INT64
    elif loss:
        per_token += _norm_saved(b.hidden, a, True, full) + (a * b.hidden if full else 0) + FP32 * b.vocab + INT64
    grads = [full or j > 0 for j in layers]  # the layer's input needs a gradient
    layer_bytes = [layer_saved_bytes(shape, a, c, g) for g in grads]
    if activation_checkpointing:
        kept = tokens * a * b.hidden  # each checkpointed layer's input
        saved = tokens * per_token + kept * len(layer_bytes) + (FP32 if loss else 0)
        return Activations(saved, tokens * max(layer_bytes, default=0), kept * len(layer_bytes),
                           kept if layer_bytes else 0)
    rope = 2 * context * b.head_dim * a if layer_bytes else 0
    return Activations(tokens * (per_token + sum(layer_bytes)) + rope + (FP32 if loss else 0), 0,
                       tokens * sum(layer_bytes), tokens * max(layer_bytes, default=0))


def chunked_loss_tokens(tokens: int) -> int:
    """Tokens per chunk of the chunked loss (data/training_memory.json techniques, chunk_tokens), at most `tokens`."""
    return min(tokens, training_data()["techniques"]["chunked-loss"]["chunk_tokens"])
