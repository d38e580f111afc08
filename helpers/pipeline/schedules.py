"""Pipeline schedules as pure data: for each device, the ordered list of actions it runs.

`F3` is "forward of micro-batch 3", `B3` its backward. GPipe and 1F1B are just different orders of the same
actions; the engines and the simulator execute any such list, and `validate` proves a list can run to the end
(no backward before its forward, no stage waiting for an action that never comes).

Past 1F1B the same data says two more things. A device can hold several (virtual) stages of the model, its
*chunks*: `F3c1` is the forward of micro-batch 3 on the device's second chunk, and the schedule's `Layout` says
which stage each chunk is (interleaved 1F1B: stage = chunk x devices + device; the V shape: chunk 0 goes down the
devices, chunk 1 comes back up, so the turn at the bottom stays on one device). And a backward can be split in two
(zero-bubble schedules): `B3` then computes only the gradient of the stage's input, which the previous stage is
waiting for, and `W3` later the gradients of the weights, which nobody waits for, so it can fill a bubble. A `B`
whose micro-batch and chunk have a `W` in the same list is such an input-only backward; without one it is the whole
backward.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

from helpers.catalog import schedule_entry, schedules

ActionKind = Literal["F", "B", "W"]
KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int
    chunk: int = 0  # which of the device's stages runs it (0 unless the device holds several)

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Layout:
    """Which stage of the model each (device, chunk) runs. `loop` (interleaved 1F1B, Narayanan et al. 2021):
    stage = chunk x devices + device, so a micro-batch loops over the devices `chunks` times. `v` (ZB-V, Qi et al.
    2024): two chunks, chunk 0 is stage `device` and chunk 1 is stage 2 x devices - 1 - device, so the first and
    the last stage share device 0 and the turn from stage devices-1 to stage devices stays on the last device."""

    devices: int
    chunks: int = 1
    shape: Literal["loop", "v"] = "loop"

    def __post_init__(self):
        if self.devices < 1 or self.chunks < 1:
            raise ValueError(f"a layout needs at least one device and one chunk, got {self.devices} and {self.chunks}")
        if self.shape not in ("loop", "v"):
            raise ValueError(f"unknown layout shape {self.shape!r}; choose 'loop' or 'v'")
        if self.shape == "v" and self.chunks != 2:
            raise ValueError(f"the V shape has exactly two chunks per device, got {self.chunks}")

    @property
    def stages(self) -> int:
        return self.devices * self.chunks

    def stage(self, device: int, chunk: int = 0) -> int:
        """The model stage that `chunk` of `device` runs."""
        if self.shape == "v" and chunk == 1:
            return 2 * self.devices - 1 - device
        return chunk * self.devices + device

    def place(self, stage: int) -> tuple[int, int]:
        """(device, chunk) of a model stage."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} is outside the layout's {self.stages} stages")
        if self.shape == "v" and stage >= self.devices:
            return 2 * self.devices - 1 - stage, 1
        return stage % self.devices, stage // self.devices

    def device_of(self, stage: int) -> int:
        return self.place(stage)[0]

    def stages_of(self, device: int) -> list[int]:
        """The stages `device` holds, in chunk order."""
        return [self.stage(device, c) for c in range(self.chunks)]


class Schedule(list):
    """Per device, its ordered actions (a list of lists), and the `layout` saying which stage each chunk is. A
    plain list of lists is a schedule of one stage per device."""

    def __init__(self, actions: Sequence[Sequence[Action]] = (), layout: Layout | None = None):
        super().__init__(list(a) for a in actions)
        self.layout = layout or Layout(max(1, len(self)))


def layout_of(schedule: Sequence[Sequence[Action]]) -> Layout:
    """The schedule's layout: its own, or one stage per device for a plain list of lists."""
    return getattr(schedule, "layout", None) or Layout(max(1, len(schedule)))


def as_layout(p: int | Layout) -> Layout:
    return p if isinstance(p, Layout) else Layout(p)


def _check_pm(p: int, m: int) -> None:
    if p < 1:
        raise ValueError(f"a pipeline needs at least one stage, got p={p}")
    if m < 1:
        raise ValueError(f"a pipeline needs at least one micro-batch, got m={m}")


Generator = Callable[[int, int], Sequence[Sequence[Action]]]
SCHEDULES: dict[str, Generator] = {}  # name -> generator of its action lists, filled by @generator below


def generator(name: str) -> Callable[[Generator], Generator]:
    """Registers the action-list generator of the catalog's schedule `name` (helpers.catalog says its layout)."""
    def register(fn: Generator) -> Generator:
        SCHEDULES[schedule_entry(name).name] = fn
        return fn
    return register


@generator("gpipe")
def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): every stage runs all forwards, then all backwards. Activations of all m
    micro-batches are alive at once."""
    _check_pm(p, m)
    return [[Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)] for _ in range(p)]


def _alternate(forwards: list[Action], backwards: list[Action], warmup: int) -> list[Action]:
    """1F1B's shape: `warmup` forwards, then one forward and one backward in turn, then the backwards left."""
    warmup = min(warmup, len(forwards))
    actions = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards):
        actions += [f, b]
    return actions + backwards[len(forwards) - warmup:]


@generator("1f1b")
def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021): stage s warms up with p-s-1 forwards, then alternates one
    forward and one backward, then drains the backwards. Same bubble as GPipe, at most p micro-batches alive."""
    _check_pm(p, m)
    if m < p:
        raise ValueError(f"1F1B needs at least as many micro-batches as stages: m={m} < p={p} "
                         f"(use m >= {p}, or GPipe)")
    forwards, backwards = [Action("F", i) for i in range(m)], [Action("B", i) for i in range(m)]
    return [_alternate(forwards, backwards, p - s - 1) for s in range(p)]


@generator("interleaved")
def interleaved_1f1b(p: int, m: int, chunks: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each device holds `chunks` stages, stage k on device
    k % p, so each micro-batch goes round the devices `chunks` times. Each stage is 1/chunks of the work, so the
    pipeline fills and drains in 1/chunks of the time: bubble (p-1)/(chunks x m + p-1). Forwards go in groups of
    p micro-batches per chunk (chunk 0 of micro-batches 0..p-1, chunk 1 of the same, ...), backwards the same
    groups in reverse chunk order; device d warms up with 2(p-d-1) + (chunks-1)p forwards, then alternates.
    The price: `chunks` times the messages, and more micro-batches in flight during the warm-up."""
    _check_pm(p, m)
    if chunks < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 chunks per device, got {chunks} (with one it is 1f1b)")
    if m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of the {p} devices: m={m} is not a multiple "
                         f"of {p} (use m={m + p - m % p})")
    groups = range(m // p)
    forwards = [Action("F", g * p + i, c) for g in groups for c in range(chunks) for i in range(p)]
    backwards = [Action("B", g * p + i, c) for g in groups for c in reversed(range(chunks)) for i in range(p)]
    return Schedule([_alternate(forwards, backwards, 2 * (p - d - 1) + (chunks - 1) * p) for d in range(p)],
                    Layout(p, chunks))


@generator("zbh1")
def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024): 1F1B's order with each backward split into B (input gradient, what the previous
    stage waits for) and W (weight gradients). Device d puts off its first d W's to the end of the step, where
    1F1B leaves it idle: the backward chain from the last stage to the first now costs B instead of B + W per
    stage, so the bubble shrinks from (p-1)(F+B+W) to (p-1)(F+B-W) with the same micro-batches in flight."""
    _check_pm(p, m)
    if m < p:
        raise ValueError(f"ZB-H1 needs at least as many micro-batches as stages: m={m} < p={p} (use m >= {p})")
    schedule = []
    for d, order in enumerate(one_f_one_b(p, m)):
        actions = []
        for a in order:
            actions.append(a)
            if a.kind == "B" and a.microbatch >= d:  # the first d weight passes wait for the end
                actions.append(Action("W", a.microbatch - d))
        schedule.append(actions + [Action("W", i) for i in range(m - d, m)])
    return Schedule(schedule, Layout(p))


class _TwoChunks:
    """One device's action list of a V-shaped schedule, built pass by pass: each (kind, chunk) numbers its
    micro-batches in order; a split backward owes its W, paid later, oldest first."""

    def __init__(self):
        self.actions: list[Action] = []
        self.count = {(k, c): 0 for k in KINDS for c in (0, 1)}
        self.owed: list[Action] = []

    def run(self, kind: str, chunk: int, split: bool = False) -> None:
        mb = self.count[(kind, chunk)]
        self.actions.append(Action(kind, mb, chunk))
        self.count[(kind, chunk)] += 1
        if split:
            self.owed.append(Action("W", mb, chunk))

    def pay(self) -> None:
        if self.owed:
            self.actions.append(self.owed.pop(0))


@generator("zbv")
def zero_bubble_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two chunks per device in a V (device d holds stages d and 2p-1-d, so the
    first and last stage share device 0), backward split into B and W. With forward, input-gradient and
    weight-gradient passes of equal cost its bubble vanishes, at 1F1B's activation memory. Device d: 2(p-d)-1
    forwards of chunk 0; d pairs of forwards of chunk 1 and chunk 0; p-d rounds of F, B, W of chunk 1; then F, B, W
    of chunk 0 and of chunk 1 in turn until the forwards run out; the cool-down drains the B's (d pairs of both
    chunks, then p-d rounds of B and W of chunk 0) and ends with the W's still owed."""
    _check_pm(p, m)
    if m < 2 * p - 1:
        raise ValueError(f"ZB-V needs at least 2p-1 = {2 * p - 1} micro-batches for {p} devices, got m={m}")
    schedule = []
    for d in range(p):
        dev = _TwoChunks()
        run, count = dev.run, dev.count
        for _ in range(2 * (p - d) - 1):
            run("F", 0)
        for _ in range(d):
            run("F", 1), run("F", 0)
        for _ in range(p - d):
            run("F", 1), run("B", 1), run("W", 1)
        while count[("F", 1)] < count[("F", 0)] or count[("F", 0)] < m:
            if count[("F", 0)] < m:
                run("F", 0)
            run("B", 0), run("W", 0), run("F", 1), run("B", 1), run("W", 1)
        for _ in range(d):
            run("B", 0), run("B", 1)
        for _ in range(p - d):
            run("B", 0), run("W", 0)
        for chunk in (1, 0):
            while count[("W", chunk)] < m:
                run("W", chunk)
        schedule.append(dev.actions)
    return Schedule(schedule, Layout(p, 2, "v"))


@generator("dualpipev")
def dual_pipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, DeepSeek-V3's DualPipe folded onto a V, as torch.distributed.pipelining's
    `ScheduleDualPipeV` runs it): ZB-V's layout, with the steady phase pairing a forward of one chunk with a whole
    backward of the other (DeepSeek overlaps each pair's communication with its compute; here, as in torch's
    schedule without an overlap function, they run one after the other). Only the first and last few backwards
    are split into B and W, to fill the ramps. Device d: 2(p-d-1) forwards of chunk 0; d+1 pairs of forwards of
    both chunks; p-d-1 rounds of B (split), one owed W, F of chunk 1; m-2p+d+1 rounds of (F chunk 0, backward
    chunk 1) and (F chunk 1, backward chunk 0); p-d-1 rounds of backward chunk 1, F chunk 1, backward chunk 0; d+1
    pairs of backwards (split from the middle pair on); p-d-1 rounds of one owed W and a backward of chunk 0; the
    W's still owed."""
    _check_pm(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as stages, 2p = {2 * p}, got m={m}")
    schedule = []
    for d in range(p):
        dev = _TwoChunks()
        run, pay = dev.run, dev.pay
        for _ in range(2 * (p - d - 1)):
            run("F", 0)
        for _ in range(d + 1):
            run("F", 0), run("F", 1)
        for _ in range(p - d - 1):
            run("B", 1, split=True), pay(), run("F", 1)
        for _ in range(m - 2 * p + d + 1):
            run("F", 0), run("B", 1), run("F", 1), run("B", 0)
        for _ in range(p - d - 1):
            run("B", 1), run("F", 1), run("B", 0)
        split = False
        for i in range(d + 1):  # the backward pairs, split from the middle one on (chunk 1 first when d is odd)
            split |= i == (d + 1) // 2 and d % 2 == 1
            run("B", 1, split)
            split |= i == (d + 1) // 2 and d % 2 == 0
            run("B", 0, split)
        for _ in range(p - d - 1):
            pay(), run("B", 0, split)
        while dev.owed:
            pay()
        schedule.append(dev.actions)
    return Schedule(schedule, Layout(p, 2, "v"))


LAYOUTS = {e.name: (e.chunks, e.shape) for e in schedules()}  # (stages per device, shape) of each schedule
if set(SCHEDULES) != set(LAYOUTS):
    raise ImportError(f"schedules without a generator: {sorted(set(LAYOUTS) - set(SCHEDULES))}; generators without a "
                      f"catalog entry: {sorted(set(SCHEDULES) - set(LAYOUTS))}")


def make_schedule(name: str, p: int, m: int) -> Sequence[Sequence[Action]]:
    """The named schedule for `p` devices and `m` micro-batches (interleaved: 2 chunks per device)."""
    chunks_of(name)  # refuses an unknown name
    return SCHEDULES[name](p, m)


def weights_in_groups(schedule: Sequence[Sequence[Action]], k: int) -> Schedule:
    """`schedule` with each device's weight passes run `k` micro-batches at a time (per chunk): every W waits for
    the next k-1 of its chunk and they run back to back where the last of them stood (a last, shorter group where
    the chunk's final W stood), so an engine can run them as one pass, each linear layer's weight gradient one
    product over k micro-batches' rows (`StageExecutor.backward_weights`; the zero-bubble papers' W passes batched).
    A W depends only on its own B, so running it later is always allowed; it holds that micro-batch's activations
    longer (`peak_in_flight` counts them). k=1: the schedule as it is."""
    if k < 1:
        raise ValueError(f"weight passes run k >= 1 micro-batches at a time, got {k}")
    grouped = []
    for actions in schedule:
        last = {a.chunk: i for i, a in enumerate(actions) if a.kind == "W"}
        waiting: dict[int, list[Action]] = {}
        out: list[Action] = []
        for i, a in enumerate(actions):
            if a.kind != "W":
                out.append(a)
                continue
            group = waiting.setdefault(a.chunk, [])
            group.append(a)
            if len(group) == k or i == last[a.chunk]:
                out.extend(group)
                waiting[a.chunk] = []
        grouped.append(out)
    return Schedule(grouped, layout_of(schedule))


def weight_groups(actions: Sequence[Action]) -> list[tuple[int, int]]:
    """The runs of weight passes of one chunk back to back in `actions`, as (index of the first, how many): what an
    engine that batches weight passes runs as one."""
    runs: list[tuple[int, int]] = []
    for i, a in enumerate(actions):
        if a.kind != "W":
            continue
        if runs and sum(runs[-1]) == i and actions[runs[-1][0]].chunk == a.chunk:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def layout_for(name: str, p: int) -> Layout:
    """Where the named schedule puts the stages of a `p`-device pipeline (the model is cut into p x chunks)."""
    if name not in LAYOUTS:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(LAYOUTS)}")
    chunks, shape = LAYOUTS[name]
    return Layout(p, chunks, shape)


def chunks_of(name: str) -> int:
    """How many stages per device the named schedule runs."""
    return layout_for(name, 1).chunks


def dependencies(device: int, action: Action, p: int | Layout) -> list[tuple[int, Action]]:
    """What must have run before `action` on `device` (with `p` devices, or a `Layout`): a forward waits for the
    previous stage's forward; a backward for its own forward and the next stage's backward (the input-gradient
    part, where that is split off); a weight pass for its own backward."""
    layout = as_layout(p)
    mb, stage = action.microbatch, layout.stage(device, action.chunk)

    def at(k: int, kind: str) -> tuple[int, Action]:
        d, c = layout.place(k)
        return d, Action(kind, mb, c)

    if action.kind == "F":
        return [at(stage - 1, "F")] if stage > 0 else []
    if action.kind == "W":
        return [at(stage, "B")]
    deps = [at(stage, "F")]
    if stage < layout.stages - 1:
        deps.append(at(stage + 1, "B"))
    return deps


def _named(layout: Layout, device: int) -> str:
    return f"stage {device}" if layout.chunks == 1 else f"device {device}"


def validate(schedule: Sequence[Sequence[Action]], m: int) -> None:
    """Refuse a schedule that cannot run to the end, with the actions that would wait forever."""
    p = len(schedule)
    _check_pm(p, m)
    layout = layout_of(schedule)
    if layout.devices != p:
        raise ValueError(f"the schedule has action lists for {p} devices but its layout has {layout.devices}")
    for d, actions in enumerate(schedule):
        bad = [a for a in actions if a.kind not in KINDS or not 0 <= a.chunk < layout.chunks]
        counts = Counter((a.kind, a.chunk, a.microbatch) for a in actions)
        once = all(counts.get((k, c, i)) == 1 for k in ("F", "B") for c in range(layout.chunks) for i in range(m))
        if bad or not once or any(n > 1 or not 0 <= i < m for (_, _, i), n in counts.items()):
            what = f"F and B of each of {m} micro-batches exactly once (and W at most once)"
            if layout.chunks > 1:
                what += f" on each of its {layout.chunks} chunks"
            raise ValueError(f"{_named(layout, d)} must run {what}; it has {[str(a) for a in actions]}")
    done: set[tuple[int, Action]] = set()

    def runs(s: int, action: Action, position: list[int]) -> bool:
        ready = all(d in done for d in dependencies(s, action, layout))
        if ready:
            done.add((s, action))
        return ready

    replay(schedule, runs, lambda s: _named(layout, s), " wait for actions that never come")


def replay(schedule: Sequence[Sequence[Action]], runs: Callable[[int, Action, list[int]], bool],
           named: Callable[[int], str] = lambda d: f"device {d}", waiting: str = "") -> None:
    """Run `schedule` in rounds, one action per device per round: `runs(device, action, position)` runs it if it can
    (True; `position`: actions run per device). Once a round runs nothing, refuse it with the devices still waiting."""
    p = len(schedule)
    position = [0] * p
    progress = True
    while progress:
        progress = False
        for d in range(p):
            if position[d] < len(schedule[d]) and runs(d, schedule[d][position[d]], position):
                position[d] += 1
                progress = True
    stuck = [f"{named(d)} at {schedule[d][position[d]]}" for d in range(p) if position[d] < len(schedule[d])]
    if stuck:
        raise ValueError(f"the schedule deadlocks (a dependency cycle): {', '.join(stuck)}{waiting}")


def split_backwards(actions: Sequence[Action]) -> set[tuple[int, int]]:
    """(chunk, micro-batch) of the backwards in `actions` that compute only the input gradient: those with a W."""
    return {(a.chunk, a.microbatch) for a in actions if a.kind == "W"}


def peak_in_flight(actions: Sequence[Action], weight: Callable[[int], int] = lambda chunk: 1) -> int:
    """The most micro-batches (per chunk) whose forward ran and whose backward has not finished with them
    (activations held) on one device: a backward frees them, or its W where it is split. `weight(chunk)`: what one
    micro-batch of that chunk holds (bytes, say) to sum instead of counting."""
    split = split_backwards(actions)
    alive: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        key = (a.chunk, a.microbatch)
        if a.kind == "F":
            alive.add(key)
        elif a.kind == "W" or key not in split:
            alive.discard(key)
        peak = max(peak, sum(weight(chunk) for chunk, _ in alive))
    return peak


def bubble_fraction(p: int, m: int, chunks: int = 1) -> float:
    """GPipe/1F1B idle fraction with equal stages and free communication: (p-1)/(m+p-1) (Huang et al. 2019);
    with `chunks` stages per device (interleaved 1F1B) the fill and drain take 1/chunks as long:
    (p-1)/(chunks x m + p-1) (Narayanan et al. 2021)."""
    _check_pm(p, m)
    return (p - 1) / (chunks * m + p - 1)


def zero_bubble_h1_fraction(p: int, m: int, f: float, b: float, w: float) -> float:
    """ZB-H1's idle fraction with equal stages, free communication and forward, input-gradient and
    weight-gradient passes of `f`, `b`, `w` seconds: a bubble of (p-1)(f+b-w) beside m(f+b+w) of work
    (Qi et al. 2024, section 3)."""
    _check_pm(p, m)
    bubble = (p - 1) * max(0.0, f + b - w)
    return bubble / (m * (f + b + w) + bubble)
