"""Small workers for spawned ranks (spawn can only run functions it can import, so they live here)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from helpers.runtime.launch import rank_device
from helpers.runtime.strict import plain_backend


def whoami() -> dict:
    """Each rank reports what it was given: rank, world size, backend, device, intra-op threads."""
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "backend": plain_backend(),
            "device": str(rank_device()), "threads": torch.get_num_threads(), "pid": os.getpid()}


def all_reduce_sum(value: float) -> float:
    """Sum `value * (rank + 1)` over ranks: the smallest real collective."""
    t = torch.tensor([value * (dist.get_rank() + 1)], device=rank_device())
    dist.all_reduce(t)
    return float(t.item())


def timed_spans(n: int) -> list:
    """Record `n` short compute spans on this rank and gather every rank's events (timeline test and demo)."""
    from helpers.timeline import Recorder, gather_events

    rec = Recorder(dist.get_rank(), rank_device())
    x = torch.randn(512, 512, device=rank_device()) / 512**0.5
    dist.barrier()  # start together, so the timeline shows both devices working at once
    for mb in range(n):
        with rec.span("forward", mb):
            y = torch.tanh(x @ x)
            y = torch.tanh(y @ x)
    return gather_events(rec.events())
