"""DP x PP on a 2-D DeviceMesh: pipelines of `--pp` stages, `--dp` of them side by side on different data; each
stage's gradients summed over its replicas. Four GPUs (or two machines of two):

    torchrun --nproc-per-node 4 scripts/train_dp_x_pp.py --model DIR --pp 2 --microbatches 4 --steps 100
"""
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from _common import (IGNORE_INDEX, autocast, batches, checkpointer, init, parse, report, token_loss_sum,
                     training_steps, weights_dtype)
from _stages import build_stage, save_pipeline, tied_copy
from helpers.models.hf import HFModel
from helpers.training.checkpoint import layer_view


def main() -> None:
    ns = parse(__doc__.splitlines()[0], pipeline=True, mesh=True)
    pp = ns.pp
    if ns.autocast == "fp16":
        raise SystemExit("this script trains with --autocast bf16 or none; fp16 needs a gradient scaler agreed by "
                         "all ranks: see scripts/train_pipeline.py")
    if ns.schedule not in ("gpipe", "1f1b"):
        raise SystemExit(f"this script runs --schedule gpipe or 1f1b, one stage per GPU; {ns.schedule} holds "
                         "several: scripts/train_pipeline.py runs every schedule")
    rank, world, device = init()
    if world % pp:
        raise SystemExit(f"{world} processes cannot make pipelines of {pp} stages")
    dp = world // pp
    mesh = init_device_mesh(device.type, (dp, pp), mesh_dim_names=("dp", "pp"))
    replica, stage_index = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    model = HFModel(ns.model, dtype=weights_dtype(ns))
    module, first = build_stage(model, stage_index, pp, device)
    tied = tied_copy(model, module, first, stage_index, pp)
    ends = [dist.new_group([r * pp, r * pp + pp - 1]) for r in range(dp)] if model.tied else []
    stage = PipelineStage(module, stage_index, pp, device, group=mesh.get_group("pp"))
    scale = [1.0]
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[ns.schedule](
        stage, ns.microbatches, scale_grads=False, loss_fn=lambda out, target: token_loss_sum(out, target) * scale[0])
    optimizer = torch.optim.AdamW(module.parameters(), lr=ns.lr)
    checkpoints = checkpointer(ns, layer_view(module.layers, range(first, first + len(module.layers))),
                               optimizer)
    per_replica = ns.batch // dp
    for step in training_steps(ns, checkpoints):
        x, y = batches(ns, model.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()  # the whole global batch's: replicas' gradients are summed
        scale[0] = 1.0 / real
        rows = slice(replica * per_replica, (replica + 1) * per_replica)
        optimizer.zero_grad()
        losses = []
        with autocast(ns, device):
            if stage_index == 0:
                schedule.step(x[rows].to(device))
            elif stage_index == pp - 1:
                schedule.step(target=y[rows].to(device), losses=losses)
            else:
                schedule.step()
        if tied is not None:
            dist.all_reduce(tied.grad, group=ends[replica])
        grads = [p.grad for p in module.parameters()]
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat, group=mesh.get_group("dp"))  # one bucket: sum over the replicas of this stage
        for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(summed.view_as(g))
        optimizer.step()
        total = torch.stack(losses).sum().detach() * real if losses else torch.zeros((), device=device)
        dist.all_reduce(total)
        report(step, total.item() / real)
    if ns.save_to and replica == 0:  # replica 0's stages hold the whole model
        save_pipeline(model, [(module, first)], ns.save_to, group=mesh.get_group("pp"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
