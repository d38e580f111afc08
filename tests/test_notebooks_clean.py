"""Notebooks are committed with outputs stripped and named NN_topic.ipynb in course order."""
import importlib
import json
import re
from pathlib import Path

from tests.course_time import core_cells, exercise_numbers, learner_minutes, notebook_id

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS


def test_outputs_are_stripped():
    dirty = []
    for path in NOTEBOOKS:
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            if cell["cell_type"] == "code" and (cell.get("outputs") or cell.get("execution_count")):
                dirty.append(path.name)
                break
    assert not dirty, f"strip outputs before committing: {dirty} (jupyter nbconvert --clear-output --inplace)"


def test_names_are_numbered_in_order():
    """NN_topic.ipynb, numbered 00, 01, ... in order; a letter after the number (06b) adds a notebook after NN."""
    numbers = [re.match(r"(\d\d)([a-z]?)_[a-z0-9_]+\.ipynb$", p.name).groups() for p in NOTEBOOKS]
    main = [int(n) for n, letter in numbers if not letter]
    assert main == list(range(len(main))), [p.name for p in NOTEBOOKS]
    assert all(int(n) in main for n, letter in numbers if letter), [p.name for p in NOTEBOOKS]


ROOT = Path(__file__).resolve().parent.parent
GLOSSARY = ROOT / "GLOSSARY.md"
FENCE = re.compile(r"^\s*(```|~~~)")


def _markdown_cells(path):
    return ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "markdown"]


def _lines_outside_fences(text):
    """The lines of a markdown text that are not inside a fenced code block (a '# comment' there is no heading)."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            yield line


def glossary_anchor(heading):
    """The anchor GitHub gives a heading: its text (no markup) lowercased, punctuation other than '-' and '_' dropped,
    each space a hyphen (so "Pinned / pageable memory" -> "pinned--pageable-memory")."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _glossary_anchors():
    anchors, seen = set(), {}
    for line in _lines_outside_fences(GLOSSARY.read_text()):
        m = re.match(r"#{1,6} +(.+?)\s*$", line)
        if m:
            base = glossary_anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            anchors.add(base if n == 0 else f"{base}-{n}")  # GitHub numbers repeated headings
    return anchors


GLOSSARY_LINK = re.compile(r"\]\(([^)\s]*GLOSSARY\.md)#([^)\s]*)\)")


def test_titles_are_numbered_like_the_file():
    bad = []
    for path in NOTEBOOKS:
        cells = json.loads(path.read_text())["cells"]
        first = "".join(cells[0]["source"]).split("\n", 1)[0] if cells else ""
        if not (cells and cells[0]["cell_type"] == "markdown" and first.startswith(f"# {path.name.split('_')[0]} · ")):
            bad.append(f"{path.name}: {first!r}")
    assert not bad, f"the first cell must be markdown titled '# NN · ...' with the file's number (06b too): {bad}"


def test_no_heading_starts_with_a_stray_hash():
    bad = [f"{path.name}: {line!r}" for path in NOTEBOOKS for text in _markdown_cells(path)
           for line in _lines_outside_fences(text) if re.match(r"#{1,6} +#", line)]
    assert not bad, f"'# #' renders a stray '#' in the heading and the outline: {bad}"


def test_glossary_anchor_matches_github():
    assert glossary_anchor("CUDA stream, event, `record_stream`") == "cuda-stream-event-record_stream"
    assert glossary_anchor("ZeRO, FSDP") == "zero-fsdp"
    assert glossary_anchor("Pinned / pageable memory") == "pinned--pageable-memory"
    assert glossary_anchor("PCIe x8/x8") == "pcie-x8x8"
    assert glossary_anchor("PCIe peer-to-peer (P2P), NVLink") == "pcie-peer-to-peer-p2p-nvlink"
    assert glossary_anchor("`reshard_after_forward`") == "reshard_after_forward"


def test_glossary_links_resolve():
    anchors = _glossary_anchors()
    sources = [(p.name, "../GLOSSARY.md", text) for p in NOTEBOOKS for text in _markdown_cells(p)]
    sources += [(name, "GLOSSARY.md", (ROOT / name).read_text()) for name in ("README.md", "INSTRUCTORS.md")]
    broken = [f"{name}: {target}#{anchor}" for name, expected, text in sources
              for target, anchor in GLOSSARY_LINK.findall(text) if target != expected or anchor not in anchors]
    broken += [f"GLOSSARY.md: #{anchor}" for anchor in re.findall(r"\]\(#([^)\s]*)\)", GLOSSARY.read_text())
               if anchor not in anchors]
    assert not broken, f"links to no heading of GLOSSARY.md (or by the wrong path): {broken}"


def test_notebooks_link_the_glossary():
    missing = [p.name for p in NOTEBOOKS if int(p.name[:2]) >= 1
               and not any("../GLOSSARY.md#" in text for text in _markdown_cells(p))]
    assert not missing, f"link the glossary at the first use of a term it defines: {missing}"


def test_notebooks_leave_no_temp_folders():
    """A notebook's scratch folders (the scripts it writes, the models it saves) come from `scratch_dir`, which
    removes them when the kernel exits; `tempfile.mkdtemp` left one behind per run."""
    for path in NOTEBOOKS:
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        assert "mkdtemp(" not in code and "tempfile." not in code, f"{path.name}: use helpers.runtime.scratch"


def test_scratch_folders_go_when_the_process_ends(tmp_path):
    import os
    import subprocess
    import sys

    code = "from helpers.runtime.scratch import scratch_dir; print(scratch_dir('lab-x-'))"
    made = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env=dict(os.environ, TMPDIR=str(tmp_path))).stdout.strip()
    assert made.startswith(str(tmp_path)) and not Path(made).exists()


def test_cuda_peaks_are_reset_before_they_are_read():
    """`torch.cuda.max_memory_allocated` is the peak since the process started unless reset: notebook 01 printed it
    per device after other steps had run, so the split's peak included everything before it."""
    for path in NOTEBOOKS:
        code = "".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        for reader in ("max_memory_allocated", "cuda_peak_bytes("):
            at = code.find(reader)
            if at >= 0:
                assert "reset_peak_memory_stats" in code[:at], f"{path.name} reads {reader} without resetting it"


def test_course_tables_list_every_notebook_in_order():
    """README's course table and INSTRUCTORS.md's run-time table are written by hand: each has one row per notebook,
    in course order, so a new notebook cannot be left out of either (or a renamed one left behind)."""
    ids = [p.name.split("_", 1)[0] for p in NOTEBOOKS]
    readme = re.findall(r"^\| `(\w+)` \|", (ROOT / "README.md").read_text(), re.MULTILINE)
    assert [name for name in readme if re.match(r"\d\d[a-z]?_", name)] == [p.stem for p in NOTEBOOKS], \
        "README.md, The course: one row per notebook, `NN_topic` in course order"
    times = re.findall(r"^\| (\d\d[a-z]?) [^|]+\| \d+ s \|", (ROOT / "INSTRUCTORS.md").read_text(), re.MULTILINE)
    assert times == ids, "INSTRUCTORS.md, Run times: one row per notebook ('| NN name | S s | ...'), in course order"


MAX_LINES, MAX_CHARS = 15, 1200   # a markdown cell says what to read in the output and why: a figure carries numbers


def test_no_walls_before_going_further():
    """On a notebook's core path (before "Going further" / "Optional") no markdown cell is over 15 non-blank lines
    or about 1,200 characters: a learner reads it in its slot (tests/course_time.py)."""
    walls = []
    for path in NOTEBOOKS:
        for cell in core_cells(path):
            text = "".join(cell["source"])
            lines = sum(1 for line in text.splitlines() if line.strip())
            if cell["cell_type"] == "markdown" and (lines > MAX_LINES or len(text) > MAX_CHARS):
                walls.append(f"{path.name}: {lines} lines, {len(text)} chars: {text.strip()[:60]!r}")
    assert not walls, "split the cell, let a table or figure carry the numbers, or move the detail to Going " \
                      "further / docs/:\n" + "\n".join(walls)


def test_every_exercise_has_a_check_cell():
    """Each numbered exercise has a cell that calls check_answer(N, ...) and so says right or wrong."""
    missing = []
    for path in NOTEBOOKS:
        numbers = exercise_numbers(path)
        code = "\n".join("".join(c["source"]) for c in core_cells(path) if c["cell_type"] == "code")
        missing += [f"{path.name}: exercise {n}" for n in numbers if not re.search(rf"check_answer\(\s*{n}\s*,", code)]
        assert numbers, f"{path.name} has no numbered exercises under '## Exercises'"
    assert not missing, "no check_answer(N, ...) cell for:\n" + "\n".join(missing)


def test_every_answer_slot_has_a_reference_answer():
    """Each `my_... = None` a learner fills in has a reference answer in tests/exercise_answers/nbNN.py, which the
    full tier runs in its place (tests/test_exercises.py): a check cell that would say wrong to the right answer fails
    there, whichever notebook it is in."""
    missing = []
    for path in NOTEBOOKS:
        code = "\n".join("".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code")
        slots = set(re.findall(r"^(my_\w+) = None\b", code, re.MULTILINE))
        answers = Path(__file__).parent / "exercise_answers" / f"nb{notebook_id(path)}.py"
        given = set(importlib.import_module(f"tests.exercise_answers.nb{notebook_id(path)}").ANSWERS) \
            if answers.exists() else set()
        missing += [f"{path.name}: {name}" for name in sorted(slots - given)]
    assert not missing, "no reference answer (tests/exercise_answers/nbNN.py) for:\n" + "\n".join(missing)


def schedule_slots(text: str) -> dict[str, int]:
    """Each notebook's longest slot in INSTRUCTORS.md's schedules: a table row '| 09:00 | block | 06b | ...' naming
    one notebook alone, lasting until the next row's time in the same table."""
    slots: dict[str, int] = {}
    for table in re.split(r"\n(?!\|)", text):
        rows = re.findall(r"^\| (\d\d?):(\d\d) \|[^|]*\|([^|]*)\|", table, re.MULTILINE)
        times = [int(h) * 60 + int(m) for h, m, _ in rows]
        assert times == sorted(times), f"schedule times out of order: {rows}"
        for (h, m, names), start, end in zip(rows, times, times[1:]):
            ids = re.findall(r"\b\d\d[a-z]?\b", names)
            if len(ids) == 1:
                slots[ids[0]] = max(slots.get(ids[0], 0), end - start)
    return slots


def test_every_notebook_has_a_slot_it_fits():
    """INSTRUCTORS.md gives every notebook (06b included) a slot of its own, at least as long as its core path takes
    a learner (tests/course_time.py: `python -m tests.course_time` prints each)."""
    slots = schedule_slots((ROOT / "INSTRUCTORS.md").read_text())
    problems = []
    for path in NOTEBOOKS:
        need = learner_minutes(path)
        have = slots.get(notebook_id(path))
        if have is None or have < need:
            problems.append(f"{path.stem}: core path {need:.0f} min, slot {have or 'none'}")
    assert not problems, "\n".join(problems)
