"""`python -m helpers.bench`: every strategy side by side on this rig in one run, each row with the simulator's
prediction calibrated in the same run; the extras; bench.json and the timelines."""
from __future__ import annotations

from helpers.bench.blocks import MachineLoad, model_and_batch
from helpers.bench.extras import (SPLIT_TARGET, checkpoint_sweep_rows, data_parallel_rows, split_backward_rows,
                                  split_comparison_rows)
from helpers.bench.predict import TARGET, calibration_record, microbatch_size, predict_rows
from helpers.bench.records import command_line, keep, source_state
from helpers.bench.report import (BENCH_COLUMNS, EXTRA_COLUMNS, compare_runs, describe_against,
                                  describe_launch_to_launch, display_rows, launch_to_launch, legend, misses,
                                  prediction_cells, row_dicts, write_results)
from helpers.bench.jobs import bench_refusals, default_config
from helpers.bench.rows import Progress, run_bench
from helpers.models import lm_loss


def parser():
    """The bench's flags."""
    import argparse

    out = argparse.ArgumentParser(prog="python -m helpers.bench",
                                  description="Every strategy side by side on this rig, in one run, each with the "
                                              "simulator's prediction calibrated in the same run. The default run: "
                                              "5 interleaved rounds of the threaded rows, every two-rank job in one "
                                              "launch per round (FSDP2 in one of its own), 2 rounds in opposite "
                                              "orders of 2 timed steps and the recorded step, timed too.")
    out.add_argument("--out", default="results", help="folder for bench.json and timeline PNGs")
    length = out.add_mutually_exclusive_group()
    length.add_argument("--quick", action="store_true",
                        help="smoke test: a smaller model (hidden 256, 4 blocks, batch 16), one micro-batch count, "
                             "3 repeats, 1 launch per job, a link sweep to 16 MiB; every kind of row still runs and "
                             "is predicted")
    length.add_argument("--precise", action="store_true",
                        help="every row (the default run leaves out the threaded rows past 1F1B, the naive split, "
                             "torch's GPipe, ZeRO-2 and DP x PP) and GPipe at m=2 and m=4, timed longer: 8 "
                             "interleaved rounds of the threaded rows, 3 launches of 6 steps of each multi-process "
                             "job, 6 repeats of the split comparison and checkpoint sweep")
    out.add_argument("--cpu", action="store_true", help="force the CPU rig on a GPU machine")
    out.add_argument("--skip-extras", action="store_true", help="skip the split comparison and checkpoint sweep")
    out.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    out.add_argument("--against", metavar="PATH",
                     help="a previous run's bench.json: print each row's speed-up (and the extras' ratios) beside "
                          "that run's, and whether all agree within 5%%")
    out.add_argument("--record", action="store_true",
                     help="also keep this run's bench.json as a record in data/bench/ (docs/benchmarks.md is "
                          "rendered from them: python -m helpers.bench.records)")
    return out


def main(argv: list[str] | None = None) -> None:
    """Measure, predict, write bench.json and the timelines, print the tables (and the comparison with --against),
    keep the record with --record."""
    ns = parser().parse_args(argv)
    previous = read_previous(ns.against) if ns.against else None
    started = source_state() if ns.record else None  # the code that measures, whatever is committed meanwhile
    progress = Progress(not ns.no_progress)
    load = MachineLoad()
    from helpers.runtime.rig import detect_rig

    rig = detect_rig(force_cpu=ns.cpu or None)
    config = default_config("quick" if ns.quick else "precise" if ns.precise else "default", rig)
    print(rig.describe(), flush=True)
    rows, extras, rig_model, calibrated = measure(config, rig, progress, ns.quick, ns.skip_extras)
    load.stop()
    calibration = {**calibration_record(rig_model, calibrated), "machine_load": load.record()}
    now = row_dicts(rows, config.batch)
    compared = compare_runs({"rows": now, **extras}, previous) if previous else None
    calibration["launch_to_launch"] = launch_to_launch(now)
    calibration["summary"] += run_summary(rows, extras)
    dicts = write_results(rows, config, rig, ns.out, extras, calibration, compared)
    print_tables(dicts, extras, calibration, rig)
    if compared is not None:
        print("\n" + describe_against(compared, previous, ns.against))
    print("\n" + load.describe())
    print(describe_launch_to_launch(calibration["launch_to_launch"]))
    print("\ncolumns:\n" + legend())
    print(f"\nwrote {ns.out}/bench.json and {len(rows)} timeline PNGs")
    if ns.record:
        print(f"kept as {keep(f'{ns.out}/bench.json', command_line('python -m helpers.bench', argv), started)}")


def measure(config, rig, progress: Progress, quick: bool, skip_extras: bool) -> tuple:
    """Every row, timed with the whole model beside it (`run_bench`); the rig calibrated (links, busy-core
    slowdown) and each row predicted from it; the extras. Returns the rows, the extras, the rig's model and the
    per-layer calibrations."""
    from helpers.simulate.calibrate import measure_rig
    from helpers.simulate.calibrate_model import WholeModelTimer

    device = rig.devices[0]
    timer = WholeModelTimer(*model_and_batch(config.cfg, config.batch, device), lm_loss)
    rows = run_bench(config, rig, progress, timer)

    progress.phase("calibrating: link benchmark (point-to-point, all-reduce) and busy-core slowdown")
    mb = min(microbatch_size(r, config.batch) for r in rows)
    rig_model = measure_rig(rig, *model_and_batch(config.cfg, mb, device), lm_loss, config.link_sizes)
    calibrated = predict_rows(rows, config, rig, rig_model, progress, timer)
    extras = {"split backward": split_backward_rows(rows), "data parallel": data_parallel_rows(rows)}
    if not skip_extras:
        extras |= {"splits": split_comparison_rows(rig, quick, rig_model, progress, config.extra_repeats),
                   "checkpointing": checkpoint_sweep_rows(rig, quick, rig_model, progress, config.extra_repeats)}
    return rows, extras, rig_model, calibrated


def run_summary(rows, extras: dict) -> list[str]:
    """The calibration summary's lines that this run's rows measured, each reading with its spread and count
    (`spread_said`): the busy-core slowdowns (threads, with each part of the run; processes, timed on both ranks
    inside their launches, one per micro-batch size the jobs compute at), what posting a receive cost in the
    pipelines' own launches (each row priced with its launches' median, in place of the link calibration's one
    reading) and FSDP2's host work in its rows' own (likewise), the one-device step's drift (`one_device_drift`)."""
    from helpers.simulate.calibrate_model import spread_said

    timed_with = {"the threaded rows": next((r.core_slowdown for r in rows if r.runner == "threads"), None),
                  **{name: extra_rows[0].get("core_slowdown") for name, extra_rows in extras.items() if extra_rows}}
    lines = [f"threads, timed with {name}: {s:.3g}x slower when both cores are busy{spread_said(s)}"
             for name, s in timed_with.items() if s is not None]
    if slowdowns := distinct([r.core_slowdown for r in rows if r.runner == "processes" and r.core_slowdown], 3):
        lines.append("processes, timed on both ranks in their launches: "
                     f"{' / '.join(f'{s:.3g}x{spread_said(s)}' for s in slowdowns)} slower when both cores are busy "
                     "(one per micro-batch size)")
    if posts := distinct([r.receive_post_s for r in rows if r.receive_post_s], 5):
        lines.append("pipelines on processes, posting a receive while both ranks compute, timed in their launches: "
                     f"{' / '.join(f'{s * 1e3:.2f} ms{spread_said(s)}' for s in posts)}; each row priced with its "
                     "launches' median")
    if hosts := distinct([r.fsdp2_host_s for r in rows if r.fsdp2_host_s is not None], 5):
        lines.append("rows on FSDP2's fully_shard, its host work per collective timed in their launches, at their "
                     f"micro-batch size: {' / '.join(f'{s * 1e3:.2f} ms{spread_said(s)}' for s in hosts)}; each row "
                     "priced with it in place of the calibration's")
    return lines + ([one_device_drift(rows)] if any(r.reference_s for r in rows) else [])


def distinct(readings: list[float], digits: int) -> list[float]:
    """`readings` without repeats (rows of one launch share theirs), equal to `digits` decimals, in increasing order;
    each kept as it was read, with its spread."""
    return sorted({round(s, digits): s for s in readings}.values())


def print_tables(dicts: list[dict], extras: dict, calibration: dict, rig) -> None:
    """The rows' table, each extra's, the calibration's summary, the predictions that missed, what the rig
    refused."""
    from helpers.report import table

    print(table(display_rows(dicts), BENCH_COLUMNS))
    for name, extra_rows in extras.items():
        shown = [{**r, **prediction_cells(r), "split / plain": _times(r.get("split / plain"), SPLIT_TARGET),
                  "wall: split / plain": _times(r.get("wall: split / plain"))} for r in extra_rows]
        print(f"\n{name}:\n" + table(shown, EXTRA_COLUMNS[name]))
    print("\ncalibration (measured in this run):\n  " + "\n  ".join(calibration["summary"]))
    missed = misses(dicts) + [line for extra_rows in extras.values() for line in misses(extra_rows)]
    print(f"\npredictions outside {TARGET:.0%} or excluded: " + ("none" if not missed else "\n" + "\n".join(missed)))
    refused = bench_refusals(rig)
    if refused:
        print("\nnot run on this rig:\n" + "\n".join(f"  {s} ({e}): {why}" for (s, e), why in refused.items()))


def one_device_drift(rows) -> str:
    """The one-device step in the threaded rounds against its median around the multi-process launches: how much
    the machine's speed moved between the two parts of the run (what timing the reference around each row's launches
    removes)."""
    import statistics

    single = next(r.step_s for r in rows if r.strategy == "single")
    between = statistics.median(r.reference_s for r in rows if r.reference_s and r.optimizer == "none")
    return (f"one device: {single * 1e3:.0f} ms a step in the threaded rounds, {between * 1e3:.0f} ms around the "
            f"multi-process launches ({between / single - 1:+.1%}); each row's speed-up uses its own minutes'")


def read_previous(path: str) -> dict:
    """A previous run's bench.json, read before anything runs (a wrong path stops the run at once)."""
    import json
    from pathlib import Path

    file = Path(path)
    file = file / "bench.json" if file.is_dir() else file
    if not file.is_file():
        raise SystemExit(f"--against {path}: no bench.json there (give a previous run's bench.json or its folder)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise SystemExit(f"--against {path}: not a bench.json ({err})") from None
    if "rows" not in data:
        raise SystemExit(f"--against {path}: not a bench.json (no rows)")
    return data


def _times(ratio: float | None, target: float | None = None) -> str:
    """'1.03x', with '*' past `target`; '-' for none."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}x" + ("*" if target is not None and ratio > target else "")
