"""What notebook 07's data-parallel script measures on each rank, beside its training loop (not needed to train).

`Watch(model)` records the first step's whole gradients, the most bytes of gathered (unsharded) weights held at any
layer's forward or backward (FSDP2 only: DDP keeps every weight whole all the time), and, in `report`, the bytes
the rank holds at rest after its last step: its weights, gradients and optimizer state, shards where sharded.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from helpers.sizing.ledger import grad_bytes, optimizer_state_bytes, param_bytes


class Watch:
    """Hooks on each layer of a `fully_shard`-ed model (none on a DDP one); call `gradients(step, model)` after
    each backward and `report(model, optimizer)` at the end."""

    def __init__(self, model: torch.nn.Module):
        self.grads: list[torch.Tensor] | None = None
        self.gathered = 0
        if any(isinstance(p, DTensor) for p in model.parameters()):
            for layer in model:
                layer.register_forward_pre_hook(lambda *_: self._look(model))
                layer.register_full_backward_hook(lambda *_: self._look(model))

    def _look(self, model: torch.nn.Module) -> None:
        unsharded = sum(p.numel() * p.element_size() for p in model.parameters() if not isinstance(p, DTensor))
        self.gathered = max(self.gathered, unsharded)

    def gradients(self, step: int, model: torch.nn.Module) -> None:
        """The first step's gradients, whole (a sharded one gathered: a collective every rank joins), on the CPU."""
        if step == 0:
            self.grads = [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float().cpu().clone()
                          for p in model.parameters()]

    def report(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        state = getattr(optimizer, "optim", optimizer)   # ZeroRedundancyOptimizer: this rank's share
        return {"grads": self.grads, "params": param_bytes(model.parameters()),
                "grad_bytes": grad_bytes(model.parameters()), "optimizer": optimizer_state_bytes(state),
                "gathered": self.gathered}
