"""The value-less vector memory of [MC] §4.1 (eqs. 18-20), as a base for ``memory_caching``.

A value-less memory maps without a value of its own: its state is a vector m in R^d that each token adds
its projection to, m_t = m_{t-1} + v_t ([MC] eq. 18 writes the projection as the key, b_K + x_t W_K,
with the start state m_0 = b_K as a bias; eq. 20 renames the stored vector v'_t), and it is read
element-wise by the query, y_t = m_t * q_t. Cut into segments of one token and cached, every token
is its own segment, so memory caching with GRM reads

    y_t = (sum_{i <= t} softmax_i(<u_t, k_i>) (m_0 + v_i)) * q_t = (m_0 + sum_i gamma_t^(i) v_i) * q_t,

which is causal softmax attention with query u_t, keys k_i and values v_i, gated element-wise by q_t
(gated global attention, [MC] eq. 20 with the denominator of eq. 19 summed to t; chapter 7 §3 of the
book shows it, ``tests/test_caching_valueless.py`` checks it).

The vector is held as the diagonal matrix Diag(m), whose read Diag(m) q = m * q is the element-wise
one. So the state is an ordinary matrix memory [B, H, V, V] and every readout of ``memory_caching``
(the per-token definition, the batched contraction, the Triton readout) reads it unchanged. A start
state that is not diagonal is kept as it is: M_t = M_0 + Diag(v_1 + ... + v_t), y_t = M_t q_t.
"""
from __future__ import annotations

import torch

from ..core import check_qkv


def valueless_memory(q, k, v, *, initial_state=None, output_final_state=False):
    """The value-less vector memory: M_t = M_{t-1} + Diag(v_t), y_t = M_t q_t (= m_t * q_t for a diagonal M).

    Args:
        q: [B, H, T, V] the read (a gate in [MC] eq. 20); k: [B, H, T, V], not used by the memory (it is
            the key that ``memory_caching`` pools to route); v: [B, H, T, V] the vector each token adds.
        initial_state: None (zeros) or [B, H, V, V] (Diag(b_K) for [MC] eq. 18's bias).
        output_final_state: also return M_T.

    Returns:
        (o [B, H, T, V], M_T [B, H, V, V] or None).
    """
    B, H, T, K, V = check_qkv(q, k, v)
    if q.shape[-1] != V:
        raise ValueError(f"valueless_memory reads element-wise: q must have the width of v ({V}), got {q.shape[-1]}")
    total = v.cumsum(2)                                           # v_1 + ... + v_t
    o = total * q
    final = torch.diag_embed(total[:, :, -1]) if T else torch.zeros(B, H, V, V, dtype=v.dtype, device=v.device)
    if initial_state is not None:
        if tuple(initial_state.shape) != (B, H, V, V):
            raise ValueError(f"initial_state must be [B, H, V, V] = [{B}, {H}, {V}, {V}], "
                             f"got {list(initial_state.shape)}")
        M0 = initial_state.to(v.dtype)
        o = o + torch.einsum("bhvw,bhtw->bhtv", M0, q)
        final = final + M0
    return o, (final if output_final_state else None)


__all__ = ["valueless_memory"]
