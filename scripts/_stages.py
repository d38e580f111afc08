"""Pipeline stages of a Hugging Face model for torch.distributed.pipelining: each rank builds only its own layers.

The course's layer view (`helpers.models.hf.HFModel`: the model as embedding, decoder layers, norm, head, built on
the meta device, loading only this stage's tensors from the checkpoint) does the cutting; everything else is
PyTorch's own pipelining.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from helpers.models.hf import HFModel
from helpers.models.layered import Stage, owned_layers
from helpers.training.api import save_trained


def cut(model: HFModel, stages: int) -> list[tuple[int, int]]:
    """Equal numbers of layers per stage (the first stages take the remainder)."""
    base, extra = divmod(model.n_layers, stages)
    edges = [0]
    for s in range(stages):
        edges.append(edges[-1] + base + (1 if s < extra else 0))
    return list(zip(edges, edges[1:]))


def build_stage(model: HFModel, stage: int, stages: int, device: torch.device) -> tuple[Stage, int]:
    """This stage's layers with the checkpoint's weights on `device`; every other layer stays on the meta device.
    Returns the stage and the index of its first layer."""
    a, b = cut(model, stages)[stage]
    return Stage(owned_layers(model, range(a, b), device)[a:b]), a


def tied_copy(model: HFModel, module: Stage, first: int, stage: int, stages: int) -> nn.Parameter | None:
    """The copy of a tied embedding / head this stage holds (first and last stage), else None. Megatron's rule:
    after every backward both copies get the sum of both gradients, so they stay identical."""
    if not model.tied or stages == 1 or stage not in (0, stages - 1):
        return None
    (i, name_i), (j, name_j) = model.tied_parameters()[0]
    index, name = (i, name_i) if stage == 0 else (j, name_j)
    return module.layers[index - first].get_parameter(name)


def save_pipeline(model: HFModel, stages: list[tuple[Stage, int]], directory: str, group=None) -> None:
    """Gather every stage's trained layers (this rank's `stages`: each module with the index of its first layer) on
    the group's first rank and save them with save_pretrained. One tensor crosses at a time, sent from where it
    lives: a GPU holds at most one tensor more than training left on it (the first rank's receive buffer), while its
    weights, gradients and Adam state are still allocated (`all_gather_object` of whole stages would stage about
    three times a stage's bytes on every GPU: pickled, gathered, unpickled). The first rank's host memory holds the
    whole model, which save_pretrained writes."""
    mine = {first + k: layer.state_dict() for module, first in stages for k, layer in enumerate(module.layers)}
    device = next(t.device for state in mine.values() for t in state.values())
    manifests = [None] * dist.get_world_size(group)  # names, shapes and dtypes only
    dist.all_gather_object(manifests, {i: [(n, t.shape, t.dtype) for n, t in s.items()] for i, s in mine.items()},
                           group=group)
    me, whole = dist.get_rank(group), {}
    for source, manifest in enumerate(manifests):
        for index, entries in manifest.items():
            for name, shape, dtype in entries:
                if source == me:
                    tensor = mine[index][name].detach()
                    if me == 0:
                        whole.setdefault(index, {})[name] = tensor.cpu()
                    else:
                        dist.send(tensor.contiguous(), group_dst=0, group=group)
                elif me == 0:
                    buffer = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(buffer, group_src=source, group=group)
                    whole.setdefault(index, {})[name] = buffer.cpu()
    if me == 0:
        save_trained(model, whole, directory)
