"""Pipeline schedules as pure data: for each stage, the ordered list of actions it runs.

`F3` is "forward of micro-batch 3", `B3` its backward. GPipe and 1F1B are just different orders of the same
actions; the engines and the simulator execute any such list, and `validate` proves a list can run to the end
(no backward before its forward, no stage waiting for an action that never comes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

ActionKind = Literal["F", "B"]


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


Schedule = list[list[Action]]  # schedule[stage] = ordered actions of that stage


def _check_pm(p: int, m: int) -> None:
    if p < 1:
        raise ValueError(f"a pipeline needs at least one stage, got p={p}")
    if m < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got m={m}")


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2019): every stage runs all forwards, then all backwards. Activations of all m
    micro-batches are alive at once."""
    _check_pm(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): stage s warms up with p-s-1 forwards, then alternates one
    forward and one backward, then drains the backwards. Same bubble as GPipe, at most p micro-batches alive."""
    _check_pm(p, m)
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: m={m} < p={p} "
                         f"(use m >= {p}, or GPipe)")
    schedule = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        actions = [Action("F", i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:
            actions += [Action("F", f), Action("B", b)]
            f, b = f + 1, b + 1
        actions += [Action("B", i) for i in range(b, m)]
        schedule.append(actions)
    return schedule


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, p: int, m: int) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m)


def dependencies(stage: int, action: Action, p: int) -> list[tuple[int, Action]]:
    """What must have run before `action` on `stage`: the previous stage's forward, the next stage's backward,
    and this stage's own forward of the same micro-batch."""
    mb = action.microbatch
    if action.kind == "F":
        return [(stage - 1, Action("F", mb))] if stage > 0 else []
    deps = [(stage, Action("F", mb))]
    if stage < p - 1:
        deps.append((stage + 1, Action("B", mb)))
    return deps


def validate(schedule: Schedule, m: int) -> None:
    """Refuse a schedule that cannot run to the end, with the actions that would wait forever."""
    p = len(schedule)
    _check_pm(p, m)
    expected = sorted(str(a) for i in range(m) for a in (Action("F", i), Action("B", i)))
    for s, actions in enumerate(schedule):
        got = sorted(str(a) for a in actions)
        if got != expected:
            raise ValueError(f"stage {s} must run F and B of each of {m} micro-batches exactly once; it has "
                             f"{[str(a) for a in actions]}")
    done: set[tuple[int, Action]] = set()
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for s in range(p):
            while position[s] < len(schedule[s]):
                action = schedule[s][position[s]]
                if not all(d in done for d in dependencies(s, action, p)):
                    break
                done.add((s, action))
                position[s] += 1
                progress = True
    stuck = [f"stage {s} at {schedule[s][position[s]]}" for s in range(p) if position[s] < len(schedule[s])]
    if stuck:
        raise ValueError(f"the schedule deadlocks (a dependency cycle): {', '.join(stuck)} wait for actions that "
                         "never come")


def peak_in_flight(actions: list[Action]) -> int:
    """The most micro-batches whose forward ran and whose backward has not (activations held) on one stage."""
    alive = peak = 0
    for a in actions:
        alive += 1 if a.kind == "F" else -1
        peak = max(peak, alive)
    return peak


def bubble_fraction(p: int, m: int) -> float:
    """GPipe/1F1B idle fraction with equal stages and free communication: (p-1)/(m+p-1) (Huang et al. 2019)."""
    _check_pm(p, m)
    return (p - 1) / (m + p - 1)
