"""One text-table format for every notebook and the bench."""
from __future__ import annotations

from typing import Any, Sequence

from helpers.units import fmt_bytes

BYTE_COLUMNS = {"params", "grads", "optimizer", "activations", "total", "bytes", "peak_activation_bytes",
                "free", "capacity", "weights", "kv_cache", "needed", "state"}


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (list, tuple)):
        return " | ".join(_cell(column, v) for v in value)
    is_bytes = column in BYTE_COLUMNS or column.rsplit(" ", 1)[-1] in BYTE_COLUMNS  # "formula params", "cpu:0 grads"
    if is_bytes and isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt_bytes(value)
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an aligned text table; byte columns are shown as KiB/MiB/GiB."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    cells = [[_cell(c, r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])
