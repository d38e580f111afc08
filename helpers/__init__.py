"""Helpers for the Two-GPU Model Parallelism Lab: every technique the notebooks teach, written once.

Modules: rig, launch, models, memory, monitor, timeline, stages, and the later rooms (profile, partition, comm,
schedules, engine, parallel, simulate, bench). Import what you need: `from helpers.rig import detect_rig`.
"""
__version__ = "0.1.0"
