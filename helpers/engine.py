"""Pipeline engines: execute a schedule's action lists, one worker per device, and record the timeline.

`ThreadedPipeline` runs in the notebook's own process: one thread per device (a CUDA device, or a CPU virtual
device limited to one intra-op thread), the graph cut at each stage boundary and gradients handed back, as
torchgpipe does. The multi-process engine (one rank per device, send/recv) lives in `helpers.mp_engine`.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from helpers.pipeline.comm import Transfer, Wire, send_to
from helpers.memory import MemoryLedger
from helpers.pipeline.schedules import Action, Schedule, make_schedule, validate
from helpers.pipeline.stages import LossFn, SplitModel, StageExecutor, make_executors
from helpers.timeline import Event, Recorder


class PipelineAborted(RuntimeError):
    """Another stage failed; this one stopped waiting."""


class Mailbox:
    """Transfers addressed by micro-batch, handed from one stage thread to another."""

    def __init__(self, abort: threading.Event):
        self._items: dict[int, Transfer] = {}
        self._cond = threading.Condition()
        self._abort = abort

    def put(self, mb: int, item: Transfer) -> None:
        with self._cond:
            self._items[mb] = item
            self._cond.notify_all()

    def get(self, mb: int, timeout_s: float) -> Transfer:
        with self._cond:
            ok = self._cond.wait_for(lambda: mb in self._items or self._abort.is_set(), timeout_s)
            if self._abort.is_set():
                raise PipelineAborted("another stage failed")
            if not ok:
                raise TimeoutError(f"waited {timeout_s:.0f} s for micro-batch {mb}")
            return self._items.pop(mb)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()


def split_batch(x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m equal micro-batches, or a clear error when the batch does not divide."""
    if m < 1:
        raise ValueError(f"the number of micro-batches must be at least 1, got {m}")
    if x.shape[0] % m:
        raise ValueError(f"global batch {x.shape[0]} is not divisible by {m} micro-batches")
    return list(x.chunk(m)), list(y.chunk(m))


def run_schedule(executors: Sequence[StageExecutor], schedule: Schedule, xs: list[torch.Tensor],
                 ys: list[torch.Tensor], wire: Wire = Wire(), timeout_s: float = 300.0) -> torch.Tensor:
    """Run the action lists with one thread per stage; return the mean loss over micro-batches.

    Activations and gradients cross each boundary in `wire.dtype` and are cast back on arrival.
    """
    p, m = len(executors), len(xs)
    if len(schedule) != p:
        raise ValueError(f"the schedule has {len(schedule)} stages but there are {p} stage executors")
    validate(schedule, m)
    abort = threading.Event()
    acts = [Mailbox(abort) for _ in range(p)]  # acts[s]: activations arriving at stage s
    grads = [Mailbox(abort) for _ in range(p)]  # grads[s]: gradients arriving at stage s
    losses: dict[int, torch.Tensor] = {}
    errors: list[tuple[int, BaseException]] = []
    streams: dict = {}  # CUDA side streams for copies, one per sending device

    def do(s: int, action: Action) -> None:
        ex, mb, last = executors[s], action.microbatch, s == p - 1
        if action.kind == "F":
            inp = xs[mb] if s == 0 else wire.unpack(acts[s].get(mb, timeout_s).get())
            out = ex.forward(mb, inp, ys[mb] if last else None)
            if last:
                losses[mb] = out.detach()
            else:
                acts[s + 1].put(mb, send_to(wire.pack(out.detach()), executors[s + 1].device, streams))
        else:
            grad = None if last else wire.unpack(grads[s].get(mb, timeout_s).get())
            g = ex.backward(mb, grad, loss_scale=1.0 / m)
            if s > 0:
                grads[s - 1].put(mb, send_to(wire.pack(g), executors[s - 1].device, streams))

    def worker(s: int) -> None:
        device = executors[s].device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            for action in schedule[s]:
                do(s, action)
        except PipelineAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append((s, exc))
            abort.set()
            for box in acts + grads:
                box.wake()

    threads = [threading.Thread(target=worker, args=(s,), name=f"stage{s}", daemon=True) for s in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        s, exc = errors[0]
        raise RuntimeError(f"stage {s} failed: {type(exc).__name__}: {exc}") from exc
    return torch.stack([losses[i].to(executors[-1].device) for i in range(m)]).mean()


class ThreadedPipeline:
    """A split model trained with a pipeline schedule, one thread per device, in this process."""

    def __init__(self, split: SplitModel, loss_fn: LossFn, schedule: str = "gpipe", microbatches: int = 4,
                 ledger: MemoryLedger | None = None, wire: Wire | str = "fp32"):
        self.split, self.schedule_name, self.m = split, schedule, microbatches
        self.wire = wire if isinstance(wire, Wire) else Wire.of(wire)  # refuses unsendable dtypes up front
        p = len(split.stages)
        self.schedule = make_schedule(schedule, p, microbatches)  # refuses m < p for 1F1B, before any thread
        self.recorders = [Recorder(i, d) for i, d in enumerate(split.devices)]
        self.executors = make_executors(split, loss_fn, self.recorders, ledger.trackers() if ledger else None)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one global batch; gradients accumulate in the stages' parameters."""
        xs, ys = split_batch(x, y, self.m)
        return run_schedule(self.executors, self.schedule, xs, ys, self.wire)

    def events(self) -> list[Event]:
        return [e for r in self.recorders for e in r.events()]

    def clear_events(self) -> None:
        for r in self.recorders:
            r.clear()
