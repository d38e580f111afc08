"""Test-wide settings: widgets print static snapshots (the notebook kernels inherit it)."""
import os

os.environ.setdefault("LAB_STATIC_WIDGETS", "1")
