"""The simulator's job (`Job`: the strategy, the batch and its micro-batches, each strategy's knobs, in
`helpers.training.job.TrainJob`'s names) and the host a rig offloads to (`Host`), what `helpers.simulate.strategies`
turns into a task graph."""
from __future__ import annotations

import math
from dataclasses import dataclass

from helpers.catalog import devices, strategy as catalog_entry
from helpers.dtypes import BYTES
from helpers.pipeline.schedules import layout_for


@dataclass(frozen=True)
class Host:
    """The host side of a rig, for what offloading moves: `pcie` bytes/s each GPU copies to or from pinned host
    memory over its own link (one direction), `memory` bytes/s the host's memory sustains (shared by every rank's
    optimizer step on the host)."""

    pcie: float
    memory: float

    def __post_init__(self):
        if not (self.pcie > 0 and self.memory > 0):
            raise ValueError(f"host bandwidths must be positive bytes/s, got pcie={self.pcie}, memory={self.memory}")


FREE_HOST = Host(math.inf, math.inf)  # offloading's copies and the host's step free (memory-only simulations)


@dataclass(frozen=True)
class Job:
    """How to train: the strategy, the global batch per optimizer step and its micro-batches (pipeline
    micro-batches, or gradient-accumulation steps for data parallelism), and each strategy's knobs. The names are
    `helpers.training.job.TrainJob`'s, meaning the same (`from_train_job` reads a training job's): `pp` pipeline
    devices, `dp` data-parallel replicas (their product `world`), `boundaries`, `activation_checkpointing`."""

    strategy: str
    batch: int
    microbatches: int = 1
    pp: int | None = None  # pipeline devices; None: 2 for a pipeline strategy (naive, gpipe, ..., dp_x_pp), else 1.
    # interleaved, zbv and dualpipev run 2 model stages on each
    dp: int | None = None  # data-parallel replicas; None: 2 for ddp, zero1, zero2, fsdp2 and dp_x_pp, else 1
    activation_checkpointing: bool | tuple[int, ...] = False  # True: recompute every layer in backward; or the
    # layers to recompute
    schedule: str = "1f1b"  # the pipeline schedule inside dp_x_pp
    boundaries: tuple[int, ...] | None = None  # first layer of each model stage after the first; None:
    # time-balanced
    bucket_mb: float = 25.0
    first_bucket_mb: float = 1.0
    # DDP's gradients are views of its buckets (gradient_as_bucket_view=True, as helpers' apply_ddp sets): no copy
    # of each gradient into its bucket, none back after the all-reduce; False: PyTorch's default, both copies
    bucket_views: bool = True
    wire: str = "auto"  # DDP's gradient buckets on the link in this dtype (fp32, bf16, fp16: TrainJob's `wire`, cast
    # before and back after each all-reduce); auto: in the gradients' own
    forward_prefetch: bool = True  # FSDP2 gathers the next layer while one computes (implicit on GPUs, see run_fsdp2)
    host_waits: bool = False  # FSDP2's collectives hold the thread that computes (the CPU rig, see run_fsdp2)
    fsdp2_host_s: float = 0.0  # FSDP2's host work per collective beyond it (measured: calibrate.fsdp2_host_samples)
    speeds: tuple[float, ...] | None = None  # per device, relative (larger is faster): a device's compute takes
    # the workload's time / its speed; None: equal devices
    shares: tuple[int, ...] | None = None  # samples of the global batch per data-parallel replica; None: equal
    cpu_offload: bool = False  # FSDP2's CPUOffloadPolicy: shards, their gradients and the optimizer step on the host
    activation_offload: bool = False  # what autograd saves in forward kept in host memory (save_on_cpu)
    batched_weights: int = 1  # a pipeline's weight passes this many micro-batches at a time (weights_in_groups);
    # a batched pass costs its passes' sum (see Simulation.backward_weights)

    def __post_init__(self):
        for name, value in zip(("pp", "dp"), devices(self.entry, self.pp, self.dp, self.microbatches)):
            object.__setattr__(self, name, value)
        for what, value in (("global batch", self.batch), ("micro-batch count", self.microbatches),
                            ("pipeline device count pp", self.pp), ("replica count dp", self.dp)):
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"the {what} must be a whole number >= 1, got {value!r}")
        recompute = self.activation_checkpointing
        if not isinstance(recompute, bool) and (not isinstance(recompute, tuple) or any(
                not isinstance(i, int) or i < 0 for i in recompute)):
            raise ValueError(f"activation_checkpointing must be True, False or a tuple of layer indices >= 0, got "
                             f"{recompute!r}")
        if not (self.fsdp2_host_s >= 0 and math.isfinite(self.fsdp2_host_s)):
            raise ValueError(f"FSDP2's host work per collective must be seconds >= 0, got {self.fsdp2_host_s!r}")
        if self.wire != "auto" and self.wire not in BYTES:
            raise ValueError(f"unknown wire dtype {self.wire!r}; choose auto or one of {list(BYTES)}")
        if not (self.bucket_mb > 0 and self.first_bucket_mb > 0):
            raise ValueError(f"DDP bucket sizes must be positive, got {self.first_bucket_mb} and {self.bucket_mb} MiB")
        if self.cpu_offload and not self.entry.fully_sharded:
            raise ValueError(f"cpu_offload is FSDP2's CPUOffloadPolicy: choose fsdp2 or zero2, not {self.strategy}")
        if self.speeds is not None and (len(self.speeds) != self.world or not all(
                isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in self.speeds)):
            raise ValueError(f"speeds={self.speeds}: give {self.world} positive relative speeds, one per device")
        if self.shares is not None:
            if self.pp > 1 or len(self.shares) != self.dp or sum(self.shares) != self.batch or any(
                    not isinstance(r, int) or r < 1 or r % self.microbatches for r in self.shares):
                raise ValueError(f"shares={self.shares}: {self.dp} replica batches (pp = 1) adding up to {self.batch}, "
                                 f"each a multiple of {self.microbatches} micro-batches")
        elif self.samples_per_microbatch * self.dp * self.microbatches != self.batch:
            split = f"{self.microbatches} micro-batches"
            if self.dp > 1:
                split = f"{self.dp} replicas x {split}"
            raise ValueError(f"global batch {self.batch} is not divisible by {split}")

    @property
    def entry(self):
        """The strategy's entry in helpers.catalog."""
        return catalog_entry(self.strategy)

    @classmethod
    def from_train_job(cls, job) -> "Job":
        """The simulator's job for a `TrainJob`: its strategy, and its fields of the same names (the run's
        boundaries, or the equal split it trains with)."""
        strategy = job.strategy if job.world > 1 else "single"
        return cls(strategy, job.batch, job.microbatches, pp=job.pp, dp=job.dp,
                   activation_checkpointing=job.activation_checkpointing,
                   schedule=job.schedule, boundaries=job.cut() if job.pp > 1 else None, bucket_mb=job.bucket_mb,
                   wire=job.wire if job.pp == 1 else "auto",
                   speeds=tuple(1.0 / f for f in job.slowdown) if job.slowdown else None,
                   shares=job.shares or None, batched_weights=job.batched_weights)

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def samples_per_microbatch(self) -> int:
        return self.batch // (self.dp * self.microbatches)

    def label(self) -> str:
        parts = [self.entry.label]
        if self.entry.kind == "pipeline":
            chunks = self.layout.chunks
            parts.append(f"{self.pp} stages" if chunks == 1 else f"{self.pp} devices x {chunks} stages")
        if self.strategy == "dp_x_pp":
            parts.append(f"{self.dp} x {self.pp}, {self.schedule}")
        if self.microbatches > 1:
            parts.append(f"m={self.microbatches}")
        if self.activation_checkpointing is True:
            parts.append("checkpointing")
        elif self.activation_checkpointing:
            parts.append(f"checkpointing {len(self.activation_checkpointing)} layers")
        return ", ".join(parts)

    @property
    def layout(self):
        """Which device holds each model stage of the pipeline (`helpers.pipeline.schedules.Layout`)."""
        return layout_for(self.pipeline_schedule, self.pp)

    @property
    def pipeline_schedule(self) -> str:
        """The schedule the pipeline runs (`schedule` inside DP x PP, else the catalog's)."""
        return self.schedule if self.strategy == "dp_x_pp" else self.entry.schedule or "gpipe"

    def checkpoints(self, layer: int) -> bool:
        """Whether `layer` recomputes its activations in backward."""
        recompute = self.activation_checkpointing
        return recompute is True or (recompute is not False and layer in recompute)
