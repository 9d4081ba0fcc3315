"""The grader (python -m atlaslib.grade) on chapter 1: full marks, zero, a wrong, crashing or hanging answer.

Each test runs a whole notebook in a fresh kernel (a few seconds each on 2 cores).
"""
import json
import re
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


def test_the_table_shows_points_and_earned_in_their_columns():
    report = {"notebook": "nb.ipynb", "chapter": "ch01", "setup_problems": [], "points": 7, "earned": 3,
              "exercises": [
                  {"number": 1, "exercise": "first", "points": 5, "earned": 3, "status": "passed", "verdict": ""},
                  {"number": 2, "exercise": "second_one", "points": 2, "earned": 0, "status": "failed",
                   "verdict": "off by 0.5"}]}
    lines = table(report).splitlines()
    assert lines[2].split() == ["#", "exercise", "points", "earned", "verdict"]
    assert lines[3].split() == ["1", "first", "5", "3", "passed"]
    assert lines[4].split() == ["2", "second_one", "2", "0", "failed:", "off", "by", "0.5"]
    assert lines[5].split() == ["total", "7", "3"]


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
B, H, T, K = q.shape
M = q.new_zeros(B, H, v.shape[-1], K)
outs = []
for t in range(T):
    M = M + v[:, :, t, :, None] * k[:, :, t, None, :]
    outs.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))
return torch.stack(outs, dim=2), M
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


def test_a_verdict_names_the_definition_that_was_graded():
    """A notebook that defines a function again in a later cell is graded on the later definition (the kernel
    holds it after the last cell): a timeout or crash must name that cell, not the first one."""
    import functools
    import types

    from atlaslib.grade import Grader
    nb = nbformat.read(SOLUTION, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("def hebbian_step(M, k, v):\n    while True:\n        pass"))
    reader = types.SimpleNamespace(nb=nb)
    reader.cell_name = functools.partial(Grader.cell_name, reader)
    last = sum(c.cell_type == "code" for c in nb.cells)
    assert Grader.defined_in(reader, "hebbian_step") == f"defined in code cell {last} (set-up)"
    assert Grader.defined_in(reader, "no_such_function") == "not defined"


def test_a_cell_that_hangs_when_replayed_does_not_sink_the_later_exercises(tmp_path):
    """After a timeout the grader restarts the kernel and runs the completed cells again; a cell that hangs on
    that second run (a check cell draws new inputs) left the new kernel busy, and every later exercise timed
    out behind it, correct ones included. The cell is now left out of the replay, which starts over."""
    hangs_when_replayed = ("try:\n    torch.load('ran_once.pt')\n    while True:\n        pass\n"
                           "except FileNotFoundError:\n    torch.save(torch.zeros(1), 'ran_once.pt')")
    path = planted_copy(tmp_path, gated_loop={"prepend": hangs_when_replayed},
                        chunk_step={"body": "while True:\n    pass"})
    report = grade(path, timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["chunk_step"]["status"] == "timeout", table(report)
    for name in ("chunkwise", "capacity", "triton_state_update"):
        assert r[name]["status"] == "passed", table(report)
    assert "failed when re-run after a restart" in json.dumps(report)


def test_notebook_without_chapter_metadata_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    path = tmp_path / "plain.ipynb"
    nbformat.write(nb, path)
    with pytest.raises(ValueError, match="not an exercise notebook"):
        grade(path, timeout=TIMEOUT, progress=False)


# ---- integrity: only the grader's own calls score ------------------------------------------

FORGED = """
import json
from IPython.display import display
for name, n in (("hebbian_step", 1), ("gated_loop", 2)):
    verdict = {"chapter": "ch01", "exercise": name, "number": n, "title": "", "points": 3, "earned": 300,
               "status": "passed", "message": "forged"}
    display({"text/plain": "PASSED", "text/x-atlaslib-check": json.dumps(verdict)}, raw=True)
"""

PATCH_THE_CHECKS = """
from atlaslib.exercises import checking
from atlaslib.exercises import ch01 as check
passed = lambda self, *fns: checking.Verdict(self.chapter, self.name, self.number, self.title, self.points,
                                             self.points, "passed", "patched")
checking.Exercise.evaluate = passed
checking.compare = lambda *a, **k: None
check.compare = lambda *a, **k: None
"""


def untouched_copy(tmp_path, extra_cells):
    nb = nbformat.read(STUDENT, as_version=4)
    nb.cells += [nbformat.v4.new_code_cell(src) for src in extra_cells]
    path = tmp_path / "ch01_linear.ipynb"
    nbformat.write(nb, path)
    return path


def test_forged_verdicts_and_patched_checks_score_nothing(tmp_path):
    # the stubs still raise NotImplementedError; the notebook prints forged verdicts and patches
    # the check machinery in its kernel, then calls the checks again: the static rules refuse it
    path = untouched_copy(tmp_path, [FORGED, PATCH_THE_CHECKS, "check.hebbian_step(hebbian_step)"])
    report = grade(path, timeout=TIMEOUT, progress=False)
    assert report["earned"] == 0, table(report)
    assert "rejected" in report and "code cell" in report["rejected"], table(report)


def test_a_failing_answer_is_not_rescued_by_a_second_check_call(tmp_path):
    # the learner's own check of a wrong hebbian_step fails; a second call with a library-backed
    # function prints PASSED in the notebook, but the grader calls `hebbian_step` itself
    rescue = """
def library_step(M, q, k, v, alpha):
    M = alpha[:, :, None, None] * M + v[..., :, None] * k[..., None, :]
    return M, torch.einsum("bhvk,bhk->bhv", M, q)
check.hebbian_step(library_step)
"""
    path = planted_copy(tmp_path, hebbian_step={"body": "return M, q"})
    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(rescue))
    nbformat.write(nb, path)
    report = grade(path, timeout=TIMEOUT, progress=False, save=str(tmp_path / "graded.ipynb"))
    r = rows(report)
    assert r["hebbian_step"]["status"] == "failed" and r["hebbian_step"]["earned"] == 0
    assert report["earned"] == report["points"] - POINTS["hebbian_step"], table(report)
    graded = nbformat.read(tmp_path / "graded.ipynb", as_version=4)
    assert "PASSED" in str(graded.cells[-1].outputs)       # what the notebook showed did not count


def test_library_backed_answers_lose_their_points(tmp_path):
    # the helper the chunkwise exercise may import, used by the exercise it answers: the runtime rule
    report = grade(planted_copy(tmp_path, chunk_step={"body": "return library_chunk_step(M, q, k, v, g)"}),
                   timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["chunk_step"]["status"] == "failed", table(report)
    assert "your answer calls atlaslib.linear.chunk" in r["chunk_step"]["verdict"], table(report)
    assert report["earned"] == report["points"] - POINTS["chunk_step"], table(report)


def test_a_kernel_handed_its_values_as_numbers_scores_nothing(tmp_path):
    """The launcher computes the answer with torch and has a kernel store it entry by entry, each value passed as
    a number: the grader's replay of the launches, on the inputs reordered, stores the same values."""
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    cell = next(c for c in nb.cells if "def state_update(" in c.source)
    launch = "    state_update_kernel[(N,)](M, k, v, g, out, b, K, V, BT=BT, BK=BK, BV=BV)\n"
    assert launch in cell.source
    cell.source = ("@triton.jit\ndef put(out_ptr, i, x):\n    tl.store(out_ptr + i, x)\n\n\n"
                   + cell.source.replace(launch, (
                       "    decayed = torch.einsum('nt,ntv,ntk->nvk', torch.exp(g[:, -1:] - g), v, k)\n"
                       "    want = torch.exp(g[:, -1:])[:, :, None] * M + decayed\n"
                       "    for i, x in enumerate(want.reshape(-1).tolist()):\n"
                       "        put[(1,)](out, i, x)\n")))
    path = tmp_path / "ch01_linear.ipynb"
    nbformat.write(nb, path)
    report = grade(path, timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["triton_state_update"]["status"] == "failed", table(report)
    assert "stored the same values" in r["triton_state_update"]["verdict"], table(report)
    assert report["earned"] == report["points"] - POINTS["triton_state_update"], table(report)


@pytest.mark.parametrize("content, why", [
    ('{"a": 1}', "not a notebook"),
    ('{"cells": [', "invalid JSON"),
    ("", "empty"),
])
def test_a_file_that_is_not_a_notebook_gives_one_line_and_exit_2(tmp_path, content, why):
    path = tmp_path / "bad.ipynb"
    path.write_text(content)
    for extra in ([], ["--json"]):
        out = subprocess.run([sys.executable, "-m", "atlaslib.grade", str(path), *extra],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and why in out.stderr, out.stderr
        if extra:
            assert why in json.loads(out.stdout)["error"]
        else:
            assert out.stdout == ""


@pytest.fixture
def grade_cli(monkeypatch):
    """``atlaslib.grade.main`` with the grading itself replaced by a failure: the options are checked first."""
    from atlaslib import grade as grade_module

    def graded(*args, **kwargs):
        raise AssertionError("a notebook was graded before the options were checked")
    monkeypatch.setattr(grade_module, "grade_in_child", graded)
    monkeypatch.setattr(grade_module, "grade_folder", graded)
    return grade_module.main


@pytest.mark.parametrize("argv, message", [
    (["--timeout", "0"], "error: --timeout must be a positive number of seconds, got 0"),
    (["--timeout", "-1"], "error: --timeout must be a positive number of seconds, got -1"),
    (["--save", "{tmp}/missing/x.ipynb"], "error: --save {tmp}/missing/x.ipynb: no folder {tmp}/missing"),
    (["--csv", "{tmp}/scores.csv"], f"error: --csv is for a folder of notebooks; {STUDENT} is not a folder"),
    (["--fail-under", "-1"], "error: --fail-under must be a number of points >= 0, got -1"),
    (["--save", "{tmp}"], "error: --save {tmp} is a folder; give a file name"),
])
def test_bad_options_are_refused_before_grading(grade_cli, capsys, tmp_path, argv, message):
    with pytest.raises(SystemExit) as exit_:
        grade_cli([str(STUDENT), *(a.format(tmp=tmp_path) for a in argv)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message.format(tmp=tmp_path) in err.strip().splitlines()[-1], err


def test_a_folder_needs_notebooks_and_takes_no_save(grade_cli, capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("not a notebook")
    assert grade_cli([str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == f"no *.ipynb in {tmp_path}"
    assert grade_cli([str(tmp_path), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["error"] == f"no *.ipynb in {tmp_path}"
    (tmp_path / "alice.ipynb").write_text(STUDENT.read_text())
    with pytest.raises(SystemExit) as exit_:
        grade_cli([str(tmp_path), "--save", str(tmp_path / "x.ipynb")])
    assert exit_.value.code == 2
    assert f"error: --save is for a single notebook; {tmp_path} is a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:                    # checked before the folder is graded
        grade_cli([str(tmp_path), "--csv", str(tmp_path / "missing" / "x.csv")])
    assert exit_.value.code == 2
    assert f"error: --csv {tmp_path}/missing/x.csv: no folder {tmp_path}/missing" in capsys.readouterr().err


def test_missing_grading_packages_are_named_before_a_notebook_is_graded(grade_cli, monkeypatch, capsys):
    """Without the ``grade`` extra (nbclient and the rest) the grader says what to install, in one line, instead
    of reporting that the notebook's grading died."""
    import importlib.util

    from atlaslib import grade as grade_module
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "nbclient" else real(name, *a))
    assert grade_cli([str(STUDENT)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "nbclient" in err and "pip install 'atlaslib[grade]'" in err, err
    assert set(grade_module.GRADING_PACKAGES) <= {"nbformat", "nbclient", "jupyter_client", "ipykernel"}


def test_the_grade_extra_lists_the_packages_the_grader_needs():
    import tomllib

    from atlaslib.grade import GRADING_PACKAGES
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["grade"]
    assert sorted(re.split(r"[<>=!~ ]", req)[0] for req in extra) == sorted(GRADING_PACKAGES)


def test_a_notebook_whose_grading_died_exits_2(monkeypatch, capsys):
    """One notebook whose worker died: one line on stderr (and an "error" object with --json), exit status 2."""
    from atlaslib import grade as grade_module
    died = f"{STUDENT}: the grading of this notebook died (exit status -9); nothing was scored"
    monkeypatch.setattr(grade_module, "grade_in_child", lambda path, *a, **k: grade_module.error_report(path, died))
    assert grade_module.main([str(STUDENT)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip() == died
    assert grade_module.main([str(STUDENT), "--json"]) == 2
    assert json.loads(capsys.readouterr().out) == {"notebook": str(STUDENT), "error": died}


def test_fail_under_on_a_folder_counts_fewer_points_only(monkeypatch, capsys, tmp_path):
    """--fail-under N on a folder: exit 1 if a notebook earns fewer than N points; exactly N is enough."""
    from atlaslib import grade as grade_module
    reports = [{"notebook": str(tmp_path / f"{who}.ipynb"), "chapter": "ch01", "exercises": [], "earned": earned,
                "points": 15} for who, earned in (("alice", 5), ("bob", 4))]
    for r in reports:
        Path(r["notebook"]).write_text(STUDENT.read_text())
    graded = []
    monkeypatch.setattr(grade_module, "grade_folder", lambda *a, **k: graded)
    graded[:] = reports[:1]
    assert grade_module.main([str(tmp_path), "--fail-under", "5"]) == 0
    graded[:] = reports
    assert grade_module.main([str(tmp_path), "--fail-under", "5"]) == 1
    assert grade_module.main([str(tmp_path), "--fail-under", "4"]) == 0
    assert "bob.ipynb: 4/15 points" in capsys.readouterr().out


def test_fail_under_sets_the_exit_status():
    args = [sys.executable, "-m", "atlaslib.grade", str(STUDENT), "--timeout", str(TIMEOUT), "--fail-under"]
    assert subprocess.run([*args, "1"], capture_output=True, cwd=ROOT, timeout=300).returncode == 1
    assert subprocess.run([*args, "0"], capture_output=True, cwd=ROOT, timeout=300).returncode == 0


def test_a_folder_of_submissions_gives_one_csv_row_each(tmp_path):
    import csv
    import shutil
    folder = tmp_path / "submissions"
    folder.mkdir()
    shutil.copy(SOLUTION, folder / "alice.ipynb")
    shutil.copy(STUDENT, folder / "bob.ipynb")
    (folder / "carol.ipynb").write_text('{"a": 1}')
    # mallory kills the process that started her kernel; dave's metadata names a list, erin's a string
    shutil.copy(with_code(tmp_path, setup="import os\nos.kill(os.getppid(), 9)"), folder / "mallory.ipynb")
    for who, metadata in (("dave", {"chapter": ["ch01"]}), ("erin", "ch01")):
        nb = nbformat.read(STUDENT, as_version=4)
        nb.metadata["atlaslib"] = metadata
        nbformat.write(nb, folder / f"{who}.ipynb")
    scores = tmp_path / "scores.csv"
    out = subprocess.run([sys.executable, "-m", "atlaslib.grade", str(folder), "--csv", str(scores),
                          "--timeout", str(TIMEOUT), "--fail-under", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 1, out.stderr          # all but alice are below 1 point
    with open(scores, newline="") as f:
        by_name = {Path(r["notebook"]).stem: r for r in csv.DictReader(f)}
    assert set(by_name) == {"alice", "bob", "carol", "dave", "erin", "mallory"}
    assert by_name["mallory"]["earned"] == "0" and "code cell 1 (set-up)" in by_name["mallory"]["error"]
    assert "'atlaslib.chapter' should be a string" in by_name["dave"]["error"]
    assert "'atlaslib' should be an object" in by_name["erin"]["error"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".scores")] == []   # no temporary left
    assert by_name["alice"]["earned"] == by_name["alice"]["points"] == str(sum(POINTS.values()))
    assert all(by_name["alice"][name] == str(points) for name, points in POINTS.items())
    assert by_name["bob"]["earned"] == "0" and by_name["bob"]["error"] == ""
    assert all(by_name["bob"][name] == "0" for name in POINTS)
    assert "not a notebook" in by_name["carol"]["error"]


# ---- the static rules: a notebook that reaches past them is refused before it runs --------------

def test_the_rules_name_every_module_a_chain_may_reach():
    """The screen lets attribute chains pass through ``TRAVERSABLE_MODULES`` and refuses every other module:
    the exercises' README lists them (by their names through ``torch`` and ``triton.language``), and every
    statement's *Allowed* line points there."""
    from atlaslib.exercises.checking import ALLOWED_MODULES, TRAVERSABLE_MODULES
    readme = " ".join((ROOT / "exercises" / "README.md").read_text().split())
    for module in sorted(TRAVERSABLE_MODULES - set(ALLOWED_MODULES)):
        name = module.replace("triton.language.", "")
        assert f"`{name}`" in readme, module
    for path in sorted((ROOT / "exercises").glob("**/ch0*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if "*Allowed:*" in cell.source:
                assert "namespaces of it that `exercises/README.md` lists" in cell.source, path.name

def with_code(tmp_path, setup="", exercise=None, code="", body=None, name="ch01_linear.ipynb", source=SOLUTION):
    """A copy of the solutions with ``setup`` appended to the set-up cell and ``code`` put before the
    solution cell of ``exercise`` (or its solution block replaced by ``body``)."""
    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    if setup:
        first = next(c for c in nb.cells if c.cell_type == "code")
        first.source += "\n" + setup
    if exercise is not None:
        if code:
            plant(nb, exercise, prepend=code)
        if body:
            plant(nb, exercise, body=body)
    path = tmp_path / name
    nbformat.write(nb, path)
    return path


LIBRARY_CALL = "return via(q, k, v, alpha=alpha, output_final_state=True, backend='chunk', chunk_size=chunk_size)"
ESCAPES = {   # what a dishonest notebook tries -> where the rule must stop it
    "input_transformer": dict(setup="def rewrite(lines):\n    return lines\n"
                                    "get_ipython().input_transformers_cleaned.append(rewrite)"),
    "importlib_patched": dict(setup="import importlib\nreal = importlib.import_module\n"
                                    "importlib.import_module = lambda name, *a: real(name, *a)"),
    "default_argument": dict(exercise="chunkwise", body=LIBRARY_CALL,
                             code="from atlaslib.linear import linear_attention\n"
                                  "def helper(f=linear_attention):\n    return f\nvia = helper()"),
    "closure": dict(exercise="chunkwise", body=LIBRARY_CALL,
                    code="def make():\n    from atlaslib.linear import linear_attention as f\n"
                         "    return lambda *a, **k: f(*a, **k)\nvia = make()"),
    "partial": dict(exercise="chunkwise", body=LIBRARY_CALL,
                    code="import functools\nfrom atlaslib import linear\n"
                         "via = functools.partial(linear.linear_attention)"),
    "function_copy": dict(exercise="chunkwise", body=LIBRARY_CALL,
                          code="import types\nfrom atlaslib.linear import linear_attention as f\n"
                               "via = types.FunctionType(f.__code__, f.__globals__)"),
    "list": dict(exercise="chunkwise", body="return vias[0](q, k, v, alpha=alpha, output_final_state=True, "
                                            "backend='chunk', chunk_size=chunk_size)",
                 code="import atlaslib.linear\nvias = [atlaslib.linear.linear_attention]"),
    "checks_module": dict(exercise="chunkwise", body=LIBRARY_CALL, code="via = check.linear_attention"),
    "magic": dict(setup="%load_ext autoreload"),
    "shell": dict(setup="!sleep 100 &"),
    "kill_the_grader": dict(setup="import os\nos.kill(os.getppid(), 9)"),
    "detached_process": dict(setup="import subprocess\nsubprocess.Popen(['sh', '-c', 'sleep 3; echo 15 > scores.csv'], "
                                   "start_new_session=True)"),
    "kernel_launch_patched": dict(setup="triton.runtime.jit.JITFunction.run = lambda self, *a, **k: None"),
    "dunder": dict(exercise="chunkwise", code="g = check.chunkwise.__class__"),
    "eval": dict(exercise="chunkwise", code="via = eval('1')"),
    "getattr_globals": dict(setup="from atlaslib.linear.chunk import chunk_step\n"
                                  "g = getattr(chunk_step, '__glo' + 'bals__')\n"
                                  "imp = g['__builtins__']['__imp' + 'ort__']\nimp('subprocess').run(['true'])"),
    "builtin_shadowed": dict(setup="def isinstance(*a):\n    return True"),
    "module_chain": dict(setup="import torch\nshell = torch.glob.re.enum"),
    "ipython_shadowed": dict(setup="def get_ipython():\n    return None"),
}


@pytest.mark.parametrize("attack", list(ESCAPES))
def test_escape_hatches_are_refused_before_anything_runs(tmp_path, attack):
    path = with_code(tmp_path, **ESCAPES[attack])
    report = grade(path, timeout=TIMEOUT, progress=False)
    assert report["earned"] == 0 and "rejected" in report, table(report)
    assert report["points"] == sum(POINTS.values())              # what the notebook could have earned
    reason = report["rejected"]
    assert reason.startswith("code cell ") and "\n" not in reason, reason
    cell = "(set-up)" if "setup" in ESCAPES[attack] else "(exercise chunkwise)"
    assert cell in reason, reason
    assert all(r["status"] == "error" and reason in r["verdict"] for r in report["exercises"]), table(report)


SCREENED = [   # (a cell, what the refusal names): the screen alone must refuse each, nothing runs
    ("from atlaslib.linear.chunk import chunk_step\ng = getattr(chunk_step, '__glo' + 'bals__')", "`getattr`"),
    ("import torch\nsetattr(torch, 'exp', torch.log)", "`setattr`"),
    ("import torch\nnames = vars(torch)", "`vars`"),
    ("names = globals()", "`globals`"),
    ("f = open('scores.csv', 'w')", "`open`"),
    ("code = compile('1', 'cell', 'eval')", "`compile`"),
    ("import torch\nlow = torch._C", "`._C`"),
    ("def wipe(out):\n    out._guarded_base.fill_(1234.5)", "`._guarded_base`"),
    ("def f():\n    pass\nspace = f.__globals__", "`.__globals__`"),
    ("def frame_of(tb):\n    return tb.tb_frame", "`.tb_frame`"),
    ("from atlaslib.linear.chunk import linear_attention_chunk",     # not the one name its module may give
     "`from atlaslib.linear.chunk import linear_attention_chunk` is not allowed"),
    # modules reached through torch's attributes: builtins, operator, TorchScript, a shell command
    ("import torch\nshell = torch.glob.re.enum", "reaches the module `glob`"),
    ("import torch\nget = torch.functional.operator", "reaches the module `torch.functional`"),
    ("import torch\nfrom atlaslib.linear.chunk import chunk_step\ncopy = torch.jit.trace(chunk_step, ())",
     "reaches the module `torch.jit`"),
    ("import torch\ntorch.utils.collect_env.run('id')", "reaches the module `torch.utils`"),
    ("from torch import glob", "`from torch import glob` is not allowed"),
    ("import torch\nt = torch\nre = t.glob.re", "the module `torch` may only be used through its attributes"),
    ("import torch\ndef lib():\n    return torch", "the module `torch` may only be used through its attributes"),
    ("import triton\nlanguage = triton.language", "`triton.language` is a module"),
    ("def node_backward(x, dx):\n    return x.grad_fn(dx)", "`.grad_fn`"),
    ("def run(space):\n    return space.exec('1')", "`.exec`"),
    # a module reached from a call's result, which the chain rule cannot follow
    ("import torch\nx = torch.get_device_module('cpu').torch", "`.get_device_module`"),
    ("import torch\nx = torch.cpu_module().torch.glob.re.enum.bltns", "`.bltns`"),
    ("import torch\nx = torch.nn.Module().eval('1 + 1')", "`.eval(...)` with an argument"),
]


@pytest.mark.parametrize("source, named", SCREENED, ids=[
    "getattr", "setattr", "vars", "globals", "open", "compile", "private_attribute", "guard_band", "function_globals",
    "frame", "library_function", "builtins_via_torch", "operator_via_torch", "torchscript", "shell_via_torch",
    "module_import", "module_alias", "module_returned", "submodule_alias", "autograd_node", "exec_attribute",
    "device_module", "builtins_alias", "eval_attribute"])
def test_the_screen_refuses_hostile_cells_and_names_the_cell(source, named):
    from atlaslib.exercises.checking import Rejected, screen
    cells = [("code cell 1 (set-up)", "import torch"), ("code cell 2", source)]
    with pytest.raises(Rejected) as refused:        # the chapter's own allowances: chunk_step may be imported
        screen(cells, "ch01", set(POINTS), registry("ch01").helpers)
    assert str(refused.value).startswith("code cell 2: ") and named in str(refused.value), refused.value


@pytest.mark.parametrize("source", ["from torch.linalg import solve_triangular", "import torch.linalg as LA",
                                    "from torch.special import ndtr", "import torch.nn.functional as F",
                                    "import torch\ngpu = torch.cuda.is_available()\nspectrum = torch.fft.rfft",
                                    "import triton\nimport triton.language as tl\nn = triton.next_power_of_2(5)",
                                    "from torch import nn\nact = nn.functional.gelu",
                                    # a function's own variable named like a module alias of the set-up cell
                                    "import torch.nn.functional as F\ndef width(x):\n    N, T, F = x.shape\n"
                                    "    return F",
                                    "import triton.language as tl\ndef scale(tl, x):\n    return x * tl",
                                    "import torch\nsigned = torch.qint8.is_signed\nm = torch.nn.Module().eval()"])
def test_the_screen_lets_torch_submodules_be_imported(source):
    """The statements allow `torch`, and point at torch.linalg.solve_triangular: importing it is allowed too."""
    from atlaslib.exercises.checking import screen
    cells = [("code cell 1 (set-up)", "import torch"), ("code cell 2", source)]
    screen(cells, "ch01", set(POINTS), registry("ch01").helpers)


@pytest.mark.parametrize("name, builtin", [("input", True), ("open", True), ("vars", True), ("In", False),
                                           ("importlib", False)])
def test_a_refused_name_says_when_it_may_be_the_readers_own_variable(name, builtin):
    from atlaslib.exercises.checking import Rejected, screen
    cells = [("code cell 1 (set-up)", "import torch"), ("code cell 2", f"def f({name}):\n    return {name} + 1")]
    with pytest.raises(Rejected) as refused:
        screen(cells, "ch01", set(POINTS), registry("ch01").helpers)
    message = str(refused.value)
    assert message.startswith(f"code cell 2: `{name}` is not allowed in a graded notebook"), message
    assert ("rename it" in message) == builtin, message


def test_the_static_rules_pass_every_shipped_notebook():
    from atlaslib.grade import screen_notebook
    for path in sorted((ROOT / "exercises").glob("**/ch*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        assert screen_notebook(nb, nb.metadata["atlaslib"]["chapter"]) is None, path


# ---- the Triton exercise: the output must be the notebook's own kernel's stores --------------------

EMPTY_KERNEL_AND_TORCH = "    pass"        # the kernel stores nothing; the launcher writes the answer in torch


def test_an_empty_kernel_with_a_torch_result_scores_zero_and_a_hang_in_a_check_is_a_timeout(tmp_path):
    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    plant(nb, "triton_state_update", body="pass")
    cell = next(c for c in nb.cells if "def state_update(" in c.source)
    cell.source = cell.source.replace("    return out", "    g_last = g[:, -1:]\n"
                                      "    decayed = v * torch.exp(g_last - g)[..., None]\n"
                                      "    out.copy_(torch.exp(g_last)[..., None] * M + decayed.mT @ k)\n"
                                      "    return out")
    # a chunkwise that only hangs when the grader calls it: its own check cell is gone
    plant(nb, "chunkwise", body="while True:\n    pass")
    nb.cells = [c for c in nb.cells if "check.chunkwise(" not in c.source]
    path = tmp_path / "ch01_linear.ipynb"
    nbformat.write(nb, path)
    report = grade(path, timeout=TIMEOUT, progress=False)
    r = rows(report)
    assert r["triton_state_update"]["earned"] == 0 and r["triton_state_update"]["status"] == "failed", table(report)
    assert "not stored by your @triton.jit kernel" in r["triton_state_update"]["verdict"], table(report)
    assert r["chunkwise"]["status"] == "timeout", table(report)
    verdict = r["chunkwise"]["verdict"]
    assert verdict.startswith("your function ran longer") and "CallAborted" not in verdict
    assert "timeout: your function ran longer" in table(report) and "timeout: timeout" not in table(report)
    assert report["earned"] == report["points"] - POINTS["triton_state_update"] - POINTS["chunkwise"], table(report)


def test_a_store_past_the_end_in_the_notebooks_process_loses_its_points(tmp_path):
    """The kernel runs in the notebook's process: what it stored there, the guard bands around the output
    included, must come back to the check, or a store past the end would go unseen."""
    nb = nbformat.read(SOLUTION, as_version=4)
    store = "    tl.store(out_ptr + state, M_next, mask=mask_state)"
    one_past = "    tl.store(out_ptr + state, M_next, mask=mask_state | ((r[:, None] == V) & (c[None, :] == 0)))"
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    cell = next(c for c in nb.cells if store in c.source)
    cell.source = cell.source.replace(store, one_past)        # row V, column 0: one entry past each matrix
    path = tmp_path / "ch01_linear.ipynb"
    nbformat.write(nb, path)
    report = grade(path, timeout=TIMEOUT, progress=False)
    row = rows(report)["triton_state_update"]
    assert row["status"] == "failed" and "wrote 1 value(s) past the end of out" in row["verdict"], table(report)
    assert report["earned"] == report["points"] - POINTS["triton_state_update"], table(report)


# ---- the sandbox: every process the notebook started ends with its grading ------------------------

def test_the_sandbox_ends_detached_processes(tmp_path):
    import os
    import time

    from atlaslib.grade import Sandbox, _process_table
    (tmp_path / "box").mkdir()
    sandbox = Sandbox(tmp_path / "box")
    # a child that double-forks a daemon in a session of its own, as a notebook could
    daemon = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
              "        open('pid', 'w').write(str(os.getpid()))\n        time.sleep(60)\n    os._exit(0)\n"
              "os.wait()\n")
    kw = sandbox.popen_args()
    kw.pop("user", None), kw.pop("group", None), kw.pop("extra_groups", None)
    subprocess.run([sys.executable, "-c", daemon], **kw, timeout=60)
    for _ in range(100):
        if (sandbox.work / "pid").exists() and (sandbox.work / "pid").read_text():
            break
        time.sleep(0.05)
    pid = int((sandbox.work / "pid").read_text())
    assert pid in _process_table()
    sandbox.end()
    time.sleep(0.2)
    gone = pid not in _process_table() or open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    assert gone
    assert os.getpid() in _process_table()


# ---- a folder run survives any one submission ---------------------------------------------------

@pytest.mark.parametrize("metadata, why", [
    ({"atlaslib": {"chapter": ["ch01"]}}, "'atlaslib.chapter' should be a string"),
    ({"atlaslib": "ch01"}, "'atlaslib' should be an object"),
])
def test_malformed_metadata_gives_one_line_and_exit_2(tmp_path, metadata, why):
    nb = nbformat.read(STUDENT, as_version=4)
    nb.metadata.update(metadata)
    path = tmp_path / "odd.ipynb"
    nbformat.write(nb, path)
    out = subprocess.run([sys.executable, "-m", "atlaslib.grade", str(path)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and why in out.stderr, out.stderr


def test_a_worker_that_dies_is_an_error_row(tmp_path, monkeypatch):
    from atlaslib import grade as grade_module
    suicidal = tmp_path / "python"
    suicidal.write_text("#!/bin/sh\nkill -9 $$\n")
    suicidal.chmod(0o755)
    monkeypatch.setattr(grade_module.sys, "executable", str(suicidal))
    report = grade_module.grade_in_child(STUDENT, TIMEOUT, progress=False)
    assert report["earned"] == 0 and "died (exit status -9)" in report["error"], report


def test_files_the_grader_writes_follow_the_umask(tmp_path):
    """--save and --csv files are written through a temporary file (mkstemp: owner-only); the file that
    stays gets the permissions open() would give it, so a class's scores are readable as the umask says."""
    import os

    from atlaslib.grade import write_atomically
    old = os.umask(0o022)
    try:
        write_atomically(tmp_path / "scores.csv", lambda f: f.write("name,points\n"))
    finally:
        os.umask(old)
    assert (tmp_path / "scores.csv").stat().st_mode & 0o777 == 0o644
