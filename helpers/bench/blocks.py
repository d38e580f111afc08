"""The bench's building blocks that notebooks import: a one-device step, a pipeline ready to time, interleaved timing
of several, their table rows, a run's stage costs, the machine's load, and where the bench cuts its model."""
from __future__ import annotations

import copy
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.measure import Timings, interleaved_medians
from helpers.sizing.ledger import MemoryLedger, ledger_for
from helpers.models import StackConfig, SyntheticTokens, build_stack, lm_loss
from helpers.pipeline.schedules import LAYOUTS, chunks_of, layout_for
from helpers.pipeline.stages import split_model
from helpers.pipeline.threaded import ThreadedPipeline, stage_devices
from helpers.timeline import Event, Recorder, busy_fraction, median_span_s, phase_seconds

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def one_device_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = lm_loss,
                    optimizer: torch.optim.Optimizer | None = None, rec: Recorder | None = None,
                    ledger: MemoryLedger | None = None) -> Callable[[], None]:
    """A closure running one training step of `model` on its own device: the baseline every ratio is taken to. Its
    forward counts what autograd saves in a memory ledger (`ledger`, or one of its own), as every pipeline's does:
    the same bookkeeping on both sides of a speed-up. With `rec`, each step's forward and backward are its spans."""
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    counted = ledger or ledger_for([model], ["device"], optimizer)

    def span(kind: str):
        return rec.span(kind, 0) if rec is not None else nullcontext()

    def step() -> None:
        if rec is not None:
            rec.clear()
        model.zero_grad(set_to_none=False)
        with span("forward"), counted.track_activations("device"):
            loss = loss_fn(model(x), y)
        with span("backward"):
            loss.backward()
        if optimizer is not None:
            optimizer.step()

    return step


def model_and_batch(cfg: StackConfig, batch: int, device) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """`cfg`'s block stack and the first `batch` samples of its synthetic tokens, all on `device`: what every
    timing of the bench (its rows, the calibration, the profiles, the extras) runs."""
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    return build_stack(cfg).to(device), x.to(device), y.to(device)


@dataclass
class PipelineRun:
    """A pipeline ready to time: the model split at `boundaries`, its memory ledger and its timeline."""

    name: str
    pipeline: ThreadedPipeline
    ledger: MemoryLedger
    boundaries: tuple[int, ...]
    optimizer: torch.optim.Optimizer | None = None
    events: list[Event] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # each timed step's `phase_seconds`

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        loss = self.pipeline.step(x, y)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss


def make_pipeline_run(name: str, model: nn.Module, boundaries: Sequence[int], devices: Sequence[torch.device],
                      labels: Sequence[str], schedule: str = "gpipe", microbatches: int = 4,
                      lr: float = 0.0, wire: str = "fp32", optimizer: str = "sgd") -> PipelineRun:
    """Copy `model`, split it at `boundaries` over `devices`, and wire a ledger and an optimizer (SGD with lr=0
    keeps the weights fixed so that every repeat times the same computation; "adam" for Adam at `lr`)."""
    layout = layout_for(schedule, (len(boundaries) + 1) // chunks_of(schedule))
    split = split_model(copy.deepcopy(model), list(boundaries), stage_devices(devices, layout))
    per_device = [nn.ModuleList(split.stages[k] for k in layout.stages_of(d)) for d in range(layout.devices)]
    ledger = ledger_for(per_device, labels[:layout.devices])
    pipe = ThreadedPipeline(split, schedule, microbatches, ledger, wire)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](split.parameters(), lr=lr)
    ledger.optimizer = opt
    return PipelineRun(name, pipe, ledger, tuple(boundaries), opt)


def time_pipeline_runs(runs: Sequence[PipelineRun], x: torch.Tensor, y: torch.Tensor, repeats: int = 5,
                       extra: dict[str, Callable[[], object]] | None = None, progress: bool = True,
                       after: dict[str, Callable[[], object]] | None = None) -> Timings:
    """Median step seconds of each run (and of any `extra` callables, `after` hooks as `interleaved_medians`'),
    timed in interleaved rounds, each run's timed steps' `phases` read from its timeline; then one recorded step per
    run fills its `events` and its ledger's activation peaks."""
    def fresh_step(r: PipelineRun) -> None:
        r.pipeline.clear_events()
        r.step(x, y)

    fns = {r.name: (lambda r=r: fresh_step(r)) for r in runs}
    reads = {r.name: (lambda r=r: r.phases.append(phase_seconds(r.pipeline.events()))) for r in runs}
    times = interleaved_medians({**(extra or {}), **fns}, repeats, progress=progress, after={**(after or {}), **reads})
    for r in runs:
        r.pipeline.clear_events()
        r.ledger.reset_peaks()
        r.step(x, y)
        r.events = r.pipeline.events()
    return times


def run_rows(runs: Sequence[PipelineRun], times: dict[str, float], batch: int,
             baseline: str | None = None) -> list[dict]:
    """One table row per run: step time, samples/s, speed-up vs `baseline`, busy and memory per device. Where
    `times` kept its samples (a `Timings`), also the spread, and the speed-up paired round by round (a slow minute
    then slows both sides of each ratio); else the ratio of the two medians."""
    rows, timed = [], isinstance(times, Timings)
    for r in runs:
        busy = busy_fraction(r.events)
        report = r.ledger.report()
        speedup = baseline and (times.paired_ratio(baseline, r.name) if timed else times[baseline] / times[r.name])
        rows.append({"split": r.name, "boundaries": list(r.boundaries), "step (ms)": times[r.name] * 1e3,
                     "samples/s": batch / times[r.name], **({"spread": times.spread(r.name)} if timed else {}),
                     **({"speedup": speedup} if baseline else {}),
                     "busy": [round(busy.get(i, 0.0), 2) for i in range(len(report))],
                     "params": [m.params for m in report.values()],
                     "activations": [m.activations for m in report.values()]})
    return rows


def stage_costs_per_microbatch(events: Sequence[Event]) -> dict[int, float]:
    """Median forward + median backward duration per micro-batch, per device, from a run's own timeline."""
    return {dev: median_span_s(events, dev, "forward") + median_span_s(events, dev, "backward")
            for dev in sorted({e.device for e in events})}


class MachineLoad:
    """CPU time other processes used while the bench ran (Linux: /proc/stat minus this process and its children):
    on a shared machine they slow some measurements and not others, and the predictions' errors say so."""

    def __init__(self):
        self.t0, self.busy0, self.mine0 = time.perf_counter(), self._busy(), self._mine()
        self.cores = os.cpu_count() or 1
        self.elapsed = self.foreign = None

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _mine() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def stop(self) -> None:
        self.elapsed = time.perf_counter() - self.t0
        busy = self._busy()
        if busy is not None and self.busy0 is not None:
            self.foreign = max(0.0, (busy - self.busy0) - (self._mine() - self.mine0))

    @property
    def share(self) -> float | None:
        return self.foreign / (self.elapsed * self.cores) if self.foreign is not None and self.elapsed else None

    def record(self) -> dict:
        return {"seconds": self.elapsed, "other_processes_cpu_s": self.foreign, "cores": self.cores,
                "share_of_machine": self.share}

    def describe(self) -> str:
        if self.share is None:
            return "machine load: not measured (needs /proc/stat)"
        line = (f"machine load: other processes used {self.foreign:.0f} CPU-s of the {self.elapsed * self.cores:.0f} "
                f"this run's {self.elapsed:.0f} s offered on {self.cores} cores ({self.share:.0%})")
        if self.share > 0.05:
            line += ("; they slowed some measurements and not others, so errors above a few percent may be theirs: "
                     "rerun on a quiet machine")
        return line


def training_curve(run: PipelineRun, data, steps: int, batch: int) -> list[float]:
    """Losses of `steps` optimizer steps of a pipeline run on consecutive batches of `data`."""
    losses = []
    for i in range(steps):
        x, y = data.batch(i, batch)
        losses.append(run.step(x, y).item())
    return losses


def bench_cut(schedule: str, n_layers: int) -> tuple[int, ...]:
    """Where the bench cuts its block stack (embedding, blocks, head) for `schedule` on two devices (any other row:
    as for one stage per device): in the middle for one stage per device; for two (interleaved, V-shaped), into four
    stages of equal block counts, the embedding with the first and the head with the last, so each device holds as
    many blocks whichever stages it gets."""
    stages = 2 * (chunks_of(schedule) if schedule in LAYOUTS else 1)
    if stages == 2:
        return (n_layers // 2,)
    blocks = n_layers - 2
    return tuple(1 + round(k * blocks / stages) for k in range(1, stages))
