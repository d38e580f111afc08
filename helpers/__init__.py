"""Helpers for the Two-GPU Model Parallelism Lab: every technique the notebooks teach, written once.

Modules: rig, course, launch, workers, models, memory, monitor, timeline, report, measure, check, stages,
profile, partition, checkpointing, comm, schedules, engine, mp_engine, parallel, bench.
Import what you need: `from helpers.runtime.rig import detect_rig`.
"""
__version__ = "0.1.0"
