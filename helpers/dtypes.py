"""Numeric formats by the names the course writes them in ('fp32', 'bf16', 'fp16', 'fp64'): the one map to torch's
dtypes and the one table of bytes per value (read off torch, so "fp32 is 4 bytes" is said nowhere by hand).

On the first floor with `units`: the precision of a run, the pipeline's wire, the planners and the simulator all name
formats, and none of them should import another room to do so. Weight formats with quantisation (int8, NF4) are
data with sources: `helpers.sizing.shape.weight_format`."""
from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}  # bytes per value: fp32 4, bf16 and fp16 2


def resolve(name: str | torch.dtype) -> torch.dtype:
    """A dtype from its course name ('bf16'); a torch dtype is returned as it is."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {list(DTYPES)}")
    return DTYPES[name]
