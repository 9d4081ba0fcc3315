"""Make the student notebooks from the solution notebooks (``make exercises``).

    python -m atlaslib.exercises.generate [--check]

For every ``exercises/solutions/chNN_*.ipynb`` this writes ``exercises/chNN_*.ipynb``:
the same cells, with each block between ``# BEGIN SOLUTION`` and ``# END SOLUTION``
replaced by ``raise NotImplementedError("Exercise N: <title>")`` at the marker's
indentation (the message on lines of its own where the line would pass 88 characters),
and with every output cleared. The exercise number and title come from
the chapter's check module, via the cell metadata ``{"atlaslib": {"exercise": name}}``
and the notebook metadata ``{"atlaslib": {"chapter": "ch01"}}``.
``--check`` writes nothing and exits 1 if a student notebook is stale.
"""
from __future__ import annotations

import argparse
import sys
import textwrap
from pathlib import Path

import nbformat

from . import registry

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "exercises" / "solutions"


WIDTH = 88   # the code cells' width (a line longer than the book's code box scrolls sideways)


def raise_not_implemented(indent: str, message: str) -> list[str]:
    """The stub's lines: one ``raise NotImplementedError(message)``, or, past WIDTH characters, the message
    on lines of its own as adjacent string literals."""
    line = f"{indent}raise NotImplementedError({message!r})"
    if len(line) <= WIDTH:
        return [line]
    inner = indent + " " * 4
    pieces = textwrap.wrap(message, WIDTH - len(inner) - 3, drop_whitespace=False)
    return [f"{indent}raise NotImplementedError(", *(f"{inner}{p!r}" for p in pieces[:-1]),
            f"{inner}{pieces[-1]!r})"]


def strip_solutions(source: str, message: str, where: str) -> str:
    """Replace each BEGIN/END SOLUTION block of ``source`` with a ``raise NotImplementedError``."""
    out, inside = [], False
    for line in source.split("\n"):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if inside:
                raise ValueError(f"{where}: nested '{BEGIN}'")
            inside = True
            indent = line[: len(line) - len(line.lstrip())]
            out += raise_not_implemented(indent, message)
        elif marker.startswith(END):
            if not inside:
                raise ValueError(f"{where}: '{END}' without '{BEGIN}'")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: '{BEGIN}' without '{END}'")
    return "\n".join(out)


def exercise_of(cell) -> str | None:
    return cell.get("metadata", {}).get("atlaslib", {}).get("exercise")


def student_notebook(solution: nbformat.NotebookNode, where: str = "notebook") -> nbformat.NotebookNode:
    """The student copy of a solution notebook (a new object; the input is not modified)."""
    nb = nbformat.from_dict(solution)  # deep copy
    chapter = nb.metadata.get("atlaslib", {}).get("chapter")
    if chapter is None:
        raise ValueError(f"{where}: notebook metadata lacks {{'atlaslib': {{'chapter': ...}}}}")
    exercises = registry(chapter)
    for i, cell in enumerate(nb.cells):
        cell.metadata.pop("execution", None)
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        if BEGIN not in cell.source:
            continue
        name = exercise_of(cell)
        if name is None or name not in exercises.exercises:
            raise ValueError(f"{where}, cell {i}: a solution block needs cell metadata "
                             f"{{'atlaslib': {{'exercise': <one of {list(exercises.exercises)}>}}}}")
        ex = exercises[name]
        cell.source = strip_solutions(cell.source, f"Exercise {ex.number}: {ex.title}", f"{where}, cell {i}")
    return nb


def target_of(path: Path) -> Path:
    return path.parent.parent / path.name


def render(path: Path) -> str:
    """The text the student notebook for solution ``path`` should have."""
    nb = nbformat.read(path, as_version=4)
    return nbformat.writes(student_notebook(nb, where=str(path.name))) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlaslib.exercises.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a student notebook is stale; write nothing")
    args = parser.parse_args(argv)
    sources = sorted(SOLUTIONS.glob("ch*.ipynb"))
    if not sources:                  # e.g. an installed atlaslib, away from the repository's exercises/
        parser.error(f"no exercises/solutions/ch*.ipynb under {ROOT}: run it from the repository's checkout")
    stale = 0
    for path in sources:
        text, target = render(path), target_of(path)
        current = target.read_text() if target.exists() else None
        rel = target.relative_to(ROOT)
        if current == text:
            print(f"up to date  {rel}")
        elif args.check:
            print(f"STALE       {rel} (run: make exercises)")
            stale += 1
        else:
            target.write_text(text)
            print(f"wrote       {rel}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
