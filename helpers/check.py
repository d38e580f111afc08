"""Correctness first: every strategy is compared with one device (same loss, gradients within 1e-5 in fp32)."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the gradients (a snapshot: later steps must not change it)."""
    return [p.grad.detach().cpu().clone() if p.grad is not None else torch.zeros_like(p, device="cpu")
            for p in params]


def _grads(source: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """A module's gradients, or a list that already holds gradient tensors (e.g. returned by ranks)."""
    if isinstance(source, nn.Module):
        return grads_of(source.parameters())
    return [g.detach().cpu() for g in source]


def max_grad_diff(reference: nn.Module | Iterable[torch.Tensor], other: nn.Module | Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between matching gradients (parameters in the same order). Each side is a
    module (its parameters' .grad) or a list of gradient tensors."""
    ref, oth = _grads(reference), _grads(other)
    if len(ref) != len(oth):
        raise ValueError(f"{len(ref)} reference parameters but {len(oth)} to compare")
    return max((a - b).abs().max().item() for a, b in zip(ref, oth))


def assert_same_grads(reference, other, atol: float = 1e-5) -> float:
    """Raise with the numbers when gradients differ by more than `atol`; return the largest difference."""
    diff = max_grad_diff(reference, other)
    if not diff <= atol:
        raise AssertionError(f"gradients differ from one device by {diff:.2e} (allowed {atol:.0e})")
    return diff


def one_device_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn) -> tuple[float, list[torch.Tensor]]:
    """The reference every strategy is checked against: loss and gradients of the whole batch on one device."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(x.to(device)), y.to(device))
    loss.backward()
    return loss.item(), grads_of(model.parameters())
