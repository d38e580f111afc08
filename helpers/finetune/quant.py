"""The 4-bit NF4 frozen base of QLoRA (Dettmers et al. 2023), from torchao; `tensor_bytes` counts its real bytes.

Why torchao's `NF4Tensor` and not bitsandbytes' `Linear4bit`: both quantize and run on this CPU rig with torch 2.13
(torchao 0.18, bitsandbytes 0.50.2; tried side by side), but only torchao's composes with FSDP2 as it ships.
`NF4Tensor` implements `fsdp_pre_all_gather` / `fsdp_post_all_gather`, so `fully_shard` shards its packed 4-bit
codes *and* its block scales over the ranks and all-gathers them as they are (uint8: 8x fewer bytes on the link
than fp32). bitsandbytes keeps the block scales in a `QuantState` on the Python object beside a packed tensor in a
float "quant storage" dtype; under `fully_shard` the parameter is replaced by a plain DTensor and the state is gone
("quant_state is required" in forward) unless the `Params4bit` was made with `module=` so the layer can reattach it;
the scales then stay whole on every rank, FSDP's `param_dtype` must equal the quant storage or the packed bytes are
cast into garbage (bitsandbytes PR #970), its CPU 4-bit matmul first tries to fetch a kernel from a model hub, and
in eval mode on CPUs with AVX512-BF16 its forward repacks `weight.data` in place. torchao's NF4 is the QLoRA
format torchtune trained with FSDP2 (torchtune itself no longer installs with torchao >= 0.18, so nothing here uses
it).

The layout: blocks of `BLOCK` values share one scale; the scales are quantized again to 8 bits in blocks
(`scaler_block_size`, double quantization). FSDP2 cuts every inner tensor into equal shards along dim 0, so the
number of blocks, of scale blocks and the rows must all divide by the ranks: `nf4_layout` picks a scale block that
works for up to `MAX_SHARDS` ranks, the same on every rig, so one device and two ranks hold the very same bytes.
"""
from __future__ import annotations

import importlib.util
import math
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.runtime.host import preparation_device

BLOCK = 64  # values per NF4 block (QLoRA's and torchao's default)
SCALER_BLOCK = 256  # scales per double-quantization block (torchao's default), or the largest that divides
MAX_SHARDS = 8  # NF4 weights are laid out so that FSDP2 can shard them over up to this many ranks


def nf4_missing() -> str | None:
    """Why NF4 cannot be used here, or None when it can (torchao is an optional dependency)."""
    if importlib.util.find_spec("torchao") is None:
        return ("QLoRA needs torchao for its 4-bit NF4 weights, and it is not installed: "
                "pip install --no-deps torchao==0.18.0 (see requirements.txt), or use method='lora'")
    return None


def _nf4():
    """torchao's NF4 module (imported quietly: `helpers` silences torchao's logs about GPU kernels a CPU lacks)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def nf4_layout(shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | str:
    """(block size, scale block size) for a weight of `shape`, or the reason it cannot be NF4 and sharded."""
    numel = math.prod(shape)
    if numel % BLOCK or shape[0] % MAX_SHARDS:
        return f"{tuple(shape)} does not split into {BLOCK}-value blocks and {MAX_SHARDS} equal row shards"
    blocks = numel // BLOCK
    for scaler in (SCALER_BLOCK, 128, 64, 32, 16, 8, 4, 2, 1):
        if blocks % scaler == 0 and (blocks // scaler) % MAX_SHARDS == 0:
            return BLOCK, scaler
    return f"{tuple(shape)}: its {blocks} blocks do not split into {MAX_SHARDS} equal shards of scale blocks"


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as an NF4Tensor (on the meta device too: shapes only), dequantizing to the weight's dtype; a host
    weight is quantized on the rank's GPU inside `helpers.runtime.host.preparing_on` and comes back to the host."""
    layout = nf4_layout(weight.shape)
    if isinstance(layout, str):
        raise ValueError(f"cannot store this weight in NF4: {layout}")
    gpu = preparation_device() if weight.device.type == "cpu" else None
    if gpu is not None:
        return _nf4().to_nf4(weight.detach().to(gpu).contiguous(), *layout).to(weight.device)
    return _nf4().to_nf4(weight.detach().contiguous(), *layout)


def dequantize(t: torch.Tensor) -> torch.Tensor:
    """The values an NF4 weight computes with (any other tensor as it is)."""
    return t.get_original_weight() if is_nf4(t) else t


class NF4Linear(nn.Linear):
    """A frozen nn.Linear whose weight is an NF4Tensor: forward dequantizes it block by block (torchao's
    `linear_nf4`, which saves only the 4-bit weight for backward). An nn.Linear, so peft wraps it like any other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _nf4().linear_nf4(x, self.weight)
        return out + self.bias if self.bias is not None else out


def quantize_linear(linear: nn.Linear) -> NF4Linear:
    """`linear` with its weight in NF4 (bias kept as it is), frozen; on whatever device it is (meta included)."""
    q = NF4Linear.__new__(NF4Linear)
    nn.Module.__init__(q)
    q.in_features, q.out_features = linear.in_features, linear.out_features
    q.weight = nn.Parameter(to_nf4(linear.weight), requires_grad=False)
    q.bias = nn.Parameter(linear.bias.detach(), requires_grad=False) if linear.bias is not None else None
    return q


class _LiveBytes(TorchDispatchMode):
    """Every storage the operators inside this mode allocate, counted while a tensor holds it (a view adds
    nothing), and the most held at once: the peak of a computation's temporaries on any device, CPU included."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # data_ptr -> [bytes, tensors holding it]
        self.held = self.peak = 0

    def _release(self, ptr: int) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.held -= entry[0]
            del self.live[ptr]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.live:
                self.live[ptr] = [t.untyped_storage().nbytes(), 0]
                self.held += self.live[ptr][0]
                self.peak = max(self.peak, self.held)
            self.live[ptr][1] += 1
            weakref.finalize(t, self._release, ptr)
        return out


def dequantization_peak(dtype: torch.dtype, shape: tuple[int, int] = (1024, 1024)) -> float:
    """The most bytes per weight element torchao's NF4 dequantization (`get_original_weight`, which `linear_nf4`
    runs in forward and again in backward) holds at once, its result included: measured on a weight of `shape` in
    `dtype` (the same operators run on a GPU: torchao decodes NF4 with plain PyTorch ops, through int64 indices)."""
    weight = to_nf4(torch.randn(shape, dtype=dtype))
    return _peak_per_element(lambda: dequantize(weight), weight.numel())


def quantization_peak(dtype: torch.dtype, shape: tuple[int, int] = (1024, 1024)) -> float:
    """The most bytes per weight element torchao's NF4 quantization (`to_nf4`) holds at once beside its input, its
    result included: what a rank needs on the host, for its largest weight, while it quantizes a layer it streams
    from a checkpoint (torchao finds each value's nearest of the 16 NF4 levels over a [values, 16] table)."""
    weight = torch.randn(shape, dtype=dtype)
    return _peak_per_element(lambda: to_nf4(weight), weight.numel())


def quantization_workspace(dtype: torch.dtype) -> tuple[int, float, float]:
    """torchao's NF4 quantization of an n-element weight holds `per_chunk * min(n, chunk) + per_element * n` bytes
    at its peak beside its input: it finds the nearest of the 16 levels chunk by chunk (CHUNK_SIZE elements: the
    [chunk, 16] table is the first term, the same for every weight of a chunk or more) and writes the packed values
    and scalers of the whole weight (the second). Returns (chunk, per_chunk, per_element), measured on weights of one
    chunk and of four; a single chunk's figure priced a 70B layer's 235 M-element weight at 15 GiB instead of 1.2."""
    chunk = _nf4().CHUNK_SIZE
    one, four = (quantization_peak(dtype, (rows, chunk // 1024)) * rows * (chunk // 1024) for rows in (1024, 4096))
    per_element = (four - one) / (3 * chunk)
    return chunk, one / chunk - per_element, per_element


def _peak_per_element(compute, elements: int) -> float:
    """The peak bytes `compute()` allocates (counted by `_LiveBytes`), per weight element."""
    with _LiveBytes() as counter:
        result = compute()
    del result
    return counter.peak / elements
