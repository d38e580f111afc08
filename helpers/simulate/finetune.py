"""LoRA, QLoRA and offloading, priced by the simulator from their own operations.

- LoRA: the base is frozen, so its linears' backward computes the input's gradient only (no weight-gradient
  matmul); each target linear gets peft's adapter, y = W x + B A dropout(x) * scaling, whose small matmuls are
  traced with the rest (`adapt`). FSDP2 gathers the frozen weights as stored (`LayerCost.frozen_bytes`, the memory
  planner's `helpers.sizing.training.training_shape`) before forward and again before backward; only the adapters'
  gradients are reduce-scattered and stepped.
- QLoRA: as LoRA, and every use of a quantized weight first dequantizes it to the compute dtype, a memory-bound pass
  that reads the packed codes and their constants and writes the bf16 weight (bitsandbytes' MatMul4Bit does so in
  forward, in the recomputed forward and in backward for the input's gradient). One kernel per use: torchao's NF4,
  whose dequantization runs several PyTorch operators, costs more than this.
- CPU offload and activation offload: `helpers.simulate.strategies` (`Job.cpu_offload`, `Job.activation_offload`)
  over the rig's host (`rig_host`: data/hardware.json `host`). The optimizer step on the host is PyTorch's
  single-tensor AdamW (the CPU's default: no foreach or fused kernel there), `HOST_ADAMW_ACCESSES` passes over the
  state's elements, memory-bound at the host's memory bandwidth.
"""
from __future__ import annotations

import functools
from dataclasses import replace

from torch import nn

from helpers.facts import load_data
from helpers.simulate.roofline import Kernel, optimizer_s
from helpers.simulate.job import Host
from helpers.simulate.workload import Workload
from helpers.sizing.gpus import Gpu
from helpers.sizing.training import TrainShape

# element reads and writes per parameter of torch.optim.AdamW's single-tensor step (torch/optim/adam.py
# `_single_tensor_adam`, each line one pass): param.mul_(1 - lr * wd) 2, exp_avg.lerp_(grad) 3,
# exp_avg_sq.mul_(beta2) 2, .addcmul_(grad, grad) 3, exp_avg_sq.sqrt() 2, / bias_correction2_sqrt 2, .add_(eps) 2,
# param.addcdiv_(exp_avg, denom) 4
HOST_ADAMW_ACCESSES = 20
@functools.lru_cache(maxsize=None)
def dequantize_kernels(train: TrainShape) -> tuple[Kernel, ...]:
    """One decoder layer's dequantizations, one per quantized linear: its packed codes and constants read, the
    weight written in the compute dtype."""
    from helpers.sizing.shape import meta_model

    fmt = train.format
    model = meta_model(train.base.config)
    block = next(m for m in model.modules() if type(m).__name__.endswith("DecoderLayer"))
    out = []
    for module in block.modules():
        if isinstance(module, nn.Linear):
            numel = module.weight.numel()
            written = numel * fmt.activation_bytes
            out.append(Kernel("memory", 0.0, fmt.tensor_bytes(module.weight.shape, True) + written, written))
    return tuple(out)


def finetune_workload(train: TrainShape, seq: int, gpu: Gpu, batch: int = 8, attention: str = "sdpa",
                      lora_dropout: float = 0.0, recipe: str = "mixed precision + Adam", state_bytes: int = 4) -> Workload:
    """Per-sample costs of LoRA or QLoRA (`train`: `training_shape(model, method, ...)`) on `gpu`, traced like
    `transformer_workload` with the base frozen and the adapters in (`adapt`), QLoRA's dequantizations added to each
    block's forward and backward (`dequantize_kernels`); each layer's frozen bytes are what the memory planner shards
    (`Unit.packed_bytes`: bitsandbytes' constants stay whole on every GPU, outside FSDP); `params` the adapters'.
    The optimizer steps the adapters only (`recipe`'s bytes per parameter on the GPU). `state_bytes`: the adapters'
    and their AdamW state's element bytes (4 for peft's fp32 adapters, 2 in pure bf16), what a CPU-offloaded shard
    holds per adapter parameter and what the host's step passes over `HOST_ADAMW_ACCESSES` times."""
    from helpers.simulate.guide import decoder_layers

    if train.method not in ("lora", "qlora"):
        raise ValueError(f"finetune_workload prices LoRA and QLoRA; for full fine-tuning use transformer_workload, "
                         f"not {train.method!r}")
    kernels, counts, tensors = _lora_kernels(train, seq, batch, attention, lora_dropout)
    if train.format.quantized:
        extra = dequantize_kernels(train)
        embedding, block, norm, head = kernels
        kernels = (embedding, replace(block, forward=block.forward + extra, backward=block.backward + extra), norm,
                   head)
    layers = decoder_layers(train.base, seq, gpu, "bf16", attention, None, batch, None, kernels, counts, tensors)
    units = [u for u in train.units if u.kind != "buffers"]
    if [u.kind for u in units] != ["embedding", *["decoder"] * (len(layers) - 3), "norm", "head"]:
        raise ValueError(f"{train.name}'s units {[u.kind for u in units]} do not line up with the simulator's "
                         "embedding, blocks, final norm and head")
    layers = [replace(layer, frozen_bytes=float(u.packed_bytes)) for layer, u in zip(layers, units)]
    trainable = sum(layer.params for layer in layers)
    return Workload(tuple(layers), recipe, optimizer_s(trainable, recipe, gpu),
                    optimizer_bytes=HOST_ADAMW_ACCESSES * state_bytes * trainable, host_bytes_per_param=state_bytes)


def _lora_kernels(train: TrainShape, seq: int, batch: int, attention: str, dropout: float):
    from helpers.simulate.guide import _decoder_kernels

    return _decoder_kernels(_bf16_shape(train), seq, None, batch, "bf16", attention,
                            (train.lora_rank, train.lora_targets, dropout))


def _bf16_shape(train: TrainShape):
    """The base in bf16: LoRA and QLoRA trace the same kernels (QLoRA's dequantizations added apart), one trace."""
    from helpers.sizing.shape import model_shape

    return model_shape(train.base.config, "bf16")


@functools.lru_cache(maxsize=None)
def rig_host() -> Host:
    """The host every rig's GPUs offload to (data/hardware.json `host`): each GPU's pinned copies over its own PCIe
    link, the host's memory bandwidth shared by the ranks' optimizer steps."""
    host = load_data("hardware")["host"]
    pcie = load_data("hardware")["links"][host["pcie_link"]]["gb_s_per_direction"]
    return Host(pcie * 1e9, host["memory_gb_s"]["value"] * 1e9)
