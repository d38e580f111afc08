"""Cut an ordered list of layers into stages on devices, and run a training step stage by stage.

The classic naive split (`SplitModel` in PyTorch's model-parallel tutorial) is `split_model(layers, [k], devices)`.
Each stage's input is cut from the graph (`detach().requires_grad_()`) and its gradient handed back explicitly,
as torchgpipe does: that is what lets every stage record its own forward and backward on the timeline, and it is
the mechanism every pipeline engine reuses (see helpers.pipeline.interpreter).

The last stage computes its micro-batch's share of the global loss: the summed token loss divided by the kept
tokens of the whole global batch. Shares add up to exactly the one-device loss, whatever the padding.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.models.data import kept_tokens, lm_loss_sum
from helpers.models.layered import Stage, call_layer
from helpers.pipeline.split_backward import (Cut, WeightGradients, backward_input, backward_input_cut, forward_cut,
                                             run_batched)
from helpers.precision import Precision
from helpers.timeline import Recorder


def as_layers(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The model as an ordered list of layers; say what structure is expected when it is not one."""
    if isinstance(model, (nn.Sequential, Stage, list, tuple, nn.ModuleList)):
        return list(model)
    raise TypeError(
        f"cannot list the layers of a {type(model).__name__}: expected an nn.Sequential or a list of modules "
        "applied in order (for a Hugging Face decoder use helpers.partition.hf_layers)")


def check_boundaries(n_layers: int, boundaries: Sequence[int]) -> list[int]:
    """Boundaries are the indices where a new stage starts: strictly increasing, inside 1..n_layers-1."""
    bounds = list(boundaries)
    for b in bounds:
        if not 1 <= b <= n_layers - 1:
            raise ValueError(f"split point {b} is outside the model's layers: a model of {n_layers} layers can "
                             f"be split at 1..{n_layers - 1} (split point k puts layers 0..k-1 on the first stage)")
    if any(b2 <= b1 for b1, b2 in zip(bounds, bounds[1:])):
        raise ValueError(f"split points {bounds} must be strictly increasing")
    return bounds


def stage_ranges(n_layers: int, boundaries: Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] layer index ranges of each stage."""
    edges = [0, *check_boundaries(n_layers, boundaries), n_layers]
    return list(zip(edges, edges[1:]))


class SplitModel(nn.Module):
    """Stages on devices; `forward` moves activations from one device to the next (the naive split)."""

    def __init__(self, stages: Sequence[nn.Module], devices: Sequence[torch.device],
                 tied: Sequence[tuple[nn.Parameter, nn.Parameter]] = ()):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.devices = list(devices)
        self.tied = list(tied)  # (first use, copy in a later stage): one weight, kept equal by summed gradients

    def sync_tied_grads(self) -> None:
        """Megatron's treatment of tied embeddings: each copy gets the sum of both uses' gradients, so the copies
        (equal at the start) stay equal after every optimizer step."""
        for a, b in self.tied:
            if a.grad is None or b.grad is None:
                continue
            total = a.grad + b.grad.to(a.grad.device)
            a.grad.copy_(total)
            b.grad.copy_(total.to(b.grad.device))

    def forward(self, x: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        for stage, device in zip(self.stages, self.devices):
            x = stage(x.to(device), ctx)
        return x


def _untie_across(stages: Sequence[nn.Module]) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """A weight used by two stages (tied embeddings: the embedding and the head) becomes one copy per stage, as it
    must when the stages sit on different GPUs; returns the (first, copy) pairs whose gradients get summed. A weight
    shared inside one stage stays shared: one device, nothing to do."""
    first: dict[int, tuple[int, nn.Parameter]] = {}
    copies: dict[tuple[int, int], nn.Parameter] = {}
    pairs = []
    for s, stage in enumerate(stages):
        for module in stage.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                owner, original = first.setdefault(id(p), (s, p))
                if owner == s:
                    continue
                if (id(p), s) not in copies:
                    copies[(id(p), s)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
                    pairs.append((original, copies[(id(p), s)]))
                setattr(module, name, copies[(id(p), s)])
    return pairs


def _ranges(n_layers: int, boundaries: int | Sequence[int], devices: Sequence[torch.device]) -> list[tuple[int, int]]:
    """Each stage's layer range, cut at `boundaries` (one split point or several); refused past one per device."""
    ranges = stage_ranges(n_layers, [boundaries] if isinstance(boundaries, int) else list(boundaries))
    if len(ranges) > len(devices):
        raise ValueError(f"{len(ranges)} stages but only {len(devices)} devices: one stage per device")
    return ranges


def split_model(model: nn.Module | Sequence[nn.Module], boundaries: int | Sequence[int],
                devices: Sequence[torch.device]) -> SplitModel:
    """Move consecutive layers onto `devices` (one stage per device), cut at `boundaries`. A weight shared by two
    stages (tied embeddings) becomes one copy per stage, kept equal by `SplitModel.sync_tied_grads`."""
    layers = as_layers(model)
    ranges = _ranges(len(layers), boundaries, devices)
    stages = [Stage(layers[a:b]) for a, b in ranges]
    tied = _untie_across(stages)
    stages = [stage.to(dev) for stage, dev in zip(stages, devices)]
    return SplitModel(stages, devices[:len(stages)], tied)


def split_layered(model, boundaries: int | Sequence[int], devices: Sequence[torch.device]) -> SplitModel:
    """Build a `LayeredModel` (the block stack, an `HFModel`) straight into stages: each stage materialises only its
    own layers, on its own device (a checkpoint's tensors are read once, stage by stage). Tied weights whose two
    uses land on different stages are two copies, registered for `sync_tied_grads`; on one stage, one weight."""
    layers = model.meta_layers()
    ranges = _ranges(len(layers), boundaries, devices)
    for (a, b), device in zip(ranges, devices):
        model.materialize(layers, range(a, b), device)
    stage_of = {i: s for s, (a, b) in enumerate(ranges) for i in range(a, b)}
    tied = [(layers[i].get_parameter(name_i), layers[j].get_parameter(name_j))
            for (i, name_i), (j, name_j) in getattr(model, "tied_parameters", lambda: [])()
            if stage_of[i] != stage_of[j]]
    return SplitModel([Stage(layers[a:b]) for a, b in ranges], devices[:len(ranges)], tied)


@dataclass
class StageStep:
    """The state one stage keeps for one micro-batch between its forward and its backward."""

    inp: torch.Tensor
    out: torch.Tensor
    cuts: list[Cut] | None = None  # the forward layer by layer, when its backward is to be split (`forward_cut`)


class StageExecutor:
    """Runs one stage: forward on a cut input, backward from the gradient of its output.

    Used by the naive step below and by every pipeline engine, so every strategy shares one mechanism. The last
    stage (`computes_loss=True`) returns its micro-batch's share of the global loss. Zero-bubble schedules split a
    backward in two (`backward(..., weights_later=True)`, then `backward_weights`); the spans of the weight half
    are recorded as `weight`. Spans carry the stage's index (a device may run several stages).
    """

    def __init__(self, stage: nn.Module, device: torch.device, index: int, recorder: Recorder | None = None,
                 track: Callable | None = None, computes_loss: bool = False, precision: Precision = Precision()):
        self.stage, self.device, self.index, self.precision = stage, device, index, precision
        self.recorder = recorder or Recorder(index, device)
        self.track = track  # e.g. lambda: ledger.track_activations(label), entered around each forward
        self.computes_loss = computes_loss
        self.saved: dict[int, StageStep] = {}
        self.deferred: dict[int, WeightGradients] = {}  # micro-batch -> weight gradients still to compute

    def forward(self, mb: int, x: torch.Tensor, target: torch.Tensor | None = None, ctx: object | None = None,
                normalizer: float = 1.0, weights_later: bool = False) -> torch.Tensor:
        """The stage's output for micro-batch `mb`; on the last stage, its loss summed over kept tokens divided by
        `normalizer` (the kept tokens of the global batch). `weights_later`: this micro-batch's backward will be
        split; where the input needs a gradient, the stage then runs layer by layer, each layer's input cut from the
        previous one's output (`split_backward.forward_cut`), so that the split's host work grows with the layers
        of the stage, not with their square."""
        x = x.to(self.device)
        if x.is_floating_point():
            x = x.detach().requires_grad_()
        target = target.to(self.device) if self.computes_loss else None
        with self.recorder.span("forward", mb, self.index), (self.track() if self.track else nullcontext()), \
                self.precision.context(self.device):
            if weights_later and x.requires_grad and type(self.stage) is Stage:  # a plain Stage: no hooks of its own
                cuts = forward_cut(self._pieces(ctx, target, normalizer), x)
                out = cuts[-1].out
            else:
                cuts = None
                out = self.stage(x, ctx) if ctx is not None else self.stage(x)
                if self.computes_loss:
                    out = lm_loss_sum(out, target) / normalizer
        self.saved[mb] = StageStep(x, out, cuts)
        return out

    def _pieces(self, ctx: object | None, target: torch.Tensor | None, normalizer: float) -> list[tuple]:
        """The stage's layers as `forward_cut`'s pieces, each layer with its weights; on the last stage the last
        piece ends with the loss (one autograd call fewer than a piece of its own)."""
        pieces: list[tuple] = [(lambda h, layer=layer: call_layer(layer, h, ctx), layer.parameters())
                               for layer in self.stage]
        if self.computes_loss:
            head, weights = pieces[-1]
            pieces[-1] = (lambda h: lm_loss_sum(head(h), target) / normalizer, weights)
        return pieces

    def backward(self, mb: int, grad: torch.Tensor | None, loss_scale: float = 1.0,
                 weights_later: bool = False) -> torch.Tensor | None:
        """Backward of micro-batch `mb`; `grad is None` means this stage's output is the loss (scaled by
        `loss_scale`, e.g. a gradient scaler's factor). With `weights_later`, only the input's gradient now (the
        graph, and its activations, kept); `backward_weights(mb)` adds the weights' gradients later."""
        step = self.saved.pop(mb)
        with self.recorder.span("backward", mb, self.index):
            if weights_later:
                seed = grad.to(self.device) if grad is not None else \
                    torch.full_like(step.out, loss_scale, device=self.device)
                if step.cuts:
                    inp_grad, self.deferred[mb] = backward_input_cut(step.cuts, seed)
                else:
                    inp = step.inp if step.inp.requires_grad else None
                    inp_grad, self.deferred[mb] = backward_input(step.out, seed, inp, self.stage.parameters())
                return inp_grad
            if grad is None:
                (step.out * loss_scale).backward()
            else:
                step.out.backward(grad.to(self.device))
        return step.inp.grad if step.inp.requires_grad else None

    def backward_weights(self, mb: int, *more: int) -> None:
        """The weight gradients of micro-batch `mb`, whose input gradient `backward(..., weights_later=True)`
        computed; then its graph and activations go. With `more` micro-batches, one weight pass for all of them,
        each linear layer's gradient one product over their rows (`split_backward.run_batched`), recorded as one
        span under the first micro-batch."""
        deferred = [self.deferred.pop(k) for k in (mb, *more)]
        with self.recorder.span("weight", mb, self.index):
            if more:
                run_batched(deferred)
            else:
                deferred[0].run()


def make_executors(model: SplitModel, recorders: Sequence[Recorder] | None = None,
                   tracks: Sequence[Callable] | None = None, precision: Precision = Precision()) -> list[StageExecutor]:
    """One executor per stage; the last one computes the loss."""
    n = len(model.stages)
    return [StageExecutor(s, d, i, recorders[i] if recorders else None, tracks[i] if tracks else None,
                          computes_loss=i == n - 1, precision=precision)
            for i, (s, d) in enumerate(zip(model.stages, model.devices))]


def naive_train_step(executors: Sequence[StageExecutor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One forward + backward through the stages in order, one device at a time; returns the loss."""
    h = x
    for ex in executors[:-1]:
        h = ex.forward(0, h)
    loss = executors[-1].forward(0, h, y, normalizer=kept_tokens(y))
    grad = None
    for ex in reversed(executors):
        grad = ex.backward(0, grad)
    return loss.detach()
