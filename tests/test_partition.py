import itertools
import math
import random

import pytest

from helpers.partition import (NoFeasibleSplit, compare_splits, equal_count_split, evaluate, greedy_split,
                               optimal_split, proportional_shares)


def brute_force(costs, k, memory=None, caps=None, speeds=None):
    n, best = len(costs), math.inf
    speeds = speeds or [1.0] * k
    for bounds in itertools.combinations(range(1, n), k - 1):
        edges = [0, *bounds, n]
        stages = list(zip(edges, edges[1:]))
        if memory is not None and any(sum(memory[a:b]) > caps[j] for j, (a, b) in enumerate(stages)):
            continue
        best = min(best, max(sum(costs[a:b]) / speeds[j] for j, (a, b) in enumerate(stages)))
    return best


@pytest.mark.parametrize("seed", range(60))
def test_optimal_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    k = rng.randint(1, n)
    costs = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
    split = optimal_split(costs, k)
    assert len(split.boundaries) == k - 1
    assert split.bottleneck == pytest.approx(brute_force(costs, k))
    assert sum(split.stage_costs) == pytest.approx(sum(costs))


@pytest.mark.parametrize("seed", range(60))
def test_optimal_with_caps_matches_brute_force(seed):
    rng = random.Random(1000 + seed)
    n = rng.randint(2, 8)
    k = rng.randint(2, min(n, 4))
    costs = [rng.random() for _ in range(n)]
    memory = [rng.randint(1, 10) for _ in range(n)]
    caps = [rng.randint(5, 30) for _ in range(k)]
    expected = brute_force(costs, k, memory, caps)
    if expected == math.inf:
        with pytest.raises(NoFeasibleSplit):
            optimal_split(costs, k, memory, caps)
    else:
        split = optimal_split(costs, k, memory, caps)
        assert split.bottleneck == pytest.approx(expected)
        for j, (a, b) in enumerate(split.ranges(n)):
            assert sum(memory[a:b]) <= caps[j]


@pytest.mark.parametrize("seed", range(60))
def test_optimal_with_unequal_speeds_matches_brute_force(seed):
    """Devices of unequal speed (and memory): the split minimises the slowest stage's time, cost / speed."""
    rng = random.Random(2000 + seed)
    n = rng.randint(2, 9)
    k = rng.randint(2, min(n, 4))
    costs = [rng.choice([0.0, rng.random() * 10]) for _ in range(n)]
    speeds = [rng.choice([1.0, 0.5, 2.0, 0.3 + rng.random() * 3]) for _ in range(k)]
    memory = [rng.randint(1, 10) for _ in range(n)] if seed % 2 else None
    caps = [rng.randint(5, 40) for _ in range(k)] if memory else None
    expected = brute_force(costs, k, memory, caps, speeds)
    if expected == math.inf:
        with pytest.raises(NoFeasibleSplit):
            optimal_split(costs, k, memory, caps, speeds=speeds)
        return
    split = optimal_split(costs, k, memory, caps, speeds=speeds)
    assert split.bottleneck == pytest.approx(expected)
    assert split.stage_times == pytest.approx([c / v for c, v in zip(split.stage_costs, speeds)])
    assert split.bottleneck == pytest.approx(evaluate(costs, split.boundaries, "same", speeds).bottleneck)


def test_a_faster_device_takes_more_layers():
    """Twice as fast, twice the layers: 9 equal layers on a 1:2 pair split 3 | 6, a perfect balance (3 units of
    time each), where the equal-layers split 5 | 4 waits 5 units for the slower device."""
    split = optimal_split([1.0] * 9, 2, speeds=[1.0, 2.0])
    equal = evaluate([1.0] * 9, equal_count_split(9, 2), "equal layers", speeds=[1.0, 2.0])
    assert split.boundaries == (3,) and split.stage_times == (3.0, 3.0) and split.imbalance == pytest.approx(1.0)
    assert equal.boundaries == (5,) and equal.bottleneck == 5.0 and equal.imbalance == pytest.approx(5 / 3)
    assert optimal_split([1.0] * 9, 2, speeds=[2.0, 4.0]).boundaries == (3,), "speeds are relative"


@pytest.mark.parametrize("speeds, msg", [([1.0], "2 device speeds|1 device speeds"), ([1.0, 0.0], "positive"),
                                         ([1.0, math.inf], "finite")])
def test_bad_speeds_are_refused(speeds, msg):
    with pytest.raises(ValueError, match=msg):
        optimal_split([1.0] * 4, 2, speeds=speeds)


def test_unequal_devices_shift_the_cut():
    costs = [1.0] * 8
    memory = [1.0] * 8
    assert optimal_split(costs, 2).boundaries == (4,)
    assert optimal_split(costs, 2, memory, caps=[3, 10]).boundaries == (3,)


@pytest.mark.parametrize("costs, k, msg", [
    ([], 2, "empty"), ([1, 2], 3, "cannot split 2 layers into 3 stages"), ([1, -1], 2, "layer 1 is -1.0"),
    ([1, float("nan")], 2, "layer 1 is nan"), ([1, 2], 0, "k must be between 1 and 2")])
def test_bad_input(costs, k, msg):
    with pytest.raises(ValueError, match=msg):
        optimal_split(costs, k)


def test_infeasible_caps_say_what_does_not_fit():
    with pytest.raises(NoFeasibleSplit, match=r"layer 2 \(5 B\) does not fit on any device \(largest: cuda:1"):
        optimal_split([1, 1, 1], 2, [1, 1, 5], [2, 4], device_names=["cuda:0", "cuda:1"])
    with pytest.raises(NoFeasibleSplit, match=r"layers 3..3 \(3 B\) are left over"):
        optimal_split([1, 1, 1, 1], 2, [3, 3, 3, 3], [6, 3])


def test_baselines():
    assert equal_count_split(10, 2) == (5,)
    assert equal_count_split(7, 3) == (3, 5)
    assert greedy_split([1, 1, 1, 1], 2) == (2,)
    assert greedy_split([10, 1, 1, 1, 1], 2) == (1,)
    splits = compare_splits([1, 1, 1, 5], [4, 1, 1, 1], [4, 1, 1, 1])
    assert splits["optimal time"].bottleneck == 5
    assert all(s.bottleneck >= splits["optimal time"].bottleneck for s in splits.values())
    assert evaluate([1, 2, 3], (1,), "x").stage_costs == (1, 5)


@pytest.mark.parametrize("seed", range(40))
def test_proportional_shares_add_up_in_whole_units_close_to_the_speeds(seed):
    """Each share a whole number of units, at least one, adding up to the total, and no device more than one unit
    away from its exact proportion (beyond the one-unit floor)."""
    rng = random.Random(3000 + seed)
    n, unit = rng.randint(2, 4), rng.choice([1, 2, 4])
    units = rng.randint(n, 20)
    speeds = [rng.choice([1.0, 2.0, 0.1 + rng.random() * 5, 100.0]) for _ in range(n)]
    shares = proportional_shares(units * unit, speeds, unit)
    assert sum(shares) == units * unit and all(s >= unit and s % unit == 0 for s in shares)
    exact = [units * v / sum(speeds) for v in speeds]
    assert all(abs(s // unit - max(1.0, e)) < 1 + sum(max(0.0, 1 - x) for x in exact) for s, e in zip(shares, exact))
    assert proportional_shares(12, [1, 2]) == (4, 8) and proportional_shares(32, [1, 2], 4) == (12, 20)


def test_proportional_shares_refuse_too_few_items():
    with pytest.raises(ValueError, match="one at least"):
        proportional_shares(2, [1.0, 1.0, 1.0])
