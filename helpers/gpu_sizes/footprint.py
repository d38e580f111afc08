"""What one device holds during one training step, measured on the meta device: no GPU, no memory, exact shapes.

Each part of the step, and why it is counted so (conservative where a choice had to be made):

- **weights**: the bytes of the device's parameters (4 per fp32 parameter).
- **grads**: as many bytes as the weights, for the whole step. A loop with `zero_grad(set_to_none=True)` frees them
  between steps and backward allocates them while it frees activations, so the real peak can hold less; most of the
  course's loops keep them (`set_to_none=False`), and counting them whole never plans too little.
- **optimizer**: SGD 0, SGD with momentum 4, Adam 8 bytes per parameter (Rajbhandari et al. 2020, *ZeRO*), plus
  Adam's step counters.
- **activations**: what autograd saves for backward, counted by the course's `MemoryLedger` during a forward pass
  on the meta device (each storage once, parameters excluded), per sequence and multiplied by the sequences in
  flight. Attention is counted as CUDA runs it: `scaled_dot_product_attention` on a GPU picks a fused kernel
  (memory-efficient attention in fp32, FlashAttention in 16 bits), which keeps q, k, v, the output and the softmax's
  log-sum-exp and recomputes the scores in backward (Dao et al. 2022, *FlashAttention*); on the meta device PyTorch
  would take the math path, which stores the scores, so `cuda_attention` sends it to the memory-efficient kernel's
  own meta function. Under bf16 autocast the matrix products are played in 16 bits (`cuda_attention(autocast=True)`),
  plus one 16-bit copy of the weights per micro-batch in flight (autocast's cast cache, saved for backward).
- **workspace**: transient bytes beyond the saved activations, the largest of
  (a) backward through one layer: the gradient with respect to its largest saved tensor together with the one it is
      computed from (2 x the largest saved storage; on the last stage that is the fp32 log-softmax of the loss, so
      this is also the gradient of the logits and of their log-softmax), plus the gradients flowing into and out of
      the layer (2 x the largest layer output: the logits on the last stage, held by the caller);
  (b) the optimizer step: PyTorch's foreach Adam computes sqrt(exp_avg_sq) into new tensors (4 bytes per parameter)
      after backward has freed the activations, so only what exceeds (a) and the activations counts;
  plus (c) the largest parameter's fresh gradient, which backward computes before adding it to the kept `.grad`,
  and (d) cuBLAS's workspace (`CUBLAS_WORKSPACE`), which the caching allocator hands out and max_memory_allocated sees.
  The CUDA context, cuBLAS's workspace and the caching allocator's slack are not part of a step: `plans` adds
  data/inference.json's runtime reserve per device and per process.

A step's plan is at least what a GPU's torch.cuda.max_memory_allocated sees for it, within 5% for the block stack
(15% for Hugging Face models under autocast): tests/test_gpu_sizes.py holds an H200's figures (docs/bench.md).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from helpers.sizing.ledger import ledger_for
from helpers.dtypes import BYTES
from helpers.sizing.state import OPTIMIZER_STATE, OPTIMIZER_TEMPORARIES
from helpers.models.data import lm_loss
from helpers.models.layered import call_layer
from helpers.models.stack import StackConfig, StackModel

# cuBLAS's workspace, taken from the caching allocator once per stream that multiplies matrices: 32 MiB on Hopper,
# 4096 KiB x 2 + 16 KiB x 8 on other GPUs (PyTorch aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize):
# the larger, so that a plan also holds on the H200 it is checked on
CUBLAS_WORKSPACE = 32 * 2**20


class cuda_attention(TorchFunctionMode):
    """`F.scaled_dot_product_attention` on meta tensors counted as a GPU runs it: through the memory-efficient
    kernel's meta function (what fp32 gets on CUDA; FlashAttention, which 16-bit inputs get, keeps the same tensors),
    instead of the math path PyTorch takes on the meta device, which stores the attention scores. Boolean masks
    become additive ones, as PyTorch converts them; grouped-query keys and values are repeated per query head.

    `autocast=True` also plays bf16 autocast, which has no meta device, by PyTorch's CUDA op lists (torch.amp docs,
    "CUDA Ops that can autocast to float16" / "to float32"): the matrix products (`F.linear`, `torch.addmm`, `matmul`,
    `bmm`, attention) get 16-bit inputs and give 16-bit outputs; pow, exp, log, rsqrt, softmax, the norms, sums and
    losses get 16-bit inputs cast to fp32 (GPT-2's tanh GELU, built on `torch.pow`, thus runs and saves in fp32);
    everything else runs in the dtype it gets. The 16-bit copy of a weight is made a Parameter, so the ledger leaves
    it out (`training_step` adds those copies once per micro-batch in flight, as autocast's cast cache holds them)."""

    MATMULS = {F.linear, torch.addmm, torch.matmul, torch.Tensor.__matmul__, torch.bmm, torch.baddbmm}
    TO_FP32 = {getattr(where, name) for name in (
        "pow", "__pow__", "__rpow__", "__rtruediv__", "exp", "expm1", "log", "log1p", "log2", "log10", "reciprocal",
        "rsqrt", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softmax", "log_softmax", "softmin", "softplus",
        "layer_norm", "group_norm", "norm", "normalize", "sum", "prod", "cumsum", "cumprod", "cross_entropy",
        "nll_loss", "mse_loss", "l1_loss", "kl_div") for where in (torch, torch.Tensor, F) if hasattr(where, name)}

    def __init__(self, autocast: bool = False, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dtype = dtype if autocast else None
        self._weights: dict[int, nn.Parameter] = {}

    def _cast(self, t):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == self.dtype:
            return t
        if isinstance(t, nn.Parameter):
            if id(t) not in self._weights:
                self._weights[id(t)] = nn.Parameter(t.detach().to(self.dtype))
            return self._weights[id(t)]
        return t.to(self.dtype)

    def _fp32(self, t):
        return t.float() if isinstance(t, torch.Tensor) and t.dtype == self.dtype else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        autocast = self.dtype is not None
        if func in self.MATMULS and autocast:
            return func(*map(self._cast, args), **{k: self._cast(v) for k, v in kwargs.items()})
        if func in self.TO_FP32 and autocast:
            return func(*map(self._fp32, args), **{k: self._fp32(v) for k, v in kwargs.items()})
        if func is not F.scaled_dot_product_attention or not args[0].is_meta:
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        call = {**dict(zip(names, args)), **kwargs}
        q, k, v = call["query"], call["key"], call["value"]
        if autocast:
            q, k, v = self._cast(q), self._cast(k), self._cast(v)
        if k.shape[-3] != q.shape[-3]:
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
        mask = call.get("attn_mask")
        if mask is not None:
            if mask.dtype == torch.bool:
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
            mask = mask.to(q.dtype).expand(*q.shape[:-1], k.shape[-2])
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, True, call.get("dropout_p", 0.0), call.get("is_causal", False), scale=call.get("scale"))
        return out[0]


@dataclass(frozen=True)
class LayerBytes:
    """One layer, for ONE sequence (every activation grows linearly with the batch): its parameters (an opaque token
    per parameter, so that a weight two layers share, like tied embeddings, counts once where both sit on one
    device, and its bytes), what its forward saves for backward, the largest single saved storage, and its output."""

    params: tuple[tuple[int, int], ...]
    saved: int
    largest_saved: int
    output: int


@dataclass(frozen=True)
class HFSpec:
    """A Hugging Face causal LM by its sizes (see `helpers.models.hf_config`), built on the meta device."""

    family: str
    n_layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    intermediate: int | None = None
    tie_embeddings: bool = False
    kv_heads: int | None = None

    def layers_and_context(self, ids: torch.Tensor) -> tuple[list[nn.Module], object]:
        from helpers.models.hf import build_hf_model, hf_layers

        model = build_hf_model(self.family, self.n_layers, self.hidden, self.heads, self.vocab, self.seq_len,
                               self.intermediate, meta=True, tie_embeddings=self.tie_embeddings,
                               kv_heads=self.kv_heads).train()
        layers = hf_layers(model)
        return list(layers), layers.context(ids)


ModelSpec = StackConfig | HFSpec


@lru_cache(maxsize=64)
def layer_bytes(spec: ModelSpec, autocast: bool = False) -> tuple[LayerBytes, ...]:
    """Every layer of `spec` for one sequence of its `seq_len` tokens: a forward pass and the loss on the meta
    device, each layer under its own label of one `MemoryLedger` (the loss counts with the last layer); `autocast`:
    under bf16 autocast (see `cuda_attention`)."""
    ids = torch.zeros(1, spec.seq_len, dtype=torch.long, device="meta")
    layers, ctx = (StackModel(spec).meta_layers(), None) if isinstance(spec, StackConfig) else \
        spec.layers_and_context(ids)
    labels = [f"layer {i}" for i in range(len(layers))]
    ledger = ledger_for(layers, labels)
    out, h = [], ids
    with torch.enable_grad(), cuda_attention(autocast):
        for i, (label, layer) in enumerate(zip(labels, layers)):
            with ledger.track_activations(label):
                h = call_layer(layer, h, ctx)
                output = h.numel() * h.element_size()
                if i == len(layers) - 1:
                    lm_loss(h, ids)
            params = tuple((id(p), p.numel() * p.element_size()) for p in layer.parameters())
            out.append(LayerBytes(params, ledger.device(label).activations, ledger.largest_saved(label), output))
    return tuple(out)


@dataclass(frozen=True)
class StageBytes:
    """Layers [start, end) of a model at a micro-batch of `batch` sequences."""

    params: int
    activations: int  # saved by one micro-batch
    largest_saved: int
    largest_output: int
    output: int  # what the stage hands to the next one (the boundary tensor), per micro-batch
    largest_layer_params: int
    largest_param: int
    recompute: int = 0  # a checkpointed layer's activations, saved again while its backward recomputes them

    @property
    def backward_workspace(self) -> int:
        """Workspace (a) and (c) of the module docstring: one layer's backward at this micro-batch (with a
        checkpointed layer's recomputed activations) and the largest parameter's fresh gradient."""
        return 2 * self.largest_saved + 2 * self.largest_output + self.recompute + self.largest_param


def stage_bytes(spec: ModelSpec, batch: int, layers: Sequence[int] | range | None = None,
                checkpointed: Sequence[int] | range = (), autocast: bool = False) -> StageBytes:
    """The layers `layers` (default: all) of `spec` at a micro-batch of `batch` sequences (under bf16 autocast with
    `autocast`). A layer in `checkpointed` (`torch.utils.checkpoint`, non-reentrant) saves only its input during
    forward and recomputes the rest in backward."""
    per_layer = layer_bytes(spec, autocast)
    chosen = list(range(len(per_layer)) if layers is None else layers)
    ckpt = [i for i in chosen if i in set(checkpointed)]
    saved = [per_layer[i - 1].output if i in ckpt else per_layer[i].saved for i in chosen]
    params = dict(p for i in chosen for p in per_layer[i].params)
    return StageBytes(params=sum(params.values()),
                      activations=batch * sum(saved),
                      largest_saved=batch * max(per_layer[i].largest_saved for i in chosen),
                      largest_output=batch * max(per_layer[i].output for i in chosen),
                      output=batch * per_layer[chosen[-1]].output,
                      largest_layer_params=max(sum(b for _, b in per_layer[i].params) for i in chosen),
                      largest_param=max(params.values(), default=0),
                      recompute=batch * max((per_layer[i].saved for i in ckpt), default=0))


def n_layers(spec: ModelSpec) -> int:
    return len(layer_bytes(spec))


@dataclass(frozen=True)
class Footprint:
    """Bytes on one device by part (see the module docstring for what each part counts)."""

    weights: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: "Footprint") -> "Footprint":
        return Footprint(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, int]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def held(params_bytes: int, grads: bool = False, optimizer: str | None = None) -> Footprint:
    """A model kept alive between steps: its weights, and its gradients and optimizer state where it has them."""
    return Footprint(weights=params_bytes, grads=params_bytes if grads else 0,
                     optimizer=params_bytes // 4 * OPTIMIZER_STATE[optimizer] if optimizer else 0)


def training_step(stage: StageBytes, optimizer: str = "sgd", in_flight: int = 1, keeps_outputs: bool = False,
                  autocast: bool = False, state_shards: int = 1, activations_held: int | None = None) -> Footprint:
    """One device's peak in a training step of `stage`: weights, grads, optimizer state, `in_flight` micro-batches'
    saved activations (a pipeline stage that is not the last also keeps each one's output until its gradient comes
    back: `keeps_outputs`; under autocast each also keeps 16-bit copies of the weights: give `stage` measured with
    `autocast=True`), and the workspace. `state_shards`: ZeRO-1 keeps 1/N of the optimizer state.
    `activations_held`: the activations at the step's heaviest moment where a schedule's chunks differ (it replaces
    the `in_flight` count)."""
    params = stage.params
    state = params // BYTES["fp32"] * OPTIMIZER_STATE[optimizer] // state_shards
    casts = params // 2 if autocast else 0  # autocast's 16-bit weight copies, saved with each micro-batch
    activations = activations_held if activations_held is not None else \
        in_flight * (stage.activations + (stage.output if keeps_outputs else 0) + casts)
    step_temporary = params // BYTES["fp32"] * OPTIMIZER_TEMPORARIES[optimizer] * BYTES["fp32"] // state_shards
    workspace = max(stage.backward_workspace, step_temporary - activations) + CUBLAS_WORKSPACE
    return Footprint(params, params, state, activations, workspace)


def training_step_peak(hidden: int, n_blocks: int, batch: int, seq: int, optimizer: str = "sgd",
                       vocab: int = 256, heads: int = 4) -> Footprint:
    """The planned peak of ONE training step of the whole block stack on one device (forward, loss, backward,
    optimizer step), to set beside `torch.cuda.max_memory_allocated` measured after `reset_peak_memory_stats` on a
    GPU that starts the step holding only the model (and, from the second step on, its gradients and optimizer
    state). The CUDA context and the allocator's slack are not included: max_memory_allocated does not see them."""
    spec = StackConfig(vocab=vocab, seq_len=seq, hidden=hidden, n_blocks=n_blocks, heads=heads)
    return training_step(stage_bytes(spec, batch), optimizer)


SMALL = dict(hidden=64, n_blocks=2, seq_len=16, heads=2)  # the CPU rig's sizes: the path, not the figures


@dataclass(frozen=True)
class Replay:
    """One whole-model training step of a notebook's plan, as the suite can rebuild it: the block stack's sizes, the
    batch, the optimizer and whether it runs under bf16 autocast."""

    model: StackConfig
    batch: int
    optimizer: str = "sgd"
    autocast: bool = False

    def as_dict(self) -> dict:
        model = asdict(self.model)
        model["ffn_widths"] = None if self.model.ffn_widths is None else list(self.model.ffn_widths)  # as JSON has it
        return {"model": model, "batch": self.batch, "optimizer": self.optimizer, "autocast": self.autocast}

    @classmethod
    def from_dict(cls, d: dict) -> "Replay":
        widths = d["model"]["ffn_widths"]
        model = StackConfig(**{**d["model"], "ffn_widths": None if widths is None else tuple(widths)})
        return cls(model, d["batch"], d["optimizer"], d["autocast"])

    def small(self) -> "Replay":
        widths = None if self.model.ffn_widths is None else (4 * SMALL["hidden"],) * SMALL["n_blocks"]
        return replace(self, model=replace(self.model, **SMALL, vocab=256, ffn_widths=widths), batch=2)

    def planned(self) -> int:
        """The plan of this step alone (weights, grads, optimizer state, activations, workspace), what
        max_memory_allocated sees."""
        stage = stage_bytes(self.model, self.batch, autocast=self.autocast)
        return training_step(stage, self.optimizer, autocast=self.autocast).total
