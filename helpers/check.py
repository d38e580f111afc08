"""Correctness first: every strategy is compared with one device (same loss, gradients within 1e-5 in fp32)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad.detach().cpu() if p.grad is not None else torch.zeros_like(p, device="cpu") for p in params]


def max_grad_diff(reference: nn.Module | Iterable[torch.Tensor], other: nn.Module | Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between matching gradients (parameters in the same order)."""
    ref = grads_of(reference.parameters() if isinstance(reference, nn.Module) else reference)
    oth = grads_of(other.parameters() if isinstance(other, nn.Module) else other)
    if len(ref) != len(oth):
        raise ValueError(f"{len(ref)} reference parameters but {len(oth)} to compare")
    return max((a - b).abs().max().item() for a, b in zip(ref, oth))


def assert_same_grads(reference, other, atol: float = 1e-5) -> float:
    """Raise with the numbers when gradients differ by more than `atol`; return the largest difference."""
    diff = max_grad_diff(reference, other)
    if not diff <= atol:
        raise AssertionError(f"gradients differ from one device by {diff:.2e} (allowed {atol:.0e})")
    return diff
