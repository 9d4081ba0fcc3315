"""Input checks shared by every public function.

Each check raises ``ValueError`` or ``TypeError`` that names the argument and the
shape it should have, so a reader never meets an IndexError from deep inside a loop.
Shapes, dtypes and devices are always checked; values (ranges, NaN) never by a host sync, but for
one: the exact exponential kernel's score bound (``deep.validation.check_exponents``) costs one scalar
read per call on an accelerator.
"""
from __future__ import annotations

import contextlib
import math
import numbers
import operator

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _value_check(x: torch.Tensor):
    """How to check x's values without a host sync: "host" (a CPU tensor in eager mode: reading
    it waits for nothing), "device" (an accelerator: a device-side assert, so the host goes on
    and a bad value stops the program at the next sync, with the message), or None (while
    torch.compile traces, where either would break the graph; or a meta tensor, without values)."""
    if torch.compiler.is_compiling() or x.device.type == "meta":
        return None
    return "host" if x.device.type == "cpu" else "device"


def check_tensor(name: str, x, ndim: int, layout: str) -> torch.Tensor:
    """``x`` must be a floating tensor of rank ``ndim`` (``layout`` names its axes)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor (fp32/fp16/bf16/fp64), got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim} dims), got {_shape(x)}")
    return x


def check_qkv_shapes(q, k, v):
    """The shape part of ``check_qkv``: q, k [B, H, T, K] and v [B, H, T, V] floating tensors (any may be 0).
    Returns (B, H, T, K, V)."""
    check_tensor("q", q, 4, "[B, H, T, K]")
    check_tensor("k", k, 4, "[B, H, T, K]")
    check_tensor("v", v, 4, "[B, H, T, V]")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, H, T, K], got q {_shape(q)} and k {_shape(k)}")
    B, H, T, K = q.shape
    if v.shape[:3] != (B, H, T):
        raise ValueError(f"v must have shape [B, H, T, V] = [{B}, {H}, {T}, V] to match q, got {_shape(v)}")
    return B, H, T, K, v.shape[3]


def check_non_empty(q, v) -> None:
    if min(*q.shape, v.shape[3]) < 1:
        raise ValueError(f"q, k, v must be non-empty, got q {_shape(q)} and v {_shape(v)}")


def check_qkv(q, k, v):
    """q, k: [B, H, T, K]; v: [B, H, T, V]. Returns (B, H, T, K, V)."""
    B, H, T, K, _ = check_qkv_shapes(q, k, v)
    check_non_empty(q, v)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    return B, H, T, K, v.shape[3]


def check_shape(name: str, x, *shapes: tuple, ref: torch.Tensor | None = None):
    """``x`` is None (an absent gate) or a floating tensor of one of ``shapes`` (on ``ref``'s device, when
    given); returns it.

    Shapes only: no value is read, so the lower-level forms can call it without waiting for the device.
    """
    if x is None:
        return None

    def allowed() -> str:        # only for a message: str() of a length that torch.compile traces as symbolic
        return " or ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes)   # cannot be traced
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {allowed()}, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if tuple(x.shape) not in [tuple(s) for s in shapes]:
        raise ValueError(f"{name} must have shape {allowed()}, got {_shape(x)}")
    if ref is not None and x.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like q, got {x.device}")
    return x


def check_one_retention(alpha, log_alpha) -> None:
    """The retention gate comes as alpha or as its log, not both (no form would know which to use)."""
    if alpha is not None and log_alpha is not None:
        raise ValueError("give the retention gate either as alpha or as log_alpha, not both")


def check_form_shapes(q, k, v, *, window: int | None = None, gamma=None, per_channel: tuple = (),
                      required: tuple = (), **gates):
    """The shapes, dtypes and devices a lower-level form (a ``*_recurrent`` or ``*_chunk``) can check for free.

    q, k [B, H, T, K] and v [B, H, T, V], none of them empty, one dtype, one device; ``gamma`` [B, H, T] or
    [B, H, T, window]; every other gate [B, H, T], or also [B, H, T, K] when its name is in ``per_channel``, on
    q's device; absent gates None, except those
    named in ``required``; alpha and log_alpha not both. Values are not read: the entry points check them
    before they call a form, and here it would cost a host sync. Returns (B, H, T, K, V).
    """
    for name in required:
        if gates.get(name) is None:
            raise TypeError(f"{name} is required: a [B, H, T] tensor")
    check_one_retention(gates.get("alpha"), gates.get("log_alpha"))
    B, H, T, K, V = check_qkv(q, k, v)
    check_shape("gamma", gamma, (B, H, T), *([] if window is None else [(B, H, T, window)]), ref=q)
    for name, g in gates.items():
        check_shape(name, g, (B, H, T), *([(B, H, T, K)] if name in per_channel else []), ref=q)
    return B, H, T, K, V


def _range(low, high) -> str:
    return f"[{low}, {high}]" if high is not None else f"[{low}, inf)"


def check_gate(name: str, g, B: int, H: int, T: int, K: int | None = None, *,
               low: float = 0.0, high: float | None = 1.0, ref: torch.Tensor | None = None):
    """A gate is ``[B, H, T]`` (scalar per token) or, when ``K`` is given, also ``[B, H, T, K]``.

    Values must lie in ``[low, high]`` (``high=None``: no upper bound, but finite); ``_value_check``
    says how that is checked. Returns the gate, or ``None`` if ``g`` is ``None``.
    """
    if check_shape(name, g, (B, H, T), *([] if K is None else [(B, H, T, K)]), ref=ref) is None:
        return None
    if g.numel() == 0:
        return g
    top = math.inf if high is None else high                     # +inf itself is never a step or a gate
    how = _value_check(g)
    if how == "host":
        with torch.no_grad():                                    # one pass: NaN propagates to min and max
            g_min, g_max = (x.item() for x in torch.aminmax(g))
        if math.isnan(g_min) or math.isnan(g_max):
            raise ValueError(f"{name} contains NaN")
        if g_min < low or g_max > top or g_max == math.inf:
            raise ValueError(f"{name} must lie in {_range(low, high)}, got values in [{g_min:.4g}, {g_max:.4g}]")
    elif how == "device":
        with torch.no_grad():                                    # NaN fails the comparisons too
            inside = (g >= low) & (g <= top) & (g < math.inf)
            torch._assert_async(inside.all(), f"{name} must lie in {_range(low, high)} and contain no NaN")
    return g


def check_state(name: str, s, shape: tuple, ref: torch.Tensor):
    """An optional state tensor of an exact shape, on ``ref``'s device, finite (no NaN or inf; checked
    as ``_value_check`` says)."""
    if s is None:
        return None

    def want() -> str:          # only for a message (str() of a symbolic size cannot be traced)
        return "[" + ", ".join(str(d) for d in shape) + "]"
    if not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {want()}, got {type(s).__name__}")
    if s.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor, got {s.dtype}")
    if tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {want()}, got {_shape(s)}")
    if s.device != ref.device:
        raise ValueError(f"{name} must be on {ref.device} like q, got {s.device}")
    how = _value_check(s)
    if how == "host":
        if not torch.isfinite(s).all():
            raise ValueError(f"{name} contains NaN or inf")
    elif how == "device":
        with torch.no_grad():
            torch._assert_async(torch.isfinite(s).all(), f"{name} contains NaN or inf")
    return s


def check_positive_number(name: str, value, what: str) -> float:
    """A step size or a bound: a finite number > 0 (``what`` says what it sets). ``True`` is refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a finite number > 0 ({what}), got {value!r}")
    return float(value)


def check_flag(name: str, x) -> bool:
    """A switch must be a bool: a string such as "no" would otherwise count as True."""
    if not isinstance(x, bool):
        raise TypeError(f"{name} must be True or False, got {x!r}")
    return x


def check_int(name: str, x, low: int, note: str = ""):
    """A count or a size: an int >= ``low``. TypeError for anything else (``True`` and ``2.0`` too), ValueError
    below ``low``; ``note`` ends both messages. A SymInt (torch.compile tracing dynamic shapes) passes as it is."""
    kind = {0: "a non-negative int", 1: "a positive int"}.get(low, f"an int >= {low}")
    if isinstance(x, bool) or not isinstance(x, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"{name} must be {kind}, got {x!r}{note}")
    if x < low:
        raise ValueError(f"{name} must be >= {low}, got {x}{note}")
    return x if isinstance(x, torch.SymInt) else int(x)


def static_int(n):
    """An int as its value; anything else as it is. While torch.compile traces with dynamic shapes, a size
    (or an int option) is symbolic, and what Python builds from it (a layout, a table of monomials, a seeded
    draw, math.comb) needs the number: operator.index fixes it to its value with a guard, so each value
    compiles its own graph. (Dynamo calls a symbolic int an int; it is never a bool.)"""
    return operator.index(n) if isinstance(n, numbers.Integral) and not isinstance(n, bool) else n


def check_chunk_size(chunk_size) -> int:
    return check_int("chunk_size", chunk_size, 1)


def check_window(window) -> int:
    """The window length c must be an int >= 1."""
    return check_int("window", window, 1, " (the number c of pairs in each update)")


def gate_or_number(name: str, x, B: int, H: int, T: int, cd: torch.dtype, ref: torch.Tensor, *,
                   low: float = 0.0, high: float | None = 1.0, width: int | None = None) -> torch.Tensor | None:
    """A gate given as a tensor [B, H, T] (or [B, H, T, width]) or as one number for every token.

    A number is checked against [low, high] and becomes a [B, H, T] tensor in ``cd`` on ``ref``'s
    device; a tensor goes through ``check_gate`` and is returned as it is; None stays None.
    """
    if x is None:
        return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        x = float(x)
        if x != x or x < low or (high is not None and x > high) or x == math.inf:
            raise ValueError(f"{name} must lie in [{low}, {'inf)' if high is None else f'{high}]'}, got {x}")
        return torch.full((B, H, T), x, dtype=cd, device=ref.device)
    check_gate(name, x, B, H, T, width, low=low, high=high, ref=ref)
    return x


@contextlib.contextmanager
def process_constant():
    """Where a process-wide cache builds its tensors: real tensors outside inference mode, whatever mode the
    caller runs under (``torch.device("meta")``, ``FakeTensorMode``), which would otherwise be cached for
    every later call. Pass ``device="cpu"`` explicitly as well (a default device is read per call). Under
    ``FakeTensorMode`` these constants are real tensors: give it ``allow_non_fake_inputs=True``."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.inference_mode(False):
        yield
