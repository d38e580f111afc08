"""Notebooks 04-07, whose checks once failed now and then on timing, sampling or the allocator's state (nbval of
04-06 failed 1 of 50 cells once on a quiet machine, then passed), run five times in a row, every cell, with no
failure. Full tier, marked `repeat`: about 17 minutes on 2 cores, which CI leaves out (`pytest --full -m repeat`
runs it alone)."""
import copy
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
REPEATED = ("04_communication", "05_gpipe", "06_1f1b", "07_data_parallel")
RUNS = 5


@pytest.mark.full
@pytest.mark.repeat
@pytest.mark.parametrize("name", REPEATED)
def test_notebook_passes_five_times_in_a_row(name):
    # the kernels' ranks run device-strict, as in nbval (conftest.py: none of these is in NOT_STRICT)
    notebook = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    for run in range(1, RUNS + 1):
        client = NotebookClient(copy.deepcopy(notebook), timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(NOTEBOOKS)}})
        try:
            client.execute()
        except CellExecutionError as err:
            pytest.fail(f"{name}: run {run} of {RUNS} failed:\n{str(err)[-3000:]}")
