"""The hardware the simulator runs on: links (latency + bytes / bandwidth), GPUs (sustained rates) and named rigs.

Every figure comes from `data/hardware.json`, each with its original source there, or from your own measurement
(`fit_link` on the link benchmark's sizes and times).

Link model: one message at a time per direction, each taking latency + bytes / bandwidth; the two directions are
independent. Collectives follow the ring algorithm's cost (Thakur et al. 2005; the busbw factors in nccl-tests'
doc/PERFORMANCE.md): an all-reduce of n bytes over N devices sends 2(N-1)/N * n bytes each way in 2(N-1) steps,
an all-gather or reduce-scatter half of that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from helpers.course import load_data

DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Link:
    """One direction of a link: `latency_s` per message plus bytes / `bandwidth` (bytes per second)."""

    latency_s: float
    bandwidth: float
    name: str = "custom link"

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be finite and >= 0 seconds, got {self.latency_s}")
        if not self.bandwidth > 0:
            raise ValueError(f"link bandwidth must be positive (bytes per second), got {self.bandwidth}")

    def seconds(self, nbytes: float) -> float:
        """Time of one message of `nbytes`; nothing to send costs nothing."""
        return self.latency_s + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def __str__(self) -> str:
        return f"{self.name}: {self.bandwidth / 1e9:.3g} GB/s per direction, {self.latency_s * 1e6:.3g} us"


FREE_LINK = Link(0.0, math.inf, "free link")


def allreduce_s(link: Link, nbytes: float, devices: int) -> float:
    """Ring all-reduce of `nbytes` over `devices`: 2(N-1) steps, each carrying nbytes/N per direction."""
    if devices < 2 or nbytes <= 0:
        return 0.0
    return 2 * (devices - 1) * (link.latency_s + nbytes / devices / link.bandwidth)


def allgather_s(link: Link, nbytes: float, devices: int) -> float:
    """Ring all-gather (or reduce-scatter) whose full tensor has `nbytes`: N-1 steps of nbytes/N each."""
    if devices < 2 or nbytes <= 0:
        return 0.0
    return (devices - 1) * (link.latency_s + nbytes / devices / link.bandwidth)


reducescatter_s = allgather_s


def fit_link(sizes: Sequence[float], seconds: Sequence[float], name: str = "fitted link") -> Link:
    """Least-squares fit of seconds = latency + size / bandwidth to a link benchmark (sizes in bytes).

    A negative intercept (noise on small messages) is clamped to zero latency and the slope refitted through the
    origin, so the link stays physical.
    """
    sizes, seconds = [float(s) for s in sizes], [float(t) for t in seconds]
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} message sizes for {len(seconds)} times")
    if len(set(sizes)) < 2:
        raise ValueError("fitting a link needs at least two different message sizes")
    if any(s < 0 for s in sizes) or any(not t > 0 for t in seconds):
        raise ValueError("message sizes must be >= 0 bytes and times > 0 seconds")
    n = len(sizes)
    mean_s, mean_t = sum(sizes) / n, sum(seconds) / n
    slope = (sum((s - mean_s) * (t - mean_t) for s, t in zip(sizes, seconds))
             / sum((s - mean_s) ** 2 for s in sizes))
    latency = mean_t - slope * mean_s
    if latency < 0:
        latency, slope = 0.0, sum(s * t for s, t in zip(sizes, seconds)) / sum(s * s for s in sizes)
    if not slope > 0:
        raise ValueError("the times do not grow with message size: no bandwidth can be fitted")
    return Link(latency, 1 / slope, name)


def _known(what: str, name: str, table: dict) -> dict:
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; known {what}s: {', '.join(sorted(table))}")
    return table[name]


def link_named(name: str) -> Link:
    """A link from data/hardware.json (`links`), e.g. '3090_gpu_to_gpu_no_p2p'."""
    entry = _known("link", name, load_data("hardware")["links"])
    if "latency_us" not in entry:
        raise ValueError(f"link {name!r} has no latency in data/hardware.json; it cannot drive a simulation")
    return Link(entry["latency_us"] * 1e-6, entry["gb_s_per_direction"] * 1e9, name)


@dataclass(frozen=True)
class GPU:
    """What the roofline needs of a GPU: sustained FLOP/s on real layers per dtype, memory bandwidth, capacity."""

    name: str
    memory_bytes: int
    memory_bandwidth: float  # bytes/s
    layer_flops: dict[str, float]  # FLOP/s sustained on real transformer layers, per dtype
    matmul_flops: dict[str, float]  # FLOP/s of a large matmul, per dtype (the ceiling real layers do not reach)

    def flops(self, dtype: str) -> float:
        if dtype not in self.layer_flops:
            raise ValueError(f"no sustained {dtype!r} figure for the {self.name} in data/hardware.json; "
                             f"known: {', '.join(sorted(self.layer_flops))}")
        return self.layer_flops[dtype]


def gpu_named(name: str) -> GPU:
    """A GPU from data/hardware.json (`gpus`), e.g. 'RTX 3090'."""
    entry = _known("GPU", name, load_data("hardware")["gpus"])
    sustained = entry.get("sustained")
    if sustained is None:
        raise ValueError(f"the {name} has no sustained figures in data/hardware.json; the roofline needs them")
    rates = lambda table: {d: table[d] * 1e12 for d in DTYPES if d in table}  # noqa: E731
    return GPU(name, int(entry["memory_gb"] * 1e9), entry["memory_bandwidth_gb_s"] * 1e9,
               rates(sustained["layer_tflops"]), rates(sustained["matmul_tflops"]))


@dataclass(frozen=True)
class TargetRig:
    """A named machine to predict: `devices` copies of `gpu` joined pairwise by `link`."""

    name: str
    gpu: GPU
    link: Link
    devices: int
    note: str = ""


def target_rigs() -> list[str]:
    return sorted(load_data("hardware")["rigs"])


def target_rig(name: str) -> TargetRig:
    """A rig from data/hardware.json (`rigs`): '2x3090 PCIe', '2x3090 NVLink', '2x4090', '2xA100', ..."""
    entry = _known("rig", name, load_data("hardware")["rigs"])
    return TargetRig(name, gpu_named(entry["gpu"]), link_named(entry["link"]), entry["devices"], entry.get("note", ""))
