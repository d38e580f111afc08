"""Measure strategies side by side in one run: medians of interleaved repeats, ratios within the run.

The building blocks here serve the notebooks; `python -m helpers.bench` (see `main`) runs every strategy.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch
from torch import nn

from helpers.catalog import BEYOND_1F1B, strategy as catalog_entry
from helpers.measure import Timings, interleaved_medians, relative_spread
from helpers.sizing.ledger import MemoryLedger, ledger_for
from helpers.models import StackConfig, lm_loss
from helpers.pipeline.schedules import LAYOUTS, chunks_of, layout_for
from helpers.pipeline.stages import split_model
from helpers.pipeline.threaded import ThreadedPipeline, stage_devices
from helpers.runtime.rig import claim_cpu_device
from helpers.timeline import PHASES, Event, Recorder, busy_fraction, chrome_trace, median_phases, phase_seconds
from helpers.training.support import support

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def one_device_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = lm_loss,
                    optimizer: torch.optim.Optimizer | None = None, rec: Recorder | None = None,
                    ledger: MemoryLedger | None = None) -> Callable[[], None]:
    """A closure running one training step of `model` on its own device: the baseline every ratio is taken to. Its
    forward counts what autograd saves in a memory ledger (`ledger`, or one of its own), as every pipeline's does:
    the same bookkeeping on both sides of a speed-up. With `rec`, each step's forward and backward are its spans."""
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)
    counted = ledger or ledger_for([model], ["device"], optimizer)

    def span(kind: str):
        return rec.span(kind, 0) if rec is not None else nullcontext()

    def step() -> None:
        if rec is not None:
            rec.clear()
        model.zero_grad(set_to_none=False)
        with span("forward"), counted.track_activations("device"):
            loss = loss_fn(model(x), y)
        with span("backward"):
            loss.backward()
        if optimizer is not None:
            optimizer.step()

    return step


@dataclass
class PipelineRun:
    """A pipeline ready to time: the model split at `boundaries`, its memory ledger and its timeline."""

    name: str
    pipeline: ThreadedPipeline
    ledger: MemoryLedger
    boundaries: tuple[int, ...]
    optimizer: torch.optim.Optimizer | None = None
    events: list[Event] = field(default_factory=list)
    phases: list[dict[str, float]] = field(default_factory=list)  # each timed step's `phase_seconds`

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=False)
        loss = self.pipeline.step(x, y)
        if self.optimizer is not None:
            self.optimizer.step()
        return loss


def make_pipeline_run(name: str, model: nn.Module, boundaries: Sequence[int], devices: Sequence[torch.device],
                      labels: Sequence[str], schedule: str = "gpipe", microbatches: int = 4,
                      lr: float = 0.0, wire: str = "fp32", optimizer: str = "sgd") -> PipelineRun:
    """Copy `model`, split it at `boundaries` over `devices`, and wire a ledger and an optimizer (SGD with lr=0
    keeps the weights fixed so that every repeat times the same computation; "adam" for Adam at `lr`)."""
    layout = layout_for(schedule, (len(boundaries) + 1) // chunks_of(schedule))
    split = split_model(copy.deepcopy(model), list(boundaries), stage_devices(devices, layout))
    per_device = [nn.ModuleList(split.stages[k] for k in layout.stages_of(d)) for d in range(layout.devices)]
    ledger = ledger_for(per_device, labels[:layout.devices])
    pipe = ThreadedPipeline(split, schedule, microbatches, ledger, wire)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](split.parameters(), lr=lr)
    ledger.optimizer = opt
    return PipelineRun(name, pipe, ledger, tuple(boundaries), opt)


def time_pipeline_runs(runs: Sequence[PipelineRun], x: torch.Tensor, y: torch.Tensor, repeats: int = 5,
                       extra: dict[str, Callable[[], object]] | None = None, progress: bool = True,
                       after: dict[str, Callable[[], object]] | None = None) -> Timings:
    """Median step seconds of each run (and of any `extra` callables, `after` hooks as `interleaved_medians`'),
    timed in interleaved rounds, each run's timed steps' `phases` read from its timeline; then one recorded step per
    run fills its `events` and its ledger's activation peaks."""
    def fresh_step(r: PipelineRun) -> None:
        r.pipeline.clear_events()
        r.step(x, y)

    fns = {r.name: (lambda r=r: fresh_step(r)) for r in runs}
    reads = {r.name: (lambda r=r: r.phases.append(phase_seconds(r.pipeline.events()))) for r in runs}
    times = interleaved_medians({**(extra or {}), **fns}, repeats, progress=progress, after={**(after or {}), **reads})
    for r in runs:
        r.pipeline.clear_events()
        r.ledger.reset_peaks()
        r.step(x, y)
        r.events = r.pipeline.events()
    return times


def run_rows(runs: Sequence[PipelineRun], times: dict[str, float], batch: int,
             baseline: str | None = None) -> list[dict]:
    """One table row per run: step time, samples/s, speed-up vs `baseline`, busy and memory per device."""
    rows = []
    for r in runs:
        busy = busy_fraction(r.events)
        report = r.ledger.report()
        rows.append({"split": r.name, "boundaries": list(r.boundaries), "step (ms)": times[r.name] * 1e3,
                     "samples/s": batch / times[r.name], **_spread_of(times, r.name),
                     **({"speedup": times[baseline] / times[r.name]} if baseline else {}),
                     "busy": [round(busy.get(i, 0.0), 2) for i in range(len(report))],
                     "params": [m.params for m in report.values()],
                     "activations": [m.activations for m in report.values()]})
    return rows


def _spread_of(times: dict[str, float], name: str) -> dict:
    """{"spread": ...} of `name` where `times` kept its samples (a `Timings`), else nothing."""
    return {"spread": times.spread(name)} if isinstance(times, Timings) else {}


# --- python -m helpers.bench -------------------------------------------------------------------------------------

def stage_costs_per_microbatch(events: Sequence[Event]) -> dict[int, float]:
    """Median forward + median backward duration per micro-batch, per device, from a run's own timeline."""
    import statistics

    costs = {}
    for dev in sorted({e.device for e in events}):
        fwd = [e.duration for e in events if e.device == dev and e.kind == "forward"]
        bwd = [e.duration for e in events if e.device == dev and e.kind == "backward"]
        costs[dev] = (statistics.median(fwd) if fwd else 0.0) + (statistics.median(bwd) if bwd else 0.0)
    return costs


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
    predicted_s: float | None = None  # the simulator's step time for this row (see `predict_rows`)
    excluded: str | None = None  # why this row's prediction is not held to the target, if it is not
    spread: float | None = None  # half the interquartile range of the step times over their median (the noise)
    predicted_phase_s: dict[str, float] = field(default_factory=dict)  # simulated forward / backward seconds
    measured_phase_s: dict[str, float] = field(default_factory=dict)  # their median over the timed steps
    # the whole-model samples this row's prediction is calibrated from (a WholeModelTimer key; None: the run's)
    calibration_key: Hashable | None = None
    whole_model_s: tuple[float, float] | None = None  # forward, backward of one micro-batch, as calibrated
    core_slowdown: float | None = None  # threaded rows: the busy-core slowdown their prediction used

    def as_dict(self, batch: int, reference_s: float) -> dict:
        predicted = batch / self.predicted_s if self.predicted_s else None
        return {"strategy": self.strategy, "engine": self.engine, "runner": self.runner,
                "microbatches": self.microbatches, "optimizer": self.optimizer, "step_s": self.step_s,
                "samples_per_s": batch / self.step_s, "predicted_samples_per_s": predicted,
                "error": self.step_s / self.predicted_s - 1 if self.predicted_s else None,
                "excluded_from_target": self.excluded, "spread": self.spread,
                **{f"{phase}_vs_predicted": compute_drift(self.strategy, phase, self.measured_phase_s,
                                                          self.predicted_phase_s) for phase in PHASES},
                "whole_model_s": self.whole_model_s, "core_slowdown": self.core_slowdown,
                "speedup": reference_s / self.step_s,
                "speedup_vs": self.reference, "peak_activation_bytes": self.peak_activation_bytes}


BENCH_COLUMNS = ["strategy", "engine", "runner", "m", "optimizer", "samples/s", "spread", "predicted", "error",
                 "forward", "backward", "speedup", "peak_activation_bytes"]
TARGET = 0.15  # every prediction within 15% of what was measured, rows excluded with a reason aside

LEGEND = f"""\
strategy     what runs: one device, the naive split, GPipe / 1F1B pipelines (2 stages), past 1F1B (notebook 06b:
             ZB-H1; interleaved 1F1B, ZB-V, DualPipeV with 2 stages per device), DDP, ZeRO-1, FSDP2, DP x PP
engine       ours = the course's schedule interpreter; torch = PyTorch's engine (torch.distributed.pipelining,
             DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard); none = plain autograd
runner       one thread; threads = one thread per device in this process; processes = one process per device (gloo
             on the CPU rig, NCCL on GPUs)
m            micro-batches per step (pipelines; DP x PP: per replica); '-' = the whole batch at once
optimizer    what the timed step includes after backward: none, or Adam (compare with single_adam)
samples/s    measured: global batch / median step time over interleaved repeats (threads) or launches (processes)
spread       the noise of that median: half the interquartile range of the step times over their median (processes:
             pooled over every launch); an error not much larger than it is within what the machine's jitter allows
             one run to show. With one launch per job (--quick) it cannot show how launches a minute apart differ:
             up to 26% on the 2-core CPU rig (the same DDP job, three launches in a row)
predicted    the simulator's samples/s for the same row (helpers.simulate), calibrated in this run: per-layer profile
             at the row's micro-batch size rescaled to the whole model's time per micro-batch measured with that row
             (same interleaved rounds; multi-process rows: just before and after each launch), the measured
             optimizer step and zero_grad, the fitted point-to-point link and collectives (all-reduce, all-gather,
             reduce-scatter, broadcast), the measured copy speed, and on the CPU rig how much slower the cores
             compute when both are busy (threads and processes share the cores fairly: processor sharing; for
             threads, two copies of the model timed at once in the rows' own rounds)
error        predicted / measured - 1; '*' marks a row outside the {TARGET:.0%} target, its reason printed below
forward, backward  how much longer the row's forward (backward, with any recomputation) passes took than the
             simulator's, summed over devices, in the median timed step (every launch's, for processes): how fast
             the machine computed during that row against the calibration. An error close to them is that speed; an
             error well beyond them is in what else the step does (waiting for messages and collectives). '-' where
             the spans include collectives: DDP's and ZeRO-1's backward (the all-reduce hook), FSDP2's forward and
             backward
speedup      measured samples/s / the one-device row's (single; single_adam for rows that include Adam)
peak_activation_bytes  saved activations at their peak, per device (rank)"""


@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs. Defaults: 8 blocks of hidden 384 (14.4 M parameters) and batch 32, sized for a 2-core CPU."""

    cfg: StackConfig
    batch: int
    steps: int
    gpipe_microbatches: tuple[int, ...]
    onefoneb_microbatches: int
    torch_microbatches: tuple[int, ...]
    rounds: int = 1  # launches of each multi-process job, interleaved across jobs
    extra_repeats: int = 2  # interleaved repeats of the split comparison and the checkpoint sweep
    link_sizes: tuple[int, ...] = tuple(4 ** k * 1024 for k in range(1, 9))  # 4 KiB .. 64 MiB


MODES = ("quick", "default", "precise")


def default_config(mode: str | bool, rig) -> BenchConfig:
    """The run of `mode` (True: quick, False: default, as before modes had names). quick: a smoke test of a smaller
    model. default: every row once, 3 timed steps, one launch of each multi-process job. precise: the same rows,
    6 steps and 3 launches of each job interleaved, 6 repeats of the extras: medians a noisy minute moves less."""
    mode = {True: "quick", False: "default"}.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown bench mode {mode!r}; choose one of {MODES}")
    scale = 1 if rig.is_cpu else 4
    if mode == "quick":  # 3 steps, so their median is not the first: 2-18% slower on the CPU rig (DDP rebuilds)
        return BenchConfig(StackConfig(hidden=256 * scale, n_blocks=4, seq_len=32), batch=16, steps=3,
                           gpipe_microbatches=(4,), onefoneb_microbatches=4, torch_microbatches=(4,), rounds=1,
                           link_sizes=tuple(4 ** k * 1024 for k in range(1, 8)), extra_repeats=2)
    precise = mode == "precise"
    return BenchConfig(StackConfig(hidden=384 * scale, n_blocks=8, seq_len=32), batch=32, steps=6 if precise else 3,
                       gpipe_microbatches=(2, 4, 8), onefoneb_microbatches=8, torch_microbatches=(8,),
                       rounds=3 if precise else 1, extra_repeats=6 if precise else 2)


class Progress:
    """One line on stderr per phase; on a terminal also tqdm bars, erased when done (leave=False), so nothing of
    them runs into the table printed on stdout at the end."""

    def __init__(self, enabled: bool = True):
        import sys

        self.enabled = enabled
        self.bars = enabled and sys.stderr.isatty()

    def phase(self, what: str) -> None:
        import sys

        if self.enabled:
            print(f"bench: {what}", file=sys.stderr, flush=True)

    def bar(self, total: int, desc: str):
        from tqdm.auto import tqdm

        return tqdm(total=total, desc=desc, leave=False, disable=not self.bars)


def _single_row(model: nn.Module, x, y, loss_fn, steps: int, extra_runs: Sequence[PipelineRun] = (),
                progress: Progress | None = None, extra: dict | None = None):
    """One device, without an optimizer and with Adam, timed in the same interleaved rounds as the threaded
    pipelines; its activation peak as its ledger counts it."""
    from helpers.simulate.calibrate import optimizer_seconds

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
                            spread=times.spread("single_adam"), measured_phase_s=median_phases(phases["single_adam"]))]


def _caller_seconds(run: PipelineRun) -> float:
    """What `PipelineRun.step` does in the calling thread around the pipeline: zero_grad and the optimizer's step
    (SGD with lr=0 here), measured."""
    from helpers.simulate.calibrate import optimizer_seconds

    return optimizer_seconds(run.optimizer, zero_grad=True) + optimizer_seconds(run.optimizer)


THREADS_KEY = "threads"  # calibration key of the rows timed in this process, in the same interleaved rounds
PROCESS_ROWS = (("naive", "processes"), ("gpipe", "processes"), ("1f1b", "processes"), ("gpipe", "torch"),
                ("1f1b", "torch"), *((s, e) for s in BEYOND_1F1B for e in ("processes", "torch")),
                ("ddp", "processes"), ("zero1", "processes"), ("fsdp2", "processes"),
                ("dp_x_pp", "processes"))  # the bench's multi-process rows, as (strategy, engine) of the support matrix


def bench_refusals(rig) -> dict[tuple[str, str], str]:
    """The bench's multi-process rows this rig cannot run, with the support matrix's reason: left out of the run
    (one GPU: torch's pipelining and FSDP2; fewer than 4 GPUs: DP x PP), instead of stopping it with nothing
    written."""
    out = {}
    for strategy, engine in PROCESS_ROWS:
        verdict = support(rig, strategy, engine, 4 if strategy == "dp_x_pp" else 2)
        if not verdict.ok:
            out[(strategy, engine)] = verdict.reason
    return out


def bench_cut(schedule: str, n_layers: int) -> tuple[int, ...]:
    """Where the bench cuts its block stack (embedding, blocks, head) for `schedule` on two devices (any other row:
    as for one stage per device): in the middle for one stage per device; for two (interleaved, V-shaped), into four
    stages of equal block counts, the embedding with the first and the head with the last, so each device holds as
    many blocks whichever stages it gets."""
    stages = 2 * (chunks_of(schedule) if schedule in LAYOUTS else 1)
    if stages == 2:
        return (n_layers // 2,)
    blocks = n_layers - 2
    return tuple(1 + round(k * blocks / stages) for k in range(1, stages))


def run_bench(config: BenchConfig, rig, progress: bool | Progress = True, timer=None) -> list[BenchRow]:
    """Every pipeline strategy on this rig, side by side: one device, the naive split, our GPipe and 1F1B (threads
    in this process and one process per device), and torch.distributed.pipelining's GPipe and 1F1B. With `timer`
    (a `helpers.simulate.calibrate.WholeModelTimer` of the same model), the whole model is timed at each row's
    micro-batch size in the same interleaved rounds (threads) and around each launch (processes), each row's samples
    kept under its `calibration_key`, for the predictions."""
    from helpers.models import SyntheticTokens, build_stack
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_trainings

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    if rig.is_cpu:
        claim_cpu_device(rig)
    model = build_stack(config.cfg).to(rig.devices[0])
    x, y = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    cut = [len(model) // 2]
    threaded = [("gpipe", m) for m in config.gpipe_microbatches] + [("1f1b", config.onefoneb_microbatches)]
    threaded += [(s, config.onefoneb_microbatches) for s in BEYOND_1F1B]
    runs = [make_pipeline_run(f"{s}-m{m}", model, bench_cut(s, len(model)), rig.devices, rig.labels, s, m)
            for s, m in threaded]
    progress.phase(f"one device and {len(runs)} threaded pipelines, {config.steps} interleaved repeats")
    sizes = sorted({config.batch} | {config.batch // m for _, m in threaded}, reverse=True)
    samplers = ({f"calibration: whole model, micro-batch {b}": timer.sampler(b, THREADS_KEY) for b in sizes}
                if timer else {})
    if timer and rig.is_cpu:
        samplers[f"calibration: two copies at once, micro-batch {sizes[-1]}"] = timer.together_sampler(sizes[-1],
                                                                                                       THREADS_KEY)
    times, rows = _single_row(model, x, y, lm_loss, config.steps, runs, progress, samplers)
    for (s, m), r in zip(threaded, runs):
        rows.append(BenchRow(s, "ours", "threads", m, times[r.name], r.events,
                             [v.activations for v in r.ledger.report().values()], caller_s=_caller_seconds(r),
                             spread=times.spread(r.name), measured_phase_s=median_phases(r.phases)))
    for row in rows:  # one device and the threaded pipelines: timed in the same rounds as the samplers
        row.calibration_key = THREADS_KEY
    jobs = [("naive", "ours", "gpipe", 1, False)]
    jobs += [("gpipe", "ours", "gpipe", m, True) for m in config.gpipe_microbatches]
    jobs += [("1f1b", "ours", "1f1b", config.onefoneb_microbatches, True)]
    jobs += [(s, "torch", s, m, True) for m in config.torch_microbatches for s in ("gpipe", "1f1b")]
    jobs += [(s, engine, s, config.onefoneb_microbatches, True) for engine in ("ours", "torch") for s in BEYOND_1F1B]
    refused = bench_refusals(rig)
    jobs = [j for j in jobs if (j[0], "torch" if j[1] == "torch" else "processes") not in refused]
    def job(j) -> TrainJob:
        return TrainJob(config.cfg, pp=2, boundaries=bench_cut(j[2], len(model)), schedule=j[2], microbatches=j[3],
                        batch=config.batch, engine=j[1], overlap=j[4], timed_steps=config.steps)

    # ours and torch's run of one schedule share a launch (one start of the processes for the two)
    results = run_in_rounds(
        {group: (lambda group=group: run_trainings([job(j) for j in group], rig))
         for group in by_launch(jobs, lambda j: (j[2], j[3], j[4]))},
        config.rounds, "process pipelines", progress,
        around=(lambda j: timer.sample(config.batch // j[3], j)) if timer else None)
    for j, got in results.items():
        strategy, engine, _, m, _ = j
        rows.append(BenchRow(strategy, engine, "processes", m, got.step_s, got.last.events,
                             got.last.peak_activations, spread=got.spread, measured_phase_s=got.phase_s,
                             calibration_key=j))
    return rows + data_parallel_rows(config, rig, progress, timer)


@dataclass(frozen=True)
class Pooled:
    """A multi-process job's launches taken together: over every launch's timed steps, the median step time, its
    `relative_spread` and the median seconds of each phase (`median_phases`); the last launch's result (its
    timeline and memory)."""

    step_s: float
    spread: float
    phase_s: dict[str, float]
    last: object


def run_in_rounds(launches: dict, rounds: int, desc: str, progress: bool | Progress = True,
                  around: Callable | None = None) -> dict:
    """Launch every group of jobs once per round, in turn (a, b, c, a, b, c, ...), so a noisy minute hits all of
    them; return {job key: `Pooled`}. `launches` maps a tuple of job keys to a launch returning one `TrainResult`
    per key (jobs launched together share one start of the processes: `run_trainings`). `around(key)` runs for
    each job just before and just after its launch (the bench times its calibration there, so each row's
    calibration sees the minutes it ran)."""
    import statistics

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    jobs = [k for group in launches for k in group]
    progress.phase(f"{desc}: {len(jobs)} jobs in {len(launches)} launches x {rounds} round(s)")
    steps: dict = {k: [] for k in jobs}
    phases: dict = {k: [] for k in jobs}
    last: dict = {}
    bar = progress.bar(rounds * len(launches), desc)
    for _ in range(rounds):
        for group, launch in launches.items():
            for key in group if around is not None else ():
                around(key)
            for key, got in zip(group, launch()):
                last[key] = got
                steps[key].extend(got.step_times)
                phases[key].extend(got.phase_times)
            for key in group if around is not None else ():
                around(key)
            bar.update()
    bar.close()
    return {k: Pooled(statistics.median(steps[k]), relative_spread(steps[k]), median_phases(phases[k]), last[k])
            for k in jobs}


def by_launch(keys: Sequence, share: Callable) -> list[tuple]:
    """The job keys grouped into launches: keys with the same `share(key)` together (in order of first appearance)."""
    groups: dict = {}
    for key in keys:
        groups.setdefault(share(key), []).append(key)
    return [tuple(group) for group in groups.values()]


DP_X_PP_MICROBATCHES = lambda config: max(2, config.onefoneb_microbatches // 2)  # noqa: E731


def data_parallel_rows(config: BenchConfig, rig, progress: bool | Progress = True, timer=None) -> list[BenchRow]:
    """DDP, ZeRO-1 and FSDP2 (Adam step included, compared with one device doing the same), and DP x PP; with
    `timer`, the whole model timed at each job's micro-batch size around its launches."""
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_training, run_trainings

    rows = []
    dp_job = lambda s: TrainJob(config.cfg, dp=2, data_parallel=s, batch=config.batch,  # noqa: E731
                                timed_steps=config.steps, optimizer="adam")
    refused = bench_refusals(rig)
    strategies = [s for s in ("ddp", "zero1", "fsdp2") if (s, "processes") not in refused]
    results = run_in_rounds({tuple(strategies): lambda: run_trainings([dp_job(s) for s in strategies], rig)}
                            if strategies else {},
                            config.rounds, "data parallel", progress,
                            around=(lambda s: timer.sample(config.batch // 2, s)) if timer else None)
    for strategy, got in results.items():
        rows.append(BenchRow(strategy, "torch", "processes", None, got.step_s, got.last.events,
                             [m.activations for m in got.last.memory], optimizer="adam", reference="single_adam",
                             spread=got.spread, measured_phase_s=got.phase_s, calibration_key=strategy))
    if ("dp_x_pp", "processes") not in refused:
        m = DP_X_PP_MICROBATCHES(config)
        results = run_in_rounds({("dp_x_pp",): lambda: [run_training(
            TrainJob(config.cfg, dp=2, pp=2, schedule="1f1b", microbatches=m, batch=config.batch,
                     timed_steps=config.steps),
            rig, oversubscribe=rig.is_cpu)]}, config.rounds, "DP x PP", progress,
            around=(lambda k: timer.sample(config.batch // 2 // m, k)) if timer else None)
        got = results["dp_x_pp"]
        rows.append(BenchRow("dp_x_pp", "ours", "processes (4 ranks)", m, got.step_s, got.last.events,
                             got.last.peak_activations, spread=got.spread, measured_phase_s=got.phase_s,
                             calibration_key="dp_x_pp"))
    return rows


# --- predictions: the simulator, calibrated in the same run ------------------------------------------------------

def row_strategy(row: BenchRow):
    """The catalog's entry of a bench row (helpers.catalog; "single_adam" is one device with Adam)."""
    return catalog_entry("single" if row.strategy == "single_adam" else row.strategy)


def microbatch_size(row: BenchRow, batch: int) -> int:
    """Samples one device computes at a time in `row`: the global batch split over replicas and micro-batches."""
    replicas = 2 if row_strategy(row).data_parallel else 1
    return batch // replicas // (row.microbatches or 1)


def simulation_job(row: BenchRow, batch: int, cut: Sequence[int] = ()):
    """The simulator's Job for a bench row: the same strategy on two devices per dimension (DP x PP: 2 x 2, 1F1B)."""
    from helpers.simulate import Job

    entry = row_strategy(row)
    if entry.kind == "single":
        return Job("single", batch)
    cut = tuple(cut) or None if entry.pipeline else None
    return Job(entry.name, batch, microbatches=row.microbatches or 1, cut=cut)


def predict_row(row: BenchRow, workload, rig_model, batch: int, cut: Sequence[int] = (), adam_s: float = 0.0,
                cores: int | None = None):
    """The simulated step of `row`: its job on `workload` (costs at the row's micro-batch size), the row's links and
    core sharing from `rig_model`, plus the work its calling thread does around the engine (`row.caller_s`).
    Rows with Adam run it on every rank (`adam_s`: one device's Adam step over the whole model). Returns the
    Simulation; `row.predicted_s` is set."""
    from dataclasses import replace

    if row.optimizer == "adam" and row.engine != "none":
        workload = replace(workload, optimizer_s=adam_s)
    engine = "threads" if row.runner in ("threads", "one thread") else "processes"
    sim = rig_model.simulate(workload, simulation_job(row, batch, cut), engine)
    row.predicted_s = sim.step_s + row.caller_s
    row.predicted_phase_s = phase_seconds(sim.events)
    return sim


def calibrate(model: nn.Module, x, y, sizes: Sequence[int], progress: Progress, repeats: int = 3,
              timer=None) -> dict:
    """{micro-batch size: Calibrated} for `model` on this rig (helpers.simulate.calibrate.measure_workload), with
    the whole model's times from `timer` where it sampled that size (between the rows' measurements)."""
    from helpers.simulate.calibrate import measure_workload

    out = {}
    bar = progress.bar(len(sizes), "profiles")
    for b in sorted(set(sizes), reverse=True):
        out[b] = measure_workload(model, x, y, lm_loss, b, repeats, whole=timer.seconds(b) if timer else None)
        bar.update()
    bar.close()
    return out


def predict_rows(rows: Sequence[BenchRow], config: BenchConfig, rig, rig_model, progress: Progress,
                 timer=None) -> dict:
    """Give every row its predicted step time, from this run's per-layer profiles (one per micro-batch size the rows
    use), each rescaled to the whole model's time sampled with the row (`timer`, under its `calibration_key`), link
    fits and core sharing; returns the calibrations by micro-batch size (rescaled to all of `timer`'s samples)."""
    from helpers.models import SyntheticTokens, build_stack

    model = build_stack(config.cfg).to(rig.devices[0])
    x, y = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    sizes = sorted({microbatch_size(r, config.batch) for r in rows}, reverse=True)
    progress.phase(f"calibrating: per-layer profile and whole-model time at micro-batch sizes {sizes}")
    calibrated = calibrate(model, x, y, sizes, progress, timer=timer)
    adam_s = next((r.optimizer_s for r in rows if r.strategy == "single_adam"), 0.0)
    for row in rows:
        size = microbatch_size(row, config.batch)
        workload, row.whole_model_s = calibrated[size].workload, (calibrated[size].forward_s,
                                                                  calibrated[size].backward_s)
        row_rig = rig_model
        if timer is not None and row.calibration_key is not None:
            row.whole_model_s = timer.seconds(size, row.calibration_key)
            workload = workload.rescaled(*(t / size for t in row.whole_model_s))
            if row.runner == "threads":
                row_rig = rig_model.with_thread_slowdown(timer.slowdown(row.calibration_key))
                row.core_slowdown = getattr(row_rig.thread_cores, "slowdown", None)
        predict_row(row, workload, row_rig, config.batch, bench_cut(row.strategy, len(model)), adam_s)
        if row.runner == "processes (4 ranks)" and rig.is_cpu and abs(row.step_s / row.predicted_s - 1) > TARGET:
            from helpers.simulate import simulate

            own = simulate(rig_model.calibrated(workload), simulation_job(row, config.batch, [len(model) // 2]),
                           rig_model.p2p, rig_model.collectives)
            row.excluded = (f"4 ranks time-share 2 cores: the prediction shares the cores fairly but does not model "
                            f"the operating system switching 4 processes on 2 cores (caches refilled, a waiting rank "
                            f"woken late); on 4 devices of their own it predicts {config.batch / own.step_s:.3g} "
                            f"samples/s")
    return calibrated


def write_results(rows: Sequence[BenchRow], config: BenchConfig, rig, out_dir,
                  extras: dict[str, list[dict]] | None = None, calibration: dict | None = None) -> list[dict]:
    """bench.json (rig, rows, any extra tables, the calibration) and per row one timeline PNG and the same timeline
    as a Chrome / Perfetto trace (timeline_*.json) in `out_dir`; returns the rows."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.timeline import plot_timeline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reference = {r.strategy: r.step_s for r in rows if r.engine == "none"}
    dicts = [r.as_dict(config.batch, reference[r.reference]) for r in rows]
    refused = {f"{s} ({e})": why for (s, e), why in bench_refusals(rig).items()}
    (out / "bench.json").write_text(json.dumps({"rig": rig.describe(), "batch": config.batch,
                                                "model": repr(config.cfg), "rows": dicts, **(extras or {}),
                                                "calibration": calibration or {}, "not_run_here": refused}, indent=2))
    for r in rows:
        m = f", m={r.microbatches}" if r.microbatches else ""
        ax = plot_timeline(r.events, title=f"{r.strategy} ({r.engine}, {r.runner}{m})")
        ax.figure.savefig(out / timeline_name(r), dpi=90, bbox_inches="tight")
        plt.close(ax.figure)
        chrome_trace(r.events, (out / timeline_name(r)).with_suffix(".json"))  # for ui.perfetto.dev
    return dicts


def timeline_name(row: BenchRow) -> str:
    """timeline_<strategy>_<engine>_<runner>[_m<m>].png, with only letters, digits, '-' and '_'."""
    import re

    parts = [row.strategy, row.engine, row.runner] + ([f"m{row.microbatches}"] if row.microbatches else [])
    return "timeline_" + "_".join(re.sub(r"[^A-Za-z0-9_]+", "-", p).strip("-") for p in parts) + ".png"


# strategies whose recorded spans of a phase include communication, which the simulator keeps apart
SPANS_INCLUDE_COMMUNICATION = {"forward": {"fsdp2"}, "backward": {"ddp", "zero1", "fsdp2"}}


def compute_drift(strategy: str, phase: str, measured: dict[str, float], predicted: dict[str, float]) -> float | None:
    """How much longer the measured spans of `phase` took than the simulator's (each a `phase_seconds`: `measured`
    the median timed step's, `predicted` the simulated step's), or None where they are not comparable
    (`SPANS_INCLUDE_COMMUNICATION`) or missing."""
    measured_s, predicted_s = measured.get(phase), predicted.get(phase)
    if strategy in SPANS_INCLUDE_COMMUNICATION[phase] or not predicted_s or not measured_s:
        return None
    return measured_s / predicted_s - 1


def _signed(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.0%}"


def _percent(error: float | None, excluded: str | None = None) -> str:
    if error is None:
        return "-"
    return f"{error:+.1%}" + ("*" if excluded or abs(error) > TARGET else "")


def _plus_minus(spread: float | None) -> str:
    return "-" if spread is None else f"±{spread:.0%}"


def display_rows(dicts: Sequence[dict]) -> list[dict]:
    """The printed table's rows: measured, predicted and the error side by side."""
    return [{"strategy": d["strategy"], "engine": d["engine"], "runner": d["runner"], "m": d["microbatches"],
             "optimizer": d["optimizer"], "samples/s": d["samples_per_s"], "spread": _plus_minus(d.get("spread")),
             "predicted": d["predicted_samples_per_s"],
             "error": _percent(d["error"], d["excluded_from_target"]),
             "forward": _signed(d.get("forward_vs_predicted")), "backward": _signed(d.get("backward_vs_predicted")),
             "speedup": d["speedup"],
             "peak_activation_bytes": d["peak_activation_bytes"]} for d in dicts]


def _drift_said(d: dict) -> str:
    """'; in its median step its forward passes took 4% longer ... than simulated', or ''."""
    said = [f"{phase} passes took {abs(x):.0%} {'longer' if x >= 0 else 'less time'}" for phase in PHASES
            if (x := d.get(f"{phase}_vs_predicted")) is not None]
    return f"; in its median step its {' and '.join(said)} than simulated" if said else ""


def misses(dicts: Sequence[dict], name_key: str = "strategy") -> list[str]:
    """One line per row whose prediction is outside the target or excluded from it, with the reason."""
    out = []
    for d in dicts:
        label = " ".join(str(d[k]) for k in (name_key, "engine", "runner", "microbatches") if d.get(k) is not None)
        if d.get("excluded_from_target"):
            out.append(f"  {label}: excluded from the target: {d['excluded_from_target']}")
        elif d.get("error") is not None and abs(d["error"]) > TARGET:
            spread = d.get("spread")
            noise = "" if spread is None else f"; the measured step times spread {_plus_minus(spread)}"
            out.append(f"  {label}: {d['error']:+.1%} (outside the {TARGET:.0%} target{noise}{_drift_said(d)})")
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from helpers.report import table
    from helpers.runtime.rig import detect_rig
    from helpers.simulate.calibrate import measure_rig

    parser = argparse.ArgumentParser(prog="python -m helpers.bench",
                                     description="Every strategy side by side on this rig, in one run, each with the "
                                                 "simulator's prediction calibrated in the same run.")
    parser.add_argument("--out", default="results", help="folder for bench.json and timeline PNGs")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true",
                        help="smoke test: a smaller model (hidden 256, 4 blocks, batch 16), one micro-batch count, "
                             "3 repeats, 1 launch per job, a link sweep to 16 MiB; every kind of row still runs and "
                             "is predicted")
    length.add_argument("--precise", action="store_true",
                        help="the same rows as the default run, timed longer: 6 steps and 3 launches of each "
                             "multi-process job interleaved, 6 repeats of the split comparison and checkpoint sweep")
    parser.add_argument("--cpu", action="store_true", help="force the CPU rig on a GPU machine")
    parser.add_argument("--skip-extras", action="store_true", help="skip the split comparison and checkpoint sweep")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    ns = parser.parse_args(argv)
    progress = Progress(not ns.no_progress)
    load = MachineLoad()
    rig = detect_rig(force_cpu=ns.cpu or None)
    config = default_config("quick" if ns.quick else "precise" if ns.precise else "default", rig)
    print(rig.describe(), flush=True)
    from helpers.models import SyntheticTokens, build_stack
    from helpers.simulate.calibrate import WholeModelTimer

    tx, ty = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    timer = WholeModelTimer(build_stack(config.cfg).to(rig.devices[0]), tx.to(rig.devices[0]), ty.to(rig.devices[0]),
                            lm_loss)
    rows = run_bench(config, rig, progress, timer)

    progress.phase("calibrating: link benchmark (point-to-point, all-reduce) and busy-core slowdown")
    probe = build_stack(config.cfg).to(rig.devices[0])
    mb = min(microbatch_size(r, config.batch) for r in rows)
    px, py = SyntheticTokens(mb, config.cfg.seq_len, config.cfg.vocab).batch(0, mb)
    rig_model = measure_rig(rig, probe, px.to(rig.devices[0]), py.to(rig.devices[0]), lm_loss, config.link_sizes)
    calibrated = predict_rows(rows, config, rig, rig_model, progress, timer)
    extras = {}
    if not ns.skip_extras:
        extras = {"splits": split_comparison_rows(rig, ns.quick, rig_model, progress, config.extra_repeats),
                  "checkpointing": checkpoint_sweep_rows(rig, ns.quick, rig_model, progress, config.extra_repeats)}
    load.stop()
    calibration = {**calibration_record(rig_model, calibrated), "machine_load": load.record()}
    timed_with = {"the threaded rows": next((r.core_slowdown for r in rows if r.runner == "threads"), None),
                  **{name: extra_rows[0].get("core_slowdown") for name, extra_rows in extras.items() if extra_rows}}
    calibration["summary"] += [f"threads, timed with {name}: {s:.3g}x slower when both cores are busy"
                               for name, s in timed_with.items() if s is not None]
    dicts = write_results(rows, config, rig, ns.out, extras, calibration)
    print(table(display_rows(dicts), BENCH_COLUMNS))
    for name, extra_rows in extras.items():
        shown = [{**r, "predicted": r.get("predicted_samples_per_s"), "spread": _plus_minus(r.get("spread")),
                  **{phase: _signed(r.get(f"{phase}_vs_predicted")) for phase in PHASES},
                  "error": _percent(r.get("error"), r.get("excluded_from_target"))} for r in extra_rows]
        print(f"\n{name}:\n" + table(shown, EXTRA_COLUMNS[name]))
    print("\ncalibration (measured in this run):\n  " + "\n  ".join(calibration["summary"]))
    missed = misses(dicts) + [line for name, extra_rows in extras.items() for line in misses(extra_rows, "split")]
    print(f"\npredictions outside {TARGET:.0%} or excluded: " + ("none" if not missed else "\n" + "\n".join(missed)))
    refused = bench_refusals(rig)
    if refused:
        print("\nnot run on this rig:\n" + "\n".join(f"  {s} ({e}): {why}" for (s, e), why in refused.items()))
    print("\n" + load.describe())
    print("\ncolumns:\n" + LEGEND + "\n" + EXTRA_LEGEND)
    print(f"\nwrote {ns.out}/bench.json and {len(rows)} timeline PNGs")


class MachineLoad:
    """CPU time other processes used while the bench ran (Linux: /proc/stat minus this process and its children):
    on a shared machine they slow some measurements and not others, and the predictions' errors say so."""

    def __init__(self):
        import os
        import time

        self.t0, self.busy0, self.mine0 = time.perf_counter(), self._busy(), self._mine()
        self.cores = os.cpu_count() or 1
        self.elapsed = self.foreign = None

    @staticmethod
    def _busy() -> float | None:
        import os

        try:
            with open("/proc/stat") as f:
                values = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return (sum(values) - values[3] - values[4]) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _mine() -> float:
        import os

        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def stop(self) -> None:
        import time

        self.elapsed = time.perf_counter() - self.t0
        busy = self._busy()
        if busy is not None and self.busy0 is not None:
            self.foreign = max(0.0, (busy - self.busy0) - (self._mine() - self.mine0))

    @property
    def share(self) -> float | None:
        return self.foreign / (self.elapsed * self.cores) if self.foreign is not None and self.elapsed else None

    def record(self) -> dict:
        return {"seconds": self.elapsed, "other_processes_cpu_s": self.foreign, "cores": self.cores,
                "share_of_machine": self.share}

    def describe(self) -> str:
        if self.share is None:
            return "machine load: not measured (needs /proc/stat)"
        line = (f"machine load: other processes used {self.foreign:.0f} CPU-s of the {self.elapsed * self.cores:.0f} "
                f"this run's {self.elapsed:.0f} s offered on {self.cores} cores ({self.share:.0%})")
        if self.share > 0.05:
            line += ("; they slowed some measurements and not others, so errors above a few percent may be theirs: "
                     "rerun on a quiet machine")
        return line


def calibration_record(rig_model, calibrated: dict) -> dict:
    """What the predictions were calibrated from, for bench.json and the printout."""
    summary = rig_model.describe() + [
        f"micro-batch {b}: whole model {c.forward_s * 1e3:.1f} ms forward + {c.backward_s * 1e3:.1f} ms backward, "
        f"{c.stream_factor:.2f}x the per-layer profile's sum" for b, c in sorted(calibrated.items())]
    return {"summary": summary,
            "links": {"p2p": [rig_model.p2p.latency_s, rig_model.p2p.bandwidth],
                      **{kind: [getattr(rig_model.collectives, kind).latency_s,
                                getattr(rig_model.collectives, kind).bandwidth]
                         for kind in ("allreduce", "allgather", "reducescatter", "broadcast")}},
            "copy_bandwidth": rig_model.copy_bandwidth, "fsdp2_host_s": rig_model.fsdp2_host_s,
            "slowdown": {"threads": getattr(rig_model.thread_cores, "slowdown", None),
                         "processes": getattr(rig_model.process_cores, "slowdown", None)},
            "whole_model_s": {b: [c.forward_s, c.backward_s] for b, c in calibrated.items()},
            "stream_factor": {b: c.stream_factor for b, c in calibrated.items()}}


EXTRA_COLUMNS = {
    "splits": ["split", "boundaries", "step (ms)", "samples/s", "spread", "predicted", "error", "forward",
               "backward", "speedup", "busy", "predicted slowest/mean"],
    "checkpointing": ["split", "step (ms)", "samples/s", "spread", "predicted", "error", "forward", "backward",
                      "step vs none", "activations"],
}
EXTRA_LEGEND = """\
splits       notebook 02's four 2-stage splits of a non-uniform model, each a 4-micro-batch GPipe pipeline on
             threads: boundaries = first layer of stage 2; speedup vs one device; busy = compute share of the step
             per device; predicted slowest/mean = the slowest stage's profiled cost over the mean
checkpointing  notebook 03's sweep: checkpoint every k-th block of a 2-stage GPipe pipeline (m=4, threads); step vs
             none = step time / the unchecked pipeline's; activations = peak saved activations per device
             (predicted and error as above)"""


def training_curve(run: PipelineRun, data, steps: int, batch: int) -> list[float]:
    """Losses of `steps` optimizer steps of a pipeline run on consecutive batches of `data`."""
    losses = []
    for i in range(steps):
        x, y = data.batch(i, batch)
        losses.append(run.step(x, y).item())
    return losses


def _predict_threaded(rows: list[dict], runs: Sequence[PipelineRun], times: dict, workload, batch: int, m: int,
                      rig_model, checkpoints: Sequence[Sequence[int]] | None = None) -> None:
    """Add predicted samples/s, the error and the compute's drift (`compute_drift`) to `run_rows` rows of threaded
    GPipe runs."""
    from helpers.simulate import Job, simulate

    for i, (row, run) in enumerate(zip(rows, runs)):
        job = Job("gpipe", batch, microbatches=m, stages=2, cut=tuple(run.boundaries),
                  checkpoint=tuple(checkpoints[i]) if checkpoints else False)
        sim = simulate(workload, job, rig_model.threads_link, cores=rig_model.thread_cores)
        step = sim.step_s + _caller_seconds(run)
        row["predicted_samples_per_s"] = batch / step
        row["error"] = times[run.name] / step - 1
        row.update({f"{phase}_vs_predicted": compute_drift("gpipe", phase, median_phases(run.phases),
                                                           phase_seconds(sim.events)) for phase in PHASES})
        row["excluded_from_target"] = None
        row["core_slowdown"] = getattr(rig_model.thread_cores, "slowdown", None)


def calibration_samplers(timer, microbatch: int, rig) -> dict[str, Callable[[], None]]:
    """The calibration timed in the same interleaved rounds as a section's threaded runs: the whole model at
    `microbatch`, and on the CPU rig two copies of it at once (the busy-core slowdown of those minutes)."""
    if timer is None:
        return {}
    together = {"calibration: two copies at once": timer.together_sampler(microbatch)} if rig.is_cpu else {}
    return {"calibration: whole model": timer.sampler(microbatch), **together}


def split_comparison_rows(rig, quick: bool = False, rig_model=None, progress: bool | Progress = False,
                          repeats: int | None = None) -> list[dict]:
    """Notebook 02's four splits of the non-uniform model, each trained as a 4-micro-batch GPipe pipeline and timed
    against one device in the same interleaved rounds; with `rig_model` (a `RigModel` of this run), each row's
    prediction from the same per-layer profile the splits were chosen on."""
    from helpers.models import SyntheticTokens, build_stack, nonuniform_config
    from helpers.partition import compare_splits
    from helpers.profile import profile_layers
    from helpers.simulate.calibrate import WholeModelTimer

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    progress.phase("splits of a non-uniform model (notebook 02)")
    batch, m, repeats = (16, 4, 2) if quick else (32, 4, repeats or 6)
    cfg = nonuniform_config(1 if rig.is_cpu else 4)
    model = build_stack(cfg).to(rig.devices[0])
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    prof = profile_layers(model, x[:batch // m], repeats=repeats, loss_fn=lm_loss, target=y[:batch // m])
    splits = compare_splits(prof.costs("time"), prof.costs("params"), prof.memory_bytes())
    runs = [make_pipeline_run(name, model, s.boundaries, rig.devices, rig.labels, "gpipe", m)
            for name, s in splits.items()]

    timer = WholeModelTimer(copy.deepcopy(model), x, y, lm_loss) if rig_model is not None else None
    calibration = calibration_samplers(timer, batch // m, rig)
    times = time_pipeline_runs(runs, x, y, repeats, extra={"one device": one_device_step(model, x, y, lm_loss),
                                                           **calibration}, progress=progress.bars)
    rows = run_rows(runs, times, batch, baseline="one device")
    for row, split in zip(rows, splits.values()):
        row["predicted slowest/mean"] = split.imbalance
    if rig_model is not None:
        from helpers.simulate import Workload

        fwd, bwd = timer.seconds(batch // m)
        workload = Workload.from_profile(prof).rescaled(fwd / (batch // m), bwd / (batch // m))
        _predict_threaded(rows, runs, times, workload, batch, m, rig_model.with_thread_slowdown(timer.slowdown()))
    return rows


def checkpoint_sweep_rows(rig, quick: bool = False, rig_model=None, progress: bool | Progress = False,
                          repeats: int | None = None) -> list[dict]:
    """Notebook 03's sweep: checkpoint every k-th block of a 2-stage GPipe pipeline; step time and saved
    activations per device; with `rig_model`, each row's prediction (the simulator recomputes the checkpointed
    blocks' forward in backward) from one profile of the unchecked model."""
    from helpers.checkpointing import checkpoint_layers, every_kth
    from helpers.models import SyntheticTokens, build_stack

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    progress.phase("activation checkpointing sweep (notebook 03)")
    batch, m, repeats = (16, 4, 2) if quick else (32, 4, repeats or 6)
    cfg = StackConfig(hidden=256 if rig.is_cpu else 1024, n_blocks=8, seq_len=32)
    model = build_stack(cfg).to(rig.devices[0])
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    blocks = list(range(1, cfg.n_blocks + 1))
    variants = {"none": [], **{f"every {k}": every_kth(blocks, k) for k in (4, 2, 1)}}
    runs = [make_pipeline_run(name, checkpoint_layers(model, which), [len(model) // 2], rig.devices, rig.labels,
                              "gpipe", m) for name, which in variants.items()]
    from helpers.simulate.calibrate import WholeModelTimer, measure_workload

    timer = WholeModelTimer(copy.deepcopy(model), x, y, lm_loss) if rig_model is not None else None
    calibration = calibration_samplers(timer, batch // m, rig)
    times = time_pipeline_runs(runs, x, y, repeats, extra=calibration, progress=progress.bars)
    rows = run_rows(runs, times, batch, baseline="none")
    for row in rows:
        row["step vs none"] = times[row["split"]] / times["none"]
    if rig_model is not None:
        workload = measure_workload(model, x, y, lm_loss, batch // m, repeats, whole=timer.seconds(batch // m)).workload
        _predict_threaded(rows, runs, times, workload, batch, m, rig_model.with_thread_slowdown(timer.slowdown()),
                          list(variants.values()))
    return rows


if __name__ == "__main__":
    main()
