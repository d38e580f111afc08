"""The house's written rules that a test can hold: README is a guide (no date or time of day, at most 450 lines) and
so are the library's docstrings; docs/benchmarks.md is what `python -m helpers.bench.records` renders from the run
records in data/bench/, and README's results tables quote those records."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers.bench.records import PAGE, RECORDS_DIR, keep, kind_of, load_records, render

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DATE = re.compile(r"\b(?:19|20)\d\d-[01]\d-[0-3]\d\b")  # 2026-12-05
CLOCK = re.compile(r"(?<![\d:.])[0-2]?\d:[0-5]\d(?::[0-5]\d)?(?![\d:])")  # 09:31, 9:31:05 (with or without UTC)
README_LINES = 450


def dated_lines(path: Path) -> list[str]:
    """'path:line: text' for every line of `path` holding a date or a clock time."""
    return [f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}"
            for n, line in enumerate(path.read_text().splitlines(), 1) if DATE.search(line) or CLOCK.search(line)]


def test_the_patterns_find_dates_and_times_and_nothing_else():
    for dated in ("measured on 2026-12-05", "at 09:31 UTC", "(03:46-04:27 UTC)", "pairs at 21:53", "9:05:59"):
        assert DATE.search(dated) or CLOCK.search(dated), dated
    for plain in ("cuda:0", "HOST_A:29500", "x[12:340]", "1.5-2.8 ms", "torch==2.13.0", "4096 x 1024", "m=8:"):
        assert not (DATE.search(plain) or CLOCK.search(plain)), plain


def test_readme_and_the_library_carry_no_date_or_time_of_day():
    """History (which run at which hour said what) lives in git and CHANGELOG.md; README and docstrings say what
    holds and why."""
    found = [line for path in [README, *sorted((ROOT / "helpers").rglob("*.py"))] for line in dated_lines(path)]
    assert not found, "dates or clock times (move the history to git or CHANGELOG.md):\n" + "\n".join(found)


def test_readme_is_a_guide_of_at_most_450_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines: move detail to docs/ and link it"


def test_readme_links_resolve():
    """Every relative link of README (docs/ pages, CHANGELOG.md, INSTRUCTORS.md, ...) names a file that exists."""
    targets = re.findall(r"\]\((?!https?:|#)([^)#\s]+)", README.read_text())
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert targets and not missing, missing


def test_benchmarks_page_is_rendered_from_the_records(tmp_path):
    rendered = tmp_path / "benchmarks.md"
    rendered.write_text(render())
    assert rendered.read_text() == PAGE.read_text(), "regenerate it: python -m helpers.bench.records"


def test_every_record_is_a_kept_run():
    records = load_records()
    assert {record["kind"] for _, record in records} == {"bench", "speed"}, "keep a bench and a speed-bench run"
    for name, record in records:
        assert name.startswith(f"{record['kind']}-{record['commit']}-") and kind_of(record["run"]) == record["kind"]
        assert record["command"].startswith("python -m helpers."), name


def test_readme_results_quote_the_records():
    """Each results table of README that names a record in data/bench/ shows that record's figures, as the rendered
    page shows them (a figure typed by hand, or a record removed, fails here)."""
    readme, page = README.read_text(), PAGE.read_text()
    results = readme[readme.index("## Results"):].split("\n## ", 1)[0]
    quoted = 0
    for part in results.split("\n### ")[1:]:
        named = re.findall(r"data/bench/((?:bench|speed)-\w+-\d+)\.json", part)
        if not named:
            continue
        record = page[page.index(f"### {named[0]}\n"):].split("\n### ", 1)[0]
        figures = [cell for line in part.splitlines() if line.startswith("|") and "---" not in line
                   for cell in re.findall(r"[-+±]?\d[\d,]*(?:\.\d+)?%?", line.split("|", 2)[2])]
        missing = [f for f in figures if f not in record]
        assert figures and not missing, f"README's table from {named[0]}: not in that record's section {missing}"
        prose = " ".join(part.split())  # its sentences as one line
        for count, rows, error in re.findall(r"(\d+) of (\d+) predicted rows within 15% \(mean absolute error "
                                             r"([\d.]+%)\)", prose):  # the verdict the prose quotes is the record's
            assert f"{count} of {rows} predicted rows within 15%, mean absolute error {error}" in record, named[0]
        for runs, count, rows, low, high in re.findall(r"in each of the (\w+) runs of that commit kept beside it, "
                                                       r"(\d+) of (\d+) \(mean ([\d.]+)-([\d.]+)%\)", prose):
            commit = named[0].rsplit("-", 1)[0]  # e.g. bench-e93a8d4: every record of that commit, rendered
            verdicts = re.findall(rf"### {commit}-\d+\n.*?(\d+ of \d+) predicted rows within 15%, mean absolute "
                                  r"error ([\d.]+)%", page, flags=re.S)
            assert len(verdicts) == ["one", "two", "three", "four", "five"].index(runs) + 1, commit
            assert {v for v, _ in verdicts} == {f"{count} of {rows}"}, verdicts
            means = sorted(float(m) for _, m in verdicts)
            assert (means[0], means[-1]) == (float(low), float(high)), verdicts
        quoted += 1
    assert quoted >= 2, "README's Results: one table from a bench record and one from a speed-bench record"


def test_keep_numbers_records_and_refuses_other_json(tmp_path):
    run = tmp_path / "bench.json"
    run.write_text('{"rig": "r", "rows": [], "calibration": {}}')
    first = keep(run, "python -m helpers.bench --quick", ("abc1234", False), folder=tmp_path / "records")
    second = keep(run, "python -m helpers.bench --quick", ("abc1234", False), folder=tmp_path / "records")
    assert (first.name, second.name) == ("bench-abc1234-1.json", "bench-abc1234-2.json")
    run.write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not a bench.json"):
        keep(run, "python -m helpers.bench", ("abc1234", False), folder=tmp_path / "records")
