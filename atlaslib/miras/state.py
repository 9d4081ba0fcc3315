"""The engine's state between calls: the memory's raw state and the optimizer's momentum.

``MirasState(memory, momentum)``:

* ``memory``: the raw state Z of axis 3 (see ``retention``): the memory's weights for
  every retention except ``kl`` (Memora: Z are the log-weights, W = c softmax(Z)) and
  ``lq`` (Moneta: Z is the accumulator, [M]'s A, W = Z / ||Z||_q^(q-2)). For the linear memory
  it is one tensor [B, H, V, K] (M maps keys to values, as in atlaslib.linear/delta);
  for deep memories a dict {name: [B, H, out, in]} (see ``memory.py`` for the names).
* ``momentum``: the buffer S of ``optimizer="momentum"`` or ``"muon"`` with the same structure, or None.

A final state returned with ``output_final_state=True`` can be passed back as
``initial_state`` to continue the sequence where it stopped: exactly on the per-token backend, and on
the chunk forms when the split falls on a chunk boundary (b fixes where gradients freeze), for
window=1. A window c > 1 also needs the last c - 1 pairs, which the state does not hold: the
continued run's first c - 1 tokens see a shorter window.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from ..core import check_state
from ..core.validation import process_constant


class MirasState(NamedTuple):
    memory: object
    momentum: object = None


def init_state(cfg, B: int, H: int, K: int, V: int, *, generator: torch.Generator | None = None,
               seed: int = 0, dtype=torch.float32, device="cpu") -> MirasState:
    """The default start state: one parameter set per head, shared by the batch.

    Deep memories draw W ~ N(0, 1/in) per weight (``memory.Memory.init``) from
    ``generator`` (default: a generator seeded with ``seed``, so ``miras`` with
    ``initial_state=None`` is deterministic); Memora's deep log-weights are N(0, 1). The
    linear memory starts at zero (Memora: uniform weights c / (V K)). Momentum starts at 0.
    K is the width of the memory's input (the feature width when phi is used). The draws are made on
    the CPU (in fp64, kept as fp32: ``memory.Memory.init``), then cast to ``dtype`` and moved to
    ``device``: one seed gives the same start (up to that cast) in every dtype and on every device.
    """
    from ..core.validation import check_int, static_int
    from .config import make_config
    from .memory import build_memory
    cfg = make_config(cfg) if not hasattr(cfg, "memory") else cfg
    for name, value in (("B", B), ("H", H), ("K", K), ("V", V)):
        check_int(name, value, 1)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    kl = cfg.retention == "kl"
    if cfg.memory == "linear":              # zeros, made where they are used
        params = build_memory(cfg, K, V).init(H, dtype=dtype, device=device)
    elif generator is not None:
        params = draw_params(build_memory(cfg, K, V), kl, H, generator)
    else:           # a table of the arguments alone, which torch.compile takes as a constant
        sizes = (static_int(x) for x in (K, V, cfg.expansion))
        drawn = seeded_params(cfg.memory, *sizes, cfg.activation, cfg.layer_norm, kl, static_int(H), seed,
                              torch.device("cpu" if device is None else device))
        params = dict(zip(build_memory(cfg, K, V).shapes, drawn))
    params = {n: w.to(dtype=dtype, device=device).clone()[None].expand(B, -1, -1, -1).contiguous()   # [B, H, out, in]
              for n, w in params.items()}
    momentum = {n: torch.zeros_like(w) for n, w in params.items()} if cfg.optimizer in ("momentum", "muon") else None
    if cfg.memory == "linear":
        params = params["M"]
        momentum = None if momentum is None else momentum["M"]
    return MirasState(params, momentum)


def draw_params(memory, kl: bool, H: int, generator) -> dict:
    """One fp32 CPU parameter set per head, drawn from ``generator`` (None: the linear memory, which draws
    nothing); Memora's deep log-weights are drawn again as N(0, 1)."""
    params = memory.init(H, generator, dtype=torch.float32, device="cpu")
    if kl and memory.name != "linear":
        params = {n: torch.randn(w.shape, generator=generator, dtype=torch.float32) for n, w in params.items()}
    return params


@torch.compiler.assume_constant_result
def seeded_params(memory: str, K: int, V: int, expansion, activation, layer_norm, kl: bool, H: int,
                  seed: int, device: torch.device) -> tuple:
    """The tensors of ``draw_params`` from a generator seeded with ``seed``, in the memory's ``shapes``
    order, on ``device``; kept for the process and per device (read-only: callers copy), so that a call on a
    GPU does not copy them from the host (a copy that waits for the device). torch.compile takes them as a
    constant: a generator made while it traces stops a fullgraph compilation, and the draw is a function of
    these arguments alone."""
    return _seeded_params(memory, K, V, expansion, activation, layer_norm, kl, H, seed, device)


@functools.lru_cache(maxsize=64)
def _seeded_params(memory, K, V, expansion, activation, layer_norm, kl, H, seed, device) -> tuple:
    from .memory import MEMORY_CLASSES
    mem = MEMORY_CLASSES[memory](K, V, expansion, activation, layer_norm)
    with process_constant():                  # kept: real tensors, also for calls that train after an eval pass
        params = draw_params(mem, kl, H, torch.Generator().manual_seed(seed))    # drawn on the CPU everywhere
        return tuple(params[name].to(device) for name in mem.shapes)


def _as_dict(x, memory, what: str, B, H, ref):
    """Validate one part of a state (a tensor for the linear memory, else a dict) and return a dict."""
    if memory.name == "linear":
        if isinstance(x, dict):
            x = x.get("M") if set(x) == {"M"} else x
        if isinstance(x, dict):
            raise ValueError(f"{what} of the linear memory must be a tensor [B, H, V, K] = "
                             f"[{B}, {H}, {memory.V}, {memory.K}], got a dict with keys {sorted(x)}")
        check_state(what, x, (B, H, memory.V, memory.K), ref)
        return {"M": x}
    if not isinstance(x, dict):
        want = ", ".join(f"{n}: [{B}, {H}, {o}, {i}]" for n, (o, i) in memory.shapes.items())
        raise TypeError(f"{what} of memory={memory.name!r} must be a dict {{{want}}}, got {type(x).__name__}")
    if set(x) != set(memory.shapes):
        raise ValueError(f"{what} of memory={memory.name!r} must have the weights {sorted(memory.shapes)}, "
                         f"got {sorted(x)}")
    for n, (o, i) in memory.shapes.items():
        check_state(f"{what}[{n!r}]", x[n], (B, H, o, i), ref)
    return dict(x)


def check_initial_state(initial_state, cfg, memory, optimizer, B, H, ref) -> MirasState | None:
    """Validate ``initial_state`` (None, a memory state, or a MirasState) and return it as a MirasState
    of dicts (or None). A bare tensor / dict is the memory part, with zero momentum."""
    if initial_state is None:
        return None
    if isinstance(initial_state, tuple) and not isinstance(initial_state, torch.Tensor):
        if len(initial_state) != 2:
            raise ValueError("initial_state must be a memory state or a MirasState(memory, momentum), "
                             f"got a tuple of length {len(initial_state)}")
        mem, mom = initial_state
    else:
        mem, mom = initial_state, None
    if mem is None:
        raise ValueError("initial_state.memory is None; pass initial_state=None for the default start state")
    mem = _as_dict(mem, memory, "initial_state.memory" if mom is not None else "initial_state", B, H, ref)
    if mom is not None:
        if not optimizer.has_state:
            raise ValueError(f"initial_state has a momentum buffer, but optimizer={cfg.optimizer!r} keeps none "
                             "(use optimizer='momentum' or 'muon', or pass the memory state alone)")
        mom = _as_dict(mom, memory, "initial_state.momentum", B, H, ref)
    return MirasState(mem, mom)


def flatten_bh(x: dict, B: int, H: int, dtype) -> dict:
    """{name: [B, H, ...]} -> {name: [B*H, ...]} in the compute dtype."""
    return {n: t.to(dtype).reshape(B * H, *t.shape[2:]) for n, t in x.items()}


def public_state(Z: dict, S, memory, B: int, H: int) -> MirasState:
    """Internal {name: [B*H, ...]} -> MirasState with [B, H, ...] tensors (a tensor for the linear memory)."""
    def out(d):
        if d is None:
            return None
        d = {n: t.reshape(B, H, *t.shape[1:]) for n, t in d.items()}
        return d["M"] if memory.name == "linear" else d
    return MirasState(out(Z), out(S))
