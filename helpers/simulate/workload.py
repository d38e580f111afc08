"""What the simulator executes: per-layer costs of one sample, from a measured profile or from plain lists.

Costs are kept per sample because every strategy cuts the global batch differently (micro-batches, replicas):
a layer's time and bytes for b samples are b times its per-sample figures. That linear model is what the
simulator assumes; tiny micro-batches run less efficiently than that on real hardware (measured on the CPU rig:
8 micro-batches in one thread take about 20% longer than one batch), so profile at the micro-batch size you plan.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from helpers.sizing.state import BYTES_PER_PARAM
from helpers.profile import Profile


@dataclass(frozen=True)
class LayerCost:
    """One layer, for one sample: seconds of forward and backward, parameter count, bytes saved for backward and
    bytes of its output (what crosses a stage boundary placed after it); `tensors`: how many parameter tensors hold
    its parameters (what is sent tensor by tensor costs one latency each); `weight_share`: the part of its backward
    that computes weight gradients (what a zero-bubble schedule defers), by default half for a layer with
    parameters (a matmul's input and weight gradients cost the same) and none without. `frozen_bytes`: parameters
    that do not train (LoRA's base in bf16, QLoRA's packed 4-bit codes), as stored: what FSDP2 shards, gathers and,
    offloading, copies to the GPU; `params` counts only the ones that train (gradients, optimizer, DDP's buckets)."""

    name: str
    forward_s: float
    backward_s: float
    params: int = 0
    activations: float = 0.0
    output: float = 0.0
    tensors: int = 1
    weight_share: float | None = None
    frozen_bytes: float = 0.0

    @property
    def weight_s(self) -> float:
        """Seconds of the weight-gradient part of the backward."""
        share = self.weight_share if self.weight_share is not None else (0.5 if self.params else 0.0)
        return self.backward_s * share

    def __post_init__(self):
        for what, value in (("forward", self.forward_s), ("backward", self.backward_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"layer {self.name!r}: {what} cost must be a positive number of seconds, got {value}")
        for what, value in (("parameter count", self.params), ("activation bytes", self.activations),
                            ("output bytes", self.output), ("frozen parameter bytes", self.frozen_bytes)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"layer {self.name!r}: {what} must be >= 0, got {value}")
        if not (isinstance(self.tensors, int) and self.tensors >= 1):
            raise ValueError(f"layer {self.name!r}: tensor count must be a whole number >= 1, got {self.tensors!r}")
        if self.weight_share is not None and not 0 <= self.weight_share <= 1:
            raise ValueError(f"layer {self.name!r}: the weight gradients' share of the backward must be between 0 and "
                             f"1, got {self.weight_share}")


@dataclass(frozen=True)
class Workload:
    """A model to simulate: its layers in order, the training recipe (bytes per parameter for weights, gradients
    and optimizer state, `helpers.sizing.state.BYTES_PER_PARAM`), the seconds of one optimizer step over all
    parameters on one device (and the bytes that step reads and writes, what it costs on the host's memory under CPU
    offload), how fast the device copies memory (the data-parallel engines copy gradients and
    parameters into and out of their communication buffers; infinite: free), and what splitting a backward costs
    beyond it (`split_overhead`)."""

    layers: tuple[LayerCost, ...]
    recipe: str = "fp32 + Adam"
    optimizer_s: float = 0.0
    copy_bandwidth: float = math.inf  # bytes/s the device copies memory at (data-parallel engines' buffer copies)
    # a split backward's input pass + weight pass over the plain backward it replaces, minus 1, for a stage whose
    # input needs a gradient: one autograd call per group of forks and each weight gradient reading its saved input
    # and output gradient a second time (measured: helpers.simulate.calibrate.split_backward_overhead); 0: free
    split_overhead: float = 0.0
    optimizer_bytes: float = 0.0  # bytes one optimizer step reads and writes over every trainable parameter
    # bytes per trainable parameter of a shard kept on the host (CPU offload): what crosses PCIe before each gather
    # (the fp32 master under mixed precision, which the all-gather's copy-in casts); 0: the recipe's weight bytes
    host_bytes_per_param: float = 0.0

    def __post_init__(self):
        if not self.layers:
            raise ValueError("a workload needs at least one layer")
        if self.recipe not in BYTES_PER_PARAM:
            raise ValueError(f"unknown recipe {self.recipe!r}; choose one of {list(BYTES_PER_PARAM)}")
        if not (self.optimizer_s >= 0 and math.isfinite(self.optimizer_s)):
            raise ValueError(f"optimizer step time must be >= 0 seconds, got {self.optimizer_s}")
        for what, value in (("the optimizer step's bytes", self.optimizer_bytes),
                            ("a host shard's bytes per parameter", self.host_bytes_per_param)):
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{what} must be >= 0, got {value}")
        if not self.copy_bandwidth > 0:
            raise ValueError(f"copy bandwidth must be positive (bytes per second), got {self.copy_bandwidth}")
        if not (self.split_overhead >= 0 and math.isfinite(self.split_overhead)):
            raise ValueError(f"a split backward's overhead must be a fraction >= 0, got {self.split_overhead}")

    @property
    def bytes_per_param(self) -> tuple[int, int, int]:
        """(weights, gradients, optimizer state) bytes per parameter."""
        return BYTES_PER_PARAM[self.recipe]

    @property
    def n_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    def time_costs(self) -> list[float]:
        """Forward + backward seconds per layer and sample: what a balanced cut balances."""
        return [layer.forward_s + layer.backward_s for layer in self.layers]

    def rescaled(self, forward_s: float, backward_s: float) -> "Workload":
        """The same layers with their forward (backward) times scaled by one factor so that one sample's forward
        (backward) through all of them takes `forward_s` (`backward_s`) seconds: the per-layer profile's shape,
        a whole-model measurement's total. A profile runs each layer alone, over and over, so its weights stay in
        cache; a training step streams every layer's weights and gradients through memory once per micro-batch,
        which costs more the smaller the micro-batch (`helpers.bench` measures both and reports the factor)."""
        for what, value in (("forward", forward_s), ("backward", backward_s)):
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"the whole model's {what} time must be a positive number of seconds, got {value}")
        f = forward_s / sum(layer.forward_s for layer in self.layers)
        b = backward_s / sum(layer.backward_s for layer in self.layers)
        return replace(self, layers=tuple(replace(layer, forward_s=layer.forward_s * f, backward_s=layer.backward_s * b)
                                          for layer in self.layers))

    @classmethod
    def from_profile(cls, profile: Profile, recipe: str = "fp32 + Adam", optimizer_s: float = 0.0,
                     bytes_per_param: int = 4) -> "Workload":
        """From `helpers.profile.profile_layers`: its times and bytes are for `profile.batch` samples; its
        parameter bytes are converted to counts with `bytes_per_param` (4 for the fp32 the profiler runs in)."""
        b = profile.batch
        if b < 1:
            raise ValueError(f"the profile's batch must be at least 1, got {b}")
        return cls(tuple(LayerCost(p.name, p.forward_s / b, p.backward_s / b, p.params // bytes_per_param,
                                   p.activations / b, p.output / b) for p in profile.layers), recipe, optimizer_s)

    @classmethod
    def from_lists(cls, forward_s: Sequence[float], backward_s: Sequence[float], params: Sequence[int] | None = None,
                   activations: Sequence[float] | None = None, output: Sequence[float] | None = None,
                   recipe: str = "fp32 + Adam", optimizer_s: float = 0.0) -> "Workload":
        """From plain per-layer lists, all per sample (parameters as counts, the rest in seconds and bytes)."""
        n = len(forward_s)
        columns = {"backward_s": backward_s, "params": params, "activations": activations, "output": output}
        for what, column in columns.items():
            if column is not None and len(column) != n:
                raise ValueError(f"{len(column)} entries in {what} for {n} layers in forward_s")
        pick = lambda column, i: 0 if column is None else column[i]  # noqa: E731
        return cls(tuple(LayerCost(f"layer {i}", forward_s[i], backward_s[i], pick(params, i), pick(activations, i),
                                   pick(output, i)) for i in range(n)), recipe, optimizer_s)
