"""Grade an exercise notebook: ``python -m atlaslib.grade NOTEBOOK [--json] [--timeout S]``.

The notebook runs top to bottom in a fresh kernel, one cell at a time, with a time
limit per cell. Every ``check.<exercise>(...)`` call leaves a machine-readable verdict
in its cell's output (``atlaslib.exercises.checking.MIME``); the grader collects them
and prints one row per exercise of the chapter, whether or not its check ran.

* The exercises and their points come from the chapter's check module
  (``atlaslib.exercises.<chapter>.EXERCISES``), named by the notebook metadata
  ``{"atlaslib": {"chapter": "ch01"}}``: editing the notebook cannot change the points.
* Cells tagged ``{"atlaslib": {"exercise": name}}`` belong to that exercise; the
  others are set-up cells.
* A cell that raises is reported on its exercise's row and grading goes on.
* A cell that runs past the time limit is reported on its row; the kernel is then
  restarted, the set-up cells run again, and grading goes on with the next cell.

Exit status 0 whenever grading completed, whatever the score; 2 if the notebook cannot
be graded at all (missing file, no chapter metadata).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import nbformat
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from tqdm.auto import tqdm

from .exercises import registry
from .exercises.checking import MIME

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


def verdicts_in(cell) -> list[dict]:
    """The check verdicts a cell displayed (in order)."""
    found = []
    for out in cell.get("outputs", []):
        payload = out.get("data", {}).get(MIME)
        if payload is not None:
            try:
                found.append(json.loads(payload if isinstance(payload, str) else "".join(payload)))
            except (TypeError, ValueError):
                pass
    return found


def error_in(cell) -> str | None:
    """``ExcName: message`` of the first error a cell raised, if any."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            msg = " ".join(str(out.get("evalue", "")).split())
            return f"{out.get('ename', 'Error')}: {msg[:300]}" if msg else out.get("ename", "Error")
    return None


class ThisPython(KernelSpecManager):
    """Kernels run on the interpreter running the grader (the project's .venv), whatever
    other 'python3' kernels the user has installed."""

    def get_kernel_spec(self, kernel_name):
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="atlaslib grader", language="python", resource_dir=".")


class Kernel:
    """An nbclient kernel that can be thrown away and restarted after a timeout."""

    def __init__(self, nb, timeout: float, cwd: str):
        self.client = NotebookClient(nb, timeout=max(1, math.ceil(timeout)), allow_errors=True,
                                     interrupt_on_timeout=False, kernel_name="python3",
                                     shutdown_kernel="immediate", resources={"metadata": {"path": cwd}})
        self.start()

    def start(self):
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
        try:
            self.client.execute_cell(cell, index)
        except CellTimeoutError:
            return "timeout"
        except DeadKernelError:
            return "died"
        return None


def grade(path, timeout: float = DEFAULT_TIMEOUT, save: str | None = None, progress: bool = True) -> dict:
    """Run the notebook at ``path`` and return the score report (see ``--json``)."""
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    chapter = nb.metadata.get("atlaslib", {}).get("chapter")
    if chapter is None:
        raise ValueError(f"{path}: not an exercise notebook (no 'atlaslib.chapter' in its metadata)")
    rows = {e.name: Row(e.number, e.name, e.title, e.points) for e in registry(chapter)}
    setup_problems, setup_cells = [], []

    def problem(name, text):
        (rows[name].problems if name in rows else setup_problems).append(text)

    kernel = Kernel(nb, timeout, str(path.resolve().parent))
    cells = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    try:
        bar = tqdm(cells, desc=f"grading {path.name}", unit="cell", disable=None if progress else True, file=sys.stderr)
        for i, cell in bar:
            name = exercise_of(cell)
            outcome = kernel.run(cell, i)
            if outcome is not None:
                if outcome == "timeout":
                    problem(name, (TIMEOUT, f"cell {i} ran longer than {timeout:g} s"))
                else:
                    problem(name, (CRASH, f"the kernel died in cell {i}"))
                kernel.restart()                       # a fresh kernel, then the set-up again
                for j in setup_cells:
                    if kernel.run(nb.cells[j], j) is not None:
                        setup_problems.append((CRASH, f"set-up cell {j} failed when re-run after a restart"))
                        break
                continue
            err = error_in(cell)
            if err:
                problem(name, (CRASH, f"cell {i} raised {err}"))
            if name is None:
                setup_cells.append(i)
            for v in verdicts_in(cell):
                if v.get("chapter") == chapter and v.get("exercise") in rows:
                    row = rows[v["exercise"]]
                    row.status, row.verdict = v["status"], v["message"]
                    row.earned = row.points if v["status"] == "passed" else 0
    finally:
        kernel.stop()
    for row in rows.values():
        if row.status == NOT_RUN and row.problems:   # no verdict: the first crash or timeout explains why
            row.status, row.verdict = row.problems[0]
    if save:
        nbformat.write(nb, save)
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
        "setup_problems": [text for _, text in setup_problems],
    }


def table(report: dict, width: int = 100) -> str:
    """The report as a plain-text score table."""
    name_w = max([len("exercise")] + [len(r["exercise"]) for r in report["exercises"]])
    lines = [f"{report['notebook']} (chapter {report['chapter']})", "",
             f" #  {'exercise':<{name_w}}  points  earned  verdict"]
    for r in report["exercises"]:
        verdict = {"passed": "passed", "not_implemented": "not implemented yet"}.get(
            r["status"], f"{r['status']}: {r['verdict']}")
        if len(verdict) > width:
            verdict = verdict[: width - 3] + "..."
        lines.append(f"{r['number']:>2}  {r['exercise']:<{name_w}}  {r['points']:>6}  {r['earned']:>6}  {verdict}")
    lines.append(f"    {'total':<{name_w}}  {report['points']:>6}  {report['earned']:>6}")
    for p in report["setup_problems"]:
        lines.append(f"set-up: {p}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m atlaslib.grade", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebook", help="an exercise notebook, e.g. exercises/ch01_linear.ipynb")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds allowed per cell (default {DEFAULT_TIMEOUT})")
    parser.add_argument("--save", metavar="PATH", help="also write the executed notebook to PATH")
    args = parser.parse_args(argv)
    if not Path(args.notebook).is_file():
        print(f"no such notebook: {args.notebook}", file=sys.stderr)
        return 2
    try:
        report = grade(args.notebook, timeout=args.timeout, save=args.save, progress=not args.json)
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
