"""The hardware a prediction runs on: links (latency + bytes / bandwidth), collectives over them, GPUs by name with
the rates they sustain, named rigs, and the roofline's efficiency constants.

Every figure comes from `data/hardware.json`, each with its original source there, or from your own measurement
(`fit_link` on the link benchmark's sizes and times).

A room of its own on the second floor, beside `sizing` (whose `Gpu` it names): the simulator and the inference speed
model both describe machines with it, and neither should import the other to do so. `sizing` stays the memory model;
links, collectives and efficiencies are time.

Link model: one message at a time per direction, each taking latency + bytes / bandwidth; the two directions are
independent. Collectives follow the ring algorithm's cost (Thakur et al. 2005; the busbw factors in nccl-tests'
doc/PERFORMANCE.md): an all-reduce of n bytes over N devices sends 2(N-1)/N * n bytes each way in 2(N-1) steps,
an all-gather or reduce-scatter half of that.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from helpers.facts import load_data
from helpers.sizing.gpus import Gpu, gpu


@dataclass(frozen=True)
class Link:
    """One direction of a link: `latency_s` per message plus bytes / `bandwidth` (bytes per second); `receive_s`:
    what posting each receive costs the receiving device's own thread, off its compute (on the CPU rig, gloo's post
    waited 2.3-2.8 ms on average while both ranks computed; measured by `measure_rig`; 0 where posting is
    asynchronous, as NCCL's on a GPU stream)."""

    latency_s: float
    bandwidth: float
    name: str = "custom link"
    receive_s: float = 0.0

    def __post_init__(self):
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be finite and >= 0 seconds, got {self.latency_s}")
        if not (self.receive_s >= 0 and math.isfinite(self.receive_s)):
            raise ValueError(f"a receive's posting time must be finite and >= 0 seconds, got {self.receive_s}")
        if not self.bandwidth > 0:
            raise ValueError(f"link bandwidth must be positive (bytes per second), got {self.bandwidth}")

    def seconds(self, nbytes: float) -> float:
        """Time of one message of `nbytes`; nothing to send costs nothing."""
        return self.latency_s + nbytes / self.bandwidth if nbytes > 0 else 0.0

    def __str__(self) -> str:
        posting = f", {self.receive_s * 1e3:.3g} ms to post each receive" if self.receive_s else ""
        return f"{self.name}: {self.bandwidth / 1e9:.3g} GB/s per direction, {self.latency_s * 1e6:.3g} us{posting}"


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


def broadcast_s(link: Link, nbytes: float, devices: int, messages: int = 1) -> float:
    """Broadcast of `nbytes` from one device to the others, sent as `messages` tensors one after another (as
    PyTorch's ZeroRedundancyOptimizer sends parameters): on a pipelined ring each message pays N-1 latencies and
    the bytes cross each link once."""
    if devices < 2 or nbytes <= 0:
        return 0.0
    return messages * (devices - 1) * link.latency_s + nbytes / link.bandwidth


@dataclass(frozen=True)
class Collectives:
    """Collectives as a library really runs them on a rig, each measured and fitted as seconds = latency + bytes /
    bandwidth of the whole tensor (an all-gather's gathered output, a reduce-scatter's full input, the tensor a
    broadcast sends) over `devices` ranks. For libraries whose costs are not the ring's: gloo on the CPU rig takes
    about as long for an all-gather as for an all-reduce of the same bytes, and longer for a reduce-scatter
    (measured by `helpers.simulate.calibrate`)."""

    allreduce: Link
    allgather: Link
    reducescatter: Link
    broadcast: Link
    devices: int = 2
    name: str = "measured collectives"

    def seconds(self, kind: str, nbytes: float, devices: int, messages: int = 1) -> float:
        if devices < 2 or nbytes <= 0:
            return 0.0
        if devices != self.devices:
            raise ValueError(f"{self.name} were measured over {self.devices} devices, not {devices}")
        link = getattr(self, kind)
        return messages * link.latency_s + nbytes / link.bandwidth

    def __str__(self) -> str:
        links = {kind: getattr(self, kind) for kind in ("allreduce", "allgather", "reducescatter", "broadcast")}
        return "; ".join(f"{kind} {link.bandwidth / 1e9:.3g} GB/s + {link.latency_s * 1e6:.3g} us"
                         for kind, link in links.items())


def collective_s(collectives: "Link | Collectives", kind: str, nbytes: float, devices: int, messages: int = 1) -> float:
    """Seconds of one collective (allreduce, allgather, reducescatter or broadcast) of `nbytes` over `devices`: from
    measured `Collectives`, or from a `Link` by the ring's costs."""
    if isinstance(collectives, Collectives):
        return collectives.seconds(kind, nbytes, devices, messages)
    if kind == "broadcast":
        return broadcast_s(collectives, nbytes, devices, messages)
    ring = {"allreduce": allreduce_s, "allgather": allgather_s, "reducescatter": reducescatter_s}
    if kind not in ring:
        raise ValueError(f"unknown collective {kind!r}; choose one of {[*ring, 'broadcast']}")
    return ring[kind](collectives, nbytes, devices)


COMPUTE_TASKS = frozenset({"forward", "backward", "recompute", "optimizer", "weight"})
COLLECTIVES = frozenset({"allreduce", "allgather", "reducescatter", "broadcast"})


@dataclass(frozen=True)
class SharedCores:
    """Devices that share a pool of processors instead of owning their hardware: the CPU rig, where a virtual device
    is a thread or a process pinned to one intra-op thread and the operating system shares the cores among them.

    While `users` tasks of `kinds` want a core (a task counts once per device it runs on), each progresses at
    min(1, cores / users) of its speed alone (processor sharing: the scheduler divides the cores fairly), and at
    1 / `slowdown` of that while more than one core is busy (two cores computing at once each run slower than one
    alone: shared caches and memory bandwidth, and for threads of one process the GIL; measure it, e.g. the bench
    times the same work alone and on both cores at once). `kinds`: the compute kinds by default; add the
    collectives on gloo, which copies and adds on the CPU.
    """

    cores: int
    slowdown: float = 1.0
    kinds: frozenset = COMPUTE_TASKS

    def __post_init__(self):
        if not (isinstance(self.cores, int) and self.cores >= 1):
            raise ValueError(f"the core count must be a whole number >= 1, got {self.cores!r}")
        if not (self.slowdown >= 1 and math.isfinite(self.slowdown)):
            raise ValueError(f"the slowdown of busy cores must be a finite factor >= 1, got {self.slowdown}")

    def __str__(self) -> str:
        return f"{self.cores} shared cores, {self.slowdown:.3g}x slower when more than one is busy"


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


def fit_collective_link(sizes: Sequence[float], allreduce_seconds: Sequence[float], devices: int = 2,
                        name: str = "fitted collectives") -> Link:
    """The link that makes `allreduce_s` reproduce a measured all-reduce (time of one all-reduce of each size over
    `devices`): a + n / B fitted, then latency a / (2(N-1)) and bandwidth B * 2(N-1)/N, the ring's steps and bytes.
    All-gathers and reduce-scatters then cost half an all-reduce of the same bytes, as on a ring."""
    if devices < 2:
        raise ValueError(f"an all-reduce needs at least 2 devices, got {devices}")
    fit = fit_link(sizes, allreduce_seconds, name)
    steps = 2 * (devices - 1)
    return Link(fit.latency_s / steps, fit.bandwidth * steps / devices, name)


def fit_collectives(samples: dict[str, tuple[Sequence[float], Sequence[float]]], devices: int = 2,
                    name: str = "measured collectives") -> Collectives:
    """`Collectives` fitted to measured (sizes, seconds) of each of allreduce, allgather, reducescatter and
    broadcast over `devices` ranks (sizes as `Collectives` defines them)."""
    kinds = ("allreduce", "allgather", "reducescatter", "broadcast")
    missing = [k for k in kinds if k not in samples]
    if missing:
        raise ValueError(f"no measurements of {missing}; give sizes and seconds for each of {list(kinds)}")
    return Collectives(*(fit_link(*samples[k], name=k) for k in kinds), devices=devices, name=name)


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


def gpu_named(name: str) -> Gpu:
    """A GPU from data/hardware.json (`gpus`), e.g. 'RTX 3090': `helpers.sizing.gpus.gpu`'s description, the one
    the planners use, with the sustained rates the roofline needs."""
    _known("GPU", name, load_data("hardware")["gpus"])
    card = gpu(name)
    if card.memory_bandwidth is None:
        raise ValueError(f"the {name} has no sustained figures in data/hardware.json; the roofline needs them")
    return card


@dataclass(frozen=True)
class TargetRig:
    """A named machine to predict: `devices` copies of `gpu` joined pairwise by `link` (copies, point to point);
    NCCL's all-reduce over them runs at `collectives`' bus bandwidth and latency (nccl-tests where published). A
    mixed rig lists its cards in `gpus` (`gpu` is the first, the one its workload is priced on)."""

    name: str
    gpu: Gpu
    link: Link
    devices: int
    collectives: Link
    note: str = ""
    gpus: tuple[Gpu, ...] = ()

    @property
    def cards(self) -> tuple[Gpu, ...]:
        """Each device's GPU, in device order."""
        return self.gpus or (self.gpu,) * self.devices

    @property
    def mixed(self) -> bool:
        return len({card.name for card in self.cards}) > 1


def target_rigs() -> list[str]:
    return sorted(load_data("hardware")["rigs"])


def allreduce_link(name: str) -> Link:
    """The ring link that makes `allreduce_s` reproduce a link's published all-reduce (data/hardware.json `links`,
    `allreduce`): for N devices a ring all-reduce takes 2(N-1) steps of latency + nbytes / N / bandwidth, and
    nccl-tests' busbw is the per-link bandwidth of that ring (its doc/PERFORMANCE.md), so the bandwidth is busbw
    and the latency per step half a 2-GPU all-reduce's small-message time. A link without a published all-reduce
    uses its copy figures."""
    entry = _known("link", name, load_data("hardware")["links"])
    if "allreduce" not in entry:
        return link_named(name)
    allreduce = entry["allreduce"]
    return Link(allreduce["small_message_us"] * 1e-6 / 2, allreduce["busbw_gb_s"] * 1e9, f"{name} (all-reduce)")


def target_rig(name: str) -> TargetRig:
    """A rig from data/hardware.json (`rigs`): '2x3090 PCIe', '2x3090 NVLink', '2x4090', '2xA100', ..."""
    entry = _known("rig", name, load_data("hardware")["rigs"])
    cards = tuple(gpu_named(card) for card in entry.get("gpus", ()))
    if cards and len(cards) != entry["devices"]:
        raise ValueError(f"rig {name!r} lists {len(cards)} GPUs for {entry['devices']} devices")
    return TargetRig(name, gpu_named(entry["gpu"]), link_named(entry["link"]), entry["devices"],
                     allreduce_link(entry["link"]), entry.get("note", ""), cards)


def rig_of_gpus(gpus: Sequence[Gpu]) -> TargetRig:
    """The named rig (data/hardware.json `rigs`) whose cards are these, in this order, on the stock driver (no
    peer-to-peer): what `--gpus "RTX 3090, RTX 4090"` trains on."""
    names = [g.name for g in gpus]
    for rig_name in target_rigs():
        rig = target_rig(rig_name)
        if [c.name for c in rig.cards] == names and ("no_p2p" in rig.link.name or rig.mixed):
            return rig
    raise ValueError(f"no training rig of {' + '.join(names)} in data/hardware.json; known rigs: "
                     f"{', '.join(target_rigs())}")


@dataclass(frozen=True)
class Efficiency:
    """The named constants of the per-kernel roofline (data/hardware.json `efficiency`): the fraction of the
    sustained large-matmul rate that real matmuls, convolutions and fused attention reach, the CPU's time to
    launch one kernel, and the share of a whole training step the GPU spends in the traced kernels (`framework`:
    the rest is what a layer benchmark does not see: the training loop's host work, synchronisations, the mixed-
    precision bookkeeping)."""

    matmul: float
    conv: float
    attention: float
    launch_s: float
    framework: float = 1.0


def efficiency(**overrides: float) -> Efficiency:
    """The roofline's constants from data/hardware.json, with any of them overridden (what a fit varies)."""
    table = load_data("hardware")["efficiency"]
    values = {name: table[name]["value"] for name in ("matmul", "conv", "attention", "framework")}
    values["launch_s"] = table["launch_us"]["value"] * 1e-6
    return Efficiency(**{**values, **overrides})
