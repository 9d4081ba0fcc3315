"""Chapter 3: the four MIRAS axes as one composable engine.

A model is a choice of memory architecture (``memory.py``), attentional bias
(``bias.py``), retention (``retention.py``) and optimizer (``optimizer.py``); the named
models are presets (``config.PRESETS``): linear_attention, deltanet, gated_deltanet,
ttt_linear, ttt_mlp, titans, moneta, yaad, memora. One function runs any of them:

    o, state = miras(q, k, v, preset="titans", alpha=a, eta=lr, theta=mom, output_final_state=True)
    o, _ = miras(q, k, v, preset="titans", memory="linear", eta=lr)          # one axis moved
    o, _ = miras(q, k, v, memory="mlp", bias="huber_switch", retention="kl", delta=d)

The three rooms: ``recurrent.py`` (the per-token definition and the frozen-gradient
oracle ``frozen_seq``), ``chunk.py`` (chunkwise, gradients frozen at the chunk start) and
``kernel.py`` (Triton, Titans/TTT with a linear memory). ``config.py`` has the presets
and the four-axis table (``axes_table``, ``axes_markdown``), ``state.py`` the state
(``MirasState``, ``init_state``); ``prepare`` + ``run`` split ``miras`` into validation and
execution, and ``memory_gradient`` gives grad_W l for any configuration (autograd).
"""
from __future__ import annotations

import functools
import importlib.util
import numbers
from typing import NamedTuple

import torch

from ..core import check_chunk_size, check_gate, check_qkv, check_state, get_feature_map
from ..core.chunking import compute_dtype
from ..core.dispatch import call_backend, choose_backend, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log, check_retention
from ..core.windows import window_gates
from .bias import BIASES, Bias, build_bias
from .chunk import miras_chunk, row_factors
from .config import (AXES, EXACT_CHUNK, PRESETS, MirasConfig, axes_markdown, axes_table, describe, make_config,
                     validate_config)
from .memory import ACTIVATIONS, MEMORIES, Memory, build_memory
from .optimizer import OPTIMIZERS, Optimizer, build_optimizer
from .recurrent import Gates, Parts, loss_gradient, miras_frozen_seq, miras_recurrent
from .retention import RETENTIONS, Retention, build_retention, soft_threshold
from .state import MirasState, check_initial_state, flatten_bh, init_state, public_state

BACKENDS = ("recurrent", "frozen_seq", "chunk", "triton", "auto")

# The chunk length b of "chunk", "frozen_seq" and "triton" for every MIRAS model, and for every
# entry point that reaches one: the OmegaNet rule (atlaslib.omega.omega_rule, linear or deep memory,
# which is this engine's l2 bias with a window) and the token mixers. For all but the
# state-free linear_attention preset b changes the output (gradients are frozen at each chunk's
# start), so one model must not get two defaults from two doors. 16 is TTT's inner mini-batch size
# and what this chapter always used: short enough that the frozen gradient stays close to the
# per-token one, long enough to give the chunk form matrix products to batch.
DEFAULT_CHUNK_SIZE = 16

KERNEL_CONFIGS = ("memory='linear', bias='l2', optimizer 'gd' or 'momentum', retention 'none' or 'decay' "
                  "(decay after the gradient), window=1: Titans with a linear memory and TTT-Linear")


def build_parts(cfg: MirasConfig, K: int, V: int) -> Parts:
    """The four axis objects of ``cfg`` for memory input width K and value width V."""
    cfg = validate_config(cfg)
    return Parts(cfg, build_memory(cfg, K, V), build_bias(cfg), build_retention(cfg), build_optimizer(cfg))


def has_kernel(cfg: MirasConfig) -> bool:
    """Whether ``backend="triton"`` has a kernel for this configuration (see KERNEL_CONFIGS)."""
    return (cfg.memory == "linear" and cfg.bias == "l2" and cfg.optimizer in ("gd", "momentum")
            and cfg.retention in ("none", "decay") and cfg.window == 1)


def kernel_available() -> bool:
    return importlib.util.find_spec(f"{__name__}.kernel") is not None


def memory_gradient(cfg, W: dict, k, v, delta=None):
    """grad_W sum_r l(W; k_r, v_r) for config ``cfg`` (a preset name or MirasConfig), by autograd.

    W: {name: [N, out, in]} (the linear memory's weight is named "M"); k [N, R, K];
    v [N, R, V]; delta [N, R] for biases that take it (default: the config's constant).
    """
    cfg = make_config(cfg) if not isinstance(cfg, MirasConfig) else cfg
    parts = build_parts(cfg, k.shape[-1], v.shape[-1])
    if parts.bias.uses_delta and delta is None:
        delta = torch.full(k.shape[:-1], float(cfg.delta), dtype=k.dtype, device=k.device)
    return loss_gradient(parts, W, k, v, delta, torch.ones(k.shape[:-1], dtype=k.dtype, device=k.device))


def _gate(name, x, B, H, T, cd, q, *, low=0.0, high=1.0, width=None):
    """A gate given as a tensor [B, H, T] (or [B, H, T, width]) or a number; returns a tensor or None."""
    if x is None:
        return None
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        x = float(x)
        if x != x or x < low or (high is not None and x > high):
            raise ValueError(f"{name} must lie in [{low}, {'inf)' if high is None else f'{high}]'}, got {x}")
        return torch.full((B, H, T), x, dtype=cd, device=q.device)
    check_gate(name, x, B, H, T, width, low=low, high=high, ref=q)
    return x


def _unused(name, x, why):
    if x is not None:
        raise ValueError(f"{name} was given but {why}")


def _retention_gate(alpha, log_alpha, B, H, T, cd, q):
    """The retention gate alpha in the compute dtype ``cd``, given as alpha or as log_alpha.

    log_alpha is turned into alpha here, at entry, in fp32 (fp64 for fp64 inputs): the engine's
    seven retentions combine with alpha itself (the KL and l_q retentions are not a decay of Z),
    so a log-gate is not threaded through them. In fp32, 1 - alpha keeps a relative precision of
    about 2^-24 / (1 - alpha): 2^-12 for the gate 1 - 2^-12 that bf16 rounds to 1. For gates much
    closer to 1, pass fp64 inputs.
    """
    if log_alpha is None:
        return _gate("alpha", alpha, B, H, T, cd, q)
    if alpha is not None:
        raise ValueError("give the retention gate either as alpha or as log_alpha, not both")
    if isinstance(log_alpha, numbers.Real) and not isinstance(log_alpha, bool):
        log_alpha = torch.full((B, H, T), float(log_alpha), dtype=cd, device=q.device)
    check_retention(None, log_alpha, B, H, T, ref=q)
    return alpha_from_log(None, log_alpha, cd)


def titans_linear_chunk(q, k, v, alpha=None, eta=None, theta=None, initial_state=None, initial_momentum=None,
                        chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """Titans with a linear memory, chunkwise in PyTorch, with the Triton kernel's contract.

    q, k [B, H, T, K], v [B, H, T, V]; alpha, eta, theta [B, H, T] or None (1, 1, 0);
    initial_state / initial_momentum [B, H, V, K] or None (zeros). In each chunk, with errors
    frozen at the chunk-start state: S_t = theta_t S_{t-1} - eta_t (M_{t0} k_t - v_t) k_t^T,
    M_t = alpha_t M_{t-1} + S_t, y_t = M_t q_t. Returns (o [B, H, T, V] in q's dtype, M_T, S_T
    fp32). It is the backward of ``backend="triton"`` and the reference of ``kernel.py``.
    ``log_alpha`` (fp32/fp64, <= 0) may replace alpha; it becomes alpha in fp32 (fp64) at entry,
    as in ``miras``.
    """
    B, H, T, K, V = check_qkv(q, k, v)
    check_retention(alpha, log_alpha, B, H, T, ref=q)
    check_gate("eta", eta, B, H, T, high=None, ref=q)
    check_gate("theta", theta, B, H, T, ref=q)
    check_state("initial_state", initial_state, (B, H, V, K), q)
    check_state("initial_momentum", initial_momentum, (B, H, V, K), q)
    check_chunk_size(chunk_size)
    has_alpha = alpha is not None or log_alpha is not None
    cfg = make_config("titans", memory="linear", retention="decay" if has_alpha else "none")
    parts = build_parts(cfg, K, V)
    cd = compute_dtype(q)
    alpha = alpha_from_log(alpha, log_alpha, cd)
    N = B * H
    flat = lambda x: None if x is None else x.to(cd).reshape(N, T)          # noqa: E731
    eta = torch.ones(N, T, dtype=cd, device=q.device) if eta is None else flat(eta)
    gates = Gates(eta=eta, G=torch.ones(N, T, 1, dtype=cd, device=q.device), alpha=flat(alpha), theta=flat(theta))
    zeros = torch.zeros(N, V, K, dtype=cd, device=q.device)
    Z = {"M": zeros if initial_state is None else initial_state.to(cd).reshape(N, V, K)}
    S = {"M": zeros if initial_momentum is None else initial_momentum.to(cd).reshape(N, V, K)}
    o, Z, S = miras_chunk(parts, q.to(cd).reshape(N, T, K), k.to(cd).reshape(N, T, K),
                          v.to(cd).reshape(N, T, V), gates, Z, S, chunk_size)
    return o.reshape(B, H, T, V).to(q.dtype), Z["M"].reshape(B, H, V, K), S["M"].reshape(B, H, V, K)


def engine_table(chunk_size: int) -> dict:
    """The engine's forms, each taking ``Problem.args`` = (parts, q, k, v, gates, Z, S) and returning (o, Z, S)."""
    return {"recurrent": miras_recurrent,
            "frozen_seq": functools.partial(miras_frozen_seq, chunk_size=chunk_size),
            "chunk": functools.partial(miras_chunk, chunk_size=chunk_size)}


# The kernel keeps its own contract, the caller's tensors in (``Problem.kernel_inputs``) and
# (o, M_T, S_T) out, so it is paired with the chunk form of that contract for its backward.
KERNEL_TABLE = {"triton": lazy(f"{__name__}.kernel", "titans_linear_triton"), "chunk": titans_linear_chunk}


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
                   f"bias={cfg.bias!r}, retention={cfg.retention!r}, optimizer={cfg.optimizer!r}, window={cfg.window}")

    def unsupported():
        from .kernel import kernel_supports
        if kernel_supports(q.shape[-1], V, chunk_size):
            return matrix_kernel_limits(q)
        return f"K={q.shape[-1]}, chunk_size={chunk_size} (it takes K <= 256, chunk_size <= 64)"
    return choose_backend(backend, q, names, unsupported=unsupported, model="miras", missing=missing)


def miras(q, k, v, *, preset=None, config=None, alpha=None, eta=None, theta=None, delta=None, gamma=None,
          phi=None, initial_state=None, output_final_state=False, backend="auto", chunk_size=DEFAULT_CHUNK_SIZE,
          log_alpha=None, **overrides):
    """Run any MIRAS configuration: memory, attentional bias, retention, optimizer.

    The per-token rule (book/notation.md, book ch. 3 §1), with W_{t-1} the memory's weights before token t:

        g_t = sum_{i=t-c+1}^{t} gamma_i^{(t)} grad_W l(W_{t-1}; phi(k_i), v_i)      (c = window, usually 1)
        u_t = -eta_t g_t                              (optimizer="gd")
            = S_t = theta_t S_{t-1} - eta_t g_t       (optimizer="momentum", Titans)
        Z_t = alpha_t Z_{t-1} + u_t,  W_t = R(Z_t)    (retention: see retention.py for all seven)
        y_t = M_{W_t}(phi(q_t))                       (read out after the update)

    Args:
        q, k: [B, H, T, K] queries and keys (phi is applied here; l2-normalised keys are
            the usual regime). v: [B, H, T, V] values.
        preset: a name from ``PRESETS`` (or a MirasConfig); ``config``: a MirasConfig (give
            one of the two, or neither for the default linear/l2/none/gd = DeltaNet).
        **overrides: MirasConfig fields that move axes or set options, e.g. memory="linear",
            bias="lp", p=3, retention="kl", scale=2.0, optimizer="momentum", window=4,
            expansion=2, layer_norm=True (see ``MirasConfig``). Unknown names: TypeError;
            options of an axis choice the config does not make, or incompatible axes
            (residual memory with K != V, proximal with a deep memory, ...): ValueError.
        alpha: retention gate in [0, 1], [B, H, T] or a number (None: 1). Only for
            retentions that take it (all but "none"); it is Memora's beta_t and Moneta's
            beta_t, and the lambda of the elastic net.
        log_alpha: the retention gate as its log (values <= 0; a tensor in fp32/fp64 or a
            number) instead of alpha. It is turned into alpha in the compute dtype (fp32, fp64
            for fp64 inputs) here, at entry, never in the activation dtype: the retentions
            combine with alpha itself, so the log is not carried further.
        eta: inner learning rate >= 0, [B, H, T] or a number (None: 1). The delta rule's beta.
        theta: momentum decay in [0, 1], [B, H, T] or a number, optimizer="momentum" only
            (None: 0, no momentum carried).
        delta: Huber threshold / value-shift radius >= 0 for the biases that take one,
            [B, H, T] (data-dependent, as in Yaad) or a number (None: the config's delta).
        gamma: window gates in [0, 1]: [B, H, T] per source token or [B, H, T, window] per
            offset, as in ``atlaslib.omega.omega_rule`` (None: all ones).
        phi: feature map for q and k (None, a name from ``core.FEATURE_MAPS`` or a callable).
        initial_state: None (the default start: zeros for the linear memory, seeded random
            weights for deep ones, see ``init_state``), a memory state (tensor [B, H, V, D]
            for the linear memory, dict {name: [B, H, out, in]} for deep ones) or a
            ``MirasState(memory, momentum)``. The memory state is the *raw* state: log-weights
            for retention="kl", the accumulator A for "lq" (see ``state.py``).
        output_final_state: also return the final ``MirasState``.
        backend: "recurrent" (the per-token definition, gradients at W_{t-1}),
            "frozen_seq" (per-token, gradients frozen at each chunk start: the chunk form's
            oracle), "chunk" (chunkwise PyTorch), "triton" (kernel; only for
            ``KERNEL_CONFIGS``, chunk_size <= 64, K <= 256, fp32/fp16/bf16; CPU under
            TRITON_INTERPRET=1; backward through the chunk form) or "auto" (triton on CUDA
            where a kernel exists and its tiles fit, chunk otherwise).
        chunk_size: b for "chunk", "frozen_seq" and "triton" (default ``DEFAULT_CHUNK_SIZE`` =
            16, shared with ``omega_rule`` and the mixers). **It changes the model** for every
            configuration whose gradient depends on the state.

    Which equalities hold (book ch. 3 §8; all tested):

    ==========================================================  ========================
    chunk(b) vs frozen_seq(b), every configuration and b        exact
    chunk(1) vs recurrent                                       exact
    chunk(b > 1) vs recurrent                                   differ (frozen gradients),
                                                                except linear_attention
                                                                (state-free gradient): exact
    triton(b) vs chunk(b)                                       exact (fp32 rounding)
    recurrent, preset linear_attention vs linear_attention      exact (alpha with
                                                                retention="decay")
    recurrent, deltanet / gated_deltanet vs delta_rule          exact (eta = beta)
    recurrent, retention="proximal" vs delta_rule(longhorn)     exact
    chunk(b > 1), deltanet / gated_deltanet vs delta_rule       differ: the frozen-gradient
                                                                delta family is approximate
    ==========================================================  ========================

    Returns:
        (o [B, H, T, V] in q's dtype, ``MirasState`` in fp32 (fp64 for fp64 inputs) or None).
    """
    problem = prepare(q, k, v, preset=preset, config=config, alpha=alpha, eta=eta, theta=theta, delta=delta,
                      gamma=gamma, phi=phi, initial_state=initial_state, backend=backend, chunk_size=chunk_size,
                      log_alpha=log_alpha, **overrides)
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be True or False, got {output_final_state!r}")
    o, state = run(problem)
    return o.to(q.dtype), (state if output_final_state else None)


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
            phi=None, initial_state=None, backend="auto", chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None,
            **overrides) -> Problem:
    """Validate every argument of ``miras`` and return the engines' inputs (see ``Problem``)."""
    if preset is not None and config is not None:
        raise ValueError("give either preset (a name) or config (a MirasConfig), not both")
    cfg = make_config(config if config is not None else preset, **overrides)
    B, H, T, K, V = check_qkv(q, k, v)
    phi_fn = get_feature_map("identity" if phi is None else phi)
    fq, fk = phi_fn(q), phi_fn(k)
    for name, f in (("phi(q)", fq), ("phi(k)", fk)):
        if not isinstance(f, torch.Tensor) or f.dim() != 4 or tuple(f.shape[:3]) != (B, H, T):
            raise ValueError(f"phi must map [B, H, T, K] to [B, H, T, D] = [{B}, {H}, {T}, D], "
                             f"but {name} has shape {list(getattr(f, 'shape', []))}")
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
    alpha = _retention_gate(alpha, log_alpha, B, H, T, cd, q)
    eta = _gate("eta", 1.0 if eta is None else eta, B, H, T, cd, q, high=None)
    theta = _gate("theta", theta, B, H, T, cd, q)
    if bias.uses_delta:
        delta = _gate("delta", cfg.delta if delta is None else delta, B, H, T, cd, q, high=None)
    gamma = _gate("gamma", gamma, B, H, T, cd, q, width=cfg.window)
    check_chunk_size(chunk_size)
    state = check_initial_state(initial_state, cfg, parts.memory, opt, B, H, q)
    backend = choose(backend, cfg, fq, V, chunk_size)
    eta = ret.effective_eta(eta.to(cd), fk.to(cd))                           # proximal: the implicit step
    if state is None:
        state = check_initial_state(init_state(cfg, B, H, D, V, dtype=cd, device=q.device), cfg, parts.memory,
                                    opt, B, H, q)
    if opt.has_state and state.momentum is None:
        state = MirasState(state.memory, {n: torch.zeros_like(w) for n, w in state.memory.items()})

    kernel_inputs = ()
    if backend == "triton":
        S0 = state.momentum["M"] if opt.has_state else None
        kernel_inputs = (fq, fk, v, alpha, eta, theta if opt.has_state else None, state.memory["M"], S0, chunk_size)
    N = B * H
    flat = lambda x: None if x is None else x.to(cd).reshape(N, T)        # noqa: E731
    G = window_gates(gamma, B, H, T, cfg.window, cd, q.device).reshape(N, T, cfg.window)
    gates = Gates(eta=flat(eta), G=G, alpha=flat(alpha), theta=flat(theta), delta=flat(delta))
    Z = flatten_bh(state.memory, B, H, cd)
    S = None if state.momentum is None else flatten_bh(state.momentum, B, H, cd)
    args = (parts, fq.to(cd).reshape(N, T, D), fk.to(cd).reshape(N, T, D), v.to(cd).reshape(N, T, V), gates, Z, S)
    return Problem(parts, args, backend, chunk_size, (B, H, T, D, V), kernel_inputs)


def run(problem: Problem, backend: str | None = None):
    """Run a prepared problem; returns (o [B, H, T, V] in the compute dtype, final MirasState)."""
    backend = backend or problem.backend
    B, H, T, D, V = problem.shape
    parts = problem.parts
    if backend == "triton":                   # the kernel's own contract, see KERNEL_TABLE
        o, M_T, S_T = call_backend("triton", KERNEL_TABLE, *problem.kernel_inputs)
        return o, MirasState(M_T, S_T if parts.optimizer.has_state else None)
    o, Z, S = call_backend(backend, engine_table(problem.chunk_size), *problem.args)
    return o.reshape(B, H, T, V), public_state(Z, S, parts.memory, B, H)


__all__ = [
    "miras", "MirasConfig", "MirasState", "make_config", "validate_config", "PRESETS", "AXES", "EXACT_CHUNK",
    "axes_table", "axes_markdown", "describe", "init_state", "build_parts", "has_kernel", "kernel_available",
    "KERNEL_CONFIGS", "BACKENDS", "DEFAULT_CHUNK_SIZE", "memory_gradient", "titans_linear_chunk", "loss_gradient", "row_factors",
    "soft_threshold",
    "miras_recurrent", "miras_frozen_seq", "miras_chunk", "Parts", "Gates", "Problem", "prepare", "run",
    "MEMORIES", "BIASES", "RETENTIONS", "OPTIMIZERS", "ACTIVATIONS", "Memory", "Bias", "Retention", "Optimizer",
]
