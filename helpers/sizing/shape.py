"""A Hugging Face decoder as every planner sees it: its placement units (the modules a device_map names), each with
its exact parameter count on the meta device and its bytes in a weight format (fp16, bf16, int8, nf4, ... from
data/inference.json, with sources), the KV cache per token of each decoder layer, and the sizes the workspace
estimates need. The inference planner (helpers.inference.plan), the training planner (helpers.finetune.memory_plan)
and their comparisons with accelerate and transformers build on `ModelShape`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from helpers.facts import cached_data


inference_data = partial(cached_data, "inference")  # data/inference.json, read once: treat it as read-only


# --- weight formats -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """How a weight is stored: its bits, plus the scaling constants a quantised format keeps beside it.

    Quantised formats (bitsandbytes int8 / 4-bit, as transformers applies them) quantise only the weights of the
    decoder layers' nn.Linear modules; embeddings, norms, biases and the head stay in the activation dtype.
    """

    name: str
    weight_bits: int
    scales: tuple[tuple[int | str, int], ...] = ()  # (one constant per `every` weights, or per "row"; its bits)
    activation_bytes: int = 2  # activations, the KV cache, and every tensor a quantised format leaves alone
    source: str = ""

    @property
    def quantized(self) -> bool:
        return bool(self.scales)

    def tensor_bytes(self, shape: Sequence[int], quantize: bool) -> int:
        """Bytes of one tensor of `shape`; `quantize` says whether a quantised format applies to it."""
        numel = math.prod(shape)
        if not self.quantized:
            return numel * self.weight_bits // 8
        if not quantize:
            return numel * self.activation_bytes
        bits = numel * self.weight_bits
        for every, scale_bits in self.scales:
            bits += (shape[0] if every == "row" else math.ceil(numel / every)) * scale_bits
        return math.ceil(bits / 8)

    def bytes_per_weight(self, features: int = 4096) -> float:
        """Average bytes per weight of a features x features matrix, scaling constants included."""
        return self.tensor_bytes((features, features), quantize=True) / features**2

    def describe(self) -> str:
        if not self.quantized:
            return f"{self.name}, {self.bytes_per_weight():g} bytes per weight"
        return (f"{self.name}, {self.bytes_per_weight():.4g} bytes per decoder-layer linear weight (scales included), "
                f"{self.activation_bytes} for the other tensors")


def known_formats() -> list[str]:
    return sorted(inference_data()["weight_formats"])


def weight_format(name: str | WeightFormat) -> WeightFormat:
    """A format from data/inference.json by name or alias ("fp16", "bf16", "int8", "nf4", "4bit", ...)."""
    if isinstance(name, WeightFormat):
        return name
    data = inference_data()
    key = str(name).strip().lower()
    key = data["weight_format_aliases"].get(key, key)
    entry = data["weight_formats"].get(key)
    if entry is None:
        raise ValueError(f"no byte size known for weight format {name!r}: choose one of {', '.join(known_formats())} "
                         f"(or an alias: {', '.join(sorted(data['weight_format_aliases']))})")
    scales = tuple((s["every"], s["bits"]) for s in entry.get("scales", ()))
    return WeightFormat(key, entry["weight_bits"], scales, entry["activation_bytes"], entry["source"])


# --- model shapes -------------------------------------------------------------------------------------------------

def known_models() -> list[str]:
    return sorted(inference_data()["models"])


def load_config(model):
    """(name, transformers config) for a bundled model name, its Hugging Face id, a local directory holding a
    config.json (or that file), or a config object. Nothing is downloaded."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        return (getattr(model, "name_or_path", "") or model.model_type), model
    models = inference_data()["models"]
    key = str(model).strip()
    by_id = {entry["hf_id"].lower(): name for name, entry in models.items()}
    name = key.lower() if key.lower() in models else by_id.get(key.lower())
    if name is not None:
        fields = dict(models[name]["config"])
        return name, AutoConfig.for_model(fields.pop("model_type"), **fields)
    path = Path(key).expanduser()
    folder = path.parent if path.name == "config.json" else path
    if (folder / "config.json").is_file():
        return folder.name, AutoConfig.from_pretrained(folder)
    raise ValueError(f"unknown model {model!r}: known models are {', '.join(known_models())}; "
                     "or give a directory that holds a config.json")


@lru_cache(maxsize=8)
def _meta_model_from_json(config_json: str) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(config_json)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config).eval()


def meta_model(config) -> nn.Module:
    """The causal LM built on the meta device: exact shapes, no memory. Cached per config: do not modify it."""
    return _meta_model_from_json(config.to_json_string(use_diff=False))


def placement_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a device_map names, in forward order: the base model's children with its layer list expanded
    (embedding, decoder layers, final norm, rotary embedding), then the head. accelerate's infer_auto_device_map stops
    at the same modules for these models: their decoder layers are `_no_split_modules` and the rest are leaves."""
    units = []
    for name, child in model.named_children():
        if child is not model.base_model:
            units.append((name, child))
            continue
        for sub, grandchild in child.named_children():
            if isinstance(grandchild, nn.ModuleList):
                units += [(f"{name}.{sub}.{i}", layer) for i, layer in enumerate(grandchild)]
            else:
                units.append((f"{name}.{sub}", grandchild))
    return units


@dataclass(frozen=True)
class Layer:
    """One module of the device_map and what it costs on the device that holds it."""

    name: str
    kind: str  # "embedding", "decoder", "norm", "head" or "buffers" (no parameters: the rotary embedding)
    params: int
    weight_bytes: int  # parameters in the weight format, plus buffers
    streamed_bytes: int  # weight bytes one decode step reads: all of them, except for the embedding...
    row_bytes: int = 0  # ...which reads one row per sequence
    kv_bytes_per_token: int = 0  # per sequence: 2 (K and V) x kv_heads x head_dim x bytes; decoder layers only
    window: int | None = None  # a sliding-window layer keeps at most this many tokens

    def kv_tokens(self, context: int) -> int:
        """Tokens this layer's cache holds at its peak: transformers' DynamicCache keeps the last window - 1 tokens
        of a sliding layer and concatenates the new one (cache_utils.DynamicSlidingWindowLayer), so min(context,
        window) during a decode step."""
        return context if self.window is None else min(context, self.window)

    def kv_bytes(self, context: int, batch: int) -> int:
        return batch * self.kv_tokens(context) * self.kv_bytes_per_token

    def read_bytes(self, context: int, batch: int) -> int:
        """Bytes one decode step reads here (the time proxy): streamed weights, looked-up rows, the whole KV cache."""
        return self.streamed_bytes + batch * self.row_bytes + self.kv_bytes(context, batch)


@dataclass(frozen=True)
class ModelShape:
    """A decoder's placement units priced in one weight format, and the sizes the workspace estimate needs."""

    name: str
    format: WeightFormat
    layers: tuple[Layer, ...]
    tied: bool  # the head shares the embedding's weight: both must sit on one device
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    config: object = field(compare=False, repr=False)

    @property
    def params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def weight_bytes(self) -> int:
        return sum(layer.weight_bytes for layer in self.layers)

    @property
    def decoder_layers(self) -> list[Layer]:
        return [layer for layer in self.layers if layer.kind == "decoder"]

    def kv_bytes(self, context: int, batch: int) -> int:
        return sum(layer.kv_bytes(context, batch) for layer in self.layers)


def _kv_windows(config, n_layers: int) -> list[int | None]:
    """Each decoder layer's sliding window, or None. `layer_types` says which layers slide (Qwen2 with
    use_sliding_window=False: none); without it a set `sliding_window` makes every layer slide (Mistral v0.1), as
    transformers' cache_utils.get_layer_types_and_kwargs decides for DynamicCache."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * n_layers
    return [window if kind == "sliding_attention" else None for kind in types]


def _unit_kind(module: nn.Module, model: nn.Module) -> str:
    if module is model.get_input_embeddings():
        return "embedding"
    if module is model.get_output_embeddings():
        return "head"
    if type(module).__name__ in (model._no_split_modules or ()):
        return "decoder"
    return "norm" if any(True for _ in module.parameters()) else "buffers"


def decoder_shape(family: str, layers: int, hidden: int, heads: int, vocab: int, intermediate: int,
                  dtype: str | WeightFormat = "bf16", seq_len: int = 1024) -> ModelShape:
    """The shape of a decoder given by its sizes, as in its Hugging Face config (`helpers.models.hf_config`: "gpt2"
    with learned positions and its embedding tied to the head, "llama", ...), in weight format `dtype`."""
    from helpers.models.hf import hf_config

    config = hf_config(family, layers, hidden, heads, vocab, seq_len, intermediate, tie_embeddings=family == "gpt2")
    return model_shape(config, dtype)


def reprice(shape: ModelShape, dtype: str | WeightFormat) -> ModelShape:
    """The same model in another weight format."""
    return _shape(shape.name, shape.config.to_json_string(use_diff=False), weight_format(dtype))


def model_shape(model="llama-2-13b", dtype: str | WeightFormat = "fp16") -> ModelShape:
    """Every placement unit of `model` with its exact parameter count and bytes in the weight format `dtype`."""
    name, config = load_config(model)
    return _shape(name, config.to_json_string(use_diff=False), weight_format(dtype))


@lru_cache(maxsize=32)
def _shape(name: str, config_json: str, fmt: WeightFormat) -> ModelShape:
    model = _meta_model_from_json(config_json)
    config = model.config
    head = model.get_output_embeddings()
    quantizable = {id(m) for m in model.modules() if isinstance(m, nn.Linear) and m is not head}
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    windows = iter(_kv_windows(config, config.num_hidden_layers))
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    seen: set[int] = set()
    layers = []
    for unit_name, module in placement_units(model):
        kind = _unit_kind(module, model)
        params, weight_bytes = 0, 0
        for owner in module.modules():
            for pname, p in owner.named_parameters(recurse=False):
                if id(p) in seen:  # a tied weight is stored once, on the module listed first (the embedding)
                    continue
                seen.add(id(p))
                params += p.numel()
                weight_bytes += fmt.tensor_bytes(p.shape, id(owner) in quantizable and pname == "weight")
        weight_bytes += sum(b.numel() * b.element_size() for b in module.buffers())
        streamed = weight_bytes
        if kind == "head" and tied:
            streamed = fmt.tensor_bytes(head.weight.shape, quantize=False)  # reads the embedding's matrix
        row = 0
        if kind == "embedding":
            streamed, row = 0, weight_bytes // module.weight.shape[0]
        kv = 2 * kv_heads * head_dim * fmt.activation_bytes if kind == "decoder" else 0
        layers.append(Layer(unit_name, kind, params, weight_bytes, streamed, row, kv,
                            next(windows) if kind == "decoder" else None))
    return ModelShape(name, fmt, tuple(layers), tied, config.hidden_size,
                      getattr(config, "intermediate_size", None) or 4 * config.hidden_size,
                      config.num_attention_heads, kv_heads, head_dim, config.vocab_size, config)


def span(names: Sequence[str]) -> str:
    """Module names with runs of numbered siblings folded: 'model.embed_tokens, model.layers.0-19, model.norm'."""
    parts: list[list] = []  # [prefix, first index, last index] or [name, None, None]
    for name in names:
        prefix, _, index = name.rpartition(".")
        if index.isdigit() and parts and parts[-1][0] == prefix and parts[-1][2] == int(index) - 1:
            parts[-1][2] = int(index)
        elif index.isdigit():
            parts.append([prefix, int(index), int(index)])
        else:
            parts.append([name, None, None])
    return ", ".join(p if a is None else f"{p}.{a}" if a == b else f"{p}.{a}-{b}" for p, a, b in parts) or "-"
