"""The grader checks every chapter's exercise tests share: solutions score full marks, the
untouched student copy scores zero through the command line, a planted wrong answer."""
import json
import subprocess
import sys
from pathlib import Path

import nbformat

from atlaslib.exercises.generate import BEGIN, END
from atlaslib.grade import grade, table

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 30   # per cell; the slowest cell (imports) takes a few seconds on 2 busy cores


def chapter_notebooks(stem):
    """(the solutions notebook, the student notebook) of exercises/<stem>.ipynb."""
    return ROOT / "exercises" / "solutions" / f"{stem}.ipynb", ROOT / "exercises" / f"{stem}.ipynb"


def rows(report):
    return {r["exercise"]: r for r in report["exercises"]}


def assert_full_marks(solution, points, timeout):
    report = grade(solution, timeout=timeout, progress=False)
    assert [r["exercise"] for r in report["exercises"]] == list(points)
    assert all(r["status"] == "passed" for r in report["exercises"]), table(report)
    assert report["earned"] == report["points"] == sum(points.values())
    assert report["setup_problems"] == []


def assert_student_scores_zero(student, points, timeout):
    out = subprocess.run([sys.executable, "-m", "atlaslib.grade", str(student), "--json", "--timeout", str(timeout)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["earned"] == 0 and report["points"] == sum(points.values())
    assert {r["exercise"]: r["status"] for r in report["exercises"]} == {n: "not_implemented" for n in points}


def planted_copy(solution, tmp_path, function, body):
    """The solutions notebook, outputs cleared, with the solution block of ``function`` replaced by ``body``."""
    nb = nbformat.read(solution, as_version=4)
    planted = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        lines = cell.source.split("\n")
        if f"def {function}(" not in cell.source:
            continue
        head = next(i for i, line in enumerate(lines) if line.startswith(f"def {function}("))
        start = next(i for i in range(head, len(lines)) if lines[i].strip() == BEGIN)
        end = next(i for i in range(start, len(lines)) if lines[i].strip() == END)
        cell.source = "\n".join(lines[:start] + ["    " + body] + lines[end + 1:])
        planted = True
    assert planted, f"no solution cell defines {function}"
    path = tmp_path / Path(solution).name
    nbformat.write(nb, path)
    return path


def assert_planted_loses_its_points(solution, tmp_path, function, body, points, exercise=None):
    """Grade the solutions with ``function``'s answer replaced by ``body``: its exercise (``exercise``,
    by default named as the function) fails with no points and every other one keeps its own. Returns
    that exercise's row of the report."""
    exercise = exercise or function
    report = grade(planted_copy(solution, tmp_path, function, body), timeout=TIMEOUT, progress=False)
    row = rows(report)[exercise]
    assert row["status"] == "failed" and row["earned"] == 0, table(report)
    assert report["earned"] == report["points"] - points[exercise], table(report)
    return row
