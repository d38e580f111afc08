"""Helpers for the Two-GPU Model Parallelism Lab: every technique the notebooks teach, written once.

Subpackages (each `__init__` says in a line what it holds):
- `runtime`: which rig this is, ranks started from a notebook or torchrun with no orphans, device-strict ranks;
- `models`: the block stack, Hugging Face causal LMs built from configs, synthetic tokens and real text offline;
- `pipeline`: schedules as data, the one interpreter, its transports, the threaded engine, boundary transfers;
- `training`: a job in the user's words (`job_for`), the strategies over one DeviceMesh, the one training loop, what
  runs where, `train()`;
- `finetune`: LoRA / QLoRA adapters on a frozen (NF4) base, and the training-memory planner;
- `inference`: the big-model planner and device maps, generation across devices, tensor parallelism;
- `sizing`: memory measured (the ledger) and planned (bytes per parameter and optimizer state with ZeRO sharding,
  activations, model shapes, GPUs and the runtime reserve): what every planner builds on;
- `gpu_sizes`: the pieces of the GPU-size plans notebooks declare, priced against two RTX 3090s, and the GPU suite;
- `simulate`: the cost model, the calibration and the step simulator behind the bench's predictions;
- `bench`: strategies measured side by side (what notebooks import apart from the command line's rows and report).
Modules: `catalog` (every strategy and schedule, named once: every list derives from it), `units` (MiB, GiB,
`fmt_bytes`), `dtypes` (format names and bytes per value), `facts` (data/'s JSON), `hardware` (links, collectives,
rigs, the roofline's constants), `monitor` (the live memory panel), `timeline`, `profile`, `partition`,
`activation_checkpointing`, `precision`, `measure`, `check`, `report`, `course` (a notebook's setup); the command
lines `bench`, `doctor`, `plan` (`python -m helpers.NAME`). Which room may import which: `floors`. Import what
you need: `from helpers.runtime.rig import detect_rig`. The offline installer for workshops is tooling, outside
the library: `python -m tools.wheelhouse`.
"""
import logging

__version__ = "0.1.0"

# torchao (installed for QLoRA) is imported by transformers whenever a model module loads; on a machine without its
# CUDA kernels it logs a warning per kernel, and torch's pytree one per type it registers: noise, not news.
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
