"""Workers that misbehave on purpose, for the launcher tests."""
import os
import time

import torch.distributed as dist


def fail_on_rank_one(message: str) -> int:
    if dist.get_rank() == 1:
        raise ValueError(message)
    dist.barrier()  # rank 0 would wait forever: the launcher must not
    return dist.get_rank()


def hang_on_rank_one() -> int:
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


def pid_then_sleep(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def exit_hard_on_rank_one() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()
