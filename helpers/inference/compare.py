"""Our plan beside Hugging Face's own device maps, which accelerate computes on the meta device.

What the `device_map` strings of `from_pretrained` do (transformers' integrations/accelerate.py `_get_device_map`,
accelerate's utils/modeling.py `get_balanced_memory` and `infer_auto_device_map`):

- "auto" and "balanced" are one code path. `get_balanced_memory` gives every GPU but the last a budget of
  (parameter + buffer bytes) / number of GPUs plus a buffer (accelerate's and transformers 5's own copy differ in it:
  `helpers.inference.hf_maps`); the last GPU keeps its whole max_memory "just in case the buffer is not enough".
- "balanced_low_0": the same, but GPU 0 only gets what the other GPUs cannot hold (room for generate's work there).
- "sequential": no balancing: fill GPU 0 up to max_memory, then GPU 1, and so on.

Then `infer_auto_device_map` walks the modules in order and puts each on the current device while it fits, never
going back; a no-split module (a decoder layer) that does not fit moves on to the next device, then "cpu", then
"disk". GPU 0 (the "main device") always keeps room for the largest layer, to stream offloaded layers in. Every budget
counts parameter and buffer bytes only: no KV cache, no activations or logits, no CUDA context. For bitsandbytes
models transformers prices a quantised weight at 0.5 (4-bit) or 1 (int8) byte, without the scaling constants, and
hands accelerate 90% of max_memory (quantizer_bnb_4bit.py / quantizer_bnb_8bit.py `adjust_max_memory`).

Here accelerate computes its maps from the same usable memory our planner starts from (capacity less the runtime
reserve), and `evaluate` then counts what accelerate leaves out: does the map still fit once the KV cache, workspace
and reserve are on the cards, how much room is left for the KV cache, and how heavy is the slowest stage. Loading onto
GPU indices needs GPUs, so on a CPU-only machine only the maps are computed.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from helpers.inference.plan import DoesNotFit, LogitsMode, Placement, evaluate, plan_shape
from helpers.sizing.gpus import Gpu, check_gpus
from helpers.sizing.shape import ModelShape, meta_model, model_shape
from helpers.units import fmt_bytes

DEVICE_MAP_STRATEGIES = ("balanced", "balanced_low_0", "sequential")  # accelerate's device_map strategies
BNB_MAX_MEMORY_FRACTION = 0.90  # transformers quantizers/quantizer_bnb_*bit.py adjust_max_memory


@dataclass(frozen=True)
class Case:
    """One row group of the comparison: a bundled model, a weight format and a context length."""

    model: str
    dtype: str
    context: int


# The six shapes of issue 10. Contexts: max_position_embeddings for Llama 2 and 3; 8192 for Mistral (two of its
# 4096-token sliding windows) and for Qwen2.5 (whose 131072 would need a KV cache as large as a card). The 70B fits
# two RTX 3090s only in 4 bits (`plan` says so when asked for fp16).
CASES = (Case("llama-2-7b", "fp16", 4096), Case("llama-2-13b", "fp16", 4096), Case("llama-3-8b", "bf16", 8192),
         Case("mistral-7b", "bf16", 8192), Case("qwen2.5-14b", "bf16", 8192), Case("llama-2-70b", "nf4", 4096))


@contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """Silence the named loggers' warnings for the block (accelerate's and transformers' "Device 0 is not available":
    on a CPU-only machine only maps are computed)."""
    logs = [logging.getLogger(name) for name in names]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def accelerate_dtypes(shape: ModelShape) -> dict[str, object]:
    """Per parameter, the dtype accelerate should price it at: the weight format's dtype, or for a bitsandbytes format
    what transformers' quantizer reports (CustomDtype.INT4 = 0.5 byte, int8 = 1 byte) for the quantised weights and
    the activation dtype for the rest."""
    from accelerate.utils import CustomDtype

    model = meta_model(shape.config)
    fmt = shape.format
    plain = {2: torch.float16 if fmt.name != "bf16" else torch.bfloat16, 4: torch.float32}[fmt.activation_bytes]
    if not fmt.quantized:
        return {name: plain for name, _ in model.named_parameters()}
    low = CustomDtype.INT4 if fmt.weight_bits == 4 else torch.int8
    head = model.get_output_embeddings()
    quantised = {f"{mname}.weight" for mname, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and m is not head}
    return {name: low if name in quantised else plain for name, _ in model.named_parameters()}


def accelerate_device_map(shape: ModelShape, strategy: str, gpus: Sequence[Gpu] | str | None = None) -> dict:
    """accelerate's own map for `strategy` ("balanced" = "auto", "balanced_low_0", "sequential"), as
    `from_pretrained(device_map=strategy, max_memory=...)` computes it, max_memory being each GPU's usable bytes."""
    from accelerate.utils import get_balanced_memory, infer_auto_device_map

    if strategy not in DEVICE_MAP_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}: choose one of {', '.join(DEVICE_MAP_STRATEGIES)} "
                         "('auto' is 'balanced')")
    gpus = check_gpus(gpus)
    model = meta_model(shape.config)
    no_split = sorted(model._no_split_modules or ())
    dtypes = accelerate_dtypes(shape)
    max_memory: dict = {j: g.usable_bytes for j, g in enumerate(gpus)}
    with quiet_loggers("accelerate.utils.modeling"):
        if strategy != "sequential":
            max_memory = get_balanced_memory(model, max_memory, no_split, special_dtypes=dtypes,
                                             low_zero=strategy == "balanced_low_0")
        if shape.format.quantized:
            max_memory = {k: int(v * BNB_MAX_MEMORY_FRACTION) for k, v in max_memory.items()}
        return dict(infer_auto_device_map(model, max_memory, no_split, special_dtypes=dtypes))


def _row(case: Case, placement: Placement) -> dict:
    devices = placement.devices
    return {"model": case.model, "dtype": case.dtype, "context": case.context, "map": placement.method,
            "fits": placement.fits,
            "weights": [d.weights_bytes for d in devices], "kv_cache": [d.kv_cache_bytes for d in devices],
            "workspace": [d.workspace_bytes for d in devices], "free": [d.free_bytes for d in devices],
            "kv_room": [d.kv_room_bytes for d in devices], "offloaded": placement.offloaded_bytes,
            "slowest_read": placement.slowest.read_bytes, "slowest_ms": placement.slowest.ms_per_token,
            "placement": placement}


def compare_with_accelerate(cases: Sequence[Case] = CASES, gpus: Sequence[Gpu] | str | None = None, batch: int = 1,
                            logits: LogitsMode = "last",
                            strategies: Sequence[str] = DEVICE_MAP_STRATEGIES) -> list[dict]:
    """For each case: our plan, then accelerate's maps, every one accounted the same way (KV cache, workspace and
    reserve included). Per row: fits, bytes per GPU by kind, room left for the KV cache, bytes offloaded, and the
    slowest stage's bytes and bandwidth-bound milliseconds per decoded token. A case our planner cannot fit gets a
    "does not fit" row instead of a plan."""
    gpus = check_gpus(gpus)
    rows = []
    for case in cases:
        shape = model_shape(case.model, case.dtype)
        try:
            rows.append(_row(case, plan_shape(shape, gpus, case.context, batch, logits)))
        except DoesNotFit as err:
            rows.append(_row(case, err.closest))
        for strategy in strategies:
            placement = evaluate(shape, accelerate_device_map(shape, strategy, gpus), gpus, case.context, batch,
                                 logits, method=f"accelerate {strategy}")
            rows.append(_row(case, placement))
    return rows


def comparison_table(rows: Sequence[dict]) -> str:
    """The comparison as one text table; per-GPU columns read 'GPU 0 | GPU 1'."""
    from helpers.report import table

    def per_gpu(values: Sequence[int]) -> str:
        return " | ".join(fmt_bytes(v) for v in values)

    cells = [{"model": r["model"], "dtype": r["dtype"], "context": r["context"], "map": r["map"],
              "fits": "yes" if r["fits"] else "NO", "weights": per_gpu(r["weights"]),
              "KV cache": per_gpu(r["kv_cache"]), "workspace": per_gpu(r["workspace"]),
              "room for KV": per_gpu(r["kv_room"]), "free": per_gpu(r["free"]),
              "offloaded": fmt_bytes(r["offloaded"]) if r["offloaded"] else "-",
              "slowest read/token": fmt_bytes(r["slowest_read"]),
              "ms/token": "-" if r["slowest_ms"] is None else f"{r['slowest_ms']:.1f}"} for r in rows]
    return table(cells)
