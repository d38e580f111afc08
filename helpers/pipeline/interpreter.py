"""The one interpreter of pipeline schedules: every engine (threads in one process, one process per device) runs a
stage's action list with `run_stage`; engines differ only in their transport.

Communication follows the pattern of Megatron-LM, picotron and torch.distributed.pipelining: between two actions a
stage posts, *together*, the sends the previous action produced and the receives the next action needs
(`comm_plan`), then waits only for the receives. Sends stay in flight while the stage computes on. Posting sends and
receives of a step as one batch is what makes this safe on NCCL, where all point-to-point operations between two
ranks run in order on one stream: `check_p2p_plan` replays a schedule's plan under those rules and proves it can
neither deadlock nor deliver a tensor to the wrong receive, for any stage count and micro-batch count.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from helpers.pipeline.schedules import Action, Schedule
from helpers.pipeline.stages import StageExecutor


@dataclass(frozen=True)
class Message:
    """An activation (`act`, travels to the next stage) or a gradient (`grad`, to the previous stage)."""

    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def peer(self, stage: int, sending: bool) -> int:
        """The stage at the other end when `stage` sends (or receives) this message."""
        forward = self.kind == "act"
        return stage + 1 if forward == sending else stage - 1


def needs(action: Action, stage: int, p: int) -> list[Message]:
    """What `action` must receive before it runs on `stage` of `p`."""
    if action.kind == "F":
        return [Message("act", action.microbatch)] if stage > 0 else []
    return [Message("grad", action.microbatch)] if stage < p - 1 else []


def makes(action: Action, stage: int, p: int) -> list[Message]:
    """What `action` sends once it has run on `stage` of `p`."""
    if action.kind == "F":
        return [Message("act", action.microbatch)] if stage < p - 1 else []
    return [Message("grad", action.microbatch)] if stage > 0 else []


Exchange = tuple[list[Message], list[Message]]  # (sends, receives) posted together


def comm_plan(actions: Sequence[Action], stage: int, p: int) -> list[Exchange]:
    """The exchanges `stage` posts: before action k, the sends of action k-1 with the receives of action k; one
    last exchange after the final action. len(plan) == len(actions) + 1; empty exchanges are skipped at run time."""
    plan, pending = [], []
    for action in actions:
        plan.append((pending, needs(action, stage, p)))
        pending = makes(action, stage, p)
    plan.append((pending, []))
    return plan


def check_p2p_plan(schedule: Schedule) -> None:
    """Prove that running `schedule` with `run_stage` can neither deadlock on NCCL nor misdeliver a tensor."""
    p = len(schedule)
    check_exchanges([comm_plan(actions, s, p) for s, actions in enumerate(schedule)])


def check_exchanges(plans: Sequence[Sequence[Exchange]]) -> None:
    """Replay every stage's exchanges under NCCL's rules and raise if they could deadlock or mismatch.

    Rules: all operations a rank posts to its pipeline group run in posting order on one stream; one exchange is
    one group (its operations start together, and it ends when all of them have); the k-th send from a to b pairs
    with the k-th receive on b from a. A rank's compute never waits for a peer, only its exchanges do.
    """
    p = len(plans)
    plans = [[ex for ex in plan if ex[0] or ex[1]] for plan in plans]
    # ops[s][g] = [(peer, 'send'|'recv', message)] of exchange g on stage s
    ops = [[[(m.peer(s, True), "send", m) for m in sends] + [(m.peer(s, False), "recv", m) for m in recvs]
            for sends, recvs in plan] for s, plan in enumerate(plans)]
    order: dict[tuple[int, int, str], list[tuple[int, int, Message]]] = {}  # (a, b, dir) -> [(group, pos, msg)]
    for s, groups in enumerate(ops):
        for g, group in enumerate(groups):
            for i, (peer, direction, msg) in enumerate(group):
                key = (s, peer, "send") if direction == "send" else (peer, s, "recv")
                order.setdefault(key, []).append((g, i, msg))
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for (a, b, direction), items in order.items():
        if direction != "send":
            continue
        recvs = order.get((a, b, "recv"), [])
        if [str(m) for *_, m in items] != [str(m) for *_, m in recvs]:
            raise ValueError(f"stage {a} sends {[str(m) for *_, m in items]} to stage {b}, which receives "
                             f"{[str(m) for *_, m in recvs]}: tensors would land in the wrong receive")
        for (ga, ia, _), (gb, ib, _) in zip(items, recvs):
            partner[(a, ga, ia)] = (b, gb, ib)
            partner[(b, gb, ib)] = (a, ga, ia)
    head = [0] * p  # the exchange each stage is blocked in; an operation is matched once its partner's exchange has
    # started (is the head, or already finished: it could only finish after matching this one)
    while True:
        finished = [s for s in range(p) if head[s] < len(ops[s]) and all(
            head[partner[(s, head[s], i)][0]] >= partner[(s, head[s], i)][1] for i in range(len(ops[s][head[s]])))]
        if not finished:
            break
        for s in finished:
            head[s] += 1
    stuck = [f"stage {s} in exchange {[str(m) for _, _, m in ops[s][head[s]]]}" for s in range(p)
             if head[s] < len(ops[s])]
    if stuck:
        raise ValueError(f"the communication plan deadlocks on NCCL: {'; '.join(stuck)}")


class Transport(Protocol):
    """How a stage's messages travel: in-process mailboxes (threads) or torch.distributed point-to-point."""

    def exchange(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> list[torch.Tensor]:
        """Post the sends and receives together; return the received tensors (in `recvs` order) once they have
        arrived, in the compute dtype on this stage's device. Sends may still be in flight on return."""
        ...

    def flush(self) -> None:
        """Wait for every send still in flight (end of a step)."""
        ...


@dataclass(frozen=True)
class MicroBatch:
    """What one stage needs of one micro-batch besides what it receives: the token ids (first stage), the targets
    (last stage) and the per-micro-batch context every stage uses (masks, positions; None for the block stack)."""

    inputs: torch.Tensor | None
    targets: torch.Tensor | None
    context: object | None = None


def run_stage(ex: StageExecutor, actions: Sequence[Action], transport: Transport, microbatches: Sequence[MicroBatch],
              p: int, normalizer: float, loss_scale: float = 1.0) -> torch.Tensor | None:
    """Execute one stage's action list; return the stage's summed loss shares on the last stage, else None.

    `normalizer` is the kept-token count of the global batch: the last stage divides each micro-batch's summed loss
    by it, so the shares add up to one device's mean loss however the padding falls.
    """
    stage, last = ex.index, ex.index == p - 1
    plan = comm_plan(actions, stage, p)  # the plan check_p2p_plan proves safe is the plan that runs
    losses: list[torch.Tensor] = []
    outputs: dict[Message, torch.Tensor] = {}
    for action, (sends, recvs) in zip(actions, plan):
        got = transport.exchange([(m, outputs.pop(m)) for m in sends], recvs) if (sends or recvs) else []
        mb = microbatches[action.microbatch]
        if action.kind == "F":
            inp = got[0] if got else mb.inputs
            out = ex.forward(action.microbatch, inp, mb.targets if last else None, mb.context, normalizer)
            if last:
                losses.append(out.detach())
            else:
                outputs[Message("act", action.microbatch)] = out.detach()
        else:
            grad = ex.backward(action.microbatch, got[0] if got else None, loss_scale)
            if stage > 0:
                outputs[Message("grad", action.microbatch)] = grad
    final_sends = plan[-1][0]
    if final_sends:
        transport.exchange([(m, outputs.pop(m)) for m in final_sends], [])
    transport.flush()
    return torch.stack(losses).sum() if losses else None
