"""Numeric precision of a training run, the way 3090 owners train: fp32, bf16 or fp16 weights; or fp32 weights with
bf16 autocast, or fp16 autocast plus a gradient scaler (fp16's narrow range would flush small gradients to zero).

One `Precision` describes a run for every engine: the pipeline stages enter `autocast` around their forward, DDP and
ZeRO-1 wrap the module in it, FSDP2 turns it into a `MixedPrecisionPolicy`, and whoever owns the loss multiplies it
by the scaler's factor, whose overflow check is agreed by every rank (`ShardedGradScaler` over the world group).
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from helpers.check import matching_pairs
from helpers.dtypes import DTYPES, resolve

AUTOCAST = ("bf16", "fp16")

# Parity with one device, by what the run computes in: fp32 is exact up to summation order; 16-bit formats round
# every product (bf16 keeps 8 bits of mantissa, fp16 11), so gradients are compared relative to their size.
TOLERANCE = {"fp32": 1e-5, "fp64": 1e-10, "bf16": 5e-2, "fp16": 1e-2}


@dataclass(frozen=True)
class Precision:
    """`dtype`: the weights (and, without autocast, the compute). `autocast`: None, or the 16-bit format matmuls
    run in while the weights stay fp32 (PyTorch's automatic mixed precision)."""

    dtype: str = "fp32"
    autocast: str | None = None

    def __post_init__(self):
        resolve(self.dtype)
        if self.autocast is not None:
            if self.autocast not in AUTOCAST:
                raise ValueError(f"autocast runs in one of {AUTOCAST}, not {self.autocast!r}")
            if self.dtype != "fp32":
                raise ValueError(f"autocast keeps fp32 weights and computes in {self.autocast}; with dtype="
                                 f"{self.dtype!r} the weights are already {self.dtype}: use one or the other")

    @property
    def weights(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def compute(self) -> str:
        """The format products are computed in: what decides the parity tolerance."""
        return self.autocast or self.dtype

    @property
    def scaled(self) -> bool:
        """fp16 anywhere needs loss scaling: small gradients underflow fp16's range without it."""
        return "fp16" in (self.dtype, self.autocast)

    @property
    def tolerance(self) -> float:
        return TOLERANCE[self.compute]

    def context(self, device: torch.device):
        """The autocast region a forward runs in (nothing without autocast)."""
        if self.autocast is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=DTYPES[self.autocast])

    def __str__(self) -> str:
        return f"{self.dtype} weights" + (f", {self.autocast} autocast" if self.autocast else "") + \
            (", loss scaling" if self.scaled else "")


class Autocast(nn.Module):
    """`module` with its forward under `precision`'s autocast (how DDP and ZeRO-1 get mixed precision)."""

    def __init__(self, module: nn.Module, precision: Precision, device: torch.device):
        super().__init__()
        self.module, self.precision, self.device = module, precision, device

    def forward(self, *args, **kwargs):
        with self.precision.context(self.device):
            return self.module(*args, **kwargs)


class HalfWeightsGradScaler(torch.amp.GradScaler):
    """A gradient scaler for fp16 *weights* in one process. PyTorch's refuses to unscale fp16 gradients ("Attempting
    to unscale FP16 gradients"): with autocast the weights, and so their gradients, are fp32. With fp16 weights there is
    no fp32 copy and the gradients are fp16 by construction; `ShardedGradScaler`, which the multi-process engines use,
    unscales them in place, and so does this one."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


def make_scaler(precision: Precision, device: torch.device, group=None):
    """A gradient scaler when the run needs one, else None. `ShardedGradScaler` all-reduces the overflow check over
    `group`, so every rank of a pipeline (whose loss lives on the last stage only) or of FSDP2 (whose gradients are
    sharded) skips the same steps and keeps the same scale."""
    if not precision.scaled:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if group is not None:
        scaler = ShardedGradScaler(device.type, process_group=group)
    else:
        scaler = HalfWeightsGradScaler(device.type) if precision.weights == torch.float16 else \
            torch.amp.GradScaler(device.type)
    scaler.scale(torch.ones((), device=device))  # every rank holds the scale, even one without a loss
    return scaler


def max_relative_diff(reference: list[torch.Tensor], other: list[torch.Tensor]) -> float:
    """Largest |a - b| / max|a| over matching tensors: how 16-bit results are compared with fp32 ones. Different
    counts, shapes or no tensors at all are refused (`helpers.check.matching_pairs`): a run that returned no
    gradients must not compare as "no difference"."""
    return max(((a.double() - b.double()).abs().max() / a.double().abs().max().clamp(min=1e-12)).item()
               for a, b in matching_pairs(reference, other))
