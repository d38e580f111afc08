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


def keep(source: str | Path, command: str, folder: Path = RECORDS_DIR) -> Path:
    """Copy a run's JSON into `folder` as <kind>-<commit>-<n>.json (n: the first number not taken), wrapped with
    what measured it: kind, commit, whether the tree had changes, and the command. Returns the record's path."""
    run = json.loads(Path(source).read_text())
    kind = kind_of(run)
    commit, changed = source_state()
    folder.mkdir(parents=True, exist_ok=True)
    n = 1
    while (path := folder / f"{kind}-{commit}-{n}.json").exists():
        n += 1
    record = {"kind": kind, "commit": commit, "uncommitted_changes": changed, "command": command, "run": run}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
