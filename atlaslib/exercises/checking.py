"""The machinery behind every ``check.<exercise>(fn)`` call in the exercise notebooks.

A check draws fresh random inputs, runs the learner's function on them, compares the
result with the library and shows a verdict right under the cell. The verdict is also
emitted as a second, machine-readable representation (mime type ``MIME``, a JSON
string) that the grader (``python -m atlaslib.grade``) collects from the executed
notebook. Success messages contain no random numbers, so a solved notebook's stored
outputs are reproducible (nbval checks them strictly).

Writing a check for a new exercise::

    EXERCISES = Registry("ch02")

    @EXERCISES.check("delta_step", title="One delta-rule step", points=2)
    def delta_step(fn, gen):
        for shape in ...:
            with case(f"B={B}, T={T}"):
                got = call(fn, *inputs)               # the learner's exceptions, reported cleanly
                compare("S_t", got, expected)         # shape, NaN, relative RMSE, where it differs
        return "matches atlaslib.delta on 4 random cases"   # deterministic success text
"""
from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass

import torch

from ..core.testing import assert_close

# A text mime type (not "+json"): nbformat keeps the payload as a plain string, which
# nbval's sanitizer can read; the payload is JSON.
MIME = "text/x-atlaslib-check"

PASSED, FAILED, ERROR, NOT_IMPLEMENTED = "passed", "failed", "error", "not_implemented"


class CheckFailed(Exception):
    """The learner's answer is wrong; the message says what differs and where."""


class LearnerError(Exception):
    """The learner's function raised; the message names the exception (no traceback)."""


class NotImplementedYet(Exception):
    """The learner's function still raises NotImplementedError (the untouched stub)."""


@dataclass
class Verdict:
    chapter: str
    exercise: str
    number: int
    title: str
    points: int
    earned: int
    status: str
    message: str

    def text(self) -> str:
        head = f"Exercise {self.number} ({self.exercise})"
        if self.status == PASSED:
            return f"PASSED {head}: {self.message}. {self.earned}/{self.points} points."
        label = {FAILED: "NOT YET", ERROR: "ERROR", NOT_IMPLEMENTED: "TO DO"}[self.status]
        return f"{label} {head}, {self.earned}/{self.points} points:\n    {self.message}"

    def show(self) -> None:
        """Display in a notebook (text + machine-readable copy), print elsewhere."""
        try:
            from IPython import get_ipython
            from IPython.display import display
            shell = get_ipython()
        except ImportError:
            shell = None
        if shell is None:
            print(self.text())
        else:
            display({"text/plain": self.text(), MIME: json.dumps(asdict(self), sort_keys=True)}, raw=True)


def short(exc: BaseException, limit: int = 400) -> str:
    """``TypeError: message`` on one line, cut to ``limit`` characters."""
    msg = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def call(fn, *args, **kwargs):
    """Run the learner's ``fn``; its exceptions become ``LearnerError`` / ``NotImplementedYet``."""
    if not callable(fn):
        raise CheckFailed(f"expected a function, got {type(fn).__name__}")
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the learner's bug, reported without a traceback wall
        e = root_cause(e)
        stub_kernel = type(e).__name__ == "CompilationError" and "NotImplementedError" in str(e)  # on a GPU
        if isinstance(e, NotImplementedError) or stub_kernel:
            raise NotImplementedYet(str(e)) from None
        raise LearnerError(f"your function raised {short(e)}") from None


def root_cause(e: BaseException) -> BaseException:
    """The learner's own exception inside wrappers such as Triton's ``InterpreterError``."""
    seen = set()
    while type(e).__name__ == "InterpreterError" and e.__cause__ is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__
    return e


def unpack(result, names: tuple[str, ...]):
    """Check that ``result`` is a tuple/list with one entry per name, and return it."""
    if len(names) == 1:
        return (result,)
    if not isinstance(result, (tuple, list)) or len(result) != len(names):
        got = f"a {type(result).__name__} of length {len(result)}" if isinstance(result, (tuple, list)) \
            else f"a {type(result).__name__}"
        raise CheckFailed(f"expected a tuple ({', '.join(names)}), got {got}")
    return tuple(result)


def compare(name: str, got, expected: torch.Tensor, tol: float | None = None) -> None:
    """Compare a learner tensor with the library's, through ``core.testing.assert_close``."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{name} should be a torch.Tensor, got {type(got).__name__}")
    if got.device != expected.device:
        raise CheckFailed(f"{name} is on {got.device}, expected {expected.device}")
    if got.is_complex() or not got.is_floating_point():
        raise CheckFailed(f"{name} has dtype {got.dtype}, expected a floating-point tensor")
    try:
        assert_close(got.detach(), expected.detach(), tol=tol, name=name)
    except AssertionError as e:
        raise CheckFailed(str(e)) from None


def compare_number(name: str, got, expected: float, tol: float = 1e-9) -> None:
    """A scalar answer: ints, floats, numpy scalars and 0-d tensors are all accepted."""
    if isinstance(got, bool) or got is None:
        raise CheckFailed(f"{name} should be a number, got {got!r}")
    try:
        value = float(got.item() if hasattr(got, "item") else got)
    except (TypeError, ValueError):
        raise CheckFailed(f"{name} should be a number, got {type(got).__name__}") from None
    if not abs(value - expected) <= tol * max(1.0, abs(expected)):
        raise CheckFailed(f"{name} = {value:g} is not right")


@contextlib.contextmanager
def case(description: str):
    """Prefix any failure raised inside with the case it happened in."""
    try:
        yield
    except (CheckFailed, LearnerError) as e:
        raise type(e)(f"[{description}] {e}") from None


def fresh_generator() -> torch.Generator:
    """A generator seeded from the OS: every check run sees new inputs."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


@dataclass
class Exercise:
    chapter: str
    name: str
    number: int
    title: str
    points: int
    body: object  # body(fn..., gen) -> success text, raises CheckFailed/LearnerError

    def evaluate(self, *fns) -> Verdict:
        """Run the check without displaying anything; returns the verdict."""
        def verdict(status, message):
            earned = self.points if status == PASSED else 0
            return Verdict(self.chapter, self.name, self.number, self.title, self.points, earned, status, message)

        try:
            summary = self.body(*fns, gen=fresh_generator())
        except NotImplementedYet:
            return verdict(NOT_IMPLEMENTED, "not implemented yet: replace the `raise NotImplementedError` "
                                            "line with your code and run the cell again")
        except CheckFailed as e:
            return verdict(FAILED, str(e))
        except LearnerError as e:
            return verdict(ERROR, str(e))
        except Exception as e:  # something the learner returned broke the comparison itself
            return verdict(ERROR, f"could not check what your function returned: {short(e)}")
        return verdict(PASSED, summary)

    def __call__(self, *fns) -> None:
        self.evaluate(*fns).show()


class Registry:
    """The exercises of one chapter, in order; ``registry.check`` declares one."""

    def __init__(self, chapter: str):
        self.chapter = chapter
        self.exercises: dict[str, Exercise] = {}

    def check(self, name: str, *, title: str, points: int):
        def register(body):
            ex = Exercise(self.chapter, name, len(self.exercises) + 1, title, points, body)
            self.exercises[name] = ex
            return ex
        return register

    def __getitem__(self, name: str) -> Exercise:
        return self.exercises[name]

    def __iter__(self):
        return iter(self.exercises.values())

    def table(self) -> list[dict]:
        return [{"exercise": e.name, "number": e.number, "title": e.title, "points": e.points} for e in self]


# ---- Triton exercises: catch reads and writes past the end of a buffer -------------------
GUARD = 4096        # elements of padding on each side: wider than any block-sized overrun
SENTINEL = 1234.5   # what an output's guard bands hold; a changed value means a stray store


def guarded(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` that sits between two bands of NaN.

    A kernel that loads past the end of its input (a missing or wrong mask) reads NaN,
    which then shows up in its output.
    """
    flat = torch.full((x.numel() + 2 * GUARD,), float("nan"), dtype=x.dtype, device=x.device)
    view = flat[GUARD:GUARD + x.numel()].view(x.shape)
    view.copy_(x)
    view._guarded_base = flat  # keep the buffer alive with the view
    return view


def guarded_output(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A NaN-filled output buffer (unwritten entries stay NaN) between two SENTINEL bands."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device=device)
    view = flat[GUARD:GUARD + n].view(*shape)
    view.fill_(float("nan"))
    view._guarded_base = flat
    return view


def check_guards(name: str, out: torch.Tensor) -> None:
    """Fail if anything was stored into the guard bands around ``out``."""
    flat = out._guarded_base
    before, after = flat[:GUARD], flat[GUARD + out.numel():]
    for side, band in (("before the start", before), ("past the end", after)):
        changed = (band != SENTINEL).sum().item()
        if changed:
            raise CheckFailed(f"your kernel wrote {changed} value(s) {side} of {name}: "
                              "mask the stores with the true sizes")


NAN_HINT = (" Hint: NaN comes from an output the kernel never stored, or from a load past the end of "
            "an input (the check surrounds every input with NaN); mask loads and stores with the true sizes.")
