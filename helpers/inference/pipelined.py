"""Pipelined generation: the layer split with one thread per device and several requests in flight.

Stage 0 computes request B's token while stage 1 computes request A's; each stage keeps a KV cache per request and
the tokens go from the last stage back to the first. On GPUs each stage computes on a CUDA stream of its own and
hands tensors over with `helpers.pipeline.comm.send_to` (a Transfer whose `get()` the receiver calls: the copy runs on
side streams and the receiver's stream waits for it); on the CPU rig nothing moves, and a thread is a virtual device
(its ops run on its own intra-op threads), so the concurrency is real. The stages, their KV caches and the result are
`helpers.inference.generate`'s (`LayerSplit`, `Generation`): this module adds only the threads and their queues.
"""
from __future__ import annotations

import queue
import time
from typing import Mapping, Sequence

import torch

from helpers.inference.generate import (Generation, LayerSplit, Request, StageSpec, Stopping, stopping_for,
                                        stages_from_device_map, sync_devices)
from helpers.models.hf import HFModel
from helpers.pipeline.comm import CopyStreams, send_to
from helpers.pipeline.threaded import run_on_device_threads

_STOP = object()  # down the pipe: no more work
_ABORT = object()  # to stage 0: another stage failed


class _Aborted(Exception):
    """A stage stops because another one failed (that one's error is reported)."""


def _get(box: queue.Queue, timeout_s: float):
    try:
        item = box.get(timeout=timeout_s)
    except queue.Empty:
        raise TimeoutError(f"no message within {timeout_s:.0f} s: a stage stopped answering") from None
    if item is _ABORT:
        raise _Aborted()
    return item


def _one_stage_per_device(specs: Sequence[StageSpec]) -> None:
    used = [s.device for s in specs]
    if len(specs) < 2 or len(set(used)) != len(used):
        raise ValueError(f"a pipeline needs one contiguous stage per device, at least two; this split runs "
                         f"{' -> '.join(f'device {d}' for d in used)} (a tied head placed with the embedding "
                         "brings device 0 back at the end): give cuts instead, e.g. stages_from_cuts(model, [k])")


class Pipelined(LayerSplit):
    """The layer split with one thread per stage and every request in flight (see the module's docstring). Each phase
    (all prefills, then all decode steps) runs as a pipeline over the requests; every stage sees the requests in the
    order stage 0 sent them, so each inbox is a plain FIFO queue.

    Needs one stage per device (a tied head placed with the embedding makes device 0 hold two stages: pass cuts).
    """

    name = "pipelined"

    def __init__(self, model: HFModel, stages: Sequence[StageSpec] | Mapping[str, int],
                 devices: Sequence[torch.device], timeout_s: float = 300.0):
        specs = stages_from_device_map(model, stages) if isinstance(stages, Mapping) else list(stages)
        _one_stage_per_device(specs)
        super().__init__(model, specs, devices)
        self._streams(timeout_s)

    @classmethod
    def from_split(cls, split: LayerSplit, timeout_s: float = 300.0) -> "Pipelined":
        """A pipeline over the very stages (weights) of a LayerSplit: no second copy of the model in memory."""
        _one_stage_per_device(split.specs)
        self = cls.__new__(cls)
        self.model, self.devices, self.specs, self.runners = split.model, split.devices, split.specs, split.runners
        self._streams(timeout_s)
        return self

    def _streams(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.compute = [torch.cuda.Stream(r.device) if r.device.type == "cuda" else None for r in self.runners]
        self.copies = CopyStreams() if any(d.type == "cuda" for d in self.devices) else None

    def _later_stage(self, s: int, requests: Sequence[Request], rule: Stopping, inboxes: list[queue.Queue],
                     feedback: queue.Queue) -> None:
        """Stages after the first: take (request, phase, transfer) from the inbox in order, compute, pass it on; the
        last stage picks the token and sends it back to stage 0, with whether the request is done."""
        runner, last = self.runners[s], s == len(self.runners) - 1
        first_device = self.runners[0].device
        finished: dict[int, torch.Tensor] = {}
        steps: dict[int, int] = {}
        while True:
            msg = _get(inboxes[s], self.timeout_s)
            if msg is _STOP:
                if not last:
                    inboxes[s + 1].put(_STOP)
                return
            r, phase, transfer = msg
            h = runner.step(r, transfer.get(), requests[r], phase)
            if not last:
                inboxes[s + 1].put((r, phase, send_to(h, self.runners[s + 1].device, self.copies)))
                continue
            if phase == "prefill":
                finished[r] = torch.zeros(requests[r].rows, dtype=torch.bool, device=runner.device)
                steps[r] = 0
            token, finished[r] = rule.next_token(h, finished[r])
            steps[r] += 1
            feedback.put((r, send_to(token, first_device, self.copies), rule.done(steps[r], finished[r])))

    def _first_stage(self, requests: Sequence[Request], inboxes: list[queue.Queue], feedback: queue.Queue,
                     out: dict) -> None:
        """Stage 0 drives: every prefill, then (once all first tokens are back: the prefill phase ends) a decode
        step for each request as soon as its previous token is back, until every request is done."""
        runner, nxt = self.runners[0], self.runners[1].device

        def send(r: int, x: torch.Tensor, phase: str) -> None:
            h = runner.step(r, x, requests[r], phase)
            inboxes[1].put((r, phase, send_to(h, nxt, self.copies)))

        tokens: dict[int, list] = {r: [] for r in range(len(requests))}
        t0 = time.perf_counter()
        for r, request in enumerate(requests):
            send(r, request.ids.to(runner.device), "prefill")
        replies, in_flight = [_get(feedback, self.timeout_s) for _ in requests], 0  # every first token
        sync_devices()
        t1 = time.perf_counter()
        while replies or in_flight:
            if not replies:
                replies.append(_get(feedback, self.timeout_s))
                in_flight -= 1
            r, token, done = replies.pop(0)
            tokens[r].append(token)
            if not done:
                send(r, token.get(), "decode")
                in_flight += 1
        inboxes[1].put(_STOP)
        out.update(tokens=tokens, t0=t0, t1=t1)

    def generate(self, requests: Sequence[Request], new_tokens: int, stopping: Stopping | None = None) -> Generation:
        rule = stopping or stopping_for(self.model, new_tokens)
        _ = self.model.config  # read config.json once, before the threads share it
        for runner in self.runners:
            runner.recorder.clear()
            runner.reset()
        p = len(self.runners)
        inboxes: list[queue.Queue] = [queue.Queue() for _ in range(p)]
        feedback: queue.Queue = queue.Queue()
        out: dict = {}

        def work(s: int) -> None:
            torch.set_grad_enabled(False)  # grad mode belongs to the thread
            if s == 0:
                self._first_stage(requests, inboxes, feedback, out)
            else:
                self._later_stage(s, requests, rule, inboxes, feedback)

        def abort() -> None:
            for box in (*inboxes, feedback):
                box.put(_ABORT)

        try:
            run_on_device_threads(work, [r.device for r in self.runners], self.compute, abort, _Aborted)
            sync_devices()
            t2 = time.perf_counter()
        finally:
            for runner in self.runners:
                runner.reset()
        tokens = [torch.cat([t.get() for t in out["tokens"][r]], dim=1).cpu() for r in range(len(requests))]
        return self._generation(requests, tokens, out["t1"] - out["t0"], t2 - out["t1"])
