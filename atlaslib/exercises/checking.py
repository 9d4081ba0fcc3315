"""The machinery behind every ``check.<exercise>(fn)`` call in the exercise notebooks.

A check draws fresh random inputs, runs the learner's function on them, compares the
result with the library and shows a verdict right under the cell. The verdict is also
emitted as a second, machine-readable representation (mime type ``MIME``, a JSON
string) that the grader (``python -m atlaslib.grade``) collects from the executed
notebook. Success messages contain no random numbers, so a solved notebook's stored
outputs are reproducible (nbval checks them strictly).

Writing a check for a new exercise::

    EXERCISES = Registry("ch02")

    @EXERCISES.check("delta_step", title="One delta-rule step", points=2,
                     functions=("delta_step",), forbidden=("atlaslib.delta.delta_rule",))
    def delta_step(fn, gen):                          # one learner function per name in `functions`
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

from ..core.interpreter import NEVER_STORED, UNDEFINED_LANE, nan_bits
from ..core.testing import assert_close, rel_rmse

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


def compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a Triton ``CompilationError`` or one of its subclasses (``UnsupportedLanguageConstruct``,
    ...): what a GPU's JIT raises at the launch of a kernel it cannot compile."""
    return any(c.__name__ == "CompilationError" for c in type(exc).__mro__)


def compile_message(exc: BaseException) -> str:
    """A compilation error's cause first, then the kernel's line it points at: its text lists up to 12 lines
    of the kernel before the cause, which a message cut to a few hundred characters would keep instead."""
    lines = [line for line in str(exc).split("\n") if line.strip()]
    node, src = getattr(exc, "node", None), getattr(exc, "src", None) or ""
    row = getattr(node, "lineno", 0)
    code = src.split("\n")[row - 1].strip() if 0 < row <= len(src.split("\n")) else ""
    return f"{lines[-1] if lines else ''} (line {row} of the kernel: {code})" if code else " ".join(lines)


def short(exc: BaseException, limit: int = 400) -> str:
    """``TypeError: message`` on one line, cut to ``limit`` characters."""
    msg = " ".join((compile_message(exc) if compile_error(exc) else str(exc)).split())
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
    moved: list = field(default_factory=list)      # per call: did the replayed launches store other values?
    learner: tuple | None = None   # the notebook's default dtype and grad mode, for its calls (None: as they are)


RULES: contextvars.ContextVar[Rules] = contextvars.ContextVar("atlaslib_exercise_rules", default=Rules())


def run_under_rules(fn, args, kwargs, forbidden, namespaces=(), outputs=()):
    """``fn(*args, **kwargs)`` with the ``forbidden`` library functions made to raise, however the
    answer reaches them (their code is swapped, so a default argument, a closure, a partial or a list
    holding one calls the stub too; the names bound to them in atlaslib's modules and ``namespaces``
    are swapped as well); returns ``(result, (number of launches of the notebook's own @triton.jit kernels,
    moved))``.

    ``outputs``: positions of the output buffers of a Triton exercise. Before the first launch of the
    notebook's own kernel they are filled with a NaN pattern; afterwards the entries it did not store get
    the values they came with (torch's writes before it are refused). A later launch stores what changes
    (it may read what an earlier one stored, e.g. to accumulate); nothing else may change the outputs,
    or the inputs, before or between launches. When ``fn`` returns, every entry must have been stored by
    one of its kernels, and nothing may have changed them since. The kernels may only be given the function's
    own tensors (views of them included: no scratch buffers); a library kernel may not be launched.
    Then the launches run once more on copies of the inputs with their values permuted: ``moved`` says
    whether the outputs came out different (None: no input changed; "raised": the replay raised). Kernels that
    compute from their inputs store other values; values computed with torch and handed to a kernel as
    numbers come out the same.

    Self-contained on purpose: the grader sends this function's source into the learner's
    kernel and runs it there.
    """
    import importlib
    import sys

    import torch

    class ForbiddenCall(Exception):
        pass

    def what(dotted):
        # a library function computes the answer; a torch one (autograd) does the work the exercise asks for
        return ("the library's answer to this exercise" if dotted.startswith("atlaslib")
                else "which does what this exercise asks you to do by hand")

    def forbidden_stub(dotted):
        def stub(*a, **k):
            raise ForbiddenCall(f"your answer calls {dotted}, {what(dotted)}: write it with your own code")
        return stub

    swaps, codes = [], []
    for dotted in forbidden:
        module, _, attr = dotted.rpartition(".")
        target = getattr(importlib.import_module(module), attr)
        stub = forbidden_stub(dotted)
        message = f"ForbiddenCall: your answer calls {dotted}, {what(dotted)}: write it with your own code"
        scope = {}
        exec(f"def stub(*a, **k):\n    raise PermissionError({message!r})", scope)
        for f in {id(x): x for x in (target, getattr(target, "__wrapped__", None))}.values():
            code = getattr(f, "__code__", None)
            if code is not None and not code.co_freevars:
                codes.append((f, code))
                f.__code__ = scope["stub"].__code__
        places = [vars(m) for name, m in list(sys.modules.items()) if name.startswith("atlaslib") and m is not None]
        for space in [*places, *namespaces]:
            for key, value in list(space.items()):
                if value is target:
                    swaps.append((space, key, value))
                    space[key] = stub

    tensors = [a for a in [*args, *kwargs.values()] if isinstance(a, torch.Tensor)]
    own_storages = {t.untyped_storage().data_ptr() for t in tensors}
    outs = [(i, args[i]) for i in outputs]
    # the inputs as they came: a kernel must read them so (an answer computed with torch into an input,
    # read by the kernel and then undone, would otherwise pass)
    ins = [(f"argument {i + 1}", a, a.clone()) for i, a in enumerate(args) if isinstance(a, torch.Tensor)
           and i not in outputs] + [(f"argument {k}", a, a.clone()) for k, a in kwargs.items()
                                    if isinstance(a, torch.Tensor)]
    int_of = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    poison = {1: 0x7F, 2: 0x7FA5, 4: 0x7FA5A5A5, 8: 0x7FF4A5A5A5A5A5A5}

    def bits(t):
        return t.view(int_of[t.element_size()])

    written = [torch.zeros(t.shape, dtype=torch.bool, device=t.device) for _, t in outs]
    initial = [t.clone() for _, t in outs]
    after = [None for _ in outs]

    def with_pointer(x):
        # an empty view of a guarded buffer: torch gives it a null pointer; a kernel that loads
        # before its start (row -1) must read the guard band, not crash
        if isinstance(x, torch.Tensor) and x.numel() == 0 and \
                x.storage_offset() < x.untyped_storage().nbytes() // x.element_size():
            return x.new_empty(0).set_(x.untyped_storage(), x.storage_offset(), (1,), (1,))
        return x

    # The storage around each tensor argument that is not the argument itself: a guarded input's NaN
    # bands, an output's sentinel bands. Under TRITON_INTERPRET every load is seen with its addresses,
    # so a load there fails the check even when the value it reads never reaches an output (on a GPU
    # such a load reads another tensor's memory, or faults). A load outside every argument's storage
    # is refused before it runs: the real one could crash the process (with every argument on the CPU:
    # the interpreter runs on host copies of the others).
    bands, extents, strays, kernel = [], [], [], ["?"]
    hosted = all(t.device.type == "cpu" for t in tensors)
    for label, t in [(f"argument {i + 1}", a) for i, a in enumerate(args)] + \
            [(f"argument {key}", a) for key, a in kwargs.items()]:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        base, size = t.untyped_storage().data_ptr(), t.element_size()
        start = base + t.storage_offset() * size
        stop = start + (0 if t.numel() == 0 else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * size
        extents.append((start, stop))
        if base < start:
            bands.append((base, start, f"before the start of {label}"))
        if stop < base + t.untyped_storage().nbytes():
            bands.append((stop, base + t.untyped_storage().nbytes(), f"past the end of {label}"))
    try:
        builder = importlib.import_module("triton.runtime.interpreter").InterpreterBuilder
        plain_load = builder.create_masked_load
    except (ImportError, AttributeError):
        builder = None

    def stray_load():
        negative = " (a negative index, such as a padding slot of -1, too)" if "before" in strays[0] else ""
        return ForbiddenCall(f"your kernel {kernel[0]} {strays[0]}: mask every load with the true sizes{negative} "
                             "(on a GPU such a load reads memory that is not the tensor's, or faults)")

    def watched_load(self, ptrs, mask, *a, **k):
        import numpy as np
        addresses = np.asarray(ptrs.data)
        addresses = addresses[np.broadcast_to(np.asarray(mask.data, dtype=bool), addresses.shape)]
        for lo, hi in extents:           # two arguments may be views of one buffer: each is the other's band
            addresses = addresses[(addresses < lo) | (addresses >= hi)]
        for lo, hi, where in bands:
            inside = (addresses >= lo) & (addresses < hi)
            if inside.any():
                strays.append(f"loaded {int(inside.sum())} value(s) {where}")
                addresses = addresses[~inside]
        if addresses.size and hosted:
            if strays:                   # e.g. an index read from a guarded table's band: the cause
                raise stray_load()
            raise ForbiddenCall(f"your kernel {kernel[0]} loaded {addresses.size} value(s) outside every tensor it "
                                "was given: an address computed from an undefined value, such as an index loaded "
                                "under a mask without other= (give it one, e.g. other=-1 for a padding slot, and "
                                "mask what it indexes); on a GPU such a load reads another tensor's memory, or faults")
        return plain_load(self, ptrs, mask, *a, **k)
    if builder is not None and extents:
        builder.create_masked_load = watched_load

    launches = [0]
    counted, recorded = [], []
    for module, cls in (("triton.runtime.jit", "JITFunction"), ("triton.runtime.interpreter", "InterpretedFunction")):
        try:
            klass = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            continue
        original = klass.run

        def counting(self, *a, _original=original, **k):
            where = str(getattr(getattr(self, "fn", None), "__module__", ""))
            name = getattr(getattr(self, "fn", None), "__name__", "?")
            if where.split(".")[0] == "atlaslib":
                raise ForbiddenCall(f"your answer launches the library's kernel {where}.{name}: "
                                    "launch your own @triton.jit kernel")
            a = tuple(with_pointer(x) for x in a)
            k = {key: with_pointer(x) for key, x in k.items()}
            if where.split(".")[0] == "triton" or k.get("warmup"):
                return _original(self, *a, **k)
            launches[0] += 1
            for x in [*a, *k.values()]:
                if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in own_storages:
                    raise ForbiddenCall(f"your kernel {name} was given a tensor that is not one of your function's "
                                        "arguments: it must read the inputs and store into the outputs it was given")
            first = launches[0] == 1
            for label, t, came in ins:
                if not (torch.equal(bits(t), bits(came)) if t.is_floating_point() else torch.equal(t, came)):
                    raise ForbiddenCall(f"{label} (an input) was changed before a launch of your kernel: "
                                        "your kernels must read the inputs as they were given")
            for j, (i, t) in enumerate(outs):
                if not first and not torch.equal(bits(t), bits(after[j])):
                    raise ForbiddenCall(f"argument {i + 1} (an output) was changed between two launches of your "
                                        "kernel: only your kernels may write the outputs")
            saved = [t.clone() for _, t in outs]
            if first:                   # what the first launch stores: whatever is not the pattern after it
                for _, t in outs:
                    bits(t).fill_(poison[t.element_size()])
            kernel[0] = name
            result = _original(self, *a, **k)
            if strays:
                raise stray_load()
            recorded.append((self, _original, a, k))
            for j, ((i, t), before) in enumerate(zip(outs, saved)):
                if first:               # what it did not store must be as it came: torch's writes do not count
                    stored = bits(t) != poison[t.element_size()]
                    by_torch = int((~stored & (bits(before) != bits(initial[j]))).sum())
                    if by_torch:
                        raise ForbiddenCall(f"{by_torch} of the {t.numel()} entries of argument {i + 1} (an output) "
                                            "were not stored by your @triton.jit kernel but written with torch "
                                            "before it: the kernel must compute the whole output (values "
                                            "written with torch do not count)")
                    bits(t).copy_(torch.where(stored, bits(t), bits(initial[j])))
                else:                   # later launches may read what earlier ones stored: what changed
                    stored = bits(t) != bits(before)
                written[j] |= stored
                after[j] = t.clone()
            return result
        klass.run = counting
        counted.append((klass, original))

    def replay():
        # The recorded launches again, each tensor argument replaced by the same view of a copy of its storage,
        # the floating inputs' values reversed in order and the outputs as they came.
        copies = {}

        def twin(x):
            if not isinstance(x, torch.Tensor):
                return x
            key = x.untyped_storage().data_ptr()
            if key not in copies:
                copies[key] = x.untyped_storage().clone()
            return x.new_empty(0).set_(copies[key], x.storage_offset(), x.shape, x.stride())
        with torch.no_grad():
            changed = False
            for _, t, came in ins:
                if t.is_floating_point():
                    permuted = came.reshape(-1).flip(0).reshape(came.shape)
                    changed = changed or not torch.equal(bits(permuted), bits(came))
                    twin(t).copy_(permuted)
            if not changed:
                return None
            for j, (_, t) in enumerate(outs):
                twin(t).copy_(initial[j])
            import warnings

            import numpy
            try:               # reordered log-gates are no longer monotone: overflows here are not the learner's
                with warnings.catch_warnings(), numpy.errstate(all="ignore"):
                    warnings.simplefilter("ignore")
                    for jit_fn, run, a, k in recorded:
                        run(jit_fn, *(twin(x) for x in a), **{key: twin(x) for key, x in k.items()})
            except Exception:
                return "raised"
            return any(not torch.equal(bits(twin(t)), bits(t)) for _, t in outs)

    try:
        result = fn(*args, **kwargs)
        for j, (i, t) in enumerate(outs if launches[0] else ()):      # no launch: the check says so
            # entries no kernel stored: left as they came (NaN), the check reports them; changed, they
            # were written by something else
            missing = int((~written[j] & (bits(t) != bits(initial[j]))).sum())
            if missing:
                raise ForbiddenCall(f"{missing} of the {t.numel()} entries of argument {i + 1} (an output) were not "
                                    "stored by your @triton.jit kernel: the kernel must compute the whole output "
                                    "(values written with torch do not count)")
            if not torch.equal(bits(t), bits(after[j])):
                raise ForbiddenCall(f"argument {i + 1} (an output) was changed after your kernel stored it: "
                                    "the values must be the ones your kernel computed")
        if builder is not None:
            builder.create_masked_load = plain_load      # the replay reads copies, not the arguments
        return result, (launches[0], replay() if recorded and outs else None)
    finally:
        if builder is not None:
            builder.create_masked_load = plain_load
        for klass, original in counted:
            klass.run = original
        for space, key, value in reversed(swaps):
            space[key] = value
        for f, code in reversed(codes):
            f.__code__ = code


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
    outputs = tuple(i for i, a in enumerate(args) if getattr(a, "_is_output", False)) if rules.needs_launch else ()
    try:
        if hasattr(fn, "remote_call"):
            result, (launches, moved) = fn.remote_call(args, kwargs, rules.forbidden, outputs)
        else:
            import __main__
            dtype, grad = rules.learner or (torch.get_default_dtype(), True)   # under the notebook's settings
            with torch_defaults(dtype, grad and torch.is_grad_enabled()):
                result, (launches, moved) = run_under_rules(fn, args, kwargs, rules.forbidden, [vars(__main__)],
                                                            outputs)
            result = from_numpy(result)
    except CallAborted:
        raise
    except RemoteError as e:
        if e.ename == "ForbiddenCall":
            raise CheckFailed(e.message) from None
        if e.ename == "PermissionError" and e.message.startswith(FORBIDDEN_MARK):
            raise CheckFailed(e.message[len(FORBIDDEN_MARK):]) from None
        if e.not_implemented:
            raise NotImplementedYet(e.message) from None
        raise LearnerError(f"your function raised {e}{cuda_fault_hint(str(e))}") from None
    except Exception as e:  # the learner's bug, reported without a traceback wall
        e = root_cause(e)
        if type(e).__name__ == "ForbiddenCall":
            raise CheckFailed(str(e)) from None
        if isinstance(e, PermissionError) and str(e).startswith(FORBIDDEN_MARK):
            raise CheckFailed(str(e)[len(FORBIDDEN_MARK):]) from None
        if is_not_implemented(e):
            raise NotImplementedYet(str(e)) from None
        raise LearnerError(f"your function raised {short(e)}{cuda_fault_hint(str(e))}") from None
    rules.launches.append(launches)
    rules.moved.append(moved)
    for label, t, before in inputs:
        if not torch.equal(torch.nan_to_num(t, nan=0.5), torch.nan_to_num(before, nan=0.5)) \
                or not torch.equal(t.isnan(), before.isnan()):
            raise CheckFailed(f"your function changed its input ({label}) in place: work on a copy "
                              "(e.g. M = M.clone()) or use out-of-place operations")
    return result


@contextlib.contextmanager
def torch_defaults(dtype: torch.dtype, grad: bool):
    """Run under this default dtype and grad mode, then put the caller's back. A check draws its inputs and
    computes its references in float32 with grad mode on, whatever the notebook set (a notebook under
    ``torch.set_default_dtype(torch.float64)`` mixed float64 and float32 inputs in every check); the
    learner's function runs under the notebook's own settings, as in the grader's kernel."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.set_grad_enabled(grad):
            yield
    finally:
        torch.set_default_dtype(before)


def from_numpy(x):
    """A result as the grader receives it from the learner's kernel (``grade.CALL_IN_KERNEL``'s ``plain``):
    numpy arrays become tensors and numpy scalars numbers, so that a check cell and the grader give one
    verdict."""
    if isinstance(x, tuple):
        return tuple(from_numpy(y) for y in x)
    if isinstance(x, list):
        return [from_numpy(y) for y in x]
    if type(x).__module__ == "numpy":
        return torch.from_numpy(x) if hasattr(x, "shape") and x.shape else x.item()
    return x


# how the stub that replaces a forbidden function's code starts its message
FORBIDDEN_MARK = "ForbiddenCall: "


def cuda_fault_hint(message: str) -> str:
    """Added to a CUDA fault (a load or store far out of bounds on a card): after one, every later CUDA call of
    the process fails, so the notebook's other checks would report errors that are not theirs."""
    if "illegal memory access" not in message and "illegal address" not in message:
        return ""
    return (". A CUDA fault leaves the GPU unusable for this kernel: look for an unmasked load or store, then "
            "restart the notebook's kernel before running another check")


def is_not_implemented(e: BaseException) -> bool:
    """The untouched stub: NotImplementedError, or a Triton kernel whose body raises it (on a GPU)."""
    return isinstance(e, NotImplementedError) or (compile_error(e) and "NotImplementedError" in str(e))


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


# assert_close's guess for a NaN, replaced by the likelier one: in torch code an undefined operation; in a
# kernel's output what the NaN's payload says (``core.interpreter``: unstored entries and undefined lanes
# carry their own)
NEVER_WROTE = "(an output the code never wrote?)"
NAN_IN_TORCH = "(a 0/0, inf - inf, inf * 0 or log 0 in your computation?)"
NAN_NEVER_STORED = "(an entry your kernel never stored, or loaded before storing it: a store missing or masked off?)"
NAN_UNDEFINED_LANE = ("(a masked-off lane of a load without other=, undefined on a GPU: give the load other=0.0, or "
                      "keep those lanes out of the result)")
NAN_IN_KERNEL = ("(your kernel computed it: a 0/0, inf - inf, inf * 0 or log 0, or a value from a masked-off lane "
                 "of a load without other=?)")
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def kernel_nan_guess(got: torch.Tensor) -> str:
    """What the first NaN of a kernel's output most likely is, read from its payload (the sign ignored)."""
    first = got.detach().reshape(-1)[torch.isnan(got.detach().reshape(-1))][:1]
    if got.dtype not in _BITS or not first.numel():
        return NEVER_WROTE
    name, width = str(got.dtype).removeprefix("torch."), 8 * got.element_size()
    bits = int(first.cpu().view(_BITS[got.dtype]).item()) & ((1 << (width - 1)) - 1)
    return {nan_bits(name, NEVER_STORED): NAN_NEVER_STORED,
            nan_bits(name, UNDEFINED_LANE): NAN_UNDEFINED_LANE}.get(bits, NAN_IN_KERNEL)


def compare(name: str, got, expected: torch.Tensor, tol: float | None = None, kernel_output: bool = False,
            explain: str = "") -> None:
    """Compare a learner tensor with the library's, through ``core.testing.assert_close``.

    A failure says what a NaN most likely is (for a ``kernel_output``, what its payload says: an entry never
    stored, a masked-off lane read, or an invalid operation; else an invalid operation) and, when a float64
    result is off by about float32's rounding, that a float32 tensor was made on the way. ``explain``, when
    the check has found the cause itself, replaces that guess."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{name} should be a torch.Tensor, got {type(got).__name__}")
    if got.device != expected.device:
        raise CheckFailed(f"{name} is on {got.device}, expected {expected.device}")
    if got.is_complex() or not got.is_floating_point():
        raise CheckFailed(f"{name} has dtype {got.dtype}, expected a floating-point tensor")
    try:
        assert_close(got.detach(), expected.detach(), tol=tol, name=name)
    except AssertionError as e:
        message = str(e).replace(NEVER_WROTE, kernel_nan_guess(got) if kernel_output else NAN_IN_TORCH)
        hint = dtype_hint(got.dtype, expected.dtype) or explain or float32_hint(got, expected)
        raise CheckFailed(f"{message}{hint or (tf32_hint(got, expected, tol) if kernel_output else '')}") from None


def float32_hint(got: torch.Tensor, want: torch.Tensor) -> str:
    """Added when a float64 answer is off by what float32 rounding costs (1e-8 to 1e-5 relative): its
    dtype is right, so ``dtype_hint`` is silent, and the numbers shown look equal to six digits."""
    if got.dtype != torch.float64 or want.dtype != torch.float64 or got.shape != want.shape:
        return ""
    err = rel_rmse(got.detach(), want.detach())
    if not 1e-8 < err < 1e-5:
        return ""
    return (". The error is about float32's rounding: a float32 tensor was made on the way (torch.tensor of a "
            "list, torch.zeros/ones/eye/arange without dtype=, a .float()); make it with dtype=x.dtype")


def tf32_hint(got: torch.Tensor, want: torch.Tensor, tol: float | None) -> str:
    """Added when a kernel's float32 output is off by what rounding its products' operands costs (above the
    check's tolerance, below 1e-2 relative): ``tl.dot``'s default TF32 products on a card, which the
    interpreter copies (``as_a_gpu``), or operands cast to fp16/bf16, which input_precision cannot undo."""
    if got.dtype != torch.float32 or got.shape != want.shape or tol is None:
        return ""
    if not tol < rel_rmse(got.detach(), want.detach().to(got.dtype)) < 1e-2:
        return ""
    return (". An error of this size is what rounded operands cost, if that is the cause: TF32 products (a "
            "tl.dot without input_precision=\"ieee\", on a card and in the interpreter here) or operands cast "
            "to fp16/bf16; keep them fp32 and pass input_precision=\"ieee\" (if every tl.dot already does, "
            "the error is a small mistake of another kind)")


def dtype_hint(got, want) -> str:
    """Added to a failed comparison when the answer lost precision: a float32 result cannot reach the
    tolerance of a float64 check, and the values shown then look equal."""
    if got.is_floating_point and want.is_floating_point and torch.finfo(got).eps > torch.finfo(want).eps:
        return (f". Your result is {got}, but the inputs are {want}: keep the inputs' dtype (a tensor made "
                f"without dtype=..., e.g. torch.zeros(n), is {torch.get_default_dtype()}, and so is a .float())")
    return ""


def compare_features(name: str, got, expected: torch.Tensor, features, dtype, tol: float = 1e-8) -> None:
    """``compare`` for inner products of a learner's feature vectors (computed in float64), with the dtype
    hint when the features themselves were made in a coarser dtype than the inputs (``dtype``)."""
    try:
        compare(name, got, expected, tol)
    except CheckFailed as e:
        coarse = [f.dtype for f in features if isinstance(f, torch.Tensor) and f.dtype != dtype]
        raise CheckFailed(f"{e}{dtype_hint(coarse[0], dtype) if coarse else ''}") from None


def check_shape(name: str, got, want, hint: str = "") -> None:
    """Fail unless ``got`` is a tensor of shape ``want``; ``hint`` is added to a wrong shape's message."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{name} should be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want):
        raise CheckFailed(f"{name} has shape {list(got.shape)}, expected {list(want)}{hint}")


def compare_finite(name: str, got, expected: torch.Tensor, tol: float, hint: str) -> None:
    """``compare`` (in ``expected``'s dtype), with ``hint`` when the answer is inf or NaN where ``expected`` is not."""
    if isinstance(got, torch.Tensor) and got.is_floating_point() and not torch.isfinite(got).all() \
            and torch.isfinite(expected).all():
        raise CheckFailed(f"{name} is not finite (inf or NaN){hint}")
    compare(name, got.to(expected.dtype) if isinstance(got, torch.Tensor) else got, expected, tol)


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

        rules = Rules(self.forbidden, self.needs_launch, learner=(torch.get_default_dtype(), torch.is_grad_enabled()))
        token = RULES.set(rules)
        try:
            with torch_defaults(torch.float32, True):
                summary = self.body(*fns, gen=fresh_generator())
            if self.needs_launch and not any(rules.launches):
                raise CheckFailed("your function computed the result without launching a @triton.jit kernel: "
                                  "this exercise is about writing one")
            replayed = [m for m in rules.moved if m is not None]
            if self.needs_launch and replayed and all(m == "raised" for m in replayed):
                raise CheckFailed("your kernel raised whenever the check ran its launches again on the inputs "
                                  "reordered, so the check cannot tell that it computes the outputs from its input "
                                  "tensors: a kernel that reads its inputs runs on any values of them")
            if self.needs_launch and replayed and not any(m is True for m in replayed):
                how = "raised or stored the same values" if "raised" in replayed else "stored the same values"
                raise CheckFailed(f"your kernel {how} when the check ran its launches again on "
                                  "the inputs reordered: the values came from the numbers it was given, not from "
                                  "its input tensors (computed with torch, they do not count); the kernel must "
                                  "compute the outputs from its inputs")
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

    def __init__(self, chapter: str, helpers: dict | None = None):
        self.chapter = chapter
        self.exercises: dict[str, Exercise] = {}
        # {module: names}: the library functions the chapter's cells may import (the exercises name them)
        self.helpers = {m: tuple(names) for m, names in (helpers or {}).items()}

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


def uneven_norms(gen: torch.Generator, *xs: torch.Tensor, low: float = 0.6, high: float = 1.15):
    """``xs`` (vectors along the last dimension, unit ones from ``random_qkv``) each rescaled to a norm drawn
    uniformly from [low, high]. The checks draw keys and queries this way, so that an answer that assumes unit
    keys (normalises k, divides by ||k||^2, uses k k^T k = k) fails; ``high`` keeps beta ||k||^2 below 2 for
    the betas the checks draw (at most 1.5), where the delta rule stays stable."""
    out = tuple(x * (low + (high - low) * torch.rand(x.shape[:-1], generator=gen, dtype=torch.float64))
                .to(x.dtype)[..., None] for x in xs)
    return out[0] if len(out) == 1 else out


def with_resets(alpha: torch.Tensor, first: int = 3, every: int = 7) -> torch.Tensor:
    """``alpha`` [B, H, T] with the gates of tokens first, first + every, ... exactly 0: full resets, which
    the statements allow (alpha_t in [0, 1]) and which a chunk form that takes log(alpha) must floor (the
    library floors it at -60): log 0 = -inf, and -inf - (-inf) is NaN."""
    alpha = alpha.clone()
    alpha[..., first::every] = 0.0
    return alpha


def guarded(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``x`` that sits between two bands of NaN (of the dtype's largest value, for
    integers).

    A kernel that loads past the end of its input (a missing or wrong mask) reads NaN,
    which then shows up in its output; an index read there points far past any row it may
    index, so the load through it fails too (refused under the interpreter; on a GPU it reads
    far off, or faults).
    """
    fill = float("nan") if x.is_floating_point() else torch.iinfo(x.dtype).max
    flat = torch.full((x.numel() + 2 * GUARD,), fill, dtype=x.dtype, device=x.device)
    view = flat[GUARD:GUARD + x.numel()].view(x.shape)
    view.copy_(x)
    view._guarded_base = flat  # keep the buffer alive with the view
    return view


def guarded_output(shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """A NaN-filled output buffer (unwritten entries stay NaN, with the payload ``NEVER_STORED``) between two
    SENTINEL bands."""
    n = 1
    for s in shape:
        n *= s
    flat = torch.full((n + 2 * GUARD,), SENTINEL, dtype=dtype, device=device)
    view = flat[GUARD:GUARD + n].view(*shape)
    view.view(_BITS[dtype]).fill_(nan_bits(str(dtype).removeprefix("torch."), NEVER_STORED))
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
            raise CheckFailed(f"your kernel wrote {changed} value(s) {side} of {name}: mask the stores with the "
                              "true sizes, and compute their addresses from the output's own sizes (a row of "
                              "the output is its true length long, not the block size)")


NAN_HINT = (" Hint: NaN comes from an output the kernel never stored, from a load past the end of an input "
            "(the check surrounds every input with NaN), or from the masked-off lanes of a load without "
            "other= (undefined on a GPU: NaN here); mask loads and stores with the true sizes, and give "
            "masked loads other=0.0.")


def compare_kernel_output(name: str, got, want, tol: float, hint: str = NAN_HINT, on: tuple = ("NaN",)) -> None:
    """``compare`` for a kernel's output buffer, with ``hint`` added to a failure whose message has a word of ``on``."""
    try:
        compare(name, got, want, tol, kernel_output=True)
    except CheckFailed as e:
        raise CheckFailed(f"{e}{hint if any(w in str(e) for w in on) else ''}") from None


# ---- Static rules: what a graded notebook's code may name, checked before anything runs ---------
#
# The grader reads every code cell's source in its own process (nothing the notebook does can change
# this) and refuses a notebook that imports or names anything outside what the exercises allow, or that
# reaches for a dynamic escape hatch. The runtime rules above stay as a second line.

# Modules any cell may import (and their attributes, less the ones below)
ALLOWED_MODULES = ("math", "torch", "torch.nn", "torch.nn.functional", "torch.linalg", "torch.special",
                   "triton", "triton.language", "itertools", "collections", "__future__", "os")
# ``os`` is there for the set-up cell's ``os.environ["TRITON_INTERPRET"] = "1"`` only
OS_ATTRIBUTES = ("environ",)
# Modules an attribute chain may pass through (``torch.cuda.is_available()``): the importable ones and a
# few of torch's numerical namespaces. Torch's other submodules lead on to modules that run code the screen
# cannot read (``torch.glob.re.enum.bltns.exec``, ``torch.jit.trace`` of a library function, a shell
# command in ``torch.utils``), so a chain that reaches one is refused.
TRAVERSABLE_MODULES = frozenset(ALLOWED_MODULES) | {
    "torch.cuda", "torch.fft", "torch.autograd", "torch.testing", "torch.nn.init", "torch.random",
    "triton.language.math"}
# Names no cell may use: ways to run code the screen cannot read, or to reach other modules
FORBIDDEN_NAMES = frozenset({
    "__import__", "importlib", "exec", "eval", "compile", "globals", "locals", "vars", "getattr", "setattr",
    "delattr", "get_ipython", "builtins", "sys", "open", "breakpoint", "input", "exit", "quit", "help",
    "memoryview", "In", "Out", "_ih", "_oh", "_dh"})
# Attributes no cell may use, on anything: they lead to other modules, frames, files or processes
FORBIDDEN_ATTRIBUTES = frozenset({
    "os", "sys", "modules", "builtins", "importlib", "import_module", "subprocess", "inspect", "gc", "ctypes",
    "atlaslib", "IPython", "get_ipython", "f_globals", "f_locals", "f_back", "f_builtins", "f_code", "tb_frame",
    "tb_next", "gi_frame", "gi_code", "cr_frame", "ag_frame", "func_globals", "system", "popen", "kill", "killpg",
    "fork", "execv", "execve", "execvp", "spawnv", "loads", "tofile", "load_inline",
    "load_library", "cpp_extension", "hub", "library", "serialization", "package", "shutil", "pathlib",
    "signal", "socket", "multiprocessing", "threading",
    # raw memory: a kernel may only touch the tensors it is given, through their own pointers
    "data_ptr", "pointer_type", "untyped_storage", "storage", "set_", "inline_asm_elementwise",
    # autograd's graph: calling a node's backward is autograd by another name
    "grad_fn", "next_functions", "get_gradient_edge",
    # the forbidden built-ins, reached as attributes of an object (a module's ``builtins``, say), and what
    # reaches modules from a call's result, which the screen cannot follow
    "exec", "getattr", "setattr", "delattr", "globals", "locals", "vars", "breakpoint", "bltns", "attrgetter",
    "methodcaller", "get_device_module"})
ALLOWED_DUNDERS = frozenset({"__init__", "__call__", "__name__", "__doc__"})


class Rejected(Exception):
    """A notebook the grader refuses to run: the message names the cell and the rule."""


def _builtin_names():
    import builtins
    return frozenset(name for name in dir(builtins) if not name.startswith("_"))


def screen(cells, chapter: str, exercises, helpers: dict) -> None:
    """Raise ``Rejected`` if a code cell breaks the static rules.

    ``cells``: (label, source) of every code cell; ``exercises``: the names ``check.<name>`` may take;
    ``helpers``: {module: names} of library functions the chapter's cells may import.
    """
    import ast
    import importlib
    import types

    from IPython.core.inputtransformer2 import TransformerManager
    transform = TransformerManager().transform_cell
    own_checks = f"atlaslib.exercises.{chapter}"
    builtin = _builtin_names()
    checks: set = set()            # names bound to the chapter's check module
    modules: set = set()           # names bound by imports (their attributes are read-only)
    bound: dict = {}               # name -> the object an import binds it to (in this process)
    os_names: set = set()          # names bound to the os module
    trees = []
    for label, source in cells:
        try:
            # line magics, shell escapes and cell magics become get_ipython() calls, refused below
            trees.append((label, ast.parse(transform(source))))
        except (SyntaxError, ValueError):
            continue               # the kernel cannot run it either; the cell's error is reported then

    def refuse(label, why):
        raise Rejected(f"{label}: {why}")

    for label, tree in trees:     # imports first: they decide what the other names are
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name not in ALLOWED_MODULES:
                        refuse(label, f"`import {alias.name}` is not allowed "
                                      f"(allowed: {', '.join(m for m in ALLOWED_MODULES if m != '__future__')})")
                    modules.add((alias.asname or alias.name).split(".")[0])
                    name = alias.asname or alias.name.split(".")[0]
                    try:
                        bound[name] = importlib.import_module(alias.name if alias.asname else name)
                    except ImportError:
                        pass       # the kernel cannot import it either
                    if alias.name == "os":
                        os_names.add(alias.asname or "os")
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                names = [a.name for a in node.names]
                if node.level or "*" in names:
                    refuse(label, "relative and `*` imports are not allowed")
                if module == "atlaslib.exercises" and names == [chapter]:
                    checks.add(node.names[0].asname or chapter)
                    continue
                if module == own_checks:
                    refuse(label, f"import the checks as a module (`from atlaslib.exercises import {chapter} "
                                  "as check`), not names from it")
                if module in helpers:
                    bad = [n for n in names if n not in helpers[module]]
                    if bad:
                        refuse(label, f"`from {module} import {bad[0]}` is not allowed (the library's functions "
                                      "are not yours to call; the exercises name the helpers you may use)")
                    continue
                if module.split(".")[0] == "atlaslib":
                    refuse(label, f"`from {module} import ...` is not allowed (the library's functions are not "
                                  "yours to call; the exercises name the helpers you may use)")
                if module not in ALLOWED_MODULES:
                    refuse(label, f"`from {module} import ...` is not allowed "
                                  f"(allowed: {', '.join(m for m in ALLOWED_MODULES if m != '__future__')})")
                for alias in node.names:
                    if alias.name in FORBIDDEN_ATTRIBUTES or alias.name.startswith("_") or \
                            (module == "os" and alias.name not in OS_ATTRIBUTES):
                        refuse(label, f"`from {module} import {alias.name}` is not allowed")
                    if module != "__future__":
                        modules.add(alias.asname or alias.name)
                        try:
                            value = getattr(importlib.import_module(module), alias.name, None)
                        except ImportError:
                            value = None
                        if isinstance(value, types.ModuleType) and value.__name__ not in TRAVERSABLE_MODULES:
                            refuse(label, f"`from {module} import {alias.name}` is not allowed (it is the module "
                                          f"`{value.__name__}`)")
                        if value is not None:
                            bound[alias.asname or alias.name] = value

    def root(node):
        while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
            node = node.func if isinstance(node, ast.Call) else node.value
        return node.id if isinstance(node, ast.Name) else None

    def module_level_targets(tree):
        """Names a cell binds in the notebook's namespace (not inside a function or class)."""
        out = []

        def visit(node):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.append(node.name)
                for d in node.decorator_list:
                    visit(d)
                return             # their bodies bind local names
            if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                return
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.append(node.id)
            elif isinstance(node, ast.alias):
                out.append((node.asname or node.name).split(".")[0])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                out.append(node.name)
            for child in ast.iter_child_nodes(node):
                visit(child)
        visit(tree)
        return out

    def resolve(node):
        """The object an attribute chain rooted at an imported name reaches in this process (None: unknown)."""
        chain = []
        while isinstance(node, ast.Attribute):
            chain.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name) or node.id not in bound:
            return None
        value = bound[node.id]
        for attr in reversed(chain):
            if isinstance(value, types.ModuleType) and value.__name__ not in TRAVERSABLE_MODULES:
                return value       # the chain passes through a module it may not
            try:
                value = getattr(value, attr, None)
            except Exception:      # a property that raises (``torch.qint8.is_signed``): the kernel's problem
                return None
            if value is None:
                return None
        return value

    for label, tree in trees:
        parents = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                parents[child] = node

        def used_through_attribute(node):
            parent = parents.get(node)
            return isinstance(parent, ast.Attribute) and parent.value is node

        def local_to_a_function(node):
            """Whether ``node``'s name is a parameter or an assigned name of a function around it (``N, T, F =
            x.shape`` beside ``import torch.nn.functional as F``). Imports are not counted: they bind modules,
            and a module reaches any other local only through a use that this screen refuses where it is."""
            scope = parents.get(node)
            while scope is not None:
                if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    a = scope.args
                    params = {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg] if x}
                    body = scope.body if isinstance(scope.body, list) else [scope.body]
                    assigned = {n.id for stmt in body for n in ast.walk(stmt)
                                if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
                    if node.id in params | assigned:
                        return True
                scope = parents.get(scope)
            return False

        for name in module_level_targets(tree):
            if name in builtin or name in FORBIDDEN_NAMES or name.startswith("__"):
                refuse(label, f"the cell rebinds `{name}` for the whole notebook: use another name")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    if name in builtin or name.startswith("__"):
                        refuse(label, f"`global {name}` is not allowed")
            if isinstance(node, ast.Name):
                if isinstance(bound.get(node.id), types.ModuleType) and isinstance(node.ctx, ast.Load) \
                        and not used_through_attribute(node) and not local_to_a_function(node):
                    refuse(label, f"the module `{node.id}` may only be used through its attributes "
                                  f"(`{node.id}.name`), not passed, returned or bound to another name (a variable "
                                  "of that name outside a function looks like the module: rename it)")
                if node.id in FORBIDDEN_NAMES or node.id.startswith("__"):
                    # the screen reads names, not scopes: a variable of the reader's own called `input` looks
                    # like the built-in, so say so
                    own = " (the screen cannot tell a variable of that name from the built-in: rename it)" \
                        if node.id in builtin else ""
                    refuse(label, f"`{node.id}` is not allowed in a graded notebook{own}")
                if node.id in checks:
                    parent = parents.get(node)
                    ok = (isinstance(parent, ast.Attribute) and parent.attr in exercises
                          and isinstance(parents.get(parent), ast.Call) and parents[parent].func is parent)
                    if not ok and not isinstance(node.ctx, ast.Store):
                        refuse(label, f"`{node.id}` (the checks) may only be called as `{node.id}.<exercise>(...)`")
            elif isinstance(node, ast.Attribute):
                attr = node.attr
                if attr in FORBIDDEN_ATTRIBUTES or (attr.startswith("_") and attr not in ALLOWED_DUNDERS):
                    refuse(label, f"the attribute `.{attr}` is not allowed in a graded notebook")
                reached = resolve(node)
                if isinstance(reached, types.ModuleType):
                    chain = ast.unparse(node)
                    if reached.__name__ not in TRAVERSABLE_MODULES:
                        refuse(label, f"`{chain}` reaches the module `{reached.__name__}`, which a graded notebook "
                                      "may not use")
                    if not used_through_attribute(node):
                        refuse(label, f"`{chain}` is a module: use what it holds through it (`{chain}.name`), "
                                      f"or import it (`import {reached.__name__} as ...`)")
                base = root(node)
                if isinstance(node.value, ast.Name) and node.value.id in os_names and attr not in OS_ATTRIBUTES:
                    refuse(label, f"`os.{attr}` is not allowed (only `os.environ`)")
                if isinstance(node.ctx, (ast.Store, ast.Del)) and base in modules | checks:
                    refuse(label, f"the cell changes `{ast.unparse(node)}`, part of a module: "
                                  "keep your changes to your own objects")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "eval" \
                    and (node.args or node.keywords):
                refuse(label, "`.eval(...)` with an argument is not allowed (a module's `.eval()` takes none; "
                              "the built-in `eval` runs code the screen cannot read)")
            elif isinstance(node, ast.keyword) and node.arg in ("weights_only", "pickle_module"):
                refuse(label, f"`{node.arg}=` is not allowed (loading pickled objects can run any code)")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name.startswith("__") and node.name not in ALLOWED_DUNDERS \
                        and not isinstance(parents.get(node), ast.ClassDef):
                    refuse(label, f"`{node.name}` is not allowed in a graded notebook")
