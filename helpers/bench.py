"""Measure strategies side by side in one run: medians of interleaved repeats, ratios within the run.

The building blocks here serve the notebooks; `python -m helpers.bench` (see `main`) runs every strategy.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from helpers.measure import interleaved_medians
from helpers.memory import MemoryLedger, ledger_for
from helpers.models import StackConfig, lm_loss
from helpers.pipeline.stages import split_model
from helpers.pipeline.threaded import ThreadedPipeline
from helpers.timeline import Event, busy_fraction

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def one_device_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn = lm_loss,
                    optimizer: torch.optim.Optimizer | None = None) -> Callable[[], None]:
    """A closure running one training step of `model` on its own device: the baseline every ratio is taken to."""
    device = next(model.parameters()).device
    x, y = x.to(device), y.to(device)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        loss_fn(model(x), y).backward()
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
    split = split_model(copy.deepcopy(model), list(boundaries), devices)
    ledger = ledger_for(split.stages, labels[:len(split.stages)])
    pipe = ThreadedPipeline(split, schedule, microbatches, ledger, wire)
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[optimizer](split.parameters(), lr=lr)
    ledger.optimizer = opt
    return PipelineRun(name, pipe, ledger, tuple(boundaries), opt)


def time_pipeline_runs(runs: Sequence[PipelineRun], x: torch.Tensor, y: torch.Tensor, repeats: int = 5,
                       extra: dict[str, Callable[[], object]] | None = None) -> dict[str, float]:
    """Median step seconds of each run (and of any `extra` callables), timed in interleaved rounds; then one
    recorded step per run fills its `events` and its ledger's activation peaks."""
    fns = {r.name: (lambda r=r: r.step(x, y)) for r in runs}
    times = interleaved_medians({**(extra or {}), **fns}, repeats, progress=True)
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
                     "samples/s": batch / times[r.name],
                     **({"speedup": times[baseline] / times[r.name]} if baseline else {}),
                     "busy": [round(busy.get(i, 0.0), 2) for i in range(len(report))],
                     "params": [m.params for m in report.values()],
                     "activations": [m.activations for m in report.values()]})
    return rows


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


def ideal_step_time(events: Sequence[Event], m: int) -> float:
    """A pipeline's step time with free communication and no scheduling overhead, from the measured per-micro-batch
    stage costs c_s: sum(c_s) + (m - 1) * max(c_s) (fill, then the slowest stage sets the pace)."""
    costs = list(stage_costs_per_microbatch(events).values())
    return sum(costs) + (m - 1) * max(costs)


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

    def as_dict(self, batch: int, reference_s: float) -> dict:
        ideal = ideal_step_time(self.events, self.microbatches) if self.microbatches else None
        return {"strategy": self.strategy, "engine": self.engine, "runner": self.runner,
                "microbatches": self.microbatches, "optimizer": self.optimizer, "step_s": self.step_s,
                "samples_per_s": batch / self.step_s, "speedup": reference_s / self.step_s,
                "speedup_vs": self.reference, "ideal_fraction": ideal / self.step_s if ideal else None,
                "peak_activation_bytes": self.peak_activation_bytes}


BENCH_COLUMNS = ["strategy", "engine", "runner", "microbatches", "optimizer", "samples_per_s", "speedup",
                 "ideal_fraction", "peak_activation_bytes"]



@dataclass(frozen=True)
class BenchConfig:
    """What the bench runs. Defaults: the model of REFERENCE.md's measurements, sized for a 2-core CPU."""

    cfg: StackConfig
    batch: int
    steps: int
    gpipe_microbatches: tuple[int, ...]
    onefoneb_microbatches: int
    torch_microbatches: tuple[int, ...]
    rounds: int = 1  # launches of each multi-process job, interleaved across jobs


def default_config(quick: bool, rig) -> BenchConfig:
    scale = 1 if rig.is_cpu else 4
    if quick:
        return BenchConfig(StackConfig(hidden=256 * scale, n_blocks=4, seq_len=32), batch=16, steps=2,
                           gpipe_microbatches=(4,), onefoneb_microbatches=4, torch_microbatches=(4,), rounds=1)
    return BenchConfig(StackConfig(hidden=384 * scale, n_blocks=8, seq_len=32), batch=32, steps=4,
                       gpipe_microbatches=(2, 4, 8), onefoneb_microbatches=8, torch_microbatches=(8,), rounds=2)


def _single_row(model: nn.Module, x, y, loss_fn, steps: int, extra_runs: Sequence[PipelineRun] = ()):
    """One device, timed in the same interleaved rounds as the threaded pipelines."""
    from helpers.memory import measure_step_memory
    from helpers.timeline import Recorder

    rec = Recorder(0, x.device)  # CUDA events on GPUs: kernel time, not launch time
    adam_model = copy.deepcopy(model)
    adam = torch.optim.Adam(adam_model.parameters(), lr=1e-3)

    def one_device_step(m: nn.Module = model):
        m.zero_grad(set_to_none=False)
        with rec.span("forward", 0):
            loss = loss_fn(m(x), y)
        with rec.span("backward", 0):
            loss.backward()

    def one_device_adam_step():
        one_device_step(adam_model)
        adam.step()

    times = time_pipeline_runs(extra_runs, x, y, steps,
                               extra={"single": one_device_step, "single_adam": one_device_adam_step})
    peak = measure_step_memory(model, x, y, loss_fn, torch.optim.SGD(model.parameters(), lr=0.0)).activations
    rec.clear()
    one_device_step()
    events = rec.events()
    return times, [BenchRow("single", "none", "one thread", None, times["single"], events, [peak]),
                   BenchRow("single_adam", "none", "one thread", None, times["single_adam"], events, [peak],
                            optimizer="adam", reference="single_adam")]


def run_bench(config: BenchConfig, rig, progress: bool = True) -> list[BenchRow]:
    """Every pipeline strategy on this rig, side by side: one device, the naive split, our GPipe and 1F1B (threads
    in this process and one process per device), and torch.distributed.pipelining's GPipe and 1F1B."""
    from helpers.models import SyntheticTokens, build_stack
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_training

    if rig.is_cpu:
        torch.set_num_threads(rig.threads_per_device)
    model = build_stack(config.cfg).to(rig.devices[0])
    x, y = SyntheticTokens(config.batch, config.cfg.seq_len, config.cfg.vocab).batch(0, config.batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    cut = [len(model) // 2]
    threaded = [("gpipe", m) for m in config.gpipe_microbatches] + [("1f1b", config.onefoneb_microbatches)]
    runs = [make_pipeline_run(f"{s}-m{m}", model, cut, rig.devices, rig.labels, s, m) for s, m in threaded]
    times, rows = _single_row(model, x, y, lm_loss, config.steps, runs)
    for (s, m), r in zip(threaded, runs):
        rows.append(BenchRow(s, "ours", "threads", m, times[r.name], r.events,
                             [v.activations for v in r.ledger.report().values()]))
    jobs = [("naive", "ours", "gpipe", 1, False)]
    jobs += [("gpipe", "ours", "gpipe", m, True) for m in config.gpipe_microbatches]
    jobs += [("1f1b", "ours", "1f1b", config.onefoneb_microbatches, True)]
    jobs += [(s, "torch", s, m, True) for m in config.torch_microbatches for s in ("gpipe", "1f1b")]
    results = run_in_rounds(
        {j: (lambda j=j: run_training(TrainJob(config.cfg, pp=2, boundaries=tuple(cut), schedule=j[2],
                                               microbatches=j[3], batch=config.batch, engine=j[1], overlap=j[4],
                                               steps=config.steps), rig)) for j in jobs},
        config.rounds, "process pipelines", progress)
    for (strategy, engine, _, m, _), (step_s, res) in results.items():
        rows.append(BenchRow(strategy, engine, "processes", m, step_s, res.events, res.peak_activations))
    return rows + data_parallel_rows(config, rig, progress)


def run_in_rounds(launches: dict, rounds: int, desc: str, progress: bool = True) -> dict:
    """Launch every job once per round, in turn (a, b, c, a, b, c, ...), so a noisy minute hits all of them; return
    {key: (median step time pooled over all rounds, the last round's result)}."""
    import statistics

    from tqdm.auto import tqdm

    pooled: dict = {k: [] for k in launches}
    last: dict = {}
    bar = tqdm(total=rounds * len(launches), desc=desc, disable=not progress)
    for _ in range(rounds):
        for key, launch in launches.items():
            last[key] = launch()
            pooled[key].extend(last[key].step_times)
            bar.update()
    bar.close()
    return {k: (statistics.median(pooled[k]), last[k]) for k in launches}


def data_parallel_rows(config: BenchConfig, rig, progress: bool = True) -> list[BenchRow]:
    """DDP, ZeRO-1 and FSDP2 (Adam step included, compared with one device doing the same), and DP x PP."""
    from helpers.training.job import TrainJob
    from helpers.training.loop import run_training

    rows = []
    results = run_in_rounds({s: (lambda s=s: run_training(TrainJob(config.cfg, dp=2, data_parallel=s, batch=config.batch,
                                                                   steps=config.steps, optimizer="adam"), rig))
                             for s in ("ddp", "zero1", "fsdp2")}, config.rounds, "data parallel", progress)
    for strategy, (step_s, res) in results.items():
        rows.append(BenchRow(strategy, "torch", "processes", None, step_s, res.events,
                             [m.activations for m in res.memory], optimizer="adam", reference="single_adam"))
    if rig.is_cpu or torch.cuda.device_count() >= 4:
        m = config.onefoneb_microbatches // 2
        res = run_training(TrainJob(config.cfg, dp=2, pp=2, schedule="1f1b", microbatches=m, batch=config.batch,
                                    steps=config.steps), rig, oversubscribe=rig.is_cpu)
        rows.append(BenchRow("dp_x_pp", "ours", "processes (4 ranks)", m, res.step_s, res.events,
                             res.peak_activations))
    return rows


def write_results(rows: Sequence[BenchRow], config: BenchConfig, rig, out_dir,
                  extras: dict[str, list[dict]] | None = None) -> list[dict]:
    """bench.json (rig, rows, and any extra tables) and one timeline PNG per row in `out_dir`; returns the rows."""
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
    (out / "bench.json").write_text(json.dumps({"rig": rig.describe(), "batch": config.batch,
                                                "model": repr(config.cfg), "rows": dicts, **(extras or {})},
                                               indent=2))
    for r in rows:
        ax = plot_timeline(r.events, title=f"{r.strategy} ({r.engine}, {r.runner}, m={r.microbatches})")
        ax.figure.savefig(out / f"timeline_{r.strategy}_{r.engine}_{r.runner.replace(' ', '-')}_m{r.microbatches}.png",
                          dpi=90, bbox_inches="tight")
        plt.close(ax.figure)
    return dicts


def main(argv: list[str] | None = None) -> None:
    import argparse

    from helpers.report import table
    from helpers.runtime.rig import detect_rig

    parser = argparse.ArgumentParser(prog="python -m helpers.bench",
                                     description="Every strategy side by side on this rig, in one run.")
    parser.add_argument("--out", default="results", help="folder for bench.json and timeline PNGs")
    parser.add_argument("--quick", action="store_true", help="small model, few rows: a smoke test in <= 60 s")
    parser.add_argument("--cpu", action="store_true", help="force the CPU rig on a GPU machine")
    parser.add_argument("--skip-extras", action="store_true", help="skip the split comparison and checkpoint sweep")
    ns = parser.parse_args(argv)
    rig = detect_rig(force_cpu=ns.cpu or None)
    config = default_config(ns.quick, rig)
    print(rig.describe())
    rows = run_bench(config, rig)
    extras = {} if ns.skip_extras else {"splits": split_comparison_rows(rig, ns.quick),
                                        "checkpointing": checkpoint_sweep_rows(rig, ns.quick)}
    dicts = write_results(rows, config, rig, ns.out, extras)
    print(table(dicts, BENCH_COLUMNS))
    for name, extra_rows in extras.items():
        print(f"\n{name}:\n" + table(extra_rows))
    print(f"\nwrote {ns.out}/bench.json and {len(rows)} timeline PNGs")



def training_curve(run: PipelineRun, data, steps: int, batch: int) -> list[float]:
    """Losses of `steps` optimizer steps of a pipeline run on consecutive batches of `data`."""
    losses = []
    for i in range(steps):
        x, y = data.batch(i, batch)
        losses.append(run.step(x, y).item())
    return losses


def split_comparison_rows(rig, quick: bool = False) -> list[dict]:
    """Notebook 02's four splits of the non-uniform model, each trained as a 4-micro-batch GPipe pipeline and timed
    against one device in the same interleaved rounds."""
    from helpers.models import SyntheticTokens, build_stack, nonuniform_config
    from helpers.partition import compare_splits
    from helpers.profile import profile_layers

    batch, m, repeats = (16, 4, 2) if quick else (32, 4, 4)
    cfg = nonuniform_config(1 if rig.is_cpu else 4)
    model = build_stack(cfg).to(rig.devices[0])
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    x, y = x.to(rig.devices[0]), y.to(rig.devices[0])
    prof = profile_layers(model, x[:batch // m], repeats=repeats, loss_fn=lm_loss, target=y[:batch // m])
    splits = compare_splits(prof.costs("time"), prof.costs("params"), prof.memory_bytes())
    runs = [make_pipeline_run(name, model, s.boundaries, rig.devices, rig.labels, "gpipe", m)
            for name, s in splits.items()]

    times = time_pipeline_runs(runs, x, y, repeats, extra={"one device": one_device_step(model, x, y, lm_loss)})
    rows = run_rows(runs, times, batch, baseline="one device")
    for row, split in zip(rows, splits.values()):
        row["predicted slowest/mean"] = split.imbalance
    return rows


def checkpoint_sweep_rows(rig, quick: bool = False) -> list[dict]:
    """Notebook 03's sweep: checkpoint every k-th block of a 2-stage GPipe pipeline; step time and saved
    activations per device."""
    from helpers.checkpointing import checkpoint_layers, every_kth
    from helpers.models import SyntheticTokens, build_stack

    batch, m, repeats = (16, 4, 2) if quick else (32, 4, 4)
    cfg = StackConfig(hidden=256 if rig.is_cpu else 1024, n_blocks=8, seq_len=32)
    model = build_stack(cfg).to(rig.devices[0])
    x, y = SyntheticTokens(batch, cfg.seq_len, cfg.vocab).batch(0, batch)
    blocks = list(range(1, cfg.n_blocks + 1))
    variants = {"none": [], **{f"every {k}": every_kth(blocks, k) for k in (4, 2, 1)}}
    runs = [make_pipeline_run(name, checkpoint_layers(model, which), [len(model) // 2], rig.devices, rig.labels,
                              "gpipe", m) for name, which in variants.items()]
    times = time_pipeline_runs(runs, x, y, repeats)
    rows = run_rows(runs, times, batch, baseline="none")
    for row in rows:
        row["step vs none"] = times[row["split"]] / times["none"]
    return rows


if __name__ == "__main__":
    main()
