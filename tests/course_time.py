"""What a learner reads in a notebook, and how long it takes: the model INSTRUCTORS.md's schedule is checked against.

A notebook's *core path* is every cell before its "Going further" (or "Optional") section, the exercises included;
the detail that does not fit a slot goes there or to docs/. The time model is deliberately plain, and stated in
INSTRUCTORS.md: technical prose read at 120 words a minute, code at 6 non-comment lines a minute (read, run, look at
the output), and 6 minutes per exercise (try, then the check cell).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
FURTHER = re.compile(r"^#{1,3} (Going further|Optional)\b", re.MULTILINE)
WORDS_PER_MINUTE = 120
CODE_LINES_PER_MINUTE = 6
MINUTES_PER_EXERCISE = 6


def notebook_id(path: Path) -> str:
    """'05' for 05_gpipe.ipynb, '06b' for 06b_beyond_1f1b.ipynb."""
    return path.name.split("_", 1)[0]


def _source(cell: dict) -> str:
    return "".join(cell["source"])


def core_cells(path: Path) -> list[dict]:
    """The cells before the notebook's "Going further" / "Optional" heading (all of them where it has none)."""
    cells = json.loads(path.read_text())["cells"]
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "markdown":
            match = FURTHER.search(_source(cell))
            if match:
                head = _source(cell)[:match.start()]
                return cells[:i] + ([{**cell, "source": [head]}] if head.strip() else [])
    return cells


def exercise_numbers(path: Path) -> list[int]:
    """The numbered items of the core path's "## Exercises" list."""
    for cell in core_cells(path):
        text = _source(cell)
        if cell["cell_type"] == "markdown" and "## Exercises" in text:
            return [int(n) for n in re.findall(r"^(\d+)\. ", text.split("## Exercises", 1)[1], re.MULTILINE)]
    return []


def learner_minutes(path: Path) -> float:
    """Minutes a learner needs for the core path, by the model in this module's docstring."""
    words = lines = 0
    for cell in core_cells(path):
        text = _source(cell)
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"\w+", text))
        else:
            lines += sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    return (words / WORDS_PER_MINUTE + lines / CODE_LINES_PER_MINUTE
            + MINUTES_PER_EXERCISE * len(exercise_numbers(path)))


if __name__ == "__main__":   # python -m tests.course_time: each notebook's core path, in minutes
    for notebook in NOTEBOOKS:
        print(f"{notebook_id(notebook):>3}  {learner_minutes(notebook):5.0f} min  {notebook.stem}")
