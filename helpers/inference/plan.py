"""Plan big-model inference on a few GPUs: what each device holds, and the split that decodes fastest.

For a Hugging Face decoder (a bundled config from data/inference.json, or any local config.json) the planner counts
every parameter exactly on the meta device, prices each tensor in the chosen weight format, and adds what
`from_pretrained(device_map="auto")` leaves out (accelerate budgets parameter bytes only): the KV cache of each decoder
layer, the prefill workspace on every device and the logits on the device that holds the head, and a runtime reserve
per GPU (CUDA context + allocator margin, sourced in data/inference.json). It returns the contiguous split that fits
every device and minimises the slowest stage, found by `helpers.partition.optimal_split`, as a `device_map` that
`from_pretrained(device_map=...)` and accelerate's `dispatch_model` accept.

Time proxy: decoding one token is memory-bandwidth bound (every weight and the whole KV cache are read once per step,
while the arithmetic per byte is tiny), so a stage costs the bytes it reads per decoded token, and its time is those
bytes / its memory bandwidth. The split minimises the bytes; with unequal cards this assumes equal bandwidth.

When nothing fits, `DoesNotFit` says by how many bytes and computes what would fit: the longest context, the largest
batch, the same model in 4 bits, and how many decoder layers would have to wait in CPU RAM.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal, Sequence

from helpers.dtypes import BYTES
from helpers.facts import load_data
from helpers.sizing.activations import activation_workspace_bytes
from helpers.sizing.gpus import Gpu, GpuShare, check_gpus, check_workload, describe_gpus, largest_fitting
from helpers.sizing.shape import Layer, ModelShape, WeightFormat, model_shape, reprice, span
from helpers.units import fmt_bytes
from helpers.partition import NoFeasibleSplit, Split, optimal_split

LogitsMode = Literal["prompt", "last"]
LOGITS_MODES = ("prompt", "last")
LOGITS_PRICED = {"last": "the last position (as generate() keeps them)",
                 "prompt": "the whole prompt (a forward with a loss over it)"}
FOUR_BIT = "nf4"


def _check_workload(context: int, batch: int, logits: str) -> None:
    check_workload(context, batch)
    if logits not in LOGITS_MODES:
        raise ValueError(f"logits must be 'prompt' (a forward over the whole prompt) or 'last' (generate(): the last "
                         f"position only), got {logits!r}")


# --- workspace ----------------------------------------------------------------------------------------------------

def logits_workspace_bytes(shape: ModelShape, context: int, batch: int, logits: LogitsMode = "last") -> int:
    """Logits on the device that holds the head, in the activation dtype plus their fp32 copy.

    "last" (the default, how the course generates): generate() in transformers 5 asks for the last position only
    (logits_to_keep=1) and copies it to fp32 for sampling. "prompt": a forward over a whole `context`-token prompt
    with a loss (evaluation, training), or an older transformers, materialises batch x context x vocab logits.
    """
    positions = context if logits == "prompt" else 1
    return batch * positions * shape.vocab * (shape.format.activation_bytes + BYTES["fp32"])  # and their fp32 copy


# --- placements: what a device_map puts on each GPU -----------------------------------------------------------------

@dataclass(frozen=True)
class DeviceUse(GpuShare):
    """What one GPU holds under a device_map, by kind, and the bytes it reads per decoded token."""

    layers: tuple[str, ...]
    weights_bytes: int
    kv_cache_bytes: int
    workspace_bytes: int
    read_bytes: int

    @property
    def used_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes + self.workspace_bytes

    @property
    def kv_room_bytes(self) -> int:
        """Room left for the KV cache once weights, workspace and reserve are placed."""
        return self.free_bytes + self.kv_cache_bytes

    @property
    def ms_per_token(self) -> float | None:
        """Bandwidth-bound time of this stage per decode step (GB/s = 10**9 bytes per second)."""
        return None if not self.gpu.bandwidth_gb_s else self.read_bytes / (self.gpu.bandwidth_gb_s * 1e9) * 1e3

    def as_dict(self) -> dict:
        return {"name": self.label, "gpu": self.gpu.name, "capacity_bytes": self.gpu.capacity_bytes,
                "weights_bytes": self.weights_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "workspace_bytes": self.workspace_bytes, "reserve_bytes": self.reserve_bytes,
                "free_bytes": self.free_bytes, "read_bytes_per_token": self.read_bytes,
                "ms_per_token": self.ms_per_token, "layers": span(self.layers)}


@dataclass(frozen=True)
class Placement:
    """A device_map for one model and workload, accounted per GPU. `method`: who made the map."""

    shape: ModelShape
    context: int
    batch: int
    logits: LogitsMode
    method: str
    device_map: dict
    devices: tuple[DeviceUse, ...]
    offloaded_bytes: int = 0  # weights the map sends to "cpu" or "disk"

    @property
    def fits(self) -> bool:
        return self.offloaded_bytes == 0 and all(d.free_bytes >= 0 for d in self.devices)

    @property
    def slowest(self) -> DeviceUse:
        return max(self.devices, key=lambda d: d.read_bytes)

    def as_dict(self) -> dict:
        fmt = self.shape.format
        return {"model": self.shape.name, "dtype": fmt.name, "bytes_per_weight": round(fmt.bytes_per_weight(), 4),
                "params": self.shape.params, "context": self.context, "batch": self.batch, "logits": self.logits,
                "method": self.method, "fits": self.fits, "offloaded_bytes": self.offloaded_bytes,
                "slowest_read_bytes_per_token": self.slowest.read_bytes,
                "slowest_ms_per_token": self.slowest.ms_per_token,
                "devices": [d.as_dict() for d in self.devices], "device_map": dict(self.device_map)}

    def rows(self) -> list[dict]:
        """One row per GPU, sizes as text: what `describe` and the bench-style tables print."""
        return [{"device": d.label, "weights": fmt_bytes(d.weights_bytes), "KV cache": fmt_bytes(d.kv_cache_bytes),
                 "workspace": fmt_bytes(d.workspace_bytes), "reserve": fmt_bytes(d.reserve_bytes),
                 "free": fmt_bytes(d.free_bytes), "capacity": fmt_bytes(d.gpu.capacity_bytes),
                 "read/token": fmt_bytes(d.read_bytes),
                 "ms/token": "-" if d.ms_per_token is None else f"{d.ms_per_token:.1f}",
                 "layers": span(d.layers)} for d in self.devices]

    def describe(self, with_map: bool = True) -> str:
        """Header lines, the per-GPU table, and (with_map) the device_map as JSON."""
        from helpers.report import table

        s, fmt = self.shape, self.shape.format
        kv_token = sum(layer.kv_bytes_per_token for layer in s.decoder_layers)
        windows = sorted({layer.window for layer in s.decoder_layers if layer.window})
        lines = [f"{s.name}: {s.params:,} parameters ({fmt.describe()}); context {self.context} tokens x batch "
                 f"{self.batch}; logits for {LOGITS_PRICED[self.logits]}",
                 f"KV cache {fmt_bytes(kv_token)} per token per sequence ({len(s.decoder_layers)} layers x 2 x "
                 f"{s.kv_heads} KV heads x {s.head_dim} x {fmt.activation_bytes} B"
                 + (f"; sliding window: at most {', '.join(map(str, windows))} tokens per layer" if windows else "")
                 + f"); {'fits' if self.fits else 'does NOT fit'} on {describe_gpus([d.gpu for d in self.devices])} "
                 f"({self.method})",
                 table(self.rows())]
        if self.offloaded_bytes:
            lines.append(f"offloaded to CPU RAM or disk: {fmt_bytes(self.offloaded_bytes)} of weights")
        if with_map:
            lines.append("device_map = " + json.dumps(self.device_map))
        return "\n".join(lines)


def _device_of(name: str, device_map: dict) -> int | str:
    """The device a map gives module `name`: its own key or its closest ancestor's ("" is the root)."""
    if name in device_map:
        return device_map[name]
    for key in sorted(device_map, key=len, reverse=True):
        if key == "" or name.startswith(key + "."):
            return device_map[key]
    deeper = [key for key in device_map if key.startswith(name + ".")]
    if deeper:
        raise ValueError(f"the device_map splits {name} across {sorted({device_map[k] for k in deeper}, key=str)}; "
                         "the planner places whole modules")
    raise ValueError(f"the device_map gives no device for {name}")


def evaluate(shape: ModelShape, device_map: dict, gpus: Sequence[Gpu], context: int, batch: int = 1,
             logits: LogitsMode = "last", method: str = "given") -> Placement:
    """Account a device_map (ours or accelerate's) per GPU: weights, KV cache, workspace, reserve, free.

    A GPU holding any module reserves the activation workspace; the head's GPU adds the logits. Modules mapped to
    "cpu" or "disk" are offloaded: accelerate runs them on its main device (the first GPU in the map), so their KV
    cache and reads land there, and that GPU keeps room to stream the largest of them in.
    """
    gpus = check_gpus(gpus)
    where = {layer.name: _device_of(layer.name, device_map) for layer in shape.layers}
    bad = sorted({str(d) for d in where.values() if d not in ("cpu", "disk") and d not in range(len(gpus))})
    if bad:
        raise ValueError(f"the device_map uses devices {bad}, but there are GPUs 0..{len(gpus) - 1} "
                         "(and 'cpu' / 'disk')")
    offloaded = [layer for layer in shape.layers if where[layer.name] in ("cpu", "disk")]
    main = next((d for d in where.values() if d not in ("cpu", "disk")), 0)
    act = activation_workspace_bytes(shape, context, batch)
    logit_bytes = logits_workspace_bytes(shape, context, batch, logits)
    stream_in = max((layer.weight_bytes for layer in offloaded), default=0)
    devices = []
    for j, g in enumerate(gpus):
        mine = [layer for layer in shape.layers if where[layer.name] == j]
        runs_here = mine + (offloaded if j == main else [])
        holds_head = any(layer.kind == "head" for layer in runs_here)
        devices.append(DeviceUse(
            j, g, tuple(layer.name for layer in mine), sum(layer.weight_bytes for layer in mine),
            sum(layer.kv_bytes(context, batch) for layer in runs_here),
            (act if runs_here else 0) + (logit_bytes if holds_head else 0) + (stream_in if j == main else 0),
            sum(layer.read_bytes(context, batch) for layer in runs_here)))
    return Placement(shape, context, batch, logits, method, dict(device_map), tuple(devices),
                     sum(layer.weight_bytes for layer in offloaded))


# --- the planner --------------------------------------------------------------------------------------------------

def _groups(shape: ModelShape, skip: frozenset[str] = frozenset()) -> list[list[Layer]]:
    """Units the split moves as one, in forward order. The embedding carries the parameterless modules (LlamaModel
    computes the rotary embedding right after it) and, when the head shares its weight, the head too."""
    first = [layer for layer in shape.layers
             if layer.kind in ("embedding", "buffers") or (shape.tied and layer.kind == "head")]
    rest = [[layer] for layer in shape.layers if layer not in first and layer.name not in skip]
    return [first, *rest]


@dataclass(frozen=True)
class _Problem:
    """The partition problem for one workload: per group cost and memory, per device memory cap."""

    groups: list
    costs: list[int]
    memory: list[int]
    caps: list[int]

    def split(self, extra: int = 0) -> Split | None:
        """The optimal split with `extra` bytes added to every cap, or None when none fits."""
        caps = [c + extra for c in self.caps]
        if min(caps) <= 0:
            return None
        try:
            return optimal_split(self.costs, len(caps), self.memory, caps)
        except NoFeasibleSplit:
            return None


def _problem(shape: ModelShape, gpus: Sequence[Gpu], context: int, batch: int, logits: LogitsMode,
             offload: int = 0) -> _Problem:
    """Costs (bytes read per token), memory (weights + KV cache) and caps (usable memory less workspace) per stage.

    `offload` leaves the last that many decoder layers in CPU RAM, as accelerate's "cpu" entries do: their KV cache
    still lives on the first GPU, which runs them, and keeps room to stream the largest of them in.
    """
    decoders = shape.decoder_layers
    if not 0 <= offload < len(decoders):
        raise ValueError(f"can offload 0..{len(decoders) - 1} of {len(decoders)} decoder layers, not {offload}")
    offloaded = decoders[len(decoders) - offload:] if offload else []
    groups = _groups(shape, frozenset(layer.name for layer in offloaded))
    if len(groups) < len(gpus):
        raise ValueError(f"{shape.name} has {len(groups)} placement units, fewer than the {len(gpus)} GPUs: "
                         "plan for fewer GPUs")
    costs = [sum(layer.read_bytes(context, batch) for layer in g) for g in groups]
    memory = [sum(layer.weight_bytes + layer.kv_bytes(context, batch) for layer in g) for g in groups]
    if offloaded:
        memory[0] += sum(layer.kv_bytes(context, batch) for layer in offloaded) \
            + max(layer.weight_bytes for layer in offloaded)
        costs[0] += sum(layer.read_bytes(context, batch) for layer in offloaded)
    head_device = 0 if shape.tied else len(gpus) - 1
    act = activation_workspace_bytes(shape, context, batch)
    logit_bytes = logits_workspace_bytes(shape, context, batch, logits)
    caps = [g.usable_bytes - act - (logit_bytes if j == head_device else 0) for j, g in enumerate(gpus)]
    return _Problem(groups, costs, memory, caps)


def _device_map(shape: ModelShape, problem: _Problem, split: Split) -> dict[str, int]:
    device = {}
    for j, (a, b) in enumerate(split.ranges(len(problem.groups))):
        for group in problem.groups[a:b]:
            device.update({layer.name: j for layer in group})
    return {layer.name: device[layer.name] for layer in shape.layers}  # forward order


def _fits(shape: ModelShape, gpus: Sequence[Gpu], context: int, batch: int, logits: LogitsMode,
          offload: int = 0) -> bool:
    return _problem(shape, gpus, context, batch, logits, offload).split() is not None


def plan(model="llama-2-13b", dtype: str | WeightFormat = "fp16", context: int = 4096, batch: int = 1,
         gpus: Sequence[Gpu] | str | None = None, logits: LogitsMode = "last") -> Placement:
    """The contiguous split of `model` over `gpus` (default: two RTX 3090s) that fits every GPU with the KV cache for
    `batch` sequences of `context` tokens, the workspace and the runtime reserve, and reads the fewest bytes per
    decoded token on its slowest GPU. Raises DoesNotFit (with what would fit) when no split fits."""
    _check_workload(context, batch, logits)
    return plan_shape(model_shape(model, dtype), check_gpus(gpus), context, batch, logits)


def plan_shape(shape: ModelShape, gpus: Sequence[Gpu], context: int, batch: int = 1,
               logits: LogitsMode = "last") -> Placement:
    """`plan` for an already priced model (what the alternatives, the comparison and the widget reuse)."""
    _check_workload(context, batch, logits)
    gpus = check_gpus(gpus)
    problem = _problem(shape, gpus, context, batch, logits)
    split = problem.split()
    if split is None:
        raise DoesNotFit.explain(shape, gpus, context, batch, logits, problem)
    return evaluate(shape, _device_map(shape, problem, split), gpus, context, batch, logits, method="planner")


# --- when nothing fits --------------------------------------------------------------------------------------------

def _shortfall(problem: _Problem) -> int:
    """The fewest extra bytes per GPU that would make some split fit: one past the most that still leave none fitting
    (with all the weights and KV cache added to every cap, any split fits)."""
    most = sum(problem.memory) + max(0, -min(problem.caps))
    return largest_fitting(lambda extra: problem.split(extra) is None, most) + 1


@dataclass(frozen=True)
class Alternatives:
    """What would fit instead, each computed by the planner."""

    context: int  # longest context that fits at this batch; 0: none
    batch: int  # largest batch that fits at this context; 0: none
    four_bit: Placement | None  # the same workload in 4 bits (nf4), when it fits and the model is not 4-bit already
    offload_layers: int  # fewest decoder layers to keep in CPU RAM so the rest fits; 0: offloading does not help
    offload_bytes: int  # their weights, streamed from CPU RAM over PCIe on every decode step
    offload_ms_per_token: float | None  # that streaming alone, at data/hardware.json's pinned host-to-device rate

    def as_dict(self) -> dict:
        return {"context": self.context, "batch": self.batch,
                "four_bit_fits": self.four_bit is not None,
                "four_bit_free_bytes": None if self.four_bit is None else [d.free_bytes for d in self.four_bit.devices],
                "offload_layers": self.offload_layers, "offload_bytes": self.offload_bytes,
                "offload_ms_per_token": self.offload_ms_per_token}


def _pcie_gb_s() -> float:
    return load_data("hardware")["links"]["pcie4_pinned_host_device"]["gb_s_per_direction"]


def _alternatives(shape: ModelShape, gpus: Sequence[Gpu], context: int, batch: int,
                  logits: LogitsMode) -> Alternatives:
    longest = largest_fitting(lambda c: _fits(shape, gpus, c, batch, logits), context - 1)
    widest = largest_fitting(lambda b: _fits(shape, gpus, context, b, logits), batch - 1)
    four_bit = None
    if shape.format.weight_bits > 4:
        small = reprice(shape, FOUR_BIT)
        try:
            four_bit = plan_shape(small, gpus, context, batch, logits)
        except DoesNotFit:
            pass
    decoders = shape.decoder_layers
    offload = next((m for m in range(1, len(decoders)) if _fits(shape, gpus, context, batch, logits, m)), 0)
    offload_bytes = sum(layer.weight_bytes for layer in decoders[len(decoders) - offload:]) if offload else 0
    return Alternatives(longest, widest, four_bit, offload, offload_bytes,
                        offload_bytes / (_pcie_gb_s() * 1e9) * 1e3 if offload else None)


class DoesNotFit(ValueError):
    """No contiguous split fits: the message says by how many bytes and what would fit instead."""

    def __init__(self, message: str, short_bytes: int, alternatives: Alternatives, closest: Placement):
        super().__init__(message)
        self.short_bytes = short_bytes  # the fewest extra bytes each GPU would need
        self.alternatives = alternatives
        self.closest = closest  # the split that overflows least, accounted (free_bytes < 0 where it overflows)

    def as_dict(self) -> dict:
        return {"fits": False, "error": str(self), "short_bytes_per_gpu": self.short_bytes,
                "alternatives": self.alternatives.as_dict(),
                "closest_devices": [d.as_dict() for d in self.closest.devices]}

    @classmethod
    def explain(cls, shape: ModelShape, gpus: Sequence[Gpu], context: int, batch: int, logits: LogitsMode,
                problem: _Problem) -> "DoesNotFit":
        short = _shortfall(problem)
        closest = evaluate(shape, _device_map(shape, problem, problem.split(short)), gpus, context, batch, logits,
                           method="closest split (does not fit)")
        alt = _alternatives(shape, gpus, context, batch, logits)
        workspace = sum(d.workspace_bytes for d in closest.devices)
        usable = sum(g.usable_bytes for g in gpus)
        names = describe_gpus(gpus)
        lines = [
            f"{shape.name} in {shape.format.name} with {context} tokens x {batch} sequence(s) does not fit on "
            f"{names}: the best split still needs {fmt_bytes(short)} more on each GPU.",
            f"It needs weights {fmt_bytes(shape.weight_bytes)} + KV cache {fmt_bytes(shape.kv_bytes(context, batch))} "
            f"+ workspace {fmt_bytes(workspace)}; the GPUs have {fmt_bytes(usable)} after the runtime reserve.",
            "What would fit:",
            "  - shorter context: " + (f"at most {alt.context} tokens" if alt.context else
                                       "none (not even 1 token: the weights and workspace alone overflow)"),
            "  - smaller batch: " + ("already 1" if batch == 1 else f"at most {alt.batch} sequences" if alt.batch
                                     else "none (not even 1 sequence)"),
            "  - 4-bit weights (nf4): " + ("already 4-bit" if shape.format.weight_bits <= 4 else
                                           f"fits, {fmt_bytes(min(d.free_bytes for d in alt.four_bit.devices))} "
                                           "left on the fullest GPU" if alt.four_bit else "does not fit either"),
            "  - CPU offload: " + (f"keep the last {alt.offload_layers} of {len(shape.decoder_layers)} decoder layers "
                                   f"({fmt_bytes(alt.offload_bytes)}) in CPU RAM; streaming them to the GPU costs "
                                   f"about {alt.offload_ms_per_token:.0f} ms per token more"
                                   if alt.offload_layers else "does not help (the rest still overflows)"),
        ]
        return cls("\n".join(lines), short, alt, closest)
