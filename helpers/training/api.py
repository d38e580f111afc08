"""One entry point: train a Hugging Face causal LM (a config, or a directory written by `save_pretrained`) with any
strategy and engine for N steps, and save the result with `save_pretrained`.

    from helpers.training import train
    out = train("models/tiny-llama", strategy="1f1b", engine="processes", steps=20, autocast="bf16",
                save_to="models/tiny-llama-trained")

Data: synthetic tokens by default; `text=` a file or folder of real text (the tokenizer saved beside the model is
used, or a byte-level BPE is trained on the text and saved beside it and beside the trained model); `data=` token
windows saved with torch.save ([N, L+1], helpers.models.text).

Strategies and their engines: helpers.catalog's. Every strategy computes what one device computes
(helpers.training.support says where each runs); the saved model reloads with `from_pretrained` and equals the
trained weights.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields as dataclass_fields, replace
from pathlib import Path
from typing import Mapping

import torch

from helpers.models.text import load_rows
from helpers.models.hf import HFModel, save_hf_model
from helpers.models.layered import microbatch_seed, owned_layers
from helpers.pipeline.stages import split_model
from helpers.precision import make_scaler
from helpers.runtime.rig import Rig, detect_rig
from helpers.runtime.scratch import scratch_dir
from helpers.training.checkpoint import CheckpointSpec, as_checkpoint_spec
from helpers.training.job import TrainJob, check_choice, check_job, job_for, renamed
from helpers.training.loop import global_batch, run_trainings
from helpers.training.strategies import make_optimizer, step_optimizer


@dataclass
class Trained:
    """What `train` and `finetune` return: the losses of every step, the trained weights by layer (a LoRA model's:
    its adapters alone), the model trained, and where the weights were saved."""

    losses: list[float]
    state: dict[int, dict[str, torch.Tensor]]
    model: object = None  # what was trained: an HFModel, or a LoraModel (helpers.finetune.lora)
    saved: Path | None = None
    events: list = field(default_factory=list)
    held_out_path: Path | None = None  # with text=: the held-out token windows (helpers.models.text.text_loss)
    held_out_loss: tuple[float, float] | None = None  # finetune: the loss on held-out windows before and after
    samples: tuple[str, str] | None = None  # finetune: the greedy continuation of its prompt before and after
    tokenizer: object | None = None  # with text=: the tokenizer of the text
    step_times: list[float] = field(default_factory=list)  # engine processes: every timed step (slowest rank)
    memory: list = field(default_factory=list)  # engine processes: per rank, DeviceMemory (helpers.sizing.ledger)
    first_step: int = 0  # with checkpoint=: the step the run resumed from (losses[k] is step first_step + k)
    save_blocked: list[float] = field(default_factory=list)  # with checkpoint=: seconds each save blocked a step
    job: TrainJob | None = None  # the job that ran (helpers.training.export.continue_on_one takes it)


def as_hf_model(model, workdir: Path | None = None, seed: int = 0) -> HFModel:
    """An HFModel from a directory (or an HFModel); a config object is first built with random weights from `seed`
    and saved, as a user saves a downloaded checkpoint, so every rank can load its own slice."""
    if isinstance(model, HFModel):
        return model
    if isinstance(model, (str, Path)):
        return HFModel(str(model))
    if hasattr(model, "model_type"):
        directory = Path(workdir or scratch_dir("lab-model-"))
        return save_hf_model(model, directory, seed=seed)
    raise TypeError(f"expected a save_pretrained directory, a transformers config or an HFModel, got "
                    f"{type(model).__name__}")


def _train_threads(model: HFModel, job: TrainJob, rig: Rig) -> Trained:
    """The in-process engine: the whole model loaded here, split over the rig's devices, one thread per stage."""
    from helpers.pipeline.threaded import ThreadedPipeline, stage_devices

    layers = owned_layers(model, range(model.n_layers), torch.device("cpu"))
    split = split_model([layer.to(job.precision.weights) for layer in layers], job.cut(),
                        stage_devices(rig.devices, job.layout))
    pipe = ThreadedPipeline(split, job.schedule, job.microbatches, wire=job.wire, precision=job.precision,
                            context=model.context)
    optimizer = make_optimizer(job.optimizer if job.optimizer != "none" else "sgd", split.parameters(), job.lr)
    scaler = make_scaler(job.precision, rig.devices[-1])
    rows = load_rows(job.data) if job.data is not None else None
    losses = []
    for step in range(job.timed_steps + 2):
        x, y, mask = global_batch(job, step, rows)
        optimizer.zero_grad(set_to_none=False)
        seeds = [microbatch_seed(job.data_seed, step, k) for k in range(job.microbatches)]
        loss = pipe.step(x, y, mask, loss_scale=scaler.get_scale() if scaler else 1.0, seeds=seeds)
        step_optimizer(optimizer, scaler)
        losses.append(loss.item())
    layers = [layer for stage in split.stages for layer in stage.layers]  # in global order: stages are contiguous
    state = {i: {n: t.detach().cpu().clone() for n, t in layer.state_dict().items()} for i, layer in enumerate(layers)}
    return Trained(losses, state, events=pipe.events())


def save_trained(model: HFModel, state: dict[int, dict[str, torch.Tensor]], directory: str | Path) -> Path:
    """Write the trained layers as a Hugging Face checkpoint (`save_pretrained`), tied weights stored once."""
    from transformers import AutoModelForCausalLM

    names = model.checkpoint_names(sorted(state))
    tensors = {}
    for i, layer_state in state.items():
        for local, value in layer_state.items():
            name = names[i].get(local)
            if name is not None and name not in tensors:  # a tied head maps to the embedding's tensor: kept once
                tensors[name] = value
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(model.config, dtype=model.weights_dtype)
    missing, unexpected = hf.load_state_dict(tensors, strict=False, assign=True)
    hf.tie_weights()
    still_missing = [m for m in missing if not (model.tied and m.endswith("lm_head.weight"))]
    if still_missing or unexpected:
        raise RuntimeError(f"the trained layers do not make the whole model: missing {still_missing}, "
                           f"unexpected {unexpected}")
    directory = Path(directory)
    hf.save_pretrained(directory)
    return directory


TRAIN_DEFAULTS = {"batch": 8, "seq_len": 32, "microbatches": 4, "optimizer": "adam"}  # train()'s job, where it
# differs from TrainJob's defaults: a few Adam steps on a small batch in 4 micro-batches
SET_BY_TRAIN = {"model", "strategy", "engine", "dp", "pp", "data_parallel", "schedule",  # the strategy's layout
                "timed_steps", "return_state"}  # and train_each's steps


def train(model, strategy: str = "1f1b", engine: str = "processes", steps: int = 10,
          save_to: str | Path | None = None, model_seed: int = 0, **options) -> Trained:
    """Train `model` for `steps` optimizer steps (>= 3: one warm-up, timed steps, one recorded) on synthetic tokens,
    real `text` or token windows `data`, and, with `save_to`, save it with `save_pretrained` (and the text's
    tokenizer beside it). `options` are `train_each`'s: how it runs (`rig`, `timeout`, `text`, `data`, `workdir`,
    `checkpoint`: a folder or CheckpointSpec where the run saves its training state with DCP and from whose latest
    complete checkpoint it resumes; `restarts`: torchrun's --max-restarts) and the job's fields
    (`helpers.training.job.TrainJob`: batch=8, seq_len=32, microbatches=4, optimizer="adam", lr, dtype, autocast,
    padding, data_seed, activation_checkpointing (recompute each decoder layer in backward: the data-parallel
    strategies), offload="cpu" (FSDP2's CPU offload: fsdp2, zero2), max_grad_norm, and the memory techniques of
    helpers.training.memory_techniques: optimizer="adamw-8bit" | "adamw-4bit", optimizer_in_backward, loss_chunks,
    activation_offload; batched_weights=2: a zero-bubble pipeline's weight passes two micro-batches at a time). Bad
    input is refused before anything starts."""
    check_choice(strategy, engine)  # before a config is built and saved
    hf = as_hf_model(model, seed=model_seed)
    out = train_each({"model": hf}, strategy, engine, steps=steps, save_to={"model": save_to}, **options)["model"]
    if save_to is not None and out.tokenizer is not None:
        out.tokenizer.save_pretrained(str(save_to))
    return out


def run_options() -> list[str]:
    """train_each's own keywords, how a run goes rather than what it trains: read off its signature, so a new one
    needs no second list."""
    skip = {"models", "strategy", "engine", "steps", "save_to", "save", "fields"}
    return [name for name in inspect.signature(train_each).parameters if name not in skip]


def job_fields(fields: Mapping[str, object]) -> dict:
    """train()'s job fields: TRAIN_DEFAULTS under the caller's, deprecated names renamed, and a field the caller
    may not set refused with those it may (the strategy sets the layout, train_each the steps, data and
    checkpoint)."""
    fields = {**TRAIN_DEFAULTS, **renamed(fields)}
    run = run_options()
    known = {f.name for f in dataclass_fields(TrainJob)} - set(run) - SET_BY_TRAIN
    unknown = sorted(set(fields) - known)
    if unknown:
        raise TypeError(f"train() got unknown option(s) {unknown}: a job's fields are {sorted(known)}, and how it "
                        f"runs: {run}")
    return fields


def train_each(models: Mapping[str, object], strategy: str, engine: str = "processes", steps: int = 10,
               save_to: Mapping[str, str | Path | None] | None = None, save=save_trained, rig: Rig | None = None,
               timeout: float = 600.0, text: str | Path | None = None, data: str | Path | None = None,
               workdir: str | Path | None = None, max_chars: int = 400_000,
               checkpoint: str | Path | CheckpointSpec | None = None, restarts: int = 0,
               **fields) -> dict[str, Trained]:
    """`train` of each of `models` (variants of one checkpoint, sharing its tokenizer: e.g. LoRA and QLoRA of one
    base) by name, with one strategy on the same data, one after the other in one launch of the ranks
    (`helpers.training.loop.run_trainings`: one start-up of the processes for all of them). `save_to`: a folder per
    name (or None), written by `save(model, state, folder)`; with several models, each one's checkpoints go to
    its own subfolder of `checkpoint` (checkpoint/name). `fields`: the TrainJob's (batch, seq_len, lr, ...), with
    train()'s defaults (TRAIN_DEFAULTS). Every job is checked before anything starts."""
    check_choice(strategy, engine)
    fields = job_fields(fields)
    seq_len = fields.pop("seq_len")
    if not isinstance(steps, int) or steps < 3:
        raise ValueError(f"steps must be at least 3 (one warm-up, one or more timed, one recorded), got {steps}")
    if text is not None and data is not None:
        raise ValueError("give text= or data= (token windows), not both")
    spec = as_checkpoint_spec(checkpoint)
    if spec is not None and engine == "threads":
        raise ValueError("checkpoints (DCP) are saved by the ranks of engine 'processes' or 'torch', not 'threads'")
    rig = rig or detect_rig()
    held_out = tokenizer = None
    if text is not None:
        from helpers.models.text import model_text

        first = next(iter(models.values()))
        folder = Path(workdir or scratch_dir("lab-text-"))
        data, held_out, tokenizer = model_text(first.path, first.vocab_size, text, seq_len, folder,
                                               max_chars=max_chars)
    own = spec is not None and len(models) > 1  # each model's checkpoints in a subfolder of its own
    jobs = [job_for(model, strategy, engine, timed_steps=steps - 2, return_state=True, seq_len=seq_len,
                    checkpoint=replace(spec, folder=str(Path(spec.folder) / name)) if own else spec,
                    data=str(data) if data is not None else None, **fields) for name, model in models.items()]
    if engine == "threads":
        for job in jobs:
            check_job(job, rig)
        outs = [_train_threads(model, job, rig) for model, job in zip(models.values(), jobs)]
    else:
        results = run_trainings(jobs, rig, timeout=timeout, oversubscribe=rig.is_cpu, restarts=restarts)
        outs = [Trained(res.losses, res.state, events=res.events, step_times=res.step_times, memory=res.memory,
                        first_step=res.first_step, save_blocked=res.save_blocked) for res in results]
    folders = save_to or {}
    for (name, model), out, job in zip(models.items(), outs, jobs):
        out.model, out.held_out_path, out.tokenizer, out.job = model, held_out, tokenizer, job
        if folders.get(name) is not None:
            out.saved = save(model, out.state, folders[name])
    return dict(zip(models, outs))
