"""Aligned text tables of a list of dicts: the one formatter of the benchmark, the training
comparisons, the experiments and the AOT report."""
from __future__ import annotations


def _fmt(x, digits):
    if x is None:
        return "grows with T"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def format_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> str:
    """An aligned text table of a list of dicts (floats rounded to ``digits``; None -> 'grows with T')."""
    if not rows:
        return "(no rows)"
    columns = columns or list(rows[0])
    cells = [[_fmt(r.get(c), digits) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def print_table(rows: list[dict], columns: list[str] | None = None, digits: int = 3) -> None:
    """Print ``format_table(rows, columns, digits)``."""
    print(format_table(rows, columns, digits))
