"""Per-layer costs on a GPU you do not have, from the layer's own operations.

A layer runs forward (and backward) once on the meta device while a dispatch mode records every kernel it would
launch: matrix multiplies and convolutions with their FLOPs (`torch.utils.flop_counter`'s formulas), fused
attention (`scaled_dot_product_attention`, caught before it decomposes) with its FLOPs, and every other operation
(normalization, activations, softmax, dropout, element-wise, casts, the loss) with the bytes it reads and writes.
Views cost nothing. Each kernel then takes the longer of its two roofs on the target GPU,

    matmul:    max(FLOPs / (sustained matmul rate x `matmul` efficiency), bytes / sustained bandwidth)
    conv:      the same at the `conv` efficiency (cuDNN convolutions reach less of the matmul rate; a GPU's own
               `conv_efficiency` where one is fitted)
    attention: fused SDPA at the `attention` efficiency; eager attention is its own matmuls and softmax kernels
    memory:    bytes / the memory bandwidth element-wise kernels sustain (measured per GPU)

and never less than one kernel launch (`launch_us`: the GPU waits for the CPU when kernels are shorter than it
takes to issue them). The sustained matmul rates per GPU and dtype are measured (data/hardware.json `gpus`); the
efficiency constants are named, each with its source or the one published figure it is fitted on
(data/hardware.json `efficiency`, `helpers.hardware.efficiency()`). The optimizer step is memory-bound: it reads
and writes each parameter's state once (`OPTIMIZER_BYTES_PER_PARAM`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, flop_registry

from helpers.dtypes import BYTES, DTYPES
from helpers.hardware import Efficiency, efficiency, gpu_named
from helpers.sizing.gpus import MATMUL_DTYPES, Gpu
from helpers.simulate.workload import LayerCost, Workload

# bytes read and written per parameter by one optimizer step (weights, gradient, state; read and written once)
OPTIMIZER_BYTES_PER_PARAM = {"fp32 + SGD": 12, "fp32 + SGD momentum": 20, "fp32 + Adam": 28,
                             "mixed precision + Adam": 28}  # fp16 grad read + fp16 weight written + fp32 state
CONV_OPS = frozenset({torch.ops.aten.convolution, torch.ops.aten.convolution_backward})
FREE_OPS = frozenset({torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty,
                      torch.ops.aten.empty_strided, torch.ops.aten._unsafe_view, torch.ops.aten.lift_fresh})
GATHER_OPS = frozenset({torch.ops.aten.embedding})  # reads only the rows it gathers: as many bytes as it writes


@dataclass(frozen=True)
class Kernel:
    """One kernel a layer launches: its kind (matmul, conv, attention or memory), FLOPs, bytes moved and bytes of
    its output."""

    kind: str
    flops: float
    nbytes: float
    written: float = 0.0


@dataclass(frozen=True)
class LayerTrace:
    """What one layer launches on a batch: its forward and backward kernels and the bytes of its output."""

    forward: tuple[Kernel, ...]
    backward: tuple[Kernel, ...]
    output_bytes: int

    @property
    def saved_bytes(self) -> float:
        """The bytes its forward kernels write: an estimate of what autograd keeps for the backward (each kernel's
        output, the largest share of which backward reads again)."""
        return sum(k.written for k in self.forward)


def _nbytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(values)[0] if isinstance(t, torch.Tensor))


class _FusedAttention(torch.autograd.Function):
    """Stands in for a fused SDPA kernel on the meta device (where SDPA would decompose into its math): records one
    attention kernel forward (4*b*h*s_q*s_k*d FLOPs) and one backward (2.5x: the fused backward recomputes the
    scores), each moving q, k, v, the output (and their gradients) once."""

    @staticmethod
    def forward(ctx, recorder, q, k, v):
        ctx.shapes = (q, k, v)
        flops = 4 * q.shape[:-1].numel() * k.shape[-2] * q.shape[-1]
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        ctx.flops, ctx.nbytes = flops, _nbytes((q, k, v, out))
        recorder.append(Kernel("attention", flops, ctx.nbytes, _nbytes(out)))
        return out

    @staticmethod
    def backward(ctx, grad):
        _AsOnCuda.recording[-1].append(Kernel("attention", 2.5 * ctx.flops, 2 * ctx.nbytes, ctx.nbytes))
        return None, *(t.new_empty(t.shape) for t in ctx.shapes)


class _Recorder(TorchDispatchMode):
    """Records every aten kernel dispatched: FLOPs for matmuls and convolutions, bytes for the rest."""

    def __init__(self):
        super().__init__()
        self.kernels: list[Kernel] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or packet in FREE_OPS:
            return out
        written = _nbytes(out)
        if packet in flop_registry:
            kind = "conv" if packet in CONV_OPS else "matmul"
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.kernels.append(Kernel(kind, flops, _nbytes((args, kwargs)) + written, written))
        elif packet in GATHER_OPS:
            self.kernels.append(Kernel("memory", 0.0, 2 * written, written))
        else:
            self.kernels.append(Kernel("memory", 0.0, _nbytes((args, kwargs)) + written, written))
        return out


class _AsOnCuda(TorchFunctionMode):
    """Runs the functions whose CUDA kernel is fused but which decompose on the meta device as CUDA runs them:
    SDPA as one fused attention kernel (`_FusedAttention`), dropout as `native_dropout` (one kernel writing the
    output and its mask, instead of bernoulli, divide and multiply)."""

    recording: list[list[Kernel]] = []  # the kernel lists of the modes entered, innermost last (backward's too)

    def __init__(self, recorder: list[Kernel]):
        super().__init__()
        self.recorder = recorder

    def __enter__(self):
        _AsOnCuda.recording.append(self.recorder)
        return super().__enter__()

    def __exit__(self, *exc):
        _AsOnCuda.recording.pop()
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            return _FusedAttention.apply(self.recorder, q, k, v)
        if func is torch.nn.functional.dropout:
            x, p, training = (list(args) + [kwargs.get("p", 0.5), kwargs.get("training", True)])[:3]
            if training and p > 0 and not kwargs.get("inplace", False):
                return torch.ops.aten.native_dropout(x, p, True)[0]
        return func(*args, **kwargs)


def _on_meta(layer: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """The layer on the meta device (a copy unless it already is), in `dtype` if given."""
    if not all(t.is_meta for t in [*layer.parameters(), *layer.buffers()]):
        layer = copy.deepcopy(layer).to("meta")
    return layer.to(dtype) if dtype is not None else layer


def trace_kernels(layers: Sequence[nn.Module], sample: torch.Tensor, dtype: str = "fp32", train: bool = True,
                  input_grad: bool = False) -> list[LayerTrace]:
    """The kernels each layer launches forward and backward on the batch `sample` (the first layer's input; its
    first dimension counts samples), run on the meta device in `dtype`, in training mode (dropout included) unless
    `train=False`. The first layer's input gets a gradient only with `input_grad` (a model's input has none)."""
    if sample.dim() == 0 or sample.shape[0] < 1:
        raise ValueError("the sample must be a batch: its first dimension counts samples")
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {MATMUL_DTYPES}")
    x = sample.to("meta", DTYPES[dtype]) if sample.is_floating_point() else sample.to("meta")
    traced = []
    for i, layer in enumerate(layers):
        layer = _on_meta(layer, DTYPES[dtype]).train(train)
        grad_in = x.is_floating_point() and (i > 0 or input_grad)
        x_in = x.detach().requires_grad_(grad_in)
        forward, backward = _Recorder(), _Recorder()
        with forward, _AsOnCuda(forward.kernels):
            y = layer(x_in)
        with backward, _AsOnCuda(backward.kernels):
            if y.requires_grad:
                y.backward(torch.ones_like(y))
        traced.append(LayerTrace(tuple(forward.kernels), tuple(backward.kernels), _nbytes(y)))
        x = y.detach()
    return traced


def trace_call(call: Callable[[], object]) -> tuple[Kernel, ...]:
    """Every kernel `call()` launches, forward and any backward it runs, on the meta device (its tensors and modules
    must be there): a benchmark's timed statement traced as it is written, e.g. one that calls `backward()` on a
    module whose gradients already exist, so that autograd adds the new ones into them (kernels a model trace with
    fresh gradients, `trace_kernels`, does not see)."""
    recorder = _Recorder()
    with recorder, _AsOnCuda(recorder.kernels):
        call()
    return tuple(recorder.kernels)


def kernel_s(kernel: Kernel, gpu: Gpu, dtype: str, eff: Efficiency) -> float:
    """Seconds of one kernel on `gpu`: the longer of its compute and memory roofs, and at least one launch."""
    memory_s = kernel.nbytes / gpu.memory_bandwidth
    if kernel.kind == "memory":
        return max(memory_s, eff.launch_s)
    conv = gpu.conv_efficiency if gpu.conv_efficiency is not None else eff.conv
    share = {"matmul": eff.matmul, "conv": conv, "attention": eff.attention}[kernel.kind]
    return max(kernel.flops / (gpu.flops(dtype) * share), memory_s, eff.launch_s)


def kernels_s(kernels: Sequence[Kernel], gpu: Gpu, dtype: str, eff: Efficiency | None = None) -> float:
    """Seconds of a sequence of kernels run one after another on `gpu`."""
    eff = eff or efficiency()
    return sum(kernel_s(k, gpu, dtype, eff) for k in kernels)


def step_s(kernels: Sequence[Kernel], gpu: Gpu, dtype: str, batch: int, eff: Efficiency | None = None) -> float:
    """Per-sample seconds of a layer's kernels (traced on `batch` samples) inside a whole training step: their time
    on `gpu` over the `framework` share."""
    eff = eff or efficiency()
    return kernels_s(kernels, gpu, dtype, eff) / batch / eff.framework


def optimizer_s(n_params: int, recipe: str, gpu: Gpu) -> float:
    """One optimizer step over `n_params`: memory-bound, each parameter's state read and written once."""
    if recipe not in OPTIMIZER_BYTES_PER_PARAM:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {list(OPTIMIZER_BYTES_PER_PARAM)}")
    return OPTIMIZER_BYTES_PER_PARAM[recipe] * n_params / gpu.memory_bandwidth


def workload_from_traces(layers: Sequence[tuple[str, nn.Module, int]], traces: Sequence[LayerTrace], batch: int,
                         gpu: Gpu, dtype: str, recipe: str, eff: Efficiency | None = None) -> Workload:
    """Per-sample forward and backward seconds of each traced layer inside a training step (`step_s`), its
    parameters, saved activations (`LayerTrace.saved_bytes`) and output bytes, each layer repeated as often as
    given; the optimizer step memory-bound."""
    eff, costs = eff or efficiency(), []
    for (name, module, repeats), t in zip(layers, traces):
        cost = LayerCost(name, step_s(t.forward, gpu, dtype, batch, eff), step_s(t.backward, gpu, dtype, batch, eff),
                         sum(p.numel() for p in module.parameters()), t.saved_bytes / batch, t.output_bytes / batch,
                         max(1, len(list(module.parameters()))))
        costs += [cost] if repeats == 1 else [replace(cost, name=f"{name} {i}") for i in range(repeats)]
    n_params = sum(c.params for c in costs)
    return Workload(tuple(costs), recipe, optimizer_s(n_params, recipe, gpu))


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


def roofline_s(flops: float, nbytes: float, gpu: Gpu, dtype: str, eff: Efficiency | None = None) -> float:
    """Seconds for `flops` of matmuls and `nbytes` of memory traffic as one kernel on `gpu`: whichever roof is
    lower (for a whole layer's totals; `kernels_s` times a layer kernel by kernel)."""
    return kernel_s(Kernel("matmul", flops, nbytes), gpu, dtype, eff or efficiency())


def weight_gradient_s(gpu: Gpu | str, rows: int, fan_in: int, fan_out: int, k: int,
                      dtype: str = "bf16") -> tuple[float, float]:
    """One linear layer's weight gradient over `k` micro-batches of `rows` rows each on `gpu`: (k products, each
    read grad and input and add into .grad; the rows stacked and one product), batched weight passes
    (`split_backward.run_batched`). The product's FLOPs are the same either way; stacking saves k-1 reads and
    writes of the fan_out x fan_in gradient and k-1 launches, and costs a copy of both operands. So it pays where a
    micro-batch's rows are few enough that the product is memory-bound (rows below about the GPU's FLOPs per byte),
    not where it is compute-bound."""
    gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
    eff, size = efficiency(), BYTES[dtype]
    flops, operands, grad = 2.0 * rows * fan_in * fan_out, size * rows * (fan_in + fan_out), size * fan_in * fan_out
    separate = sum(kernel_s(Kernel("matmul", flops, operands + grad * (1 if i == 0 else 2)), gpu, dtype, eff)
                   for i in range(k))
    stack = kernel_s(Kernel("memory", 0.0, 2 * k * operands), gpu, dtype, eff)
    batched = stack + kernel_s(Kernel("matmul", k * flops, k * operands + grad), gpu, dtype, eff)
    return separate, batched


def on_gpu(workload: Workload, flops: Sequence[tuple[float, float]], gpu: Gpu | str, dtype: str = "bf16",
           value_bytes_here: int = 4) -> Workload:
    """`workload` (e.g. profiled on this rig) as it would run on `gpu` in `dtype`, from per-layer FLOP totals only:
    activation and output bytes rescaled from `value_bytes_here` bytes per value (4: the profiler runs in fp32) to
    the dtype's, each layer's time from the roofline of its totals, the optimizer step (Adam) from memory
    bandwidth. Coarser than `trace_kernels`, which sees each kernel."""
    gpu = gpu_named(gpu) if isinstance(gpu, str) else gpu
    if dtype not in MATMUL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {MATMUL_DTYPES}")
    if len(flops) != len(workload.layers):
        raise ValueError(f"{len(flops)} FLOP counts for {len(workload.layers)} layers")
    scale = BYTES[dtype] / value_bytes_here
    layers = []
    for layer, (f_flops, b_flops) in zip(workload.layers, flops):
        activations, output = layer.activations * scale, layer.output * scale
        written = activations + output
        layers.append(replace(layer, forward_s=roofline_s(f_flops, written, gpu, dtype),
                              backward_s=roofline_s(b_flops, 2 * written, gpu, dtype),
                              activations=activations, output=output))
    return replace(workload, layers=tuple(layers), optimizer_s=optimizer_s(workload.n_params, "fp32 + Adam", gpu))
