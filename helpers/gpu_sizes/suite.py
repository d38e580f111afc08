"""The GPU check of the plans: every notebook's training step at its GPU sizes, replayed alone on one GPU, its
measured peak beside its plan (`python -m helpers.doctor --gpu-suite`): what the tensors held at once
(`torch.cuda.max_memory_allocated` over the second step), which the plan's parts price, and what the caching allocator
held from the driver meanwhile (`max_memory_reserved`: that plus the blocks it keeps and rounds up, which a 24 GB card
must also hold, and the runtime reserve covers). The steps come from data/gpu_plans.json, where each notebook's plan records the whole-model steps it
is made of (`helpers.gpu_sizes.parts.step`); on the CPU rig each runs at small sizes, so the path is exercised in CI
without a GPU (there is no allocator peak to read there: the plan is printed alone).

Sized for about 10 minutes of one GPU: a step of each distinct (model, batch, optimizer) once, three steps each.
"""
from __future__ import annotations

import time

import torch

from helpers.gpu_sizes.footprint import Replay
from helpers.gpu_sizes.plans import recorded_plans
from helpers.models.data import SyntheticTokens, lm_loss
from helpers.models.stack import build_stack

OPTIMIZERS = {"sgd": lambda p: torch.optim.SGD(p, lr=0.0), "none": lambda p: torch.optim.SGD(p, lr=0.0),
              "momentum": lambda p: torch.optim.SGD(p, lr=0.0, momentum=0.9),
              "adam": lambda p: torch.optim.Adam(p, lr=0.0)}


def run_step(step: Replay, device: torch.device, steps: int = 3) -> tuple[int, int] | None:
    """Train `step`'s model for `steps` steps on `device`; on a GPU return the peaks over the second step (after
    reset_peak_memory_stats, the model and its state already there), allocated and reserved; elsewhere None."""
    cuda = device.type == "cuda"
    model = build_stack(step.model, device=device)
    optimizer = OPTIMIZERS[step.optimizer](model.parameters())
    x, y = SyntheticTokens(step.batch, step.model.seq_len, step.model.vocab).batch(0, step.batch)
    x, y = x.to(device), y.to(device)
    peak = None
    for k in range(steps):
        if cuda and k == 1:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        optimizer.zero_grad(set_to_none=False)
        with torch.autocast(device.type, torch.bfloat16, enabled=step.autocast):
            loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        if cuda and k == 1:
            torch.cuda.synchronize(device)
            peak = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()
    return peak


def gpu_suite(device: torch.device) -> list[dict]:
    """Every notebook's recorded whole-model steps on `device`: at their GPU sizes on a GPU, small on the host. One
    row per step: notebook, what, planned, measured allocated and reserved (GPU), and allocated / planned."""
    rows = []
    for notebook, per_rig in recorded_plans().items():
        for what, step in per_rig["one_gpu"].steps:
            run = step if device.type == "cuda" else step.small()
            t0 = time.perf_counter()
            measured, reserved = run_step(run, device) or (None, None)
            planned = run.planned()
            rows.append({"notebook": notebook, "step": what, "sizes": f"{run.model.hidden} x {run.model.n_blocks}, "
                         f"{run.batch} x {run.model.seq_len}, {run.optimizer}" + (", bf16" if run.autocast else ""),
                         "planned GiB": planned / 2**30,
                         "measured GiB": None if measured is None else measured / 2**30,
                         "measured / planned": None if measured is None else measured / planned,
                         "reserved GiB": None if reserved is None else reserved / 2**30,
                         "seconds": time.perf_counter() - t0})
    return rows
