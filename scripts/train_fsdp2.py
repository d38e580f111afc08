"""FSDP2 (ZeRO-3) with activation checkpointing: parameters, gradients and Adam state sharded over the GPUs, each
decoder layer gathered when it computes; activations recomputed in backward. For models whose replica does not fit.
The model is built on the meta device and sharded there; each rank then reads the checkpoint one layer at a time and
keeps its shard, so no rank ever holds the whole model in host memory.

    torchrun --nproc-per-node 2 scripts/train_fsdp2.py --model DIR --steps 100 --autocast bf16 --save-to OUT

The planner's memory flags (python -m helpers.plan --train ... --optimizer ... --technique ...): --optimizer
adamw-8bit/adamw-4bit (torchao's low-bit AdamW; on --dtype bf16 weights, bf16 stochastic rounding), --technique
optimizer-in-backward,chunked-loss,activation-offload. A full fine-tune of Llama-3-8B on two RTX 3090s (the plan:
python -m helpers.plan --train --model llama-3-8b --method full --context 2048 --batch 1 --gpus '2 x RTX 3090'
--strategy fsdp2 --optimizer adamw-4bit --precision pure --technique optimizer-in-backward,chunked-loss):

    torchrun --nproc-per-node 2 scripts/train_fsdp2.py --model DIR --seq-len 2048 --batch 2 --dtype bf16 \\
        --autocast none --optimizer adamw-4bit --technique optimizer-in-backward,chunked-loss --save-to OUT
"""
import contextlib
import json

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from helpers.dtypes import DTYPES
from helpers.models.hf import enable_activation_checkpointing
from helpers.sizing.ledger import MemoryLedger, grad_bytes
from helpers.sizing.training import chunked_loss_tokens
from helpers.training.memory_techniques import (OptimizerInBackward, chunked_lm_loss_sum, low_bit_adamw,
                                                offloaded_activations)

from _common import (IGNORE_INDEX, batches, checkpointer, decoder_layers, exit_without_teardown, init,
                     meta_model, parse, report, stream_checkpoint, token_loss_sum, training_steps, weights_dtype)


class ChunkedLoss(torch.nn.Module):
    """The causal LM returning its summed loss instead of logits: the head and the cross entropy run a chunk of
    tokens at a time, each chunk recomputed in backward, so the whole batch's logits never exist. It is FSDP2's
    root unit (embeddings, final norm, head), so its forward gathers them as the model's own forward would."""

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.lm.base_model(input_ids=input_ids).last_hidden_state  # after the final norm
        chunks = -(-targets.numel() // chunked_loss_tokens(targets.numel()))  # the planner's chunk of tokens
        return chunked_lm_loss_sum(self.lm.get_output_embeddings(), h, targets, chunks)


def make_optimizer(ns, params):
    """AdamW, or torchao's 8-/4-bit AdamW (stochastic rounding into bf16 weights, no fp32 master copy)."""
    if ns.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=ns.lr)
    return low_bit_adamw(ns.optimizer, params, ns.lr)


def main() -> None:
    ns = parse(__doc__.splitlines()[0], memory=True)  # bad flag combinations stop here, before NCCL/gloo
    rank, world, device = init()
    lm = meta_model(ns.model, weights_dtype(ns))  # shapes only: each rank reads its shards after sharding
    model = ChunkedLoss(lm) if "chunked-loss" in ns.technique else lm
    mesh = init_device_mesh(device.type, (world,))
    enable_activation_checkpointing(lm)  # recompute each decoder layer in backward
    half = DTYPES.get(ns.autocast)  # None without autocast
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
    for layer in decoder_layers(lm)[1]:
        fully_shard(layer, mesh=mesh, mp_policy=mp)  # one all-gather per decoder layer
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the rest (embeddings, tied head, final norm) in the root unit
    model.to_empty(device=device)
    stream_checkpoint(lm, ns.model, weights_dtype(ns), rank, world)  # one layer at a time on the host
    if "optimizer-in-backward" in ns.technique:  # each shard steps in backward once reduce-scattered, then freed
        optimizer = OptimizerInBackward(model.parameters(), lambda params: make_optimizer(ns, params))
    else:
        optimizer = make_optimizer(ns, model.parameters())
    scaler = ShardedGradScaler(device.type, enabled=ns.autocast == "fp16")
    checkpoints = checkpointer(ns, model, optimizer, scaler)
    ledger = MemoryLedger(["device", "host"])  # the course's byte accounting of this rank (--memory-report)
    ledger.assign("device", model)
    ledger.optimizer = optimizer
    if "activation-offload" in ns.technique:  # what autograd saves goes to host memory (pinned on a GPU)
        saving = lambda: offloaded_activations(ledger, pin_memory=device.type == "cuda")  # noqa: E731
    elif ns.memory_report:  # the ledger's hooks on every saved tensor only when asked: they cost time per tensor
        saving = lambda: ledger.track_activations("device")  # noqa: E731
    else:
        saving = contextlib.nullcontext
    peak_grads = 0
    per_rank = ns.batch // world
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, lm.config.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for k, (xm, ym) in enumerate(zip(x.chunk(ns.microbatches), y.chunk(ns.microbatches))):
            model.set_requires_gradient_sync(k == ns.microbatches - 1)  # reduce-scatter on the last only
            with saving():
                if "chunked-loss" in ns.technique:
                    summed = model(xm, ym)
                else:
                    summed = token_loss_sum(model(input_ids=xm).logits, ym)
                scaler.scale(summed * world / real).backward()  # FSDP2 averages over ranks, like DDP
            total += summed.detach()
        peak_grads = max(peak_grads, grad_bytes(model.parameters()))
        scaler.step(optimizer)  # with the step in backward: nothing left to do
        scaler.update()
        dist.all_reduce(total)
        report(step, total.item() / real)
    if ns.memory_report:
        measured = ledger.device("device").parts()
        if isinstance(optimizer, OptimizerInBackward):
            peak_grads = optimizer.peak_grad_bytes  # one unit's gradient shard at a time
        measured.update(grads=peak_grads, buffers=sum(b.numel() * b.element_size() for b in model.buffers()),
                        host_activations=ledger.device("host").activations)
        print(json.dumps({"rank": rank, "memory": measured}), flush=True)
    state = get_model_state_dict(lm, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ns.save_to and rank == 0:
        lm.save_pretrained(ns.save_to, state_dict=state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # FSDP2 ranks may abort in the interpreter's teardown, after the work is done
