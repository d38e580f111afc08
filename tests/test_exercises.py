"""Each exercise's check cell says right to the right answer: a notebook with reference answers
(tests/exercise_answers/nbNN.py) runs start to finish with them written in place of `my_... = None`, in a fresh kernel,
and every numbered exercise must print "exercise N: right" (full tier; it replaces that notebook's nbval run,
tests/conftest.py)."""
import copy
import importlib
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from conftest import NOT_STRICT
from tests.course_time import NOTEBOOKS, exercise_numbers, notebook_id

ANSWERED = [p for p in NOTEBOOKS if (Path(__file__).parent / "exercise_answers" / f"nb{notebook_id(p)}.py").exists()]


def answers_of(path: Path) -> dict[str, str]:
    return importlib.import_module(f"tests.exercise_answers.nb{notebook_id(path)}").ANSWERS


def with_answers(notebook: nbformat.NotebookNode, answers: dict[str, str]) -> nbformat.NotebookNode:
    """The notebook with each `name = None` line of its code cells set to the reference answer."""
    notebook = copy.deepcopy(notebook)
    found = set()
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        for name, value in answers.items():
            cell.source, n = re.subn(rf"^{name} = None\b.*$", f"{name} = {value}", cell.source, flags=re.MULTILINE)
            found |= {name} if n else set()
    assert found == set(answers), f"no '{sorted(set(answers) - found)} = None' line in the notebook's code cells"
    return notebook


def printed(notebook: nbformat.NotebookNode) -> str:
    return "".join(out.get("text", "") for cell in notebook.cells if cell.cell_type == "code"
                   for out in cell.get("outputs", []) if out.get("output_type") == "stream")


@pytest.mark.full
@pytest.mark.parametrize("path", ANSWERED, ids=[p.stem for p in ANSWERED])
def test_reference_answers_are_right(path, monkeypatch):
    if path.name in NOT_STRICT:
        monkeypatch.delenv("LAB_DEVICE_STRICT", raising=False)
    notebook = with_answers(nbformat.read(path, as_version=4), answers_of(path))
    client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}}, env=dict(os.environ))
    try:
        client.execute()
    except CellExecutionError as err:
        pytest.fail(f"{path.name} with the reference answers:\n{str(err)[-3000:]}")
    out = printed(notebook)
    verdicts = dict(re.findall(r"^exercise (\d+): (right|wrong|replace None)", out, re.MULTILINE))
    assert {int(n): v for n, v in verdicts.items()} == {n: "right" for n in exercise_numbers(path)}, out[-3000:]
