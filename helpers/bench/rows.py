"""The bench's rows, measured: one device and every pipeline on threads (`_single_row`, `run_bench`), every two-rank
job (pipelines, DDP, ZeRO-1) in one launch per round, those built on fully_shard in launches of their own
(`process_rows`, `launch_groups`, `run_in_rounds`) and DP x PP (`dp_x_pp_rows`); each kept as a `BenchRow`. What a
run measures is `helpers.bench.jobs`'."""
from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Hashable, Sequence

import torch
from torch import nn

from helpers.bench.blocks import (PipelineRun, bench_cut, make_pipeline_run, model_and_batch, one_device_step,
                                  time_pipeline_runs)
from helpers.bench.jobs import BenchConfig, bench_jobs, job_microbatch, threaded_pipelines, two_rank_jobs
from helpers.catalog import CATALOG
from helpers.measure import relative_spread
from helpers.sizing.ledger import ledger_for
from helpers.models import StackConfig, lm_loss
from helpers.runtime.rig import claim_cpu_device
from helpers.timeline import PHASES, Event, Recorder, median_phases, phase_seconds

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
    batched_weights: int = 1  # pipelines: weight passes this many micro-batches at a time (TrainJob's)
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
    fsdp2_host_s: float | None = None  # rows on fully_shard: its host work per collective, measured in their launches
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
                "batched_weights": self.batched_weights,
                "microbatches": self.microbatches, "optimizer": self.optimizer, "step_s": self.step_s,
                "samples_per_s": batch / self.step_s, "predicted_samples_per_s": predicted,
                "error": self.step_s / self.predicted_s - 1 if self.predicted_s else None,
                "excluded_from_target": self.excluded, "spread": self.spread,
                **{f"{phase}_vs_predicted": compute_drift(self.strategy, phase, self.measured_phase_s,
                                                          self.predicted_phase_s) for phase in PHASES},
                "whole_model_s": self.whole_model_s, "core_slowdown": self.core_slowdown,
                "receive_post_s": self.receive_post_s, "fsdp2_host_s": self.fsdp2_host_s, "cpu_s": self.cpu_s,
                "cpu_share": sum(self.cpu_s) / len(self.cpu_s) / self.step_s if self.cpu_s else None,
                "predicted_busy": self.predicted_busy,
                "speedup": self.speedup or reference_s / self.step_s, "speedup_vs": self.reference,
                "reference_s": reference_s, "reference_timed": "around this row's launches"
                if self.reference_s else "in the threaded rounds", "peak_activation_bytes": self.peak_activation_bytes,
                "launch_step_times_s": [list(t) for t in self.launch_times],
                "reference_samples_s": list(self.reference_samples)}


class Progress:
    """One line on stderr per phase, with the minutes and seconds since the run started (where a run's time goes);
    on a terminal also tqdm bars, erased when done (leave=False), so nothing of them runs into the table printed on
    stdout at the end."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.bars = enabled and sys.stderr.isatty()
        self.started = time.perf_counter()

    def phase(self, what: str) -> None:
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
    rows = [BenchRow(name, "none", "one thread", None, times[name], events, [peak], spread=times.spread(name),
                     measured_phase_s=median_phases(phases[name]), **fields)
            for name, fields in (("single", dict(caller_s=zero_s)),
                                 ("single_adam", dict(optimizer="adam", reference="single_adam",
                                                      caller_s=zero_s + adam_s, optimizer_s=adam_s)))]
    return times, rows, LaunchReference(one_device, adam_s)


def _caller_seconds(run: PipelineRun) -> float:
    """What `PipelineRun.step` does in the calling thread around the pipeline: zero_grad and the optimizer's step
    (SGD with lr=0 here), measured."""
    from helpers.simulate.calibrate_model import optimizer_seconds

    return optimizer_seconds(run.optimizer, zero_grad=True) + optimizer_seconds(run.optimizer)


@dataclass
class LaunchReference:
    """One device's step (the `single` row's closure), timed again in this process just before and just after every
    multi-process launch: the reference of those rows' speed-ups, the median of the one-device steps timed around a
    row's launches over the row's median step in them. The machine's speed drifts over a run, so each row is set
    against its own minutes; pooled rather than launch by launch (one slow step moves a per-launch ratio), and not
    timed by a rank, whose step slows once it has run other jobs (docs/bench.md, `LaunchReference`). Rows with Adam
    add one device's Adam step, measured (`adam_s`)."""

    step: Callable[[], None]
    adam_s: float
    samples: dict = field(default_factory=dict)  # job key -> seconds of each one-device step timed beside it

    def sample(self, keys: Sequence[Hashable]) -> None:
        from helpers.measure import interleaved_medians

        seconds = interleaved_medians({"single": self.step}, repeats=1, warmup=0)["single"]
        for key in keys:
            self.samples.setdefault(key, []).append(seconds)

    def apply(self, row: BenchRow, key: Hashable, adam: bool = False) -> None:
        """Give `row` (the job of `key`) this reference: the median one-device step timed beside the launches of
        `key` (plus Adam's step with `adam`; None if never sampled), and the samples that median comes from
        (bench.json keeps them beside the row's launches, so runs can be compared step by step)."""
        got = self.samples.get(key, ())
        row.reference_s = statistics.median(got) + (self.adam_s if adam else 0.0) if got else None
        row.reference_samples = tuple(got)

    def around(self, sizes: Callable[[Sequence[Hashable]], None] | None) -> Callable:
        """The hook `run_in_rounds` calls with a launch's keys before and after it: this reference's step, then the
        whole-model calibration samples (`sizes`, if any)."""
        def hook(keys: Sequence[Hashable]) -> None:
            self.sample(keys)
            if sizes is not None:
                sizes(keys)
        return hook


THREADS_KEY = "threads"  # calibration key of the rows timed in this process, in the same interleaved rounds


def calibration_samplers(timer, sizes: Sequence[int], rig, key: Hashable | None = None) -> dict[str, Callable]:
    """The calibration timed in the same interleaved rounds as threaded runs, kept under `key`: the whole model at
    each micro-batch size of `sizes`, and on the CPU rig two copies of it at once at the smallest (the busy-core
    slowdown of those minutes); nothing without a `timer`."""
    if timer is None:
        return {}
    out = {f"calibration: whole model, micro-batch {b}": timer.sampler(b, key) for b in sizes}
    if rig.is_cpu:
        out[f"calibration: two copies at once, micro-batch {min(sizes)}"] = timer.together_sampler(min(sizes), key)
    return out


def run_bench(config: BenchConfig, rig, progress: bool | Progress = True, timer=None) -> list[BenchRow]:
    """Every strategy on this rig, side by side: one device, every pipeline of the catalog on threads in this
    process (`threaded_pipelines`), then every multi-process job (`process_rows`). With `timer`
    (a `helpers.simulate.calibrate.WholeModelTimer` of the same model), the whole model is timed at each row's
    micro-batch size in the same interleaved rounds (threads) and around each launch (processes), each row's samples
    kept under its `calibration_key`, for the predictions."""
    progress = progress if isinstance(progress, Progress) else Progress(progress)
    if rig.is_cpu:
        claim_cpu_device(rig)
    model, x, y = model_and_batch(config.cfg, config.batch, rig.devices[0])
    threaded = threaded_pipelines(config)
    runs = [make_pipeline_run(f"{s.name}-m{m}", model, bench_cut(s.schedule, len(model)), rig.devices, rig.labels,
                              s.schedule, m) for s, m in threaded]
    progress.phase(f"one device and {len(runs)} threaded pipelines, {config.thread_repeats} interleaved repeats")
    sizes = sorted({config.batch} | {config.batch // m for _, m in threaded}, reverse=True)
    times, rows, reference = _single_row(model, x, y, lm_loss, config.thread_repeats, runs, progress,
                                         calibration_samplers(timer, sizes, rig, THREADS_KEY))
    for (s, m), r in zip(threaded, runs):
        rows.append(BenchRow(s.name, "ours", "threads", m, times[r.name], r.events,
                             [v.activations for v in r.ledger.report().values()], caller_s=_caller_seconds(r),
                             spread=times.spread(r.name), measured_phase_s=median_phases(r.phases),
                             speedup=times.paired_ratio("single", r.name)))
    for row in rows:  # one device and the threaded pipelines: timed in the same rounds as the samplers
        row.calibration_key = THREADS_KEY
    return rows + process_rows(config, rig, progress, timer, reference)


def jobs_by_size(jobs: Sequence[TrainJob]) -> dict[int, list[TrainJob]]:
    """A launch's jobs by the micro-batch size their ranks compute at, smallest first."""
    sizes = sorted({job_microbatch(job) for job in jobs})
    return {size: [job for job in jobs if job_microbatch(job) == size] for size in sizes}


TOGETHER_REPEATS = 6  # both ranks' whole-model steps at each size, after a launch's last job
FSDP2_HOST_ROUNDS_IN_LAUNCH = 6  # `fsdp2_host_samples` rounds after an FSDP2 job (its launches' rounds are pooled)


def train_workers_timed_together(jobs: Sequence, cfg: StackConfig, sizes: Sequence[int],
                                 repeats: int = TOGETHER_REPEATS) -> dict:
    """Rank worker of the bench's two-rank launches: the jobs one after the other (`train_workers`), then the whole
    model's forward and backward timed on both ranks at once (released by a barrier), `repeats` times at each
    micro-batch size of `sizes`: how fast a rank computes while the other rank computes too, in its launch's
    minutes. The parent times the same model alone beside the launch (`_rows_in_rounds`); the ratio is the busy-core
    slowdown of the launch's rows. Where a job is a pipeline, then what posting a receive costs while both ranks
    compute (`receive_post_seconds`, a hidden state of the pipelines' micro-batch); where a job is built on FSDP2's
    `fully_shard`, its host work per collective at the job's micro-batch size (`fsdp2_host_samples`). Each is read
    inside each launch because one reading for the whole run, from a launch of its own, mispriced the rows
    (docs/bench.md). Timed after the last job, so that no job runs after it (a job's step can depend on what ran
    before it: `launch_groups`)."""
    import torch.distributed as dist

    from helpers.runtime.launch import rank_device
    from helpers.simulate.calibrate import fsdp2_host_samples, receive_post_seconds
    from helpers.simulate.calibrate_model import WholeModelTimer
    from helpers.training.loop import train_workers

    results = train_workers(jobs)
    device = rank_device()
    timer = WholeModelTimer(*model_and_batch(cfg, max(sizes), device), lm_loss)
    for size in sizes:
        for _ in range(repeats):
            dist.barrier()
            timer.sample(size)
    pipelined = [job.batch // job.microbatches for job in jobs if job.pp > 1]  # their micro-batches' samples
    posts = receive_post_seconds(timer.model, timer.x[:min(pipelined)]) if pipelined else None
    sharded = [job_microbatch(job) for job in jobs if job.fully_sharded]
    host = fsdp2_host_samples(timer.model, timer.x[:sharded[0]], timer.y[:sharded[0]], lm_loss,
                              FSDP2_HOST_ROUNDS_IN_LAUNCH) if sharded else []
    return {"jobs": results, "together": {size: [f + b for f, b in timer.samples[size]] for size in sizes},
            "receive_post_s": posts, "fsdp2_host_s": host}


def launch_jobs(jobs: Sequence[TrainJob], config: BenchConfig, rig, timer=None) -> list:
    """One launch of the bench's two-rank `jobs`, in that order: a `TrainResult` each. With `timer`, the
    ranks' whole model timed both at once after the jobs is kept as the jobs' together samples, by micro-batch size,
    and what posting a receive and FSDP2's host work cost there as their launch readings
    (`train_workers_timed_together`)."""
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
        timer.add_launch_reading("receive_post_s", [parts[0]["receive_post_s"]], [job for job in jobs if job.pp > 1])
    timer.add_launch_reading("fsdp2_host_s", parts[0]["fsdp2_host_s"], [job for job in jobs if job.fully_sharded])
    return [combine_ranks([part["jobs"][i] for part in parts]) for i in range(len(jobs))]


def launch_groups(jobs: Sequence[TrainJob]) -> list[tuple[TrainJob, ...]]:
    """The bench's two-rank jobs as launches: every job in one launch (one start-up a round), less the strategies
    built on FSDP2's `fully_shard` (the catalog's `fully_sharded`), each in a launch of its own: their step depends
    on what ran before it in the same processes (cause not found; docs/bench.md, `launch_groups`)."""
    shared = tuple(k for k in jobs if not k.fully_sharded)
    return [group for group in [shared, *((k,) for k in jobs if k.fully_sharded)] if group]


def process_rows(config: BenchConfig, rig, progress: bool | Progress = True, timer=None,
                 reference: LaunchReference | None = None) -> list[BenchRow]:
    """Every two-rank job (our pipelines, torch's, DDP, ZeRO-1) in one launch per round, FSDP2's apart
    (`launch_groups`), `config.rounds` rounds in alternating order (`run_in_rounds`), then DP x PP (`dp_x_pp_rows`);
    with `timer` and `reference`, each row's calibration and one-device step timed beside its launches and, for the
    calibration, on both ranks inside them (`launch_jobs`)."""
    launches = {group: lambda group: launch_jobs(group, config, rig, timer)
                for group in launch_groups(two_rank_jobs(config, rig))}
    return _rows_in_rounds(launches, config, "multi-process jobs", "processes", progress, timer, reference) + \
        dp_x_pp_rows(config, rig, progress, timer, reference)


def dp_x_pp_rows(config: BenchConfig, rig, progress: bool | Progress = True, timer=None,
                 reference: LaunchReference | None = None) -> list[BenchRow]:
    """DP x PP on a 2 x 2 mesh (4 ranks: on a 2-core CPU they share the cores) on each engine the catalog lists for
    it, each job in launches of its own, interleaved in rounds; with `timer`, the whole model timed at its
    micro-batch size around them (and the one-device `reference`)."""
    from helpers.training.loop import run_training

    launches = {(job,): lambda group: [run_training(group[0], rig, oversubscribe=rig.is_cpu)]
                for job in bench_jobs(config, rig) if job.world == 4}
    return _rows_in_rounds(launches, config, "DP x PP", "processes (4 ranks)", progress, timer, reference)


def _rows_in_rounds(launches: dict, config: BenchConfig, desc: str, runner: str, progress, timer,
                    reference: LaunchReference | None) -> list[BenchRow]:
    """`launches` run in `config.rounds` rounds (`run_in_rounds`), with the calibration samples (`timer`) and the
    one-device `reference` beside each launch, whichever are given; a `process_row` per job."""
    # the whole model timed once at each micro-batch size a launch's jobs use, kept for every job of that size (they
    # ran in the same minutes)
    sizes = timer and (lambda group: [timer.sample(size, keys=same) for size, same in jobs_by_size(group).items()])
    results = run_in_rounds(launches, config.rounds, desc, progress,
                            around=reference.around(sizes) if reference else sizes)
    return [process_row(job, got, runner, reference) for job, got in results.items()]


def process_row(job: TrainJob, got: dict, runner: str, reference: LaunchReference | None = None) -> BenchRow:
    """The row of a multi-process `job` (its key) from its launches pooled (`got`: `pool`'s): a pipeline under its
    engine; data parallelism under PyTorch's wrappers (engine 'torch') or DeepSpeed's ('deepspeed'), with Adam,
    against one device with Adam. With `reference`, its speed-up taken against the one-device step timed around its
    launches."""
    replicas_only = job.pp == 1
    row = BenchRow(job.strategy, ("deepspeed" if job.deepspeed else "torch") if replicas_only else job.engine, runner,
                   None if replicas_only else job.microbatches, optimizer=job.optimizer,
                   reference="single_adam" if job.optimizer == "adam" else "single", calibration_key=job,
                   wire=job.wire, batched_weights=job.batched_weights, **got)
    if reference is not None:
        reference.apply(row, job, adam=job.optimizer == "adam")
    return row


def run_in_rounds(launches: dict, rounds: int, desc: str, progress: bool | Progress = True,
                  around: Callable | None = None) -> dict:
    """Launch every group of jobs once per round, in turn (a, b, c, a, b, c, ...), so a noisy minute hits all of
    them; return {job key: its launches `pool`ed}. `launches` maps a tuple of job keys to a launch that runs the keys
    it is given, in that order, returning one `TrainResult` per key (jobs launched together share one start of the
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


def pool(launched: Sequence) -> dict:
    """A multi-process job's launches taken together (the `TrainResult` of each), as its `BenchRow`'s fields: every
    launch's steps (`launch_samples`) pooled; the last launch's timeline and memory are the row's."""
    steps = [t for got in launched for t in launch_samples(got)]
    cpu = [got.thread_cpu_s for got in launched]
    return dict(step_s=statistics.median(steps), spread=relative_spread(steps),
                measured_phase_s=median_phases([p for got in launched for p in got.phase_times]),
                cpu_s=[statistics.median(c) for c in zip(*cpu)] if all(cpu) else None,
                launch_times=tuple(launch_samples(got) for got in launched),
                launch_events=tuple(got.events for got in launched), events=launched[-1].events,
                peak_activation_bytes=launched[-1].peak_activations)


def launch_samples(got) -> tuple[float, ...]:
    """One launch's step times of a job (a `TrainResult`): its timed steps and the recorded step after them, an
    ordinary step whose timeline and peak memory are kept (timing it is free: the default run times two steps and
    takes three samples, one step less of every job in every launch)."""
    return (*got.step_times, *(() if got.recorded_step_s is None else (got.recorded_step_s,)))
