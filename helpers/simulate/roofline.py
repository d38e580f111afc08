"""Per-layer costs on a GPU you do not have: FLOPs counted on the meta device, time from a roofline.

A layer's time is max(FLOPs / sustained FLOP/s, bytes moved / memory bandwidth). The compute roof is what real
transformer layers sustain (data/hardware.json `layer_tflops`: about half of a large matmul's rate, measured on GPT-2
blocks), not the matmul peak: layers also run attention, norms and element-wise kernels. Bytes moved per sample:
the forward writes its saved activations and its output, the backward reads them and writes as much again (2x the
forward). Weight reads are left out: per sample they shrink with the batch, and at training batch sizes activations
dominate. The optimizer step is memory-bound: Adam reads and writes each parameter's weights, gradient and two moments
once, about 28 bytes per parameter for fp32 and for mixed precision alike (an estimate; no kernel launches counted).
"""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Sequence

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from helpers.simulate.hardware import DTYPES, GPU, gpu_named
from helpers.simulate.workload import Workload

ADAM_BYTES_PER_PARAM = 28
VALUE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _on_meta(layer: nn.Module) -> nn.Module:
    """The layer on the meta device (a copy unless it already is): shapes without memory or compute."""
    if all(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
        return layer
    return copy.deepcopy(layer).to("meta")


def layer_flops(layers: Sequence[nn.Module], sample: torch.Tensor) -> list[tuple[float, float]]:
    """(forward, backward) FLOPs per sample of each layer in order, for inputs shaped like `sample` (a batch of the
    first layer's input), counted by `torch.utils.flop_counter.FlopCounterMode` on the meta device."""
    if sample.dim() == 0 or sample.shape[0] < 1:
        raise ValueError("the sample must be a batch: its first dimension counts samples")
    x = sample.to("meta")
    counts = []
    for layer in layers:
        layer = _on_meta(layer)
        x_in = x.detach().requires_grad_() if x.is_floating_point() else x
        with FlopCounterMode(display=False) as forward:
            y = layer(x_in)
        with FlopCounterMode(display=False) as backward:
            if y.requires_grad:
                y.backward(torch.ones_like(y))
        counts.append((forward.get_total_flops() / sample.shape[0], backward.get_total_flops() / sample.shape[0]))
        x = y.detach()
    return counts


def roofline_s(flops: float, nbytes: float, gpu: GPU, dtype: str) -> float:
    """Seconds for `flops` and `nbytes` of memory traffic on `gpu`: whichever roof is lower."""
    return max(flops / gpu.flops(dtype), nbytes / gpu.memory_bandwidth)


def on_gpu(workload: Workload, flops: Sequence[tuple[float, float]], gpu: GPU | str, dtype: str = "bf16",
           value_bytes_here: int = 4) -> Workload:
    """`workload` (e.g. profiled on this rig) as it would run on `gpu` in `dtype`: activation and output bytes
    rescaled from `value_bytes_here` bytes per value (4: the profiler runs in fp32) to the dtype's, each layer's
    time from the roofline, the optimizer step from memory bandwidth."""
    gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {DTYPES}")
    if len(flops) != len(workload.layers):
        raise ValueError(f"{len(flops)} FLOP counts for {len(workload.layers)} layers")
    scale = VALUE_BYTES[dtype] / value_bytes_here
    layers = []
    for layer, (f_flops, b_flops) in zip(workload.layers, flops):
        activations, output = layer.activations * scale, layer.output * scale
        written = activations + output
        layers.append(replace(layer, forward_s=roofline_s(f_flops, written, gpu, dtype),
                              backward_s=roofline_s(b_flops, 2 * written, gpu, dtype),
                              activations=activations, output=output))
    optimizer_s = ADAM_BYTES_PER_PARAM * workload.n_params / gpu.memory_bandwidth
    return replace(workload, layers=tuple(layers), optimizer_s=optimizer_s)
