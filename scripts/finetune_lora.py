"""LoRA / QLoRA with FSDP2: a frozen base sharded over the GPUs, small adapters trained, activation checkpointing,
CPU offload.

    torchrun --nproc-per-node 2 scripts/finetune_lora.py --model DIR --method qlora --lora-rank 16 --text corpus/ \
        --activation-checkpointing --steps 200 --save-to adapters/

The base is frozen: in bf16 with --autocast bf16, in fp32 with --autocast none (fp16 is refused), and for --method qlora every linear layer of its
decoder blocks is stored in 4-bit NF4 (torchao's NF4Tensor, which FSDP2 shards and all-gathers as 4-bit codes and
scales). peft adds the adapters (fp32: Adam's updates are too small for bf16) and freezes the rest; FSDP2 shards each
decoder layer, so the base never has to fit one GPU during training. Only the adapters get gradients, optimizer
state and a reduce-scatter. --save-to writes the adapters with peft's save_pretrained: reload them with
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR), ADAPTERS)`, or merge them with
`.merge_and_unload()`.

Loading within host RAM: the model is built on the meta device (adapters and NF4 layout included) and sharded there;
then each rank reads one decoder layer at a time from the safetensors files, quantizes it on its share of the CPU
cores, and keeps only its shard. A rank's host memory holds its shards and one layer, never the whole base (a 70B
base: about 138 GB in bf16). The frozen base never meets `fully_shard` as a host tensor, so it stays frozen on GPUs
(FSDP2 moves a host tensor subclass to the GPU as a new, trainable `nn.Parameter`).
"""
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from helpers.models.hf import enable_activation_checkpointing
from helpers.runtime.host import mark_offloaded, to_device

from _common import (IGNORE_INDEX, batches, checkpointer, decoder_layers, exit_without_teardown, init, meta_model,
                     parse, report, stream_checkpoint, token_loss_sum, training_steps)


def linears(block: nn.Module) -> dict[str, nn.Linear]:
    """The plain nn.Linear modules of a decoder block, by qualified name: what LoRA adapts and QLoRA stores in NF4."""
    return {name: m for name, m in block.named_modules() if type(m) is nn.Linear}


def build(ns, dtype: torch.dtype) -> tuple[nn.Module, LoraConfig]:
    """The base on the meta device, its block linears in NF4 for --method qlora (the layout only), with peft's
    adapters: nothing read, nothing allocated yet."""
    from helpers.finetune.quant import quantize_linear

    model = meta_model(ns.model, dtype)
    blocks = decoder_layers(model)[1]
    if not linears(blocks[0]):
        raise SystemExit(f"{model.config.model_type} has no nn.Linear layers in its blocks to adapt")
    targets = sorted({n.rsplit(".", 1)[-1] for n in linears(blocks[0])}) if ns.lora_targets == "all-linear" \
        else ns.lora_targets.split(",")
    if ns.method == "qlora":
        for block in blocks:
            for name, linear in linears(block).items():
                parent, _, leaf = name.rpartition(".")
                setattr(block.get_submodule(parent), leaf, quantize_linear(linear))
    config = LoraConfig(r=ns.lora_rank, lora_alpha=ns.lora_alpha, target_modules=targets, lora_dropout=0.0)
    return get_peft_model(model, config, autocast_adapter_dtype=True), config  # fp32 adapters over a bf16 base


def load_model(ns, rank: int, world: int, device: torch.device) -> tuple[nn.Module, bool]:
    """The adapted model, sharded over the ranks by FSDP2 (one unit per decoder layer, the rest in the root) unless
    QLoRA runs on one process, its shards filled from the checkpoint one layer at a time; and whether it is
    sharded."""
    from helpers.finetune.lora import adapt_linears
    from helpers.models.layered import layer_seed

    dtype = torch.bfloat16 if ns.autocast == "bf16" else torch.float32
    model, config = build(ns, dtype)
    if ns.activation_checkpointing:
        enable_activation_checkpointing(model)  # recompute each decoder layer in backward
    shard = not (ns.method == "qlora" and world == 1)
    if shard:
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if ns.offload == "cpu" else OffloadPolicy()
        mesh = init_device_mesh(device.type, (world,))
        for layer in decoder_layers(model.base_model.model)[1]:
            fully_shard(layer, mesh=mesh, offload_policy=offload)  # one all-gather per decoder layer
        fully_shard(model, mesh=mesh, offload_policy=offload)  # embeddings, final norm, head in the root unit
    model.to_empty(device=torch.device("cpu") if ns.offload == "cpu" else device)
    if ns.offload == "cpu":
        mark_offloaded(model)  # host memory, which NCCL does not serve (a device-strict CPU rank refuses it too)

    def prepare(block: nn.Module, index: int) -> nn.Module:  # the same NF4 bytes and adapters on every rank
        return adapt_linears(block, linears(block), config, ns.method == "qlora", layer_seed(ns.seed, index))

    stream_checkpoint(model.base_model.model, ns.model, dtype, rank, world, prepare, device)
    if ns.offload == "cpu":  # FSDP2 keeps the parameter shards in host memory; buffers go to the GPU
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
    return model, shard


def main() -> None:
    ns = parse(__doc__.splitlines()[0], lora=True)
    if ns.autocast == "fp16":  # the base would stay fp32 and nothing would compute in fp16: say so, never train silently
        raise SystemExit("finetune_lora.py trains with --autocast bf16 (a bf16 base, bf16 compute) or none (fp32); "
                         "fp16 would need a gradient scaler FSDP2 shares across ranks: use bf16")
    if ns.method == "qlora":
        from helpers.finetune.quant import nf4_missing

        if nf4_missing():
            raise SystemExit(nf4_missing())
        alone = int(os.environ.get("WORLD_SIZE", "1")) == 1
        if alone and ns.offload == "cpu":  # torchao 0.18's NF4 fails FSDP2's one-rank gather (ValueError)
            raise SystemExit("QLoRA with --offload cpu needs FSDP2 over 2 or more processes here; on one GPU run "
                             "QLoRA without --offload (the 4-bit base is not sharded then)")
    rank, world, device = init()
    model, shard = load_model(ns, rank, world, device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=ns.lr, weight_decay=0.0)
    checkpoints = checkpointer(ns, model, optimizer)  # the adapters, their Adam state, the step, RNG
    per_rank = ns.batch // world
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.config.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for k, (xm, ym) in enumerate(zip(x.chunk(ns.microbatches), y.chunk(ns.microbatches))):
            if shard:
                model.set_requires_gradient_sync(k == ns.microbatches - 1)  # reduce-scatter on the last only
            summed = token_loss_sum(model(input_ids=xm).logits, ym)
            (summed * world / real).backward()  # FSDP2 averages over ranks, like DDP
            total += summed.detach()
        optimizer.step()
        dist.all_reduce(total)
        report(step, total.item() / real)
    # full_tensor is a collective: an offloaded shard is copied to the GPU first, since NCCL serves no host memory
    adapters = {name: (to_device(p, device).full_tensor() if shard else p).cpu()
                for name, p in model.named_parameters() if p.requires_grad}
    if ns.save_to and rank == 0:
        model.save_pretrained(ns.save_to, state_dict=adapters)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # FSDP2 ranks may abort in the interpreter's teardown, after the work is done
