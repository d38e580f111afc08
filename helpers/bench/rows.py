"""The bench's rows: what a run measures (`BenchConfig`, `default_config`), one device and every pipeline on threads
(`_single_row`, `run_bench`), every two-rank job (pipelines, DDP, ZeRO-1) in one launch per round, FSDP2 in one
of its own (`process_rows`, `launch_groups`, `run_in_rounds`) and DP x PP (`dp_x_pp_rows`); each kept as a
`BenchRow`."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import torch
from torch import nn

from helpers.bench.blocks import PipelineRun, bench_cut, make_pipeline_run, one_device_step, time_pipeline_runs
from helpers.catalog import BEYOND_1F1B, CATALOG, Strategy, strategy as catalog_entry
from helpers.pipeline.schedules import chunks_of
from helpers.measure import relative_spread
from helpers.sizing.ledger import ledger_for
from helpers.models import StackConfig, lm_loss
from helpers.runtime.rig import claim_cpu_device
from helpers.timeline import PHASES, Event, Recorder, median_phases, phase_seconds
from helpers.training.support import support

if TYPE_CHECKING:
    from helpers.training.job import TrainJob


# strategies whose recorded spans of a phase include communication, which the simulator keeps apart: the backward
# of every data-parallel strategy (DDP's hooks all-reduce in it, fully_shard reduce-scatters), the forward of those
# built on fully_shard (it all-gathers each layer there)
SPANS_INCLUDE_COMMUNICATION = {"forward": {s.name for s in CATALOG if s.fully_sharded},
                               "backward": {s.name for s in CATALOG if s.kind == "data_parallel"}}


def compute_drift(strategy: str, phase: str, measured: dict[str, float], predicted: dict[str, float]) -> float | None:
    """How much longer the measured spans of `phase` took than the simulator's (each a `phase_seconds`: `measured`
    the median timed step's, `predicted` the simulated step's), or None where they are not comparable
    (`SPANS_INCLUDE_COMMUNICATION`) or missing."""
    measured_s, predicted_s = measured.get(phase), predicted.get(phase)
    if strategy in SPANS_INCLUDE_COMMUNICATION[phase] or not predicted_s or not measured_s:
        return None
    return measured_s / predicted_s - 1


@dataclass
class BenchRow:
    strategy: str
    engine: str  # ours / torch / none
    runner: str  # threads / processes / one thread
    microbatches: int | None
    step_s: float
    events: list[Event]
    peak_activation_bytes: list[int]
    optimizer: str = "none"  # what the timed step includes besides forward and backward
    reference: str = "single"  # the one-device row this row's speed-up is taken against
    caller_s: float = 0.0  # measured work of the calling thread around the engine (zero_grad, optimizer step)
    optimizer_s: float = 0.0  # of caller_s, the optimizer step (single_adam: one device's Adam, measured)
    reference_s: float | None = None  # the one-device step timed around this row's launches (multi-process rows)
    wire: str = "auto"  # what DDP's gradients cross the link in (TrainJob's `wire`); auto: their own dtype
    speedup: float | None = None  # threads: median of the ratios of one device's step to this row's, each round's
    # pair timed together; None: `reference_s` over `step_s` (multi-process rows, timed around their launches)
    predicted_s: float | None = None  # the simulator's step time for this row (see `predict_rows`)
    excluded: str | None = None  # why this row's prediction is not held to the target, if it is not
    spread: float | None = None  # half the interquartile range of the step times over their median (the noise)
    predicted_phase_s: dict[str, float] = field(default_factory=dict)  # simulated forward / backward seconds
    measured_phase_s: dict[str, float] = field(default_factory=dict)  # their median over the timed steps
    # the whole-model samples this row's prediction is calibrated from (a WholeModelTimer key; None: the run's)
    calibration_key: Hashable | None = None
    whole_model_s: tuple[float, float] | None = None  # forward, backward of one micro-batch, as calibrated
    core_slowdown: float | None = None  # threaded and two-rank rows: the busy-core slowdown their prediction used
    receive_post_s: float | None = None  # two-rank pipelines: posting a receive, measured in their launches
    cpu_s: list[float] | None = None  # multi-process rows: per rank, the median step's CPU seconds of its thread
    predicted_busy: float | None = None  # the simulated step's compute share, averaged over devices
    launch_times: tuple[tuple[float, ...], ...] = ()  # multi-process rows: every launch's `launch_samples`, in order
    reference_samples: tuple[float, ...] = ()  # the one-device steps timed around them (before, after each launch)
    launch_events: tuple[list[Event], ...] = ()  # multi-process rows: every launch's recorded step (`events`: the last)

    def recorded_events(self) -> list[Event]:
        """The spans of every recorded step this row has: one per launch (multi-process rows), else `events`."""
        return [e for events in self.launch_events or (self.events,) for e in events]

    def as_dict(self, batch: int, reference_s: float) -> dict:
        """`reference_s`: the one-device row's step, used where this row has no `reference_s` of its own."""
        reference_s = self.reference_s or reference_s
        predicted = batch / self.predicted_s if self.predicted_s else None
        return {"strategy": self.strategy, "engine": self.engine, "runner": self.runner, "wire": self.wire,
                "microbatches": self.microbatches, "optimizer": self.optimizer, "step_s": self.step_s,
                "samples_per_s": batch / self.step_s, "predicted_samples_per_s": predicted,
                "error": self.step_s / self.predicted_s - 1 if self.predicted_s else None,
                "excluded_from_target": self.excluded, "spread": self.spread,
                **{f"{phase}_vs_predicted": compute_drift(self.strategy, phase, self.measured_phase_s,
                                                          self.predicted_phase_s) for phase in PHASES},
                "whole_model_s": self.whole_model_s, "core_slowdown": self.core_slowdown,
                "receive_post_s": self.receive_post_s, "cpu_s": self.cpu_s,
                "cpu_share": sum(self.cpu_s) / len(self.cpu_s) / self.step_s if self.cpu_s else None,
                "predicted_busy": self.predicted_busy,
                "speedup": self.speedup or reference_s / self.step_s, "speedup_vs": self.reference,
                "reference_s": reference_s, "reference_timed": "around this row's launches"
                if self.reference_s else "in the threaded rounds", "peak_activation_bytes": self.peak_activation_bytes,
                "launch_step_times_s": [list(t) for t in self.launch_times],
                "reference_samples_s": list(self.reference_samples)}


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
    every_row: bool = True  # False (the default run): leave out the rows `shorter_run_leaves_out` names


MODES = ("quick", "default", "precise")


def shorter_run_leaves_out(strategy: str, engine: str) -> bool:
    """Whether the default run leaves the row of `strategy` on `engine` (threads, processes or torch: the support
    matrix's) to --precise, to stay under 5 minutes on the 2-core rig. A rule on the catalog's fields, so that a
    strategy added there runs by default unless a rule says why not:
    - the threaded engine's schedules past 1F1B (notebook 06b's): ours runs them on processes beside torch's, where
      they are compared;
    - a pipeline that reuses another's schedule (the naive split: GPipe's at one micro-batch, notebook 01's
      baseline rather than a contender);
    - torch's GPipe: never torch's best pipeline;
    - FSDP2 without resharding after forward (ZeRO-2): FSDP2 with one knob turned, and like FSDP2 in a launch of
      its own (`own_launch`);
    - DP x PP: 4 ranks, refused on two GPUs; on the CPU rig they share the 2 cores and the prediction is excluded
      from the target (27-34 s of the run)."""
    entry = catalog_entry(strategy)
    return ((engine == "threads" and strategy in BEYOND_1F1B)
            or (entry.kind == "pipeline" and entry.schedule != entry.name)
            or (engine == "torch" and strategy == "gpipe")
            or (entry.fully_sharded and entry.reshard_after_forward is False)
            or entry.kind == "dp_x_pp")


def left_out(config: BenchConfig, strategy: str, engine: str) -> bool:
    """Whether the run of `config` leaves the row of `strategy` on `engine` to --precise (`shorter_run_leaves_out`)."""
    return not config.every_row and shorter_run_leaves_out(strategy, engine)


def default_config(mode: str | bool, rig) -> BenchConfig:
    """The run of `mode` (True: quick, False: default, as before modes had names). quick: a smoke test of a smaller
    model, every row. default: built to repeat within 5% in under 5 minutes on the 2-core CPU rig: one micro-batch
    count per pipeline (m=8; `schedule_microbatches` for two stages per device), the rows of
    `shorter_run_leaves_out` left out, 5 interleaved rounds of the threaded rows, 3 of the extras, and the two-rank
    jobs in one launch per round (FSDP2 in one of its own: `launch_groups`), 2 rounds in opposite orders (each job's
    2 timed steps and its recorded step in each of two launches a minute or more apart: 6 samples, so one disturbed
    launch or step no longer decides a row). precise: every row, GPipe at m = 2, 4, 8 too, 8 threaded rounds, 3
    launches of 6 timed steps (and the recorded one), 6 repeats of the extras."""
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


class Progress:
    """One line on stderr per phase, with the minutes and seconds since the run started (where a run's time goes);
    on a terminal also tqdm bars, erased when done (leave=False), so nothing of them runs into the table printed on
    stdout at the end."""

    def __init__(self, enabled: bool = True):
        import sys
        import time

        self.enabled = enabled
        self.bars = enabled and sys.stderr.isatty()
        self.started = time.perf_counter()

    def phase(self, what: str) -> None:
        import sys
        import time

        if self.enabled:
            elapsed = int(time.perf_counter() - self.started)
            print(f"bench [{elapsed // 60}:{elapsed % 60:02d}]: {what}", file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, disable=not self.bars)


def _single_row(model: nn.Module, x, y, loss_fn, steps: int, extra_runs: Sequence[PipelineRun] = (),
                progress: Progress | None = None, extra: dict | None = None):
    """One device, without an optimizer and with Adam, timed in the same interleaved rounds as the threaded
    pipelines; its activation peak as its ledger counts it. Returns the timings, the two rows and a
    `LaunchReference` that times the same one-device step again just before and after each multi-process launch."""
    from helpers.simulate.calibrate_model import optimizer_seconds

    rec = Recorder(0, x.device)  # CUDA events on GPUs: kernel time, not launch time
    adam_model = copy.deepcopy(model)
    adam = torch.optim.Adam(adam_model.parameters(), lr=1e-3)
    ledger = ledger_for([model], ["device"])
    one_device = one_device_step(model, x, y, loss_fn, rec=rec, ledger=ledger)
    one_device_adam = one_device_step(adam_model, x, y, loss_fn, adam, rec)

    phases: dict[str, list[dict[str, float]]] = {"single": [], "single_adam": []}
    times = time_pipeline_runs(extra_runs, x, y, steps, extra={"single": one_device, "single_adam": one_device_adam,
                                                               **(extra or {})},
                               progress=bool(progress and progress.bars),
                               after={k: (lambda k=k: phases[k].append(phase_seconds(rec.events()))) for k in phases})
    ledger.reset_peaks()
    one_device()
    events, peak = rec.events(), ledger.device("device").activations
    zero_s, adam_s = optimizer_seconds(adam, zero_grad=True), optimizer_seconds(adam)
    return times, [BenchRow("single", "none", "one thread", None, times["single"], events, [peak], caller_s=zero_s,
                            spread=times.spread("single"), measured_phase_s=median_phases(phases["single"])),
                   BenchRow("single_adam", "none", "one thread", None, times["single_adam"], events, [peak],
                            optimizer="adam", reference="single_adam", caller_s=zero_s + adam_s, optimizer_s=adam_s,
                            spread=times.spread("single_adam"), measured_phase_s=median_phases(phases["single_adam"]))
                   ], LaunchReference(one_device, adam_s)


def _caller_seconds(run: PipelineRun) -> float:
    """What `PipelineRun.step` does in the calling thread around the pipeline: zero_grad and the optimizer's step
    (SGD with lr=0 here), measured."""
    from helpers.simulate.calibrate_model import optimizer_seconds

    return optimizer_seconds(run.optimizer, zero_grad=True) + optimizer_seconds(run.optimizer)


@dataclass
class LaunchReference:
    """One device's step (the `single` row's closure), timed again in this process just before and just after every
    multi-process launch: the reference of those rows' speed-ups, the median of the one-device steps timed around a
    row's launches over the row's median step in them (`seconds`). The machine's speed drifts over a run (the whole
    model timed beside the launches ran from 4% faster to 7% slower than in the same run's threaded rounds), so each
    row is set against its own minutes. Pooled rather than launch by launch: with the default run's two launches a
    median of per-launch ratios is their mean, each from two single one-device steps, so one slow step or launch
    moves it; pooled, fewer rows' speed-ups move more than 5% between two runs. Not timed by rank 0 inside the
    launch, before each job: a rank that has run other jobs took 20-50% longer for the same step while the jobs
    themselves ran at their calibrated speed, so it is no reference. Rows with Adam
    add one device's Adam step, measured (`adam_s`)."""

    step: Callable[[], None]
    adam_s: float
    samples: dict = field(default_factory=dict)  # job key -> seconds of each one-device step timed beside it

    def sample(self, keys: Sequence[Hashable]) -> None:
        from helpers.measure import interleaved_medians

        seconds = interleaved_medians({"single": self.step}, repeats=1, warmup=0)["single"]
        for key in keys:
            self.samples.setdefault(key, []).append(seconds)

    def seconds(self, key: Hashable, adam: bool = False) -> float | None:
        """Median one-device step timed beside the launches of `key` (plus Adam's step with `adam`); None if never
        sampled."""
        import statistics

        got = self.samples.get(key)
        return statistics.median(got) + (self.adam_s if adam else 0.0) if got else None

    def apply(self, row: BenchRow, key: Hashable, adam: bool = False) -> None:
        """Give `row` (the job of `key`) this reference: the one-device step its speed-up is taken against, and the
        samples that median comes from (bench.json keeps them beside the row's launches, so runs can be compared
        step by step)."""
        row.reference_s = self.seconds(key, adam=adam)
        row.reference_samples = tuple(self.samples.get(key, ()))

    def around(self, sizes: Callable[[Sequence[Hashable]], None] | None) -> Callable:
        """The hook `run_in_rounds` calls with a launch's keys before and after it: this reference's step, then the
        whole-model calibration samples (`sizes`, if any)."""
        def hook(keys: Sequence[Hashable]) -> None:
            self.sample(keys)
            if sizes is not None:
                sizes(keys)
        return hook


THREADS_KEY = "threads"  # calibration key of the rows timed in this process, in the same interleaved rounds
# the bench's multi-process rows, as (strategy, engine) of the support matrix: every strategy of the catalog that
# train() runs, on every engine it lists but threads (`run_bench` times those in this process)
PROCESS_ROWS = tuple((s.name, engine) for s in CATALOG for engine in s.engines if engine != "threads")


def bench_refusals(rig) -> dict[tuple[str, str], str]:
    """The bench's multi-process rows this rig cannot run, with the support matrix's reason: left out of the run
    (one GPU: torch's pipelining and FSDP2; fewer than 4 GPUs: DP x PP), instead of stopping it with nothing
    written."""
    out = {}
    for strategy, engine in PROCESS_ROWS:
        verdict = support(rig, strategy, engine)
        if not verdict.ok:
            out[(strategy, engine)] = verdict.reason
    return out


def threaded_pipelines(config: BenchConfig) -> list[tuple[Strategy, int]]:
    """The pipelines the bench times on threads in this process, each with its micro-batch count: every pipeline of
    the catalog that the threaded engine runs, at its `pipeline_microbatches`, less what the run leaves out."""
    return [(entry, m) for entry in CATALOG if "threads" in entry.engines
            and not left_out(config, entry.name, "threads") for m in pipeline_microbatches(entry, "threads", config)]


def run_bench(config: BenchConfig, rig, progress: bool | Progress = True, timer=None) -> list[BenchRow]:
    """Every strategy on this rig, side by side: one device, every pipeline of the catalog on threads in this
    process (`threaded_pipelines`), then every multi-process job (`process_rows`). With `timer`
    (a `helpers.simulate.calibrate.WholeModelTimer` of the same model), the whole model is timed at each row's
    micro-batch size in the same interleaved rounds (threads) and around each launch (processes), each row's samples
    kept under its `calibration_key`, for the predictions."""
    from helpers.models import SyntheticTokens, build_stack

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    if rig.is_cpu:
        claim_cpu_device(rig)
    model = build_stack(config.cfg).to(rig.devices[0])
    x, y = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    threaded = threaded_pipelines(config)
    runs = [make_pipeline_run(f"{s.name}-m{m}", model, bench_cut(s.schedule, len(model)), rig.devices, rig.labels,
                              s.schedule, m) for s, m in threaded]
    progress.phase(f"one device and {len(runs)} threaded pipelines, {config.thread_repeats} interleaved repeats")
    sizes = sorted({config.batch} | {config.batch // m for _, m in threaded}, reverse=True)
    samplers = ({f"calibration: whole model, micro-batch {b}": timer.sampler(b, THREADS_KEY) for b in sizes}
                if timer else {})
    if timer and rig.is_cpu:
        samplers[f"calibration: two copies at once, micro-batch {sizes[-1]}"] = timer.together_sampler(sizes[-1],
                                                                                                       THREADS_KEY)
    times, rows, reference = _single_row(model, x, y, lm_loss, config.thread_repeats, runs, progress, samplers)
    for (s, m), r in zip(threaded, runs):
        rows.append(BenchRow(s.name, "ours", "threads", m, times[r.name], r.events,
                             [v.activations for v in r.ledger.report().values()], caller_s=_caller_seconds(r),
                             spread=times.spread(r.name), measured_phase_s=median_phases(r.phases),
                             speedup=times.paired_ratio("single", r.name)))
    for row in rows:  # one device and the threaded pipelines: timed in the same rounds as the samplers
        row.calibration_key = THREADS_KEY
    return rows + process_rows(config, rig, progress, timer, reference)


def bench_engine(job: TrainJob) -> str:
    """The support matrix's engine of a bench job: torch's pipelining, or processes (our interpreter, and PyTorch's
    data-parallel wrappers)."""
    return "torch" if job.pp > 1 and job.engine == "torch" else "processes"


def pipeline_microbatches(entry: Strategy, engine: str, config: BenchConfig) -> tuple[int, ...]:
    """The micro-batch counts the bench runs a pipeline strategy at on `engine` (threads, processes or torch): a
    pipeline that reuses another's schedule (the naive split) at one, our GPipe at each of
    `config.gpipe_microbatches` (notebook 05's sweep, in --precise), every other at `schedule_microbatches`; DP x PP
    at `DP_X_PP_MICROBATCHES` a replica."""
    if entry.kind == "dp_x_pp":
        return (DP_X_PP_MICROBATCHES(config),)
    if entry.schedule != entry.name:
        return (1,)
    if entry.name == "gpipe" and engine != "torch":
        return config.gpipe_microbatches
    return (schedule_microbatches(entry.name, config),)


def strategy_jobs(entry: Strategy, engine: str, config: BenchConfig) -> list[TrainJob]:
    """The bench's `TrainJob`s of a catalog strategy on `engine` (`job_for`: two devices a dimension), each the key
    of its row: a pipeline at each of its `pipeline_microbatches`, cut as `bench_cut` cuts it (DP x PP: equal
    layers), the naive split with blocking sends (the baseline notebook 01 measures); data parallelism with Adam,
    DDP also with its gradients sent in bf16 (notebook 07's compression hook)."""
    from helpers.training.job import job_for

    common = dict(batch=config.batch, timed_steps=config.steps)
    if entry.kind == "data_parallel":
        return [job_for(config.cfg, entry.name, engine, optimizer="adam", wire=wire, **common)
                for wire in (("auto", "bf16") if entry.name == "ddp" else ("auto",))]
    naive = entry.schedule != entry.name
    cut = () if entry.data_parallel else bench_cut(entry.schedule, config.cfg.n_blocks + 2)
    return [job_for(config.cfg, entry.name, engine, microbatches=m, boundaries=cut, overlap=not naive, **common)
            for m in pipeline_microbatches(entry, engine, config)]


def bench_jobs(config: BenchConfig, rig) -> list[TrainJob]:
    """Every multi-process job the run of `config` measures on this rig, in catalog order: each strategy of the
    catalog on each engine it lists but threads (`strategy_jobs`), less what the rig refuses (`bench_refusals`)
    and what the run leaves out (`left_out`)."""
    refused = bench_refusals(rig)
    jobs = [job for entry in CATALOG for engine in entry.engines if engine != "threads"
            for job in strategy_jobs(entry, engine, config)]
    return [job for job in jobs if (job.strategy, bench_engine(job)) not in refused
            and not left_out(config, job.strategy, bench_engine(job))]


def two_rank_jobs(config: BenchConfig, rig) -> list[TrainJob]:
    """The bench's jobs on two ranks (pipelines and data parallelism: DP x PP takes 4), each its row's key."""
    return [job for job in bench_jobs(config, rig) if job.world == 2]


def schedule_microbatches(schedule: str, config: BenchConfig) -> int:
    """Micro-batches a step of `schedule` past 1F1B gets in the bench: 1F1B's count where it runs one stage per
    device (ZB-H1); where it runs two (interleaved 1F1B, ZB-V, DualPipeV), half as many micro-batches of twice the
    samples, and at least one per stage. Each device then runs as many passes a step as in 1F1B, each the same
    FLOPs (twice the samples through half the blocks), where 1F1B's count would give each pass half the work at half
    the samples, which computes slower per sample: on the CPU rig the whole model runs about 19% slower per sample
    at 4 samples than at 32 (the bench's calibration), and DualPipeV and ZB-V step 8-11% faster at m=4 than at
    m=8."""
    chunks = chunks_of(schedule)
    stages = 2 * chunks  # the bench's pipelines run on two devices
    return max(stages, config.onefoneb_microbatches // chunks)


def job_microbatch(job: TrainJob) -> int:
    """Samples one rank computes at a time in `job`."""
    return job.batch // job.dp // job.microbatches


def jobs_by_size(jobs: Sequence[TrainJob]) -> dict[int, list[TrainJob]]:
    """A launch's jobs by the micro-batch size their ranks compute at, smallest first."""
    sizes = sorted({job_microbatch(job) for job in jobs})
    return {size: [job for job in jobs if job_microbatch(job) == size] for size in sizes}


def sample_launch(timer, jobs: Sequence[TrainJob]) -> None:
    """The whole model timed once at each micro-batch size a launch's jobs use, each time kept for every job of that
    size (they ran in the same minutes)."""
    for size, same in jobs_by_size(jobs).items():
        timer.sample(size, keys=same)


TOGETHER_REPEATS = 6  # both ranks' whole-model steps at each size, after a launch's last job


def train_workers_timed_together(jobs: Sequence, cfg: StackConfig, sizes: Sequence[int],
                                 repeats: int = TOGETHER_REPEATS) -> dict:
    """Rank worker of the bench's two-rank launches: the jobs one after the other (`train_workers`), then the whole
    model's forward and backward timed on both ranks at once (released by a barrier), `repeats` times at each
    micro-batch size of `sizes`: how fast a rank computes while the other rank computes too, in its launch's
    minutes. The parent times the same model alone beside the launch (`sample_launch`); the ratio is the busy-core
    slowdown of the launch's rows. A fresh pair of processes measures it steady (about 1.03), yet one figure for
    the whole run, timed in a launch of its own, priced a run whose pipelines' passes ran 6-16% slower than
    calibrated. Where a job is a pipeline, then what posting a receive costs while both ranks compute
    (`receive_post_seconds`, a hidden state of the pipelines' micro-batch), for the same reason: one reading for the
    whole run, from a launch of its own, moved from run to run (0.59-2.24 ms), and the runs that read it low were
    over-predicted more. Timed after the last job, so that no job runs after it (a job's step can depend on what ran
    before it in the same processes: `own_launch`)."""
    import torch.distributed as dist

    from helpers.models import SyntheticTokens, build_stack
    from helpers.runtime.launch import rank_device
    from helpers.simulate.calibrate import receive_post_seconds
    from helpers.simulate.calibrate_model import WholeModelTimer
    from helpers.training.loop import train_workers

    results = train_workers(jobs)
    device = rank_device()
    x, y = SyntheticTokens(max(sizes), cfg.seq_len, cfg.vocab).batch(0, max(sizes))
    timer = WholeModelTimer(build_stack(cfg).to(device), x.to(device), y.to(device), lm_loss)
    for size in sizes:
        for _ in range(repeats):
            dist.barrier()
            timer.sample(size)
    pipelined = [job.batch // job.microbatches for job in jobs if job.pp > 1]  # their micro-batches' samples
    posts = receive_post_seconds(timer.model, timer.x[:min(pipelined)]) if pipelined else None
    return {"jobs": results, "together": {size: [f + b for f, b in timer.samples[size]] for size in sizes},
            "receive_post_s": posts}


def launch_jobs(jobs: Sequence[TrainJob], config: BenchConfig, rig, timer=None) -> list:
    """One launch of the bench's two-rank `jobs`, in that order: a `TrainResult` each. With `timer`, the
    ranks' whole model timed both at once after the jobs is kept as the jobs' together samples, by micro-batch size,
    and what posting a receive cost there as their receive posts (`train_workers_timed_together`)."""
    from helpers.runtime.launch import run
    from helpers.training.job import check_job
    from helpers.training.loop import combine_ranks, run_trainings

    if timer is None:
        return run_trainings(jobs, rig)
    for job in jobs:
        check_job(job, rig)
    by_size = jobs_by_size(jobs)
    parts = run(train_workers_timed_together, jobs, config.cfg, list(by_size), rig=rig, timeout=300.0 * len(jobs))
    for part in parts:
        for size, seconds in part["together"].items():
            timer.add_together(size, seconds, by_size[size])
    if parts[0]["receive_post_s"] is not None:  # the mean over both ranks: every rank returns it
        timer.add_receive_posts(parts[0]["receive_post_s"], [job for job in jobs if job.pp > 1])
    return [combine_ranks([part["jobs"][i] for part in parts]) for i in range(len(jobs))]


def own_launch(job: TrainJob) -> bool:
    """Whether `job` runs in a launch of its own: the strategies built on FSDP2's `fully_shard` (the
    catalog's `fully_sharded`), whose step depends on what ran before it in the same processes: FSDP2 took 0.75-0.85
    s a step in fresh processes, 0.93 s late in the bench's shared launch, and 1.07-1.25 s there once the earlier
    jobs' process groups were destroyed as they ended (quiet machine; cause not found)."""
    return job.fully_sharded


def launch_groups(jobs: Sequence[TrainJob]) -> list[tuple[TrainJob, ...]]:
    """The bench's two-rank jobs as launches: every job in one launch (one start-up a round), less those that
    `own_launch` sets apart, each in a launch of its own."""
    shared = tuple(k for k in jobs if not own_launch(k))
    return [group for group in [shared, *((k,) for k in jobs if own_launch(k))] if group]


def process_rows(config: BenchConfig, rig, progress: bool | Progress = True, timer=None,
                 reference: LaunchReference | None = None) -> list[BenchRow]:
    """Every two-rank job (our pipelines, torch's, DDP, ZeRO-1; FSDP2's in launches of their own: `launch_groups`) in
    one launch per round, `config.rounds` rounds in alternating order (start-up paid once a round; each job's steps
    come from launches minutes apart), then DP x PP (4 ranks). With `timer`, the whole model timed at each job's
    micro-batch size just before and after the launch that ran it (`calibration_key`: the job's key), and on both
    ranks at once inside that launch (`launch_jobs`); with `reference`, the one-device step too, each row's speed-up
    then taken against its median there."""
    jobs = two_rank_jobs(config, rig)
    launches = {group: lambda group: launch_jobs(group, config, rig, timer) for group in launch_groups(jobs)}
    results = run_in_rounds(launches, config.rounds, "multi-process jobs", progress,
                            around=_around(reference, timer and (lambda group: sample_launch(timer, group))))
    return [process_row(job, got, "processes", reference) for job, got in results.items()] + \
        dp_x_pp_rows(config, rig, progress, timer, reference)


def process_row(job: TrainJob, got: Pooled, runner: str, reference: LaunchReference | None = None) -> BenchRow:
    """The row of a multi-process `job` (its key) from its launches pooled: a pipeline under its engine; data
    parallelism under PyTorch's wrappers (engine 'torch'), with Adam, against one device with Adam. With
    `reference`, its speed-up taken against the one-device step timed around its launches."""
    replicas_only = job.pp == 1
    row = BenchRow(job.strategy, "torch" if replicas_only else job.engine, runner,
                   None if replicas_only else job.microbatches, got.step_s, got.last.events,
                   got.last.peak_activations, optimizer=job.optimizer,
                   reference="single_adam" if job.optimizer == "adam" else "single", spread=got.spread,
                   measured_phase_s=got.phase_s, calibration_key=job, cpu_s=got.cpu_s, wire=job.wire,
                   launch_times=got.launch_times, launch_events=tuple(result.events for result in got.launched))
    if reference is not None:
        reference.apply(row, job, adam=job.optimizer == "adam")
    return row


def _around(reference: LaunchReference | None, sample: Callable | None) -> Callable | None:
    """What runs beside each launch: the one-device reference and the calibration samples, whichever are given."""
    return reference.around(sample) if reference else sample


@dataclass(frozen=True)
class Pooled:
    """A multi-process job's launches taken together: over every launch's steps (`launch_samples`), the median step
    time and its `relative_spread`; over their timed steps, the median seconds of each phase (`median_phases`);
    every launch's result, in launch order (the last one's timeline and memory are the row's); each launch's
    steps."""

    step_s: float
    spread: float
    phase_s: dict[str, float]
    launched: tuple
    cpu_s: list[float] | None = None  # per rank, the median over launches of its median step's thread CPU seconds
    launch_times: tuple[tuple[float, ...], ...] = ()  # every launch's `launch_samples`, in launch order

    @property
    def last(self):
        return self.launched[-1]


def run_in_rounds(launches: dict, rounds: int, desc: str, progress: bool | Progress = True,
                  around: Callable | None = None) -> dict:
    """Launch every group of jobs once per round, in turn (a, b, c, a, b, c, ...), so a noisy minute hits all of
    them; return {job key: `Pooled`}. `launches` maps a tuple of job keys to a launch that runs the keys it is
    given, in that order, returning one `TrainResult` per key (jobs launched together share one start of the
    processes: `run_trainings`); every other round runs a group's jobs in reverse order, so no job is always
    the first or the last of its launch. `around(keys)` runs with a launch's keys just before and just after it (the
    bench times its calibration there, so each row's calibration sees the minutes it ran)."""

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    jobs = [k for group in launches for k in group]
    progress.phase(f"{desc}: {len(jobs)} jobs in {len(launches)} launches x {rounds} round(s)")
    launched: dict = {k: [] for k in jobs}  # every launch's result of each job
    bar = progress.bar(rounds * len(launches), desc)
    for r in range(rounds):
        for group, launch in launches.items():
            order = group if r % 2 == 0 else group[::-1]
            if around is not None:
                around(order)
            for key, got in zip(order, launch(order)):
                launched[key].append(got)
            if around is not None:
                around(order)
            bar.update()
    bar.close()
    return {k: pool(got) for k, got in launched.items()}


def pool(launched: Sequence) -> Pooled:
    """One job's `Pooled` from the `TrainResult` of each of its launches."""
    import statistics

    steps = [t for got in launched for t in launch_samples(got)]
    cpu = [got.thread_cpu_s for got in launched]
    return Pooled(statistics.median(steps), relative_spread(steps),
                  median_phases([p for got in launched for p in got.phase_times]), tuple(launched),
                  [statistics.median(c) for c in zip(*cpu)] if all(cpu) else None,
                  tuple(launch_samples(got) for got in launched))


def launch_samples(got) -> tuple[float, ...]:
    """One launch's step times of a job (a `TrainResult`): its timed steps and the recorded step after them, an
    ordinary step whose timeline and peak memory are kept (timing it is free: the default run times two steps and
    takes three samples, one step less of every job in every launch)."""
    return (*got.step_times, *(() if got.recorded_step_s is None else (got.recorded_step_s,)))


DP_X_PP_MICROBATCHES = lambda config: max(2, config.onefoneb_microbatches // 2)  # noqa: E731


def dp_x_pp_rows(config: BenchConfig, rig, progress: bool | Progress = True, timer=None,
                 reference: LaunchReference | None = None) -> list[BenchRow]:
    """DP x PP on a 2 x 2 mesh (4 ranks: on a 2-core CPU they share the cores) on each engine the catalog lists for
    it, each job in launches of its own, interleaved in rounds; with `timer`, the whole model timed at its
    micro-batch size around them (and the one-device `reference`)."""
    from helpers.training.loop import run_training

    jobs = [job for job in bench_jobs(config, rig) if job.world == 4]
    sizes = timer and (lambda group: timer.sample(job_microbatch(group[0]), keys=group))
    results = run_in_rounds({(job,): lambda group: [run_training(group[0], rig, oversubscribe=rig.is_cpu)]
                             for job in jobs}, config.rounds, "DP x PP", progress, around=_around(reference, sizes))
    return [process_row(job, got, "processes (4 ranks)", reference) for job, got in results.items()]
