"""The one interpreter of pipeline schedules: every engine (threads in one process, one process per device) runs a
stage's action list with `run_stage`; engines differ only in their transport.

Communication follows the pattern of Megatron-LM, picotron and torch.distributed.pipelining: between two actions a
stage posts, *together*, the sends the previous action produced and the receives the next action needs
(`comm_plan`), then waits only for the receives. Sends stay in flight while the stage computes on. Posting sends and
receives of a step as one batch is what makes this safe on NCCL, where all point-to-point operations between two
ranks run in order on one stream: `check_p2p_plan` replays a schedule's plan under those rules and proves it can
neither deadlock nor deliver a tensor to the wrong receive, for any stage count and micro-batch count.

A device may run several stages (interleaved and V-shaped schedules): what one of its stages hands to another never
goes over the wire. For those schedules the plan above can deadlock (both devices sending, each send waiting for a
receive queued behind the other's send); `communication_plan` then posts each receive as soon as its sender has
produced the message, and the action that needs it waits for it (`early_receive_plans`, torch's rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from helpers.pipeline.schedules import Action, Layout, as_layout, layout_of, replay, split_backwards, weight_groups
from helpers.pipeline.stages import StageExecutor


@dataclass(frozen=True)
class Message:
    """An activation (`act`, travels to the next stage) or a gradient (`grad`, to the previous stage) of one
    micro-batch across `boundary` b, the cut between stages b and b+1 (None in a hand-written plan of one stage
    per device: the boundary next to the device)."""

    kind: str
    microbatch: int
    boundary: int | None = None

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"@{self.boundary}" if self.boundary is not None else "")

    def peer(self, device: int, sending: bool, layout: Layout | None = None) -> int:
        """The device at the other end when `device` sends (or receives) this message."""
        forward = self.kind == "act"
        if self.boundary is None:
            return device + 1 if forward == sending else device - 1
        layout = layout or Layout(self.boundary + 2)
        above, below = layout.device_of(self.boundary), layout.device_of(self.boundary + 1)
        return below if forward == sending else above


def needs(action: Action, device: int, p: int | Layout, arriving: bool = True) -> list[Message]:
    """What `action` must receive before it runs on `device` (of `p` devices, or a `Layout`): from another
    device or, between two chunks of this one, from itself. A weight pass needs nothing. `arriving=False`: what
    it hands on once it has run (`makes`)."""
    layout = as_layout(p)
    stage = layout.stage(device, action.chunk)
    if action.kind == "W":
        return []
    forward = action.kind == "F"
    boundary = stage - 1 if forward == arriving else stage  # activations cross from the stage before, gradients back
    return [Message("act" if forward else "grad", action.microbatch, boundary)] \
        if 0 <= boundary < layout.stages - 1 else []


def makes(action: Action, device: int, p: int | Layout) -> list[Message]:
    """What `action` hands on once it has run on `device`."""
    return needs(action, device, p, arriving=False)


def on_wire(message: Message, device: int, layout: Layout, sending: bool) -> bool:
    """Whether `message` leaves (arrives at) `device` over the link: between two chunks of one device it does not."""
    return message.peer(device, sending, layout) != device


Exchange = tuple  # (sends, receives) posted together; or (sends, receives, waits) when the next action waits for
# other messages than the receives posted with it (posted earlier, see `early_receive_plans`)


def comm_plan(actions: Sequence[Action], stage: int, p: int | Layout) -> list[Exchange]:
    """The exchanges device `stage` posts: before action k, the sends of action k-1 with the receives of action
    k; one last exchange after the final action. len(plan) == len(actions) + 1; empty exchanges are skipped at run
    time. Messages between two chunks of the device stay off the wire and out of the plan."""
    layout = as_layout(p)
    plan, pending = [], []
    for action in actions:
        plan.append((pending, _wire(needs(action, stage, layout), stage, layout, False)))
        pending = _wire(makes(action, stage, layout), stage, layout, True)
    plan.append((pending, []))
    return plan


def _wire(messages: list[Message], device: int, layout: Layout, sending: bool) -> list[Message]:
    return [m for m in messages if on_wire(m, device, layout, sending)]


def early_receive_plans(schedule: Sequence[Sequence[Action]]) -> list[list[Exchange]]:
    """Every device's exchanges when each receive is posted as soon as its sender has produced the message (the
    rule of torch.distributed.pipelining's `_add_send_recv`), and waited for only by the action that needs it.

    Built by running the schedule in rounds, one action per device per round, devices in order: once a device runs
    an action, its sends go into the exchange before its next action, and each receiver posts the receive in the
    exchange before *its* next action, which may be several actions before the one that uses it."""
    layout = layout_of(schedule)
    p = len(schedule)
    plans: list[list[Exchange]] = [[([], [], []) for _ in range(len(actions) + 1)] for actions in schedule]
    posted: list[set[Message]] = [set() for _ in range(p)]

    def runs(d: int, action: Action, position: list[int]) -> bool:
        waits = _wire(needs(action, d, layout), d, layout, False)
        if not all(m in posted[d] for m in waits):
            return False
        plans[d][position[d]][2].extend(waits)
        for m in _wire(makes(action, d, layout), d, layout, True):
            plans[d][position[d] + 1][0].append(m)
            receiver = m.peer(d, True, layout)
            plans[receiver][position[receiver]][1].append(m)
            posted[receiver].add(m)
        return True

    replay(schedule, runs)
    return plans


def communication_plan(schedule: Sequence[Sequence[Action]]) -> list[list[Exchange]]:
    """The exchanges every device of `schedule` posts, proven safe on NCCL (`check_exchanges`): `comm_plan`'s
    rule (Megatron-LM's: the previous action's sends with the next action's receives) where it is safe, as for
    GPipe, 1F1B and ZB-H1; where it is not, as for interleaved 1F1B and the V shape, whose devices can both be
    sending while the matching receives wait behind those sends, receives posted early (`early_receive_plans`)."""
    layout = layout_of(schedule)
    plans = [comm_plan(actions, d, layout) for d, actions in enumerate(schedule)]
    try:
        check_exchanges(plans, layout)
        return plans
    except ValueError as simple_failed:
        plans = early_receive_plans(schedule)
        try:
            check_exchanges(plans, layout)
        except ValueError as err:
            raise ValueError(f"{simple_failed}; with receives posted early: {err}") from None
        return plans


def check_p2p_plan(schedule: Sequence[Sequence[Action]]) -> None:
    """Prove that running `schedule` with `run_stage` can neither deadlock on NCCL nor misdeliver a tensor."""
    communication_plan(schedule)


def check_exchanges(plans: Sequence[Sequence[Exchange]], layout: Layout | None = None) -> None:
    """Replay every device's exchanges under NCCL's rules and raise if they could deadlock or mismatch.

    Rules: all operations a rank posts to its pipeline group run in posting order on one stream; one exchange is
    one group (its operations start together, and it ends when all of them have); the k-th send from a to b pairs
    with the k-th receive on b from a. Exchange k is posted before action k (the last one after the last action);
    an action waits for the exchanges holding the receives it needs, so a rank's compute waits for a peer only
    through its receives, and an exchange waits for the ones posted before it.
    """
    p = len(plans)
    name = "stage" if layout is None or layout.chunks == 1 else "device"
    # ops[s][g] = [(peer, 'send'|'recv', message)] of exchange g on device s
    ops = [[[(m.peer(s, True, layout), "send", m) for m in ex[0]] + [(m.peer(s, False, layout), "recv", m)
                                                                       for m in ex[1]]
            for ex in plan] for s, plan in enumerate(plans)]
    order: dict[tuple[int, int, str], list[tuple[int, int, Message]]] = {}  # (a, b, dir) -> [(group, pos, msg)]
    for s, groups in enumerate(ops):
        for g, group in enumerate(groups):
            for i, (peer, direction, msg) in enumerate(group):
                key = (s, peer, "send") if direction == "send" else (peer, s, "recv")
                order.setdefault(key, []).append((g, i, msg))
    partner: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for (a, b, direction), items in order.items():
        recvs = order.get((a, b, "recv"), [])
        sends = order.get((a, b, "send"), [])
        if [str(m) for *_, m in sends] != [str(m) for *_, m in recvs]:
            raise ValueError(f"{name} {a} sends {[str(m) for *_, m in sends]} to {name} {b}, which receives "
                             f"{[str(m) for *_, m in recvs]}: tensors would land in the wrong receive")
        for (ga, ia, _), (gb, ib, _) in zip(sends, recvs):
            partner[(a, ga, ia)] = (b, gb, ib)
            partner[(b, gb, ib)] = (a, ga, ia)
    posted_in = [{m: g for g, ex in enumerate(plan) for m in ex[1]} for plan in plans]
    waits = [[ex[2] if len(ex) > 2 else ex[1] for ex in plan] for plan in plans]
    host = [0] * p  # actions run: exchanges 0..host are posted
    head = [0] * p  # exchanges finished on the device's stream; the next one starts once posted

    def started(s: int, g: int) -> bool:
        return g <= head[s] and g <= host[s]

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while head[s] < len(ops[s]) and started(s, head[s]) and all(
                    started(*partner[(s, head[s], i)][:2]) for i in range(len(ops[s][head[s]]))):
                head[s] += 1
                progress = True
            while host[s] < len(ops[s]) - 1 and all(posted_in[s][m] < head[s] for m in waits[s][host[s]]):
                host[s] += 1
                progress = True
    stuck = [f"{name} {s} in exchange {[str(m) for _, _, m in ops[s][head[s]]]}" for s in range(p)
             if head[s] < len(ops[s])]
    if stuck:
        raise ValueError(f"the communication plan deadlocks on NCCL: {'; '.join(stuck)}")


class Transport(Protocol):
    """How a stage's messages travel: in-process mailboxes (threads) or torch.distributed point-to-point."""

    def post(self, sends: list[tuple[Message, torch.Tensor]], recvs: list[Message]) -> None:
        """Post the sends and receives of one exchange together. Sends may still be in flight on return."""
        ...

    def receive(self, messages: list[Message]) -> list[torch.Tensor]:
        """The tensors of `messages` (posted by this or an earlier exchange), waited for, in the compute dtype on
        this stage's device."""
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


def run_stage(ex: StageExecutor | Sequence[StageExecutor], actions: Sequence[Action], transport: Transport,
              microbatches: Sequence[MicroBatch], p: int | Layout, normalizer: float, loss_scale: float = 1.0,
              plan: Sequence[Exchange] | None = None, batched_weights: bool = False) -> torch.Tensor | None:
    """Execute one device's action list with its stage executor (or, for a device holding several stages, one
    executor per chunk, in chunk order); return the summed loss shares where the last stage runs, else None.

    `normalizer` is the kept-token count of the global batch: the last stage divides each micro-batch's summed loss
    by it, so the shares add up to one device's mean loss however the padding falls. `plan`: this device's part of
    `communication_plan(schedule)` (default: `comm_plan`'s, enough for one stage per device). Tensors between two
    chunks of this device are handed over in place, never sent. A B whose micro-batch and chunk have a W in
    `actions` computes only the input gradient; the W computes the weight gradients later. `batched_weights`:
    weight passes of one chunk back to back (`weights_in_groups`) run as one, where the last of them stands, each
    linear layer's gradient one product over their micro-batches' rows.
    """
    executors = [ex] if isinstance(ex, StageExecutor) else list(ex)
    layout = as_layout(p)
    device = layout.device_of(executors[0].index)
    last = layout.stages - 1
    split = split_backwards(actions)
    plan = plan if plan is not None else comm_plan(actions, device, layout)
    losses: list[torch.Tensor] = []
    outputs: dict[Message, torch.Tensor] = {}  # produced here, waiting to be sent with the next exchange
    local: dict[Message, torch.Tensor] = {}  # produced here for another chunk of this device
    batch_ends = {start + n - 1: [a.microbatch for a in actions[start:start + n]]
                  for start, n in weight_groups(actions)} if batched_weights else {}
    for i, (action, (sends, recvs, *_)) in enumerate(zip(actions, plan)):
        if sends or recvs:
            transport.post([(m, outputs.pop(m)) for m in sends], recvs)
        wanted = needs(action, device, layout)
        remote = _wire(wanted, device, layout, False)
        arrived = dict(zip(remote, transport.receive(remote))) if remote else {}
        incoming = [arrived[m] if m in arrived else local.pop(m) for m in wanted]
        chunk = executors[action.chunk]
        mb, stage = microbatches[action.microbatch], chunk.index
        if action.kind == "F":
            inp = incoming[0] if incoming else mb.inputs
            out = chunk.forward(action.microbatch, inp, mb.targets if stage == last else None, mb.context, normalizer,
                                weights_later=(action.chunk, action.microbatch) in split)
            result = out.detach()
            if stage == last:
                losses.append(result)
        elif action.kind == "B":
            result = chunk.backward(action.microbatch, incoming[0] if incoming else None, loss_scale,
                                    weights_later=(action.chunk, action.microbatch) in split)
        elif not batched_weights:
            chunk.backward_weights(action.microbatch)
        elif i in batch_ends:
            chunk.backward_weights(*batch_ends[i])
        for m in makes(action, device, layout):
            (outputs if on_wire(m, device, layout, True) else local)[m] = result
    final_sends = plan[-1][0]
    if final_sends:
        transport.post([(m, outputs.pop(m)) for m in final_sends], [])
    transport.flush()
    return torch.stack(losses).sum() if losses else None
