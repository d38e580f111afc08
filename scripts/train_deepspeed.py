"""DeepSpeed ZeRO (stage 1, 2 or 3; --offload cpu: ZeRO-Offload) on a Hugging Face causal LM, one rank per GPU.

    torchrun --nproc-per-node 2 scripts/train_deepspeed.py --model DIR --stage 3 --offload cpu --dtype bf16

The DeepSpeed config is written from the flags (the course's `ds_config`: batch sizes that multiply out, clipping off
where DeepSpeed's default clips at 1.0, its CPU Adam under offload) or read from --ds-config and checked against them.
--checkpoint-dir saves DeepSpeed checkpoints (engine.save_checkpoint) and resumes from the latest; --save-to writes
a Hugging Face folder (ZeRO-3's partitions gathered to rank 0). `pip install -r requirements-deepspeed.txt` first.
"""
import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

from _common import IGNORE_INDEX, batches, init, parse, report, token_loss_sum, weights_dtype


def config_for(ns, world: int) -> dict:
    """The run's DeepSpeed config: the user's (--ds-config), checked against the flags, or the course's."""
    from helpers.models.stack import StackConfig
    from helpers.training.deepspeed_zero import check_config, ds_config
    from helpers.training.job import TrainJob

    job = TrainJob(StackConfig(), f"ds_zero{ns.stage}", dp=world, batch=ns.batch, microbatches=ns.microbatches,
                   optimizer="adamw", lr=ns.lr, dtype=ns.dtype, offload=ns.offload)
    if ns.ds_config:
        config = json.loads(Path(ns.ds_config).read_text())
        check_config(config, job)
        return config
    return ds_config(job)


def save_checkpoint(engine, ns, step: int) -> None:
    """A DeepSpeed checkpoint of every rank's partitions at `step`, the oldest beyond --keep removed by rank 0."""
    engine.save_checkpoint(ns.checkpoint_dir, tag=f"step{step}", client_state={"step": step})
    if dist.get_rank() == 0:
        tags = sorted(Path(ns.checkpoint_dir).glob("step*"), key=lambda p: int(p.name[4:]))
        for old in tags[:-ns.keep]:
            shutil.rmtree(old)
    dist.barrier()


def main() -> None:
    ns = parse(__doc__.splitlines()[0], deepspeed=True)
    model = AutoModelForCausalLM.from_pretrained(ns.model, dtype=weights_dtype(ns))  # on the host: ZeRO partitions it
    rank, world, device = init()
    if device.type == "cpu":  # DeepSpeed's CPU accelerator, named (found, it warns)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    config = config_for(ns, world)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if ns.offload else torch.optim.AdamW(params, lr=ns.lr)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config, optimizer=optimizer,
                                      dist_init_required=False)
    first = 0
    if ns.checkpoint_dir and (Path(ns.checkpoint_dir) / "latest").is_file():
        _, state = engine.load_checkpoint(ns.checkpoint_dir)
        first = state["step"]
        if rank == 0:
            print(json.dumps({"resumed_from": first}), flush=True)
    per_rank = ns.batch // world
    for step in range(first, ns.steps):
        x, y = batches(ns, model.config.vocab_size, step)
        real = (y != IGNORE_INDEX).sum().item()  # real tokens in the whole global batch
        x, y = x[rank * per_rank:(rank + 1) * per_rank].to(device), y[rank * per_rank:(rank + 1) * per_rank].to(device)
        total = torch.zeros((), device=device)
        for xm, ym in zip(x.chunk(ns.microbatches), y.chunk(ns.microbatches)):
            summed = token_loss_sum(engine(input_ids=xm).logits, ym)
            engine.backward(summed * world / real, scale_wrt_gas=False)  # averaged over ranks: x world, the mean
            engine.step()  # steps the optimizer at the last micro-batch, counts the others
            total += summed.detach()
        dist.all_reduce(total)
        report(step, total.item() / real)
        if ns.checkpoint_dir and ((step + 1) % ns.checkpoint_every == 0 or step + 1 == ns.steps):
            save_checkpoint(engine, ns, step + 1)
    if ns.save_to:
        state = engine._zero3_consolidated_16bit_state_dict() if ns.stage == 3 else None  # a collective
        if rank == 0:
            model.save_pretrained(ns.save_to, state_dict=state)
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
