"""The algorithm: chunkwise MIRAS with gradients frozen at each chunk's start state.

Split the sequence into chunks of b tokens. In a chunk that starts from the raw state
Z_{t0} (weights W_{t0} = R(Z_{t0})) and momentum S_{t0}, every gradient is taken at
W_{t0} instead of W_{t-1} ([A] §3.3, [M] App. F, book ch. 3 §8). Then:

1. **Frozen gradients, all rows at once.** The window rows r of the chunk (the b tokens,
   plus the c - 1 before it when a window reaches back) go through the memory as one
   batch at W_{t0}. Every weight W of a memory is used as x -> W x, so row r's gradient
   is rank one, grad_r = a_r x_r^T with x_r the layer's input and a_r = d l_r / d (W x_r),
   which one autograd call gives for all rows at once (``row_factors``). A window row
   before the chunk is evaluated at W_{t0} too, as in book ch. 4 §8; with
   retention decay_first row r is evaluated at alpha_r W_{t0} (window 1 only).
2. **Optimizer and retention as masked matmuls.** For a linear optimizer the updates are
   u_t = b_t S_{t0} + sum_r E[t, r] grad_r (``optimizer.affine``: E = -diag(eta) Gamma for
   GD; E = D_theta diag(-eta) Gamma with D_theta[t, i] = theta_{i+1} ... theta_t for
   momentum), and a linear retention gives
       Z_t = A_t Z_{t0} + (D_alpha b)_t S_{t0} + sum_r (D_alpha E)[t, r] grad_r,
   with A_t = alpha_{t0+1} ... alpha_t and D_alpha[t, i] = A_t / A_i (i <= t). The decay
   ratios are exp(differences of cumulative log-gates), never quotients of cumulative
   products (``atlaslib.core.chunking.causal_decay``). Memora's log-domain recursion and
   Moneta's accumulator Z ([M]'s A) are of this form: both are linear in Z; only the read
   W = R(Z) is not.
3. **Readouts inside the chunk.** y_t = M_{W_t}(phi(q_t)) needs the weights after every
   token. Three ways, equal to rounding:
   * *dual form* (retentions with W = Z and linear combine: none, decay, decay_first,
     proximal): each layer's output W_t x = A_t W_{t0} x + s_t S_{t0} x +
     sum_r C[t, r] a_r (x_r . x), with C = D_alpha E, never forming W_t;
   * *dual form over a scalar* (lq, Moneta: W_t = Z_t / nu_t with nu_t = ||Z_t||_q^(q-2)):
     the same, divided by nu_t; the b accumulators A_t are formed only for their norms;
   * *materialised* (kl, elastic, and non-linear optimizers such as chapter 5's Muon):
     the b per-token weight sets are formed (elastic net by a short elementwise scan,
     since its soft threshold is not linear), read through R, and applied token by token.

Exactness (book ch. 3 §8, all tested): ``miras_chunk(b) == miras_frozen_seq(b)`` for every
b; at b = 1 both equal the per-token engine; for b > 1 they differ from it (the frozen
gradient is an approximation), except when the gradient does not depend on the state
(dot-product bias with a linear memory: linear attention, exact for every b). The delta
family (deltanet, gated_deltanet presets) run through this engine is therefore the
*approximate* frozen-gradient variant for b > 1; ``atlaslib.delta`` has its exact
chunkwise form.

``titans_linear_chunk`` is this engine with the Triton kernel's contract (Titans or TTT with
a linear memory, the caller's [B, H, T, .] tensors in, (o, M_T, S_T) out): the reference of
``kernel.py`` and the backward of ``backend="triton"``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core import check_chunk_size, check_gate, check_qkv, check_state
from ..core.chunking import (LOG_FLOOR, causal_decay, chunk_spans, chunk_windows, compute_dtype, cumulative_logs,
                             log_gate)
from ..core.gates import alpha_from_log, check_retention
from ..core.windows import band_gates
from .config import DEFAULT_CHUNK_SIZE, make_config
from .memory import per_token_linear
from .recurrent import Gates, Parts, build_parts


def row_factors(parts: Parts, W: dict, k_rows, v_rows, delta_rows, scale=None):
    """The rank-one factors of every row's gradient at the frozen weights W.

    W: {name: [N, out, in]}; k_rows [N, R, D]; v_rows [N, R, V]; delta_rows [N, R] or None;
    scale [N, R] or None (row r evaluated at scale_r * W). Returns ({name: a [N, R, out]},
    {name: x [N, R, in]}) with grad_W l(row r) = a_r x_r^T for each weight.

    All rows share the weights, so they go through the memory as one batch (what a vmap
    over the chunk would do); a zero "tap" added to each layer's output W x has gradient
    a = d l / d (W x), which one vector-Jacobian product gives for every row. It is taken
    with ``torch.func.vjp``, not ``torch.autograd.grad``: the result is the same and stays
    differentiable for the outer loop, but torch.compile traces it into one graph, and it
    also runs under ``torch.inference_mode``.
    """
    N, R, _ = k_rows.shape

    def predict(taps):                              # taps -> (prediction, each layer's input x)
        inputs = {}

        def linear(name, x):
            inputs[name] = x
            out = x @ W[name].transpose(-1, -2)
            if scale is not None:
                out = out * scale[..., None]
            return out + taps[name]                 # d l / d taps = d l / d (W x): the factor a
        return parts.memory.forward(linear, k_rows), inputs
    taps = {name: k_rows.new_zeros(N, R, out) for name, (out, _) in parts.memory.shapes.items()}
    y, pullback, inputs = torch.func.vjp(predict, taps, has_aux=True)
    (a,) = pullback(parts.bias.psi(y, v_rows, delta_rows))
    return a, inputs


# The gate-only coefficients are built for this many tokens at a time (whole chunks), so their
# memory, O(GROUP_TOKENS * (b + c - 1)) per head, does not grow with T.
GROUP_TOKENS = 1024


def chunk_coefficients(parts: Parts, gates: Gates, T: int, chunk_size: int) -> dict:
    """Everything of the chunk form that depends on the gates alone, for many chunks at once.

    Tokens are grouped into nc = ceil(T / b) blocks [N, nc, b] (the last one padded at its
    end with neutral gates, which leaves the top-left blocks of every matrix unchanged):
    Gamma [.., b, b + c - 1] (window gates), eta, the log-retention ga (cumulative from
    each chunk's start, fp64: ``cumulative_logs``), D_alpha, A, the log-momentum h (fp64), and for
    linear optimizers b, E (``optimizer.affine``), C = D_alpha E and s = D_alpha b.
    """
    ret, opt, c = parts.retention, parts.optimizer, parts.cfg.window
    N = gates.eta.shape[0]
    nc = -(-T // chunk_size)
    extra = nc * chunk_size - T

    def blocks(x, fill):                                              # [N, T] -> [N, nc, b]
        return F.pad(x, (0, extra), value=fill).view(N, nc, chunk_size)

    def log_cumsum(x, log=None):                                      # from the log-gate itself when given
        if log is not None:
            return cumulative_logs(blocks(log, 0.0).clamp_min(LOG_FLOOR))
        # clamped before the log (log_gate): a gate of exactly 0 then has a gradient of 0, not 0 * inf = NaN
        return None if x is None else cumulative_logs(log_gate(blocks(x, 1.0), x.dtype))

    ga = log_cumsum(gates.alpha, gates.log_alpha) if ret.uses_alpha else None
    h = log_cumsum(gates.theta if opt.uses_theta else None)
    Gamma = band_gates(F.pad(gates.G, (0, 0, 0, extra)).view(N, nc, chunk_size, c), c)
    eta = blocks(gates.eta, 0.0)
    causal = torch.ones(chunk_size, chunk_size, dtype=eta.dtype, device=eta.device).tril()
    cd = eta.dtype                                                    # ga, h: fp64 sums, rounded after differencing
    coef = dict(Gamma=Gamma, eta=eta, h=h, A=None if ga is None else torch.exp(ga).to(cd),
                D=causal.expand(N, nc, -1, -1) if ga is None else causal_decay(ga, dtype=cd))
    if opt.linear:
        b, E = opt.affine(Gamma, eta, h)
        coef.update(b=b, E=E, C=coef["D"] @ E, s=None if b is None else (coef["D"] @ b[..., None])[..., 0])
    return coef


def by_chunk(coef: dict) -> dict:
    """``chunk_coefficients``' tensors [N, nc, ...] as tuples of nc views [N, ...], cut once: picking chunk
    j with x[:, j] in the loop costs the backward a zero-filled copy of the whole tensor per chunk."""
    return {key: None if x is None else x.unbind(1) for key, x in coef.items()}


def chunk_slice(coef: dict, j: int, n: int, R: int, first: int = 0) -> dict:
    """Chunk j's coefficients (``by_chunk``), cut to its n tokens and its window rows first .. R - 1."""
    out = {}
    for key, x in coef.items():
        if x is None:
            out[key] = None
        elif key in ("Gamma", "E", "C"):
            out[key] = x[j][:, :n, first:R]
        elif key == "D":
            out[key] = x[j][:, :n, :n]
        else:
            out[key] = x[j][:, :n]
    return out


def dual_linear(Z0: dict, S0, a: dict, x_rows: dict, C, A, s_vec, divisor=None):
    """``linear`` callback for readouts Z_t x = A_t Z0 x + s_t S0 x + sum_r C[t, r] a_r (x_r . x)
    (divided by divisor[name] [N, n] when W_t = Z_t / nu_t)."""
    def linear(name, x):                                              # x: [N, n, in]
        out = x @ Z0[name].transpose(-1, -2)
        if A is not None:
            out = out * A[..., None]
        if s_vec is not None and S0 is not None:
            out = out + s_vec[..., None] * (x @ S0[name].transpose(-1, -2))
        scores = (x @ x_rows[name].transpose(-1, -2)) * C              # [N, n, R]
        out = out + scores @ a[name]
        return out if divisor is None else out / divisor[name][..., None]
    return linear


def end_state(base: dict, coef_base, extra: dict | None, coef_extra, a: dict, x_rows: dict, weights) -> dict:
    """coef_base * base + coef_extra * extra + sum_r weights_r a_r x_r^T for each weight (coefs [N] or None)."""
    out = {}
    for name in a:
        update = (a[name] * weights[..., None]).transpose(-1, -2)          # [N, out, R]
        start = None
        if base is not None:
            start = base[name] if coef_base is None else coef_base[:, None, None] * base[name]
        if extra is not None and coef_extra is not None:
            scaled = coef_extra[:, None, None] * extra[name]
            start = scaled if start is None else start + scaled
        # one fused GEMM: start + sum_r (weights_r a_r) x_r^T
        out[name] = update @ x_rows[name] if start is None else torch.baddbmm(start, update, x_rows[name])
    return out


def states_from_factors(Z0: dict, S0, a: dict, x_rows: dict, C, A, s_vec) -> dict:
    """All b raw states Z_t = A_t Z0 + s_t S0 + sum_r C[t, r] a_r x_r^T, {name: [N, n, out, in]}."""
    out = {}
    for name in a:
        z = (C[..., :, None] * a[name][:, None]).transpose(-1, -2) @ x_rows[name][:, None]   # [N, n, out, in]
        z0 = Z0[name][:, None]
        z = z + (z0 if A is None else A[..., None, None] * z0)
        if s_vec is not None and S0 is not None:
            z = z + s_vec[..., None, None] * S0[name][:, None]
        out[name] = z
    return out


def retained_states(parts: Parts, Z0: dict, U: dict, alpha_chunk, D, A) -> dict:
    """All b raw states of a chunk from the materialised updates U {name: [N, n, out, in]}."""
    ret = parts.retention
    if ret.linear:                                                    # Z_t = A_t Z0 + sum_i D[t, i] U_i
        out = {}
        for name, u in U.items():
            z0 = Z0[name][:, None]
            out[name] = torch.einsum("nti,nioj->ntoj", D, u) + (z0 if A is None else A[..., None, None] * z0)
        return out
    Z, states = Z0, []                                                # elastic net: elementwise scan
    for t in range(next(iter(U.values())).shape[1]):
        Z = ret.combine(Z, {name: u[:, t] for name, u in U.items()}, None if alpha_chunk is None else alpha_chunk[:, t])
        states.append(Z)
    return {name: torch.stack([z[name] for z in states], dim=1) for name in Z0}


def window_rows(x, b: int, c: int) -> list | None:
    """For each chunk [s, e) of b tokens, the rows s - c + 1 .. e - 1 of x [N, T, ...] along T (those before
    token 0 as zero rows), cut once as views (``chunk_windows``)."""
    if x is None:
        return None
    return chunk_windows(F.pad(x, (0, 0) * (x.dim() - 2) + (c - 1, 0)), b, c - 1, dim=1)


def miras_chunk(parts: Parts, q, k, v, gates: Gates, Z: dict, S=None, chunk_size: int = 16, materialize=False):
    """Chunkwise engine (see the module docstring). Returns (o [N, T, V], Z_T, S_T).

    ``materialize=True`` forces the materialised per-token weights everywhere (the readouts
    agree with the dual form to rounding; the tests check both).
    """
    ret, opt, mem, c = parts.retention, parts.optimizer, parts.memory, parts.cfg.window
    N, T, _ = q.shape
    linear = ret.linear and opt.linear
    dual = linear and ret.identity_read and not materialize                 # readouts W_t x in the dual form
    scaled = linear and ret.scalar_read and not materialize                 # ... divided by nu_t (W_t = Z_t / nu_t)
    chunk_size = min(chunk_size, T)                  # a chunk longer than the sequence: one chunk of all T tokens
    alpha = gates.alpha if ret.uses_alpha else None
    group = max(1, GROUP_TOKENS // chunk_size) * chunk_size            # tokens whose coefficients exist at once
    outputs = []
    # every chunk's rows cut once: slices in the loop cost the backward a zero-filled copy of the whole input each
    q_chunks = q.split(chunk_size, 1)
    alpha_chunks = None if alpha is None else alpha.split(chunk_size, 1)
    windows = [window_rows(x, chunk_size, c) for x in (k, v, gates.delta)]
    for i, (s, e) in enumerate(chunk_spans(T, chunk_size)):
        if s % group == 0:
            g_end = min(s + group, T)
            coef = by_chunk(chunk_coefficients(parts, gates.slice(s, g_end), g_end - s, chunk_size))
        # window rows r = 0 .. R - 1 are the tokens s - c + 1 + r; those before token 0 do not exist (their
        # window gate is 0) and are left out, not evaluated at zero keys and values: a bias whose gradient is
        # infinite at a zero error (lp with p < 2) would give 0 * inf = NaN gradients
        n, R = e - s, e - s + c - 1
        lo = max(0, s - c + 1)
        first = lo - (s - c + 1)                                      # the window rows before token 0
        cf = chunk_slice(coef, (s % group) // chunk_size, n, R, first=first)
        k_rows, v_rows, delta_rows = (None if w is None else w[i].narrow(1, first, e - lo) for w in windows)
        alpha_c = None if alpha is None else alpha_chunks[i]
        scale = alpha_c if ret.grad_at_decayed else None                        # window 1 here
        a, x_rows = row_factors(parts, ret.read(Z), k_rows, v_rows, delta_rows, scale)
        D, A = cf["D"], cf["A"]
        if opt.linear:
            b, E, C, s_vec = cf["b"], cf["E"], cf["C"], cf["s"]    # u_t = b_t S + E grad;  Z_t = A_t Z + s_t S + C grad
            S_end = None
            if opt.has_state:                                         # S_b = B_b S_{t0} + sum_r E[b, r] grad_r
                S_end = end_state(None, None, S, None if b is None else b[:, -1], a, x_rows, E[:, -1])
        if dual or scaled:
            nu = None
            if scaled:                                                # W_t = Z_t / nu_t (Moneta): norms of all Z_t
                nu = {name: ret.divisor(z)[..., 0, 0]
                      for name, z in states_from_factors(Z, S, a, x_rows, C, A, s_vec).items()}
            outputs.append(mem.forward(dual_linear(Z, S, a, x_rows, C, A, s_vec, nu), q_chunks[i]))
            Z = end_state(Z, None if A is None else A[:, -1], S, None if s_vec is None else s_vec[:, -1],
                          a, x_rows, C[:, -1])
            S = S_end
            continue
        if linear:                                                    # all b raw states straight from the factors
            Z_all = states_from_factors(Z, S, a, x_rows, C, A, s_vec)
            S = S_end
        else:                                                         # per-row gradients -> updates -> states
            grad = {name: a[name][..., :, None] * x_rows[name][..., None, :] for name in a}   # [N, R, out, in]
            U, S = opt.updates(S, grad, cf["Gamma"], cf["eta"], cf["h"])
            Z_all = retained_states(parts, Z, U, alpha_c, D, A)
        outputs.append(mem.forward(per_token_linear(ret.read(Z_all)), q_chunks[i]))
        Z = {name: z[:, -1] for name, z in Z_all.items()}
    return torch.cat(outputs, dim=1), Z, S


def titans_linear_chunk(q, k, v, alpha=None, eta=None, theta=None, initial_state=None, initial_momentum=None,
                        chunk_size=DEFAULT_CHUNK_SIZE, log_alpha=None):
    """Titans with a linear memory, chunkwise in PyTorch, with the Triton kernel's contract.

    q, k [B, H, T, K], v [B, H, T, V]; alpha, eta, theta [B, H, T] or None (1, 1, 0);
    initial_state / initial_momentum [B, H, V, K] or None (zeros). In each chunk, with errors
    frozen at the chunk-start state: S_t = theta_t S_{t-1} - eta_t (M_{t0} k_t - v_t) k_t^T,
    M_t = alpha_t M_{t-1} + S_t, y_t = M_t q_t. Returns (o [B, H, T, V] in q's dtype, M_T, S_T
    fp32, fp64 for fp64 inputs). It is the backward of ``backend="triton"`` and the reference of ``kernel.py``.
    ``log_alpha`` (fp32/fp64, <= 0) may replace alpha; as in ``miras``, the decays use it directly.
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
    gates = Gates(eta=eta, G=torch.ones(N, T, 1, dtype=cd, device=q.device), alpha=flat(alpha), theta=flat(theta),
                  log_alpha=flat(log_alpha))
    zeros = torch.zeros(N, V, K, dtype=cd, device=q.device)
    Z = {"M": zeros if initial_state is None else initial_state.to(cd).reshape(N, V, K)}
    S = {"M": zeros if initial_momentum is None else initial_momentum.to(cd).reshape(N, V, K)}
    o, Z, S = miras_chunk(parts, q.to(cd).reshape(N, T, K), k.to(cd).reshape(N, T, K),
                          v.to(cd).reshape(N, T, V), gates, Z, S, chunk_size)
    return o.reshape(B, H, T, V).to(q.dtype), Z["M"].reshape(B, H, V, K), S["M"].reshape(B, H, V, K)
