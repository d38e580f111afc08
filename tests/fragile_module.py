"""Imports fine in the caller, fails inside a rank: the launcher must bring the import error back."""
import os

if "RANK" in os.environ:
    raise ImportError("this module refuses to load inside a rank")


def worker() -> int:
    return 0
