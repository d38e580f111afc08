"""What the training-memory planner (`helpers.finetune.memory_plan`) is asked, checked in the user's terms before
anything is planned."""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from helpers.sizing.gpus import Gpu, check_choice, check_gpus, check_workload
from helpers.sizing.shape import WeightFormat
from helpers.sizing.state import known_optimizers
from helpers.sizing.training import check_method

PLAN_STRATEGIES = ("ddp", "fsdp2", "1f1b")  # catalog names: replicas, shards, or a 1F1B pipeline of a stage per GPU
OLD_STRATEGIES = {"pipeline": "1f1b"}  # accepted with a warning for a release
OFFLOADS = ("none", "cpu")
PRECISIONS = ("mixed", "pure")
# memory techniques the planner prices (data/training_memory.json "techniques"), as the training loop names them
TECHNIQUES = ("optimizer-in-backward", "chunked-loss", "activation-offload")


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
    activation_checkpointing: bool = True
    lora_rank: int | None = None  # None: data/training_memory.json's default (64)
    lora_targets: str = "all"
    optimizer: str = "adamw"
    precision: str = "mixed"
    dtype: str | WeightFormat | None = None  # the base's weight format; None: bf16 (full, lora) or nf4-torchao (qlora)
    microbatches: int | None = None  # per optimizer step (accumulated, or a pipeline's); None: 1, or the stages (1f1b)
    host_ram_bytes: int | None = None  # None: host RAM is reported, not checked
    techniques: tuple[str, ...] = ()  # of TECHNIQUES (a comma-separated string is accepted)

    def uses(self, technique: str) -> bool:
        return technique in self.techniques

    @property
    def pipelined(self) -> bool:
        return self.strategy == "1f1b"

    @property
    def pins_host_memory(self) -> bool:
        """Whether CPU offload pins its host buffers: `apply_fsdp` asks FSDP2 for CPUOffloadPolicy(pin_memory=
        device.type == "cuda"), so GPUs do; the CPU rig's devices (GPUs named 'cpu...', e.g. '2x cpu=8GiB') pin
        nothing."""
        return self.offload == "cpu" and not all(g.name.lower().startswith("cpu") for g in self.gpus)

    @property
    def microbatch_count(self) -> int:
        return self.microbatches or (len(self.gpus) if self.pipelined else 1)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: each data-parallel replica runs `batch` x micro-batches."""
        replicas = 1 if self.pipelined else len(self.gpus)
        return self.batch * self.microbatch_count * replicas


def check_techniques(techniques) -> tuple[str, ...]:
    """Techniques as a tuple of TECHNIQUES' names, in TECHNIQUES' order: from None, a comma list or an iterable."""
    if techniques is None:
        return ()
    items = techniques.split(",") if isinstance(techniques, str) else \
        [t for item in techniques for t in str(item).split(",")]
    names = {str(t).strip().lower() for t in items if str(t).strip()}
    unknown = sorted(names - set(TECHNIQUES))
    if unknown:
        raise ValueError(f"unknown technique(s) {', '.join(unknown)}: choose from {', '.join(TECHNIQUES)}")
    return tuple(t for t in TECHNIQUES if t in names)


def check_request(request: TrainingRequest) -> TrainingRequest:
    """The request with names normalised and the GPUs resolved; ValueError, in the user's terms, for bad input."""
    method = check_method(request.method)
    strategy = str(request.strategy).strip().lower()
    if strategy in OLD_STRATEGIES:
        warnings.warn(f"strategy {strategy!r} is now {OLD_STRATEGIES[strategy]!r} (the catalog's name)",
                      DeprecationWarning, stacklevel=3)
        strategy = OLD_STRATEGIES[strategy]
    strategy = check_choice("strategy", strategy, PLAN_STRATEGIES)
    offload = check_choice("offload", request.offload, OFFLOADS)
    optimizer = str(request.optimizer).strip().lower()
    optimizer = check_choice("optimizer", optimizer, known_optimizers())
    techniques = check_techniques(request.techniques)
    precision = check_choice("precision", request.precision, PRECISIONS)
    check_workload(request.context, request.batch)
    gpus = tuple(check_gpus(list(request.gpus) or None))
    if offload == "cpu" and strategy != "fsdp2":
        raise ValueError(f"CPU offload keeps FSDP2's shards in host RAM: use --strategy fsdp2 with --offload cpu "
                         f"(not {strategy})")
    m = request.microbatches
    if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
        raise ValueError(f"micro-batches per step must be a whole number, at least 1, got {m!r}")
    if request.host_ram_bytes is not None and request.host_ram_bytes <= 0:
        raise ValueError(f"host RAM must be positive, got {request.host_ram_bytes!r}")
    if "optimizer-in-backward" in techniques:
        if strategy != "fsdp2" or offload != "none":
            raise ValueError("optimizer-in-backward steps each parameter's shard on the GPU as its gradient arrives: "
                             f"use --strategy fsdp2 without --offload cpu (not {strategy}"
                             f"{', offload cpu' if offload == 'cpu' else ''})")
        if (m or 1) > 1:
            raise ValueError(f"optimizer-in-backward steps during each backward, so gradients cannot accumulate over "
                             f"{m} micro-batches: use --microbatches 1 (a larger --batch instead)")
    return dataclasses.replace(request, method=method, strategy=strategy, offload=offload, optimizer=optimizer,
                               precision=precision, gpus=gpus, techniques=techniques)
