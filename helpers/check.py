"""Correctness first: every strategy is compared with one device (same loss, gradients within 1e-5 in fp32)."""
from __future__ import annotations

from typing import Iterable, Sequence

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


def matching_pairs(reference: Sequence[torch.Tensor],
                   other: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The tensors of two runs, paired in order, refused unless they can be compared: a run that returned no
    gradients, fewer than the reference, or tensors of another shape would otherwise compare as "no difference"
    (zip stops at the shorter list; broadcasting hides a missing dimension)."""
    if len(reference) == 0:
        raise ValueError("nothing to compare: the reference holds no tensors")
    if len(reference) != len(other):
        raise ValueError(f"{len(reference)} reference tensors but {len(other)} to compare")
    for i, (a, b) in enumerate(zip(reference, other)):
        if a.shape != b.shape:
            raise ValueError(f"tensor {i}: shape {tuple(b.shape)}, the reference's is {tuple(a.shape)}")
    return list(zip(reference, other))


def max_grad_diff(reference: nn.Module | Iterable[torch.Tensor], other: nn.Module | Iterable[torch.Tensor]) -> float:
    """Largest absolute difference between matching gradients (parameters in the same order). Each side is a
    module (its parameters' .grad) or a list of gradient tensors; different counts, shapes or no gradients at all
    are refused (`matching_pairs`)."""
    return max((a - b).abs().max().item() for a, b in matching_pairs(_grads(reference), _grads(other)))


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
