"""A multi-process training run, described once: pipeline, data parallelism (DDP, ZeRO-1, ZeRO-2-like, FSDP2) or
both, laid out on a (dp, pp) DeviceMesh. `check_job` refuses, before any process starts, everything that cannot
run, in the user's terms."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

from helpers.catalog import DATA_PARALLEL, DEEPSPEED, Strategy, devices, strategy as catalog_entry
from helpers.sizing.state import training_state_bytes, zero_formula
from helpers.models.data import PADDING
from helpers.models.layered import LayeredModel
from helpers.models.stack import StackConfig, StackModel
from helpers.pipeline.comm import resolve_dtype
from helpers.pipeline.interpreter import check_p2p_plan
from helpers.pipeline.schedules import Layout, Schedule, layout_for, make_schedule
from helpers.pipeline.stages import stage_ranges
from helpers.precision import Precision
from helpers.runtime.launch import check_ranks
from helpers.runtime.rig import Rig
from helpers.training.checkpoint import CheckpointSpec, check_spec
from helpers.training.support import engines_for, support
from helpers.units import fmt_bytes

OPTIMIZERS = ("none", "sgd", "adam", "adamw", "adamw-8bit", "adamw-4bit")  # the last two: torchao's low-bit AdamW
PIPELINE_ENGINES = ("ours", "torch")
RENAMED = {"checkpointing": "activation_checkpointing",  # recomputation, not a training checkpoint
           "grad_accum": "microbatches"}  # old keyword -> new, accepted with a warning for a release


def renamed(options: dict) -> dict:
    """`options` with every deprecated keyword (RENAMED) under its new name, warning once for each; both names
    given at once is refused."""
    options = dict(options)
    for old, new in RENAMED.items():
        if old in options:
            if new in options:
                raise TypeError(f"give {new}= only ({old}= is its deprecated name)")
            warnings.warn(f"{old}= is now {new}=", DeprecationWarning, stacklevel=3)
            options[new] = options.pop(old)
    return options


def as_layered(model: LayeredModel | StackConfig) -> LayeredModel:
    """A StackConfig stands for the course's block stack with seed 0."""
    return StackModel(model) if isinstance(model, StackConfig) else model


@dataclass(frozen=True)
class TrainJob:
    """One training run, keyed by the catalog's strategy name: `TrainJob(model, "1f1b", microbatches=4)`.
    The strategy fills the layout it implies (helpers.catalog: 2 devices per dimension, pp and dp say more); a
    job built from the layout alone (dp, pp, data_parallel, schedule) is given the catalog name of what it runs.
    dp replicas x pp pipeline stages; rank = replica * pp + stage. Every rank rebuilds the same seeded data and
    materialises only what it owns: its stage, or (FSDP2) its shards."""

    model: LayeredModel | StackConfig
    strategy: str | None = None  # a catalog name (helpers.catalog); None: the one the layout below runs
    dp: int | None = None  # data-parallel replicas; default: 2 for a data-parallel strategy, else 1
    pp: int | None = None  # pipeline devices; default: 2 for a pipeline strategy, else 1
    data_parallel: str | None = None  # with dp > 1: ddp | zero1 | zero2 | fsdp2 | ds_zero1-3 (dp x pp: ddp)
    boundaries: tuple[int, ...] = ()  # where stages 1.. start; () = equal layers per stage
    schedule: str | None = None  # gpipe | 1f1b | zbh1; interleaved | zbv | dualpipev: 2 stages per device (pp x 2)
    microbatches: int = 1  # pipeline micro-batches, or gradient accumulation steps with pp == 1
    engine: str = "ours"  # pipeline engine: ours (the interpreter) | torch (torch.distributed.pipelining)
    wire: str = "auto"  # dtype on the link: pipeline boundaries, or (dp only) DDP's gradient buckets; auto: the
    # model's own
    overlap: bool = True  # False: wait for every send before computing on (the blocking baseline)
    batched_weights: int = 1  # our engine, schedules that split the backward (zbh1, zbv, dualpipev): weight passes k
    # micro-batches at a time, each linear layer's weight gradient one product over their rows (notebook 06b)
    dtype: str = "fp32"  # weights: fp32 | bf16 | fp16
    autocast: str | None = None  # None | bf16 | fp16 (fp32 weights, 16-bit matmuls; fp16 adds loss scaling)
    batch: int = 32  # global batch
    shares: tuple[int, ...] = ()  # rows of the global batch per replica (dp only), e.g. by speed (proportional_shares:
    # a faster card takes more); () = equal. The loss is normalised by the global batch's tokens either way
    seq_len: int | None = None  # default: the model's
    padding: str = "none"  # none | right | left: seeded lengths, padded positions masked and ignored by the loss
    timed_steps: int = 3  # after one warm-up step (the parity check) and before one recorded step: train()'s
    # `steps` (every optimizer step) is timed_steps + 2
    optimizer: str = "none"
    lr: float = 1e-3
    max_grad_norm: float | None = None  # clip the gradients' global norm to this before each step (one stage)
    bucket_mb: float = 25.0  # DDP gradient bucket size (PyTorch's default)
    data_seed: int = 0
    return_grads: bool = False
    return_state: bool = False  # every rank sends back its trained weights (to save the model)
    data: str | None = None  # token windows saved with torch.save, [N, L+1] (helpers.models.text): step k trains on
    # windows k*batch..; None: synthetic tokens, the same batch every step
    activation_checkpointing: bool = False  # recompute each block's activations in backward (dp strategies, one
    # stage); not to be confused with `checkpoint`, the training state saved to disk
    offload: str | None = None  # "cpu": FSDP2's CPUOffloadPolicy (shards, gradients, optimizer step in host memory);
    # with ds_zero2/ds_zero3, ZeRO-Offload (the optimizer state and step on the host, DeepSpeed's CPU Adam)
    optimizer_in_backward: bool = False  # each parameter stepped in backward as its gradient is whole, then freed
    loss_chunks: int | None = None  # the head and cross entropy in this many chunks of tokens, recomputed in backward
    activation_offload: bool = False  # what autograd saves in forward kept in host memory (save_on_cpu)
    checkpoint: CheckpointSpec | None = None  # save / resume training state with DCP (helpers.training.checkpoint)
    slowdown: tuple[float, ...] = ()  # per rank, the CPU rig only: emulate slower cards (2.0: each compute span
    # takes twice as long, helpers.timeline.Recorder); () = none

    def __post_init__(self):
        """The strategy's layout filled in, or the layout's strategy named; a layout the strategy does not run is
        refused in the catalog's words."""
        if self.strategy is None:
            layout = {"dp": self.dp or 1, "pp": self.pp or 1, "data_parallel": self.data_parallel or "ddp",
                      "schedule": self.schedule or "gpipe"}
            layout["strategy"] = _named(layout, self.microbatches)
        else:
            layout = _layout_of(catalog_entry(self.strategy), self)
        for name, value in layout.items():
            object.__setattr__(self, name, value)

    @property
    def checkpointing(self) -> bool:
        """Deprecated name of `activation_checkpointing`."""
        warnings.warn("TrainJob.checkpointing is now TrainJob.activation_checkpointing", DeprecationWarning,
                      stacklevel=2)
        return self.activation_checkpointing

    @property
    def layered(self) -> LayeredModel:
        return as_layered(self.model)

    @property
    def precision(self) -> Precision:
        return Precision(self.dtype, self.autocast)

    @property
    def world(self) -> int:
        return self.dp * self.pp

    @property
    def fully_sharded(self) -> bool:
        """Replicas shard with FSDP2's fully_shard (zero2, fsdp2: helpers.catalog)."""
        return self.dp > 1 and catalog_entry(self.data_parallel).fully_sharded

    @property
    def deepspeed(self) -> bool:
        """Replicas run by DeepSpeed's engine (ds_zero1, ds_zero2, ds_zero3: helpers.training.deepspeed_zero)."""
        return self.dp > 1 and self.data_parallel in DEEPSPEED

    @property
    def title(self) -> str:
        """What a memory panel calls this run: the strategy, and the fine-tuning method of a LoRA model."""
        method = getattr(getattr(self.layered, "spec", None), "method", None)
        return f"{self.strategy} {method}" if method else self.strategy

    @property
    def n_layers(self) -> int:
        return len(self.layered.meta_layers())

    @property
    def layout(self) -> Layout:
        """Which device holds each pipeline stage: pp stages, or pp x 2 for the schedules that put two on a device."""
        return layout_for(self.schedule, self.pp) if self.pp > 1 else Layout(1)

    def cut(self) -> tuple[int, ...]:
        """The job's boundaries, or equal layers per stage."""
        from helpers.partition import equal_count_split

        stages = self.layout.stages
        return self.boundaries or (equal_count_split(self.n_layers, stages) if stages > 1 else ())

    def sequence_length(self) -> int:
        if self.seq_len is not None:
            return self.seq_len
        cfg = getattr(self.layered, "cfg", None)
        if cfg is None or not hasattr(cfg, "seq_len"):
            raise ValueError("give the job a seq_len: the model does not say how long its sequences are")
        return cfg.seq_len


def _named(layout: dict, microbatches: int) -> str:
    """The catalog name of a layout: DP x PP, a pipeline (the naive split: GPipe with one micro-batch), or the
    data-parallel strategy (a one-device job keeps its data_parallel's name)."""
    if layout["pp"] > 1 and layout["dp"] > 1:
        return "dp_x_pp"
    if layout["pp"] > 1:
        return "naive" if microbatches == 1 and layout["schedule"] == "gpipe" else layout["schedule"]
    return layout["data_parallel"]


def _layout_of(entry: Strategy, job: "TrainJob") -> dict:
    """The layout a catalog strategy implies, with the job's own pp and dp where it gives them (a pipeline of 3
    stages, 4 replicas); a field that names another strategy is refused."""
    pp, dp = devices(entry, job.pp, job.dp, job.microbatches)
    if entry.kind == "single" or (pp > 1) != entry.pipeline or (dp > 1) != entry.data_parallel:
        raise ValueError(f"strategy {entry.name!r} runs on {_devices(entry)}, not pp={pp} x dp={dp}")
    data_parallel = entry.name if entry.kind == "data_parallel" else "ddp"
    schedule = entry.schedule or "gpipe"
    if entry.kind == "dp_x_pp" and job.schedule is not None:
        schedule = job.schedule  # DP x PP runs any pipeline schedule inside its replicas
    for name, value in (("data_parallel", data_parallel), ("schedule", schedule)):
        given = getattr(job, name)
        if given is not None and given != value:
            raise ValueError(f"strategy {entry.name!r} runs {name}={value!r}, not {given!r}: give one or the other")
    return {"pp": pp, "dp": dp, "data_parallel": data_parallel, "schedule": schedule}


def _devices(entry: Strategy) -> str:
    return {"pipeline": "pipeline stages (pp >= 2, dp = 1)", "data_parallel": "replicas (dp >= 2, pp = 1)",
            "dp_x_pp": "a dp x pp mesh (both >= 2)"}.get(entry.kind, "one device")


def check_choice(strategy: str, engine: str) -> Strategy:
    """The catalog's entry of `strategy`, refused with the choices if it is unknown, the one-device reference, or
    not run by `engine`."""
    engines_for(strategy, engine)
    return catalog_entry(strategy)


def job_for(model: LayeredModel | StackConfig, strategy: str, engine: str = "processes", **fields) -> TrainJob:
    """The job of a catalog strategy (helpers.catalog) on two devices per dimension, from the user's words: a
    pipeline of 2 stages, 2 data-parallel replicas, or 2 x 2 for DP x PP; `engine` one of those the catalog lists
    for it (threads run the job's layout in one process). The naive split is GPipe with one micro-batch."""
    entry = check_choice(strategy, engine)
    fields = renamed(fields)
    if entry.name == "naive":
        fields["microbatches"] = 1
    return TrainJob(model, entry.name, engine="torch" if engine == "torch" else "ours", **fields)


def _positive(job: TrainJob) -> None:
    for name in ("dp", "pp", "batch", "timed_steps", "microbatches"):
        value = getattr(job, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def _check_shares(job: TrainJob) -> None:
    """Unequal replica batches: one whole, positive share per replica, adding up to the global batch, each split
    into the job's micro-batches; pipelines keep equal micro-batches (their stages exchange fixed shapes)."""
    if job.pp > 1 or job.dp == 1:
        raise ValueError("shares= gives data-parallel replicas unequal batches: it needs dp >= 2 and pp = 1")
    if len(job.shares) != job.dp or any(not isinstance(r, int) or r < 1 for r in job.shares):
        raise ValueError(f"shares={job.shares}: give {job.dp} whole numbers >= 1, one batch share per replica")
    if sum(job.shares) != job.batch:
        raise ValueError(f"shares={job.shares} add up to {sum(job.shares)}, not the global batch {job.batch}")
    if any(r % job.microbatches for r in job.shares):
        raise ValueError(f"shares={job.shares}: each replica's share must divide into {job.microbatches} micro-batches")


def _check_batches(job: TrainJob) -> None:
    if job.shares:
        return _check_shares(job)
    if job.batch % job.dp:
        raise ValueError(f"global batch {job.batch} is not divisible by the data-parallel size {job.dp}")
    per_replica = job.batch // job.dp
    if per_replica % job.microbatches:
        where = f"global batch {job.batch}" if job.dp == 1 else \
            f"each replica's batch {per_replica} (global {job.batch} over {job.dp} replicas)"
        raise ValueError(f"{where} is not divisible by {job.microbatches} micro-batches")


def _check_pipeline(job: TrainJob) -> None:
    if job.engine not in PIPELINE_ENGINES:
        raise ValueError(f"unknown engine {job.engine!r}; choose one of {PIPELINE_ENGINES}")
    resolve_dtype(job.wire)
    if job.engine == "torch" and job.wire != "auto":
        raise ValueError("torch.distributed.pipelining sends in the compute dtype: use wire='auto' with it")
    layout = job.layout
    bounds = job.cut()
    if len(bounds) != layout.stages - 1:
        per_device = f" x {layout.chunks} stages per device ({job.schedule})" if layout.chunks > 1 else ""
        raise ValueError(f"{len(bounds)} boundaries give {len(bounds) + 1} stages, but pp={job.pp}{per_device} "
                         f"needs {layout.stages}")
    stage_ranges(job.n_layers, bounds)
    schedule = make_schedule(job.schedule, job.pp, job.microbatches)  # refuses m < p for 1F1B, ...
    check_p2p_plan(schedule)
    if job.batched_weights != 1:
        _check_batched_weights(job, schedule)


def _check_batched_weights(job: TrainJob, schedule: Schedule) -> None:
    """Batched weight passes need weight passes to batch, and the engine that runs them (torch's schedules run
    each W alone)."""
    if job.batched_weights < 1:
        raise ValueError(f"batched_weights={job.batched_weights}: give how many micro-batches each weight pass "
                         "takes at once (1: each its own)")
    if job.engine != "ours":
        raise ValueError("batched_weights runs in our pipeline engine (engine='ours'); torch.distributed.pipelining "
                         "runs each weight pass alone")
    if not any(a.kind == "W" for actions in schedule for a in actions):
        raise ValueError(f"batched_weights batches the weight passes of a split backward; schedule "
                         f"{job.schedule!r} has none with {job.microbatches} micro-batches: use zbh1 or zbv")


def _check_data_parallel(job: TrainJob, capacity_bytes: int | None) -> None:
    if job.data_parallel not in DATA_PARALLEL:
        raise ValueError(f"unknown data-parallel strategy {job.data_parallel!r}; choose one of {DATA_PARALLEL}")
    try:
        resolve_dtype(job.wire)  # with pp > 1 the pipeline's check has refused a bad wire already
    except ValueError:
        raise ValueError(f"wire={job.wire!r}: DDP's gradient buckets cross the link as 'auto' (the gradients' own "
                         "dtype), fp32, fp16 or bf16") from None
    if job.wire == "fp16" and job.autocast != "fp16":
        raise ValueError("wire='fp16' sends DDP's gradients in fp16, whose range flushes small gradients to zero unless "
                         "the loss is scaled: use wire='bf16' (fp32's range in 16 bits), or autocast='fp16', whose "
                         "gradient scaler scales what crosses the link")
    if job.wire != "auto" and job.fully_sharded:
        raise ValueError(f"wire={job.wire!r} compresses DDP's gradient buckets (ddp, zero1); {job.data_parallel} "
                         "reduces its gradients in MixedPrecisionPolicy's reduce_dtype")
    if job.pp > 1 and job.data_parallel != "ddp":
        raise ValueError(f"DP x PP here averages each stage's gradients over its replicas (data_parallel='ddp'); "
                         f"{job.data_parallel} inside pipeline stages is not part of this course")
    layers = job.layered.meta_layers()
    if job.fully_sharded and not any(any(True for _ in l.parameters()) for l in layers):
        raise ValueError("FSDP2 shards layer by layer, but the model has no layers with parameters")
    if catalog_entry(job.data_parallel).bucketed and capacity_bytes is not None and job.pp == 1:
        n = sum(p.numel() for l in layers for p in l.parameters())
        need = training_state_bytes(n, "fp32 + Adam") if job.data_parallel == "ddp" else \
            zero_formula("zero1", n, job.dp)
        if need.total > capacity_bytes:
            raise ValueError(
                f"{job.data_parallel} keeps a full replica on every device: {fmt_bytes(need.total)} of weights, "
                f"gradients and Adam state, but a device has {fmt_bytes(capacity_bytes)}. Shard it (data_parallel="
                "'zero2' or 'fsdp2') or split it into pipeline stages (notebooks 05-06).")


def _check_context(job: TrainJob) -> None:
    """A sequence longer than the model's positions is refused (rotary models would run, and compute nonsense)."""
    cfg = getattr(job.layered, "config", None)
    limit = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if limit is not None and job.sequence_length() > limit:
        raise ValueError(f"seq_len {job.sequence_length()} is beyond the model's context of {limit} positions "
                         "(max_position_embeddings)")


def _check_extras(job: TrainJob) -> None:
    """Data from a file, activation checkpointing, CPU offload, and the dtypes of a model that keeps its own."""
    if job.data is not None:
        from pathlib import Path

        from helpers.models.text import check_rows, load_rows

        if not Path(job.data).is_file():
            raise ValueError(f"no token windows at {job.data}: save them with helpers.models.text (TextData.save)")
        check_rows(load_rows(job.data), job.batch, job.sequence_length(), job.layered.vocab_size, str(job.data))
        if job.padding != "none":
            raise ValueError("padding is simulated on synthetic tokens only; windows of real text are whole")
    if job.activation_checkpointing and job.pp > 1:
        raise ValueError("activation checkpointing here runs with the data-parallel strategies (one stage per "
                         "rank); notebook 07 checkpoints pipeline stages")
    if job.offload not in (None, "cpu"):
        raise ValueError(f"offload must be None or 'cpu', got {job.offload!r}")
    if job.offload and not (job.pp == 1 and (job.fully_sharded or job.deepspeed)):
        raise ValueError("CPU offload is FSDP2's CPUOffloadPolicy or DeepSpeed's ZeRO-Offload: use data_parallel="
                         "'fsdp2' (or 'zero2', 'ds_zero2', 'ds_zero3') with dp >= 2")
    if job.checkpoint is not None:
        check_spec(job.checkpoint)
    if getattr(job.layered, "own_dtypes", False) and (job.dtype != "fp32" or job.autocast is not None):
        raise ValueError("this model keeps its own dtypes (a LoRA model: the frozen base in LoraSpec.base_dtype or "
                         "NF4, adapters in fp32): leave the job's dtype at 'fp32' and autocast at None")


def _check_slowdown(job: TrainJob, rig: Rig) -> None:
    """An emulated slower card: one factor >= 1 per rank, on the CPU rig (real cards run at their own speed)."""
    if not job.slowdown:
        return
    if not rig.is_cpu:
        raise ValueError("slowdown= emulates slower cards on the CPU rig; on GPUs each card runs at its own speed")
    if len(job.slowdown) != job.world or any(not (isinstance(f, (int, float)) and f >= 1) for f in job.slowdown):
        raise ValueError(f"slowdown={job.slowdown}: give {job.world} factors >= 1, one per rank (2.0: half as fast)")


def check_job(job: TrainJob, rig: Rig, oversubscribe: bool = False) -> None:
    """Everything that cannot run, refused with the reason before any process starts."""
    _positive(job)
    _check_slowdown(job, rig)
    job.precision  # refuses an unknown dtype, or autocast on 16-bit weights
    if job.padding not in PADDING:
        raise ValueError(f"unknown padding {job.padding!r}; choose one of {PADDING}")
    if job.optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {job.optimizer!r}; choose one of {OPTIMIZERS}")
    if job.deepspeed:
        from helpers.training import deepspeed_zero

        deepspeed_zero.check_job(job, rig)
    elif job.optimizer.startswith("adam") and job.dtype == "fp16":
        raise ValueError(f"{job.optimizer} on fp16 weights divides by sqrt(v) + eps with eps = 1e-8, which fp16 "
                         "rounds to 0: a weight whose gradient is 0 becomes NaN at the first step. Keep fp32 weights "
                         "and compute in fp16 with autocast='fp16' (fp32 master weights and Adam state, loss scaling), "
                         "or use optimizer='sgd'")
    _check_batches(job)
    if job.pp > 1:
        _check_pipeline(job)
    elif job.batched_weights != 1:
        raise ValueError(f"batched_weights batches a pipeline's weight passes; {job.strategy} runs no pipeline")
    if job.dp > 1:
        _check_data_parallel(job, rig.capacity_bytes[0])
    if job.world > 1:
        engine = "torch" if job.pp > 1 and job.engine == "torch" else "processes"
        support(rig, job.strategy, engine, job.world).require(f"{job.strategy} with engine {engine!r}")
    check_ranks(rig, job.world, oversubscribe)
    if job.sequence_length() < 1:
        raise ValueError(f"seq_len must be >= 1, got {job.sequence_length()}")
    _check_context(job)
    _check_extras(job)
    _check_memory_techniques(job)


def _check_one_stage(job: TrainJob, what: str) -> None:
    if job.pp > 1:
        raise ValueError(f"{what} runs here with one stage per rank (ddp, fsdp2, zero2, or one device); pipeline "
                         "stages are not wired for it")


def _check_low_bit(job: TrainJob) -> None:
    """torchao's 8-/4-bit AdamW: over one device's tensors or FSDP2's DTensor shards, stepped on the device."""
    _check_one_stage(job, f"optimizer={job.optimizer!r}")
    if job.dp > 1 and job.data_parallel == "zero1":
        raise ValueError(f"{job.optimizer} shards its state with FSDP2 here: use data_parallel='fsdp2' (or 'zero2', "
                         "'ddp'); ZeroRedundancyOptimizer over torchao's state is not wired")
    if job.offload is not None:
        raise ValueError(f"{job.optimizer} steps on the device: offload='cpu' moves the step to the host, where "
                         "torchao offers its own CPUOffloadOptimizer instead; use one or the other")
    if job.checkpoint is not None:
        raise ValueError(f"saving {job.optimizer}'s quantized state with DCP is not wired here: checkpoint=None")


def _check_in_backward(job: TrainJob) -> None:
    """The optimizer step in backward: one parameter at a time, on a gradient that is whole when it arrives."""
    if job.optimizer == "none":
        raise ValueError("optimizer_in_backward steps the job's optimizer in backward: give optimizer= (adam, ...)")
    _check_one_stage(job, "optimizer_in_backward")
    if job.dp > 1 and not job.fully_sharded:
        raise ValueError(f"optimizer_in_backward with {job.data_parallel}: DDP averages gradients in buckets after "
                         "each one is accumulated, so the hook would step on this replica's gradient alone; use "
                         "data_parallel='fsdp2' (its hooks run on the reduce-scattered shard) or one device")
    if job.microbatches > 1:
        raise ValueError(f"optimizer_in_backward frees each gradient as it steps, but accumulating over "
                         f"{job.microbatches} micro-batches needs the gradients kept until the last one: use "
                         "microbatches=1 (a smaller batch) or drop optimizer_in_backward")
    if job.precision.autocast == "fp16" or job.dtype == "fp16":
        raise ValueError("optimizer_in_backward steps before the whole backward has run, but fp16's loss scaling "
                         "skips a step when any gradient overflowed, known only at the end: use bf16")
    if job.max_grad_norm is not None:
        raise ValueError("optimizer_in_backward steps each parameter as soon as its gradient is whole, but clipping "
                         "scales every gradient by the norm of all of them, known only when backward ends: drop "
                         "max_grad_norm or optimizer_in_backward")
    if job.return_grads:
        raise ValueError("optimizer_in_backward frees each gradient as soon as it steps: nothing to return "
                         "(return_grads=False)")
    if job.offload is not None or job.checkpoint is not None:
        raise ValueError("optimizer_in_backward keeps one optimizer per parameter: CPU offload and DCP checkpoints "
                         "of its state are not wired (offload=None, checkpoint=None)")


def _check_memory_techniques(job: TrainJob) -> None:
    """Low-bit AdamW, the optimizer step in backward, the chunked loss and activation offload
    (helpers.training.memory_techniques), refused where they cannot run, before any process starts."""
    if job.max_grad_norm is not None:
        if not (isinstance(job.max_grad_norm, (int, float)) and job.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0, got {job.max_grad_norm!r}")
        _check_one_stage(job, "max_grad_norm (the norm of every stage's gradients together)")
    if job.optimizer in ("adamw-8bit", "adamw-4bit"):
        _check_low_bit(job)
    if job.optimizer_in_backward:
        _check_in_backward(job)
    if job.loss_chunks is not None:
        if not isinstance(job.loss_chunks, int) or job.loss_chunks < 1:
            raise ValueError(f"loss_chunks must be a whole number >= 1, got {job.loss_chunks!r}")
        _check_one_stage(job, "loss_chunks")
    if job.activation_offload:
        _check_one_stage(job, "activation_offload")
