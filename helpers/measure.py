"""Timing that survives a shared, noisy machine: warm-up, repeats, medians, and rivals timed in interleaved rounds
so that a slow minute hurts every contender alike. Ratios are only ever taken between numbers of the same run."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def _sync() -> None:
    """Wait for every GPU (synchronize() alone waits for the current device only)."""
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in seconds (CUDA synchronised where present)."""
    return interleaved_medians({"fn": fn}, repeats, warmup)["fn"]


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1,
                        progress: bool = False) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin: a, b, c, a, b, c, ..."""
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
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}
