"""What every engine needs from a model: an ordered list of layers it can cut anywhere, built on the meta device and
materialised layer by layer with exactly the weights one device would hold.

A rank (or a pipeline thread) asks for `meta_layers()`: every layer, shapes only, no memory. It materialises only
the layers it owns (`materialize`), so the layers it does not own stay on the meta device and any accidental use of
one fails on the CPU rig as it would on a GPU. Boundary shapes come from a forward pass on the meta device
(`boundary_shapes`), never from running layers on real data.

Equal weights without building the whole model: the course's block stack initialises layer i from its own seeded
generator (seed from the model seed and i), so a rank holding layers 5..8 gets the same numbers one device holding
all of them would; a Hugging Face model loads only the stage's tensors from its `save_pretrained` checkpoint.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class LayeredModel(Protocol):
    """A model as an ordered list of layers (embedding, blocks..., head), buildable piece by piece on any rank.
    Instances are small, picklable descriptions: the launcher sends them to every rank."""

    def meta_layers(self) -> list[nn.Module]:
        """Every layer on the meta device (shapes, no memory)."""
        ...

    def materialize(self, layers: list[nn.Module], indices: Iterable[int], device: torch.device) -> None:
        """Give the layers at `indices` (in place) the weights one device would hold, on `device`."""
        ...

    def context(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> object | None:
        """What every stage needs besides the hidden state for a micro-batch (masks, positions); None if nothing."""
        ...

    @property
    def vocab_size(self) -> int:
        ...


def layer_seed(model_seed: int, index: int) -> int:
    """The seed of layer `index`'s own generator: independent of which other layers a device builds."""
    return (model_seed * 1_000_003 + index * 7_919 + 17) % (2**63 - 1)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run a block with the CPU generator at `seed`, leaving the caller's random state untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def materialize_seeded(layers: list[nn.Module], indices: Iterable[int], device: torch.device, model_seed: int) -> None:
    """Materialise meta layers from per-layer seeds: allocated and initialised on the CPU (so every rig draws the
    same numbers), then moved to `device`. Only one layer at a time is ever materialised off-device."""
    for i in indices:
        layer = layers[i].to_empty(device="cpu")
        with seeded(layer_seed(model_seed, i)):  # every submodule that knows how (nn.Linear, ...), in module order
            for sub in layer.modules():
                if callable(getattr(sub, "reset_parameters", None)):
                    sub.reset_parameters()
        layers[i] = layer.to(device)


def owned_layers(model: LayeredModel, indices: Sequence[int], device: torch.device) -> list[nn.Module]:
    """All layers, the ones at `indices` materialised on `device`, every other one left on the meta device."""
    layers = model.meta_layers()
    model.materialize(layers, indices, device)
    return layers


def tie_parameters_(layers: Sequence[nn.Module], pairs: Sequence[tuple[tuple[int, str], tuple[int, str]]]) -> None:
    """Make each pair's second parameter the very object of the first (one device holds both uses: a tied
    embedding and head become one weight again, as in the original model)."""
    for (i, a), (j, b) in pairs:
        module_path, _, name = b.rpartition(".")
        owner = layers[j].get_submodule(module_path) if module_path else layers[j]
        setattr(owner, name, layers[i].get_parameter(a))


def microbatch_seed(data_seed: int, step: int, index: int) -> int:
    """The dropout seed of micro-batch `index` (counted over the whole global batch) at `step`: the same in every
    engine, so a run is repeatable, and with one micro-batch equal to one device's."""
    return (data_seed * 1_000_003 + step * 10_007 + index * 101 + 7) % (2**31 - 1)


def with_seed(ctx: object | None, seed: int) -> object | None:
    """`ctx` carrying a dropout seed, for models whose context has one (Hugging Face layers); others unchanged."""
    from dataclasses import is_dataclass, replace

    if ctx is not None and is_dataclass(ctx) and hasattr(ctx, "seed"):
        return replace(ctx, seed=seed)
    return ctx


def is_meta(module: nn.Module) -> bool:
    """True when every parameter and buffer of `module` is on the meta device (a layer this rank does not own)."""
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def boundary_shapes(model: LayeredModel, boundaries: Sequence[int], microbatch: int, seq_len: int,
                    dtype: torch.dtype | None = None) -> list[tuple]:
    """(shape, dtype) of the tensor that crosses each boundary, from a forward pass on the meta device (weights in
    `dtype` if given): no data, no memory, no layer run on anything real. Layer i's output crosses boundary b when
    b == i + 1."""
    layers = [layer.to(dtype) if dtype is not None else layer for layer in model.meta_layers()]
    ids = torch.zeros(microbatch, seq_len, dtype=torch.long, device="meta")
    ctx = model.context(ids, None)
    out, h = [], ids
    wanted = set(boundaries)
    with torch.no_grad():
        for i, layer in enumerate(layers):
            h = call_layer(layer, h, ctx)
            if i + 1 in wanted:
                out.append((tuple(h.shape), h.dtype))
    return out


def call_layer(layer: nn.Module, h: torch.Tensor, ctx: object | None) -> torch.Tensor:
    """One layer on the hidden state; layers that need the micro-batch's context (masks, positions) say so with a
    `takes_context = True` attribute."""
    return layer(h, ctx) if getattr(layer, "takes_context", False) else layer(h)


class Stage(nn.Module):
    """Consecutive layers run as one stage: `stage(h)` or `stage(h, ctx)`. Indexable like nn.Sequential."""

    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h: torch.Tensor, ctx: object | None = None) -> torch.Tensor:
        for layer in self.layers:
            h = call_layer(layer, h, ctx)
        return h

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i):
        return Stage(self.layers[i]) if isinstance(i, slice) else self.layers[i]

    def __iter__(self):
        return iter(self.layers)
