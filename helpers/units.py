"""Units of memory, and bytes said in them: what every module that prints or reads a size imports (and nothing
else, so that printing a size does not pull in the memory ledger or a planner)."""
from __future__ import annotations

import re

KiB = 1024
MiB = 1024**2
GiB = 1024**3

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(GiB|MiB|GB|MB)\s*$", re.IGNORECASE)
_UNITS = {"gib": GiB, "mib": MiB, "gb": 10**9, "mb": 10**6}


def fmt_bytes(n: float) -> str:
    """'1.50 GiB', '12.00 MiB', '3.00 KiB' or '12 B': the largest binary unit the size reaches, two decimals."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def is_size(text: str) -> bool:
    """Whether `text` reads as a memory size ('24GiB', '24268 MiB', '24GB')."""
    return _SIZE.match(text) is not None


def parse_size(text: str) -> int:
    """'24GiB', '24268 MiB', '24GB' -> bytes (GiB = 2**30, GB = 10**9)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"cannot read {text!r} as a memory size: write e.g. '24GiB', '24268MiB' or '24GB'")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
