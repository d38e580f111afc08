"""Checks that can pass on nothing, found by reading the code: every `assert` in tests/ and in the notebooks' code
cells is walked (AST), and the notebooks' check cells must check something.

Flagged:
- a comparison of a value with itself (`a == a`, `x <= x`): true whatever the code computed;
- membership in a literal collection holding every value a bool can take (`x in (True, False)`), or a comparison
  between two literals (`"yes" in ("yes", "NO")`): decided when it was written;
- `assert (condition, "message")` (a non-empty tuple is always true), `assert <literal>`, `... or True`;
- a code cell of a notebook's *Check yourself* section without an `assert`.
"""
import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = sorted((ROOT / "tests").glob("*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _same(a: ast.AST, b: ast.AST) -> bool:
    return ast.dump(a) == ast.dump(b)


def _literal(node: ast.AST) -> bool:
    """A constant, or a tuple/list/set of constants."""
    if isinstance(node, ast.Constant):
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(isinstance(e, ast.Constant) for e in node.elts)


def _every_bool(node: ast.AST) -> bool:
    if not isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return False
    values = {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return any(v is True for v in values) and any(v is False for v in values)


def vacuous(test: ast.AST) -> list[str]:
    """Why the condition of an `assert` holds whatever the code under test did ([] when it can fail)."""
    why = []
    if isinstance(test, ast.Tuple) and test.elts:
        why.append("a non-empty tuple is always true (assert (x, 'msg') instead of assert x, 'msg')")
    elif isinstance(test, ast.Constant) and test.value:
        why.append(f"asserts the literal {test.value!r}")
    for node in ast.walk(test):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and \
                any(isinstance(v, ast.Constant) and v.value for v in node.values):
            why.append("'or' with a true literal")
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                if _same(left, right) and not isinstance(op, (ast.NotEq, ast.Lt, ast.Gt, ast.IsNot, ast.NotIn)):
                    why.append(f"compares {ast.unparse(left)} with itself")
                elif isinstance(op, (ast.In, ast.NotIn)) and _every_bool(right):
                    why.append(f"{ast.unparse(left)} in every value a bool can take")
                elif _literal(left) and _literal(right):
                    why.append(f"{ast.unparse(left)} {ast.unparse(node)[len(ast.unparse(left)):].split()[0]} "
                               f"{ast.unparse(right)}: two literals")
    return why


def _python_of_cell(source: str) -> str:
    """A code cell as Python: IPython's magics and shell lines blanked (a %%writefile cell is a module: kept)."""
    lines = source.splitlines()
    if lines and lines[0].startswith("%%writefile"):
        return "\n".join(lines[1:])
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)


def notebook_cells(path: Path) -> list[tuple[str, int, str, ast.Module]]:
    """(section heading, cell index, source, syntax tree) of every code cell, the heading being the last `## `."""
    out, section = [], ""
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            section = next((m.group(1) for m in reversed(list(re.finditer(r"^## +(.+)$", source, re.M)))), section)
        elif cell["cell_type"] == "code":
            out.append((section, i, source, ast.parse(_python_of_cell(source))))
    return out


def sources() -> list[tuple[str, ast.Module]]:
    out = [(str(path.relative_to(ROOT)), ast.parse(path.read_text())) for path in TESTS]
    out += [(f"{path.relative_to(ROOT)} cell {i}", tree)
            for path in NOTEBOOKS for _, i, _, tree in notebook_cells(path)]
    return out


def test_no_assert_holds_whatever_was_computed():
    found = [f"{where}:{node.lineno}: {ast.unparse(node.test)[:100]} ({'; '.join(why)})"
             for where, tree in sources() for node in ast.walk(tree)
             if isinstance(node, ast.Assert) and (why := vacuous(node.test))]
    assert not found, "asserts that cannot fail:\n" + "\n".join(found)


def _asserts(tree: ast.AST) -> list[ast.AST]:
    """assert statements, and calls of the course's assert_* helpers (assert_same_grads, ...)."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Assert) or (
        isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id.startswith("assert_"))]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_check_cells_check_something(path):
    """Every code cell of a notebook's *Check yourself* section asserts something."""
    checks = [(i, tree) for section, i, _, tree in notebook_cells(path) if section.startswith("Check yourself")]
    assert checks, "no Check yourself section"
    assert all(_asserts(tree) for _, tree in checks), [i for i, tree in checks if not _asserts(tree)]


@pytest.mark.parametrize("source, reasons", [
    ("assert x == x", ["compares x with itself"]),
    ("assert f(a) <= f(a) and ok", ["compares f(a) with itself"]),
    ("assert rig.peer_access in (True, False)", ["rig.peer_access in every value a bool can take"]),
    ("assert flag in {False, None, True}", ["flag in every value a bool can take"]),
    ("assert 'fits' in ('yes', 'NO')", ["'fits' in ('yes', 'NO'): two literals"]),
    ("assert (x > 0, 'positive')", ["a non-empty tuple is always true (assert (x, 'msg') instead of assert x, 'msg')"]),
    ("assert x.startswith('yes') or True", ["'or' with a true literal"]),
    ("assert x != x", []), ("assert a == b", []), ("assert r['fits'] in ('yes', 'NO')", []),
    ("assert x in (1, 2)", []), ("assert not x", []),
])
def test_the_walk_tells_vacuous_asserts_from_real_ones(source, reasons):
    (node,) = ast.parse(source).body
    assert vacuous(node.test) == reasons
