"""The setup cell every notebook starts with, and reading the facts in data/ (each with its source)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from helpers.runtime.rig import Rig, claim_cpu_device, detect_rig

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


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


def load_data(name: str) -> dict:
    """A JSON file from data/ (facts and figures, every entry with its source)."""
    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no data file {path.name} in {DATA_DIR}; available: "
                                f"{sorted(p.stem for p in DATA_DIR.glob('*.json'))}")
    return json.loads(path.read_text())
