"""Grade an exercise notebook: ``python -m atlaslib.grade NOTEBOOK [--json] [--timeout S] [--save PATH]
[--fail-under N]``, or a folder of them: ``python -m atlaslib.grade FOLDER [--csv PATH] ...``.

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
* Before anything runs, every code cell's source is checked against the static rules
  (``checking.screen``: allowed imports and helpers, no dynamic escape hatches); a notebook
  that breaks one is refused whole, 0 points, with one line naming the cell.
* The kernel runs in a sandbox (``Sandbox``): its own session and working directory, the user
  ``nobody`` when the grader is root and the project is readable by all (unless the environment
  sets ``ATLASLIB_GRADE_AS_NOBODY=0``); every process it
  started is killed when its grading ends, and only then are results written (atomically).
* From the command line each notebook is graded in a worker process of its own, so a
  submission that kills or crashes its grader is an error row, never the end of a folder run.
* A cell that raises is reported on its exercise's row and grading goes on.
* A cell or a grader's call that runs past the time limit is reported on its row; the
  kernel is then restarted, the cells that had completed run again, and grading goes on.

Exit status 0 when grading completed (1 with ``--fail-under N`` and fewer than N points);
2 if the file cannot be graded at all (missing, not a notebook, no or malformed chapter metadata) or the
folder holds no ``*.ipynb`` — one line on stderr, and a JSON ``{"error": ...}`` on stdout with ``--json``;
2 with argparse's usage line for a bad option (``--timeout`` not above 0, ``--fail-under`` below 0, ``--save``
into a missing folder or with a folder, ``--csv`` without a folder).
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


class Sandbox:
    """Where and as whom the notebook's kernel runs, and how every process it started is ended.

    The kernel gets a working directory of its own (``root/work``), its own session and process
    group, and, when the grader runs as root and the project can be read by everyone, the
    unprivileged user ``nobody``, with HOME and the caches under ``root``. ``end()`` kills
    every process the kernel started, detached ones included (they keep its session or its marker
    in their environment; in the command line's processes, which own no other children, every
    descendant is ended).
    """

    def __init__(self, root: Path):
        import os
        import secrets
        self.root, self.work = root, root / "work"
        self.work.mkdir()
        (root / "home").mkdir()
        self.marker = secrets.token_hex(8)
        self.sessions: set = set()          # the kernels' session ids (their pids)
        wanted = os.environ.get("ATLASLIB_GRADE_AS_NOBODY", "1") != "0"     # "0": keep the grader's user
        self.user = unprivileged_user() if wanted and os.name == "posix" and os.geteuid() == 0 else None
        if self.user is not None:
            for dirpath, dirnames, filenames in os.walk(root):
                for name in [dirpath, *(os.path.join(dirpath, f) for f in dirnames + filenames)]:
                    os.chown(name, *self.user)
            os.chmod(root, 0o700)

    def env(self, base: dict | None = None) -> dict:
        import os
        env = dict(os.environ if base is None else base)
        env.update({"ATLASLIB_GRADE_SANDBOX": self.marker,
                    "PYTHONPATH": os.pathsep.join(p for p in [project_root(), env.get("PYTHONPATH", "")] if p)})
        if self.user is not None:       # another user: a home and caches it can write
            home = str(self.root / "home")
            env.update({"HOME": home, "IPYTHONDIR": f"{home}/.ipython", "JUPYTER_RUNTIME_DIR": f"{home}/runtime",
                        "MPLCONFIGDIR": f"{home}/mpl", "TRITON_CACHE_DIR": f"{home}/triton",
                        "TORCHINDUCTOR_CACHE_DIR": f"{home}/inductor", "XDG_CACHE_HOME": f"{home}/.cache"})
        return env

    def popen_args(self, env: dict | None = None) -> dict:
        """Popen arguments for the kernel; ``env``: the environment the kernel manager prepared."""
        kw = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "stdin": subprocess.DEVNULL,
              "env": self.env(env), "cwd": str(self.work)}
        if self.user is not None:
            kw.update(user=self.user[0], group=self.user[1], extra_groups=[])
        return kw

    def give(self, path: Path) -> None:
        """A file the grader wrote for the kernel (its input): readable by the kernel's user."""
        import os
        if self.user is not None:
            os.chown(path, *self.user)

    def end(self, everything: bool = False) -> None:
        """Kill the kernels' processes (all descendants of this process too, if ``everything``)."""
        end_processes(self.sessions, f"ATLASLIB_GRADE_SANDBOX={self.marker}", everything)


def project_root() -> str:
    return str(Path(__file__).resolve().parents[1])


def unprivileged_user():
    """(uid, gid) of ``nobody`` if it can read the interpreter and the project, else None."""
    import stat
    try:
        import pwd
        entry = pwd.getpwnam("nobody")
    except (ImportError, KeyError):
        return None

    def open_to_all(path: Path) -> bool:
        path = path.resolve()
        for p in [path, *path.parents]:
            mode = p.stat().st_mode
            if not mode & stat.S_IXOTH if p.is_dir() else not mode & stat.S_IROTH:
                return False
        return True
    try:
        paths = [Path(sys.executable), Path(__file__).resolve().parent, Path(subprocess.__file__)]
        import ipykernel
        paths.append(Path(ipykernel.__file__).parent)
        if not all(open_to_all(p) for p in paths):
            return None
    except OSError:
        return None
    return entry.pw_uid, entry.pw_gid


def _process_table(zombies: dict | None = None) -> dict:
    """pid -> (ppid, session id) of every live process, from /proc (empty where there is none);
    dead ones waiting to be reaped go to ``zombies`` (pid -> ppid)."""
    import os
    table = {}
    zombies = {} if zombies is None else zombies
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] in ("Z", "X"):       # dead already (a zombie waits for its parent to reap it)
                zombies[int(name)] = int(fields[1])
                continue
            table[int(name)] = (int(fields[1]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _has_marker(pid: int, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker.encode() in f.read().split(b"\0")
    except OSError:
        return False


def end_processes(sessions, marker: str | None, everything: bool = False) -> None:
    """SIGKILL every process in ``sessions``, carrying ``marker`` (``KEY=value`` in its environment), or
    descending from one of those (every descendant of this process too, if ``everything``), until none is left."""
    import os
    import signal
    import time
    me = os.getpid()
    for _ in range(50):
        zombies: dict = {}
        table = _process_table(zombies)
        for pid, ppid in zombies.items():       # ours to reap (children, or orphans adopted as a subreaper)
            if ppid == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except OSError:
                    pass
        children: dict = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        doomed = {pid for pid, (_, sid) in table.items()
                  if pid != me and (sid in sessions or (marker and _has_marker(pid, marker)))}
        if everything:
            doomed |= set(children.get(me, []))
        stack = list(doomed)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in doomed and child != me:
                    doomed.add(child)
                    stack.append(child)
        if not doomed:
            return
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)
        for pid in doomed:          # reap the ones that were ours (or became ours as a subreaper)
            if table.get(pid, (None,))[0] == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except OSError:
                    pass


def become_subreaper() -> None:
    """Orphans among this process's descendants become its children (Linux), so none escapes ``end``."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)      # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


class Kernel:
    """An nbclient kernel that can be thrown away and restarted after a timeout.

    Kernels run on the interpreter running the grader (the project's .venv), whatever other
    'python3' kernels the user has installed, inside ``sandbox``.
    """

    def __init__(self, nb, timeout: float, sandbox: Sandbox):
        from nbclient import NotebookClient
        self.sandbox = sandbox
        self.client = NotebookClient(nb, timeout=max(1, math.ceil(timeout)), allow_errors=True,
                                     interrupt_on_timeout=False, kernel_name="python3",
                                     shutdown_kernel="immediate", resources={"metadata": {"path": str(sandbox.work)}})
        self.start()

    def start(self):
        import os

        from jupyter_client import AsyncKernelManager
        from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
        sandbox = self.sandbox

        class ThisPython(KernelSpecManager):
            def get_kernel_spec(self, kernel_name):
                return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                                  display_name="atlaslib grader", language="python", resource_dir=".")

        class SandboxedKernel(AsyncKernelManager):
            async def _async_launch_kernel(self, kernel_cmd, **kw):
                sandbox.give(Path(self.connection_file))
                kw.update(sandbox.popen_args(kw.get("env")))
                await super()._async_launch_kernel(kernel_cmd, **kw)
                pid = getattr(self.provisioner, "pid", None)
                if pid is not None:
                    sandbox.sessions.add(pid)          # a new session: its id is the kernel's pid

        c = self.client
        c.km = SandboxedKernel(kernel_name="python3", kernel_spec_manager=ThisPython())
        c.km.connection_file = str(sandbox.root / f"kernel-{os.urandom(4).hex()}.json")
        c.start_new_kernel()
        c.start_new_kernel_client()

    def stop(self):
        if self.client.km is not None:
            try:
                self.client._cleanup_kernel()
            except Exception:  # the kernel is gone already; nothing to clean
                self.client.km = self.client.kc = None
        self.sandbox.end()

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
        if isinstance(x, tuple):            # a namedtuple too: sent back as a plain tuple
            return tuple(plain(y) for y in x)
        if isinstance(x, list):
            return [plain(y) for y in x]
        if type(x).__module__ == "numpy":
            return torch.from_numpy(x) if hasattr(x, "shape") and x.shape else x.item()
        return x

    try:
        if {name!r} not in namespace:
            raise NameError("your notebook does not define `{name}` (the function this exercise asks for)")
        result, launches = __atlaslib_run_under_rules(namespace[{name!r}], args, kwargs, {forbidden!r}, [namespace],
                                                      {outputs!r})
        out = {{"ok": True, "result": plain(result), "args": args, "kwargs": kwargs, "launches": launches}}
    except BaseException as e:
        seen = set()
        while type(e).__name__ == "InterpreterError" and e.__cause__ is not None and id(e) not in seen:
            seen.add(id(e))
            e = e.__cause__
        compiling = any(c.__name__ == "CompilationError" for c in type(e).__mro__)   # a GPU's JIT
        stub = isinstance(e, NotImplementedError) or (compiling and "NotImplementedError" in str(e))
        text = str(e)
        if compiling:      # the cause (the last line) first, not the kernel's source listed before it
            lines = [line for line in text.split("\\n") if line.strip()]
            text = lines[-1] + " (" + lines[0].rstrip(":") + " of the kernel)" if lines else text
        out = {{"ok": False, "ename": type(e).__name__, "message": " ".join(text.split())[:400],
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

    def remote_call(self, args, kwargs, forbidden, outputs=()):
        import inspect

        import torch

        from .exercises.checking import CallAborted, RemoteError, run_under_rules
        src, dst = self.grader.scratch / "in.pt", self.grader.scratch / "out.pt"
        dst.unlink(missing_ok=True)
        torch.save((tuple(args), dict(kwargs)), src)
        self.grader.sandbox.give(src)
        helper = inspect.getsource(run_under_rules).replace("def run_under_rules(", "def __atlaslib_run_under_rules(")
        code = helper + CALL_IN_KERNEL.format(src=str(src), dst=str(dst), name=self.name, forbidden=tuple(forbidden),
                                              outputs=tuple(outputs))
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

    def __init__(self, path: Path, nb, chapter: str, timeout: float, sandbox: Sandbox):
        from .exercises import registry
        self.path, self.nb, self.chapter, self.timeout = path, nb, chapter, timeout
        self.sandbox, self.scratch = sandbox, sandbox.root
        self.exercises = list(registry(chapter))
        self.rows = {e.name: Row(e.number, e.name, e.title, e.points) for e in self.exercises}
        self.setup_problems: list = []
        self.completed: list[int] = []          # cells that ran to the end, re-run after a restart
        self.kernel = Kernel(nb, timeout, sandbox)

    def problem(self, name, text):
        (self.rows[name].problems if name in self.rows else self.setup_problems).append(text)

    def restart(self):
        """A fresh kernel, and every cell that had completed run again. A cell that times out or kills the
        kernel when re-run (a check cell draws new inputs) is left out from then on, and the replay starts
        over in another fresh kernel: the one it left is still busy with that cell, or dead, and every later
        call would time out behind it."""
        self.kernel.restart()
        for j in self.completed:
            if self.kernel.run(self.nb.cells[j], j) is not None:
                self.problem(exercise_of(self.nb.cells[j]),
                             (CRASH, f"{self.cell_name(j)} failed when re-run after a restart"))
                self.completed.remove(j)
                self.restart()
                return

    def run_cells(self, progress: bool):
        from tqdm.auto import tqdm
        cells = [(i, c) for i, c in enumerate(self.nb.cells) if c.cell_type == "code" and c.source.strip()]
        bar = tqdm(cells, desc=f"running {self.path.name}", unit="cell", disable=None if progress else True,
                   file=sys.stderr)
        for i, cell in bar:
            name = exercise_of(cell)
            outcome = self.kernel.run(cell, i)
            if outcome is not None:
                if outcome == "timeout":
                    self.problem(name, (TIMEOUT, f"{self.cell_name(i)} ran longer than {self.timeout:g} s"))
                else:
                    self.problem(name, (CRASH, f"the kernel died in {self.cell_name(i)}"))
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

    def defined_in(self, name: str) -> str:
        """The code cell whose definition of ``name`` is the one graded: the last one, as the notebook runs
        top to bottom (a later cell that defines it again replaces an earlier one, checked or not)."""
        for i in reversed(range(len(self.nb.cells))):
            cell = self.nb.cells[i]
            if cell.cell_type == "code" and f"def {name}(" in cell.source:
                return f"defined in {self.cell_name(i)}"
        return "not defined"

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
                where = " or ".join(f"`{n}` ({self.defined_in(n)})" for n in ex.functions)
                if str(e) == "timeout":
                    row.status, row.verdict = TIMEOUT, (f"your function ran longer than {self.timeout:g} s "
                                                        f"when the grader called {where}")
                else:
                    row.status, row.verdict = CRASH, (f"the kernel died when the grader called {where}")
                continue
            undefined = "your notebook does not define" in v.message
            if v.status != PASSED and row.problems and undefined:   # the crash explains why
                row.status, row.verdict = row.problems[0]
            else:
                row.status, row.verdict, row.earned = v.status, v.message, v.earned


def chapter_of(path: Path, nb) -> str:
    """The chapter named by the notebook's metadata, or ValueError with one line saying what is wrong."""
    meta = nb.get("metadata", {}).get("atlaslib")
    if meta is None:
        raise ValueError(f"{path}: not an exercise notebook (no 'atlaslib.chapter' in its metadata)")
    if not isinstance(meta, dict):
        raise ValueError(f"{path}: malformed metadata: 'atlaslib' should be an object like "
                         f'{{"chapter": "ch01"}}, got {type(meta).__name__}')
    chapter = meta.get("chapter")
    if chapter is None:
        raise ValueError(f"{path}: not an exercise notebook (no 'atlaslib.chapter' in its metadata)")
    if not isinstance(chapter, str):
        raise ValueError(f"{path}: malformed metadata: 'atlaslib.chapter' should be a string like \"ch01\", "
                         f"got {type(chapter).__name__}")
    for i, cell in enumerate(nb.get("cells", [])):
        md = cell.get("metadata", {}) if isinstance(cell, dict) else {}
        cm = md.get("atlaslib") if isinstance(md, dict) else None
        if cm is not None and not (isinstance(cm, dict) and isinstance(cm.get("exercise", ""), str)):
            raise ValueError(f"{path}: malformed metadata in cell {i + 1}: 'atlaslib' should be an object like "
                             '{"exercise": "name"}')
    return chapter


def rejected_report(path, chapter, timeout, reason: str) -> dict:
    """A notebook refused before it ran: every exercise 0 points, with the reason."""
    from .exercises import registry
    rows = [Row(e.number, e.name, e.title, e.points, status=CRASH, verdict=f"rejected: {reason}")
            for e in registry(chapter)]
    return {"notebook": str(path), "chapter": chapter, "timeout_s": timeout,
            "exercises": [{**asdict(r), "problems": []} for r in rows], "earned": 0,
            "points": sum(r.points for r in rows), "setup_problems": [], "rejected": reason}


def screen_notebook(nb, chapter: str) -> str | None:
    """The static rules (``checking.screen``) on every code cell: None, or the one-line reason."""
    from .exercises import registry
    from .exercises.checking import Rejected, screen
    reg = registry(chapter)
    names = {e.name for e in reg}
    cells, n = [], 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            n += 1
            name = exercise_of(cell)
            cells.append((f"code cell {n}" + (f" (exercise {name})" if name else " (set-up)"), cell.source))
    try:
        screen(cells, chapter, names, reg.helpers)
    except Rejected as e:
        return str(e)
    return None


def write_atomically(path, write) -> None:
    """``write(file)`` into a temporary file beside ``path``, then rename it over ``path``."""
    import os
    import tempfile
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~umask)        # mkstemp makes it owner-only; the file gets what open() would give
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def grade(path, timeout: float = DEFAULT_TIMEOUT, save: str | None = None, progress: bool = True,
          everything: bool = False) -> dict:
    """Run the notebook at ``path`` and return the score report (see ``--json``).

    ``everything``: when grading ends, kill every descendant of this process (the command line's
    worker does; a library caller keeps its own children, and the kernel's are found by session and
    marker)."""
    import os
    import tempfile

    path = Path(path)
    nb = read_notebook(path)
    chapter = chapter_of(path, nb)
    import torch
    if not torch.cuda.is_available():
        # The learner's Triton kernels run in the notebook's kernel, in the interpreter when there is
        # no GPU (its set-up cell says so); the checks in this process pick their device to match.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .exercises import CHAPTERS
    if chapter not in CHAPTERS:
        raise ValueError(f"{path}: unknown chapter {chapter!r} in its metadata (known: {', '.join(CHAPTERS)})")
    reason = screen_notebook(nb, chapter)
    if reason is not None:
        return rejected_report(path, chapter, timeout, reason)
    with tempfile.TemporaryDirectory(prefix="atlaslib-grade-") as scratch:
        sandbox = Sandbox(Path(scratch))
        try:
            grader = Grader(path, nb, chapter, timeout, sandbox)
            try:
                grader.run_cells(progress)
                grader.score(progress)
            finally:
                grader.kernel.stop()
        finally:
            sandbox.end(everything)          # nothing the notebook started outlives its grading
    if save:
        import nbformat
        write_atomically(save, lambda f: nbformat.write(nb, f))
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


def read_notebook(path: Path, validate: bool = True):
    """The notebook at ``path``, or ValueError with one line saying why it is not one
    (without ``validate``: the JSON only, as a dict, without nbformat's slower schema check)."""
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
    if not isinstance(raw["metadata"], dict) or not isinstance(raw["cells"], list):
        raise ValueError(f"{path}: not a notebook ('metadata' should be an object and 'cells' a list)")
    if not validate:
        return raw
    import nbformat
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
    if report.get("rejected"):
        lines.append(f"rejected: {report['rejected']}")
    return "\n".join(lines)


def error_report(path, message: str) -> dict:
    return {"notebook": str(path), "chapter": None, "exercises": [], "earned": 0, "points": 0, "error": message}


def grade_in_child(path: Path, timeout: float, save: str | None = None, progress: bool = True,
                   reap_all: bool = False) -> dict:
    """Grade one notebook in a worker process of its own (``--worker``), in a session of its own.

    Whatever the notebook does to that worker (kill it, crash it) becomes an error report for this
    notebook; then every process it left behind is ended: those in the worker's session or carrying
    this call's marker, and with ``reap_all`` (the command line) every descendant of this process,
    which is then a subreaper (Linux): orphans become its children instead of escaping.
    """
    import os
    import secrets
    import tempfile
    if reap_all:
        become_subreaper()
    marker = f"ATLASLIB_GRADE_RUN={secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="atlaslib-report-") as box:
        report_path = Path(box) / "report.json"
        cmd = [sys.executable, "-m", "atlaslib.grade", "--worker", str(report_path), str(path),
               "--timeout", str(timeout)] + (["--save", save] if save else []) + ([] if progress else ["--json"])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [project_root(), env.get("PYTHONPATH", "")] if p)
        env[marker.split("=")[0]] = marker.split("=")[1]
        proc = None
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=None if progress else subprocess.DEVNULL, start_new_session=True,
                                    env=env)
            try:
                code = proc.wait(timeout=max(600.0, 100 * timeout))
            except subprocess.TimeoutExpired:
                code = None
        finally:
            end_processes({proc.pid} if proc else set(), marker, everything=reap_all)
        try:
            report = json.loads(report_path.read_text())
        except (OSError, ValueError):
            report = None
        if not isinstance(report, dict) or "notebook" not in report:
            what = "ran past its time limit" if code is None else f"died (exit status {code})"
            return error_report(path, f"{path}: the grading of this notebook {what}; nothing was scored")
        return report


def grade_folder(folder: Path, timeout: float, progress: bool, reap_all: bool = False) -> list[dict]:
    """Grade every ``*.ipynb`` in ``folder`` (not recursive), each in a worker process of its own; a
    file that cannot be graded, or whose grading dies, gets a report with an ``error`` and no points."""
    return [grade_in_child(path, timeout, progress=progress, reap_all=reap_all)
            for path in sorted(folder.glob("*.ipynb"))]


def write_csv(reports: list[dict], out) -> None:
    """One row per notebook: file, chapter, the points of each exercise, total, error."""
    import csv
    names = list(dict.fromkeys(r["exercise"] for rep in reports for r in rep["exercises"]))
    writer = csv.DictWriter(out, fieldnames=["notebook", "chapter", *names, "earned", "points", "error"])
    writer.writeheader()
    for rep in reports:
        row = {"notebook": rep["notebook"], "chapter": rep["chapter"], "earned": rep["earned"],
               "points": rep["points"], "error": rep.get("error") or rep.get("rejected", "")}
        row.update({r["exercise"]: r["earned"] for r in rep["exercises"]})
        writer.writerow(row)


GRADING_PACKAGES = ("nbformat", "nbclient", "jupyter_client", "ipykernel")    # pyproject's ``grade`` extra


def missing_grading_packages() -> list[str]:
    import importlib.util
    return [name for name in GRADING_PACKAGES if importlib.util.find_spec(name) is None]


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
    parser.add_argument("--worker", metavar="REPORT", help=argparse.SUPPRESS)   # internal: see grade_in_child
    args = parser.parse_args(argv)

    def refuse(message):
        print(message, file=sys.stderr)
        if args.json:
            print(json.dumps({"notebook": args.notebook, "error": message}))
        return 2

    missing = missing_grading_packages()
    if missing:                   # the grader's own packages, before a worker reports the notebook as dead
        return refuse(f"python -m atlaslib.grade needs {', '.join(missing)}: pip install 'atlaslib[grade]' "
                      "(the repository's `make` installs them)")
    target = Path(args.notebook)
    if not 0 < args.timeout < math.inf:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    if args.fail_under is not None and args.fail_under < 0:
        parser.error(f"--fail-under must be a number of points >= 0, got {args.fail_under}")
    if args.csv and not target.is_dir():
        parser.error(f"--csv is for a folder of notebooks; {args.notebook} is not a folder")
    if args.save and target.is_dir():
        parser.error(f"--save is for a single notebook; {args.notebook} is a folder")
    for option, path in (("--save", args.save), ("--csv", args.csv)):     # before the notebooks run, not after
        if path and not Path(path).parent.is_dir():
            parser.error(f"{option} {path}: no folder {Path(path).parent}")
        if path and Path(path).is_dir():
            parser.error(f"{option} {path} is a folder; give a file name")
    if args.worker:      # the child process of grade_in_child: the report goes to the file it names
        try:
            report = grade(target, timeout=args.timeout, save=args.save, progress=not args.json, everything=True)
        except ValueError as e:
            report = error_report(target, str(e))
        write_atomically(args.worker, lambda f: json.dump(report, f))
        return 0
    if target.is_dir():
        if not any(target.glob("*.ipynb")):
            return refuse(f"no *.ipynb in {args.notebook}")
        reports = grade_folder(target, args.timeout, progress=not args.json, reap_all=True)
        if args.csv:
            write_atomically(args.csv, lambda f: write_csv(reports, f))
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
    try:                          # the file's own problems: one line before any kernel starts
        chapter_of(target, read_notebook(target, validate=False))
    except ValueError as e:
        return refuse(str(e))
    report = grade_in_child(target, args.timeout, save=args.save, progress=not args.json, reap_all=True)
    if "error" in report:
        return refuse(report["error"])
    print(json.dumps(report, indent=2) if args.json else table(report))
    if args.fail_under is not None and report["earned"] < args.fail_under:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
