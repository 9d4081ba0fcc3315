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
import contextvars
import json
import os
from dataclasses import asdict, dataclass, field

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


class CallAborted(Exception):
    """The grader gave up on a call (it ran past the time limit or the kernel died): no verdict."""


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
        label = self.status.replace("_", " ").upper()     # the grader's words: FAILED, ERROR, NOT IMPLEMENTED
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


class RemoteError(Exception):
    """A learner's function raised in another process; only its name and message came back."""

    def __init__(self, ename: str, message: str, not_implemented: bool = False):
        super().__init__(f"{ename}: {message}" if message else ename)
        self.ename, self.message, self.not_implemented = ename, message, not_implemented


@dataclass
class Rules:
    """What an answer may not do while a check calls it (stated in each exercise)."""
    forbidden: tuple = ()          # dotted names of library functions that compute the answer
    needs_launch: bool = False     # the answer must launch a @triton.jit kernel
    launches: list = field(default_factory=list)   # kernel launches seen during the calls


RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("atlaslib_exercise_rules", default=Rules())


def run_under_rules(fn, args, kwargs, forbidden, namespaces=()):
    """``fn(*args, **kwargs)`` with the ``forbidden`` library functions replaced by ones that
    raise, everywhere they are bound (atlaslib's modules and ``namespaces``); returns
    ``(result, number of @triton.jit launches)``.

    Self-contained on purpose: the grader sends this function's source into the learner's
    kernel and runs it there, so nothing the notebook patches can change how it works.
    """
    import importlib
    import sys

    def forbidden_stub(dotted):
        def stub(*a, **k):
            raise ForbiddenCall(f"your answer calls {dotted}, the library's answer to this exercise: "
                                "write it with your own code")
        return stub

    class ForbiddenCall(Exception):
        pass

    swaps = []
    for dotted in forbidden:
        module, _, attr = dotted.rpartition(".")
        target = getattr(importlib.import_module(module), attr)
        stub = forbidden_stub(dotted)
        places = [vars(m) for name, m in list(sys.modules.items()) if name.startswith("atlaslib") and m is not None]
        for space in [*places, *namespaces]:
            for key, value in list(space.items()):
                if value is target:
                    swaps.append((space, key, value))
                    space[key] = stub
    launches = [0]
    counted = []
    for module, cls in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
        try:
            klass = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        original = klass.run

        def counting(self, *a, _original=original, **k):
            launches[0] += 1
            return _original(self, *a, **k)
        klass.run = counting
        counted.append((klass, original))
    try:
        return fn(*args, **kwargs), launches[0]
    finally:
        for klass, original in counted:
            klass.run = original
        for space, key, value in reversed(swaps):
            space[key] = value


def tensors_in(args, kwargs):
    """(label, tensor) for every tensor argument, in order."""
    found = [(f"argument {i + 1}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    return found + [(f"argument {k}", a) for k, a in kwargs.items() if isinstance(a, torch.Tensor)]


def call(fn, *args, **kwargs):
    """Run the learner's ``fn`` under the exercise's rules.

    Its exceptions become ``LearnerError`` / ``NotImplementedYet``; calling a forbidden library
    function or changing an input in place (any tensor argument not made by ``guarded_output``)
    fails the check. ``fn`` may live in another process (the grader's ``KernelFunction``).
    """
    if not callable(fn):
        raise CheckFailed(f"expected a function, got {type(fn).__name__}")
    rules = RULES.get()
    inputs = [(label, t, t.clone()) for label, t in tensors_in(args, kwargs) if not getattr(t, "_is_output", False)]
    try:
        if hasattr(fn, "remote_call"):
            result, launches = fn.remote_call(args, kwargs, rules.forbidden)
        else:
            import __main__
            result, launches = run_under_rules(fn, args, kwargs, rules.forbidden, [vars(__main__)])
    except RemoteError as e:
        if e.ename == "ForbiddenCall":
            raise CheckFailed(e.message) from None
        if e.not_implemented:
            raise NotImplementedYet(e.message) from None
        raise LearnerError(f"your function raised {e}") from None
    except Exception as e:  # the learner's bug, reported without a traceback wall
        e = root_cause(e)
        if type(e).__name__ == "ForbiddenCall":
            raise CheckFailed(str(e)) from None
        if is_not_implemented(e):
            raise NotImplementedYet(str(e)) from None
        raise LearnerError(f"your function raised {short(e)}") from None
    rules.launches.append(launches)
    for label, t, before in inputs:
        if not torch.equal(torch.nan_to_num(t, nan=0.5), torch.nan_to_num(before, nan=0.5)) \
                or not torch.equal(t.isnan(), before.isnan()):
            raise CheckFailed(f"your function changed its input ({label}) in place: work on a copy "
                              "(e.g. M = M.clone()) or use out-of-place operations")
    return result


def is_not_implemented(e: BaseException) -> bool:
    """The untouched stub: NotImplementedError, or a Triton kernel whose body raises it (on a GPU)."""
    return isinstance(e, NotImplementedError) or (
        type(e).__name__ == "CompilationError" and "NotImplementedError" in str(e))


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
    functions: tuple = ()   # the names the learner defines, in the order the check takes them
    forbidden: tuple = ()   # library functions an answer may not call (dotted names)
    needs_launch: bool = False   # a Triton exercise: the answer must launch a @triton.jit kernel

    def evaluate(self, *fns) -> Verdict:
        """Run the check without displaying anything; returns the verdict."""
        def verdict(status, message):
            earned = self.points if status == PASSED else 0
            return Verdict(self.chapter, self.name, self.number, self.title, self.points, earned, status, message)

        rules = Rules(self.forbidden, self.needs_launch)
        token = RULES.set(rules)
        try:
            summary = self.body(*fns, gen=fresh_generator())
            if self.needs_launch and not any(rules.launches):
                raise CheckFailed("your function computed the result without launching a @triton.jit kernel: "
                                  "this exercise is about writing one")
        except CallAborted:
            raise
        except NotImplementedYet:
            return verdict(NOT_IMPLEMENTED, "not implemented yet: replace the `raise NotImplementedError` "
                                            "line with your code and run the cell again")
        except CheckFailed as e:
            return verdict(FAILED, str(e))
        except LearnerError as e:
            return verdict(ERROR, str(e))
        except Exception as e:  # something the learner returned broke the comparison itself
            return verdict(ERROR, f"could not check what your function returned: {short(e)}")
        finally:
            RULES.reset(token)
        return verdict(PASSED, summary)

    def __call__(self, *fns) -> None:
        self.evaluate(*fns).show()


class Registry:
    """The exercises of one chapter, in order; ``registry.check`` declares one."""

    def __init__(self, chapter: str):
        self.chapter = chapter
        self.exercises: dict[str, Exercise] = {}

    def check(self, name: str, *, title: str, points: int, functions: tuple, forbidden: tuple = (),
              needs_launch: bool = False):
        def register(body):
            ex = Exercise(self.chapter, name, len(self.exercises) + 1, title, points, body, tuple(functions),
                          tuple(forbidden), needs_launch)
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
    view._is_output = True     # the kernel writes into it: exempt from the inputs-unchanged check
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
