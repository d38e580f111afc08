"""Each notebook's GPU-size plan, as the notebook declares it, found by walking notebooks/*.ipynb (tests may read
notebook JSON; the library never does): the setup cell's imports and the cells up to the one that calls `check_plan`
are executed with a GPU rig given as `rig`, and the call's arguments are caught instead of checked.

`python -m tests.notebook_plans` rewrites data/gpu_plans.json, which `check_plan` prints on the CPU rig and the
doctor reads; tests/test_gpu_sizes.py fails while that file is stale.
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import tempfile
from functools import lru_cache
from pathlib import Path

from helpers.gpu_sizes import plans as plans_module
from helpers.gpu_sizes.plans import NotebookPlan, PlanRecord, plan_of, rtx3090_rigs, write_recorded
from helpers.runtime.rig import Rig

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
# a notebook allocates on a GPU if it takes the course's rig (whose devices are GPUs there) or names CUDA itself
USES_A_GPU = re.compile(r"\bsetup\(|\bcuda\b|rig\.devices")


def notebook_id(path: Path) -> str:
    """'05' for 05_gpipe.ipynb, '06b' for 06b_beyond_1f1b.ipynb."""
    return path.name.split("_", 1)[0]


def code_cells(path: Path) -> list[str]:
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def uses_a_gpu(path: Path) -> bool:
    return any(USES_A_GPU.search(cell) for cell in code_cells(path))


def _calls_check_plan(cell: str) -> bool:
    return re.search(r"^check_plan\(", cell, re.MULTILINE) is not None


def plan_cells(path: Path) -> tuple[str, str]:
    """(the setup cell's imports that the parameters and plan cells use, those cells up to the `check_plan` call):
    the setup cell is the first code cell; the next cells up to the first that calls `check_plan` set the
    constants and declare the plan. Raises if no cell calls `check_plan`."""
    cells = code_cells(path)
    ends = [i for i, cell in enumerate(cells) if _calls_check_plan(cell)]
    if not ends:
        raise LookupError(f"{path.name} uses a GPU but no cell calls check_plan: declare its GPU plan after its "
                          "parameters (see helpers.gpu_sizes.plans)")
    body = "\n".join(cells[1:ends[0] + 1])
    used = {n.id for n in ast.walk(ast.parse(body)) if isinstance(n, ast.Name)}
    imports = [node for node in ast.parse(cells[0]).body if isinstance(node, (ast.Import, ast.ImportFrom))
               and any((a.asname or a.name).split(".")[0] in used for a in node.names)]
    return ast.unparse(ast.Module(imports, [])), body


@lru_cache(maxsize=64)
def declared(path: Path, rig: Rig) -> dict:
    """What the notebook at `path` passes to `check_plan` when its cells run on `rig`: {notebook, constants, phases,
    knobs}. Its prints are swallowed; a temporary directory it makes is made inside one that is removed again."""
    imports, body = plan_cells(path)
    caught: dict = {}

    def catch(notebook, rig, constants, phases, knobs):
        caught.update(notebook=notebook, constants=dict(constants), phases=phases, knobs=tuple(knobs))

    namespace: dict[str, object] = {"rig": rig}
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()), \
            _patched(plans_module, "check_plan", catch):
        saved, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            import helpers.gpu_sizes as package

            with _patched(package, "check_plan", catch):
                exec(imports, namespace)
                exec(body, namespace)
        finally:
            tempfile.tempdir = saved
    if not caught:
        raise LookupError(f"{path.name}: check_plan was never reached")
    return caught


@contextlib.contextmanager
def _patched(owner, name, value):
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def declared_plan(path: Path, kind: str, **changes) -> NotebookPlan:
    """The notebook's plan at its GPU sizes on RTX 3090s (`kind`: "two_gpus" or "one_gpu"); `changes`: constants
    to replace before planning (the plan function reads the notebook's globals)."""
    rig = rtx3090_rigs()[kind]
    d = declared(path, rig)
    if changes:
        d["phases"].__globals__.update(changes)
        try:
            return plan_of(d["notebook"], rig, {**d["constants"], **changes}, d["phases"], d["knobs"])
        finally:
            d["phases"].__globals__.update({k: d["constants"][k] for k in changes})
    return plan_of(d["notebook"], rig, d["constants"], d["phases"], d["knobs"])


def records(paths=None) -> dict[str, dict[str, PlanRecord]]:
    """Every GPU notebook's plan reduced to what data/gpu_plans.json keeps."""
    out = {}
    for path in paths or [p for p in NOTEBOOKS if uses_a_gpu(p)]:
        out[notebook_id(path)] = {kind: declared_plan(path, kind).record() for kind in rtx3090_rigs()}
    return out


if __name__ == "__main__":
    written = records()
    write_recorded(written)
    print(f"wrote {plans_module.RECORDED}: " + ", ".join(written))
