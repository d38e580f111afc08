"""Bytes per parameter, one table: weights, gradients and optimizer state under each training recipe, the optimizers'
state and step temporaries, and how ZeRO's stages (DDP, ZeRO-1, ZeRO-2, FSDP2: helpers.catalog) shard them.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", section 3.1): mixed
precision Adam holds 2 + 2 bytes of 16-bit weights and gradients and K = 12 bytes of fp32 master weights and moments
per parameter. The optimizers' tensors are PyTorch's own (data/training_memory.json "optimizers", with sources).
"""
from __future__ import annotations

from functools import partial

from helpers.catalog import DATA_PARALLEL, strategy as catalog_entry
from helpers.dtypes import BYTES
from helpers.facts import cached_data
from helpers.sizing.ledger import DeviceMemory

# state tensors shaped like each parameter: SGD none, SGD's momentum_buffer, Adam's exp_avg and exp_avg_sq
OPTIMIZER_MOMENTS = {"none": 0, "sgd": 0, "momentum": 1, "adam": 2}
# tensors shaped like the parameters that an optimizer step allocates: foreach Adam's sqrt(exp_avg_sq)
OPTIMIZER_TEMPORARIES = {"none": 0, "sgd": 0, "momentum": 0, "adam": 1}
OPTIMIZER_STATE = {name: n * BYTES["fp32"] for name, n in OPTIMIZER_MOMENTS.items()}  # bytes per fp32 parameter

BYTES_PER_PARAM = {  # (weights, grads, optimizer state) per parameter
    "fp32 + SGD": (BYTES["fp32"], BYTES["fp32"], OPTIMIZER_STATE["sgd"]),
    "fp32 + SGD momentum": (BYTES["fp32"], BYTES["fp32"], OPTIMIZER_STATE["momentum"]),
    "fp32 + Adam": (BYTES["fp32"], BYTES["fp32"], OPTIMIZER_STATE["adam"]),
    "mixed precision + Adam": (BYTES["bf16"], BYTES["bf16"], BYTES["fp32"] + OPTIMIZER_STATE["adam"]),  # fp32 master
}


training_data = partial(cached_data, "training_memory")  # data/training_memory.json, read once: treat it as read-only


def known_optimizers() -> list[str]:
    """The optimizers the training planner prices (data/training_memory.json)."""
    return sorted(training_data()["optimizers"])


def training_state_bytes(n_params: int, recipe: str = "fp32 + Adam") -> DeviceMemory:
    """Weights, gradients and optimizer state for `n_params` under a training recipe (no activations)."""
    if recipe not in BYTES_PER_PARAM:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {list(BYTES_PER_PARAM)}")
    w, g, o = BYTES_PER_PARAM[recipe]
    return DeviceMemory(params=w * n_params, grads=g * n_params, optimizer=o * n_params)


def zero_formula(strategy: str, n_params: int, world: int, weight_bytes: int = 4, grad_bytes: int = 4,
                 optim_bytes: int = 8) -> DeviceMemory:
    """Per-device training state from the ZeRO paper, fp32 Adam by default: DDP replicates all; ZeRO-1 shards
    optimizer state; ZeRO-2 also gradients; ZeRO-3 (FSDP2) also parameters (helpers.catalog's `shards`)."""
    if strategy not in DATA_PARALLEL:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(DATA_PARALLEL)}")
    w, g, o = (world if sharded else 1 for sharded in catalog_entry(strategy).shards)
    return DeviceMemory(params=n_params * weight_bytes // w, grads=n_params * grad_bytes // g,
                        optimizer=n_params * optim_bytes // o)

