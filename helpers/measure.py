"""Timing that survives a shared, noisy machine: warm-up, repeats, medians, and rivals timed in interleaved rounds
so that a slow minute hurts every contender alike. Ratios are only ever taken between numbers of the same run."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync_devices() -> None:
    """Wait for every GPU's queued work, before reading a clock (synchronize() alone waits for the current device
    only); nothing to wait for on the CPU."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a GPU runs its kernels after the host moves on); a CPU has none."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timings(dict):
    """Median seconds by name (a plain dict of medians), with every timed sample kept in `samples`: how much a
    median can be trusted is in the spread of what it was taken from (`relative_spread`)."""

    def __init__(self, samples: dict[str, list[float]]):
        super().__init__({k: statistics.median(v) for k, v in samples.items()})
        self.samples = samples

    def spread(self, name: str) -> float | None:
        """`relative_spread` of `name`'s samples."""
        return relative_spread(self.samples[name])

    def paired_ratio(self, reference: str, name: str) -> float:
        """The median over rounds of `reference`'s time over `name`'s, each pair timed in the same round: a minute
        in which the machine runs slower slows both and cancels in their ratio, which the ratio of the two medians
        keeps (docs/bench.md, `paired_ratio`)."""
        return statistics.median(a / b for a, b in zip(self.samples[reference], self.samples[name], strict=True))


def relative_spread(samples: list[float]) -> float | None:
    """Half the interquartile range of `samples` over their median: the noise a median of them sits in (None with
    fewer than 2 samples)."""
    if len(samples) < 2:
        return None
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / 2 / statistics.median(samples)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 1,
                before: Callable[[], object] | None = None) -> float:
    """Median wall time of `fn()` in seconds, waiting for `device`'s queued work around each call; `before()` runs
    before each call, untimed (a barrier that lines the ranks up for a collective)."""
    times = []
    for r in range(warmup + repeats):
        if before is not None:
            before()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                        progress: bool = False, after: dict[str, Callable[[], object]] | None = None) -> Timings:
    """Median seconds per call of each function, timed round-robin: a, b, c, a, b, c, ... (a `Timings`: a dict of
    medians that keeps the samples). `after[name]` runs after each timed call of `fns[name]`, outside its timing
    (e.g. to read the timeline that call recorded; not after the warm-up calls)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    rounds = range(repeats)
    if progress:
        from tqdm.auto import tqdm

        rounds = tqdm(rounds, desc="timing", leave=False)
    for _ in rounds:
        for name, fn in fns.items():
            sync_devices()
            t0 = time.perf_counter()
            fn()
            sync_devices()
            times[name].append(time.perf_counter() - t0)
            if after and name in after:
                after[name]()
    return Timings(times)
