"""Hugging Face causal LMs as layer lists the engines can cut anywhere, reproducing the model's own forward exactly.

Nothing loads from a hub: `build_hf_model` builds a model from a config with random weights; `save_hf_model`
saves one with `save_pretrained`, and `HFModel` (a `LayeredModel`) reads such a directory, builds every layer on
the meta device and loads only the tensors of the layers a device owns.

The layers: embedding (token embedding, GPT-2's learned positions, Gemma's scaling by sqrt(hidden), GPT-2's
embedding dropout), one layer per decoder block (each with its own copy of the rotary embedding, buffers only, so
a cut can fall anywhere), the final norm, the head. The blocks are Hugging Face's own modules; what the model's
forward computes once for all blocks (position ids, attention masks) is computed once per micro-batch by
`hf_context` with Hugging Face's own mask functions (`transformers.masking_utils`), and handed to every layer.

Supported families: GPT-2, Llama (grouped-query attention), Mistral (sliding window), Qwen2 (per-layer sliding
window) and Gemma (v1); attention implementations "eager" and "sdpa".
"""
from __future__ import annotations

import copy
import inspect
import json
import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import torch
from torch import nn

from helpers.models.layered import Stage, layer_seed, seeded

ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa")
FULL, SLIDING = "full_attention", "sliding_attention"  # Hugging Face's names for the two kinds of attention layer


@dataclass(frozen=True)
class _Parts:
    """Where a family keeps its parts: attribute names on the causal LM (`base`) and on its decoder."""

    base: str
    embed: str
    blocks: str
    norm: str
    positions: str | None = None  # learned position embedding (GPT-2)
    dropout: str | None = None  # embedding dropout (GPT-2)
    rotary: str | None = None  # rotary position embedding, computed once by the model and given to every block


_GPT2 = _Parts("transformer", "wte", "h", "ln_f", positions="wpe", dropout="drop")
_ROTARY = _Parts("model", "embed_tokens", "layers", "norm", rotary="rotary_emb")
FAMILIES: dict[str, _Parts] = {"gpt2": _GPT2, "llama": _ROTARY, "mistral": _ROTARY, "qwen2": _ROTARY,
                               "gemma": _ROTARY}


def _check_family(model_type: str | None) -> _Parts:
    if model_type not in FAMILIES:
        raise ValueError(f"model type {model_type!r} is not supported: the layer view reproduces "
                         f"{', '.join(FAMILIES)} causal LMs exactly; other architectures compute their masks, "
                         "positions or embeddings differently")
    return FAMILIES[model_type]


def attention_kind(config, block: int) -> str:
    """Which mask block `block` uses, as the family's own forward decides: Qwen2 lists a kind per layer
    (`layer_types`), Mistral uses the sliding window on every layer when it has one, the others full attention."""
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return kinds[block]
    return SLIDING if getattr(config, "sliding_window", None) is not None else FULL


# --- the context: what every layer needs besides the hidden state -------------------------------------------------

@dataclass(frozen=True)
class HFContext:
    """Everything a micro-batch's layers need besides the hidden state, computed once (`hf_context`) as the Hugging
    Face model's forward computes it.

    - `position_ids`: [1, q] (or [b, q] when given explicitly): arange after what the cache already holds.
    - `masks`: per attention kind ("full_attention", "sliding_attention") the mask in the form the attention
      implementation takes: a float mask of 0 / dtype-min for eager, a boolean mask for sdpa, or None where sdpa's
      own causal path needs none (no padding, no window reached).
    - `cache`: this stage's KV cache (`transformers.DynamicCache`) for incremental decoding, or None.
    - `seed`: seeds dropout. With a seed, each layer runs in training mode under a generator forked and seeded from
      (seed, layer index), so a layer's dropout is the same run after run and wherever the layer runs; without one,
      dropout draws from the global generator as Hugging Face's forward does. Engines set one per micro-batch with
      `dataclasses.replace(ctx, seed=...)`. A one-device reference that runs the same micro-batches with the same
      seeds equals the engine exactly; with m > 1 micro-batches it differs from one device running the whole batch
      at once, because dropout masks are drawn per micro-batch, not for the whole batch.
    """

    position_ids: torch.Tensor
    masks: Mapping[str, torch.Tensor | None]
    cache: object | None = None
    seed: int | None = None

    def mask(self, kind: str, device: torch.device) -> torch.Tensor | None:
        """The mask of one attention kind on `device` (stages on other devices share one context)."""
        m = self.masks[kind]
        return m.to(device) if m is not None and m.device != device else m


def check_inputs(config, input_ids: torch.Tensor, past: int = 0) -> None:
    """Refuse token ids outside the vocabulary, and sequences longer than learned positions (GPT-2), here, with the
    model's sizes, rather than as an index error deep inside an embedding (possibly on another rank)."""
    if input_ids.is_meta or input_ids.numel() == 0:
        return
    vocab = config.vocab_size
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab:
        raise ValueError(f"token id {high if high >= vocab else low} is outside the model's vocabulary of {vocab} "
                         f"tokens (ids 0..{vocab - 1})")
    max_positions = getattr(config, "n_positions", None)
    if max_positions is not None and past + input_ids.shape[1] > max_positions:
        raise ValueError(f"{past + input_ids.shape[1]} tokens are more than the model's {max_positions} learned "
                         "positions")


def _positions(q_length: int, device: torch.device, past: int = 0) -> torch.Tensor:
    """What the model's forward uses when given no position ids: arange after the cached tokens, as [1, q]."""
    return (torch.arange(q_length, device=device) + past).unsqueeze(0)


def _cache_layer(cache, kind: str) -> int | None:
    """The cache layer that sizes a mask. A stage's cache holds only the stage's own layers (all of which have seen
    the same tokens), so take the first filled layer of this kind, else any filled one; None (Hugging Face's
    default: the first layer of the kind) when nothing is filled yet, as in prefill."""
    filled = [i for i, layer in enumerate(cache.layers) if layer.is_initialized]
    same = [i for i in filled if cache.is_sliding[i] == (kind == SLIDING)]
    return (same or filled or [None])[0]


def _past_length(cache, attention_mask: torch.Tensor | None, q_length: int) -> int:
    """Tokens before this step: what the stage's cache holds. A stage without attention layers keeps nothing in its
    cache; then the attention mask, which covers past and new tokens when decoding, says it."""
    layer = _cache_layer(cache, FULL)
    if layer is not None:
        return cache.get_seq_length(layer)
    return attention_mask.shape[-1] - q_length if attention_mask is not None else 0


def _build_context(config, batch: int, q_length: int, device: torch.device, dtype: torch.dtype,
                   attention_mask: torch.Tensor | None = None, cache=None, position_ids: torch.Tensor | None = None,
                   past: int = 0) -> HFContext:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    # Only the batch size, query length, dtype and device of the embeddings matter to the mask functions.
    shape_only = torch.empty(batch, q_length, 0, dtype=dtype, device=device)
    makers = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
    masks = {}
    for kind in sorted({attention_kind(config, i) for i in range(config.num_hidden_layers)}):
        # Default positions are a plain arange, in which Hugging Face's packed-sequence detection finds nothing:
        # passing only given ones keeps the result and lets the mask be built on the meta device.
        # The cache goes fourth by position: transformers 5.17 names it past_key_values, 5.25 cache.
        masks[kind] = makers[kind](config, shape_only, attention_mask, cache, position_ids=position_ids,
                                   layer_idx=_cache_layer(cache, kind) if cache is not None else None)
    return HFContext(position_ids if position_ids is not None else _positions(q_length, device, past), masks, cache)


def hf_context(config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
               position_ids: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> HFContext:
    """The context of one micro-batch (see `HFContext`), computed from the token ids alone, as every stage can.

    `attention_mask` is Hugging Face's 2D padding mask (1 = token, 0 = padding), left or right padding, covering
    cached and new tokens when decoding. `cache`: the stage's own KV cache; build the context before running the
    stage, as the mask is sized from what the cache holds. `position_ids` default to what the model's forward
    uses (arange after the cached tokens); `generate` passes `attention_mask.cumsum(-1) - 1` for left-padded
    prompts: pass those to reproduce it. `dtype`: the model's (the eager mask is in it).
    """
    past = _past_length(cache, attention_mask, input_ids.shape[1]) if cache is not None else 0
    check_inputs(config, input_ids, past)
    return _build_context(config, *input_ids.shape, input_ids.device, dtype, attention_mask, cache, position_ids,
                          past)


_GENERATOR_LOCKS: dict[str, threading.RLock] = {}  # one per random generator stage threads may share
_LOCKS_LOCK = threading.Lock()


def generator_lock(device: torch.device) -> threading.RLock:
    """The lock of the default generator that dropout on `device` draws from: the CPU's, or one per GPU. Two stage
    threads on one device (the CPU rig's virtual devices, both stages of the one-GPU rig on cuda:0) share that
    generator; seeding it and drawing from it must not interleave, or a mask would depend on thread timing."""
    key = "cpu" if device.type != "cuda" else f"cuda:{device.index if device.index is not None else 0}"
    with _LOCKS_LOCK:
        return _GENERATOR_LOCKS.setdefault(key, threading.RLock())


@contextmanager
def _dropout_generator(ctx: HFContext | None, index: int, training: bool, device: torch.device) -> Iterator[None]:
    """Run a layer under its own generator, forked and seeded from (context seed, layer index), when the context
    carries a seed (see `HFContext.seed`); the caller's generators are left as they were. The device's default
    generator is held for the layer's forward (`generator_lock`): stage threads sharing it take turns in the
    layers that draw random numbers, and their masks are those of one device whatever the timing."""
    if ctx is None or ctx.seed is None or not training or device.type == "meta":
        yield
        return
    gpus = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with generator_lock(device), torch.random.fork_rng(devices=gpus):
        generator = torch.cuda.default_generators[gpus[0]] if gpus else torch.random.default_generator
        generator.manual_seed(layer_seed(ctx.seed, index))
        yield


# --- the layers -------------------------------------------------------------------------------------------------

class HFEmbedding(nn.Module):
    """Token embedding (Gemma's scales itself by sqrt(hidden) in the weights' dtype), plus GPT-2's learned
    positions and embedding dropout: everything the model does before its first block."""

    takes_context = True

    def __init__(self, config, tok: nn.Module, pos: nn.Module | None = None, drop: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.tok, self.pos, self.drop = tok, pos, drop
        self.index = 0

    def forward(self, input_ids: torch.Tensor, ctx: HFContext | None = None) -> torch.Tensor:
        if ctx is None:  # a whole sequence, nothing cached: positions are all the embedding needs
            check_inputs(self.config, input_ids)
            ctx = HFContext(_positions(input_ids.shape[1], input_ids.device), masks={})
        with _dropout_generator(ctx, self.index, self.training, input_ids.device):
            h = self.tok(input_ids)
            if self.pos is not None:
                h = h + self.pos(ctx.position_ids.to(input_ids.device))
            return self.drop(h) if self.drop is not None else h


def cache_keyword(block: nn.Module) -> str:
    """The name a decoder block takes its KV cache by: `cache` from transformers 5.25, `past_key_values` before (a
    cache passed under the other name lands in **kwargs unused: decoding then attends to nothing cached)."""
    return "cache" if "cache" in inspect.signature(block.forward).parameters else "past_key_values"


class HFBlock(nn.Module):
    """One Hugging Face decoder block, called as the model's forward calls it: with its attention kind's mask, the
    position ids, the rotary embedding of its own copy of the rotary module, and the stage's KV cache."""

    takes_context = True

    def __init__(self, config, block: nn.Module, index: int, kind: str, rotary: nn.Module | None = None):
        super().__init__()
        self.config = config
        self.block = block
        self.rotary = copy.deepcopy(rotary) if rotary is not None else None
        self.index, self.kind = index, kind
        self.cache_keyword = cache_keyword(block)

    def forward(self, h: torch.Tensor, ctx: HFContext | None = None) -> torch.Tensor:
        if ctx is None:  # a whole causal sequence, nothing cached: what a layer called on its own needs
            ctx = _build_context(self.config, h.shape[0], h.shape[1], h.device, h.dtype)
        with _dropout_generator(ctx, self.index, self.training, h.device):
            positions = ctx.position_ids.to(h.device)
            kwargs = {"attention_mask": ctx.mask(self.kind, h.device), "position_ids": positions,
                      self.cache_keyword: ctx.cache, "use_cache": ctx.cache is not None}
            if self.rotary is not None:
                kwargs["position_embeddings"] = self.rotary(h, positions)
            out = self.block(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HFLayers(Stage):
    """The layer list of a Hugging Face causal LM: embedding, blocks..., final norm, head. Run it as a stage,
    `layers(ids)` (a whole causal sequence) or `layers(ids, layers.context(ids, attention_mask))` (padding)."""

    def __init__(self, config, layers: Iterable[nn.Module]):
        super().__init__(list(layers))
        self.config = config

    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                position_ids: torch.Tensor | None = None) -> HFContext:
        return hf_context(self.config, input_ids, attention_mask, cache, position_ids, self.layers[0].tok.weight.dtype)


def hf_layers(model: nn.Module) -> HFLayers:
    """An in-memory Hugging Face causal LM as its layer list (see `HFLayers`), sharing the model's parameters:
    cutting the list cuts the model. With tied embeddings the embedding and the head share one Parameter, as in
    the model (both on one device: nothing extra to do). For a model saved on disk, `HFModel` builds the same
    layers on the meta device and loads only the ones a device owns."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "lm_head"):
        raise TypeError(f"cannot list the layers of {type(model).__name__}: expected a Hugging Face causal LM "
                        "(a ...ForCausalLM or GPT2LMHeadModel, with a config and an lm_head)")
    parts = _check_family(config.model_type)
    base = getattr(model, parts.base)
    rotary = getattr(base, parts.rotary) if parts.rotary else None
    embedding = HFEmbedding(config, getattr(base, parts.embed),
                            getattr(base, parts.positions) if parts.positions else None,
                            getattr(base, parts.dropout) if parts.dropout else None)
    blocks = [HFBlock(config, block, i + 1, attention_kind(config, i), rotary)
              for i, block in enumerate(getattr(base, parts.blocks))]
    return HFLayers(config, [embedding, *blocks, getattr(base, parts.norm), model.lm_head])


# --- a saved model, loaded layer by layer -------------------------------------------------------------------------

def _checkpoint_index(path: Path) -> dict[str, str]:
    """Tensor name -> safetensors file, for one file or a sharded checkpoint (its index json)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.exists():
        raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json: save the model with "
                         "save_pretrained (safetensors, the default)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {name: single.name for name in f.keys()}


Slice = tuple[int, int, int]  # (dimension, part, parts): part `part` of `parts` equal chunks along `dimension`


def _read(handle, name: str, piece: Slice | None) -> torch.Tensor:
    """Tensor `name` of an open safetensors file, or only one chunk of it (safetensors reads just those bytes)."""
    if piece is None:
        return handle.get_tensor(name)
    dim, part, parts = piece
    view = handle.get_slice(name)
    size = view.get_shape()[dim]
    if size % parts:
        raise ValueError(f"{name}: {size} rows along dimension {dim} do not split into {parts} equal parts")
    step = size // parts
    index = (slice(None),) * dim + (slice(part * step, (part + 1) * step),)
    return view[index]


def read_tensors(path: str | Path, names: Iterable[str],
                 slices: Mapping[str, Slice] | None = None) -> dict[str, torch.Tensor]:
    """Exactly the tensors `names` of a safetensors checkpoint, each file opened once; nothing else is read. With
    `slices`, only the given chunk of those tensors (a tensor-parallel rank's shard)."""
    from safetensors import safe_open

    path = Path(path)
    where = _checkpoint_index(path)
    by_file: dict[str, list[str]] = {}
    for name in names:
        if name not in where:
            raise ValueError(f"the checkpoint in {path} has no tensor {name!r}")
        by_file.setdefault(where[name], []).append(name)
    out = {}
    for file, wanted in by_file.items():  # read on the host, whatever the caller's default device
        with torch.device("cpu"), safe_open(path / file, framework="pt", device="cpu") as f:
            out.update({name: _read(f, name, (slices or {}).get(name)) for name in wanted})
    return out


def load_module(module: nn.Module, path: str | Path, prefix: str = "", dtype: torch.dtype | None = None) -> nn.Module:
    """Fill `module`, a part of a Hugging Face model built on the meta device whose tensors the checkpoint in `path`
    stores as `prefix` + their local names (`model.layers.3.` for a decoder layer, "" for the whole model), with
    exactly those tensors, read on the host (`read_tensors`: nothing else is read), floating ones in `dtype`. Weights
    tied inside `module` stay one Parameter (a tied checkpoint stores one of their names); `requires_grad` is kept.
    Buffers the checkpoint does not hold (rotary frequencies) are left as they are. Returns `module`."""
    where = _checkpoint_index(Path(path))
    params = {id(p) for p in module.parameters()}
    groups: dict[int, list[str]] = {}  # one entry per tensor, with every name it has in `module`
    originals: dict[int, torch.Tensor] = {}
    for local, t in module.state_dict(keep_vars=True).items():
        groups.setdefault(id(t), []).append(local)
        originals[id(t)] = t
    stored = {}
    for key, names in groups.items():
        saved = [prefix + n for n in names if prefix + n in where]
        if saved:
            stored[key] = saved[0]
        elif key in params:
            raise ValueError(f"the checkpoint in {path} has no tensor {prefix + names[0]!r}")
    tensors = read_tensors(path, stored.values())
    state = {}
    for key, name in stored.items():
        t = _as_dtype(tensors.pop(name), dtype) if dtype is not None else tensors.pop(name)
        value = nn.Parameter(t, requires_grad=originals[key].requires_grad) if key in params else t
        state.update(dict.fromkeys(groups[key], value))
    module.load_state_dict(state, strict=False, assign=True)
    return module


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face causal LM saved with `save_pretrained` in the directory `path`, as a `LayeredModel`: a small
    picklable description (path and options) the launcher sends to every rank.

    `meta_layers()` builds the layers of `hf_layers` on the meta device from config.json; `materialize` loads only
    the requested layers' tensors from the safetensors files. `dtype`: the weights' dtype (fp32, bf16, fp16;
    default: the checkpoint's); rotary frequencies stay fp32, as `from_pretrained` keeps them.

    Tied embeddings (`tied_parameters()`): the embedding and the head are two parameters, both loaded from the one
    tensor a tied checkpoint stores, so they can live on different devices; engines keep them equal by summing their
    gradients. When one `materialize` call places both on one device, they share one Parameter instead.
    """

    path: str
    attn_implementation: str = "sdpa"
    dtype: torch.dtype | None = None

    def __post_init__(self):
        if self.attn_implementation not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {self.attn_implementation!r} is not supported: choose one "
                             f"of {ATTENTION_IMPLEMENTATIONS}")
        directory = Path(self.path)
        if not (directory / "config.json").is_file():
            raise ValueError(f"{self.path} is not a model saved with save_pretrained: it has no config.json")
        _check_family(json.loads((directory / "config.json").read_text()).get("model_type"))
        _checkpoint_index(directory)

    @cached_property
    def config(self):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path, attn_implementation=self.attn_implementation)

    @property
    def weights_dtype(self) -> torch.dtype:
        stored = getattr(self.config, "dtype", None)  # a torch.dtype, or its name in an older config
        return self.dtype or (getattr(torch, stored) if isinstance(stored, str) else stored) or torch.float32

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def n_layers(self) -> int:
        return self.config.num_hidden_layers + 3

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def tied_parameters(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        """Pairs of ((layer index, parameter name), (layer index, parameter name)) that are one weight in the
        checkpoint: the embedding and the head when the embeddings are tied."""
        return [((0, "tok.weight"), (self.n_layers - 1, "weight"))] if self.tied else []

    def skeleton(self, real_buffers: bool = True, tied: bool = True) -> nn.Module:
        """The whole Hugging Face model with its parameters on the meta device; its buffers (rotary frequencies,
        Gemma's scale: not in the checkpoint) really computed on the host, from where `materialize` moves them to the
        layer's device, or (`real_buffers=False`) on the meta device too. `tied`: tied as the checkpoint is, for
        engines that shard the original module (tensor parallelism) and then load each parameter's own part with
        `read_tensors`; the layer view is built untied, ties being the checkpoint's."""
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        config = copy.deepcopy(self.config)
        config.tie_word_embeddings = False
        with init_empty_weights(include_buffers=False) if real_buffers else nullcontext(), \
                torch.device("cpu" if real_buffers else "meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation=self.attn_implementation,
                                                     dtype=self.weights_dtype)
        if tied and self.tied:
            model.lm_head.weight = model.get_input_embeddings().weight
        return model

    def meta_layers(self) -> list[nn.Module]:
        return list(hf_layers(self.skeleton(real_buffers=False, tied=False)))

    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, cache=None,
                position_ids: torch.Tensor | None = None) -> HFContext:
        """See `hf_context`; `cache` is this stage's own (`new_cache()`)."""
        return hf_context(self.config, input_ids, attention_mask, cache, position_ids, self.weights_dtype)

    def new_cache(self):
        """An empty KV cache for one stage (the kind `generate` uses: sliding-window layers keep only the window)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def materialize(self, layers: list[nn.Module], indices: Iterable[int], device: torch.device) -> None:
        """Replace the layers at `indices` by ones holding the checkpoint's weights (in `weights_dtype`) on `device`,
        reading only their tensors. Tied embeddings: if this call places both the embedding and the head, they
        share one Parameter; otherwise each gets its own copy of the checkpoint's one tensor."""
        owned = sorted(set(indices))
        if any(not 0 <= i < len(layers) for i in owned):
            raise ValueError(f"layer indices {owned} are outside the model's {len(layers)} layers")
        model = self.skeleton(tied=False)
        skeleton = hf_layers(model)
        head = len(skeleton) - 1
        share = self.tied and 0 in owned and head in owned
        wanted = self.checkpoint_names(owned, model)
        if share:
            del wanted[head]["weight"]
        tensors = read_tensors(self.path, {name for names in wanted.values() for name in names.values()})
        for i in owned:  # in order: the embedding is on `device` before a head that shares its weight
            layer = skeleton[i]
            state = {local: _as_dtype(tensors[name], self.weights_dtype) for local, name in wanted[i].items()}
            if share and i == head:
                state["weight"] = layers[0].tok.weight
            layer.load_state_dict(state, assign=True)
            layers[i] = layer.to(device)

    def checkpoint_names(self, indices: Iterable[int], model: nn.Module | None = None) -> dict[int, dict[str, str]]:
        """For the layers at `indices` (of `model`, default a meta skeleton): each state name -> the checkpoint tensor
        it is saved as (how trained layers go back into a `save_pretrained` directory). When tied, the head's weight
        is the embedding's tensor: a tied checkpoint stores only that one."""
        model = model if model is not None else self.skeleton(real_buffers=False, tied=False)
        skeleton = hf_layers(model)
        full = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        names = {i: {local: full[id(t)] for local, t in skeleton[i].state_dict(keep_vars=True).items()}
                 for i in sorted(set(indices))}
        head = len(skeleton) - 1
        if self.tied and head in names:
            names[head]["weight"] = full[id(skeleton[0].tok.weight)]
        return names


def _as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t


def save_hf_model(config, directory: str | Path, seed: int = 0, attn_implementation: str = "sdpa",
                  dtype: torch.dtype | None = None) -> HFModel:
    """Build the causal LM of `config` with random weights drawn from `seed`, `save_pretrained` it to `directory`
    and return the `HFModel` that reads it, so each rank loads only its own layers."""
    from transformers import AutoModelForCausalLM

    _check_family(config.model_type)
    with seeded(seed):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    model.save_pretrained(directory)
    return HFModel(str(directory), attn_implementation, dtype)


def enable_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Recompute each decoder layer in backward, non-reentrant, by the name the installed transformers has
    (`gradient_checkpointing_enable` warns from 5.x on and goes in v6)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


# --- models built from configs (nothing downloaded) -----------------------------------------------------------------

def hf_config(family: str = "gpt2", n_layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 256,
              seq_len: int = 64, intermediate: int | None = None, tie_embeddings: bool = False, *,
              kv_heads: int | None = None, sliding_window: int | None = None, dropout: float = 0.0):
    """The config of a small (or, on the meta device, a real-sized) model of a supported family.

    `kv_heads` < `heads`: grouped-query attention (not GPT-2). `sliding_window`: Mistral's on every layer, Qwen2's
    on the upper half of the layers (its `max_window_layers`). `dropout`: every dropout the family has."""
    from transformers import GemmaConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {list(FAMILIES)}")
    if family == "gpt2" and kv_heads not in (None, heads):
        raise ValueError("GPT-2 has no grouped-query attention: leave kv_heads unset")
    if family not in ("mistral", "qwen2") and sliding_window is not None:
        raise ValueError(f"{family} has no sliding window; Mistral and Qwen2 have one")
    intermediate = intermediate or 4 * hidden
    if family == "gpt2":
        return GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=hidden, n_layer=n_layers, n_head=heads,
                          n_inner=intermediate, tie_word_embeddings=tie_embeddings, resid_pdrop=dropout,
                          embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=n_layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads or heads, max_position_embeddings=seq_len,
                  tie_word_embeddings=tie_embeddings, attention_dropout=dropout)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=sliding_window)
    if family == "qwen2":
        return Qwen2Config(**common, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                           max_window_layers=n_layers // 2)
    return GemmaConfig(**common, head_dim=hidden // heads)


def build_hf_model(family: str = "gpt2", n_layers: int = 4, hidden: int = 128, heads: int = 4, vocab: int = 256,
                   seq_len: int = 64, intermediate: int | None = None, seed: int = 0, meta: bool = False,
                   tie_embeddings: bool = False, *, kv_heads: int | None = None, sliding_window: int | None = None,
                   dropout: float = 0.0, attn_implementation: str = "sdpa",
                   dtype: torch.dtype | None = None) -> nn.Module:
    """A Hugging Face causal LM (see `hf_config` for the families and options) with random weights: no download.

    `meta=True` builds it on the meta device: exact shapes and parameter counts of a 7B model with no memory.
    Embeddings are untied by default (`tie_embeddings=True` gives GPT-2's and Gemma's published parameter counts).
    Returned in eval mode, like `from_pretrained`.
    """
    from transformers import AutoModelForCausalLM

    config = hf_config(family, n_layers, hidden, heads, vocab, seq_len, intermediate, tie_embeddings,
                       kv_heads=kv_heads, sliding_window=sliding_window, dropout=dropout)
    with seeded(seed), torch.device("meta") if meta else nullcontext():
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype)
    return model.eval()
