"""Split a cost vector into k contiguous stages, optimally: minimise the slowest stage (the pipeline's bottleneck),
subject to each device's memory. A stage's time is its cost divided by its device's relative speed (all 1.0 for
equal devices, where time and cost are one: a 4090 beside a 3090 takes more layers).

`optimal_split` is exact (dynamic programming over prefix sums, O(k n^2)).
The baselines are what popular tools do: equal layer count (Megatron, picotron), equal parameters (DeepSpeed's
default), and a greedy in-order fill against an equal memory budget (Hugging Face accelerate's "balanced").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import NoReturn, Sequence

from helpers.units import fmt_bytes


@dataclass(frozen=True)
class Split:
    """Where each stage starts (`boundaries`, as for `split_model`), what each stage costs, and the relative speeds
    of the devices that run them (None: equal devices)."""

    boundaries: tuple[int, ...]
    stage_costs: tuple[float, ...]
    method: str = "optimal"
    speeds: tuple[float, ...] | None = None

    @property
    def stage_times(self) -> tuple[float, ...]:
        """Each stage's cost over its device's speed: what the pipeline waits for."""
        speeds = self.speeds or (1.0,) * len(self.stage_costs)
        return tuple(c / v for c, v in zip(self.stage_costs, speeds))

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def imbalance(self) -> float:
        """Bottleneck / the time of a perfect balance (the whole cost over the devices' summed speed): 1.0 is
        perfect balance; for equal devices it is the slowest stage's cost over the mean."""
        speeds = self.speeds or (1.0,) * len(self.stage_costs)
        ideal = sum(self.stage_costs) / sum(speeds)
        return self.bottleneck / ideal if ideal > 0 else 1.0

    def ranges(self, n: int) -> list[tuple[int, int]]:
        edges = [0, *self.boundaries, n]
        return list(zip(edges, edges[1:]))


class NoFeasibleSplit(ValueError):
    """No contiguous split satisfies the memory caps; the message says which layers do not fit where."""


def check_costs(costs: Sequence[float], k: int, what: str = "cost") -> list[float]:
    costs = [float(c) for c in costs]
    if not costs:
        raise ValueError(f"the {what} vector is empty: give one {what} per layer")
    for i, c in enumerate(costs):
        if not math.isfinite(c) or c < 0:
            raise ValueError(f"{what} of layer {i} is {c}; {what}s must be finite and >= 0")
    if not 1 <= k <= len(costs):
        raise ValueError(f"cannot split {len(costs)} layers into {k} stages: each stage needs at least one layer "
                         f"(k must be between 1 and {len(costs)})")
    return costs


def _stage_costs(prefix: list[float], bounds: Sequence[int]) -> tuple[float, ...]:
    edges = [0, *bounds, len(prefix) - 1]
    return tuple(prefix[b] - prefix[a] for a, b in zip(edges, edges[1:]))


def _check_caps(memory: Sequence[float] | None, caps: Sequence[float] | None, n: int, k: int):
    if (memory is None) != (caps is None):
        raise ValueError("give both memory (bytes per layer) and caps (bytes per device), or neither")
    if memory is None:
        return None, None
    memory = check_costs(memory, 1, "memory")
    if len(memory) != n:
        raise ValueError(f"{len(memory)} memory entries for {n} layers")
    if len(caps) != k:
        raise ValueError(f"{len(caps)} device caps for {k} stages: give one cap per device")
    if any(not c > 0 for c in caps):
        raise ValueError(f"device caps must be positive, got {list(caps)}")
    return memory, [float(c) for c in caps]


def check_speeds(speeds: Sequence[float] | None, k: int) -> tuple[float, ...] | None:
    """One positive, finite relative speed per device (larger is faster), or None for equal devices."""
    if speeds is None:
        return None
    speeds = tuple(float(v) for v in speeds)
    if len(speeds) != k:
        raise ValueError(f"{len(speeds)} device speeds for {k} stages: give one relative speed per device")
    if any(not (math.isfinite(v) and v > 0) for v in speeds):
        raise ValueError(f"device speeds must be positive and finite (relative: larger is faster), got {list(speeds)}")
    return speeds


def explain_infeasible(memory: Sequence[float], caps: Sequence[float], names: Sequence[str] | None = None) -> NoReturn:
    """Raise NoFeasibleSplit with the numbers (called once the search found no split).

    Filling each device in order with as many layers as fit is optimal for feasibility, so when it fails no
    contiguous split fits, and where it fails is the story to tell.
    """
    names = names or [f"device {j}" for j in range(len(caps))]
    biggest = max(range(len(memory)), key=lambda i: memory[i])
    if memory[biggest] > max(caps):
        raise NoFeasibleSplit(f"layer {biggest} ({fmt_bytes(memory[biggest])}) does not fit on any device "
                              f"(largest: {names[caps.index(max(caps))]} with {fmt_bytes(max(caps))})")
    i, held = 0, []
    for j, cap in enumerate(caps):
        start, used = i, 0.0
        while i < len(memory) and used + memory[i] <= cap:
            used += memory[i]
            i += 1
        if i > start:
            held.append(f"{names[j]} holds layers {start}..{i - 1} ({fmt_bytes(used)} of {fmt_bytes(cap)})")
        else:
            held.append(f"{names[j]} holds nothing ({fmt_bytes(cap)})")
    if i < len(memory):
        raise NoFeasibleSplit(f"no split fits: filled in order, {'; '.join(held)}; layers {i}..{len(memory) - 1} "
                              f"({fmt_bytes(sum(memory[i:]))}) are left over")
    raise NoFeasibleSplit(f"every stage needs at least one layer, but no contiguous split gives each device layers "
                          f"it can hold (filled in order: {'; '.join(held)})")


def optimal_split(costs: Sequence[float], k: int, memory: Sequence[float] | None = None,
                  caps: Sequence[float] | None = None, device_names: Sequence[str] | None = None,
                  speeds: Sequence[float] | None = None) -> Split:
    """The contiguous split into k non-empty stages whose slowest stage takes least time, stage j within caps[j].

    `speeds[j]` is device j's relative speed (larger is faster: measured by profiling the model on each device, or
    a card's relative compute from the GPU table): stage j takes its cost / speeds[j]. The search is the same exact
    dynamic program; only the time of a stage changes."""
    costs = check_costs(costs, k)
    n = len(costs)
    memory, caps = _check_caps(memory, caps, n, k)
    speeds = check_speeds(speeds, k)
    rate = speeds or (1.0,) * k
    prefix = [0.0, *accumulate(costs)]
    mprefix = [0.0, *accumulate(memory)] if memory else None

    def fits(a: int, b: int, j: int) -> bool:
        return mprefix is None or mprefix[b] - mprefix[a] <= caps[j] * (1 + 1e-12)

    inf = math.inf
    # dp[j][i]: best bottleneck for layers[:i] in j+1 stages; cut[j][i]: where stage j starts
    dp = [[inf] * (n + 1) for _ in range(k)]
    cut = [[0] * (n + 1) for _ in range(k)]
    for i in range(1, n + 1):
        if fits(0, i, 0):
            dp[0][i] = prefix[i] / rate[0]
    for j in range(1, k):
        for i in range(j + 1, n + 1):
            for t in range(j, i):
                if dp[j - 1][t] < inf and fits(t, i, j):
                    value = max(dp[j - 1][t], (prefix[i] - prefix[t]) / rate[j])
                    if value < dp[j][i]:
                        dp[j][i], cut[j][i] = value, t
    if dp[k - 1][n] == inf:
        explain_infeasible(memory, caps, device_names)
    bounds, i = [], n
    for j in range(k - 1, 0, -1):
        i = cut[j][i]
        bounds.append(i)
    bounds.reverse()
    return Split(tuple(bounds), _stage_costs(prefix, bounds), speeds=speeds)


def proportional_shares(total: int, speeds: Sequence[float], unit: int = 1) -> tuple[int, ...]:
    """`total` items (a global batch) dealt to devices in proportion to their speeds, in whole multiples of `unit`
    (each replica's micro-batches), at least one unit each: the largest remainders get the units rounding left over.
    Data parallelism with these shares waits for no card: each finishes its share in about the same time."""
    speeds = check_speeds(speeds, len(speeds))
    if unit < 1 or total % unit or total // unit < len(speeds):
        raise ValueError(f"cannot deal {total} items to {len(speeds)} devices in whole units of {unit}, one at least "
                         "each")
    units = total // unit
    exact = [units * v / sum(speeds) for v in speeds]
    whole = [max(1, math.floor(e)) for e in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda j: exact[j] - whole[j], reverse=True)
    for j in by_remainder[:units - sum(whole)]:
        whole[j] += 1
    while sum(whole) > units:  # the one-unit floor took more than was left: give back from the largest
        whole[max((j for j in range(len(whole)) if whole[j] > 1), key=lambda j: whole[j] - exact[j])] -= 1
    return tuple(w * unit for w in whole)


def equal_count_split(n_layers: int, k: int) -> tuple[int, ...]:
    """Megatron/picotron style: the same number of layers per stage (the first stages take the remainder)."""
    check_costs([1.0] * n_layers, k)
    base, extra = divmod(n_layers, k)
    sizes = [base + (1 if j < extra else 0) for j in range(k)]
    return tuple(accumulate(sizes[:-1]))


def greedy_split(memory: Sequence[float], k: int) -> tuple[int, ...]:
    """accelerate-style "balanced": budget = total / k per device, filled in module order, never backtracking."""
    memory = check_costs(memory, k, "memory")
    budget = sum(memory) / k
    bounds, used, stage = [], 0.0, 0
    for i, m in enumerate(memory):
        layers_left, stages_left = len(memory) - i, k - stage - 1
        if stage < k - 1 and used > 0 and (used + m > budget or layers_left <= stages_left):
            bounds.append(i)
            stage, used = stage + 1, 0.0
        used += m
    return tuple(bounds)


def evaluate(costs: Sequence[float], boundaries: Sequence[int], method: str,
             speeds: Sequence[float] | None = None) -> Split:
    """The stage costs of a given split under `costs` (e.g. measured time for a params-balanced split), on devices
    of the given relative speeds (None: equal)."""
    prefix = [0.0, *accumulate(float(c) for c in costs)]
    return Split(tuple(boundaries), _stage_costs(prefix, boundaries), method,
                 check_speeds(speeds, len(boundaries) + 1))


def compare_splits(time_costs: Sequence[float], param_costs: Sequence[float], memory: Sequence[float],
                   k: int = 2) -> dict[str, Split]:
    """The four splits of notebook 02, each evaluated on measured time."""
    return {
        "equal layers": evaluate(time_costs, equal_count_split(len(time_costs), k), "equal layers"),
        "equal params": evaluate(time_costs, optimal_split(param_costs, k).boundaries, "equal params"),
        "greedy memory": evaluate(time_costs, greedy_split(memory, k), "greedy memory"),
        "optimal time": evaluate(time_costs, optimal_split(time_costs, k).boundaries, "optimal time"),
    }
