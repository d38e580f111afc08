"""A notebook's memory plan per GPU, and the check every notebook runs before its first big step.

A notebook declares its plan itself, in the cell after its parameters: a function of the rig that lists its phases
(the moments it holds the most: a section's objects alive plus the step it runs, or the ranks it spawns beside what
the notebook process still holds), each a list of parts on the rig's devices built from the notebook's own constants
(`helpers.gpu_sizes.parts`), and the constants that shrink it. A device's planned peak is its heaviest phase: the
parts' bytes, the CUDA context of every process that uses the device (the notebook's own on every GPU, since the
check below queries each one, and each rank's on its GPU), and an allocator margin, both from data/inference.json's
runtime reserve with their sources. On the one-GPU rig both stages' parts land on cuda:0. The course's GPU sizes
must leave 15% of each card free (`HEADROOM`).

The library never reads a notebook. What each notebook's plan comes to on two RTX 3090s and on one is recorded in
data/gpu_plans.json, written by the test that walks the notebooks (`python -m tests.notebook_plans` rewrites it; the
test fails while it is stale): `check_plan` prints it on the CPU rig, the doctor compares it with the cards it finds.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from helpers.facts import DATA_DIR
from helpers.gpu_sizes.footprint import Footprint, Replay
from helpers.sizing.gpus import gpu, runtime_reserve, runtime_reserve_bytes
from helpers.units import GiB, fmt_bytes
from helpers.runtime.rig import Rig

HEADROOM = 0.15  # the share of each card a plan leaves free: planned peak <= 85% of the card
CARD = "RTX 3090"
NOTEBOOK = "notebook"  # the process a part lives in: the notebook's own, or a spawned rank ("rank 0", ...)
RECORDED = DATA_DIR / "gpu_plans.json"
RIG_NAMES = {"two_gpus": "two GPUs", "one_gpu": "one GPU"}


@dataclass(frozen=True)
class Part:
    """Something alive on one of the rig's devices (an index into `rig.devices`) at a phase's heaviest moment."""

    what: str
    device: int
    bytes: Footprint
    process: str = NOTEBOOK
    replay: Replay | None = None  # a whole-model step the GPU suite can rerun alone (helpers.gpu_sizes.suite)


@dataclass(frozen=True)
class Phase:
    name: str
    parts: tuple[Part, ...]

    def __init__(self, name: str, parts: Sequence[Part]):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "parts", tuple(parts))


Phases = Callable[[Rig], Sequence[Phase]]


def card_bytes(card: str = CARD) -> int:
    """The memory CUDA reports for `card`, from the one GPU description (helpers.sizing.gpus)."""
    return gpu(card).capacity_bytes


def rtx3090_rigs() -> dict[str, Rig]:
    """The two GPU rigs of the course with RTX 3090s, as `detect_rig` would describe them there (capacities as CUDA
    reports a 3090; the one-GPU rig gives each stage half), built without touching CUDA."""
    from helpers.training.support import reference_rigs

    rigs, card = reference_rigs(), card_bytes()
    return {"two_gpus": replace(rigs["two GPUs"], capacity_bytes=(card, card)),
            "one_gpu": replace(rigs["one GPU"], capacity_bytes=(card // 2, card // 2))}


@dataclass(frozen=True)
class DevicePeak:
    """One device's planned peak: its bytes, its heaviest phase, and that phase's parts summed by kind."""

    device: str
    peak: int
    heaviest: str
    parts: Mapping[str, int]


@dataclass(frozen=True)
class PlanRecord:
    """A notebook's plan on one rig reduced to what the checks read (what data/gpu_plans.json keeps)."""

    notebook: str
    rig: str  # "two_gpus" or "one_gpu"
    knobs: str  # "BATCH (now 32) or SEQ (now 512)"
    devices: tuple[DevicePeak, ...]
    steps: tuple[tuple[str, Replay], ...] = ()  # its whole-model steps, each once, for the GPU suite
    capacity: int = field(default_factory=card_bytes)

    def peaks(self) -> dict[str, int]:
        return {d.device: d.peak for d in self.devices}

    @property
    def budget(self) -> int:
        """What a plan may use per card: the card less the headroom."""
        return int(self.capacity * (1 - HEADROOM))

    @property
    def fits(self) -> bool:
        return all(d.peak <= self.budget for d in self.devices)

    def describe(self) -> str:
        """'two GPUs: cuda:0 14.2 GiB, cuda:1 9.8 GiB' for one rig."""
        return f"{RIG_NAMES[self.rig]}: " + ", ".join(f"{d.device} {d.peak / GiB:.1f} GiB" for d in self.devices)

    def rows(self) -> list[dict]:
        """One row per device: peak, heaviest phase, and its parts summed by kind (what the doctor prints)."""
        return [{"notebook": self.notebook, "rig": self.rig, "device": d.device, "planned peak": fmt_bytes(d.peak),
                 "of": fmt_bytes(self.capacity), "fits (<= 85%)": d.peak <= self.budget,
                 "heaviest moment": d.heaviest, **{k: fmt_bytes(v) for k, v in d.parts.items()}}
                for d in self.devices]

    def as_dict(self) -> dict:
        return {"knobs": self.knobs, "devices": [{"device": d.device, "peak": d.peak, "heaviest": d.heaviest,
                                                  "parts": dict(d.parts)} for d in self.devices],
                "steps": [{"what": what, **step.as_dict()} for what, step in self.steps]}

    @classmethod
    def from_dict(cls, notebook: str, rig: str, d: Mapping) -> "PlanRecord":
        return cls(notebook, rig, d["knobs"], tuple(DevicePeak(x["device"], x["peak"], x["heaviest"], x["parts"])
                                                    for x in d["devices"]),
                   tuple((s["what"], Replay.from_dict(s)) for s in d.get("steps", ())))


@dataclass(frozen=True)
class NotebookPlan:
    """One notebook's plan on one rig: its phases, the constants they were planned with, the knobs that shrink it.
    Built by `plan_of` from what the notebook declares."""

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
        parts = [p for p in phase.parts if self._on(p) == device]
        return sum(p.bytes.total for p in parts) + runtime_reserve_bytes(len({NOTEBOOK} | {p.process for p in parts}))

    def heaviest(self, device: str) -> Phase:
        return max(self.phases, key=lambda phase: self.phase_bytes(phase, device))

    def peak(self, device: str) -> int:
        return self.phase_bytes(self.heaviest(device), device)

    def peaks(self) -> dict[str, int]:
        return {d: self.peak(d) for d in self.devices}

    def knob_text(self) -> str:
        return " or ".join(f"{k} (now {self.constants[k]})" for k in self.knobs)

    def record(self) -> PlanRecord:
        """The plan reduced to each device's peak, heaviest phase and its parts by kind."""
        devices = []
        for d in self.devices:
            phase = self.heaviest(d)
            total = sum((p.bytes for p in phase.parts if self._on(p) == d), Footprint())
            devices.append(DevicePeak(d, self.peak(d), phase.name,
                                      {k: v for k, v in total.as_dict().items() if k != "total"}))
        steps = {p.replay: p.what for phase in self.phases for p in phase.parts if p.replay is not None}
        return PlanRecord(self.notebook, self.rig.kind, self.knob_text(), tuple(devices),
                          tuple((what, step) for step, what in steps.items()), self.capacity)

    @property
    def budget(self) -> int:
        return self.record().budget

    @property
    def fits(self) -> bool:
        return self.record().fits


def plan_of(notebook: str, rig: Rig, constants: Mapping[str, object], phases: Phases,
            knobs: Sequence[str]) -> NotebookPlan:
    """Notebook `notebook`'s plan on `rig` (a GPU rig): `phases(rig)`, declared by the notebook from its constants
    (`constants`, e.g. its `globals()`; the upper-case names are kept for the message), and `knobs`, the constants
    that shrink it."""
    if rig.is_cpu:
        raise ValueError("plans are for GPU rigs: give rtx3090_rigs()['two_gpus'] or ['one_gpu']")
    missing = [k for k in knobs if k not in constants]
    if missing:
        raise ValueError(f"notebook {notebook}'s knobs {missing} are not among its constants")
    return NotebookPlan(notebook, rig, {k: v for k, v in constants.items() if k.isupper()}, tuple(knobs),
                        tuple(phases(rig)))


def recorded_plans() -> dict[str, dict[str, PlanRecord]]:
    """Every notebook's plan at its GPU sizes on two RTX 3090s and on one, as data/gpu_plans.json records them:
    {notebook: {"two_gpus": PlanRecord, "one_gpu": PlanRecord}}."""
    if not RECORDED.exists():
        raise FileNotFoundError(f"{RECORDED} is missing: write it with `python -m tests.notebook_plans`")
    data = json.loads(RECORDED.read_text())["notebooks"]
    return {nb: {rig: PlanRecord.from_dict(nb, rig, d) for rig, d in rigs.items()} for nb, rigs in data.items()}


def write_recorded(records: Mapping[str, Mapping[str, PlanRecord]]) -> None:
    """Write data/gpu_plans.json (what `recorded_plans` reads), notebooks in course order."""
    body = {"about": "each notebook's GPU-size plan on two RTX 3090s and on one, computed by helpers.gpu_sizes from "
                     "the plan each notebook declares after its parameters; written by `python -m "
                     "tests.notebook_plans`, and tests/test_gpu_sizes.py fails while it is stale",
            "notebooks": {nb: {rig: r.as_dict() for rig, r in records[nb].items()} for nb in sorted(records)}}
    RECORDED.write_text(json.dumps(body, indent=1) + "\n")


def notebook_plans(rig: Rig | str = "two_gpus") -> list[PlanRecord]:
    """Every notebook's recorded plan: on two RTX 3090s ("two_gpus"), one ("one_gpu"), or against a detected GPU rig
    (the record of its kind, with its cards' capacity). What `python -m helpers.doctor` prints."""
    kind = rig if isinstance(rig, str) else rig.kind
    if kind not in RIG_NAMES:
        raise ValueError(f"unknown rig kind {kind!r}; choose one of {list(RIG_NAMES)} or give a GPU rig")
    records = [per_rig[kind] for per_rig in recorded_plans().values()]
    if isinstance(rig, str):
        return records
    capacity = sum(rig.capacity_bytes) if rig.kind == "one_gpu" else min(rig.capacity_bytes)
    return [replace(r, capacity=capacity) for r in records]


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


def check_plan(notebook: str, rig: Rig, constants: Mapping[str, object], phases: Phases,
               knobs: Sequence[str]) -> None:
    """Before a notebook's first big step, with the plan the notebook declares (`phases`, a function of the rig;
    `knobs`, the constants that shrink it; `constants`, its `globals()`). On GPUs: compare each GPU's planned peak
    with the memory CUDA says is free, and raise `NotEnoughMemory`, naming the constants to lower, instead of running
    out of memory halfway. On the CPU rig: print the plan of the notebook's GPU sizes on RTX 3090s as recorded in
    data/gpu_plans.json, one line (CUDA is never touched there)."""
    if not callable(phases) or not knobs:
        raise TypeError(f"notebook {notebook}: declare its plan, check_plan({notebook!r}, rig, globals(), "
                        "phases=gpu_plan, knobs=('BATCH', ...)) with gpu_plan(rig) -> [Phase(...), ...]")
    if rig.is_cpu:
        recorded = recorded_plans().get(notebook)
        if recorded is None:
            raise LookupError(f"notebook {notebook} has no plan in {RECORDED.name}: write it with "
                              "`python -m tests.notebook_plans`")
        plans = list(recorded.values())
        print(f"GPU sizes planned for RTX 3090s ({fmt_bytes(plans[0].capacity)} each, at most "
              f"{1 - HEADROOM:.0%} used): " + "; ".join(p.describe() for p in plans))
        return
    import torch

    plan = plan_of(notebook, rig, constants, phases, knobs)
    free = {d: torch.cuda.mem_get_info(torch.device(d))[0] for d in plan.devices}
    own_context = runtime_reserve()["context"]  # this process's context is already taken from the free memory
    problems = shortfalls(plan, free, own_context)
    if problems:
        raise NotEnoughMemory("; ".join(problems))
    print(f"notebook {notebook} plans " + ", ".join(
        f"{d} {(plan.peak(d) - own_context) / GiB:.1f} of {free[d] / GiB:.1f} GiB free" for d in plan.devices))
