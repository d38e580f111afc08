"""What every training script shares: the same flags, the process group, the data, the loss, saving.

Each script is plain PyTorch + transformers you can take home; launch it with torchrun, on two GPUs or on a CPU:
    torchrun --nproc-per-node 2 scripts/train_ddp.py --model DIR --steps 100 --autocast bf16 --save-to OUT
"""
from __future__ import annotations

import argparse
import json
import os
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F

IGNORE_INDEX = -100


def parse(description: str, pipeline: bool = False, mesh: bool = False) -> argparse.Namespace:
    """The flags every script takes (the same everywhere, so switching strategy is switching the script); pipeline
    scripts add --schedule, DP x PP adds --pp (stages per pipeline)."""
    p = argparse.ArgumentParser(description=description)
    if pipeline:
        p.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b")
    if mesh:
        p.add_argument("--pp", type=int, default=2, help="pipeline stages; the other ranks are replicas")
    p.add_argument("--model", required=True, help="a directory written by save_pretrained")
    p.add_argument("--data", help="a torch.save'd LongTensor [N, L+1] of token ids (default: synthetic tokens that "
                                  "follow a fixed rule, so the loss can fall)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--microbatches", type=int, default=4 if pipeline else 1,
                   help="pipeline micro-batches / gradient accumulation steps")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--autocast", choices=("none", "bf16", "fp16"), default="bf16")
    p.add_argument("--save-to", help="save the trained model here with save_pretrained")
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    if ns.batch % ns.microbatches:
        p.error(f"--batch {ns.batch} is not divisible by --microbatches {ns.microbatches}")
    return ns


def init() -> tuple[int, int, torch.device]:
    """Join the process group as PyTorch's own engines do: on GPUs bind the rank's GPU first and give NCCL
    `device_id`, so its communicator is created now, on every rank together (LAB_FORCE_CPU=1: the CPU rig)."""
    if torch.cuda.is_available() and os.environ.get("LAB_FORCE_CPU") != "1":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def batches(ns: argparse.Namespace, vocab: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch for `step`, identical on every rank."""
    if ns.data:
        tokens = torch.load(ns.data)
        start = (step * ns.batch) % max(1, len(tokens) - ns.batch + 1)
        rows = tokens[start:start + ns.batch, :ns.seq_len + 1]
    else:  # learnable: each token follows the previous one by a fixed permutation, from a random first token
        rule = torch.randperm(vocab, generator=torch.Generator().manual_seed(ns.seed))
        g = torch.Generator().manual_seed(ns.seed * 100_003 + step)
        columns = [torch.randint(vocab, (ns.batch,), generator=g)]
        for _ in range(ns.seq_len):
            columns.append(rule[columns[-1]])
        rows = torch.stack(columns, dim=1)
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over the real tokens, in fp32. Divide by the real tokens of the *whole* batch: then
    shards and micro-batches with different padding still add up to one device's mean."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def autocast(ns: argparse.Namespace, device: torch.device):
    if ns.autocast == "none":
        return nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if ns.autocast == "bf16" else torch.float16)


def report(step: int, loss: float) -> None:
    """One JSON line per step on rank 0 (tests and plots read them)."""
    if dist.get_rank() == 0:
        print(json.dumps({"step": step, "loss": loss}), flush=True)
