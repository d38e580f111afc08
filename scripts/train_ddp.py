"""Data parallelism with DDP: a full replica per GPU, each computes half the batch, gradients averaged.

    torchrun --nproc-per-node 2 scripts/train_ddp.py --model DIR --steps 100 --autocast bf16 --save-to OUT
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoModelForCausalLM

from _common import (IGNORE_INDEX, autocast, batches, checkpointer, init, parse, report, token_loss_sum,
                     training_steps, weights_dtype)


def main() -> None:
    ns = parse(__doc__.splitlines()[0])
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=weights_dtype(ns))  # read on the host first
    rank, world, device = init()
    model.to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=ns.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=ns.autocast == "fp16")
    checkpoints = checkpointer(ns, ddp.module, optimizer, scaler)
    per_rank = ns.batch // world
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.config.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()  # real tokens in the whole global batch
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for k, (xm, ym) in enumerate(zip(x.chunk(ns.microbatches), y.chunk(ns.microbatches))):
            last = k == ns.microbatches - 1
            with ddp.no_sync() if not last else nullcontext(), autocast(ns, device):
                summed = token_loss_sum(ddp(input_ids=xm).logits, ym)
                scaler.scale(summed * world / real).backward()  # DDP averages: x world makes it the global mean
            total += summed.detach()
        scaler.step(optimizer)
        scaler.update()
        dist.all_reduce(total)
        report(step, total.item() / real)
    if ns.save_to and rank == 0:
        model.save_pretrained(ns.save_to)
    del ddp  # free DDP before leaving the group: freed after, its reducer tears the group down holding Python's lock
    dist.destroy_process_group()  # while gloo's worker thread waits for that lock to free a tensor (hung 1 run in 8)


if __name__ == "__main__":
    main()
