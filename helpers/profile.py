"""Per-layer cost of a model: forward and backward time, parameter bytes, saved-activation bytes, output bytes.

The partitioner needs a cost per layer; this measures it on the rig the notebook runs on. Each layer runs on its
own (input cut from the graph, as in a pipeline stage) with warm-up and the median of repeats; CUDA time is
synchronised around each measurement.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.measure import synchronize
from helpers.sizing.ledger import ledger_for, param_bytes, tensor_bytes
from helpers.report import table
from helpers.pipeline.stages import as_layers

COST_KINDS = ("time", "forward", "params", "count", "activations")


@dataclass(frozen=True)
class LayerProfile:
    name: str
    forward_s: float
    backward_s: float
    params: int  # bytes
    activations: int  # bytes saved for backward
    output: int  # bytes of the output: what crosses a boundary placed after this layer

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Profile:
    layers: tuple[LayerProfile, ...]
    device: str
    batch: int

    def costs(self, kind: str = "time") -> list[float]:
        """A cost vector for the partitioner: time (fwd+bwd), forward, params, count, or activations."""
        if kind not in COST_KINDS:
            raise ValueError(f"unknown cost {kind!r}; choose one of {COST_KINDS}")
        pick: dict[str, Callable[[LayerProfile], float]] = {
            "time": lambda p: p.time_s, "forward": lambda p: p.forward_s, "params": lambda p: float(p.params),
            "count": lambda p: 1.0, "activations": lambda p: float(p.activations)}
        return [pick[kind](p) for p in self.layers]

    def memory_bytes(self, state_bytes_per_param_byte: float = 4.0) -> list[int]:
        """Bytes each layer needs on its device in training: weights+grads+optimizer (x4 of the weight bytes for
        fp32 Adam) plus saved activations."""
        return [int(p.params * state_bytes_per_param_byte + p.activations) for p in self.layers]

    def rows(self) -> list[dict]:
        return [{"layer": p.name, "fwd (ms)": p.forward_s * 1e3, "bwd (ms)": p.backward_s * 1e3,
                 "params": p.params, "activations": p.activations, "bytes": p.output} for p in self.layers]

    def __str__(self) -> str:
        return f"profile on {self.device}, batch {self.batch}\n" + table(self.rows())

    def plot(self, ax=None, boundaries: dict[str, Sequence[int]] | None = None, kind: str = "time"):
        """Bars of per-layer cost, with vertical lines at each named split's cut points."""
        import matplotlib.pyplot as plt

        if ax is None:
            _, ax = plt.subplots(figsize=(10, 3))
        costs = self.costs(kind)
        scale, unit = (1e3, "ms") if kind in ("time", "forward") else (1.0, "")
        ax.bar(range(len(costs)), [c * scale for c in costs], color="#4C72B0")
        ax.set_xticks(range(len(costs)), [p.name for p in self.layers], rotation=60, fontsize=7)
        ax.set_ylabel(f"{kind} per layer {unit}".strip())
        for i, (name, cuts) in enumerate((boundaries or {}).items()):
            for j, b in enumerate(cuts):
                ax.axvline(b - 0.5 + 0.06 * i, color=f"C{i + 1}", linestyle="--", label=name if j == 0 else None)
        if boundaries:
            ax.legend(fontsize=7)
        return ax

    def as_dicts(self) -> list[dict]:
        return [asdict(p) for p in self.layers]


class _WithLoss(nn.Module):
    def __init__(self, layer: nn.Module, loss_fn: Callable, target: torch.Tensor):
        super().__init__()
        self.layer, self.loss_fn, self.target = layer, loss_fn, target

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.layer(x), self.target)


def profile_layers(model: nn.Module | Sequence[nn.Module], sample: torch.Tensor, repeats: int = 5, warmup: int = 1,
                   device: torch.device | None = None, loss_fn: Callable | None = None,
                   target: torch.Tensor | None = None) -> Profile:
    """Profile each layer of an ordered model on `device` with input `sample` (a batch of the first layer's input).

    Profile at the batch a stage will really see (the micro-batch of a pipeline). With `loss_fn` and `target`, the
    last layer's cost includes the loss, as the last pipeline stage computes it.
    """
    if (loss_fn is None) != (target is None):
        raise ValueError("give both loss_fn and target, or neither")
    layers = as_layers(model)
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = device or next(layers[0].parameters()).device
    h = sample.to(device)
    out_profiles = []
    for i, layer in enumerate(layers):
        layer.to(device)
        if loss_fn is not None and i == len(layers) - 1:
            layer = _WithLoss(layer, loss_fn, target.to(device))
        fwd, bwd = [], []
        for r in range(warmup + repeats):
            x = h.detach().requires_grad_() if h.is_floating_point() else h
            synchronize(device)
            t0 = time.perf_counter()
            out = layer(x)
            synchronize(device)
            t1 = time.perf_counter()
            grad = torch.ones_like(out) / out.numel()
            out.backward(grad)
            synchronize(device)
            t2 = time.perf_counter()
            if r >= warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        ledger = ledger_for([layer], ["layer"])
        x = h.detach().requires_grad_() if h.is_floating_point() else h
        with ledger.track_activations("layer"):
            out = layer(x)
        act = ledger.live_activations("layer")
        layer.zero_grad(set_to_none=True)
        name = f"{i}:{type(getattr(layer, 'layer', layer)).__name__}"  # the layer's own name, not _WithLoss
        out_profiles.append(LayerProfile(name, statistics.median(fwd), statistics.median(bwd),
                                         param_bytes(layer.parameters()), act, tensor_bytes(out)))
        h = out.detach()
    return Profile(tuple(out_profiles), str(device), int(sample.shape[0]))
