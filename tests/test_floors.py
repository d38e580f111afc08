"""Each name in its room: the imports of every module of helpers/ (at the top and inside functions, absolute and
relative) against the floors of helpers/floors.py. Read with `ast`, nothing imported."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

from helpers.floors import FLOORS, floor_of

HELPERS = Path(__file__).resolve().parent.parent / "helpers"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(HELPERS.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(HELPERS.rglob("*.py"))}


def room_of(module: str) -> str | None:
    """helpers.inference.speed -> 'inference', helpers.units -> 'units'; the package `helpers` itself is no room."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def imports_in(source: str, package: str) -> list[tuple[str, int]]:
    """(module of helpers, line) for every import statement anywhere in `source`, a module of `package`: at the top,
    in functions, under `if`; relative ones resolved; `from P import m` names the module P.m where m is one, else P."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found += [(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base, node.lineno) for a in node.names]
    return [(name, line) for name, line in found if name == "helpers" or name.startswith("helpers.")]


def package_of(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


IMPORTS = {module: imports_in(MODULES[module].read_text(), package_of(module)) for module in MODULES}


def room_edges() -> dict[tuple[str, str], list[str]]:
    """(importing room, imported room) -> 'module:line' of each import that makes the edge."""
    edges = defaultdict(list)
    for module, names in IMPORTS.items():
        for name, line in names:
            source, target = room_of(module), room_of(name)
            if source and target and source != target:
                edges[(source, target)].append(f"{MODULES[module].relative_to(HELPERS.parent)}:{line}")
    return edges


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): every set of nodes that import each
    other round a circle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_room_has_one_floor_and_every_floor_names_rooms():
    rooms = {room_of(m) for m in MODULES} - {None}
    listed = [room for names in FLOORS.values() for room in names]
    assert len(listed) == len(set(listed)), "a room is listed on two floors"
    assert sorted(rooms - set(listed)) == [], "rooms without a floor: add them to helpers/floors.py"
    assert sorted(set(listed) - rooms) == [], "helpers/floors.py names rooms that do not exist"
    assert sorted(FLOORS) == list(range(1, len(FLOORS) + 1))


def test_the_package_door_imports_no_room():
    assert IMPORTS["helpers"] == [], "helpers/__init__.py would hide an import from the floors"


def test_no_room_imports_from_a_floor_above():
    upward = [f"{source} (floor {floor_of(source)}) imports {target} (floor {floor_of(target)}): {', '.join(where)}"
              for (source, target), where in sorted(room_edges().items()) if floor_of(target) > floor_of(source)]
    assert upward == [], "\n".join(upward)


def test_no_circle_between_rooms():
    edges = room_edges()
    graph = defaultdict(set)
    for source, target in edges:
        graph[source].add(target)
    found = circles(graph)
    detail = [f"{' <-> '.join(c)}: " + "; ".join(f"{s} -> {t} at {edges[(s, t)][0]}" for s in c for t in c
                                                   if (s, t) in edges) for c in found]
    assert found == [], "\n".join(detail)


def test_no_circle_between_modules():
    """Within a room too: two modules importing each other (one of them lazily, to dodge the circle) are one module
    cut in two, or a name in the wrong one."""
    graph = {module: {name for name, _ in names if name in MODULES and name != module}
             for module, names in IMPORTS.items()}
    assert circles(graph) == []


def test_the_checks_see_what_they_must():
    """The walk finds lazy and relative imports, and the circle finder a circle of three."""
    source = "import torch\n\ndef f():\n    from .speed import predict_speed\n    from .. import units\n"
    assert imports_in(source, "helpers.inference") == [("helpers.inference.speed", 4), ("helpers.units", 5)]
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_FILE_LINES, MAX_FUNCTION_LINES = 600, 80  # issue 52: a file and a function a maintainer reads whole


def test_no_module_over_600_lines_and_no_function_over_80():
    """Every module of helpers/ (walked, not listed), and every function or method in it, docstring included."""
    long_files, long_functions = [], []
    for name, path in MODULES.items():
        source = path.read_text()
        if len(source.splitlines()) > MAX_FILE_LINES:
            long_files.append(f"{name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}.{node.name} (line {node.lineno}): {length} lines")
    assert not long_files, f"modules over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
