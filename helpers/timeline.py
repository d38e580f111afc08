"""What each device did, when: one event format for pipelines, data parallelism and the simulator.

Events are recorded with `time.perf_counter` (on Linux a system-wide monotonic clock, so ranks on one machine share
it) or, on GPUs, with CUDA events resolved after a synchronise. One function draws them all.
"""
from __future__ import annotations

import math
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Iterator, Sequence

import torch

KIND_COLORS = {
    "forward": "#4C72B0", "backward": "#DD8452", "send": "#55A868", "recv": "#8C8C8C",
    "allreduce": "#C44E52", "optimizer": "#8172B3", "recompute": "#937860", "compute": "#4C72B0",
    "allgather": "#DA8BC3", "reducescatter": "#CCB974", "transfer": "#55A868", "loss": "#64B5CD",
    "prefill": "#4C72B0", "decode": "#55A868", "copy": "#B0B0B0", "host": "#6E6E6E", "weight": "#E5AE38",
}


COMPUTE_KINDS = {"forward", "backward", "recompute", "optimizer", "loss", "compute", "weight"}


@dataclass(frozen=True)
class Event:
    device: int
    kind: str  # forward / backward / weight (a split backward's weight half) / send / recv / allreduce / ...
    start: float  # seconds
    end: float
    microbatch: int | None = None
    stage: int | None = None  # the pipeline stage that ran it (a device may hold several)
    # CPU seconds the recording thread itself used during the span (CPU spans recorded with `Recorder.span`): unlike
    # the wall time, other processes on the cores do not stretch it, so it shows the work a span did
    cpu: float | None = None

    @property
    def duration(self) -> float:
        return self.end - self.start

    def as_dict(self) -> dict:
        return asdict(self)


class Recorder:
    """Records spans for one device. On CUDA the spans are CUDA events on the current stream (no sync per span).

    `slowdown` (the CPU rig only) emulates a slower card: each outermost compute span (forward, backward, weight,
    recompute, optimizer, ...) is stretched to `slowdown` times its measured length by waiting at its end, the way a
    host thread waits on a slower GPU. Memory is unchanged and the device's core stays free for the other device
    while it waits; a 3090 beside a 4090 is about a 1.6x slowdown (compute), 1.0 is none."""

    def __init__(self, device_index: int, torch_device: torch.device | None = None, slowdown: float = 1.0):
        self.device_index = device_index
        self._cuda = torch_device is not None and torch_device.type == "cuda" and torch.cuda.is_available()
        if not (math.isfinite(slowdown) and slowdown >= 1.0):
            raise ValueError(f"slowdown must be a factor >= 1 (2.0: half as fast), got {slowdown!r}")
        if self._cuda and slowdown != 1.0:
            raise ValueError("a slower card is emulated on the CPU rig only: on GPUs each card runs at its own speed")
        self.slowdown = slowdown
        self._compute_depth = 0
        self._events: list[Event] = []
        self._pending: list[tuple[str, int | None, object, object, int | None]] = []
        if self._cuda:
            self._torch_device = torch_device
            torch.cuda.synchronize(torch_device)
            self._base_event = torch.cuda.Event(enable_timing=True)
            self._base_event.record(torch.cuda.current_stream(torch_device))
            torch.cuda.synchronize(torch_device)
            self._base_time = time.perf_counter()

    def start(self):
        """A start mark: a CUDA event on this device's current stream, or the wall clock on CPU."""
        if self._cuda:
            mark = torch.cuda.Event(enable_timing=True)
            mark.record(torch.cuda.current_stream(self._torch_device))
            return mark
        return time.perf_counter()

    def finish(self, mark, kind: str, microbatch: int | None = None, stage: int | None = None) -> None:
        """Close a span opened with `start`. On CUDA the end is an event on the *current* stream, so a callback
        that runs once a collective has finished on the GPU (a DDP comm hook's future) marks that moment, not the
        moment the host queued the work."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record(torch.cuda.current_stream(self._torch_device))
            self._pending.append((kind, microbatch, mark, end, stage))
        else:
            self._events.append(Event(self.device_index, kind, mark, time.perf_counter(), microbatch, stage))

    @contextmanager
    def span(self, kind: str, microbatch: int | None = None, stage: int | None = None) -> Iterator[None]:
        """Record the enclosed code as a span; on CPU also the thread's CPU time during it (`Event.cpu`)."""
        if self._cuda:
            mark = self.start()
            yield
            self.finish(mark, kind, microbatch, stage)
            return
        stretch = self.slowdown != 1.0 and kind in COMPUTE_KINDS and self._compute_depth == 0
        cpu, start = time.thread_time(), time.perf_counter()
        self._compute_depth += kind in COMPUTE_KINDS
        try:
            yield
        finally:
            self._compute_depth -= kind in COMPUTE_KINDS
        if stretch:
            time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))
        end = time.perf_counter()
        self._events.append(Event(self.device_index, kind, start, end, microbatch, stage, time.thread_time() - cpu))

    def events(self) -> list[Event]:
        if self._pending:
            torch.cuda.synchronize(self._torch_device)
            for kind, mb, s, e, stage in self._pending:
                t0 = self._base_time + self._base_event.elapsed_time(s) / 1e3
                t1 = self._base_time + self._base_event.elapsed_time(e) / 1e3
                self._events.append(Event(self.device_index, kind, t0, t1, mb, stage))
            self._pending.clear()
        return sorted(self._events, key=lambda e: e.start)

    def clear(self) -> None:
        self._events.clear()
        self._pending.clear()


def normalise(events: Iterable[Event]) -> list[Event]:
    """Shift events so the earliest starts at 0."""
    events = list(events)
    if not events:
        return []
    t0 = min(e.start for e in events)
    return sorted((replace(e, start=e.start - t0, end=e.end - t0) for e in events), key=lambda e: (e.device, e.start))


def gather_events(events: list[Event]) -> list[Event]:
    """All ranks' events, on every rank (call on all ranks of an initialised process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return list(events)
    parts: list[list[Event] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, list(events))
    return [e for part in parts for e in (part or [])]


def makespan(events: Iterable[Event]) -> float:
    events = list(events)
    return max(e.end for e in events) - min(e.start for e in events) if events else 0.0


PHASES = {"forward": {"forward"}, "backward": {"backward", "recompute", "weight"}}  # the timeline kinds of each phase


def phase_seconds(events: Iterable[Event]) -> dict[str, float]:
    """Seconds spent in each of `PHASES`, summed over devices (nested spans of one kind count twice)."""
    events = list(events)
    return {phase: sum(e.duration for e in events if e.kind in kinds) for phase, kinds in PHASES.items()}


def median_phases(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over steps of `phase_seconds` (one dict per step): the typical step, not the one
    recorded for a timeline, which on a shared machine can be 20% off either way."""
    return {phase: statistics.median(s[phase] for s in steps) for phase in PHASES} if steps else {}


def median_span_s(events: Iterable[Event], device: int, kind: str, cpu: bool = False) -> float:
    """Median seconds of `device`'s spans of `kind`: the thread's CPU seconds where recorded (`cpu`; CUDA spans have
    none: their GPU time), else the wall time; 0 where there are none."""
    spans = [e for e in events if e.device == device and e.kind == kind]
    return statistics.median(e.cpu if cpu and e.cpu is not None else e.duration for e in spans) if spans else 0.0


def busy_fraction(events: Iterable[Event], busy_kinds: set[str] | None = None) -> dict[int, float]:
    """Per device: time spent computing (merged spans of `busy_kinds`, by default the compute kinds: waiting for a
    message is not work) / the whole makespan."""
    events = list(events)
    busy_kinds = COMPUTE_KINDS if busy_kinds is None else busy_kinds
    span = makespan(events)
    out: dict[int, float] = {}
    for dev in sorted({e.device for e in events}):
        busy, reached = 0.0, -math.inf  # overlapping spans count once: only what lies past the spans before
        for s, e in sorted((e.start, e.end) for e in events if e.device == dev and e.kind in busy_kinds):
            busy += max(0.0, e - max(s, reached))
            reached = max(reached, e)
        out[dev] = busy / span if span > 0 else 0.0
    return out


def plot_timeline(events: Iterable[Event], ax=None, title: str | None = None,
                  device_names: dict[int, str] | None = None, busy_kinds: set[str] | None = None):
    """Gantt chart: one row per device, a bar per event, micro-batch numbers on the bars, busy % per row. Where a
    device runs several pipeline stages (interleaved and V-shaped schedules), the bars of its later stages are
    hatched."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = normalise(events)
    if ax is None:
        # constrained: the title, the time axis and the legend outside the axes stay on the figure wherever it is
        # drawn (a live widget's output keeps the figure's own size, without the inline backend's tight crop)
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * max(1, len({e.device for e in events}))), layout="constrained")
    busy = busy_fraction(events, busy_kinds)
    devices = sorted({e.device for e in events})
    span_ms = makespan(events) * 1e3 or 1.0
    hatched = False
    for row, dev in enumerate(devices):
        mine = [e for e in events if e.device == dev]
        first_stage = min((e.stage for e in mine if e.stage is not None), default=None)
        for e in mine:
            later = e.stage is not None and e.stage != first_stage
            hatched |= later
            ax.barh(row, e.duration * 1e3, left=e.start * 1e3, height=0.6, edgecolor="white", linewidth=0.5,
                    color=KIND_COLORS.get(e.kind, "#999999"), hatch="///" if later else None)
            if e.microbatch is not None and e.duration * 1e3 > span_ms / 60:
                ax.text((e.start + e.duration / 2) * 1e3, row, str(e.microbatch), ha="center", va="center",
                        fontsize=7, color="white")
    names = device_names or {}
    ax.set_yticks(range(len(devices)), [f"{names.get(d, f'device {d}')}\nbusy {busy[d]:.0%}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    kinds = [k for k in KIND_COLORS if any(e.kind == k for e in events)]
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in kinds]
    if hatched:
        handles.append(Patch(facecolor="#999999", edgecolor="white", hatch="///", label="device's later stage"))
    ax.legend(handles=handles, loc="upper left", fontsize=7, bbox_to_anchor=(1.0, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return ax


def concurrent_time(events: Iterable[Event], kinds: set[str] | None = None) -> float:
    """Seconds during which two devices computed at the same time: 0 for a strictly sequential schedule (the naive
    split), positive once a pipeline or data parallelism keeps both busy. A structural check, not a speed."""
    kinds = kinds or COMPUTE_KINDS
    spans = [(e.start, e.end, e.device) for e in events if e.kind in kinds]
    points = sorted([(s, 1, d) for s, _, d in spans] + [(e, -1, d) for _, e, d in spans])
    active: dict[int, int] = {}
    total, last = 0.0, None
    for t, step, dev in points:
        if last is not None and sum(1 for n in active.values() if n > 0) >= 2:
            total += t - last
        active[dev] = active.get(dev, 0) + step
        last = t
    return total


def plot_timelines(panels: dict[str, Iterable[Event]], device_names: dict[int, str] | None = None,
                   busy_kinds: set[str] | None = None):
    """Several timelines stacked on one time axis, one titled panel each (to compare schedules or strategies)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 1.8 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, events) in zip(axes[:, 0], panels.items()):
        plot_timeline(events, ax=ax, title=title, device_names=device_names, busy_kinds=busy_kinds)
    fig.tight_layout()
    return fig


def chrome_trace(events: Iterable[Event], path=None, device_names: dict[int, str] | None = None) -> dict:
    """The events as a Chrome / Perfetto trace (the JSON `torch.profiler`'s `export_chrome_trace` writes: one
    complete event, "ph": "X", per span, times in microseconds from the first span, its CPU milliseconds among its
    args where recorded), one process row per device; written to `path` if given. Open it at ui.perfetto.dev or
    chrome://tracing."""
    import json

    events = normalise(events)
    names = device_names or {}
    trace = [{"name": "process_name", "ph": "M", "pid": d, "tid": 0, "args": {"name": names.get(d, f"device {d}")}}
             for d in sorted({e.device for e in events})]
    for e in events:
        label = e.kind if e.microbatch is None else f"{e.kind} {e.microbatch}"
        args = {k: v for k, v in (("microbatch", e.microbatch), ("stage", e.stage),
                                  ("cpu_ms", None if e.cpu is None else e.cpu * 1e3)) if v is not None}
        trace.append({"name": label, "cat": e.kind, "ph": "X", "ts": e.start * 1e6, "dur": e.duration * 1e6,
                      "pid": e.device, "tid": 0, "args": args})
    out = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        from pathlib import Path

        Path(path).write_text(json.dumps(out))
    return out
