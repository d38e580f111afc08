"""A notebook's memory plan per GPU, and the check every notebook runs before its first big step.

A plan is a list of phases (the moments a notebook holds the most: a section's objects alive plus the step it
runs, or the ranks it spawns beside what the notebook process still holds), each a list of parts on the rig's
devices. A device's planned peak is its heaviest phase: the parts' bytes, the CUDA context of every process that uses
the device (the notebook's own on every GPU, since the check below queries each one, and each rank's on its GPU),
and an allocator margin, both from data/inference.json's runtime reserve with their sources. On the one-GPU rig both
stages' parts land on cuda:0. The course's GPU sizes must leave 15% of each card free (`HEADROOM`).
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Callable, Mapping, Sequence

from helpers.course import load_data
from helpers.gpu_sizes.footprint import Footprint
from helpers.sizing.gpus import runtime_reserve
from helpers.units import GiB, MiB, fmt_bytes
from helpers.runtime.rig import Rig

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
HEADROOM = 0.15  # the share of each card a plan leaves free: planned peak <= 85% of the card
CARD = "RTX 3090"
NOTEBOOK = "notebook"  # the process a part lives in: the notebook's own, or a spawned rank ("rank 0", ...)


@dataclass(frozen=True)
class Part:
    """Something alive on one of the rig's devices (an index into `rig.devices`) at a phase's heaviest moment."""

    what: str
    device: int
    bytes: Footprint
    process: str = NOTEBOOK


@dataclass(frozen=True)
class Phase:
    name: str
    parts: tuple[Part, ...]


def card_bytes(card: str = CARD) -> int:
    """The memory CUDA reports for `card` (data/inference.json "gpu_memory", with its source)."""
    return load_data("inference")["gpu_memory"][card]["cuda_total_mib"] * MiB


def rtx3090_rigs() -> dict[str, Rig]:
    """The two GPU rigs of the course with RTX 3090s, as `detect_rig` would describe them there (capacities as CUDA
    reports a 3090; the one-GPU rig gives each stage half), built without touching CUDA."""
    from helpers.training.support import reference_rigs

    rigs, card = reference_rigs(), card_bytes()
    return {"two_gpus": replace(rigs["two GPUs"], capacity_bytes=(card, card)),
            "one_gpu": replace(rigs["one GPU"], capacity_bytes=(card // 2, card // 2))}


@dataclass(frozen=True)
class NotebookPlan:
    """One notebook's plan on one rig: its phases, the constants they were planned with, the knobs that shrink it."""

    notebook: str
    rig: Rig
    constants: Mapping[str, object]
    knobs: tuple[str, ...]
    phases: tuple[Phase, ...]
    capacity: int = field(default_factory=card_bytes)

    @property
    def devices(self) -> tuple[str, ...]:
        """The physical devices, in order ("cuda:0", "cuda:1"; one entry on the one-GPU rig)."""
        return tuple(dict.fromkeys(str(d) for d in self.rig.devices))

    def _on(self, part: Part) -> str:
        return str(self.rig.devices[part.device])

    def phase_bytes(self, phase: Phase, device: str) -> int:
        """Everything on `device` during `phase`: parts, one CUDA context per process there, the margin."""
        reserve = runtime_reserve()
        parts = [p for p in phase.parts if self._on(p) == device]
        processes = {NOTEBOOK} | {p.process for p in parts}
        return sum(p.bytes.total for p in parts) + len(processes) * reserve["context"] + reserve["margin"]

    def heaviest(self, device: str) -> Phase:
        return max(self.phases, key=lambda phase: self.phase_bytes(phase, device))

    def peak(self, device: str) -> int:
        return self.phase_bytes(self.heaviest(device), device)

    def peaks(self) -> dict[str, int]:
        return {d: self.peak(d) for d in self.devices}

    @property
    def budget(self) -> int:
        """What a plan may use per card: the card less the headroom."""
        return int(self.capacity * (1 - HEADROOM))

    @property
    def fits(self) -> bool:
        return all(peak <= self.budget for peak in self.peaks().values())

    def knob_text(self) -> str:
        return " or ".join(f"{k} (now {self.constants[k]})" for k in self.knobs)

    def describe(self) -> str:
        """'two GPUs: cuda:0 14.2 GiB (section 4: ...), cuda:1 9.8 GiB' for one rig."""
        rig = {"two_gpus": "two GPUs", "one_gpu": "one GPU"}[self.rig.kind]
        return f"{rig}: " + ", ".join(f"{d} {self.peak(d) / GiB:.1f} GiB" for d in self.devices)

    def rows(self) -> list[dict]:
        """One row per device: peak, heaviest phase, and its parts summed by kind (what the doctor prints)."""
        rows = []
        for d in self.devices:
            phase = self.heaviest(d)
            total = sum((p.bytes for p in phase.parts if self._on(p) == d), Footprint())
            rows.append({"notebook": self.notebook, "rig": self.rig.kind, "device": d,
                         "planned peak": fmt_bytes(self.peak(d)), "of": fmt_bytes(self.capacity),
                         "fits (<= 85%)": self.peak(d) <= self.budget, "heaviest moment": phase.name,
                         **{k: fmt_bytes(v) for k, v in total.as_dict().items() if k != "total"}})
        return rows


# --- the notebooks' own constants -----------------------------------------------------------------------------------

def notebook_path(notebook: str) -> Path:
    found = sorted(NOTEBOOKS_DIR.glob(f"{notebook}_*.ipynb"))
    if len(found) != 1:
        raise ValueError(f"no single notebook {notebook}_*.ipynb in {NOTEBOOKS_DIR} (found {len(found)})")
    return found[0]


def _code_cells(path: Path) -> list[str]:
    cells = json.loads(path.read_text())["cells"]
    return ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]


def _is_plan_check(node: ast.stmt) -> bool:
    return (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "check_plan")


@lru_cache(maxsize=64)
def _parameters_source(notebook: str) -> tuple[str, str]:
    """(the setup cell's imports that the parameters cell uses, the parameters cell without its check_plan call):
    the setup cell is the first code cell (imports, then `rig = setup(...)`), the parameters cell the next one."""
    setup_cell, params_cell = _code_cells(notebook_path(notebook))[:2]
    params = ast.parse(params_cell)
    used = {n.id for n in ast.walk(params) if isinstance(n, ast.Name)}
    imports = [node for node in ast.parse(setup_cell).body if isinstance(node, (ast.Import, ast.ImportFrom))
               and any((a.asname or a.name).split(".")[0] in used for a in node.names)]
    body = [node for node in params.body if not _is_plan_check(node)]
    return ast.unparse(ast.Module(imports, [])), ast.unparse(ast.Module(body, []))


def notebook_constants(notebook: str, rig: Rig) -> dict[str, object]:
    """The constants the parameters cell of notebook `notebook` ("05") sets on `rig`: the cell is executed as the
    notebook runs it (with `rig` given, the imports it needs from the setup cell, its prints swallowed and any
    temporary directory it makes created inside one that is removed again), so no constant is copied anywhere."""
    imports, params = _parameters_source(notebook)
    namespace: dict[str, object] = {"rig": rig}
    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(io.StringIO()):
        saved, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            exec(imports, namespace)
            exec(params, namespace)
        finally:
            tempfile.tempdir = saved
    return {k: v for k, v in namespace.items() if k.isupper()}


# --- planning and checking -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Inventory:
    """How a notebook is planned: its phases from its constants and rig, and the constants that shrink them."""

    phases: Callable[[Mapping[str, object], Rig], Sequence[Phase]]
    knobs: tuple[str, ...]


def inventories() -> dict[str, Inventory]:
    from helpers.gpu_sizes.notebooks import INVENTORIES

    return INVENTORIES


def plan_notebook(notebook: str, rig: Rig, constants: Mapping[str, object] | None = None) -> NotebookPlan:
    """Notebook `notebook`'s plan on `rig` (a GPU rig), with `constants` (default: its parameters cell's own)."""
    if rig.is_cpu:
        raise ValueError("plans are for GPU rigs: give rtx3090_rigs()['two_gpus'] or ['one_gpu']")
    known = inventories()
    if notebook not in known:
        raise ValueError(f"no memory plan for notebook {notebook!r}; planned: {', '.join(known)}")
    inventory = known[notebook]
    constants = dict(notebook_constants(notebook, rig) if constants is None else
                     {k: v for k, v in constants.items() if k.isupper()})
    phases = tuple(inventory.phases(constants, rig))
    return NotebookPlan(notebook, rig, constants, inventory.knobs, phases)


def notebook_plans(rig: Rig | str = "two_gpus") -> list[NotebookPlan]:
    """Every planned notebook at its own GPU constants: on two RTX 3090s ("two_gpus"), one ("one_gpu"), or a detected
    GPU rig (its cards' capacity). What `python -m helpers.doctor` prints: each plan says `fits`, `peaks()` per
    device and `rows()` for a table."""
    if isinstance(rig, str):
        rigs = rtx3090_rigs()
        if rig not in rigs:
            raise ValueError(f"unknown rig kind {rig!r}; choose one of {list(rigs)} or give a GPU rig")
        return [plan_notebook(nb, rigs[rig]) for nb in inventories()]
    capacity = sum(rig.capacity_bytes) if rig.kind == "one_gpu" else min(rig.capacity_bytes)
    return [replace(plan_notebook(nb, rig), capacity=capacity) for nb in inventories()]


def plans_table(rig: Rig | str = "two_gpus") -> str:
    """`notebook_plans` as one table: a row per notebook and device, the heaviest moment and its parts."""
    from helpers.report import table

    return table([row for plan in notebook_plans(rig) for row in plan.rows()])


class NotEnoughMemory(RuntimeError):
    """The notebook's plan does not fit the free memory of a GPU."""


def shortfalls(plan: NotebookPlan, free: Mapping[str, int], already_used: int = 0) -> list[str]:
    """What does not fit, in the user's terms, for each device whose planned peak (less `already_used`, what the
    free figure has already lost to this process: its CUDA context) exceeds `free[device]`."""
    messages = []
    for device in plan.devices:
        need = plan.peak(device) - already_used
        if need > free[device]:
            messages.append(f"notebook {plan.notebook} plans {need / GiB:.1f} GiB on {device} but "
                            f"{free[device] / GiB:.1f} GiB are free (heaviest moment: "
                            f"{plan.heaviest(device).name}): lower {plan.knob_text()} in the parameters cell, or "
                            f"close other programs using the GPU")
    return messages


def check_plan(notebook: str, rig: Rig, constants: Mapping[str, object] | None = None) -> None:
    """Before a notebook's first big step. On GPUs: plan the notebook with its constants as they are now
    (`constants`, e.g. `globals()`), compare each GPU's planned peak with the memory CUDA says is free, and raise
    `NotEnoughMemory`, naming the constants to lower, instead of running out of memory halfway. On the CPU rig:
    print the plan of the notebook's GPU sizes on RTX 3090s, one line (CUDA is never touched there)."""
    if rig.is_cpu:
        plans = [plan_notebook(notebook, r) for r in rtx3090_rigs().values()]
        print(f"GPU sizes planned for RTX 3090s ({fmt_bytes(plans[0].capacity)} each, at most "
              f"{1 - HEADROOM:.0%} used): " + "; ".join(p.describe() for p in plans))
        return
    import torch

    plan = plan_notebook(notebook, rig, constants)
    free = {d: torch.cuda.mem_get_info(torch.device(d))[0] for d in plan.devices}
    own_context = runtime_reserve()["context"]  # this process's context is already taken from the free memory
    problems = shortfalls(plan, free, own_context)
    if problems:
        raise NotEnoughMemory("; ".join(problems))
    print(f"notebook {notebook} plans " + ", ".join(
        f"{d} {(plan.peak(d) - own_context) / GiB:.1f} of {free[d] / GiB:.1f} GiB free" for d in plan.devices))
