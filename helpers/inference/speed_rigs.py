"""The two devices the speed model prices (`helpers.inference.speed`), and the links between them: `Device`,
`SpeedRig`.

Rigs: `speed_rig("2x3090 PCIe")` and the others named in data/inference_speed.json (each GPU as
`helpers.hardware` describes it: sustained bandwidth and matmul rate, the roofline's efficiency, the CPU's time to
launch a kernel), your two GPUs as the doctor measured their links (`speed_rig("doctor.json")`), or the CPU rig as
the speed bench measures it (`helpers.inference.speed_calibration.calibrate_cpu_rig`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

from helpers.facts import cached_data, load_data
from helpers.hardware import Link, efficiency, gpu_named, link_named
from helpers.hardware import allreduce_link as ring_allreduce_link

RING_STEPS = 2  # a 2-rank ring all-reduce: one reduce-scatter step, one all-gather step


speed_data = partial(cached_data, "inference_speed")  # data/inference_speed.json, read once: treat it as read-only


# --- devices and rigs ---------------------------------------------------------------------------------------------

def interpolated(points: Sequence[tuple[float, float]], x: float, log: bool = False) -> float:
    """The measured (x, y) `points` at `x`: linear between the two around it (in log(x) with `log`), the nearest
    point's y outside them (never extrapolated: a trend fitted on a few short points overcharged the long ones), 0
    with no points."""
    points = sorted(points)
    if not points:
        return 0.0
    if x <= points[0][0]:
        return points[0][1]
    scale = math.log if log else float
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (scale(x) - scale(x0)) / (scale(x1) - scale(x0)) * (y1 - y0)
    return points[-1][1]


@dataclass(frozen=True)
class Device:
    """One device as the speed model sees it.

    `bandwidth`: bytes per second the device streams weights and KV cache at; `flops`: (rows, FLOP/s) points of its
    sustained matmul rate by rows multiplied at once (one point: a constant rate, the GPUs' published layer rate);
    `host_s_per_op`: host time to dispatch one op; `busy_slowdown`: how much slower the device streams and computes
    while the other device is busy too (1 on GPUs, measured on the CPU rig where both share memory and caches);
    `busy_flops`: where measured (CPU rig), the matmul rate by rows while the other device multiplies too, which
    replaces `busy_slowdown` for the arithmetic (two cores sharing one memory slow down by how much they stream);
    `lock_wait_s_per_op`: what each op waits for the interpreter lock while the other device's thread works in the
    same process (the pipelined engine's stage threads; measured on the CPU rig, where it adds to the host's time,
    by `StageForwards.sample`; 0 where unmeasured: on GPUs the host launches ahead of the kernels); `activation_s`:
    (rows, seconds) points of what a decoder layer's forward of that many rows takes beyond its weights' roofline
    and its ops' dispatch: attention over the cache and its append, norms, rotary embedding, SiLU, residual adds,
    which one CPU thread runs after the matmuls rather than under them (measured on the CPU rig at decode batches;
    none where unmeasured: the GPUs' published layer rates include them); `prefill_activation_s`: the same for a
    prefill of that many rows (a whole prompt's causal attention, its cache written: not the decode step's work at
    as many rows), where measured; else a prefill takes the decode points."""

    name: str
    bandwidth: float
    flops: tuple[tuple[int, float], ...]
    host_s_per_op: float
    busy_slowdown: float = 1.0
    busy_flops: tuple[tuple[int, float], ...] = ()
    lock_wait_s_per_op: float = 0.0
    activation_s: tuple[tuple[int, float], ...] = ()
    prefill_activation_s: tuple[tuple[int, float], ...] = ()

    def rate(self, rows: int, busy: bool = False) -> float:
        """FLOP/s at `rows` rows (while the other device works too, with `busy`), interpolated in log(rows) between
        the measured points, constant beyond them."""
        if busy and not self.busy_flops:
            return self.rate(rows) / self.busy_slowdown
        return interpolated(self.busy_flops if busy else self.flops, rows, log=True)

    def activation_seconds(self, rows: int, prefill: bool = False) -> float:
        """`activation_s` (a `prefill`: `prefill_activation_s` where measured) at `rows`: interpolated between the
        measured points, the nearest point's outside them."""
        return interpolated(self.prefill_activation_s if prefill and self.prefill_activation_s else self.activation_s,
                            rows)

    def seconds(self, nbytes: float, flops: float, rows: int, busy: bool = False) -> float:
        """The roofline: max(bytes / bandwidth, FLOPs / rate at `rows`), slower while both devices work."""
        slow = self.busy_slowdown if busy else 1.0
        return max(slow * nbytes / self.bandwidth, flops / self.rate(rows, busy))


@dataclass(frozen=True)
class SpeedRig:
    """Two devices, the hop of a hidden state between them, and the all-reduce tensor parallelism pays per layer.

    `hop`: one point-to-point message (seconds = latency + bytes / bandwidth); `allreduce`: one all-reduce of the
    whole tensor over both devices, as a Link whose latency is the small-message cost; `host_overlaps`: True on GPUs
    (the host launches ahead of the kernels), False on the CPU rig (the thread that dispatches also computes);
    `sharded_linear_s`: (rows, seconds) points of the host time DTensor adds to each column-parallel linear of that
    many rows (measured on the CPU rig, `sharded_linear_seconds`: it grows with the rows; none where unknown). The
    row-parallel ones' host work comes with their all-reduce: the CPU rig's `allreduce` is measured through a
    row-parallel linear, as the engine issues it. `allreduce_waits`: (seconds of work since the last
    all-reduce, seconds the next one waits beyond `allreduce`) points: the ranks drift apart while they work and
    the earlier waits for the later (`allreduce_wait`; measured on the CPU rig, where a rank's time slices vary;
    none on GPUs, where kernels keep time)."""

    name: str
    devices: tuple[Device, Device]
    hop: Link
    allreduce: Link
    host_overlaps: bool = True
    sharded_linear_s: tuple[tuple[int, float], ...] = ()
    allreduce_waits: tuple[tuple[float, float], ...] = ()
    note: str = ""
    sources: dict = field(default_factory=dict, compare=False)

    def allreduce_wait(self, work_s: float) -> float:
        """Seconds an all-reduce waits for the later rank after `work_s` seconds of work since the last one:
        interpolated between the measured points, none below the first (where `allreduce` was measured), the last
        point's beyond the last: not extrapolated, as a linear drift fitted on short stretches overcharges prefill's
        long ones (docs/bench.md, `allreduce_wait`)."""
        return interpolated(self.allreduce_waits, work_s)

    def sharded_linear_seconds(self, rows: int) -> float:
        """DTensor's host time on one column-parallel linear of `rows` rows (`sharded_linear_s`, interpolated)."""
        return interpolated(self.sharded_linear_s, rows)


def speed_rigs() -> list[str]:
    return sorted(speed_data()["rigs"])


def _gpu_device(name: str) -> Device:
    """A GPU as the simulator's roofline sees it (helpers.hardware: data/hardware.json's sustained bandwidth and
    matmul rate, the `efficiency` a real layer's matmul reaches of it, the CPU's time to launch a kernel)."""
    gpu, eff = gpu_named(name), efficiency()
    return Device(name, gpu.memory_bandwidth, ((1, gpu.flops("bf16") * eff.matmul),), eff.launch_s)


def allreduce_over(link: Link) -> Link:
    """The 2-GPU all-reduce of a hidden state on `link` by this module's rule, as seconds = latency + bytes /
    bandwidth of the whole tensor: latency max(2 x the link's message latency, the NCCL floor), bandwidth the
    link's (a 2-rank ring sends each rank's half and receives the other's: n bytes each way in two steps;
    data/inference_speed.json)."""
    floor = speed_data()["allreduce_small"]["nccl_floor_us"] * 1e-6
    return Link(max(RING_STEPS * link.latency_s, floor), link.bandwidth, f"all-reduce over {link.name}")


def rig_allreduce(link_name: str) -> Link:
    """The all-reduce of a named link: data/hardware.json's own figure where it has one (a ring's per-step latency
    and bus bandwidth, `helpers.hardware.allreduce_link`: 2 ranks pay 2 steps and n / busbw), else
    `allreduce_over` the link's copy figures."""
    if "allreduce" not in load_data("hardware")["links"][link_name]:
        return allreduce_over(link_named(link_name))
    ring = ring_allreduce_link(link_name)
    return Link(RING_STEPS * ring.latency_s, ring.bandwidth, ring.name)


def speed_rig(name: str | SpeedRig) -> SpeedRig:
    """A named rig of data/inference_speed.json ('2x3090 PCIe', '2x3090 PCIe P2P', '2x3090 NVLink', '3090 + 4090'),
    the path of a doctor's JSON report (`speed_rig_from_doctor`), or a SpeedRig you built or measured (as is)."""
    if isinstance(name, SpeedRig):
        return name
    if str(name).endswith(".json"):
        return speed_rig_from_doctor(name)
    rigs = speed_data()["rigs"]
    if name not in rigs:
        raise ValueError(f"unknown rig {name!r}: known rigs are {', '.join(speed_rigs())}; or give your GPUs' links "
                         "as measured by `python -m helpers.doctor --json doctor.json` (the path doctor.json)")
    entry = rigs[name]
    link = link_named(entry["link"])
    hardware = load_data("hardware")
    wire = hardware["links"][entry["link"]]
    sources = {"link": wire["source"],
               "allreduce": wire["allreduce"]["source"] if "allreduce" in wire else
               speed_data()["allreduce_small"]["nccl_floor_source"],
               **{g: hardware["gpus"][g]["source"] for g in entry["gpus"]}}
    a, b = (_gpu_device(g) for g in entry["gpus"])
    return SpeedRig(name, (a, b), link, rig_allreduce(entry["link"]), note=entry["note"], sources=sources)


def _known_gpu(reported: str) -> str:
    """data/hardware.json's name for a GPU as CUDA reports it ('NVIDIA GeForce RTX 3090' -> 'RTX 3090')."""
    known = sorted(load_data("hardware")["gpus"], key=len, reverse=True)
    match = next((name for name in known if reported.lower().endswith(name.lower())), None)
    if match is None:
        raise ValueError(f"no published rates for {reported!r} in data/hardware.json (known: {', '.join(known)})")
    return match


def speed_rig_from_doctor(report: dict | str) -> SpeedRig:
    """Your two GPUs as `python -m helpers.doctor --json doctor.json` measured them: each GPU's published rates by
    name, the hop from the multi-process point-to-point link, the all-reduce from the doctor's fit over hidden-state
    sizes (its small-message latency, what tensor parallelism pays twice per layer)."""
    import json
    from pathlib import Path

    if not isinstance(report, dict):
        if not Path(report).is_file():
            raise ValueError(f"no doctor's report at {report}: write one with python -m helpers.doctor --json {report}")
        report = json.loads(Path(report).read_text())
    gpus = [g["name"] for g in report.get("topology", {}).get("gpus", [])]
    if len(gpus) < 2:
        raise ValueError(f"the doctor's report lists {len(gpus)} GPU(s): the speed model needs two (run the doctor on "
                         "the two-GPU machine)")
    links = {row["path"]: row for row in report.get("links", [])}

    def link(pick) -> Link:
        row = next((r for path, r in links.items() if pick(path)), None)
        if row is None:
            raise ValueError(f"the doctor's report has no link row for this (paths: {', '.join(links) or 'none'})")
        return Link(row["latency_us"] * 1e-6, row["GB/s"] * 1e9, row["path"])

    hop = link(lambda path: path.startswith("processes: point-to-point"))
    allreduce = link(lambda path: "all-reduce" in path and path.endswith("hidden-state sizes"))
    a, b = (_gpu_device(_known_gpu(name)) for name in gpus[:2])
    return SpeedRig("your rig (doctor)", (a, b), hop, allreduce, note=f"{gpus[0]} + {gpus[1]}, links measured by the "
                    "doctor", sources={"links": "python -m helpers.doctor", "gpus": "data/hardware.json"})
