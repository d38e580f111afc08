"""Activation checkpointing: keep a block's input, drop what it saves inside, recompute it during backward.

Built on `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`. The checkpointed block's input is kept
through autograd's saved-tensor mechanism, so the memory ledger counts it; what the block saves inside is not kept.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from helpers.pipeline.stages import as_layers


class Checkpointed(nn.Module):
    """Runs `module` under activation checkpointing (non-reentrant, as PyTorch recommends)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.module(x)
        return checkpoint(self.module, x, use_reentrant=False)


def checkpoint_in_place(module: nn.Module) -> nn.Module:
    """`module` itself, its forward now run under activation checkpointing; names, parameters and class unchanged,
    so FSDP2 can still shard it and its all-gather hooks stay outside the recomputed region (torchtitan's order:
    checkpoint each block, then shard it). Any arguments (a layer's context too) are passed through."""
    forward = module.forward

    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed
    return module


def checkpoint_layers(model: nn.Module | Sequence[nn.Module], which: Iterable[int]) -> nn.Sequential:
    """The same layers (parameters shared, not copied) with the layers at indices `which` checkpointed."""
    layers = as_layers(model)
    chosen = set(which)
    bad = sorted(i for i in chosen if not 0 <= i < len(layers))
    if bad:
        raise ValueError(f"layer indices {bad} are outside the model's layers 0..{len(layers) - 1}")
    return nn.Sequential(*(Checkpointed(l) if i in chosen else l for i, l in enumerate(layers)))


def every_kth(candidates: Sequence[int], k: int) -> list[int]:
    """Every k-th of the candidate layer indices (k=1: all of them), e.g. the transformer blocks of a stage."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    return list(candidates)[::k]
