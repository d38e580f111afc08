"""The bench's extras: notebook 02's splits of a non-uniform model and notebook 03's checkpointing sweep, each a
table of threaded GPipe pipelines timed against their baseline and predicted."""
from __future__ import annotations

import copy
from typing import Sequence

from helpers.bench.blocks import (PipelineRun, make_pipeline_run, model_and_batch, one_device_step, run_rows,
                                  time_pipeline_runs)
from helpers.bench.report import shown_strategy
from helpers.bench.rows import Progress, _caller_seconds, calibration_samplers, compute_drift
from helpers.models import StackConfig, lm_loss
from helpers.timeline import PHASES, median_phases, median_span_s, phase_seconds


def _predict_threaded(rows: list[dict], runs: Sequence[PipelineRun], times: dict, workload, batch: int, m: int,
                      rig_model, checkpoints: Sequence[Sequence[int]] | None = None) -> None:
    """Add predicted samples/s, the error and the compute's drift (`compute_drift`) to `run_rows` rows of threaded
    GPipe runs."""
    from helpers.simulate import Job, simulate

    for i, (row, run) in enumerate(zip(rows, runs)):
        job = Job("gpipe", batch, microbatches=m, pp=2, boundaries=tuple(run.boundaries),
                  activation_checkpointing=tuple(checkpoints[i]) if checkpoints else False)
        sim = simulate(workload, job, rig_model.threads_link, cores=rig_model.thread_cores)
        step = sim.step_s + _caller_seconds(run)
        row["predicted_samples_per_s"] = batch / step
        row["error"] = times[run.name] / step - 1
        row.update({f"{phase}_vs_predicted": compute_drift("gpipe", phase, median_phases(run.phases),
                                                           phase_seconds(sim.events)) for phase in PHASES})
        row["excluded_from_target"] = None
        row["core_slowdown"] = getattr(rig_model.thread_cores, "slowdown", None)


def split_comparison_rows(rig, quick: bool = False, rig_model=None, progress: bool | Progress = False,
                          repeats: int | None = None) -> list[dict]:
    """Notebook 02's four splits of the non-uniform model, each trained as a 4-micro-batch GPipe pipeline and timed
    against one device in the same interleaved rounds; with `rig_model` (a `RigModel` of this run), each row's
    prediction from the same per-layer profile the splits were chosen on."""
    from helpers.models import nonuniform_config
    from helpers.partition import compare_splits
    from helpers.profile import profile_layers
    from helpers.simulate.calibrate_model import WholeModelTimer

    progress = progress if isinstance(progress, Progress) else Progress(progress)
    progress.phase("splits of a non-uniform model (notebook 02)")
    batch, m, repeats = (16, 4, 2) if quick else (32, 4, repeats or 6)
    model, x, y = model_and_batch(nonuniform_config(1 if rig.is_cpu else 4), batch, rig.devices[0])
    prof = profile_layers(model, x[:batch // m], repeats=repeats, loss_fn=lm_loss, target=y[:batch // m])
    splits = compare_splits(prof.costs("time"), prof.costs("params"), prof.memory_bytes())
    runs = [make_pipeline_run(name, model, s.boundaries, rig.devices, rig.labels, "gpipe", m)
            for name, s in splits.items()]

    timer = WholeModelTimer(copy.deepcopy(model), x, y, lm_loss) if rig_model is not None else None
    calibration = calibration_samplers(timer, [batch // m], rig)
    times = time_pipeline_runs(runs, x, y, repeats, extra={"one device": one_device_step(model, x, y, lm_loss),
                                                           **calibration}, progress=progress.bars)
    rows = run_rows(runs, times, batch, baseline="one device")
    for row, split in zip(rows, splits.values()):
        row["predicted slowest/mean"] = split.imbalance
    if rig_model is not None:
        from helpers.simulate import Workload

        fwd, bwd = timer.seconds(batch // m)
        workload = Workload.from_profile(prof).rescaled(fwd / (batch // m), bwd / (batch // m))
        _predict_threaded(rows, runs, times, workload, batch, m, rig_model.with_core_slowdown(timer.slowdown()))
    return rows


def checkpoint_sweep_rows(rig, quick: bool = False, rig_model=None, progress: bool | Progress = False,
                          repeats: int | None = None) -> list[dict]:
    """Notebook 03's sweep: checkpoint every k-th block of a 2-stage GPipe pipeline; step time and saved
    activations per device; with `rig_model`, each row's prediction (the simulator recomputes the checkpointed
    blocks' forward in backward) from one profile of the unchecked model."""
    from helpers.activation_checkpointing import checkpoint_layers, every_kth
    progress = progress if isinstance(progress, Progress) else Progress(progress)
    progress.phase("activation checkpointing sweep (notebook 03)")
    batch, m, repeats = (16, 4, 2) if quick else (32, 4, repeats or 6)
    cfg = StackConfig(hidden=256 if rig.is_cpu else 1024, n_blocks=8, seq_len=32)
    model, x, y = model_and_batch(cfg, batch, rig.devices[0])
    blocks = list(range(1, cfg.n_blocks + 1))
    variants = {"none": [], **{f"every {k}": every_kth(blocks, k) for k in (4, 2, 1)}}
    runs = [make_pipeline_run(name, checkpoint_layers(model, which), [len(model) // 2], rig.devices, rig.labels,
                              "gpipe", m) for name, which in variants.items()]
    from helpers.simulate.calibrate_model import WholeModelTimer, measure_workload

    timer = WholeModelTimer(copy.deepcopy(model), x, y, lm_loss) if rig_model is not None else None
    calibration = calibration_samplers(timer, [batch // m], rig)
    times = time_pipeline_runs(runs, x, y, repeats, extra=calibration, progress=progress.bars)
    rows = run_rows(runs, times, batch, baseline="none")
    for row in rows:
        row["step vs none"] = times.paired_ratio(row["split"], "none")  # each round's pair: its minute cancels
    if rig_model is not None:
        workload = measure_workload(model, x, y, lm_loss, batch // m, repeats, whole=timer.seconds(batch // m)).workload
        _predict_threaded(rows, runs, times, workload, batch, m, rig_model.with_core_slowdown(timer.slowdown()),
                          list(variants.values()))
    return rows


SPLIT_TARGET = 1.1  # a split backward (input pass + weight pass) costs at most 1.1x a plain backward


def split_backward_rows(rows: Sequence) -> list[dict]:
    """What the split backward costs, per engine and device: in each engine's ZB-H1 row, the median input pass
    ("backward" spans) plus the median weight pass ("weight"), over the median backward of the same engine's 1F1B
    row (the same stages, the same micro-batches), from the rows' recorded steps, every launch's spans pooled (from
    the last launch alone the same ratio read 1.15x and 1.06x in the two runs of a pair); in CPU seconds of the
    thread that ran them (not stretched by other processes on the cores) and, beside it, in wall time. The first
    stage's input needs no gradient: its input pass is empty and its weight pass is its whole backward."""
    out = []
    by_key = {(r.strategy, r.engine, r.runner): r for r in rows if r.batched_weights == 1}
    for (strategy, engine, runner), split in by_key.items():
        plain = by_key.get(("1f1b", engine, runner))
        if strategy != "zbh1" or plain is None:
            continue
        plain_spans, split_spans = plain.recorded_events(), split.recorded_events()
        for device in sorted({e.device for e in split_spans if e.kind == "weight"}):
            cost = {how: (median_span_s(plain_spans, device, "backward", how == "cpu"),
                          median_span_s(split_spans, device, "backward", how == "cpu"),
                          median_span_s(split_spans, device, "weight", how == "cpu")) for how in ("cpu", "wall")}
            b, i, w = cost["cpu"]
            out.append({"engine": engine, "runner": runner, "device": device, "plain backward (ms)": b * 1e3,
                        "input pass (ms)": i * 1e3, "weight pass (ms)": w * 1e3,
                        "split / plain": (i + w) / b if b else None,
                        "wall: split / plain": sum(cost["wall"][1:]) / cost["wall"][0] if cost["wall"][0] else None})
    return out


def _step_parts(events, device: int) -> dict[str, float]:
    """Where one recorded data-parallel step of `device` went, in seconds of wall time: its forward and backward
    spans, of the backward the part its thread did not run (wall less the thread's CPU: the core went to the
    collectives' threads or the other rank, or the thread waited for the last bucket's collective, which the
    engines' backward returns after; CUDA spans carry no CPU time, so 0 there), the optimizer step, and the whole
    step (first span's start to last span's end)."""
    mine = [e for e in events if e.device == device]
    spans = {kind: [e for e in mine if e.kind == kind] for kind in ("forward", "backward", "optimizer")}
    return {"forward": sum(e.duration for e in spans["forward"]),
            "backward": sum(e.duration for e in spans["backward"]),
            "waited": sum(e.duration - e.cpu for e in spans["backward"] if e.cpu is not None),
            "optimizer": sum(e.duration for e in spans["optimizer"]),
            "step": max(e.end for e in mine) - min(e.start for e in mine)}


def data_parallel_rows(rows: Sequence) -> list[dict]:
    """Why a data-parallel row falls short of 2x, per device, from its recorded steps (each launch's, median): one
    device's step (with its optimizer) halved is the ideal; against it, the rank's forward and backward on half the
    batch, the part of that backward its thread did not run (on the CPU rig the collectives' threads run on the
    cores that compute, so an all-reduce overlapped with the backward still slows it; and the backward returns only
    when its last bucket is reduced), the optimizer step each rank runs (DDP: on every weight, as one device does;
    ZeRO-1 and FSDP2: on its half, ZeRO-1's with the broadcast of the updated half), and the rest of the step."""
    import statistics

    from helpers.catalog import names

    out = []
    for row in rows:
        if row.strategy not in names("data_parallel") or not row.reference_s or not row.launch_events:
            continue
        for device in sorted({e.device for e in row.recorded_events()}):
            parts = [_step_parts(events, device) for events in row.launch_events]
            median = {k: statistics.median(p[k] for p in parts) * 1e3 for k in parts[0]}
            named = {f"{k} (ms)": v for k, v in median.items() if k != "step"}
            out.append({"row": shown_strategy({"strategy": row.strategy, "wire": row.wire}),
                        "device": device, "one device / 2 (ms)": row.reference_s / 2 * 1e3,
                        "recorded step (ms)": median["step"], **named,
                        "rest (ms)": median["step"] - median["forward"] - median["backward"] - median["optimizer"]})
    return out
