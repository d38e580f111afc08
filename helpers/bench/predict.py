"""The bench's predictions: each row's job on the simulator (`helpers.simulate`), calibrated in the same run (per-layer
profiles rescaled to the whole model timed with the row, the links, core sharing), and how a row's passes drifted
from the simulated ones."""
from __future__ import annotations

from typing import Sequence

from helpers.bench.blocks import bench_cut, model_and_batch
from helpers.bench.jobs import BenchConfig
from helpers.bench.rows import BenchRow, Progress
from helpers.catalog import strategy as catalog_entry
from helpers.models import lm_loss
from helpers.timeline import phase_seconds


TARGET = 0.15  # every prediction within 15% of what was measured, rows excluded with a reason aside


# --- predictions: the simulator, calibrated in the same run ------------------------------------------------------

def microbatch_size(row: BenchRow, batch: int) -> int:
    """Samples one device computes at a time in `row`: the global batch split over replicas and micro-batches."""
    return simulation_job(row, batch).samples_per_microbatch


def simulation_job(row: BenchRow, batch: int, boundaries: Sequence[int] = ()):
    """The simulator's Job for a bench row: the same strategy on two devices per dimension (DP x PP: 2 x 2, 1F1B);
    the catalog's entry of "single_adam" is one device's."""
    from helpers.simulate import Job

    entry = catalog_entry("single" if row.strategy == "single_adam" else row.strategy)
    if entry.kind == "single":
        return Job("single", batch)
    return Job(entry.name, batch, microbatches=row.microbatches or 1,
               boundaries=tuple(boundaries) or None if entry.pipeline else None, wire=row.wire,
               batched_weights=row.batched_weights)


def predict_row(row: BenchRow, workload, rig_model, batch: int, boundaries: Sequence[int] = (),
                adam_s: float = 0.0, cores: int | None = None):
    """The simulated step of `row`: its job on `workload` (costs at the row's micro-batch size), the row's links and
    core sharing from `rig_model`, plus the work its calling thread does around the engine (`row.caller_s`).
    Rows with Adam run it on every rank (`adam_s`: one device's Adam step over the whole model). Returns the
    Simulation; `row.predicted_s` is set."""
    from dataclasses import replace

    if row.optimizer == "adam" and row.engine != "none":
        workload = replace(workload, optimizer_s=adam_s)
    engine = "threads" if row.runner in ("threads", "one thread") else "processes"
    sim = rig_model.simulate(workload, simulation_job(row, batch, boundaries), engine)
    row.predicted_s = sim.step_s + row.caller_s
    row.predicted_phase_s = phase_seconds(sim.events)
    row.predicted_busy = sum(sim.busy.values()) / len(sim.busy) if sim.busy else None
    return sim


def predict_rows(rows: Sequence[BenchRow], config: BenchConfig, rig, rig_model, progress: Progress,
                 timer=None) -> dict:
    """Give every row its predicted step time, from this run's per-layer profiles (one per micro-batch size the rows
    use: `measure_workload`), each rescaled to the whole model's time sampled with the row (`timer`, under its
    `calibration_key`), link fits and core sharing; returns the calibrations by micro-batch size (rescaled to all of
    `timer`'s samples)."""
    from helpers.simulate.calibrate_model import measure_workload

    model, x, y = model_and_batch(config.cfg, config.batch, rig.devices[0])
    sizes = sorted({microbatch_size(r, config.batch) for r in rows}, reverse=True)
    progress.phase(f"calibrating: per-layer profile and whole-model time at micro-batch sizes {sizes}")
    calibrated, bar = {}, progress.bar(len(sizes), "profiles")
    for b in sizes:
        calibrated[b] = measure_workload(model, x, y, lm_loss, b, 3, whole=timer.seconds(b) if timer else None)
        bar.update()
    bar.close()
    adam_s = next((r.optimizer_s for r in rows if r.strategy == "single_adam"), 0.0)
    for row in rows:
        size = microbatch_size(row, config.batch)
        workload, row.whole_model_s = calibrated[size].workload, (calibrated[size].forward_s,
                                                                  calibrated[size].backward_s)
        row_rig = rig_model
        if timer is not None and row.calibration_key is not None:
            row.whole_model_s = timer.seconds(size, row.calibration_key)
            workload = workload.rescaled(*(t / size for t in row.whole_model_s))
            if row.runner in ("threads", "processes"):  # two devices' busy cores, timed in the row's minutes
                row_rig = rig_model.with_core_slowdown(timer.slowdown(row.calibration_key), row.runner)
                row.core_slowdown = getattr(row_rig.thread_cores if row.runner == "threads"
                                            else row_rig.process_cores, "slowdown", None)
            if row.runner == "processes":  # posting a receive and FSDP2's host work, measured in the row's launches
                row.receive_post_s = timer.launch_reading("receive_post_s", row.calibration_key)
                row.fsdp2_host_s = timer.launch_reading("fsdp2_host_s", row.calibration_key)
                row_rig = row_rig.with_receive_post(row.receive_post_s).with_fsdp2_host(
                    row.fsdp2_host_s and row.fsdp2_host_s.at_least(0.0))
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


def calibration_record(rig_model, calibrated: dict) -> dict:
    """What the predictions were calibrated from, for bench.json and the printout; each reading's spread and count
    beside it (`spreads`: None for a figure not measured as a `Reading`)."""
    from helpers.simulate.calibrate_model import spread_record, spread_said

    summary = rig_model.describe() + [
        f"micro-batch {b}: whole model {c.forward_s * 1e3:.1f} ms forward{spread_said(c.forward_s)} + "
        f"{c.backward_s * 1e3:.1f} ms backward{spread_said(c.backward_s)}, {c.stream_factor:.2f}x the per-layer "
        "profile's sum" for b, c in sorted(calibrated.items())]
    slowdowns = {"threads": getattr(rig_model.thread_cores, "slowdown", None),
                 "processes": getattr(rig_model.process_cores, "slowdown", None)}
    return {"summary": summary,
            "links": {"p2p": [rig_model.p2p.latency_s, rig_model.p2p.bandwidth],
                      "p2p_receive_s": rig_model.p2p.receive_s,
                      **{kind: [getattr(rig_model.collectives, kind).latency_s,
                                getattr(rig_model.collectives, kind).bandwidth]
                         for kind in ("allreduce", "allgather", "reducescatter", "broadcast")}},
            "copy_bandwidth": rig_model.copy_bandwidth, "fsdp2_host_s": rig_model.fsdp2_host_s,
            "split_overhead": rig_model.split_overhead,
            "slowdown": slowdowns,
            "whole_model_s": {b: [c.forward_s, c.backward_s] for b, c in calibrated.items()},
            "stream_factor": {b: c.stream_factor for b, c in calibrated.items()},
            "spreads": {"fsdp2_host_s": spread_record(rig_model.fsdp2_host_s),
                        "split_overhead": spread_record(rig_model.split_overhead),
                        "slowdown": {engine: spread_record(s) for engine, s in slowdowns.items()},
                        "whole_model_s": {b: [spread_record(c.forward_s), spread_record(c.backward_s)]
                                          for b, c in calibrated.items()}}}
