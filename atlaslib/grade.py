"""Grade an exercise notebook: ``python -m atlaslib.grade NOTEBOOK [--json] [--timeout S] [--fail-under N]``.

The notebook runs top to bottom in a fresh kernel, one cell at a time, with a time
limit per cell, so that the learner's functions get defined (and the learner's own check
calls show their feedback in the saved copy). Then the grader computes every verdict
itself: for each exercise of the chapter it draws fresh inputs in its own process, sends
them to the kernel, calls the learner's function there (by the name the exercise asks
for), brings the results back as data (tensors and numbers only) and compares them in its
own process. Nothing the notebook displays, and no code run in its kernel, can change a
score: a check's printed verdict is only feedback.

* The exercises, their points, the names of the functions they ask for and what an answer
  may not call come from the chapter's check module (``atlaslib.exercises.<chapter>``),
  named by the notebook metadata ``{"atlaslib": {"chapter": "ch01"}}``.
* Cells tagged ``{"atlaslib": {"exercise": name}}`` belong to that exercise; the
  others are set-up cells.
* A cell that raises is reported on its exercise's row and grading goes on.
* A cell or a grader's call that runs past the time limit is reported on its row; the
  kernel is then restarted, the cells that had completed run again, and grading goes on.

Exit status 0 when grading completed (1 with ``--fail-under N`` and fewer than N points);
2 if the file cannot be graded at all (missing, not a notebook, no chapter metadata) — one
line on stderr, and a JSON ``{"error": ...}`` on stdout with ``--json``.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_TIMEOUT = 60
TIMEOUT, CRASH, NOT_RUN = "timeout", "error", "not_run"


@dataclass
class Row:
    number: int
    exercise: str
    title: str
    points: int
    earned: int = 0
    status: str = NOT_RUN
    verdict: str = "its check never ran"
    problems: list = field(default_factory=list)   # crashes / timeouts in the exercise's cells


def exercise_of(cell) -> str | None:
    return cell.get("metadata", {}).get("atlaslib", {}).get("exercise")


def error_in(cell) -> str | None:
    """``ExcName: message`` of the first error a cell raised, if any."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            msg = " ".join(str(out.get("evalue", "")).split())
            return f"{out.get('ename', 'Error')}: {msg[:300]}" if msg else out.get("ename", "Error")
    return None


class Kernel:
    """An nbclient kernel that can be thrown away and restarted after a timeout.

    Kernels run on the interpreter running the grader (the project's .venv), whatever other
    'python3' kernels the user has installed.
    """

    def __init__(self, nb, timeout: float, cwd: str):
        from nbclient import NotebookClient
        self.client = NotebookClient(nb, timeout=max(1, math.ceil(timeout)), allow_errors=True,
                                     interrupt_on_timeout=False, kernel_name="python3",
                                     shutdown_kernel="immediate", resources={"metadata": {"path": cwd}})
        self.start()

    def start(self):
        from jupyter_client import AsyncKernelManager
        from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

        class ThisPython(KernelSpecManager):
            def get_kernel_spec(self, kernel_name):
                return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                  display_name="atlaslib grader", language="python", resource_dir=".")

        c = self.client
        c.km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ThisPython())
        c.start_new_kernel(stderr=subprocess.DEVNULL)   # the kernel's own log lines are noise here
        c.start_new_kernel_client()

    def stop(self):
        if self.client.km is not None:
            try:
                self.client._cleanup_kernel()
            except Exception:  # the kernel is gone already; nothing to clean
                self.client.km = self.client.kc = None

    def restart(self):
        self.stop()
        self.start()

    def run(self, cell, index: int) -> str | None:
        """Execute one cell; None if it completed (errors stay in its outputs), else 'timeout'/'died'."""
        from nbclient.exceptions import CellTimeoutError, DeadKernelError
        try:
            self.client.execute_cell(cell, index)
        except CellTimeoutError:
            return "timeout"
        except DeadKernelError:
            return "died"
        return None


# Runs in the learner's kernel: call one function on the inputs the grader saved, save what
# came back (the result and the arguments afterwards, to see in-place writes) or the error.
CALL_IN_KERNEL = """
def __atlaslib_grader_call():
    import torch
    args, kwargs = torch.load({src!r}, weights_only=True)
    namespace = get_ipython().user_ns

    def plain(x):
        if isinstance(x, torch.Tensor):
            return x.detach()
        if isinstance(x, (tuple, list)):
            return type(x)(plain(y) for y in x)
        if type(x).__module__ == "numpy":
            return torch.from_numpy(x) if hasattr(x, "shape") and x.shape else x.item()
        return x

    try:
        if {name!r} not in namespace:
            raise NameError("your notebook does not define `{name}` (the function this exercise asks for)")
        result, launches = __atlaslib_run_under_rules(namespace[{name!r}], args, kwargs, {forbidden!r}, [namespace])
        out = {{"ok": True, "result": plain(result), "args": args, "kwargs": kwargs, "launches": launches}}
    except BaseException as e:
        seen = set()
        while type(e).__name__ == "InterpreterError" and e.__cause__ is not None and id(e) not in seen:
            seen.add(id(e))
            e = e.__cause__
        stub = isinstance(e, NotImplementedError) or (
            type(e).__name__ == "CompilationError" and "NotImplementedError" in str(e))
        out = {{"ok": False, "ename": type(e).__name__, "message": " ".join(str(e).split())[:400],
                "not_implemented": stub}}
    try:
        torch.save(out, {dst!r})
    except Exception as e:
        torch.save({{"ok": False, "ename": "TypeError", "not_implemented": False,
                    "message": f"the grader cannot read what your function returned ({{e}}): "
                               "return tensors, numbers, or tuples of them"}}, {dst!r})


__atlaslib_grader_call()
del __atlaslib_grader_call, __atlaslib_run_under_rules
"""


class KernelFunction:
    """A learner's function that lives in the grading kernel; the checks call it like a local one."""

    def __init__(self, grader: "Grader", name: str):
        self.grader, self.name = grader, name

    def __call__(self, *args, **kwargs):
        raise TypeError("call through atlaslib.exercises.checking.call")

    def remote_call(self, args, kwargs, forbidden):
        import inspect

        import torch

        from .exercises.checking import CallAborted, RemoteError, run_under_rules
        src, dst = self.grader.scratch / "in.pt", self.grader.scratch / "out.pt"
        dst.unlink(missing_ok=True)
        torch.save((tuple(args), dict(kwargs)), src)
        helper = inspect.getsource(run_under_rules).replace("def run_under_rules(", "def __atlaslib_run_under_rules(")
        code = helper + CALL_IN_KERNEL.format(src=str(src), dst=str(dst), name=self.name, forbidden=tuple(forbidden))
        outcome = self.grader.run_scratch(code)
        if outcome is not None:
            raise CallAborted(outcome)
        try:
            out = torch.load(dst, weights_only=True)
        except Exception as e:   # no file, or one holding more than data
            raise RemoteError("TypeError", f"the grader could not read the result back ({type(e).__name__})") from None
        if not out["ok"]:
            raise RemoteError(out["ename"], out["message"], out["not_implemented"])
        for mine, theirs in zip([*args, *kwargs.values()], [*out["args"], *out["kwargs"].values()]):
            if isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor):
                # the whole storage: a guarded buffer's bands travel with it, and so do stray writes
                mine.untyped_storage().copy_(theirs.untyped_storage())
        return out["result"], out["launches"]


class Grader:
    """One notebook in one kernel: run its cells, then compute each exercise's verdict."""

    def __init__(self, path: Path, nb, chapter: str, timeout: float, scratch: Path):
        from .exercises import registry
        self.path, self.nb, self.chapter, self.timeout, self.scratch = path, nb, chapter, timeout, scratch
        self.exercises = list(registry(chapter))
        self.rows = {e.name: Row(e.number, e.name, e.title, e.points) for e in self.exercises}
        self.setup_problems: list = []
        self.completed: list[int] = []          # cells that ran to the end, re-run after a restart
        self.kernel = Kernel(nb, timeout, str(path.resolve().parent))

    def problem(self, name, text):
        (self.rows[name].problems if name in self.rows else self.setup_problems).append(text)

    def restart(self):
        """A fresh kernel, and every cell that had completed run again."""
        self.kernel.restart()
        for j in self.completed:
            if self.kernel.run(self.nb.cells[j], j) is not None:
                self.setup_problems.append((CRASH, f"{self.cell_name(j)} failed when re-run after a restart"))
                break

    def run_cells(self, progress: bool):
        from tqdm.auto import tqdm
        cells = [(i, c) for i, c in enumerate(self.nb.cells) if c.cell_type == "code" and c.source.strip()]
        bar = tqdm(cells, desc=f"running {self.path.name}", unit="cell", disable=None if progress else True,
                   file=sys.stderr)
        for i, cell in bar:
            name = exercise_of(cell)
            outcome = self.kernel.run(cell, i)
            if outcome is not None:
                what = f"ran longer than {self.timeout:g} s" if outcome == "timeout" else "killed the kernel"
                self.problem(name, (TIMEOUT if outcome == "timeout" else CRASH, f"{self.cell_name(i)} {what}"))
                self.restart()
                continue
            self.completed.append(i)
            err = error_in(cell)
            if err:
                self.problem(name, (CRASH, f"{self.cell_name(i)} raised {err}"))

    def cell_name(self, i: int) -> str:
        """A cell as a reader finds it: its exercise, and its place among the code cells."""
        n = sum(1 for c in self.nb.cells[:i + 1] if c.cell_type == "code")
        name = exercise_of(self.nb.cells[i])
        return f"code cell {n}" + (f" (exercise {name})" if name else " (set-up)")

    def run_scratch(self, code: str) -> str | None:
        """Run the grader's own code in the kernel (a cell that is not kept in the notebook)."""
        import nbformat
        cell = nbformat.v4.new_code_cell(code)
        self.nb.cells.append(cell)
        try:
            outcome = self.kernel.run(cell, len(self.nb.cells) - 1)
        finally:
            self.nb.cells.pop()
        if outcome is not None:
            self.restart()
        return outcome

    def score(self, progress: bool):
        from tqdm.auto import tqdm

        from .exercises.checking import PASSED, CallAborted
        for ex in tqdm(self.exercises, desc=f"grading {self.path.name}", unit="exercise",
                       disable=None if progress else True, file=sys.stderr):
            row = self.rows[ex.name]
            if any(kind == TIMEOUT for kind, _ in row.problems):   # it hung once already: do not wait again
                row.status, row.verdict = row.problems[0]
                continue
            try:
                v = ex.evaluate(*(KernelFunction(self, name) for name in ex.functions))
            except CallAborted as e:
                what = f"ran longer than {self.timeout:g} s" if str(e) == "timeout" else "killed the kernel"
                row.status, row.verdict = TIMEOUT if str(e) == "timeout" else CRASH, f"your function {what}"
                continue
            undefined = "your notebook does not define" in v.message
            if v.status != PASSED and row.problems and undefined:   # the crash explains why
                row.status, row.verdict = row.problems[0]
            else:
                row.status, row.verdict, row.earned = v.status, v.message, v.earned


def grade(path, timeout: float = DEFAULT_TIMEOUT, save: str | None = None, progress: bool = True) -> dict:
    """Run the notebook at ``path`` and return the score report (see ``--json``)."""
    import tempfile

    path = Path(path)
    nb = read_notebook(path)
    chapter = nb.metadata.get("atlaslib", {}).get("chapter")
    if chapter is None:
        raise ValueError(f"{path}: not an exercise notebook (no 'atlaslib.chapter' in its metadata)")
    import os

    import torch
    if not torch.cuda.is_available():
        # The learner's Triton kernels run in the notebook's kernel, in the interpreter when there is
        # no GPU (its set-up cell says so); the checks in this process pick their device to match.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .exercises import CHAPTERS
    if chapter not in CHAPTERS:
        raise ValueError(f"{path}: unknown chapter {chapter!r} in its metadata (known: {', '.join(CHAPTERS)})")
    with tempfile.TemporaryDirectory(prefix="atlaslib-grade-") as scratch:
        grader = Grader(path, nb, chapter, timeout, Path(scratch))
        try:
            grader.run_cells(progress)
            grader.score(progress)
        finally:
            grader.kernel.stop()
    if save:
        import nbformat
        nbformat.write(nb, save)
    rows = grader.rows
    result = [asdict(r) for r in rows.values()]
    for r in result:
        r["problems"] = [text for _, text in r["problems"]]
    return {
        "notebook": str(path),
        "chapter": chapter,
        "timeout_s": timeout,
        "exercises": result,
        "earned": sum(r.earned for r in rows.values()),
        "points": sum(r.points for r in rows.values()),
        "setup_problems": [text for _, text in grader.setup_problems],
    }


def read_notebook(path: Path):
    """The notebook at ``path``, or ValueError with one line saying why it is not one."""
    import nbformat
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({type(e).__name__})") from None
    if not text.strip():
        raise ValueError(f"{path}: the file is empty")
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a notebook (invalid JSON at line {e.lineno}: {e.msg})") from None
    if not isinstance(raw, dict) or "cells" not in raw or "metadata" not in raw:
        raise ValueError(f"{path}: not a notebook (JSON without 'cells' and 'metadata')")
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as e:  # nbformat's own validation
        raise ValueError(f"{path}: not a valid notebook ({type(e).__name__})") from None


def table(report: dict, width: int = 100) -> str:
    """The report as a plain-text score table; long verdicts wrap under their row."""
    import textwrap
    name_w = max([len("exercise")] + [len(r["exercise"]) for r in report["exercises"]])
    indent = " " * (4 + name_w + 18)
    lines = [f"{report['notebook']} (chapter {report['chapter']})", "",
             f" #  {'exercise':<{name_w}}  points  earned  verdict"]
    for r in report["exercises"]:
        status = r["status"].replace("_", " ")           # the same words as the notebook and the JSON
        verdict = status if r["status"] in ("passed", "not_implemented") else f"{status}: {r['verdict']}"
        wrapped = textwrap.wrap(verdict, width=max(40, width - len(indent))) or [""]
        lines.append(f"{r['number']:>2}  {r['exercise']:<{name_w}}  {r['points']:>6}  {r['earned']:>6}  {wrapped[0]}")
        lines += [indent + more for more in wrapped[1:]]
    lines.append(f"    {'total':<{name_w}}  {report['points']:>6}  {report['earned']:>6}")
    for p in report["setup_problems"]:
        lines.append(f"set-up: {p}")
    return "\n".join(lines)


def grade_folder(folder: Path, timeout: float, progress: bool) -> list[dict]:
    """Grade every ``*.ipynb`` in ``folder`` (not recursive); a file that cannot be graded gets
    a report with an ``error`` and no points."""
    reports = []
    for path in sorted(folder.glob("*.ipynb")):
        try:
            reports.append(grade(path, timeout=timeout, progress=progress))
        except ValueError as e:
            reports.append({"notebook": str(path), "chapter": None, "exercises": [], "earned": 0, "points": 0,
                            "error": str(e)})
    return reports


def write_csv(reports: list[dict], out) -> None:
    """One row per notebook: file, chapter, the points of each exercise, total, error."""
    import csv
    names = list(dict.fromkeys(r["exercise"] for rep in reports for r in rep["exercises"]))
    writer = csv.DictWriter(out, fieldnames=["notebook", "chapter", *names, "earned", "points", "error"])
    writer.writeheader()
    for rep in reports:
        row = {"notebook": rep["notebook"], "chapter": rep["chapter"], "earned": rep["earned"],
               "points": rep["points"], "error": rep.get("error", "")}
        row.update({r["exercise"]: r["earned"] for r in rep["exercises"]})
        writer.writerow(row)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlaslib.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", help="an exercise notebook (e.g. exercises/ch01_linear.ipynb), "
                                         "or a folder of submissions: every *.ipynb in it is graded")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (a list for a folder)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds allowed per cell and per grader call (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--save", metavar="PATH", help="also write the executed notebook to PATH")
    parser.add_argument("--fail-under", type=int, metavar="N",
                        help="exit with status 1 if a notebook earns fewer than N points")
    parser.add_argument("--csv", metavar="PATH", help="for a folder: write one CSV row per notebook to PATH")
    args = parser.parse_args(argv)

    def refuse(message):
        print(message, file=sys.stderr)
        if args.json:
            print(json.dumps({"notebook": args.notebook, "error": message}))
        return 2

    target = Path(args.notebook)
    if target.is_dir():
        reports = grade_folder(target, args.timeout, progress=not args.json)
        if args.csv:
            with open(args.csv, "w", newline="") as out:
                write_csv(reports, out)
        if args.json:
            print(json.dumps(reports, indent=2))
        else:
            for rep in reports:
                result = rep.get("error") or f"{rep['earned']}/{rep['points']} points"
                print(f"{rep['notebook']}: {result}")
        below = args.fail_under is not None and any(rep["earned"] < args.fail_under for rep in reports)
        return 1 if below else 0
    if not target.is_file():      # before anything slow is imported
        return refuse(f"no such notebook: {args.notebook}")
    try:
        report = grade(args.notebook, timeout=args.timeout, save=args.save, progress=not args.json)
    except ValueError as e:
        return refuse(str(e))
    print(json.dumps(report, indent=2) if args.json else table(report))
    if args.fail_under is not None and report["earned"] < args.fail_under:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
