"""FSDP2 (ZeRO-3) with activation checkpointing: parameters, gradients and Adam state sharded over the GPUs, each
decoder layer gathered when it computes; activations recomputed in backward. For models whose replica does not fit.
The model is built on the meta device and sharded there; each rank then reads the checkpoint one layer at a time and
keeps its shard, so no rank ever holds the whole model in host memory.

    torchrun --nproc-per-node 2 scripts/train_fsdp2.py --model DIR --steps 100 --autocast bf16 --save-to OUT
"""
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from helpers.models.hf import enable_activation_checkpointing

from helpers.dtypes import DTYPES

from _common import (IGNORE_INDEX, batches, checkpointer, decoder_layers, exit_without_teardown, init, meta_model,
                     parse, report, stream_checkpoint, token_loss_sum, training_steps, weights_dtype)


def main() -> None:
    ns = parse(__doc__.splitlines()[0])
    rank, world, device = init()
    model = meta_model(ns.model, weights_dtype(ns))  # shapes only: each rank reads its shards after sharding
    mesh = init_device_mesh(device.type, (world,))
    enable_activation_checkpointing(model)  # recompute each decoder layer in backward
    half = DTYPES.get(ns.autocast)  # None without autocast
    mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32) if half else MixedPrecisionPolicy()
    for layer in decoder_layers(model)[1]:
        fully_shard(layer, mesh=mesh, mp_policy=mp)  # one all-gather per decoder layer
    fully_shard(model, mesh=mesh, mp_policy=mp)  # the rest (embeddings, tied head, final norm) in the root unit
    model.to_empty(device=device)
    stream_checkpoint(model, ns.model, weights_dtype(ns), rank, world)  # one layer at a time on the host
    optimizer = torch.optim.AdamW(model.parameters(), lr=ns.lr)
    scaler = ShardedGradScaler(device.type, enabled=ns.autocast == "fp16")
    checkpoints = checkpointer(ns, model, optimizer, scaler)
    per_rank = ns.batch // world
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.config.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        optimizer.zero_grad()
        total = torch.zeros((), device=device)
        for k, (xm, ym) in enumerate(zip(x.chunk(ns.microbatches), y.chunk(ns.microbatches))):
            model.set_requires_gradient_sync(k == ns.microbatches - 1)  # reduce-scatter on the last only
            summed = token_loss_sum(model(input_ids=xm).logits, ym)
            scaler.scale(summed * world / real).backward()  # FSDP2 averages over ranks, like DDP
            total += summed.detach()
        scaler.step(optimizer)
        scaler.update()
        dist.all_reduce(total)
        report(step, total.item() / real)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ns.save_to and rank == 0:
        model.save_pretrained(ns.save_to, state_dict=state)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown()  # FSDP2 ranks may abort in the interpreter's teardown, after the work is done
