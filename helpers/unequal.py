"""Two unequal cards: how fast each device runs the same work, and the pair a comparison of splits trains on.

`measure_speeds(model, x, y, loss_fn, devices)` times one forward + backward of a copy of `model` on each device with
the timeline's `Recorder` (CUDA events on a GPU, the wall clock on the CPU rig), the devices taking turns in each of
`repeats` rounds; a device's speed is the median of the rounds' ratios, so that a noisy moment, which slows both
halves of a round alike, cancels. Its `speeds` are relative to device 0 (1.0; a card twice as slow 0.5), ready for
`optimal_split(costs, k, speeds=...)` and the simulator's `Job(speeds=...)`, whose per-layer costs are device 0's
profile.

On the CPU rig both virtual devices are alike, so a slower card is emulated: `slowdown=(1.0, 2.0)` stretches each
compute span of device 1 to twice its length by waiting at its end, as `TrainJob(slowdown=...)` does in training
(same memory, longer compute). `unequal_pair(rig, ...)` picks the pair a notebook compares splits on: the CPU rig's
emulated pair; two GPUs whose measured speeds differ by more than `EQUAL_WITHIN`, as they are; two equal GPUs (or
one) cannot be emulated (a GPU runs at its own speed), so there the splits of the emulated speeds are predicted by
the simulator and not trained (`Pair.trains`).
"""
from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.runtime.rig import Rig
from helpers.timeline import Recorder

EMULATED = (1.0, 2.0)  # the CPU rig's pair: device 1 half as fast
EQUAL_WITHIN = 0.1  # two GPUs whose speeds differ by less than this are a matched pair


@dataclass(frozen=True)
class DeviceSpeeds:
    """Median seconds of one forward + backward per device, and the emulation it was timed under (() for none)."""

    labels: tuple[str, ...]
    seconds: tuple[float, ...]
    slowdown: tuple[float, ...] = ()
    ratios: tuple[float, ...] | None = None  # per device, the median over rounds of device 0's time over its own

    @property
    def speeds(self) -> tuple[float, ...]:
        """Each device's speed relative to device 0 (larger is faster): the median of each round's device 0 time over
        the device's own, where rounds were timed (a noisy moment slows both halves of a round alike), else the
        medians' ratio."""
        return self.ratios or tuple(self.seconds[0] / s for s in self.seconds)

    def __str__(self) -> str:
        parts = [f"{label} {s * 1e3:.1f} ms (speed {v:.2f})" for label, s, v in
                 zip(self.labels, self.seconds, self.speeds)]
        emulated = f", emulated with slowdown {self.slowdown}" if any(f != 1.0 for f in self.slowdown) else ""
        return "forward + backward: " + ", ".join(parts) + emulated


def measure_speeds(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                   devices: Sequence[torch.device], labels: Sequence[str] | None = None,
                   slowdown: Sequence[float] = (), repeats: int = 5) -> DeviceSpeeds:
    """Time one forward + backward of `model` on (x, y) on each device: a copy per device (the model itself is not
    touched), one warm-up round, then `repeats` rounds in which every device runs once, one after the other: the
    medians, and each device's speed from the rounds' ratios. `slowdown` (the CPU rig only, one factor >= 1 per
    device) emulates slower cards as `Recorder(slowdown=...)` does."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    slowdown = tuple(float(f) for f in slowdown)
    if slowdown and len(slowdown) != len(devices):
        raise ValueError(f"slowdown={slowdown}: give {len(devices)} factors, one per device")
    labels = tuple(labels) if labels is not None else tuple(str(d) for d in devices)
    copies = [copy.deepcopy(model).to(d) for d in devices]
    inputs = [(x.to(d), y.to(d)) for d in devices]
    recorders = [Recorder(i, d, slowdown[i] if slowdown else 1.0) for i, d in enumerate(devices)]
    times: list[list[float]] = [[] for _ in devices]
    for round_ in range(repeats + 1):
        for i, (m, (xi, yi), rec) in enumerate(zip(copies, inputs, recorders)):
            rec.clear()
            with rec.span("forward"):
                loss = loss_fn(m(xi), yi)
            with rec.span("backward"):
                loss.backward()
            m.zero_grad(set_to_none=True)
            if round_:  # round 0 warms up
                times[i].append(sum(e.duration for e in rec.events()))
    del copies, inputs
    ratios = tuple(statistics.median(t0 / t for t0, t in zip(times[0], own)) for own in times)
    return DeviceSpeeds(labels, tuple(statistics.median(t) for t in times), slowdown, ratios)


@dataclass(frozen=True)
class Pair:
    """The two devices a comparison of splits runs on: what was measured, the speeds to split by, the emulation to
    train with (`TrainJob(slowdown=...)`, () on real cards) and whether the training runs on this rig."""

    measured: DeviceSpeeds
    speeds: tuple[float, ...]
    slowdown: tuple[float, ...]
    trains: bool
    note: str

    def __str__(self) -> str:
        return f"{self.note}\n{self.measured}\nsplit by speeds {tuple(round(v, 2) for v in self.speeds)}"


def unequal_pair(rig: Rig, model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable,
                 repeats: int = 5, emulate: Sequence[float] = EMULATED) -> Pair:
    """Measure each device's speed and pick the pair: on the CPU rig the emulated one (`emulate`, per device: its
    speeds are 1 / those factors, the measurement shows the emulation at work); two GPUs of different speed as
    measured; equal GPUs (or one GPU) the emulated speeds for the split and the simulator, without training."""
    emulate = tuple(float(f) for f in emulate)
    emulated_speeds = tuple(emulate[0] / f for f in emulate)
    if rig.is_cpu:
        measured = measure_speeds(model, x, y, loss_fn, rig.devices, rig.labels, emulate, repeats)
        return Pair(measured, emulated_speeds, emulate, True,
                    f"the CPU rig's emulated pair: device 1 at slowdown {emulate[1]:g} (same memory, each compute span "
                    f"{emulate[1]:g}x as long)")
    measured = measure_speeds(model, x, y, loss_fn, rig.devices, rig.labels, (), repeats)
    slowest = min(measured.speeds) / max(measured.speeds)
    if rig.kind == "two_gpus" and slowest < 1 - EQUAL_WITHIN:
        return Pair(measured, measured.speeds, (), True, "two cards of different speed, as measured")
    return Pair(measured, emulated_speeds, (), False,
                f"the devices run at the same speed (within {EQUAL_WITHIN:.0%}) and a slower card is emulated on the "
                f"CPU rig only: the splits for speeds {emulated_speeds} are predicted, not trained (LAB_FORCE_CPU=1 "
                "trains them on the CPU rig)")
