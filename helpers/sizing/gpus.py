"""GPUs, one description for the planners and the simulator: the memory CUDA reports, the one runtime reserve (a CUDA
context per process plus an allocator margin per device, data/inference.json with sources), the memory bandwidth of
the specification and the rates a card sustains (data/hardware.json's `sustained`: what the simulator's roofline
needs); GPUs named the way a user says them ('2 x RTX 3090', 'RTX 5090=32GiB'); and the search for the largest
workload that fits."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from helpers.facts import load_data
from helpers.sizing.shape import inference_data
from helpers.units import MiB, fmt_bytes, is_size, parse_size

MATMUL_DTYPES = ("fp32", "fp16", "bf16")  # the dtypes a matmul rate is given for


@dataclass(frozen=True)
class Gpu:
    """One GPU: the memory CUDA reports, the runtime reserve, the memory bandwidth of its specification (GB/s, what
    the inference planner's decode estimate reads) and, where data/hardware.json has them, the rates it sustains (the
    simulator's roofline: the bandwidth element-wise kernels reach, a large matmul's FLOP/s per dtype, the share of
    that rate convolutions reach). A GPU given only by its size knows none of the rates."""

    name: str
    capacity_bytes: int
    reserve_bytes: int
    bandwidth_gb_s: float | None = None
    memory_bandwidth: float | None = None  # bytes/s an element-wise kernel sustains (measured, or an estimate)
    matmul_flops: Mapping[str, float] = field(default_factory=dict)  # FLOP/s of a large matmul, per dtype, measured
    conv_efficiency: float | None = None  # this card's own (fitted) share of the matmul rate convolutions reach
    capacity_source: str | None = None  # where `capacity_bytes` comes from (a measurement's source, a spec, the user)

    @property
    def usable_bytes(self) -> int:
        return self.capacity_bytes - self.reserve_bytes

    def flops(self, dtype: str) -> float:
        """The sustained matmul rate in `dtype` (FLOP/s)."""
        if dtype not in self.matmul_flops:
            raise ValueError(f"no sustained {dtype!r} matmul figure for the {self.name} in data/hardware.json; "
                             f"known: {', '.join(sorted(self.matmul_flops)) or 'none'}")
        return self.matmul_flops[dtype]


@dataclass(frozen=True)
class GpuShare:
    """One GPU's share of a plan (the inference planner's `DeviceUse`, the training planner's `GpuTraining`): what
    the plan puts there (`used_bytes`), the card's runtime reserve beside it, and what is left."""

    device: int
    gpu: Gpu

    @property
    def used_bytes(self) -> int:
        raise NotImplementedError

    @property
    def reserve_bytes(self) -> int:
        return self.gpu.reserve_bytes

    @property
    def free_bytes(self) -> int:
        """Capacity left after everything; negative when the device is over-full."""
        return self.gpu.capacity_bytes - self.used_bytes - self.reserve_bytes

    @property
    def label(self) -> str:
        """"cuda:1 RTX 3090" for a GPU; a device already named by the rig (a CPU virtual device) keeps its name."""
        named = self.gpu.name.startswith(("cpu", "cuda"))
        return self.gpu.name if named else f"cuda:{self.device} {self.gpu.name}"


def _sustained(entry: dict) -> dict:
    """The roofline's fields of a data/hardware.json `gpus` entry (none where it has no `sustained` figures)."""
    sustained = entry.get("sustained")
    if sustained is None:
        return {}
    matmul, conv = sustained["matmul_tflops"], sustained.get("conv_efficiency")
    return {"memory_bandwidth": sustained["memory_gb_s"]["value"] * 1e9,
            "matmul_flops": {d: rate * 1e12 for d, rate in matmul.items() if d in MATMUL_DTYPES},
            "conv_efficiency": conv["value"] if conv else None}


def runtime_reserve() -> dict[str, int]:
    """Bytes per process (the CUDA context, ollama's figure) and per device (an allocator margin, llama.cpp's
    --fit margin): data/inference.json's "runtime_reserve", where each figure's source is given."""
    reserve = inference_data()["runtime_reserve"]
    return {"context": reserve["cuda_context"]["mib"] * MiB, "margin": reserve["allocator_margin"]["mib"] * MiB}


def runtime_reserve_bytes(processes: int = 1) -> int:
    """Per GPU that `processes` use: a CUDA context each plus the allocator margin."""
    reserve = runtime_reserve()
    return processes * reserve["context"] + reserve["margin"]


_COUNT = re.compile(r"^\s*(\d+)\s*[x×*]\s*(.+)$", re.IGNORECASE)


def gpu(spec: str) -> Gpu:
    """A GPU from its name in data/hardware.json ('RTX 3090'), NAME=SIZE ('RTX 5090=32GiB') or a bare size ('24GiB').

    Capacity: the memory CUDA reports where data/inference.json has it (RTX 3090), else hardware.json's memory_gb in
    GB (10**9 bytes, the unit its key names).
    """
    spec = spec.strip()
    known = load_data("hardware")["gpus"]
    by_name = {name.lower(): name for name in known}
    name, _, size = spec.partition("=")
    name, size = name.strip(), size.strip()
    if not size and is_size(name):
        name, size = f"GPU ({name})", name
    canonical = by_name.get(name.lower())
    entry = known[canonical] if canonical else {}
    if size:
        capacity, source = parse_size(size), f"given: {size}"
    elif canonical:
        measured = inference_data()["gpu_memory"].get(canonical)
        capacity, source = (measured["cuda_total_mib"] * MiB, measured["source"]) if measured else \
            (int(known[canonical]["memory_gb"] * 10**9), f"data/hardware.json: {known[canonical]['memory_gb']} GB")
    else:
        raise ValueError(f"no memory size known for GPU {spec!r}: use one of {', '.join(known)} or give its memory "
                         f"as NAME=SIZE, e.g. '{name or 'my GPU'}=24GiB'")
    reserve = runtime_reserve_bytes()
    if capacity <= reserve:
        raise ValueError(f"{name or spec} has {fmt_bytes(capacity)}, no more than the runtime reserve of "
                         f"{fmt_bytes(reserve)} (CUDA context + allocator margin): nothing would be left for a model")
    return Gpu(canonical or name, capacity, reserve, entry.get("memory_bandwidth_gb_s"), **_sustained(entry),
               capacity_source=source)


def parse_gpus(text: str) -> list[Gpu]:
    """'2 x RTX 3090', 'RTX 3090, RTX 4090', '2x24GiB' -> GPUs in device order."""
    gpus = []
    for item in (part for part in text.split(",") if part.strip()):
        match = _COUNT.match(item)
        count, spec = (int(match.group(1)), match.group(2)) if match else (1, item)
        gpus += [gpu(spec)] * count
    if not gpus:
        raise ValueError(f"no GPUs in {text!r}: list them like '2 x RTX 3090' or 'RTX 3090, RTX 4090'")
    return gpus


def describe_gpus(gpus: Sequence[Gpu]) -> str:
    """'2 x RTX 3090' or 'RTX 3090 + RTX 4090'."""
    names = [g.name for g in gpus]
    return f"{len(names)} x {names[0]}" if len(set(names)) == 1 and len(names) > 1 else " + ".join(names)


def check_gpus(gpus: Sequence[Gpu] | str | None) -> list[Gpu]:
    """GPUs as given (a list, or text for `parse_gpus`); None: the course's target rig, two RTX 3090s."""
    if gpus is None:
        return parse_gpus("2 x RTX 3090")
    if isinstance(gpus, str):
        return parse_gpus(gpus)
    gpus = list(gpus)
    if not gpus:
        raise ValueError("no GPUs given: plan for at least one (the default is two RTX 3090s)")
    for g in gpus:
        if not g.usable_bytes > 0:
            raise ValueError(f"{g.name} has no memory left after its runtime reserve "
                             f"({fmt_bytes(g.capacity_bytes)} - {fmt_bytes(g.reserve_bytes)})")
    return gpus


def check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    """`value` normalised (stripped, lower case) when it is one of `choices`, else the reason why not."""
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def check_workload(context: int, batch: int) -> None:
    """A context (tokens per sequence) and a batch (sequences) of whole numbers >= 1, or the reason why not."""
    for what, value in (("context", context), ("batch", batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a whole number of at least 1 (tokens per sequence for the context, "
                             f"sequences for the batch), got {value!r}")


def largest_fitting(fits: Callable[[int], bool], upper: int) -> int:
    """The largest n in 1..upper with fits(n) (fits is monotone: true, then false), or 0 when even 1 fails."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
