"""A pipeline with torch.distributed.pipelining: the first half of the layers on GPU 0, the rest on GPU 1, the batch
cut into micro-batches so both work at once (GPipe or 1F1B). Tied embeddings: one copy per end, gradients summed.

    torchrun --nproc-per-node 2 scripts/train_pipeline.py --model DIR --schedule 1f1b --microbatches 4 --steps 100
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from _common import (IGNORE_INDEX, autocast, batches, checkpointer, init, parse, report, token_loss_sum,
                     training_steps, weights_dtype)
from _stages import build_stage, save_pipeline, tied_copy
from helpers.models.hf import HFModel
from helpers.training.checkpoint import layer_view

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def main() -> None:
    ns = parse(__doc__.splitlines()[0], pipeline=True)
    rank, world, device = init()
    model = HFModel(ns.model, dtype=weights_dtype(ns))
    module, first = build_stage(model, rank, world, device)
    tied = tied_copy(model, module, first, rank, world)
    ends = dist.new_group([0, world - 1]) if model.tied and world > 2 else None  # every rank creates the group
    stage = PipelineStage(module, rank, world, device)
    scale = [1.0]  # this step's 1 / (real tokens of the global batch) x the loss scale
    schedule = SCHEDULES[ns.schedule](stage, ns.microbatches, scale_grads=False,
                                        loss_fn=lambda out, target: token_loss_sum(out, target) * scale[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=ns.lr)
    scaler = ShardedGradScaler(device.type, enabled=ns.autocast == "fp16")  # overflow agreed by every stage
    checkpoints = checkpointer(ns, layer_view(module.layers, range(first, first + len(module.layers))),
                               optimizer, scaler)
    scaler.scale(torch.ones((), device=device))
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()
        scale[0] = scaler.get_scale() / real if scaler.is_enabled() else 1.0 / real
        optimizer.zero_grad()
        losses = []
        with autocast(ns, device):
            if rank == 0:
                schedule.step(x.to(device))
            elif rank == world - 1:
                schedule.step(target=y.to(device), losses=losses)
            else:
                schedule.step()
        if tied is not None:
            dist.all_reduce(tied.grad, group=ends)
        scaler.step(optimizer)
        scaler.update()
        total = torch.stack(losses).sum().detach() / scale[0] / real if losses else torch.zeros((), device=device)
        dist.all_reduce(total)
        report(step, total.item())
    if ns.save_to:
        save_pipeline(model, module, first, ns.save_to)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
