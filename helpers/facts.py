"""The facts in data/: published figures and measurements as JSON, every entry with its source.

Its own module on the first floor (beside `units`), not in `course`: the planners, the hardware descriptions and the
speed model read these facts, and none of them should import a notebook's setup (which detects the rig)."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def load_data(name: str) -> dict:
    """A JSON file from data/ (facts and figures, every entry with its source)."""
    path = DATA_DIR / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(f"no data file {path.name} in {DATA_DIR}; available: "
                                f"{sorted(p.stem for p in DATA_DIR.glob('*.json'))}")
    return json.loads(path.read_text())


cached_data = lru_cache(maxsize=None)(load_data)  # each file read once, for the tables read on every call: read-only
