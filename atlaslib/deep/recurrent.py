"""The definition: the linear DeepTransformer one token at a time (book ch. 6).

    M_t = alpha_t M_{t-1} + eta_t v_t phi*(k_t)^T,        y_t = M_t phi*(q_t),

one gradient step on the dot-product bias -<M phi*(k_t), v_t>, whose gradient -v_t phi*(k_t)^T
does not depend on M. Two ways to hold M:

* ``hebbian_recurrent``: M as a matrix [V, D] on the truncated features phi*_P; each step is
  chapter 1's ``linear_attention_step`` on the features with the value eta_t v_t.
* ``coefficient_recurrent``: M as coefficients of past features, M_t = sum_j u_j phi*(k_j)^T (GD
  never leaves their span). A step scales every u_j by alpha_t and appends u_t = eta_t v_t; a
  window c (SWDT) drops the pair t - c as it leaves; a read is y_t = sum_j u_j kappa(k_j, q_t)
  with kappa(k, q) = exp(k^T q), the exact phi* (the kernel trick, no truncation, O(T^2)), or
  the dot product of given features (``kernel="dot"``).

``dot_coefficient_recurrent`` is DOT (the l2 bias, window c and gates gamma) in the same coefficient
space: each step adds eta_t gamma_i^{(t)} (v_i - M_{t-1} phi*(k_i)) to the coefficient of every pair i
of the window.

``deep_mlp_recurrent`` (DeepTransformer, dot-product bias) and ``dot_mlp_recurrent`` (DOT, l2 bias and a
window) hold the deep memory W2 act(W1 phi*(x)) the same way: W2 a matrix, W1 = sum_j U_j phi*(k_j)^T
(started at zero), so that exp(k_j^T x) is all phi* is ever needed for.
"""
from __future__ import annotations

import torch

from ..core.chunking import compute_dtype, start_memory
from ..core.validation import check_chunk_size, check_form_shapes, check_shape, check_tensor, check_window
from ..core.windows import window_gates
from ..linear.recurrent import linear_attention_step
from ..miras.bias import BIASES
from ..miras.memory import ACTIVATIONS
from .validation import check_activation, check_kernel


def written_value(v_t: torch.Tensor, eta, t: int) -> torch.Tensor:
    """eta_t v_t: what token t writes ([B, H, V])."""
    return v_t if eta is None else eta[:, :, t, None].to(v_t.dtype) * v_t


def hebbian_recurrent(fq, fk, v, alpha=None, eta=None, initial_state=None):
    """Per-token loop on features. fq, fk: [B,H,T,D]; v: [B,H,T,V]; alpha, eta: None or [B,H,T].
    Shapes are checked here; value ranges are the caller's (``deep_transformer`` checks them).

    Returns (o [B,H,T,V] in fq's dtype, M_T [B,H,V,D] in fp32/fp64).
    """
    B, H, T, D, _ = check_form_shapes(fq, fk, v, alpha=alpha, eta=eta)
    cd = compute_dtype(fq)
    M = start_memory(fq, v, initial_state)
    v = v.to(cd)
    outputs = []
    for t in range(T):
        alpha_t = None if alpha is None else alpha[:, :, t]
        M, y_t = linear_attention_step(M, fq[:, :, t], fk[:, :, t], written_value(v[:, :, t], eta, t), alpha_t)
        outputs.append(y_t)
    return torch.stack(outputs, dim=2).to(fq.dtype), M


def coefficient_recurrent(q, k, v, alpha=None, eta=None, window=None, kernel="exp", shift=False):
    """Per-token loop in coefficient space. q, k: [B,H,T,D] (raw for "exp", features for "dot").

    alpha, eta: None or [B,H,T] (retention and step). ``window``: None, or c: the memory holds only
    the last c pairs (SWDT's sliding window; not the Omega window of ``dot_coefficient_recurrent``).

    ``shift`` (exp kernel only): divide each read by e^{max_j k_j^T q_t}. The read is then off by
    that factor, which cancels in y / (z^T phi*(q)) when the last value column is the normaliser's
    constant 1; it keeps exp from overflowing. Returns (o [B,H,T,V] in q's dtype, None).
    Shapes and window are checked here; value ranges are the caller's (``deep_transformer`` checks them).
    """
    B, H, T, _, _ = check_form_shapes(q, k, v, alpha=alpha, eta=eta)
    if window is not None:                                          # None: no window
        check_window(window)
    check_kernel(kernel)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    U = v[:, :, :0]                                                 # coefficients u_j [B,H,j,V]
    keys = k[:, :, :0]                                              # the keys k_j they belong to
    outputs = []
    for t in range(T):
        if alpha is not None:
            U = U * alpha[:, :, t, None, None].to(cd)               # every u_j decays by alpha_t
        U = torch.cat([U, written_value(v[:, :, t], eta, t)[:, :, None]], dim=2)   # u_t = eta_t v_t
        keys = torch.cat([keys, k[:, :, t, None]], dim=2)
        if window is not None:                                      # SWDT: only the last c pairs stay
            U, keys = U[:, :, -window:], keys[:, :, -window:]
        s = torch.einsum("bhjd,bhd->bhj", keys, q[:, :, t])         # k_j^T q_t
        if kernel == "exp":
            if shift:
                s = s - s.amax(-1, keepdim=True).detach()
            s = torch.exp(s)                                        # phi*(k_j)^T phi*(q_t)
        outputs.append(torch.einsum("bhj,bhjv->bhv", s, U))         # y_t = sum_j u_j kappa(k_j, q_t)
    return torch.stack(outputs, dim=2).to(out_dtype), None


def dot_coefficient_recurrent(q, k, v, alpha=None, eta=None, kernel="exp", window=1, gamma=None,
                              chunk_size=None):
    """DOT (the Omega rule in phi* space), per token, in coefficient space: the definition.

        M_t = alpha_t M_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} (M_{t-1} phi*(k_i) - v_i) phi*(k_i)^T,
        y_t = M_t phi*(q_t)

    ([A] eq. 27 with the sign and side of eqs. 28-31 corrected). With M_{t-1} = sum_j u_j phi*(k_j)^T the
    error of window pair i is e_i = sum_j u_j kappa(k_j, k_i) - v_i, every one taken at M_{t-1}; so a step
    scales every u_j by alpha_t, appends u_t = 0 and adds -eta_t gamma_i^{(t)} e_i to u_i for each i in the
    window (the kernel trick, chapter 6 §2 and §5). With c = 1 that is u_t = -eta_t e_t (the delta rule on phi*).

    window: c >= 1 (c >= T: every past pair, the global window). gamma: None (ones), [B,H,T] per source
    token or [B,H,T,c] per offset, as ``omega_rule`` takes them.

    ``chunk_size`` b (None: the definition): the frozen-gradient oracle of ``dot_window_chunk``, every
    error of chunk [t0, t0 + b) taken at the chunk-start state M_{t0 - 1} (its coefficients, the tokens
    before t0) instead of M_{t-1}, as ``omega.omega_frozen_seq``; b = 1 is the definition.
    Returns (o [B,H,T,V] in q's dtype, None). Shapes, window and chunk_size are checked here; value
    ranges are the caller's (``dot`` checks them).
    """
    B, H, T, _, _ = check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    if chunk_size is not None:                                      # None: the definition
        check_chunk_size(chunk_size)
    check_kernel(kernel)
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v = q.to(cd), k.to(cd), v.to(cd)
    kappa = (lambda x, y: torch.exp(x @ y)) if kernel == "exp" else (lambda x, y: x @ y)
    G = None if gamma is None else window_gates(gamma, B, H, T, window, cd, q.device)   # G[t, j] = gamma_{t-j}^{(t)}
    U = v[:, :, :0]                                                 # coefficients u_j [B,H,j,V], j < t
    outputs = []
    for t in range(T):
        if chunk_size is None or t % chunk_size == 0:
            U0, t0 = U, t                                  # the state the errors are taken at (or frozen)
        lo = max(0, t - window + 1)                                 # the window: pairs lo..t, oldest first
        n = t + 1 - lo
        recall = torch.einsum("bhjn,bhjv->bhnv", kappa(k[:, :, :t0], k[:, :, lo:t + 1].mT), U0)  # M_{t-1} phi*(k_i)
        weight = torch.ones(B, H, n, dtype=cd, device=q.device)
        if eta is not None:
            weight = weight * eta[:, :, t, None].to(cd)
        if G is not None:
            weight = weight * G[:, :, t, :n].flip(-1)               # row i has offset t - i
        step = weight[..., None] * (v[:, :, lo:t + 1] - recall)     # -eta_t gamma_i^{(t)} e_i
        if alpha is not None:
            U = U * alpha[:, :, t, None, None].to(cd)
        U = torch.cat([U, torch.zeros_like(v[:, :, t, None])], dim=2)            # u_t = 0, then the steps
        U = torch.cat([U[:, :, :lo], U[:, :, lo:] + step], dim=2)
        outputs.append(torch.einsum("bhj,bhjv->bhv", kappa(k[:, :, :t + 1], q[:, :, t, :, None])[..., 0], U))
    return torch.stack(outputs, dim=2).to(out_dtype), None


# The deep ("mlp") memory M(x) = W2 act(W1 phi*(x)) in coefficient form (chapter 6 §7). GD keeps the first
# layer in the span of the past features when it starts there (W1_0 = 0): W1 = sum_j U_j phi*(k_j)^T with
# U_j in R^h, so W1 phi*(x) = sum_j U_j kappa(k_j, x), while W2 [V, h] stays an ordinary matrix.

def first_layer(U, keys, x, kappa):
    """W1 phi*(x_r) = sum_j U_j kappa(k_j^T x_r). U [B,H,n,h], keys [B,H,n,K], x [B,H,R,K] -> [B,H,R,h]."""
    return torch.einsum("bhrj,bhju->bhru", kappa(x @ keys.mT), U)


def mlp_read(W2, z, act):
    """y_r = W2 act(z_r): W2 [B,H,V,h], z [B,H,R,h] -> [B,H,R,V]."""
    return act(z) @ W2.mT


def mlp_loss_gradients(W2, z, v, weights, bias, act):
    """The gradients of sum_r w_r l(W2 act(z_r), v_r): (d/dW2 [B,H,V,h], d/dz_r [B,H,R,h]).

    As chapter 3's engine (``miras.loss_gradient``): the bias gives psi = dl/dy, autograd pulls it back.
    d/dW1 is then sum_r (d/dz_r) phi*(x_r)^T: a coefficient d/dz_r on the feature of row r's key.
    """
    y, pullback = torch.func.vjp(lambda W, zz: mlp_read(W, zz, act), W2, z)
    return pullback(bias.psi(y, v) * weights[..., None])


def deep_mlp_recurrent(q, k, v, W2, alpha=None, eta=None, kappa=torch.exp, activation="gelu"):
    """DeepTransformer with the deep memory, per token, W1 in coefficient form: the definition.

        W_t = alpha_t W_{t-1} - eta_t grad_W l(W_{t-1}; phi*(k_t), v_t),   l = -<W2 act(W1 phi*(k)), v>,
        y_t = W2_t act(W1_t phi*(q_t)),                                    W1_0 = 0, W2_0 = W2.

    (DLA on phi*: the dot-product bias, GD, decay after the gradient, as ``dla``.) Each step scales W2 and
    every U_j by alpha_t and appends U_t = -eta_t dl/dz_t, where z_t = W1_{t-1} phi*(k_t).
    q, k [B,H,T,K]; v [B,H,T,V]; W2 [B,H,V,h]; kappa: the kernel of the scores (``exp_kernel``).
    Returns (o [B,H,T,V] in q's dtype, (W2_T, U [B,H,T,h]) in fp32/fp64). Shapes are checked here;
    value ranges are the caller's (``deep_transformer`` checks them).
    """
    return _mlp_loop(q, k, v, W2, alpha, eta, kappa, activation, "dot", 1, None)


def dot_mlp_recurrent(q, k, v, W2, alpha=None, eta=None, kappa=torch.exp, activation="gelu", window=1,
                      gamma=None):
    """DOT with the deep memory, per token, W1 in coefficient form: the definition.

        W_t = alpha_t W_{t-1} - eta_t sum_{i=t-c+1}^{t} gamma_i^{(t)} grad_W l2(W_{t-1}; phi*(k_i), v_i),
        y_t = W2_t act(W1_t phi*(q_t)),                                   W1_0 = 0, W2_0 = W2.

    Every gradient at W_{t-1}, the decay after (chapter 4's Omega convention, as ``dot``). A step scales
    W2 and every U_j by alpha_t, appends U_t = 0 and adds -eta_t gamma_i^{(t)} dl2/dz_i to U_i for each i
    in the window. window: c >= 1; gamma: None, [B,H,T] or [B,H,T,c] as ``omega_rule`` takes them.
    Returns as ``deep_mlp_recurrent``. Shapes and window are checked here; value ranges are the caller's
    (``dot`` checks them).
    """
    return _mlp_loop(q, k, v, W2, alpha, eta, kappa, activation, "l2", window, gamma)


def _mlp_loop(q, k, v, W2, alpha, eta, kappa, activation, bias, window, gamma):
    """The loop both rules share: the bias and the window (c pairs, gates gamma) are what differs."""
    B, H, T, _, V = check_form_shapes(q, k, v, window=check_window(window), gamma=gamma, alpha=alpha, eta=eta)
    check_tensor("W2", W2, 4, "[B, H, V, h]")
    check_shape("W2", W2, (B, H, V, W2.shape[3]), ref=q)
    if W2.shape[3] < 1:
        raise ValueError(f"W2 must have a hidden width h >= 1, got shape {tuple(W2.shape)}")
    cd, out_dtype = compute_dtype(q), q.dtype
    q, k, v, W2 = q.to(cd), k.to(cd), v.to(cd), W2.to(cd)
    act, loss = ACTIVATIONS[check_activation(activation)], BIASES[bias](None)
    G = None if gamma is None else window_gates(gamma, B, H, T, window, cd, q.device)   # G[t, j] = gamma_{t-j}^{(t)}
    U = W2.new_zeros(B, H, 0, W2.shape[-1])                        # coefficients U_j [B,H,j,h], j < t
    outputs = []
    for t in range(T):
        lo = max(0, t - window + 1)                                 # the window: pairs lo..t, oldest first
        n = t + 1 - lo
        z = first_layer(U, k[:, :, :t], k[:, :, lo:t + 1], kappa)   # W1_{t-1} phi*(k_i)
        weight = torch.ones(B, H, n, dtype=cd, device=q.device)
        if eta is not None:
            weight = weight * eta[:, :, t, None].to(cd)
        if G is not None:
            weight = weight * G[:, :, t, :n].flip(-1)               # row i has offset t - i
        step_W2, step_z = mlp_loss_gradients(W2, z, v[:, :, lo:t + 1], weight, loss, act)
        a = 1.0 if alpha is None else alpha[:, :, t, None, None].to(cd)
        W2 = a * W2 - step_W2                                       # decay after the gradient
        U = torch.cat([a * U, W2.new_zeros(B, H, 1, W2.shape[-1])], dim=2)   # U_t = 0, then the steps
        U = torch.cat([U[:, :, :lo], U[:, :, lo:] - step_z], dim=2)
        outputs.append(mlp_read(W2, first_layer(U, k[:, :, :t + 1], q[:, :, t:t + 1], kappa), act)[:, :, 0])
    return torch.stack(outputs, dim=2).to(out_dtype), (W2, U)
