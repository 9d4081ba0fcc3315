"""Validate a call of ``miras``, choose the backend, run it.

``prepare`` checks every argument (shapes, gate ranges, which gates the configuration takes,
the initial state), builds the four axis objects and chooses the backend; it returns a
``Problem`` whose ``args`` = (parts, q, k, v, gates, Z, S) are the engines' inputs in their
internal layout (N = B * H rows, compute dtype). ``run`` executes a prepared problem:

    problem = prepare(q, k, v, preset="titans", eta=lr, chunk_size=8)
    o, Z, S = miras_chunk(*problem.args, chunk_size=8)        # one engine, directly
    o, state = run(problem)                                   # the chosen backend, public layout

The forms the backends name: ``engine_table`` (recurrent, frozen_seq, chunk, each taking
``Problem.args``) and ``KERNEL_TABLE`` (the Triton kernel with its own contract, paired with
its chunk form ``titans_linear_chunk`` for the backward).
"""
from __future__ import annotations

import functools
import importlib.util
import numbers
from typing import NamedTuple

import torch

from ..core import apply_feature_map, check_chunk_size, check_qkv, gate_or_number
from ..core.chunking import compute_dtype
from ..core.dispatch import call_backend, choose_backend, lazy, matrix_kernel_limits, on_the_inputs_gpu
from ..core.gates import alpha_from_log, check_retention
from ..core.validation import check_one_retention, static_int
from ..core.windows import window_gates
from .chunk import miras_chunk, titans_linear_chunk
from .config import DEFAULT_CHUNK_SIZE, MirasConfig, make_config
from .recurrent import Gates, Parts, build_parts, miras_frozen_seq, miras_recurrent
from .state import MirasState, check_initial_state, flatten_bh, init_state, public_state

BACKENDS = ("recurrent", "frozen_seq", "chunk", "triton", "auto")

KERNEL_CONFIGS = ("memory='linear', bias='l2', optimizer 'gd' or 'momentum', retention 'none' or 'decay' "
                  "(decay after the gradient), window=1: Titans with a linear memory and TTT-Linear")

KERNEL_MODULE = f"{__package__}.kernel"


def has_kernel(cfg: MirasConfig) -> bool:
    """Whether ``backend="triton"`` has a kernel for this configuration (see KERNEL_CONFIGS)."""
    return (cfg.memory == "linear" and cfg.bias == "l2" and cfg.optimizer in ("gd", "momentum")
            and cfg.retention in ("none", "decay") and cfg.window == 1)


def kernel_available() -> bool:
    return importlib.util.find_spec(KERNEL_MODULE) is not None


def _unused(name, x, why):
    if x is not None:
        raise ValueError(f"{name} was given but {why}")


def _retention_gate(alpha, log_alpha, B, H, T, cd, q):
    """(alpha, log_alpha) in the compute dtype ``cd``, from the retention gate given as alpha or as log_alpha.

    Given as a log, alpha = exp(log_alpha) in fp32 (fp64 for fp64 inputs) for the forms that combine
    with alpha itself (the per-token loops, the KL and l_q retentions), and the log itself is kept
    for the chunk form's decays (exp of differences of cumulative log-gates), which then never take
    log(exp(.)). Given as alpha, log_alpha is None (the chunk form takes its log).
    """
    if log_alpha is None:
        return gate_or_number("alpha", alpha, B, H, T, cd, q), None
    check_one_retention(alpha, log_alpha)
    if isinstance(log_alpha, numbers.Real) and not isinstance(log_alpha, bool):
        log_alpha = torch.full((B, H, T), float(log_alpha), dtype=cd, device=q.device)
    check_retention(None, log_alpha, B, H, T, ref=q)
    return alpha_from_log(None, log_alpha, cd), log_alpha.to(cd)


def engine_table(chunk_size: int) -> dict:
    """The engine's forms, each taking ``Problem.args`` = (parts, q, k, v, gates, Z, S) and returning (o, Z, S)."""
    return {"recurrent": miras_recurrent,
            "frozen_seq": functools.partial(miras_frozen_seq, chunk_size=chunk_size),
            "chunk": functools.partial(miras_chunk, chunk_size=chunk_size)}


# The kernel keeps its own contract, the caller's tensors in (``Problem.kernel_inputs``) and
# (o, M_T, S_T) out, so it is paired with the chunk form of that contract for its backward.
KERNEL_TABLE = {"triton": lazy(KERNEL_MODULE, "titans_linear_triton"), "chunk": titans_linear_chunk}


def choose(backend, cfg, q, V, chunk_size) -> str:
    """``core.dispatch.choose_backend`` for this configuration: "triton" only where a kernel exists."""
    names = ("recurrent", "frozen_seq", "chunk")
    if has_kernel(cfg) and kernel_available():
        names += ("triton",)
        missing = None
    elif has_kernel(cfg):
        missing = "atlaslib/miras/kernel.py is not available in this installation"
    else:
        missing = (f"chapter 3 has a kernel only for {KERNEL_CONFIGS}; got memory={cfg.memory!r}, "
                   f"bias={cfg.bias!r}, retention={cfg.retention!r}, optimizer={cfg.optimizer!r}, "
                   f"window={static_int(cfg.window)}")

    def unsupported():
        from .kernel import kernel_supports
        if kernel_supports(q.shape[-1], V, chunk_size):
            return matrix_kernel_limits(q)
        return f"K={q.shape[-1]}, chunk_size={chunk_size} (it takes K <= 256, chunk_size <= 64)"
    return choose_backend(backend, q, names, unsupported=unsupported, model="miras", missing=missing)


class Problem(NamedTuple):
    """A validated call of ``miras``: the axis objects, the engine inputs and the chosen backend.

    ``args`` = (parts, q, k, v, gates, Z, S) in the engines' internal layout (N = B * H rows,
    compute dtype), so ``miras_chunk(*problem.args, chunk_size=b)`` runs one engine directly.
    """
    parts: Parts
    args: tuple
    backend: str
    chunk_size: int
    shape: tuple          # (B, H, T, D, V)
    kernel_inputs: tuple  # the kernel's arguments (backend "triton" only)


def prepare(q, k, v, *, preset=None, config=None, alpha=None, eta=None, theta=None, delta=None, gamma=None,
            phi=None, initial_state=None, backend="auto", chunk_size=None, log_alpha=None,
            **overrides) -> Problem:
    """Validate every argument of ``miras`` and return the engines' inputs (see ``Problem``)."""
    if preset is not None and config is not None:
        raise ValueError("give either preset (a name) or config (a MirasConfig), not both")
    cfg = make_config(config if config is not None else preset, **overrides)
    B, H, T, K, V = check_qkv(q, k, v)
    fq, fk = apply_feature_map(phi, q, k)
    D = fk.shape[-1]
    parts = build_parts(cfg, D, V)
    ret, opt, bias = parts.retention, parts.optimizer, parts.bias
    cd = compute_dtype(q)
    if not ret.uses_alpha:
        for name, x in (("alpha", alpha), ("log_alpha", log_alpha)):
            _unused(name, x, f"retention={cfg.retention!r} has no retention gate "
                             f"(use retention='decay', or 'decay_first' for the Gated DeltaNet placement)")
    if not opt.uses_theta:
        _unused("theta", theta, f"optimizer={cfg.optimizer!r} has no momentum (use optimizer='momentum')")
    if not bias.uses_delta:
        _unused("delta", delta, f"bias={cfg.bias!r} takes no threshold (delta is for the Huber and value_shift biases)")
    alpha, log_alpha = _retention_gate(alpha, log_alpha, B, H, T, cd, q)
    eta = gate_or_number("eta", 1.0 if eta is None else eta, B, H, T, cd, q, high=None)
    theta = gate_or_number("theta", theta, B, H, T, cd, q)
    if bias.uses_delta:
        delta = gate_or_number("delta", cfg.delta if delta is None else delta, B, H, T, cd, q, high=None)
    gamma = gate_or_number("gamma", gamma, B, H, T, cd, q, width=cfg.window)
    chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else check_chunk_size(chunk_size)
    state = check_initial_state(initial_state, cfg, parts.memory, opt, B, H, q)
    backend = choose(backend, cfg, fq, V, chunk_size)
    eta = ret.effective_eta(eta.to(cd), fk.to(cd))                           # proximal: the implicit step
    if state is None:
        state = check_initial_state(init_state(cfg, B, H, D, V, dtype=cd, device=q.device), cfg, parts.memory,
                                    opt, B, H, q)
    if opt.has_state and state.momentum is None:
        state = MirasState(state.memory, {n: torch.zeros_like(w) for n, w in state.memory.items()})

    G = window_gates(gamma, B, H, T, cfg.window, cd, q.device)
    kernel_inputs = ()
    if backend == "triton":
        S0 = state.momentum["M"] if opt.has_state else None
        # the kernel's window is one token, whose gate gamma_t only scales that token's gradient: eta_t gamma_t
        eta_k = eta if gamma is None else eta * G[..., 0]
        # the retention as given: a log goes to the kernel as a log (alpha = exp(log_alpha) would round)
        kernel_inputs = (fq, fk, v, alpha if log_alpha is None else None, eta_k, theta if opt.has_state else None,
                         state.memory["M"], S0, chunk_size, log_alpha)
    N = B * H
    flat = lambda x: None if x is None else x.to(cd).reshape(N, T)        # noqa: E731
    G = G.reshape(N, T, cfg.window)
    gates = Gates(eta=flat(eta), G=G, alpha=flat(alpha), theta=flat(theta), delta=flat(delta),
                  log_alpha=flat(log_alpha))
    Z = flatten_bh(state.memory, B, H, cd)
    S = None if state.momentum is None else flatten_bh(state.momentum, B, H, cd)
    args = (parts, fq.to(cd).reshape(N, T, D), fk.to(cd).reshape(N, T, D), v.to(cd).reshape(N, T, V), gates, Z, S)
    return Problem(parts, args, backend, chunk_size, (B, H, T, D, V), kernel_inputs)


def run(problem: Problem, backend: str | None = None):
    """Run a prepared problem; returns (o [B, H, T, V] in the compute dtype, q's dtype from the Triton
    kernel, final MirasState).

    ``backend``: None runs the prepared backend; "recurrent", "frozen_seq" or "chunk" runs that engine form
    on the same inputs instead ("triton" only if the problem was prepared for it: its inputs differ).
    """
    forms = ("recurrent", "frozen_seq", "chunk", problem.backend)
    if backend is not None and backend not in forms:
        raise ValueError(f"run: backend must be None, 'recurrent', 'frozen_seq', 'chunk' or the prepared "
                         f"{problem.backend!r}, got {backend!r}")
    backend = backend or problem.backend
    B, H, T, D, V = problem.shape
    parts = problem.parts
    if backend == "triton":                   # the kernel's own contract, see KERNEL_TABLE
        with on_the_inputs_gpu(problem.kernel_inputs[0]):
            o, M_T, S_T = call_backend("triton", KERNEL_TABLE, *problem.kernel_inputs)
        return o, MirasState(M_T, S_T if parts.optimizer.has_state else None)
    o, Z, S = call_backend(backend, engine_table(problem.chunk_size), *problem.args)
    return o.reshape(B, H, T, V), public_state(Z, S, parts.memory, B, H)
