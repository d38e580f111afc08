"""What a bench run measures: its size and repeats by mode (`BenchConfig`, `default_config`), and its jobs, derived
from the catalog (helpers.catalog) and the support matrix: every strategy on every engine it lists, timed on threads
in the bench's process (`threaded_pipelines`) or launched (`bench_jobs`, each job its row's key), less what the rig
refuses (`bench_refusals`) and what the default run leaves to --precise (`left_out`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from helpers.bench.blocks import bench_cut
from helpers.catalog import BEYOND_1F1B, CATALOG, DEEPSPEED, Strategy, strategy as catalog_entry
from helpers.models import StackConfig
from helpers.pipeline.schedules import chunks_of, make_schedule
from helpers.training.support import support

if TYPE_CHECKING:
    from helpers.training.job import TrainJob


@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs. Defaults: 8 blocks of hidden 384 (14.4 M parameters), batch 32: sized for a 2-core CPU."""

    cfg: StackConfig
    batch: int
    steps: int  # timed steps of each multi-process job per launch (the recorded step after them is timed too)
    gpipe_microbatches: tuple[int, ...]
    onefoneb_microbatches: int
    rounds: int = 1  # launches of each multi-process job, interleaved across jobs
    extra_repeats: int = 2  # interleaved repeats of the split comparison and the checkpoint sweep
    link_sizes: tuple[int, ...] = tuple(4 ** k * 1024 for k in range(1, 9))  # 4 KiB .. 64 MiB
    thread_repeats: int = 3  # interleaved rounds of one device and the threaded pipelines
    every_row: bool = True  # False (the default run): leave out the rows `left_out` names


MODES = ("quick", "default", "precise")


def left_out(config: BenchConfig, strategy: str, engine: str) -> bool:
    """Whether the run of `config` (the default run: `every_row` False) leaves the row of `strategy` on `engine`
    (threads, processes or torch: the support matrix's) to --precise, to stay under 5 minutes on the 2-core rig. A
    rule on the catalog's fields, so that a strategy added there runs by default unless a rule says why not:
    - the threaded engine's schedules past 1F1B (notebook 06b's): ours runs them on processes beside torch's, where
      they are compared;
    - a pipeline that reuses another's schedule (the naive split: GPipe's at one micro-batch, notebook 01's
      baseline rather than a contender);
    - torch's GPipe: never torch's best pipeline;
    - FSDP2 without resharding after forward (ZeRO-2): FSDP2 with one knob turned, and like FSDP2 in a launch of
      its own (`launch_groups`);
    - DP x PP: 4 ranks, refused on two GPUs; on the CPU rig they share the 2 cores and the prediction is excluded
      from the target;
    - DeepSpeed's ZeRO stages: another library's engine beside PyTorch's, an optional install, each launch paying
      its start-up (importing DeepSpeed, building its communication op)."""
    entry = catalog_entry(strategy)
    return not config.every_row and ((engine == "threads" and strategy in BEYOND_1F1B)
                                     or (entry.kind == "pipeline" and entry.schedule != entry.name)
                                     or (engine == "torch" and strategy == "gpipe")
                                     or (entry.fully_sharded and entry.reshard_after_forward is False)
                                     or entry.kind == "dp_x_pp" or entry.library == "deepspeed")


def default_config(mode: str | bool, rig) -> BenchConfig:
    """The run of `mode` (True: quick, False: default). quick: a smoke test of a smaller model, every row. default:
    built to repeat within 5% in under 5 minutes on the 2-core CPU rig: one micro-batch count per pipeline, the rows
    `left_out` names left out, and the two-rank jobs in one launch per round (`launch_groups`), 2 rounds in opposite
    orders (each job's timed steps and its recorded step in each of two launches a minute or more apart: 6 samples,
    so one disturbed launch or step no longer decides a row). precise: every row, GPipe at three counts, timed
    longer."""
    mode = {True: "quick", False: "default"}.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown bench mode {mode!r}; choose one of {MODES}")
    scale = 1 if rig.is_cpu else 4
    if mode == "quick":  # 3 steps, so their median is not the first: 2-18% slower on the CPU rig (DDP rebuilds)
        return BenchConfig(StackConfig(hidden=256 * scale, n_blocks=4, seq_len=32), batch=16, steps=3,
                           gpipe_microbatches=(4,), onefoneb_microbatches=4, rounds=1,
                           link_sizes=tuple(4 ** k * 1024 for k in range(1, 8)), extra_repeats=2)
    cfg = StackConfig(hidden=384 * scale, n_blocks=8, seq_len=32)
    if mode == "precise":
        return BenchConfig(cfg, batch=32, steps=6, gpipe_microbatches=(2, 4, 8), onefoneb_microbatches=8, rounds=3,
                           extra_repeats=6, thread_repeats=8)
    return BenchConfig(cfg, batch=32, steps=2, gpipe_microbatches=(8,), onefoneb_microbatches=8, rounds=2,
                       extra_repeats=3, thread_repeats=5, every_row=False)


# the bench's multi-process rows, as (strategy, engine) of the support matrix: every strategy of the catalog that
# train() runs, on every engine it lists but threads (`run_bench` times those in this process)
PROCESS_ROWS = tuple((s.name, engine) for s in CATALOG for engine in s.engines if engine != "threads")


def bench_refusals(rig) -> dict[tuple[str, str], str]:
    """The bench's multi-process rows this rig cannot run, with the support matrix's reason: left out of the run
    (one GPU: torch's pipelining, FSDP2 and DeepSpeed; fewer than 4 GPUs: DP x PP; DeepSpeed where it is not
    installed), instead of stopping it with nothing written."""
    from helpers.training.deepspeed_zero import missing

    refused = {(s, e): verdict.reason for s, e in PROCESS_ROWS if not (verdict := support(rig, s, e)).ok}
    if missing():
        refused.update({(s, e): missing() for s, e in PROCESS_ROWS if s in DEEPSPEED and (s, e) not in refused})
    return refused


def threaded_pipelines(config: BenchConfig) -> list[tuple[Strategy, int]]:
    """The pipelines the bench times on threads in this process, each with its micro-batch count: every pipeline of
    the catalog that the threaded engine runs, at its `pipeline_microbatches`, less what the run leaves out."""
    return [(entry, m) for entry in CATALOG if "threads" in entry.engines
            and not left_out(config, entry.name, "threads") for m in pipeline_microbatches(entry, "threads", config)]


def bench_engine(job: TrainJob) -> str:
    """The support matrix's engine of a bench job: torch's pipelining, or processes (our interpreter, and PyTorch's
    data-parallel wrappers)."""
    return "torch" if job.pp > 1 and job.engine == "torch" else "processes"


def pipeline_microbatches(entry: Strategy, engine: str, config: BenchConfig) -> tuple[int, ...]:
    """The micro-batch counts the bench runs a pipeline strategy at on `engine` (threads, processes or torch): a
    pipeline that reuses another's schedule (the naive split) at one, our GPipe at each of
    `config.gpipe_microbatches` (notebook 05's sweep, in --precise), every other at `schedule_microbatches`; DP x PP
    at half 1F1B's count a replica."""
    if entry.kind == "dp_x_pp":  # half of 1F1B's count (each replica has half the batch), at least 2
        return (max(2, config.onefoneb_microbatches // 2),)
    if entry.schedule != entry.name:
        return (1,)
    if entry.name == "gpipe" and engine != "torch":
        return config.gpipe_microbatches
    return (schedule_microbatches(entry.name, config),)


def strategy_jobs(entry: Strategy, engine: str, config: BenchConfig) -> list[TrainJob]:
    """The bench's `TrainJob`s of a catalog strategy on `engine` (`job_for`: two devices a dimension), each the key
    of its row: a pipeline at each of its `pipeline_microbatches`, cut as `bench_cut` cuts it (DP x PP: equal
    layers), the naive split with blocking sends (the baseline notebook 01 measures), on our engine a schedule that
    splits every backward also with its weight passes two micro-batches at a time (notebook 06b's batched W); data
    parallelism with Adam, DDP also with its gradients sent in bf16 (notebook 07's compression hook)."""
    from helpers.training.job import job_for

    common = dict(batch=config.batch, timed_steps=config.steps)
    if entry.kind == "data_parallel":
        return [job_for(config.cfg, entry.name, engine, optimizer="adam", wire=wire, **common)
                for wire in (("auto", "bf16") if entry.name == "ddp" else ("auto",))]
    naive = entry.schedule != entry.name
    cut = () if entry.data_parallel else bench_cut(entry.schedule, config.cfg.n_blocks + 2)
    return [job_for(config.cfg, entry.name, engine, microbatches=m, boundaries=cut, overlap=not naive,
                    batched_weights=k, **common)
            for m in pipeline_microbatches(entry, engine, config) for k in weight_batches(entry, engine, m)]


def weight_batches(entry: Strategy, engine: str, m: int) -> tuple[int, ...]:
    """How many micro-batches at a time the bench runs a pipeline's weight passes: 1, and on our engine 2 as well
    where the schedule splits every backward (ZB-H1, ZB-V: a W for each B), so that the batched passes have
    something to batch all through the step."""
    if engine != "processes" or entry.kind != "pipeline":
        return (1,)
    actions = make_schedule(entry.schedule, 2, m)
    every = all(sum(a.kind == "W" for a in d) == sum(a.kind == "B" for a in d) for d in actions)
    return (1, 2) if every else (1,)


def bench_jobs(config: BenchConfig, rig) -> list[TrainJob]:
    """Every multi-process job the run of `config` measures on this rig, in catalog order: each strategy of the
    catalog on each engine it lists but threads (`strategy_jobs`), less what the rig refuses (`bench_refusals`)
    and what the run leaves out (`left_out`)."""
    refused = bench_refusals(rig)
    jobs = [job for s, engine in PROCESS_ROWS for job in strategy_jobs(catalog_entry(s), engine, config)]
    return [job for job in jobs if (job.strategy, bench_engine(job)) not in refused
            and not left_out(config, job.strategy, bench_engine(job))]


def two_rank_jobs(config: BenchConfig, rig) -> list[TrainJob]:
    """The bench's jobs on two ranks (pipelines and data parallelism: DP x PP takes 4), each its row's key."""
    return [job for job in bench_jobs(config, rig) if job.world == 2]


def schedule_microbatches(schedule: str, config: BenchConfig) -> int:
    """Micro-batches a step of `schedule` past 1F1B gets in the bench: 1F1B's count where it runs one stage per
    device (ZB-H1); where it runs two (interleaved 1F1B, ZB-V, DualPipeV), half as many micro-batches of twice the
    samples, and at least one per stage. Each device then runs as many passes a step as in 1F1B, each the same
    FLOPs (twice the samples through half the blocks): 1F1B's count would halve each pass's samples, which computes
    slower per sample (docs/bench.md, `schedule_microbatches`)."""
    chunks = chunks_of(schedule)
    stages = 2 * chunks  # the bench's pipelines run on two devices
    return max(stages, config.onefoneb_microbatches // chunks)


def job_microbatch(job: TrainJob) -> int:
    """Samples one rank computes at a time in `job`."""
    return job.batch // job.dp // job.microbatches

