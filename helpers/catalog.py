"""Every way the course trains on several devices, named once: each strategy and schedule with its kind, where its
stages sit, the engines that run it, PyTorch's class for it, the label tables print and the notebook that teaches it.

Every other list derives from this one: the schedules and their layouts (`helpers.pipeline.schedules`), the support
matrix and README's table (`helpers.training.support`), the strategies `train()` takes, the simulator's strategies
and labels (`helpers.simulate.strategies`), torch's schedule classes (`helpers.training.strategies`), the bench's
rows beyond 1F1B. Adding a schedule is its generator (`@generator` in `helpers.pipeline.schedules`) and one entry
here; tests/test_catalog.py walks every entry through each of those places.

Pure data, importing nothing of the course: the pipeline package (below training) reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("threads", "processes", "torch")  # in-process threads, our interpreter per rank, torch's pipelining
KINDS = ("single", "pipeline", "data_parallel", "dp_x_pp")


@dataclass(frozen=True)
class Strategy:
    """One way to train. `schedule`: the action lists a pipeline runs (its own name for a schedule; the naive split
    is GPipe with one micro-batch; DP x PP runs 1F1B unless told otherwise). `chunks` and `shape`: how many model
    stages each device holds, in a loop (device d holds stages d, d+p, ...) or a V (d and 2p-1-d). `torch_class`:
    torch.distributed.pipelining's class of the schedule, or PyTorch's API of a data-parallel strategy. `shards`:
    which of weights, gradients and optimizer state each replica holds 1/N of at the step's peak (the ZeRO paper's
    stages; FSDP2 without resharding after forward keeps the gathered weights until backward: ZeRO-2's peak).
    `library`: PyTorch's engines, or DeepSpeed's (its ZeRO stages, run on the same job by deepspeed.initialize)."""

    name: str
    kind: str
    label: str
    engines: tuple[str, ...] = ()
    notebook: str = ""
    schedule: str | None = None
    chunks: int = 1
    shape: str = "loop"
    torch_class: str | None = None
    shards: tuple[bool, bool, bool] = (False, False, False)
    reshard_after_forward: bool | None = None  # FSDP2's knob, for the two strategies built on fully_shard
    deepspeed: str | None = None  # the DeepSpeed config with the same memory layout (DeepSpeed's own: its config)
    library: str = "pytorch"  # whose engine runs it: pytorch, or deepspeed (helpers.training.deepspeed_zero)

    @property
    def pipeline(self) -> bool:
        """Cut into stages across devices (DP x PP too)."""
        return self.kind in ("pipeline", "dp_x_pp")

    @property
    def data_parallel(self) -> bool:
        """Replicated across devices (DP x PP too)."""
        return self.kind in ("data_parallel", "dp_x_pp")

    @property
    def fully_sharded(self) -> bool:
        """Built on FSDP2's `fully_shard` (reduce-scatter and all-gather; parameters sharded at rest)."""
        return self.reshard_after_forward is not None

    @property
    def bucketed(self) -> bool:
        """A full replica per device whose gradients DDP all-reduces bucket by bucket (DDP, ZeRO-1): what a DDP
        comm hook, its bucket size and its gradient compression apply to."""
        return self.kind == "data_parallel" and not self.fully_sharded and self.library == "pytorch"

    @property
    def trained(self) -> bool:
        """Runs on several devices through `train()` (one device is the reference, not a strategy to pick)."""
        return bool(self.engines)


_PIPE = ENGINES
CATALOG: tuple[Strategy, ...] = (
    Strategy("single", "single", "one device", notebook="00"),
    Strategy("naive", "pipeline", "naive split (GPipe with one micro-batch)", ("threads", "processes"), "01",
             schedule="gpipe"),
    Strategy("gpipe", "pipeline", "GPipe pipeline", _PIPE, "05", "gpipe", torch_class="ScheduleGPipe"),
    Strategy("1f1b", "pipeline", "1F1B pipeline", _PIPE, "06", "1f1b", torch_class="Schedule1F1B"),
    Strategy("interleaved", "pipeline", "interleaved 1F1B pipeline", _PIPE, "06b", "interleaved", 2,
             torch_class="ScheduleInterleaved1F1B"),
    # torch's ZB-H1 is its interleaved zero-bubble schedule with one stage per device
    Strategy("zbh1", "pipeline", "ZB-H1 pipeline", _PIPE, "06b", "zbh1", torch_class="ScheduleInterleavedZeroBubble"),
    Strategy("zbv", "pipeline", "ZB-V pipeline", _PIPE, "06b", "zbv", 2, "v", torch_class="ScheduleZBVZeroBubble"),
    Strategy("dualpipev", "pipeline", "DualPipeV pipeline", _PIPE, "06b", "dualpipev", 2, "v",
             torch_class="ScheduleDualPipeV"),
    Strategy("ddp", "data_parallel", "DDP", ("processes",), "07", torch_class="DistributedDataParallel",
             deepspeed='"zero_optimization": {"stage": 0}'),
    Strategy("zero1", "data_parallel", "ZeRO-1", ("processes",), "07",
             torch_class="DDP + torch.distributed.optim.ZeroRedundancyOptimizer", shards=(False, False, True),
             deepspeed='"zero_optimization": {"stage": 1}'),
    Strategy("zero2", "data_parallel", "ZeRO-2 (FSDP2, no reshard after forward)", ("processes",), "07",
             torch_class="FSDP2 fully_shard(reshard_after_forward=False)", shards=(False, True, True),
             reshard_after_forward=False, deepspeed='"zero_optimization": {"stage": 2}'),
    Strategy("fsdp2", "data_parallel", "FSDP2 (ZeRO-3)", ("processes",), "07",
             torch_class="FSDP2 fully_shard (reshard_after_forward=True)", shards=(True, True, True),
             reshard_after_forward=True, deepspeed='"zero_optimization": {"stage": 3}'),
    Strategy("ds_zero1", "data_parallel", "DeepSpeed ZeRO-1", ("processes",), "07", shards=(False, False, True),
             deepspeed='"zero_optimization": {"stage": 1}', library="deepspeed"),
    Strategy("ds_zero2", "data_parallel", "DeepSpeed ZeRO-2", ("processes",), "07", shards=(False, True, True),
             deepspeed='"zero_optimization": {"stage": 2}', library="deepspeed"),
    Strategy("ds_zero3", "data_parallel", "DeepSpeed ZeRO-3", ("processes",), "07", shards=(True, True, True),
             deepspeed='"zero_optimization": {"stage": 3}', library="deepspeed"),
    Strategy("dp_x_pp", "dp_x_pp", "DP x PP", ("processes", "torch"), "08", "1f1b"),
)
_BY_NAME = {s.name: s for s in CATALOG}


def strategy(name: str) -> Strategy:
    """The catalog's entry for `name`; an unknown name is refused with the names there are."""
    if name not in _BY_NAME:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(_BY_NAME)}")
    return _BY_NAME[name]


def devices(entry: Strategy, pp: int | None = None, dp: int | None = None, microbatches: int = 1) -> tuple[int, int]:
    """The pipeline devices and data-parallel replicas `entry` runs on: 2 in each dimension it uses unless given, 1
    in each it does not (anything else refused), and the naive split with one micro-batch."""
    pp = pp if pp is not None else (2 if entry.pipeline else 1)
    dp = dp if dp is not None else (2 if entry.data_parallel else 1)
    for name, value, used in (("pp", pp, entry.pipeline), ("dp", dp, entry.data_parallel)):
        if not used and value != 1:
            raise ValueError(f"{entry.name} has no {'pipeline' if name == 'pp' else 'data parallelism'}: {name} "
                             f"must be 1, got {value!r}")
    if entry.name == "naive" and microbatches != 1:
        raise ValueError("the naive split runs the whole batch at once (microbatches=1); use 'gpipe' or '1f1b' for "
                         "micro-batches")
    return pp, dp


def names(kind: str | None = None, trained: bool | None = None, notebook: str | None = None) -> tuple[str, ...]:
    """Catalog names in catalog order, optionally of one kind, only those `train()` runs (`trained=True`), or those
    one notebook teaches."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; choose one of {KINDS}")
    return tuple(s.name for s in CATALOG if (kind is None or s.kind == kind)
                 and (trained is None or s.trained == trained) and (notebook is None or s.notebook == notebook))


def schedules() -> tuple[Strategy, ...]:
    """The pipeline schedules: the entries that name their own action lists (the naive split reuses GPipe's)."""
    return tuple(s for s in CATALOG if s.kind == "pipeline" and s.schedule == s.name)


def schedule_entry(name: str) -> Strategy:
    """The catalog's entry of the schedule `name`, refused with the schedules there are if it is none."""
    known = {s.name: s for s in schedules()}
    if name not in known:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(known)}")
    return known[name]


PIPELINES = names("pipeline")  # naive, gpipe, 1f1b, interleaved, zbh1, zbv, dualpipev
DATA_PARALLEL = names("data_parallel")  # ddp, zero1, zero2, fsdp2, ds_zero1, ds_zero2, ds_zero3
TRAINED = names(trained=True)  # what train() and the support matrix take
BEYOND_1F1B = names(notebook="06b")  # the schedules notebook 06b adds, the bench's rows beyond 1F1B
DEEPSPEED = tuple(s.name for s in CATALOG if s.library == "deepspeed")  # run by DeepSpeed's engine
PYTORCH_API = {s.name: s.torch_class for s in CATALOG if s.kind == "data_parallel" and s.library == "pytorch"}
DEEPSPEED_EQUIVALENT = {s.name: s.deepspeed for s in CATALOG if s.deepspeed and s.library == "pytorch"}
