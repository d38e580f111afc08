"""GPU sizes planned, not guessed: every notebook's GPU constants against the course's memory model, per device.

Its own room (not `sizing.ledger`, which counts what a run holds while it runs, nor `inference.plan`, which places one
model for generation): it plans whole notebooks before they run, from the same accounting (`MemoryLedger` on the
meta device) plus what a GPU adds (workspace, CUDA contexts, allocator margin).

Its modules, bottom up: `footprint` (one device's bytes in a training step, measured on the meta device), `parts`
(what a kept model, a step, a pipeline or a group of ranks holds per device: the pieces of a notebook's plan), `plans`
(a notebook's phases and peaks, `check_plan`, and the recorded plans the doctor prints), `suite` (the GPU check).
"""
from helpers.gpu_sizes.footprint import Footprint, stage_bytes, training_step, training_step_peak
from helpers.gpu_sizes.plans import (HEADROOM, NotebookPlan, NotEnoughMemory, Part, Phase, PlanRecord, check_plan,
                                     notebook_plans, plan_of, plans_table, recorded_plans, rtx3090_rigs, shortfalls)

__all__ = ["Footprint", "HEADROOM", "NotEnoughMemory", "NotebookPlan", "Part", "Phase", "PlanRecord", "check_plan",
           "notebook_plans", "plan_of", "plans_table", "recorded_plans", "rtx3090_rigs", "shortfalls", "stage_bytes",
           "training_step", "training_step_peak"]
