"""A pipeline with torch.distributed.pipelining, any of its schedules (their classes: helpers/catalog.py): GPipe and
1F1B (one stage per GPU), and the schedules that hold two stages per GPU: ScheduleInterleaved1F1B (interleaved: GPU d
holds stages d and d + p), ScheduleZBVZeroBubble and ScheduleDualPipeV (the V shapes: GPU d holds stages d and
2p - 1 - d, so GPU 0 holds the first and the last); ZB-H1 is ScheduleInterleavedZeroBubble with one stage per GPU. The batch is cut into
micro-batches so all GPUs work at once. Tied embeddings: one copy per end, gradients summed (on one GPU for the V).

    torchrun --nproc-per-node 2 scripts/train_pipeline.py --model DIR --schedule zbv --microbatches 4 --steps 100
"""
import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.pipelining import PipelineStage

from _common import (IGNORE_INDEX, autocast, batches, checkpointer, init, parse, report, token_loss_sum,
                     training_steps, weights_dtype)
from _stages import build_stage, save_pipeline, tied_copy
from helpers.models.hf import HFModel
from helpers.pipeline.schedules import layout_for
from helpers.catalog import schedule_entry  # a schedule's torch.distributed.pipelining class, among the rest
from helpers.training.checkpoint import layer_view


def main() -> None:
    ns = parse(__doc__.splitlines()[0], pipeline=True)
    rank, world, device = init()
    model = HFModel(ns.model, dtype=weights_dtype(ns))
    layout = layout_for(ns.schedule, world)  # which stages this rank holds: one per chunk
    mine = layout.stages_of(rank)
    built = {k: build_stage(model, k, layout.stages, device) for k in mine}  # k -> (module, its first layer)
    stages = [PipelineStage(built[k][0], k, layout.stages, device) for k in mine]
    tied = [t for k in mine if (t := tied_copy(model, built[k][0], built[k][1], k, layout.stages)) is not None]
    ends = {layout.device_of(0), layout.device_of(layout.stages - 1)}
    group = dist.new_group(sorted(ends)) if model.tied and len(ends) > 1 and world > 2 else None  # on every rank
    scale = [1.0]  # this step's 1 / (real tokens of the global batch) x the loss scale
    cls = getattr(pipelining, schedule_entry(ns.schedule).torch_class)
    multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)  # takes a list of stages
    schedule = cls(stages if multi else stages[0], ns.microbatches, scale_grads=False,
                   loss_fn=lambda out, target: token_loss_sum(out, target) * scale[0])
    parameters = [p for module, _ in built.values() for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=ns.lr)
    scaler = ShardedGradScaler(device.type, enabled=ns.autocast == "fp16")  # overflow agreed by every stage
    owned = [(a + j, layer) for module, a in built.values() for j, layer in enumerate(module.layers)]
    checkpoints = checkpointer(ns, layer_view([l for _, l in owned], [i for i, _ in owned]), optimizer, scaler)
    scaler.scale(torch.ones((), device=device))
    first, last = 0 in mine, layout.stages - 1 in mine
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()
        scale[0] = scaler.get_scale() / real if scaler.is_enabled() else 1.0 / real
        optimizer.zero_grad()
        losses = []
        with autocast(ns, device):
            schedule.step(*((x.to(device),) if first else ()),
                          **(dict(target=y.to(device), losses=losses) if last else {}))
        if tied:  # both copies get the sum of both gradients (Megatron's rule), on one rank or across the ends
            total_grad = sum(t.grad for t in tied)
            if len(tied) == 1 and len(ends) > 1:
                dist.all_reduce(total_grad, group=group)
            for t in tied:
                t.grad.copy_(total_grad)
        scaler.step(optimizer)
        scaler.update()
        total = torch.stack(losses).sum().detach() / scale[0] / real if losses else torch.zeros((), device=device)
        dist.all_reduce(total)
        report(step, total.item())
    if ns.save_to:
        save_pipeline(model, [built[k] for k in mine], ns.save_to)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
