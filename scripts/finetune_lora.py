"""LoRA / QLoRA with FSDP2: a frozen base sharded over the GPUs, small adapters trained, checkpointing, CPU offload.

    torchrun --nproc-per-node 2 scripts/finetune_lora.py --model DIR --method qlora --lora-rank 16 --text corpus/ \
        --checkpointing --steps 200 --save-to adapters/

The base is frozen: in bf16 with --autocast bf16, in fp32 with --autocast none (fp16 is refused), and for --method qlora every linear layer of its
decoder blocks is stored in 4-bit NF4 (torchao's NF4Tensor, which FSDP2 shards and all-gathers as 4-bit codes and
scales). peft adds the adapters (fp32: Adam's updates are too small for bf16) and freezes the rest; FSDP2 shards each
decoder layer, so the base never has to fit one GPU during training. Only the adapters get gradients, optimizer
state and a reduce-scatter. --save-to writes the adapters with peft's save_pretrained: reload them with
`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(DIR), ADAPTERS)`, or merge them with
`.merge_and_unload()`. (Every rank reads the whole checkpoint here; for a 70B base, load it on the meta device and
fill the shards layer by layer, as helpers.finetune.lora does, or as answer.ai's fsdp_qlora does from rank 0.)
"""
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from transformers import AutoModelForCausalLM

from _common import IGNORE_INDEX, batches, checkpointer, init, parse, report, token_loss_sum, training_steps


def quantize_blocks(model: nn.Module) -> None:
    """QLoRA's frozen base: every nn.Linear inside the decoder blocks in NF4 (embeddings, norms, head unchanged)."""
    from helpers.finetune.quant import quantize_linear

    for block in model.model.layers:
        for name, module in list(block.named_modules()):
            for child_name, child in list(module.named_children()):
                if type(child) is nn.Linear:
                    setattr(module, child_name, quantize_linear(child))


def main() -> None:
    ns = parse(__doc__.splitlines()[0], lora=True)
    if ns.autocast == "fp16":  # the base would stay fp32 and nothing would compute in fp16: say so, never train silently
        raise SystemExit("finetune_lora.py trains with --autocast bf16 (a bf16 base, bf16 compute) or none (fp32); "
                         "fp16 would need a gradient scaler FSDP2 shares across ranks: use bf16")
    shard = not (ns.method == "qlora" and int(os.environ.get("WORLD_SIZE", "1")) == 1)
    if ns.method == "qlora":
        from helpers.finetune.quant import nf4_missing

        if nf4_missing():
            raise SystemExit(nf4_missing())
        if not shard and ns.offload == "cpu":  # torchao 0.18's NF4 fails FSDP2's one-rank gather (ValueError)
            raise SystemExit("QLoRA with --offload cpu needs FSDP2 over 2 or more processes here; on one GPU run "
                             "QLoRA without --offload (the 4-bit base is not sharded then)")
    base_dtype = torch.bfloat16 if ns.autocast == "bf16" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=base_dtype)  # read on the host, before the group
    if not any(type(m) is nn.Linear for m in model.model.layers[0].modules()):
        raise SystemExit(f"{model.config.model_type} has no nn.Linear layers in its blocks to adapt")
    if ns.method == "qlora":
        quantize_blocks(model)
    targets = "all-linear" if ns.lora_targets == "all-linear" else ns.lora_targets.split(",")
    config = LoraConfig(r=ns.lora_rank, lora_alpha=ns.lora_alpha, target_modules=targets, lora_dropout=0.0)
    if targets == "all-linear":
        config.target_modules = sorted({n.rsplit(".", 1)[-1] for n, m in model.model.layers.named_modules()
                                        if isinstance(m, nn.Linear)})
    model = get_peft_model(model, config, autocast_adapter_dtype=True)  # adapters in fp32 over a bf16 base
    if ns.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rank, world, device = init()
    if shard:
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if ns.offload == "cpu" else OffloadPolicy()
        mesh = init_device_mesh(device.type, (world,))
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mesh=mesh, offload_policy=offload)  # one all-gather per decoder layer
        fully_shard(model, mesh=mesh, offload_policy=offload)  # embeddings, final norm, head in the root unit
    if ns.offload == "cpu":  # FSDP2 keeps the parameter shards in host memory; buffers go to the GPU
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
    else:
        model.to(device)
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
    adapters = {name: (p.full_tensor() if shard else p).cpu()  # full_tensor: a collective
                for name, p in model.named_parameters() if p.requires_grad}
    if ns.save_to and rank == 0:
        model.save_pretrained(ns.save_to, state_dict=adapters)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
