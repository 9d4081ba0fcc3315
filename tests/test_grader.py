"""The grader (python -m atlaslib.grade) on chapter 1: full marks, zero, a wrong, crashing or hanging answer.

Each test runs a whole notebook in a fresh kernel (a few seconds each on 2 cores).
"""
import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from atlaslib.exercises import registry
from atlaslib.exercises.generate import BEGIN, END
from atlaslib.grade import grade, table

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "exercises" / "solutions" / "ch01_linear.ipynb"
STUDENT = ROOT / "exercises" / "ch01_linear.ipynb"
POINTS = {e.name: e.points for e in registry("ch01")}
TIMEOUT = 20   # per cell; the slowest cell of the notebook (imports) takes ~6 s on 2 busy cores


def rows(report):
    return {r["exercise"]: r for r in report["exercises"]}


def plant(nb, exercise, body=None, prepend=None):
    """Replace the first solution block of ``exercise`` with ``body``, or put ``prepend`` before its cell."""
    for cell in nb.cells:
        if cell.get("metadata", {}).get("atlaslib", {}).get("exercise") == exercise and BEGIN in cell.source:
            if prepend is not None:
                cell.source = prepend + "\n" + cell.source
                return
            lines = cell.source.split("\n")
            start = next(i for i, line in enumerate(lines) if line.strip().startswith(BEGIN))
            end = next(i for i, line in enumerate(lines) if line.strip().startswith(END))
            indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
            new = [indent + line for line in body.strip("\n").split("\n")]
            cell.source = "\n".join(lines[:start] + new + lines[end + 1:])
            return
    raise AssertionError(f"no solution cell for {exercise}")


def planted_copy(tmp_path, **plants):
    nb = nbformat.read(SOLUTION, as_version=4)
    for exercise, kw in plants.items():
        plant(nb, exercise, **kw)
    for cell in nb.cells:          # grade from a clean notebook, like a learner's
        if cell.cell_type == "code":
            cell.outputs = []
    path = tmp_path / "ch01_linear.ipynb"
    nbformat.write(nb, path)
    return path


def test_solutions_score_full_marks():
    report = grade(SOLUTION, timeout=TIMEOUT, progress=False)
    assert [r["exercise"] for r in report["exercises"]] == list(POINTS)
    assert all(r["status"] == "passed" for r in report["exercises"]), table(report)
    assert report["earned"] == report["points"] == sum(POINTS.values())
    assert report["setup_problems"] == []


def test_untouched_student_notebook_scores_zero_via_cli():
    out = subprocess.run([sys.executable, "-m", "atlaslib.grade", str(STUDENT), "--json", "--timeout", str(TIMEOUT)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["earned"] == 0 and report["points"] == sum(POINTS.values())
    assert {r["exercise"]: r["status"] for r in report["exercises"]} == {n: "not_implemented" for n in POINTS}


def test_wrong_answer_loses_exactly_its_points(tmp_path):
    # gated_loop that forgets to apply the gates: plain linear attention
    wrong = """
from atlaslib.linear import linear_attention
return linear_attention(q, k, v, output_final_state=True)
"""
    report = grade(planted_copy(tmp_path, gated_loop={"body": wrong}), timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["gated_loop"]["status"] == "failed" and r["gated_loop"]["earned"] == 0
    assert "relative RMSE" in r["gated_loop"]["verdict"]
    assert report["earned"] == report["points"] - POINTS["gated_loop"], table(report)


def test_crashing_and_hanging_answers_are_reported_not_fatal(tmp_path):
    path = planted_copy(
        tmp_path,
        hebbian_step={"body": "return 1 / 0"},                              # raises when the check calls it
        capacity={"prepend": 'raise RuntimeError("planted crash")'},        # the cell itself raises
        chunkwise={"body": "while True:\n    pass"},                        # hangs inside the check
    )
    report = grade(path, timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["hebbian_step"]["status"] == "error" and "ZeroDivisionError" in r["hebbian_step"]["verdict"]
    assert "Traceback" not in r["hebbian_step"]["verdict"]
    assert r["capacity"]["status"] == "error" and "RuntimeError: planted crash" in r["capacity"]["verdict"]
    assert r["chunkwise"]["status"] == "timeout" and f"longer than {TIMEOUT} s" in r["chunkwise"]["verdict"]
    # the kernel was restarted after the timeout and the later exercises still scored
    for name in ("gated_loop", "chunk_step", "triton_state_update"):
        assert r[name]["status"] == "passed", table(report)
    assert report["earned"] == POINTS["gated_loop"] + POINTS["chunk_step"] + POINTS["triton_state_update"]
    text = table(report)
    assert "timeout" in text and "total" in text


def test_notebook_without_chapter_metadata_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    path = tmp_path / "plain.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match="not an exercise notebook"):
        grade(path, timeout=TIMEOUT, progress=False)
