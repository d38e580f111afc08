"""Measure strategies side by side in one run: medians of interleaved repeats, ratios within the run.

The building blocks here serve the notebooks; `python -m helpers.bench` (see `main`) runs every strategy.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.engine import ThreadedPipeline
from helpers.measure import interleaved_medians
from helpers.memory import MemoryLedger, ledger_for
from helpers.stages import LossFn, split_model
from helpers.timeline import Event, busy_fraction


@dataclass
class PipelineRun:
    """A pipeline ready to time: the model split at `boundaries`, its memory ledger and its timeline."""

    name: str
    pipeline: ThreadedPipeline
    ledger: MemoryLedger
    boundaries: tuple[int, ...]
    optimizer: torch.optim.Optimizer | None = None
    events: list[Event] = field(default_factory=list)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        loss = self.pipeline.step(x, y)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss


def make_pipeline_run(name: str, model: nn.Module, boundaries: Sequence[int], devices: Sequence[torch.device],
                      labels: Sequence[str], loss_fn: LossFn, schedule: str = "gpipe", microbatches: int = 4,
                      lr: float = 0.0) -> PipelineRun:
    """Copy `model`, split it at `boundaries` over `devices`, and wire a ledger and an SGD optimizer (lr=0 keeps
    the weights fixed so that every repeat times the same computation)."""
    split = split_model(copy.deepcopy(model), list(boundaries), devices)
    ledger = ledger_for(split.stages, labels[:len(split.stages)])
    pipe = ThreadedPipeline(split, loss_fn, schedule, microbatches, ledger)
    return PipelineRun(name, pipe, ledger, tuple(boundaries), torch.optim.SGD(split.parameters(), lr=lr))


def time_pipeline_runs(runs: Sequence[PipelineRun], x: torch.Tensor, y: torch.Tensor, repeats: int = 5,
                       extra: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Median step seconds of each run (and of any `extra` callables), timed in interleaved rounds; then one
    recorded step per run fills its `events` and its ledger's activation peaks."""
    fns = {r.name: (lambda r=r: r.step(x, y)) for r in runs}
    times = interleaved_medians({**(extra or {}), **fns}, repeats, progress=True)
    for r in runs:
        r.pipeline.clear_events()
        r.ledger.reset_peaks()
        r.step(x, y)
        r.events = r.pipeline.events()
    return times


def run_rows(runs: Sequence[PipelineRun], times: dict[str, float], batch: int,
             baseline: str | None = None) -> list[dict]:
    """One table row per run: step time, samples/s, speed-up vs `baseline`, busy and memory per device."""
    rows = []
    for r in runs:
        busy = busy_fraction(r.events)
        report = r.ledger.report()
        rows.append({"split": r.name, "boundaries": list(r.boundaries), "step (ms)": times[r.name] * 1e3,
                     "samples/s": batch / times[r.name],
                     **({"speedup": times[baseline] / times[r.name]} if baseline else {}),
                     "busy": [round(busy.get(i, 0.0), 2) for i in range(len(report))],
                     "params": [m.params for m in report.values()],
                     "activations": [m.activations for m in report.values()]})
    return rows
