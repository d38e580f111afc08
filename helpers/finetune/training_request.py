"""What the training-memory planner (`helpers.finetune.memory_plan`) is asked, checked in the user's terms before
anything is planned."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from helpers.sizing.gpus import Gpu, check_gpus, check_workload
from helpers.sizing.shape import WeightFormat
from helpers.sizing.state import known_optimizers
from helpers.sizing.training import check_method

PLAN_STRATEGIES = ("ddp", "fsdp2", "pipeline")  # the catalog's ddp and fsdp2, and a pipeline of one stage per GPU
OFFLOADS = ("none", "cpu")
PRECISIONS = ("mixed", "pure")


@dataclass(frozen=True)
class TrainingRequest:
    """Everything the planner is asked; `plan_training` checks it before planning."""

    model: object = "llama-2-7b"  # a name, an id or a directory (str), or a transformers config
    method: str = "qlora"
    context: int = 2048
    batch: int = 1
    gpus: tuple[Gpu, ...] = ()  # empty: two RTX 3090s
    strategy: str = "fsdp2"
    offload: str = "none"
    checkpointing: bool = True
    lora_rank: int | None = None  # None: data/training_memory.json's default (64)
    lora_targets: str = "all"
    optimizer: str = "adamw"
    precision: str = "mixed"
    dtype: str | WeightFormat | None = None  # the base's weight format; None: bf16 (full, lora) or nf4-torchao (qlora)
    grad_accum: int | None = None  # micro-batches per optimizer step; None: 1, or the number of stages (pipeline)
    host_ram_bytes: int | None = None  # None: host RAM is reported, not checked

    @property
    def micro_batches(self) -> int:
        return self.grad_accum or (len(self.gpus) if self.strategy == "pipeline" else 1)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: each data-parallel replica runs `batch` x micro-batches."""
        replicas = 1 if self.strategy == "pipeline" else len(self.gpus)
        return self.batch * self.micro_batches * replicas


def _check_choice(what: str, value: str, choices: Sequence[str]) -> str:
    key = str(value).strip().lower()
    if key not in choices:
        raise ValueError(f"unknown {what} {value!r}: choose one of {', '.join(choices)}")
    return key


def check_request(request: TrainingRequest) -> TrainingRequest:
    """The request with names normalised and the GPUs resolved; ValueError, in the user's terms, for bad input."""
    method = check_method(request.method)
    strategy = _check_choice("strategy", request.strategy, PLAN_STRATEGIES)
    offload = _check_choice("offload", request.offload, OFFLOADS)
    optimizer = _check_choice("optimizer", request.optimizer, known_optimizers())
    precision = _check_choice("precision", request.precision, PRECISIONS)
    check_workload(request.context, request.batch)
    gpus = tuple(check_gpus(list(request.gpus) or None))
    if offload == "cpu" and strategy != "fsdp2":
        raise ValueError(f"CPU offload keeps FSDP2's shards in host RAM: use --strategy fsdp2 with --offload cpu "
                         f"(not {strategy})")
    if request.grad_accum is not None and (isinstance(request.grad_accum, bool) or
                                           not isinstance(request.grad_accum, int) or request.grad_accum < 1):
        raise ValueError(f"gradient accumulation must be a whole number of micro-batches, at least 1, got "
                         f"{request.grad_accum!r}")
    if request.host_ram_bytes is not None and request.host_ram_bytes <= 0:
        raise ValueError(f"host RAM must be positive, got {request.host_ram_bytes!r}")
    return dataclasses.replace(request, method=method, strategy=strategy, offload=offload, optimizer=optimizer,
                               precision=precision, gpus=gpus)
