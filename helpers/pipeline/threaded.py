"""The in-process pipeline engine: one thread per device runs its stage's action list with the shared interpreter,
stages hand tensors over through mailboxes (the graph cut at each boundary and gradients handed back, as torchgpipe
does).

A thread per device is a real device here: on CPU a virtual device is one thread with its own intra-op threads; on
GPUs each stage computes on a stream of its own (so on the one-GPU rig the two stages' kernels can interleave, and
their spans are measured on their own streams) and copies between GPUs run on side streams.
"""
from __future__ import annotations

import threading
from typing import Sequence

import torch

from helpers.memory import MemoryLedger
from helpers.models.data import kept_tokens
from helpers.pipeline.comm import CopyStreams, Wire
from helpers.pipeline.interpreter import MicroBatch, check_p2p_plan, run_stage
from helpers.pipeline.schedules import Schedule, make_schedule, validate
from helpers.pipeline.stages import SplitModel, StageExecutor, make_executors
from helpers.pipeline.transports import Mailboxes, MailboxTransport, PipelineAborted
from helpers.timeline import Event, Recorder


def split_batch(x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m equal micro-batches, or a clear error when the batch does not divide."""
    if m < 1:
        raise ValueError(f"the number of micro-batches must be at least 1, got {m}")
    if x.shape[0] % m:
        raise ValueError(f"global batch {x.shape[0]} is not divisible by {m} micro-batches")
    return list(x.chunk(m)), list(y.chunk(m))


def _compute_streams(executors: Sequence[StageExecutor]) -> list:
    """One CUDA stream per stage (None on CPU)."""
    return [torch.cuda.Stream(ex.device) if ex.device.type == "cuda" else None for ex in executors]


def run_schedule(executors: Sequence[StageExecutor], schedule: Schedule, microbatches: Sequence[MicroBatch],
                 normalizer: float, wire: Wire = Wire(), timeout_s: float = 300.0,
                 streams: tuple[list, CopyStreams] | None = None) -> torch.Tensor:
    """Run the action lists with one thread per stage; return the loss of the global batch."""
    p, m = len(executors), len(microbatches)
    if len(schedule) != p:
        raise ValueError(f"the schedule has {len(schedule)} stages but there are {p} stage executors")
    validate(schedule, m)
    boxes = Mailboxes(p)
    compute, copies = streams or ([None] * p, None)
    losses: list[torch.Tensor] = []
    errors: list[tuple[int, BaseException]] = []
    devices = [ex.device for ex in executors]

    def worker(s: int) -> None:
        ex = executors[s]
        transport = MailboxTransport(s, boxes, devices, wire, ex.recorder, copies, timeout_s)
        try:
            if compute[s] is not None:
                torch.cuda.set_device(ex.device)
                compute[s].wait_stream(torch.cuda.current_stream(ex.device))  # inputs and zeroed grads exist
                with torch.cuda.stream(compute[s]):
                    loss = run_stage(ex, schedule[s], transport, microbatches, p, normalizer)
            else:
                loss = run_stage(ex, schedule[s], transport, microbatches, p, normalizer)
            if loss is not None:
                losses.append(loss)
        except PipelineAborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append((s, exc))
            boxes.fail()

    threads = [threading.Thread(target=worker, args=(s,), name=f"stage{s}", daemon=True) for s in range(p)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        s, exc = errors[0]
        raise RuntimeError(f"stage {s} failed: {type(exc).__name__}: {exc}") from exc
    for ex, stream in zip(executors, compute):
        if stream is not None:  # the caller's stream (optimizer step, next zero_grad) waits for the stages
            torch.cuda.current_stream(ex.device).wait_stream(stream)
    return losses[0]


class ThreadedPipeline:
    """A split model trained with a pipeline schedule, one thread per device, in this process."""

    def __init__(self, split: SplitModel, schedule: str = "gpipe", microbatches: int = 4,
                 ledger: MemoryLedger | None = None, wire: Wire | str = "fp32"):
        self.split, self.schedule_name, self.m = split, schedule, microbatches
        self.wire = wire if isinstance(wire, Wire) else Wire.of(wire)  # refuses unsendable dtypes up front
        p = len(split.stages)
        self.schedule = make_schedule(schedule, p, microbatches)  # refuses m < p for 1F1B, before any thread
        check_p2p_plan(self.schedule)
        self.recorders = [Recorder(i, d) for i, d in enumerate(split.devices)]
        self.executors = make_executors(split, self.recorders, ledger.trackers() if ledger else None)
        self.streams = None
        if any(d.type == "cuda" for d in split.devices):
            self.streams = (_compute_streams(self.executors), CopyStreams())

    def step(self, x: torch.Tensor, y: torch.Tensor, context: object | None = None) -> torch.Tensor:
        """Forward and backward of one global batch; gradients accumulate in the stages' parameters. Returns the
        batch's loss: each micro-batch's summed token loss over the kept tokens of the whole batch."""
        xs, ys = split_batch(x, y, self.m)
        mbs = [MicroBatch(xi, yi, context) for xi, yi in zip(xs, ys)]
        return run_schedule(self.executors, self.schedule, mbs, kept_tokens(y), self.wire, streams=self.streams)

    def events(self) -> list[Event]:
        return [e for r in self.recorders for e in r.events()]

    def clear_events(self) -> None:
        for r in self.recorders:
            r.clear()
