"""Validate a call of ``omega_rule`` or ``swla``, choose the backend, run it.

``prepare`` checks every argument and applies the feature map; ``OMEGA_BACKENDS`` and
``SWLA_BACKENDS`` are the two window rules' backend tables for ``core.dispatch`` (with
``kernel_limits``, what the window kernel refuses); ``omega_deep`` runs the deep memories on
chapter 3's engine.
"""
from __future__ import annotations

import torch

from ..core import apply_feature_map, check_chunk_size, check_qkv, check_state, check_window, gate_or_number
from ..core.chunking import compute_dtype
from ..core.dispatch import dispatch, lazy, matrix_kernel_limits
from ..core.gates import alpha_from_log, retention_gates
from ..miras import MEMORIES, MirasState, miras
from .chunk import omega_chunk, swla_chunk
from .recurrent import omega_frozen_seq, omega_recurrent, swla_recurrent

# "linear": this package's own three rooms; the deep memories run on chapter 3's engine
# (atlaslib.miras, memory axis), with the Omega window on its l2 bias.


def prepare(q, k, v, window, gamma, alpha, eta, phi, memory, initial_state, chunk_size, log_alpha=None):
    """Validate every argument and apply phi to q and k. Returns (phi(q), phi(k), gamma, alpha, eta, log_alpha,
    initial_state, window, chunk_size): gates given as numbers become [B, H, T] tensors in the compute dtype, a
    linear memory's ``MirasState(M, None)`` start becomes M, and window and chunk_size plain ints (a numpy
    integer stopped the kernel's launch)."""
    if memory not in MEMORIES:
        raise ValueError(f"memory must be one of {MEMORIES}, got {memory!r}")
    B, H, T, K, V = check_qkv(q, k, v)
    window = check_window(window)
    gamma = gate_or_number("gamma", gamma, B, H, T, compute_dtype(q), q, width=window)
    alpha, log_alpha, eta = step_gates(alpha, log_alpha, eta, B, H, T, q)
    chunk_size = check_chunk_size(chunk_size)
    fq, fk = apply_feature_map(phi, q, k)
    if memory == "linear":                  # deep memories' states are checked by atlaslib.miras
        initial_state = memory_of_state(initial_state)
        check_state("initial_state", initial_state, (B, H, V, fk.shape[-1]), q)
    return fq, fk, gamma, alpha, eta, log_alpha, initial_state, window, chunk_size


def step_gates(alpha, log_alpha, eta, B: int, H: int, T: int, q: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(alpha, log_alpha, eta) checked, the retention gates as ``core.gates.retention_gates`` returns them
    and eta (a number or [B, H, T]) as a [B, H, T] tensor in the compute dtype (None stays None)."""
    alpha, log_alpha = retention_gates(alpha, log_alpha, B, H, T, ref=q)
    return alpha, log_alpha, gate_or_number("eta", eta, B, H, T, compute_dtype(q), q, high=None)


def memory_of_state(initial_state):
    """The memory of a start state given as the memory itself or as ``MirasState(memory, None)``."""
    if isinstance(initial_state, tuple):
        if not isinstance(initial_state, MirasState) or initial_state.momentum is not None:
            raise ValueError("initial_state must be the memory (a tensor, or a dict of weights) or a "
                             "MirasState(memory, None): this rule carries no momentum")
        return initial_state.memory
    return initial_state


def kernel_limits(fq, window, chunk_size):
    """What the window kernel refuses, as ``core.dispatch`` wants it: fp32 compute, and tiles that fit."""
    from ..core.kernels import dot_tile
    from .kernel import MAX_CHUNK, MAX_FEATURES, MAX_WINDOW_TILE, kernel_supports
    D = fq.shape[-1]
    if kernel_supports(D, window, chunk_size):
        return matrix_kernel_limits(fq)
    BW, BD = dot_tile(chunk_size + window - 1), dot_tile(D)
    return (f"chunk_size={chunk_size}, window={window}, D={D} (its tiles would not fit: chunk_size <= {MAX_CHUNK}, "
            f"D <= {MAX_FEATURES} and tile(chunk_size + window - 1) * tile(D) <= {MAX_WINDOW_TILE} elements with "
            f"tile(n) = max(16, next_pow2(n)); here {BW} * {BD} = {BW * BD})")


def window_table(recurrent, chunk, kernel: str, frozen_seq=None) -> dict:
    """One window rule's forms, each taking (q, k, v, window, gamma, alpha, eta, initial_state,
    chunk_size, log_alpha); the per-token loops get exp(log_alpha), and the definition ignores chunk_size.
    ``frozen_seq``: the per-token oracle of a chunk form that freezes gradients (the Omega rule; SWLA's
    chunk form is exact and has none)."""
    def per_token(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, log_alpha):
        return recurrent(q, k, v, window, gamma, alpha_from_log(alpha, log_alpha, compute_dtype(q)), eta,
                         initial_state)
    def frozen(q, k, v, window, gamma, alpha, eta, initial_state, chunk_size, log_alpha):
        return frozen_seq(q, k, v, window, gamma, alpha_from_log(alpha, log_alpha, compute_dtype(q)), eta,
                          initial_state, chunk_size)
    table = {"recurrent": per_token, "chunk": chunk, "triton": lazy(f"{__package__}.kernel", kernel)}
    return table if frozen_seq is None else table | {"frozen_seq": frozen}


OMEGA_BACKENDS = window_table(omega_recurrent, omega_chunk, "omega_triton", omega_frozen_seq)
SWLA_BACKENDS = window_table(swla_recurrent, swla_chunk, "swla_triton")


def omega_deep(fq, fk, v, window, gamma, alpha, eta, memory, initial_state, output_final_state, backend,
               chunk_size, log_alpha=None, **memory_options):
    """OmegaNet with a deep memory: chapter 3's engine with the Omega window on the l2 bias.

    ``atlaslib.miras`` takes all c gradients at the same state (W_{t-1}, or the chunk-start
    state in its chunk form), decays with alpha after the gradient step, and reads out
    after the update, so this is the same rule as the linear case with M(x) = M x replaced
    by the MLP. Its backends are "recurrent", "frozen_seq", "chunk" and "auto" (= chunk; there is no
    kernel for deep memories, so "triton" is a ValueError). The state is a
    ``miras.MirasState`` whose memory is a dict of weights (see ``miras.init_state``). ``memory_options``
    (``expansion``, ``activation``, ``layer_norm``) go to the engine.
    """
    def engine(backend_name):
        def run(fq, fk, v):
            return miras(fq, fk, v, memory=memory, bias="l2", optimizer="gd",
                         retention="none" if alpha is None and log_alpha is None else "decay", window=window,
                         gamma=gamma, alpha=alpha, log_alpha=log_alpha, eta=eta, initial_state=initial_state,
                         output_final_state=output_final_state, backend=backend_name, chunk_size=chunk_size,
                         **memory_options)
        return run
    table = {name: engine(name) for name in ("recurrent", "frozen_seq", "chunk")}
    return dispatch(backend, fq, table, fq, fk, v, model=f"omega_rule(memory={memory!r})",
                    missing=f"there is a kernel only for memory='linear'; memory={memory!r} runs on atlaslib.miras "
                            f"(use backend='chunk', 'frozen_seq' or 'recurrent')")
