"""How a pipeline stage's messages travel (the `Transport` of helpers.pipeline.interpreter): between threads of one
process (`MailboxTransport`), or between processes (`P2PTransport`)."""
from __future__ import annotations

import threading
from typing import Sequence

import torch
import torch.distributed as dist

from helpers.pipeline.comm import CopyStreams, Transfer, Wire, send_to
from helpers.pipeline.interpreter import Message
from helpers.pipeline.schedules import Layout
from helpers.runtime.strict import plain_backend
from helpers.timeline import Recorder


class PipelineAborted(RuntimeError):
    """Another stage failed; this one stopped waiting."""


class Mailboxes:
    """Every device's incoming activations and gradients (transfers addressed by message: kind, micro-batch,
    boundary), handed from one device's thread to another, and the flag that stops all waits when a stage fails."""

    def __init__(self, p: int):
        self.abort = threading.Event()
        self._items: dict[int, dict[Message, Transfer]] = {d: {} for d in range(p)}
        self._cond = threading.Condition()

    def put(self, device: int, msg: Message, item: Transfer) -> None:
        with self._cond:
            self._items[device][msg] = item
            self._cond.notify_all()

    def get(self, device: int, msg: Message, timeout_s: float) -> Transfer:
        items = self._items[device]
        with self._cond:
            ok = self._cond.wait_for(lambda: msg in items or self.abort.is_set(), timeout_s)
            if self.abort.is_set():
                raise PipelineAborted("another stage failed")
            if not ok:
                raise TimeoutError(f"waited {timeout_s:.0f} s for {msg}")
            return items.pop(msg)

    def fail(self) -> None:
        with self._cond:
            self.abort.set()
            self._cond.notify_all()


class MailboxTransport:
    """Threads in one process: sends are non-blocking puts into the receiver's mailbox (on GPUs copied on side
    streams, `helpers.pipeline.comm.send_to`), receives wait on the mailbox (recorded as `recv`)."""

    def __init__(self, stage: int, boxes: Mailboxes, devices: Sequence[torch.device], wire: Wire,
                 recorder: Recorder, streams: CopyStreams | None, timeout_s: float, layout: Layout | None = None):
        self.stage, self.boxes, self.devices, self.wire = stage, boxes, devices, wire
        self.rec, self.streams, self.timeout_s = recorder, streams, timeout_s
        self.layout = layout  # which device holds each stage (None: one stage per device)

    def post(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> None:
        """Sends are puts into the receiver's mailbox; a receive needs no posting (`receive` waits on the mailbox)."""
        for msg, t in sends:
            dst = msg.peer(self.stage, True, self.layout)
            transfer = send_to(self.wire.pack(t), self.devices[dst], self.streams)
            transfer.dtype = t.dtype  # in one process the receiver restores exactly what the sender computed
            self.boxes.put(dst, msg, transfer)

    def receive(self, messages: list[Message]) -> list[torch.Tensor]:
        out = []
        for msg in messages:
            with self.rec.span("recv", msg.microbatch):
                transfer = self.boxes.get(self.stage, msg, self.timeout_s)
                arrived = transfer.get()
            out.append(self.wire.unpack(arrived, transfer.dtype))
        return out

    def flush(self) -> None:
        """Puts complete at once; copies finish on their streams, which the consumer waits for."""


def still_running(in_flight: list[tuple[object, object]]) -> list[tuple[object, object]]:
    """The (tensor, work) pairs whose work has not completed: `Work.is_completed` is a query, never a wait (NCCL's
    reads the work's CUDA event; NCCL itself keeps a sent tensor alive until then). Gloo's point-to-point works say
    completed only once waited, so on the CPU rig sent messages (host copies) are released at `flush`."""
    return [(t, w) for t, w in in_flight if not w.is_completed()]


class P2PTransport:
    """Processes: each exchange is one `batch_isend_irecv` on the pipeline group `group`, whose rank i is device i
    (holding the stages `layout` gives it; None: stage i). A receive is waited for when its tensor is asked for,
    which may be after later exchanges were posted (plans that post receives early).

    `shapes[b]` is the shape of what crosses boundary b (an activation forward, its gradient back), and `wire.compute`
    the dtype planned for the boundary (from the meta-device forward); a stage whose output has another dtype (an
    unexpected autocast result, say) is stopped with the reason, never rounded silently. Gloo carries CPU tensors
    only, so with gloo (the CPU rig, and two ranks sharing one GPU) messages are staged through host memory.
    With `overlap=False` every send is waited for before the stage computes on (recorded as `send`): the blocking
    baseline that notebook 04 compares with.
    """

    def __init__(self, group, stage: int, shapes: dict[int, tuple], wire: Wire, device: torch.device,
                 recorder: Recorder, overlap: bool = True, layout: Layout | None = None):
        self.group, self.stage, self.shapes, self.wire = group, stage, shapes, wire
        self.device, self.rec, self.overlap, self.layout = device, recorder, overlap, layout
        self.wire_device = torch.device("cpu") if plain_backend(group) == "gloo" else device
        self.in_flight: list[tuple[torch.Tensor, object]] = []  # (tensor, work): kept alive until its work completes
        self.posted: dict[Message, tuple[torch.Tensor, object]] = {}  # receives posted: (buffer, work)

    def _ops(self, sends, recvs) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
        ops, data, bufs = [], [], []
        for msg, t in sends:
            if t.is_floating_point() and t.dtype != self.wire.compute:
                raise ValueError(f"stage {self.stage} produced a {t.dtype} {msg.kind} but the boundary was planned "
                                 f"as {self.wire.compute} (from the model's dtype): every stage must compute in one "
                                 "dtype; give the model one dtype, or set the wire dtype explicitly")
            d = self.wire.pack(t.detach()).to(self.wire_device).contiguous()
            ops.append(dist.P2POp(dist.isend, d, group=self.group, group_peer=msg.peer(self.stage, True, self.layout)))
            data.append(d)
        for msg in recvs:
            b = torch.empty(self.shapes[msg.boundary], dtype=self.wire.carried, device=self.wire_device)
            ops.append(dist.P2POp(dist.irecv, b, group=self.group, group_peer=msg.peer(self.stage, False, self.layout)))
            bufs.append(b)
        return ops, data, bufs

    def release_sent(self) -> None:
        """Drop the sent tensors whose work has completed: kept to the end of the step, every micro-batch's message
        would stay allocated (about 512 MiB at notebook 06b's old GPU sizes), which no plan counted."""
        self.in_flight = still_running(self.in_flight)

    def post(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> None:
        self.release_sent()
        ops, data, bufs = self._ops(sends, recvs)
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # one work per operation (gloo): a receive waits for its own
            send_works, recv_works = works[:len(data)], works[len(data):]
        else:  # NCCL coalesces the batch into one work: waiting on it is a stream wait, not a host wait
            send_works, recv_works = ([], works * len(recvs)) if recvs else (works, [])
            if recvs:  # the sent tensors live until the batch is done
                self.in_flight.extend((data, w) for w in works)
        self.posted.update({m: (b, w) for m, b, w in zip(recvs, bufs, recv_works)})
        pending = list(zip(data, send_works)) if len(send_works) == len(data) else [(data, w) for w in send_works]
        if self.overlap:
            self.in_flight.extend(pending)
        elif pending:
            with self.rec.span("send", sends[0][0].microbatch):
                for _, w in pending:
                    w.wait()

    def receive(self, messages: list[Message]) -> list[torch.Tensor]:
        got = [self.posted.pop(m) for m in messages]
        with self.rec.span("recv", messages[0].microbatch):
            for _, w in got:
                w.wait()
        return [self.wire.unpack(b.to(self.device, non_blocking=False)) for b, _ in got]

    def flush(self) -> None:
        for _, work in self.in_flight:
            work.wait()
        self.in_flight.clear()
