"""Which strategy for two GPUs: the memory-only guide notebook 08 uses (to be replaced by the simulator's fair
guide, helpers.simulate.guide)."""
from __future__ import annotations

from dataclasses import dataclass

from helpers.memory import training_state_bytes


@dataclass(frozen=True)
class PlanOption:
    strategy: str
    per_device_bytes: int
    fits: bool


def plan_two_gpus(n_params: int, activation_bytes_per_sample: float, global_batch: int, capacity_bytes: int,
                  checkpoint_fraction: float, recipe: str = "mixed precision + Adam",
                  microbatches: int = 8) -> list[PlanOption]:
    """Per-device bytes of each way to train on two GPUs, from the ZeRO formulas and linear activations:
    DDP (full replica, half the batch each), FSDP2/ZeRO-3 (state halved, full model's activations for half the
    batch), a 2-stage 1F1B pipeline (state halved, half the layers x 2 micro-batches of batch/m in flight), and
    that pipeline with every block checkpointed (activations x `checkpoint_fraction`, see
    `memory.checkpointed_fraction`)."""
    state = training_state_bytes(n_params, recipe).total
    a = activation_bytes_per_sample
    options = [
        ("DDP (replicate)", state + a * global_batch / 2),
        ("FSDP2 / ZeRO-3 (shard)", state / 2 + a * global_batch / 2),
        ("pipeline 1F1B, 2 stages", state / 2 + (a / 2) * 2 * global_batch / microbatches),
        ("pipeline 1F1B + checkpointing", state / 2 + (a / 2) * 2 * global_batch / microbatches * checkpoint_fraction),
    ]
    return [PlanOption(name, int(b), b <= capacity_bytes) for name, b in options]


def choose_two_gpus(options: list[PlanOption]) -> str:
    """The first option that fits, in order of simplicity; else the honest answer."""
    for opt in options:
        if opt.fits:
            return opt.strategy
    return "does not fit two GPUs: more GPUs or machines (DP x PP, torchrun), or CPU offload"
