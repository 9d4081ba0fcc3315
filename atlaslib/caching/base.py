"""The base model of Memory Caching: any function of the book that starts from ``initial_state`` and
returns its final state (``linear_attention``, ``delta_rule``, ``miras`` and its presets,
``omega_rule``, ``swla``, ``atlas``, ``dla``).

A base is called as ``base(q, k, v, initial_state=..., output_final_state=True, backend=...,
chunk_size=..., **base_kwargs)``. Per-token tensors in ``base_kwargs`` (gates whose first three
dims are [B, H, T]) are cut with the segment; everything else is passed as is. Each segment is
its own sequence for the base, so the base's chunks start at each segment start: the cached states
are exact chunk-end states of the base's chunk form (chapter 7 §1).

The readout of a cached state on the queries is one of two things:

* linear memory (state a matrix [B, H, V, D]): M phi(q_t), a contraction (see ``linear_features``);
* any other memory: the base itself, started at the cached state with learning switched off
  (eta = 0 or beta = 0, zero values, no retention gate, no momentum), so every step leaves the
  state unchanged and y_t = M(phi(q_t)) is the base's own readout (``probe``).
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from ..core import apply_feature_map
from ..miras import MirasConfig, MirasState, make_config, miras

# Gates that only change the state (they are dropped for a probe, whose state must not move).
WRITE_GATES = ("alpha", "log_alpha", "theta")
# Retentions whose raw state is not the weights, or memories with a layer norm: no contraction.
NONLINEAR_READ = ("kl", "lq")


def base_name(base) -> str:
    return getattr(base, "__name__", type(base).__name__)


def check_base(base, base_kwargs) -> dict:
    """The base must be callable and take initial_state and output_final_state. Returns its kwargs."""
    if not callable(base):
        raise TypeError(f"base must be a model function of the book (e.g. atlaslib.linear.linear_attention), "
                        f"got {type(base).__name__}")
    try:
        params = inspect.signature(base).parameters
    except (TypeError, ValueError):
        params = {}
    missing = [p for p in ("initial_state", "output_final_state") if p not in params]
    if missing:
        raise ValueError(f"base {base_name(base)!r} does not take {' and '.join(missing)}: memory caching starts "
                         "each segment from a state and caches the state it ends in, so the base must accept "
                         "initial_state and return its final state (output_final_state=True)")
    if base_kwargs is not None and not isinstance(base_kwargs, dict):
        raise TypeError(f"base_kwargs must be a dict of the base's keyword arguments (or None), got "
                        f"{type(base_kwargs).__name__}")
    kw = dict(base_kwargs or {})
    bad = [n for n in ("q", "k", "v", "initial_state", "output_final_state", "backend", "chunk_size") if n in kw]
    if bad:
        raise ValueError(f"base_kwargs must not set {bad}: memory caching passes them itself")
    if kw.get("normalize"):
        raise ValueError("base_kwargs normalize=True is not supported: the normaliser z^T q makes the readout "
                         "of a cached state nonlinear; cache unnormalised memories")
    return kw


def check_per_token(kw: dict, B: int, H: int, T: int) -> None:
    """A tensor of ``base_kwargs`` with 3 dims or more is a per-token gate ([B, H, T, ...]) and is cut into
    the segments; any other shape (another T, or [B, T, H]) would reach every segment whole and fail there
    with the segment's length in its message, so it is refused here, with the whole sequence's shape."""
    for n, x in kw.items():
        if isinstance(x, torch.Tensor) and x.dim() >= 3 and tuple(x.shape[:3]) != (B, H, T):
            raise ValueError(f"base_kwargs[{n!r}] must have shape [B, H, T, ...] = [{B}, {H}, {T}, ...] like q "
                             f"(it is cut into the segments), got {list(x.shape)}")


def takes(base, name: str) -> bool:
    return name in inspect.signature(base).parameters


def slice_kwargs(kw: dict, shape3: tuple, a: int, b: int) -> dict:
    """Cut the per-token tensors ([B, H, T, ...]) of ``kw`` to tokens [a, b)."""
    return {n: (x[:, :, a:b] if isinstance(x, torch.Tensor) and x.dim() >= 3 and tuple(x.shape[:3]) == shape3
                else x) for n, x in kw.items()}


def run_base(base, q, k, v, kw: dict, initial_state, backend: str, chunk_size: int | None):
    """(o, final state) of the base over one sequence (or a batch of segments); chunk_size None: the
    base's own default."""
    extra = {"chunk_size": chunk_size} if chunk_size is not None and takes(base, "chunk_size") else {}
    if takes(base, "backend"):
        extra["backend"] = backend
    o, state = base(q, k, v, initial_state=initial_state, output_final_state=True, **kw, **extra)
    if state is None:
        raise ValueError(f"base {base_name(base)!r} returned no final state with output_final_state=True")
    return o, state


def cut_segments(q, k, v, kw: dict, spans) -> list:
    """(q, k, v, kw) of each span, for consecutive spans tiling [0, T): the tensors cut once (split), so
    the backward stacks the segments' gradients instead of zero-filling a whole-sequence gradient per
    segment and tensor (O(T^2 / C) for segments of C tokens)."""
    B, H, T = q.shape[:3]
    lengths = [b - a for a, b in spans]
    cut = lambda x: (x.split(lengths, dim=2) if isinstance(x, torch.Tensor) and x.dim() >= 3  # noqa: E731
                     and tuple(x.shape[:3]) == (B, H, T) else [x] * len(spans))
    qs, ks, vs = cut(q), cut(k), cut(v)
    kws = {n: cut(x) for n, x in kw.items()}
    return [(qs[i], ks[i], vs[i], {n: x[i] for n, x in kws.items()}) for i in range(len(spans))]


def run_segment(base, q, k, v, kw: dict, a: int, b: int, init, carried: bool, backend: str, chunk_size: int,
                piece=None):
    """(o, final state) of the base over tokens [a, b) from ``init``. ``carried``: init is the final state
    of the segment before (checkpoint mode), so a state the base refuses (NaN, inf) is an earlier
    segment's divergence, and the error says so instead of naming an initial_state nobody passed.
    ``piece``: (q, k, v, kw) of tokens [a, b) already cut (``cut_segments``); None: sliced here."""
    B, H, T = q.shape[:3]
    if piece is None:
        piece = (q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], slice_kwargs(kw, (B, H, T), a, b))
    try:
        return run_base(base, *piece, init, backend, chunk_size)
    except ValueError as err:
        if not carried or "initial_state" not in str(err):
            raise
        raise ValueError(f"segment [{a}, {b}) starts from the final state of the segment before it "
                         f"(mode='checkpoint') and the base {base_name(base)!r} refused that state ({err}): the base "
                         "diverged in an earlier segment (too large a step size, or non-finite inputs there)") from err


def memory_part(state):
    """The memory of a state: the tensor itself, or the memory of a MirasState / (M, S) pair."""
    return state[0] if isinstance(state, tuple) else state


def without_momentum(state):
    """The state with no optimizer momentum (a cached memory is read, never trained further)."""
    return MirasState(memory_part(state), None) if isinstance(state, tuple) else state


def miras_config(base, kw: dict) -> MirasConfig | None:
    """The MIRAS configuration a ``miras`` call would build from kw (None for other bases)."""
    if base is not miras:
        return None
    fields = {f.name for f in dataclasses.fields(MirasConfig)}
    over = {n: x for n, x in kw.items() if n in fields}
    return make_config(kw.get("config") if kw.get("config") is not None else kw.get("preset"), **over)


def linear_features(base, kw: dict, state, q, k):
    """phi(q) [B, H, T, D] when the cached memory is a matrix read as M phi(q); else None (use ``probe``)."""
    M = memory_part(state)
    if not isinstance(M, torch.Tensor) or "phi_star" in kw and kw["phi_star"] is not None:
        return None
    cfg = miras_config(base, kw)
    if cfg is not None and (cfg.retention in NONLINEAR_READ or cfg.layer_norm):
        return None
    fq = apply_feature_map(kw.get("phi"), q, k)[0] if "phi" in kw else q
    return fq if fq.shape[-1] == M.shape[-1] else None


def probe(base, state, q, V: int, kw: dict, chunk_size: int, backend: str):
    """M(phi(q_t)) for every t: the base from ``state`` with learning off (eta = 0 / beta = 0, v = 0,
    no retention gate or momentum), so the state never moves. Exact for every base whose step with a
    zero step size is the identity (all but the elastic-net retention, whose threshold still acts)."""
    B, H, T = q.shape[:3]
    kw = {n: x for n, x in kw.items() if n not in WRITE_GATES and n != "beta"}
    zero = torch.zeros(B, H, T, dtype=q.dtype, device=q.device)
    if takes(base, "eta"):
        kw["eta"] = zero
    if takes(base, "beta"):
        kw["beta"] = zero
    v0 = torch.zeros(B, H, T, V, dtype=q.dtype, device=q.device)
    try:
        o, _ = run_base(base, q, q, v0, kw, without_momentum(state), backend, chunk_size)
    except ValueError as err:
        if "initial_state" not in str(err):
            raise
        raise ValueError(f"a state the readout reads was refused by the base {base_name(base)!r} ({err}): the base "
                         "diverged while compressing a segment (too large a step size, or non-finite inputs "
                         "there)") from err
    return o


# ---- states as vectors: scaling and adding (soup mixes parameters, [MC] eq. 14-15) ----

def state_map(f, *states):
    """Apply f leaf-wise over states of one structure (tensor, dict, MirasState/tuple with None)."""
    first = states[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return f(*states)
    if isinstance(first, dict):
        return {n: state_map(f, *[s[n] for s in states]) for n in first}
    if isinstance(first, MirasState):
        return MirasState(*[state_map(f, *[s[i] for s in states]) for i in range(2)])
    if isinstance(first, tuple):
        return tuple(state_map(f, *[s[i] for s in states]) for i in range(len(first)))
    raise TypeError(f"unsupported state type {type(first).__name__}")


def state_bh(state, fn):
    """Apply fn to every tensor of a state (e.g. select or repeat along the batch)."""
    return state_map(fn, state)


def mix_states(weights: torch.Tensor, states: list):
    """sum_n weights[..., n] * states[n] leaf-wise; weights [B, H] broadcast over each weight matrix."""
    def mix(*leaves):
        return sum(w_n(weights[..., n], x) for n, x in enumerate(leaves))
    return state_map(mix, *[without_momentum(s) for s in states])


def w_n(w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return w.to(x.dtype).reshape(*w.shape, *([1] * (x.dim() - w.dim()))) * x
