"""The setup cell every notebook starts with; `load_data` (the facts in data/, `helpers.facts`) is here too, since
every notebook imports both from here."""
from __future__ import annotations

import random

import torch

from helpers.facts import DATA_DIR, load_data
from helpers.runtime.rig import Rig, claim_cpu_device, detect_rig

__all__ = ["DATA_DIR", "load_data", "setup"]


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

