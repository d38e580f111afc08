"""The in-process pipeline engine: one thread per device runs its stage's action list with the shared interpreter,
stages hand tensors over through mailboxes (the graph cut at each boundary and gradients handed back, as torchgpipe
does).

A thread per device is a real device here: on CPU a virtual device is one thread with its own intra-op threads; on
GPUs each stage computes on a stream of its own (so on the one-GPU rig the two stages' kernels can interleave, and
their spans are measured on their own streams) and copies between GPUs run on side streams.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Callable, Sequence

import torch

from helpers.sizing.ledger import MemoryLedger
from helpers.models.data import kept_tokens
from helpers.models.layered import with_seed
from helpers.pipeline.comm import CopyStreams, Wire
from helpers.pipeline.interpreter import Exchange, MicroBatch, communication_plan, run_stage
from helpers.pipeline.schedules import Layout, chunks_of, layout_of, make_schedule, validate, weights_in_groups
from helpers.pipeline.stages import SplitModel, StageExecutor, make_executors
from helpers.pipeline.transports import Mailboxes, MailboxTransport, PipelineAborted
from helpers.precision import Precision
from helpers.runtime.rig import device_thread
from helpers.timeline import Event, Recorder

ContextFn = Callable[[torch.Tensor, "torch.Tensor | None"], object]


def split_batch(x: torch.Tensor, y: torch.Tensor, m: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """m equal micro-batches, or a clear error when the batch does not divide."""
    if m < 1:
        raise ValueError(f"the number of micro-batches must be at least 1, got {m}")
    if x.shape[0] % m:
        raise ValueError(f"global batch {x.shape[0]} is not divisible by {m} micro-batches")
    return list(x.chunk(m)), list(y.chunk(m))


def stage_devices(devices: Sequence[torch.device], layout: Layout) -> list[torch.device]:
    """The device of each stage of `layout` (what `split_model` takes when a device holds several stages)."""
    if len(devices) < layout.devices:
        raise ValueError(f"the schedule runs on {layout.devices} devices but {len(devices)} were given")
    return [devices[layout.device_of(k)] for k in range(layout.stages)]


def check_one_dtype(split: SplitModel) -> torch.dtype:
    """Every stage must hold weights of one floating dtype (a boundary cannot be bf16 on one side and fp32 on the
    other); returns it."""
    per_stage = [sorted({str(p.dtype) for p in stage.parameters() if p.is_floating_point()}) for stage in split.stages]
    if len({d for dtypes in per_stage for d in dtypes}) > 1:
        where = "; ".join(f"stage {i}: {', '.join(d)}" for i, d in enumerate(per_stage))
        raise ValueError(f"the stages hold weights of different dtypes ({where}): convert the whole model to one "
                         "dtype before splitting it (for mixed precision use autocast, which keeps fp32 weights)")
    return next((p.dtype for p in split.parameters() if p.is_floating_point()), torch.float32)


def run_on_device_threads(work: Callable[[int], None], devices: Sequence[torch.device], streams: Sequence | None,
                          abort: Callable[[], None], aborted: type[BaseException]) -> None:
    """`work(i)` in one thread per device, each thread that virtual device (`device_thread`) and, on a GPU, computing
    on its stream `streams[i]` once what the caller queued is done; the caller's streams then wait for them. A failure
    calls `abort()`, so that the others stop waiting (they raise `aborted`, ignored), and is raised here."""
    streams = streams or [None] * len(devices)
    # the caller's streams, read in the caller's thread: a stream is current per thread, so a worker asking for the
    # current stream would get its own thread's default stream, not the one the caller made the inputs on
    callers = [torch.cuda.current_stream(d) if stream is not None else None for d, stream in zip(devices, streams)]
    errors: list[tuple[int, BaseException]] = []

    def worker(i: int) -> None:
        try:
            if streams[i] is not None:
                torch.cuda.set_device(devices[i])
                streams[i].wait_stream(callers[i])  # the inputs (and zeroed grads) exist
            with torch.cuda.stream(streams[i]) if streams[i] is not None else nullcontext():
                work(i)
        except aborted:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported to the caller below
            errors.append((i, exc))
            abort()

    n = len(devices)
    threads = [threading.Thread(target=device_thread(lambda i=i: worker(i), devices[i], i, n), name=f"stage{i}",
                                daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        i, exc = errors[0]
        raise RuntimeError(f"stage {i} failed: {type(exc).__name__}: {exc}") from exc
    for caller, stream in zip(callers, streams):
        if stream is not None:  # the caller's stream (optimizer step, next zero_grad) waits for the stages
            caller.wait_stream(stream)


def run_schedule(executors: Sequence[StageExecutor], schedule: Sequence[Sequence], microbatches: Sequence[MicroBatch],
                 normalizer: float, wire: Wire = Wire(), timeout_s: float = 300.0,
                 streams: tuple[list, CopyStreams] | None = None, loss_scale: float = 1.0,
                 plan: list[list[Exchange]] | None = None, batched_weights: bool = False) -> torch.Tensor:
    """Run the action lists with one thread per device (holding one executor per stage of the schedule's layout);
    return the loss of the global batch. `plan`: the schedule's `communication_plan`, if already made;
    `batched_weights`: weight passes back to back run as one (`run_stage`)."""
    layout, m = layout_of(schedule), len(microbatches)
    if len(executors) != layout.stages:
        raise ValueError(f"the schedule has {layout.stages} stages but there are {len(executors)} stage executors")
    validate(schedule, m)
    plan = plan or communication_plan(schedule)
    boxes = Mailboxes(layout.devices)
    compute, copies = streams or (None, None)
    losses: list[torch.Tensor] = []
    mine = [[executors[k] for k in layout.stages_of(d)] for d in range(layout.devices)]
    devices = [chunks[0].device for chunks in mine]

    def stage(s: int) -> None:
        transport = MailboxTransport(s, boxes, devices, wire, mine[s][0].recorder, copies, timeout_s, layout)
        loss = run_stage(mine[s], schedule[s], transport, microbatches, layout, normalizer, loss_scale, plan[s],
                         batched_weights)
        if loss is not None:
            losses.append(loss)

    run_on_device_threads(stage, devices, compute, boxes.fail, PipelineAborted)
    return losses[0]


class ThreadedPipeline:
    """A split model trained with a pipeline schedule, one thread per device, in this process.

    `context` computes what every stage needs besides the hidden state for a micro-batch (masks and positions of a
    Hugging Face model: `HFModel.context` or `hf_layers(model).context`); the block stack needs none.

    Schedules that put several stages on a device (interleaved, zbv: `chunks_of(schedule)` stages each) take a
    split of devices x chunks stages, stage k on `stage_devices(devices, layout)[k]`; `ledger` then has one label
    per device.
    """

    def __init__(self, split: SplitModel, schedule: str = "gpipe", microbatches: int = 4,
                 ledger: MemoryLedger | None = None, wire: Wire | str = "auto", precision: Precision = Precision(),
                 context: ContextFn | None = None, batched_weights: int = 1):
        self.split, self.schedule_name, self.m, self.context = split, schedule, microbatches, context
        self.batched_weights = batched_weights  # weight passes this many micro-batches at a time (weights_in_groups)
        dtype = check_one_dtype(split)
        self.wire = wire if isinstance(wire, Wire) else Wire.of(wire, compute=dtype)  # refuses unsendable dtypes
        stages, chunks = len(split.stages), chunks_of(schedule)
        if stages % chunks:
            raise ValueError(f"{schedule} runs {chunks} stages per device: split the model into a multiple of {chunks} "
                             f"stages (devices x {chunks}), not {stages}")
        self.schedule = weights_in_groups(make_schedule(schedule, stages // chunks, microbatches), batched_weights)
        self.plan = communication_plan(self.schedule)  # proven safe on NCCL, or refused
        layout = layout_of(self.schedule)
        devices = [split.devices[layout.stage(d)] for d in range(layout.devices)]
        if stage_devices(devices, layout) != list(split.devices):
            raise ValueError(f"{schedule} runs stages 0..{stages - 1} on devices "
                             f"{[layout.device_of(k) for k in range(stages)]}: split the model over "
                             "helpers.pipeline.threaded.stage_devices(devices, layout)")
        self.recorders = [Recorder(i, d) for i, d in enumerate(devices)]
        tracks = [ledger.trackers()[layout.device_of(k)] for k in range(stages)] if ledger else None
        self.executors = make_executors(split, [self.recorders[layout.device_of(k)] for k in range(stages)], tracks,
                                        precision)
        self.streams = None
        if any(d.type == "cuda" for d in devices):
            self.streams = ([torch.cuda.Stream(d) if d.type == "cuda" else None for d in devices], CopyStreams())

    def microbatches(self, x: torch.Tensor, y: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     seeds: Sequence[int] | None = None) -> list[MicroBatch]:
        """The global batch cut into micro-batches, each with its context (and dropout seed, if given)."""
        xs, ys = split_batch(x, y, self.m)
        masks = list(attention_mask.chunk(self.m)) if attention_mask is not None else [None] * self.m
        contexts = [self.context(xi, mi) if self.context else None for xi, mi in zip(xs, masks)]
        if seeds is not None:
            contexts = [with_seed(c, seed) for c, seed in zip(contexts, seeds)]
        return [MicroBatch(xi, yi, c) for xi, yi, c in zip(xs, ys, contexts)]

    def step(self, x: torch.Tensor, y: torch.Tensor, attention_mask: torch.Tensor | None = None,
             loss_scale: float = 1.0, seeds: Sequence[int] | None = None) -> torch.Tensor:
        """Forward and backward of one global batch; gradients accumulate in the stages' parameters (tied copies
        summed). Returns the batch's loss: each micro-batch's summed token loss over the kept tokens of the whole
        batch, exactly one device's mean whatever the padding. `loss_scale`: a gradient scaler's factor; `seeds`:
        one dropout seed per micro-batch (models with dropout)."""
        mbs = self.microbatches(x, y, attention_mask, seeds)
        loss = run_schedule(self.executors, self.schedule, mbs, kept_tokens(y), self.wire, streams=self.streams,
                            loss_scale=loss_scale, plan=self.plan, batched_weights=self.batched_weights > 1)
        self.split.sync_tied_grads()
        return loss

    def events(self) -> list[Event]:
        return [e for r in self.recorders for e in r.events()]

    def clear_events(self) -> None:
        for r in self.recorders:
            r.clear()
