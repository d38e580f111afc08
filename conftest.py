"""Test-wide settings, inherited by the notebook kernels and every rank the tests start: widgets print static
snapshots; ranks run device-strict (helpers.runtime.strict: a tensor made without device= fails a collective, as
under NCCL)."""
import os

os.environ.setdefault("LAB_STATIC_WIDGETS", "1")
os.environ.setdefault("LAB_DEVICE_STRICT", "1")
