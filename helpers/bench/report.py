"""What the bench prints and writes: the table's columns and legend, bench.json with a timeline PNG and Perfetto trace
per row, and the lines that name each row outside the target."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

from helpers.bench.predict import TARGET
from helpers.bench.jobs import BenchConfig, bench_refusals
from helpers.bench.rows import BenchRow
from helpers.simulate.calibrate_model import plus_minus, spread_record
from helpers.timeline import PHASES, chrome_trace


BENCH_COLUMNS = ["strategy", "engine", "runner", "m", "optimizer", "samples/s", "spread", "predicted", "error",
                 "forward", "backward", "speedup", "peak_activation_bytes"]


EXTRA_COLUMNS = {
    "split backward": ["engine", "runner", "device", "plain backward (ms)", "input pass (ms)", "weight pass (ms)",
                       "split / plain", "wall: split / plain"],
    "splits": ["split", "boundaries", "step (ms)", "samples/s", "spread", "predicted", "error", "forward",
               "backward", "speedup", "busy", "predicted slowest/mean"],
    "data parallel": ["row", "device", "one device / 2 (ms)", "recorded step (ms)", "forward (ms)", "backward (ms)",
                      "waited (ms)", "optimizer (ms)", "rest (ms)"],
    "checkpointing": ["split", "step (ms)", "samples/s", "spread", "predicted", "error", "forward", "backward",
                      "step vs none", "activations"],
}


def legend() -> str:
    """The legend printed under the tables: the tables of docs/bench.md's "The columns" section (its one copy), each
    entry wrapped to 120 characters with its name in the margin."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "bench.md").read_text()
    start = text.index("### The columns")
    rows = [line.strip("| ").split(" | ", 1) for line in text[start:text.index("\n### ", start)].splitlines()
            if line.startswith("| ")]
    wrap = textwrap.TextWrapper(120, subsequent_indent=" " * 13, break_on_hyphens=False)
    return "\n".join(wrap.fill(f"{name:<11}  " + meaning.replace("`", "")) for name, meaning in rows
                     if name not in ("column", "table"))


def row_dicts(rows: Sequence[BenchRow], batch: int) -> list[dict]:
    """The rows as bench.json holds them, each speed-up taken against its one-device row, with the spread and count
    of the calibration readings it was priced with (`reading_spreads`)."""
    reference = {r.strategy: r.step_s for r in rows if r.engine == "none"}
    return [{**r.as_dict(batch, reference[r.reference]), "reading_spreads": reading_spreads(r)} for r in rows]


def reading_spreads(row: BenchRow) -> dict:
    """`spread_record` of each calibration reading a row was priced with: its busy-core slowdown, its receive post,
    FSDP2's host work, its whole model's forward and backward (None for a figure without a spread)."""
    whole = row.whole_model_s or (None, None)
    return {"core_slowdown": spread_record(row.core_slowdown), "receive_post_s": spread_record(row.receive_post_s),
            "fsdp2_host_s": spread_record(row.fsdp2_host_s), "whole_model_s": [spread_record(t) for t in whole]}


def write_results(rows: Sequence[BenchRow], config: BenchConfig, rig, out_dir,
                  extras: dict[str, list[dict]] | None = None, calibration: dict | None = None,
                  against: list[dict] | None = None) -> list[dict]:
    """bench.json (rig, rows, any extra tables, the calibration, the comparison with a previous run `against`) and
    per row one timeline PNG and the same timeline as a Chrome / Perfetto trace (timeline_*.json) in `out_dir`;
    returns the rows."""
    import json
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from helpers.timeline import plot_timeline

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dicts = row_dicts(rows, config.batch)
    refused = {f"{s} ({e})": why for (s, e), why in bench_refusals(rig).items()}
    (out / "bench.json").write_text(json.dumps({"rig": rig.describe(), "batch": config.batch,
                                                "model": repr(config.cfg), "rows": dicts, **(extras or {}),
                                                "calibration": calibration or {}, "not_run_here": refused,
                                                **({"against": against} if against is not None else {})}, indent=2))
    for r in rows:
        m = f", m={r.microbatches}" if r.microbatches else ""
        ax = plot_timeline(r.events, title=f"{r.strategy} ({r.engine}, {r.runner}{m})")
        ax.figure.savefig(out / timeline_name(r), dpi=90, bbox_inches="tight")
        plt.close(ax.figure)
        chrome_trace(r.events, (out / timeline_name(r)).with_suffix(".json"))  # for ui.perfetto.dev
    return dicts


def timeline_name(row: BenchRow) -> str:
    """timeline_<strategy>_<engine>_<runner>[_m<m>][_<wire>][_w<k>].png (one a row: k, the micro-batches a weight
    pass takes, where more than one), with only letters, digits, '-' and '_'."""
    import re

    parts = [row.strategy, row.engine, row.runner] + ([f"m{row.microbatches}"] if row.microbatches else []) + \
        ([row.wire] if row.wire != "auto" else []) + ([f"w{row.batched_weights}"] if row.batched_weights > 1 else [])
    return "timeline_" + "_".join(re.sub(r"[^A-Za-z0-9_]+", "-", p).strip("-") for p in parts) + ".png"


def _signed(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:+.0%}"


def _percent(error: float | None, excluded: str | None = None, mark: bool = True) -> str:
    """'+4.2%', with '*' (`mark`) where it is excluded or outside the target; '-' for none."""
    if error is None:
        return "-"
    return f"{error:+.1%}" + ("*" if mark and (excluded or abs(error) > TARGET) else "")


def display_rows(dicts: Sequence[dict]) -> list[dict]:
    """The printed table's rows: measured, predicted and the error side by side."""
    return [{"strategy": shown_strategy(d), "engine": d["engine"], "runner": d["runner"], "m": d["microbatches"],
             "optimizer": d["optimizer"], "samples/s": d["samples_per_s"], **prediction_cells(d),
             "speedup": d["speedup"], "peak_activation_bytes": d["peak_activation_bytes"]} for d in dicts]


def prediction_cells(d: dict) -> dict:
    """A row's (or an extra's row's) prediction as the tables print it: the spread, the predicted samples/s, the error
    ('*' outside the target or excluded) and how far its forward and backward passes drifted."""
    return {"spread": plus_minus(d.get("spread")), "predicted": d.get("predicted_samples_per_s"),
            "error": _percent(d.get("error"), d.get("excluded_from_target")),
            **{phase: _signed(d.get(f"{phase}_vs_predicted")) for phase in PHASES}}


def shown_strategy(d: dict) -> str:
    """A row's strategy as the table prints it: with the dtype its gradients cross the link in, where not their own
    ('ddp, bf16 grads'), and how many micro-batches its weight passes take at once, where more than one
    ('zbv, W x2')."""
    wire, batched = d.get("wire", "auto"), d.get("batched_weights", 1)
    return d["strategy"] + (f", {wire} grads" if wire != "auto" else "") + (f", W x{batched}" if batched > 1 else "")


def _drift_said(d: dict) -> str:
    """'; in its median step its forward passes took 4% longer ... than simulated', and for multi-process rows how
    much of the step the ranks' threads ran against how much the simulated devices computed (ran less: they waited
    longer than simulated; as much but the step is longer: each pass cost more CPU than calibrated), or ''."""
    said = [f"{phase} passes took {abs(x):.0%} {'longer' if x >= 0 else 'less time'}" for phase in PHASES
            if (x := d.get(f"{phase}_vs_predicted")) is not None]
    known = d.get("cpu_share") is not None and d.get("predicted_busy") is not None
    cpu = (f"; its ranks' threads ran {d['cpu_share']:.0%} of the step (CPU seconds over wall: the rest they "
           f"waited), the simulated devices computed {d['predicted_busy']:.0%}" if known else "")
    return (f"; in its median step its {' and '.join(said)} than simulated" if said else "") + cpu


def misses(dicts: Sequence[dict]) -> list[str]:
    """One line per row (or an extra's row) whose prediction is outside the target or excluded from it, with the
    reason; each row named by its `row_label`."""
    out = []
    for d in dicts:
        if d.get("excluded_from_target"):
            out.append(f"  {row_label(d)}: excluded from the target: {d['excluded_from_target']}")
        elif d.get("error") is not None and abs(d["error"]) > TARGET:
            spread = d.get("spread")
            noise = "" if spread is None else f"; the measured step times spread {plus_minus(spread)}"
            out.append(f"  {row_label(d)}: {d['error']:+.1%} (outside the {TARGET:.0%} target{noise}{_drift_said(d)})")
    return out


REPEAT_TOLERANCE = 0.05  # two runs in a row agree within 5% on every row's speed-up
EXTRA_SPEEDUPS = {"splits": "speedup", "checkpointing": "step vs none"}  # each extra table's ratio within the run


def row_label(d: dict) -> str:
    """A row's name across runs: strategy (or split), engine, runner and micro-batches."""
    m, wire, batched = d.get("microbatches"), d.get("wire", "auto"), d.get("batched_weights", 1)
    parts = [d.get("strategy") or d.get("split"), d.get("engine"), d.get("runner"), f"m={m}" if m else None,
             f"wire={wire}" if wire != "auto" else None, f"W x{batched}" if batched > 1 else None]
    return " ".join(str(p) for p in parts if p)


def prediction_errors(data: dict) -> dict[str, float | None]:
    """Every predicted row of a bench.json (`data`: its rows and the extras' rows, by `row_label`, extras prefixed
    with their table): predicted / measured - 1, None where the row is excluded from the target with a reason.
    The hook a check of the predictions' bound reads (e.g. every |error| <= TARGET, their mean <= 7%)."""
    tables = {"": data.get("rows", []), **{f"{name}: ": data.get(name, []) for name in EXTRA_SPEEDUPS}}
    return {prefix + row_label(d): (None if d.get("excluded_from_target") else d["error"])
            for prefix, dicts in tables.items() for d in dicts if d.get("error") is not None}


def launch_to_launch(dicts: Sequence[dict], tolerance: float = REPEAT_TOLERANCE) -> dict | None:
    """How far the same jobs moved between their own launches in one run (bench.json's rows), the floor of
    `--against`: a second run is only more launches. Per multi-process row, its slowest launch's median step over its
    fastest's, minus 1; and the one-device step the rows' speed-ups are taken against, timed beside the launches
    (each sample once: the rows of one launch share them), its fastest and slowest. None without a row of two
    launches or more."""
    import statistics

    spreads = {row_label(d): max(medians) / min(medians) - 1 for d in dicts
               if len(medians := [statistics.median(steps) for steps in d.get("launch_step_times_s") or []]) > 1}
    if not spreads:
        return None
    reference = list(dict.fromkeys(s for d in dicts for s in d.get("reference_samples_s") or []))
    worst = max(spreads, key=spreads.get)
    return {"rows": len(spreads), "median": statistics.median(spreads.values()), "largest": spreads[worst],
            "largest_row": worst, "within": sum(v <= tolerance for v in spreads.values()), "tolerance": tolerance,
            "one_device_s": [min(reference), statistics.median(reference), max(reference)] if reference else None}


def describe_launch_to_launch(summary: dict | None, run: str = "this run") -> str:
    """What `launch_to_launch` found in `run`, in a sentence."""
    if summary is None:
        return f"launch to launch ({run}): no row ran in two launches (--quick runs one)"
    low, median, high = summary["one_device_s"] or (None,) * 3
    reference = (f"; one device's step, timed beside the launches, {low * 1e3:.0f}-{high * 1e3:.0f} ms (median "
                 f"{median * 1e3:.0f})" if median else "")
    return (f"launch to launch ({run}): the same job's median step differed between its launches by a median "
            f"{summary['median']:.1%} (largest {summary['largest']:.1%}, {summary['largest_row']}; "
            f"{summary['within']} of {summary['rows']} multi-process rows within {summary['tolerance']:.0%}){reference}"
            f": a second run is more launches, and its rows can differ from this run's by as much")


def describe_against(compared: list[dict], previous: dict, path: str) -> str:
    """What `--against` prints: the comparison with the previous run (`describe_comparison`) and how far that run's
    own rows moved between their launches (`launch_to_launch`), the floor the comparison can show."""
    return describe_comparison(compared, path) + "\n" + describe_launch_to_launch(launch_to_launch(previous["rows"]),
                                                                                 path)


def _ratios(data: dict) -> dict[str, float]:
    """Each row's ratio within its run: the rows' speed-ups and the extras' (`EXTRA_SPEEDUPS`), by label."""
    out = {row_label(d): d["speedup"] for d in data.get("rows", []) if d.get("speedup") is not None}
    for name, key in EXTRA_SPEEDUPS.items():
        out.update({f"{name}: {row_label(d)}": d[key] for d in data.get(name, []) if d.get(key) is not None})
    return out


def compare_runs(now: dict, then: dict, tolerance: float = REPEAT_TOLERANCE) -> list[dict]:
    """This run's ratios (speed-ups, and the extras' ratios) beside a previous run's (`then`, its bench.json), row by
    row: now / then - 1 and whether it is within `tolerance`. Ratios within one run, not samples/s: the machine's
    speed may differ between the runs, the ratios should not."""
    before = _ratios(then)
    return [{"row": label, "now": ratio, "before": before[label], "difference": ratio / before[label] - 1,
             "within": abs(ratio / before[label] - 1) <= tolerance}
            for label, ratio in _ratios(now).items() if label in before]


def describe_comparison(compared: list[dict], path: str, tolerance: float = REPEAT_TOLERANCE) -> str:
    """The comparison's table and its verdict."""
    from helpers.report import table

    if not compared:
        return f"against {path}: no row in common"
    shown = [{**c, "difference": f"{c['difference']:+.1%}" + ("" if c["within"] else "*")} for c in compared]
    worst = max(compared, key=lambda c: abs(c["difference"]))
    outside = [c for c in compared if not c["within"]]
    verdict = (f"all {len(compared)} rows within {tolerance:.0%}" if not outside else
               f"{len(outside)} of {len(compared)} rows outside {tolerance:.0%}")
    return (f"against {path} (speed-ups and the extras' ratios, this run vs that one):\n"
            + table(shown, ["row", "now", "before", "difference"])
            + f"\n{verdict}; largest difference {worst['difference']:+.1%} ({worst['row']})")
