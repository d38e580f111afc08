"""The memory techniques a 24 GB card needs, as the training loop applies them (`TrainJob` fields):

- `optimizer="adamw-8bit" | "adamw-4bit"`: torchao's low-bit AdamW, its two moments in 8 or 4 bits per number with
  one fp32 scale per block (256 or 128 numbers), over FSDP2's DTensor shards or one device; on bf16 weights it
  rounds each update stochastically into bf16 (no fp32 master copy).
- `optimizer_in_backward=True`: each parameter's optimizer step taken in backward the moment its gradient is whole
  (`register_post_accumulate_grad_hook`, as torchtune's optimizer_in_bwd), and the gradient freed at once: the step
  never holds every gradient together.
- `loss_chunks=N`: the head's matmul and the cross entropy computed for N chunks of tokens, each recomputed in
  backward (`torch.utils.checkpoint`): the whole batch's logits never exist.
- `activation_offload=True`: what autograd saves in forward moved to host memory (pinned on CUDA), as
  `torch.autograd.graph.save_on_cpu` does, and counted in the ledger as host bytes, not device bytes.

The training planner (helpers.finetune.memory_plan) takes the same optimizer names; its `techniques=` names the
other three optimizer-in-backward, chunked-loss and activation-offload.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from helpers.models.data import lm_loss_sum
from helpers.models.layered import Stage, call_layer
from helpers.sizing.ledger import MemoryLedger

LOW_BIT = {"adamw-8bit": "AdamW8bit", "adamw-4bit": "AdamW4bit"}  # job optimizer -> torchao.optim class


# --- low-bit AdamW ------------------------------------------------------------------------------------------------

def low_bit_adamw(name: str, params: Sequence[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """torchao's 8- or 4-bit AdamW over `params` (plain tensors or FSDP2's DTensor shards). A tensor under 4096
    numbers, or not a whole number of blocks, keeps its moments in the weights' dtype (torchao's rule). bf16
    weights: the update is rounded stochastically into bf16, so small steps are not lost where fp32 master weights
    would not fit."""
    params = list(params)
    bf16 = any(p.dtype == torch.bfloat16 for p in params)
    with _host_default():  # its learning rate is a tensor made without device=
        return _fp32_state(name)(params, lr=lr, bf16_stochastic_round=bf16)


def _fp32_state(name: str) -> type:
    """torchao's low-bit AdamW class `name` with two fixes for FSDP2's DTensor shards: its quantized moments
    dequantize to fp32 whatever the weights' dtype (the stored bytes are the same: codes and fp32 scales; torchao's
    4-bit state in bf16 fails inside a DTensor at torch.compile, "OptimState4bit ... aten.view.dtype"), and its
    compiled step kept out of AOTAutograd's cache, which cannot tell torchao's state subclasses of different shapes
    apart ("does not implement _stable_hash_for_caching") and hands a 4-bit shard another shape's graph ("wrong
    number of dimensions"). torchao makes its step counts and code tables without device=, host tensors on a GPU
    rank: `_host_default`."""
    import torchao.optim
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    cls = getattr(torchao.optim, LOW_BIT[name])
    state = OptimState8bit if name == "adamw-8bit" else OptimState4bit

    def fp32_zeros(p: torch.Tensor, signed: bool, block_size: int):
        return state.zeros(p.shape, signed, block_size, p.device, dtype=torch.float32)

    def step(self, closure=None):
        with torch._functorch.config.patch(enable_autograd_cache=False), _host_default():
            return cls.step(self, closure)

    return type(cls.__name__, (cls,), {"_subclass_zeros": staticmethod(fp32_zeros), "step": step})


def _host_default():
    """The host as default device where a device-strict rank (helpers.runtime.strict) made it `meta`: what a tensor
    created without device= is on a GPU rank; elsewhere nothing changes."""
    from contextlib import nullcontext

    return torch.device("cpu") if torch.get_default_device().type == "meta" else nullcontext()


def low_bit_state_bytes(numel: int, name: str, weight_bytes: int = 4) -> int:
    """Optimizer-state bytes of one tensor of `numel` numbers (its local shard under FSDP2), as the ledger counts
    them: each of the two moments 1 (8-bit) or 0.5 (4-bit) byte per number, one fp32 scale per block of 256 (8-bit)
    or 128 (4-bit) numbers and the code's lookup table (256 or 16 fp32 values); a tensor under 4096 numbers or not a
    whole number of blocks keeps two moments in the weights' dtype (`weight_bytes`). Plus the fp32 step count."""
    bits, block = (8, 256) if name == "adamw-8bit" else (4, 128)
    if numel < 4096 or numel % block:
        return 2 * numel * weight_bytes + 4
    return 2 * (numel * bits // 8 + numel // block * 4 + 2 ** bits * 4) + 4


# --- optimizer in backward ----------------------------------------------------------------------------------------

class OptimizerInBackward:
    """One optimizer per parameter, each stepped by the parameter's post-accumulate-grad hook, which then frees the
    gradient (torchtune's optimizer_in_bwd). With FSDP2 the hooks sit on the sharded parameters, whose gradient is
    the reduce-scattered shard: FSDP2 calls them after assigning it. `step()` and `zero_grad()` do nothing (the work
    is done in backward); `state` is every parameter's state, what the memory ledger reads. `peak_grad_bytes`: the
    most gradient bytes held at once, the largest storage a gradient lived in: one parameter's on one device; under
    FSDP2 one unit's reduce-scattered shard, which its parameters' gradients are views of until the last is freed."""

    def __init__(self, params: Iterable[nn.Parameter], make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]):
        self.params = [p for p in params if p.requires_grad]
        self.optimizers = {p: make([p]) for p in self.params}
        self.peak_grad_bytes = 0
        self._handles = [p.register_post_accumulate_grad_hook(self._step) for p in self.params]

    def _step(self, param: nn.Parameter) -> None:
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        self.peak_grad_bytes = max(self.peak_grad_bytes, grad.untyped_storage().nbytes())
        self.optimizers[param].step()
        param.grad = None

    @property
    def state(self) -> dict:
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


# --- chunked cross entropy ----------------------------------------------------------------------------------------

def chunked_lm_loss_sum(head: nn.Module, h: torch.Tensor, targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """`lm_loss_sum(head(h), targets)` (the cross entropy summed over kept tokens) computed `chunks` groups of
    tokens at a time: each group's logits are made, reduced to a loss and dropped; backward recomputes them group by
    group. The head must act on each token alone (a norm and a linear layer do). Exact up to fp32 summation order."""
    flat_h = h.reshape(-1, h.shape[-1])
    flat_y = targets.reshape(-1)
    from torch.utils.checkpoint import checkpoint

    def piece(hc: torch.Tensor, yc: torch.Tensor) -> torch.Tensor:
        return lm_loss_sum(head(hc), yc)

    losses = [checkpoint(piece, hc, yc, use_reentrant=False)
              for hc, yc in zip(flat_h.tensor_split(chunks), flat_y.tensor_split(chunks))]
    return torch.stack(losses).sum()


class ChunkedLossStage(Stage):
    """A one-stage model whose last layer is the head, returning the summed loss instead of logits:
    `stage(inputs, ctx, targets)`; the head runs in `chunks` groups of tokens (`chunked_lm_loss_sum`)."""

    def __init__(self, layers: Sequence[nn.Module], chunks: int):
        super().__init__(layers)
        self.chunks = chunks

    def forward(self, h: torch.Tensor, ctx: object | None = None, targets: torch.Tensor | None = None):
        for layer in self.layers[:-1]:
            h = call_layer(layer, h, ctx)
        return chunked_lm_loss_sum(self.layers[-1], h, targets, self.chunks)


# --- activation offload -------------------------------------------------------------------------------------------

def _is_weight(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


@contextmanager
def offloaded_activations(ledger: MemoryLedger, device_label: str = "device", host_label: str = "host",
                          pin_memory: bool = False) -> Iterator[None]:
    """`torch.autograd.graph.save_on_cpu` with the ledger counting: every tensor autograd saves is copied to host
    memory (pinned on CUDA, so the copies back in backward can overlap) and counted as `host_label`'s activations;
    weights stay where they are (they are no activations, and copying them would cost a link's worth of time).
    Only the innermost saved-tensor hooks run, so this replaces `ledger.track_activations(device_label)`. As in
    save_on_cpu, each saved tensor is its own copy: one saved by two operations is copied twice, and the host holds
    more than the device would have (the ledger counts a device storage once)."""

    def pack(t: torch.Tensor):
        if _is_weight(t):
            return t.device, ledger._pack(device_label, t)
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, device="cpu",
                           pin_memory=pin_memory and not t.is_sparse)
        host.copy_(t)
        return t.device, ledger._pack(host_label, host)

    def unpack(packed):
        device, saved = packed
        return ledger._unpack(saved).to(device, non_blocking=pin_memory)

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
