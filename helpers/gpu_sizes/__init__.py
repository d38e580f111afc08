"""GPU sizes planned, not guessed: every notebook's GPU constants against the course's memory model, per device.

Its own room (not `sizing.ledger`, which counts what a run holds while it runs, nor `inference.plan`, which places one
model for generation): it plans whole notebooks before they run, from the same accounting (`MemoryLedger` on the
meta device) plus what a GPU adds (workspace, CUDA contexts, allocator margin).

- `footprint`: one device's bytes in a training step, measured on the meta device; `training_step_peak` is the plan
  of one step, to compare with `torch.cuda.max_memory_allocated` on a GPU.
- `parts`: what a model kept alive, a step, a pipeline (any schedule) or a group of ranks holds on each device: the
  pieces a notebook's plan is made of.
- `plans`: a notebook's phases and per-device peaks on two RTX 3090s or one; `check_plan`, which each notebook calls
  with the plan it declares after its parameters; `notebook_plans` / `plans_table`, which the doctor prints from
  data/gpu_plans.json (the library never reads a notebook: a test walks them and keeps that file current).
"""
from helpers.gpu_sizes.footprint import Footprint, stage_bytes, training_step, training_step_peak
from helpers.gpu_sizes.plans import (HEADROOM, NotebookPlan, NotEnoughMemory, Part, Phase, PlanRecord, check_plan,
                                     notebook_plans, plan_of, plans_table, recorded_plans, rtx3090_rigs, shortfalls)

__all__ = ["Footprint", "HEADROOM", "NotEnoughMemory", "NotebookPlan", "Part", "Phase", "PlanRecord", "check_plan",
           "notebook_plans", "plan_of", "plans_table", "recorded_plans", "rtx3090_rigs", "shortfalls", "stage_bytes",
           "training_step", "training_step_peak"]
