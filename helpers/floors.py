"""The architecture as data: every room of `helpers/` (a package under it, or a top-level module) on its floor.

The rule (shared/ARCHITECTURE.md's floors): a room imports only from its own floor or the floors below it, never from
a floor above, and the rooms' imports never close a circle, on one floor or across floors; lazy imports (inside a
function) count like any other. A name two rooms need lives on the lower room's floor. Each room sits on the lowest
floor its own imports allow, except the commands (bench, doctor, plan, gpu_sizes), which stay on the top floor
whatever they import, so that nothing the course teaches can come to depend on a command.

tests/test_floors.py reads every module's imports with `ast` and fails on an import up a floor, on a circle between
rooms or between modules, and on a room missing from this table (or a name here that is no room): a new room gets a
floor here first.
"""
from __future__ import annotations

FLOORS: dict[int, tuple[str, ...]] = {
    # pure data and the machine: units, number formats, facts in data/, the catalog, the rig and launcher, the models,
    # and the small tools every room uses (checks, tables, timing, events and plots, precision, the optimal cut, the
    # memory panel, a notebook's setup)
    1: ("floors", "units", "dtypes", "facts", "catalog", "check", "report", "measure", "timeline", "precision",
        "partition", "unequal", "monitor", "course", "runtime", "models"),
    2: ("sizing", "hardware"),  # memory planned and measured; links, collectives, rigs and the roofline's constants
    3: ("pipeline", "profile", "activation_checkpointing", "checkpointing"),
    4: ("training",),
    5: ("finetune", "inference"),
    6: ("simulate",),
    7: ("bench", "doctor", "plan", "gpu_sizes"),  # the commands
}


def floor_of(room: str) -> int:
    """The floor of `room` (a package under helpers/ or a top-level module's name)."""
    for floor, rooms in FLOORS.items():
        if room in rooms:
            return floor
    raise KeyError(f"room {room!r} has no floor: give it one in helpers/floors.py")
