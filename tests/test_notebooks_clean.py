"""Notebooks are committed with outputs stripped and named NN_topic.ipynb in course order."""
import json
import re
from pathlib import Path

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
    numbers = [int(re.match(r"(\d\d)_[a-z0-9_]+\.ipynb$", p.name).group(1)) for p in NOTEBOOKS]
    assert numbers == list(range(len(numbers))), [p.name for p in NOTEBOOKS]
