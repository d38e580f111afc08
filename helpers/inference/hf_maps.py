"""Which code computes `from_pretrained(device_map="auto")` in transformers 5, and how it differs from accelerate's.

transformers 5 no longer calls accelerate to balance a model: `PreTrainedModel.from_pretrained` calls
`transformers.integrations.accelerate._get_device_map`, which uses transformers' own copies of
`get_balanced_memory` and `infer_auto_device_map` (accelerate still provides `get_max_memory`, `dispatch_model` and
the hooks). accelerate's functions of the same names are what `accelerate.infer_auto_device_map` and
`load_checkpoint_and_dispatch(device_map="auto")` run, and what `helpers.inference.compare` reproduces.

The two balancing functions differ in one line, the margin added to each GPU's even share of the weights (all GPUs
but the last; the last keeps its whole max_memory):
- accelerate: 1.25 x max(the first no-split block found (a decoder layer), the mean size of the leaf modules);
- transformers 5: 1.25 x max(the largest no-split block, the largest leaf module).
A leaf module here is the embedding or the head; with a large vocabulary (Llama 3: 128256 tokens x 4096) it is bigger
than a decoder layer, so transformers gives GPU 0 a larger budget, and its greedy pass puts more layers there.

Everything runs on the meta device; nothing is loaded and no GPU is needed.
"""
from __future__ import annotations

import inspect
from typing import Sequence

import torch

from helpers.dtypes import DTYPES
from helpers.inference.compare import CASES, DEVICE_MAP_STRATEGIES, Case, accelerate_device_map, quiet_loggers
from helpers.sizing.gpus import Gpu, check_gpus
from helpers.sizing.shape import ModelShape, model_shape
from helpers.inference.plan import evaluate

PUBLIC = {"balanced": "auto", "balanced_low_0": "balanced_low_0", "sequential": "sequential"}


_DEVICE_WARNINGS = ("accelerate.utils.modeling", "transformers.integrations.accelerate")  # quiet on CPU


def _device_of(name: str, device_map: dict):
    """The device a map gives module `name`: its own entry or its closest ancestor's."""
    while name not in device_map:
        if "." not in name:
            return device_map.get("", "?")
        name = name.rsplit(".", 1)[0]
    return device_map[name]


def which_code_runs() -> dict[str, str]:
    """Where the functions `from_pretrained(device_map="auto")` calls are defined, read from the installed
    transformers itself (not from its documentation)."""
    import transformers.modeling_utils as mu

    get_map = mu._get_device_map
    where = get_map.__globals__
    return {"from_pretrained calls": f"{get_map.__module__}.{get_map.__name__}",
            "get_balanced_memory": f"{where['get_balanced_memory'].__module__}.get_balanced_memory",
            "infer_auto_device_map": f"{where['infer_auto_device_map'].__module__}.infer_auto_device_map",
            "file": inspect.getsourcefile(get_map) or "?"}


def _meta_model(shape: ModelShape):
    from transformers import AutoModelForCausalLM

    fmt = shape.format
    if fmt.quantized:
        raise ValueError(f"{fmt.name} is a bitsandbytes format: transformers prices it through its quantizer, which "
                         "needs bitsandbytes; compare fp32, fp16 or bf16 weights here")
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape.config, dtype=DTYPES[fmt.name]).eval()


def transformers_device_map(shape: ModelShape, strategy: str, gpus: Sequence[Gpu] | str | None = None) -> dict:
    """The map `from_pretrained(device_map=strategy, max_memory=...)` computes in transformers 5 ("auto" and
    "balanced" are one path), max_memory being each GPU's usable bytes, as in `compare`."""
    from transformers.integrations.accelerate import _get_device_map

    key = "balanced" if strategy == "auto" else strategy
    if key not in DEVICE_MAP_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose auto, balanced, balanced_low_0 or sequential")
    gpus = check_gpus(gpus)
    model = _meta_model(shape)
    with quiet_loggers(*_DEVICE_WARNINGS):
        return dict(_get_device_map(model, key, {j: g.usable_bytes for j, g in enumerate(gpus)}, None))


def balanced_budgets(shape: ModelShape, gpus: Sequence[Gpu] | str | None = None,
                     low_zero: bool = False) -> dict[str, dict]:
    """The max_memory each library's `get_balanced_memory` hands to its greedy pass, per GPU."""
    from accelerate.utils import get_balanced_memory as accelerate_balanced
    from transformers.integrations.accelerate import get_balanced_memory as transformers_balanced

    from helpers.inference.compare import accelerate_dtypes
    from helpers.sizing.shape import meta_model

    gpus = check_gpus(gpus)
    usable = {j: g.usable_bytes for j, g in enumerate(gpus)}
    model = _meta_model(shape)
    with quiet_loggers(*_DEVICE_WARNINGS):
        ours = transformers_balanced(model, dict(usable), model._no_split_modules, low_zero=low_zero)
        fp32 = meta_model(shape.config)
        theirs = accelerate_balanced(fp32, dict(usable), sorted(fp32._no_split_modules or ()),
                                     special_dtypes=accelerate_dtypes(shape), low_zero=low_zero)
    return {"transformers": {k: v for k, v in ours.items() if isinstance(k, int)},
            "accelerate": {k: v for k, v in theirs.items() if isinstance(k, int)}}


def decoder_layers_per_device(shape: ModelShape, device_map: dict) -> dict:
    """How many decoder layers a map puts on each device (and on "cpu" / "disk")."""
    counts: dict = {}
    for layer in shape.decoder_layers:
        device = _device_of(layer.name, device_map)
        counts[device] = counts.get(device, 0) + 1
    return counts


def _split_text(counts: dict, n_gpus: int) -> str:
    parts = [str(counts.get(j, 0)) for j in range(n_gpus)]
    off = {k: v for k, v in counts.items() if isinstance(k, str)}
    return " | ".join(parts) + "".join(f" + {v} on {k}" for k, v in off.items())


def strategy_rows(cases: Sequence[Case] = CASES, gpus: Sequence[Gpu] | str | None = None, batch: int = 1,
                  strategies: Sequence[str] = DEVICE_MAP_STRATEGIES, logits: str = "last") -> list[dict]:
    """Per case and strategy: decoder layers per GPU in transformers 5's map (what from_pretrained loads) and in
    accelerate's; whether transformers' map still fits once the KV cache, workspace and reserve are counted; its
    slowest stage's bandwidth-bound milliseconds per token (accounted as `compare` does). Quantised cases are
    skipped (see `_meta_model`)."""
    gpus = check_gpus(gpus)
    rows = []
    for case in cases:
        shape = model_shape(case.model, case.dtype)
        if shape.format.quantized:
            continue
        for strategy in strategies:
            mine = transformers_device_map(shape, strategy, gpus)
            theirs = accelerate_device_map(shape, strategy, gpus)
            placement = evaluate(shape, mine, gpus, case.context, batch, logits, method=f"transformers {strategy}")
            rows.append({"model": case.model, "dtype": case.dtype, "device_map": PUBLIC[strategy],
                         "transformers 5": _split_text(decoder_layers_per_device(shape, mine), len(gpus)),
                         "accelerate": _split_text(decoder_layers_per_device(shape, theirs), len(gpus)),
                         "same map": mine == theirs, "fits with KV": "yes" if placement.fits else "NO",
                         "ms/token": placement.slowest.ms_per_token})
    return rows
