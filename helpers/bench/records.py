"""Run records: a bench or speed-bench run kept as data in data/bench/ (one JSON file a run, never edited), and
docs/benchmarks.md rendered from all of them.

`python -m helpers.bench --record` keeps a bench run; `python -m helpers.bench.records --keep FILE` keeps a run's
JSON written earlier (a bench.json, or a speed bench's `--json`); `python -m helpers.bench.records` renders the page.
The page is a function of the records alone (sorted, no clock read), so a test can render it again and compare."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORDS_DIR = ROOT / "data" / "bench"
PAGE = ROOT / "docs" / "benchmarks.md"
KINDS = ("bench", "speed")  # helpers.bench, helpers.inference.speed_bench


def kind_of(run: dict) -> str:
    """Which command wrote a run's JSON: the bench's carries its calibration, the speed bench's its speed rig."""
    if "calibration" in run and "rows" in run:
        return "bench"
    if "speed_rig" in run and "rows" in run:
        return "speed"
    raise ValueError("not a bench.json nor a speed bench --json file (no rows with a calibration or speed rig)")


def source_state() -> tuple[str, bool]:
    """The checkout's short commit and whether tracked files differ from it (a record says what code measured it)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short=7", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return "unknown", True


def command_line(prog: str, argv: list[str] | None) -> str:
    """The command as typed: `prog` and its arguments (this process's own when `argv` is None)."""
    import shlex
    import sys

    return " ".join([prog, *map(shlex.quote, sys.argv[1:] if argv is None else argv)])


def keep(source: str | Path, command: str, state: tuple[str, bool] | None = None,
         folder: Path = RECORDS_DIR) -> Path:
    """Copy a run's JSON into `folder` as <kind>-<commit>-<n>.json (n: the first number not taken), wrapped with
    what measured it: kind, commit, whether the tree had changes (`state`: `source_state()` when the run started;
    default: now), and the command. Returns the record's path."""
    run = json.loads(Path(source).read_text())
    kind = kind_of(run)
    commit, changed = state or source_state()
    folder.mkdir(parents=True, exist_ok=True)
    n = 1
    while (path := folder / f"{kind}-{commit}-{n}.json").exists():
        n += 1
    record = {"kind": kind, "commit": commit, "uncommitted_changes": changed, "command": command, "run": run}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_records(folder: Path = RECORDS_DIR) -> list[tuple[str, dict]]:
    """Every record in `folder` as (name, record), bench runs first, then speed-bench runs, each kind by name."""
    records = [(path.stem, json.loads(path.read_text())) for path in folder.glob("*.json")]
    return sorted(records, key=lambda item: (KINDS.index(item[1]["kind"]), item[0]))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    """Rows as a Markdown table, each cell as the bench's text tables print it."""
    from helpers.report import _cell

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(_cell(c, row.get(c)) for c in columns) + " |" for row in rows])


def provenance(name: str, record: dict) -> str:
    """Where a record came from: its file, the command and the commit (and whether the tree had changes)."""
    changed = " with uncommitted changes in the tree" if record["uncommitted_changes"] else ""
    return (f"### {name}\n`data/bench/{name}.json`: `{record['command']}` at commit {record['commit']}{changed}; "
            f"{record['run']['rig']}.")


def within_target(errors: list[float], target: float) -> str:
    """'18 of 19 predicted rows within 15%, mean absolute error 4.2%'."""
    inside = sum(abs(e) <= target for e in errors)
    return (f"{inside} of {len(errors)} predicted rows within {target:.0%}, mean absolute error "
            f"{sum(map(abs, errors)) / len(errors):.1%}") if errors else "no predicted rows"


def machine_load(run: dict) -> str:
    """How much of the machine other processes took while the bench ran (its calibration's `machine_load`)."""
    share = (run["calibration"].get("machine_load") or {}).get("share_of_machine")
    return "not measured" if share is None else f"other processes used {share:.0%} of the CPU while it ran"


def bench_section(name: str, record: dict) -> str:
    """One bench run: where it came from, the machine load, the verdict, the rows, the extras and the calibration."""
    from helpers.bench.predict import TARGET
    from helpers.bench.report import (EXTRA_SPEEDUPS, _percent, describe_launch_to_launch,
                                      display_rows, prediction_errors, row_label)

    run = record["run"]
    errors = [e for e in prediction_errors(run).values() if e is not None]
    parts = [provenance(name, record),
             f"Model {run['model']}, batch {run['batch']}. Machine load: {machine_load(run)}. "
             f"{within_target(errors, TARGET)} (the extras' included; rows excluded with a reason left out).",
             "In this run, " + describe_launch_to_launch(run["calibration"].get("launch_to_launch")) + ".",
             markdown_table(display_rows(run["rows"]), ["strategy", "engine", "runner", "m", "optimizer", "samples/s",
                                                         "spread", "predicted", "error", "speedup"])]
    for extra, ratio in EXTRA_SPEEDUPS.items():
        rows = [{"row": row_label(d), ratio: d.get(ratio), "error": _percent(d.get("error"), mark=False)}
                for d in run.get(extra, [])]
        parts += [f"{extra}:", markdown_table(rows, ["row", ratio, "error"])] if rows else []
    for extra in ("split backward", "data parallel"):  # tables of measured parts, no prediction
        rows = run.get(extra, [])  # in the columns the run wrote: a record is never rewritten to newer names
        parts += [f"{extra}:", markdown_table(rows, list(rows[0]))] if rows else []
    summary = run["calibration"].get("summary", [])
    return "\n\n".join(parts + ["Calibration (measured in the run):\n" + "\n".join(f"- {line}" for line in summary)])


def speed_section(name: str, record: dict) -> str:
    """One speed-bench run: where it came from, the model, the verdict, the rows and the per-engine summary."""
    from helpers.bench.predict import TARGET  # the speed bench holds its rows to the same 15%
    from helpers.bench.report import _percent

    run = record["run"]
    config = run["config"]
    model = ", ".join(f"{key} {config[key]}" for key in ("hidden_size", "num_hidden_layers", "vocab_size")
                      if key in config)
    rows = [{**row, "error": _percent(row["error"], mark=False)} for row in run["rows"]]
    summary = [{**row, "median error (absolute)": f"{row['median |error|']:.1%}",
                "largest error (absolute)": f"{row['max |error|']:.1%}"} for row in run["summary"]]
    verdict = within_target([row["error"] for row in run["rows"]], TARGET) + " (priced by the whole run's rounds)"
    return "\n\n".join([provenance(name, record),
                        f"Model: {model}. Machine load: not recorded by the speed bench. {verdict}.",
                        markdown_table(rows, ["engine", "phase", "batch", "prompt", "new_tokens", "tok/s",
                                              "predicted tok/s", "error"]),
                        markdown_table(summary, ["engine", "phase", "rows", "median error (absolute)",
                                                 "largest error (absolute)"])])


HEADER = """\
# Benchmark records

Every run kept in `data/bench/` (one JSON file a run, never edited), rendered by `python -m helpers.bench.records`.
Do not edit this page: change or add records and render it again (tests/test_house.py fails when it differs).
Keep a run with `python -m helpers.bench --record`, or `python -m helpers.bench.records --keep FILE` for a run's
JSON written earlier (a `bench.json`, or `python -m helpers.inference.speed_bench --json FILE`). What the columns
mean and how the bench measures: [bench.md](bench.md)."""


def render(folder: Path = RECORDS_DIR) -> str:
    """docs/benchmarks.md from every record in `folder`: a function of the records alone."""
    sections = {"bench": ("## Bench runs (`python -m helpers.bench`)", bench_section),
                "speed": ("## Speed bench runs (`python -m helpers.inference.speed_bench`)", speed_section)}
    parts = [HEADER]
    records = load_records(folder)
    for kind, (heading, section) in sections.items():
        mine = [section(name, record) for name, record in records if record["kind"] == kind]
        parts += [heading, *(mine or ["No record yet."])]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m helpers.bench.records",
                                     description=f"Render {PAGE.relative_to(ROOT)} from the run records in "
                                                 f"{RECORDS_DIR.relative_to(ROOT)}/, or keep a run's JSON as a record.")
    parser.add_argument("--keep", metavar="FILE", help="keep this run's JSON (a bench.json, or a speed bench's "
                                                       "--json file) as a record, then render")
    parser.add_argument("--command", help="with --keep: the command line that wrote FILE")
    ns = parser.parse_args(argv)
    if ns.keep and not ns.command:
        parser.error("--keep needs --command: the command line that wrote the file, kept with the record")
    if ns.keep:
        print(f"kept as {keep(ns.keep, ns.command)}")
    PAGE.write_text(render())
    print(f"wrote {PAGE.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
