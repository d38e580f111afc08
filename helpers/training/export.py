"""What a checkpoint becomes after the run: continued on one device, and exported as a Hugging Face folder.

A checkpoint names every tensor by global layer index (helpers.training.checkpoint), whatever the strategy saved
it, and DCP reshards on load: the shards two FSDP2 ranks wrote, or the stages of a pipeline, load into the whole
model in one process (the laptop, or one GPU), with the optimizer state, and training goes on from the same step.

    from helpers.training.export import continue_on_one, export_hf
    one = continue_on_one(job, "runs/x/step-00000010", steps=5)   # the same batches the ranks would have seen
    export_hf(job.layered, one.layers, "exported/")               # AutoModelForCausalLM.from_pretrained("exported/")

A LoRA model exports merged (peft's `merge_and_unload`: a plain model) or as the adapters alone, for
`PeftModel.from_pretrained(base, folder)`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from helpers.models.data import kept_tokens, lm_loss_sum
from helpers.models.layered import Stage, microbatch_seed, with_seed
from helpers.models.text import load_rows
from helpers.training.checkpoint import Checkpointer, CheckpointSpec, layer_view
from helpers.training.job import TrainJob
from helpers.training.loop import global_batch
from helpers.training.strategies import make_optimizer, weights_in


@dataclass
class OnOne:
    """A run continued on one device: its layers, its optimizer, the checkpoint's step and the losses of the steps
    run after it (losses[k] is step first_step + k)."""

    layers: list[nn.Module]
    optimizer: torch.optim.Optimizer | None
    first_step: int
    losses: list[float] = field(default_factory=list)


def load_on_one(job: TrainJob, checkpoint: str | Path, device: torch.device | str = "cpu") -> OnOne:
    """The whole model of `job` on one device, with the weights and optimizer state of `checkpoint` (saved by any
    number of ranks, any strategy)."""
    model = job.layered
    layers = model.meta_layers()
    model.materialize(layers, range(len(layers)), torch.device(device))
    layers = list(weights_in(Stage(layers), model, job.precision).layers)
    optimizer = make_optimizer(job.optimizer, Stage(layers).parameters(), job.lr)
    path = Path(checkpoint)
    spec = replace(job.checkpoint or CheckpointSpec(str(path.parent)), folder=str(path.parent), async_save=False)
    ckpt = Checkpointer(spec, layer_view(layers, range(len(layers))), [optimizer] if optimizer else [])
    return OnOne(layers, optimizer, ckpt.load(path))


def continue_on_one(job: TrainJob, checkpoint: str | Path, steps: int,
                    device: torch.device | str = "cpu") -> OnOne:
    """`load_on_one`, then `steps` more optimizer steps on the batches the run's ranks would have trained on (the
    data position is the step), one device computing the global batch's token-mean loss."""
    one = load_on_one(job, checkpoint, device)
    stage = Stage(one.layers)
    rows = load_rows(job.data) if job.data is not None else None
    for step in range(one.first_step, one.first_step + steps):
        x, y, mask = (t.to(device) if t is not None else None for t in global_batch(job, step, rows))
        ctx = with_seed(job.layered.context(x, mask), microbatch_seed(job.data_seed, step, 0))
        with job.precision.context(torch.device(device)):
            out = stage(x, ctx) if ctx is not None else stage(x)
        loss = lm_loss_sum(out, y) / kept_tokens(y)
        if one.optimizer is not None:
            one.optimizer.zero_grad()
            loss.backward()
            one.optimizer.step()
        one.losses.append(loss.item())
    return one


def layers_logits(model, layers: list[nn.Module], input_ids: torch.Tensor) -> torch.Tensor:
    """The logits of `layers` (the whole model of `model`, e.g. `OnOne.layers`) for `input_ids`, in eval mode
    without gradients: what the folder `export_hf` writes must reproduce under `from_pretrained`."""
    ctx = model.context(input_ids, None)
    stage = Stage(layers).eval()
    with torch.no_grad():
        return stage(input_ids, ctx) if ctx is not None else stage(input_ids)


def export_hf(model, layers: list[nn.Module], directory: str | Path, merge: bool = True) -> Path:
    """Write `layers` (the whole model, e.g. `OnOne.layers`) as a Hugging Face folder that
    `AutoModelForCausalLM.from_pretrained` loads. A model that knows its own export (a LoRA model,
    `helpers.finetune.lora.LoraModel.export_hf`: merged into its base with `merge`, or the adapters alone) writes
    itself: training sits below fine-tuning and names no adapter format. Any other is saved as trained."""
    from helpers.training.api import save_trained

    if hasattr(model, "export_hf"):
        return model.export_hf(layers, directory, merge)
    state = {i: {n: t.detach().cpu().clone() for n, t in layer.state_dict().items()} for i, layer in enumerate(layers)}
    return save_trained(model, state, directory)
