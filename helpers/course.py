"""The setup cell every notebook starts with; `load_data` (the facts in data/, `helpers.facts`) is here too, since
every notebook imports both from here."""
from __future__ import annotations

import math
import random
from typing import Callable

import torch

from helpers.facts import DATA_DIR, load_data
from helpers.runtime.rig import Rig, claim_cpu_device, detect_rig

__all__ = ["DATA_DIR", "check_answer", "load_data", "setup"]


def setup(seed: int = 0, force_cpu: bool | None = None, quiet: bool = False) -> Rig:
    """Seed everything, detect the rig, give this process one virtual device's threads, print which rig this is."""
    random.seed(seed)
    torch.manual_seed(seed)
    rig = detect_rig(force_cpu=force_cpu)
    if rig.is_cpu:
        claim_cpu_device(rig)
    if not quiet:
        print(rig.describe())
        for line in rig.advice:
            print("advice:", line)
    return rig



def _same(answer: object, expected: object, rel: float) -> bool:
    """Numbers within `rel` of each other, sequences element by element (a tuple equals a list), anything else equal."""
    if isinstance(answer, (int, float)) and isinstance(expected, (int, float)) and not isinstance(answer, bool):
        return math.isclose(answer, expected, rel_tol=rel, abs_tol=0.0 if rel else 1e-12)
    if isinstance(answer, (list, tuple)) and isinstance(expected, (list, tuple)):
        return len(answer) == len(expected) and all(_same(a, e, rel) for a, e in zip(answer, expected))
    return answer == expected


def check_answer(number: int, answer: object, expected: object | Callable[[object], bool], hint: str,
                 rel: float = 0.0) -> bool | None:
    """Say whether a learner's answer to exercise `number` is right, without giving the right one away.

    `answer` None means not answered yet (the cell still runs, so Run All never stops here). `expected` is the right
    value (numbers within `rel`, relative) or a function that takes the answer and says whether it is right: such a
    function may run an experiment, which then costs time only once the learner has answered. The hint says where
    to look, not what to write. Returns True / False, or None while unanswered (the reference-answer test reads the
    printed line)."""
    if answer is None:
        print(f"exercise {number}: replace None with your answer, then run this cell again")
        return None
    right = bool(expected(answer)) if callable(expected) else _same(answer, expected, rel)
    print(f"exercise {number}: right" if right else f"exercise {number}: wrong, {hint}")
    return right
