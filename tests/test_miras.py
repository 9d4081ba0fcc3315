"""Chapter 3: the MIRAS engine (atlaslib.miras).

The per-token engine is checked against chapters 1-2 (linear attention, the delta rule,
Longhorn, the Omega rule) and against oracles written out here from the formulas of book ch. 3
(hand-derived gradients of the linear, MLP and residual memories; Titans' momentum;
Moneta's accumulator; Memora's softmax update in its naive, non-log form; the
soft threshold of the elastic net). The chunk form is then checked against the
frozen-gradient oracle for every preset and several chunk sizes, against the per-token
engine at chunk size 1, and shown to differ from it for b > 1 where book ch. 3 §8 says it
must. All comparisons use fresh random inputs (seed printed on failure).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslib.core import assert_close, random_gate, random_qkv, rel_rmse
from atlaslib.core.testing import assert_causal_mixer
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.atlas import atlas_config
from atlaslib.miras import (BIASES, EXACT_CHUNK, PRESETS, MirasConfig, MirasState, axes_markdown, axes_table,
                            build_parts, describe, has_kernel, init_state, make_config, memory_gradient, miras,
                            miras_chunk, prepare)
from atlaslib.omega import omega_rule

F64 = torch.float64


@pytest.fixture(autouse=True)
def one_thread():
    """The engines run many tiny ops per token; with one thread none of them waits for a thread-pool
    wake-up (which costs milliseconds per op on a busy 2-core machine)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# Configurations beyond the presets, so that every axis value runs through every engine.
EXTRA = {
    "gated_vshift_elastic_mom": dict(memory="gated", bias="value_shift", retention="elastic", threshold=0.01,
                                     optimizer="momentum", expansion=2),
    "mlp_huber_kl_mom": dict(memory="mlp", bias="huber", retention="kl", scale=4.0, optimizer="momentum",
                             expansion=2, activation="silu"),
    "linear_hnorm_lq_mom": dict(memory="linear", bias="huber_norm", retention="lq", lq=3.0, optimizer="momentum"),
    "residual_dot_decayfirst_mom": dict(memory="residual", bias="dot", retention="decay_first", optimizer="momentum",
                                        expansion=2),
    "linear_lp_elastic": dict(memory="linear", bias="lp", p=1.5, retention="elastic", threshold=0.02),
    "residual_l2_decay_window": dict(memory="residual", bias="l2", retention="decay", optimizer="momentum",
                                     window=3, expansion=2, activation="tanh"),
}
CONFIGS = {**{p: dict(preset=p) for p in PRESETS}, **EXTRA}


def gates_for(cfg, gen, B, H, T, dtype=F64, eta_high=0.3):
    """Random gates that the configuration takes (alpha, eta, theta, delta, gamma).

    eta stays below 0.3: with eta up to 0.5, momentum and a random MLP memory, about 3% of draws
    diverge within 20 tokens (Titans: outputs past 1e100, then NaN in every form, so no comparison
    means anything); below 0.3 none of 1000 draws exceeded 6 for any configuration here."""
    parts = build_parts(cfg, 4, 4)
    kw = {"eta": random_gate(B, H, T, low=0.05, high=eta_high, dtype=dtype, generator=gen)}
    if parts.retention.uses_alpha:
        kw["alpha"] = random_gate(B, H, T, low=0.6, high=1.0, dtype=dtype, generator=gen)
    if parts.optimizer.uses_theta:
        kw["theta"] = random_gate(B, H, T, low=0.2, high=0.9, dtype=dtype, generator=gen)
    if parts.bias.uses_delta:
        kw["delta"] = random_gate(B, H, T, low=0.05, high=1.0, dtype=dtype, generator=gen)
    if cfg.window > 1:
        kw["gamma"] = random_gate(B, H, T, cfg.window, low=0.3, high=1.0, dtype=dtype, generator=gen)
    return kw


def switch_ratios(gen, B, H, T, dtype=F64):
    """delta_t / ||e_t|| for a test of a threshold: 0.3-0.9 at even t, 1.1-2 at odd t, so both sides of every
    switch run (a delta drawn alone sits below ||e|| ~ sqrt(V) almost always and tests one branch)."""
    u = torch.rand(B, H, T, generator=gen, dtype=dtype)
    return torch.where(torch.arange(T) % 2 == 0, 0.3 + 0.6 * u, 1.1 + 0.9 * u)


def random_state(cfg, gen, B, H, D, V, dtype=F64, scale=0.3):
    """A random MirasState (memory and, for momentum, a momentum buffer)."""
    st = init_state(cfg, B, H, D, V, dtype=dtype)
    rnd = lambda x: scale * torch.randn(x.shape, generator=gen, dtype=dtype)        # noqa: E731
    mem = rnd(st.memory) if isinstance(st.memory, torch.Tensor) else {n: rnd(w) for n, w in st.memory.items()}
    mom = None
    if st.momentum is not None:
        mom = rnd(st.momentum) if isinstance(st.momentum, torch.Tensor) else {n: rnd(w) for n, w in st.momentum.items()}
    return MirasState(mem, mom)


def flat_state(s):
    """All tensors of a MirasState, concatenated (for comparisons)."""
    parts = []
    for part in s:
        if part is None:
            continue
        parts += [part.flatten()] if isinstance(part, torch.Tensor) else [part[n].flatten() for n in sorted(part)]
    return torch.cat(parts)


# ---------------------------------------------------------------------------- reductions to chapters 1-2

@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
@pytest.mark.parametrize("gated", [False, True])
def test_linear_attention_preset_is_linear_attention(gen, backend, gated):
    """Dot-product bias, linear memory, GD: M_t = alpha_t M_{t-1} + eta_t v_t k_t^T, exact for every chunk size."""
    B, H, T, K, V = 2, 2, 23, 6, 5
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.1, high=2.0, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.5, dtype=F64, generator=gen) if gated else None
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    ref, ref_s = linear_attention(q, k, eta[..., None] * v, alpha=alpha, initial_state=h0,
                                  output_final_state=True, backend="recurrent")
    extra = {"retention": "decay", "alpha": alpha} if gated else {}
    for b in (1, 4, 16):
        o, s = miras(q, k, v, preset="linear_attention", eta=eta, initial_state=h0, output_final_state=True,
                     backend=backend, chunk_size=b, **extra)
        assert_close(o, ref, tol=1e-12, name=f"o (chunk_size={b})")
        assert_close(s.memory, ref_s, tol=1e-12, name="final state")
        assert s.momentum is None


@pytest.mark.parametrize("preset", ["deltanet", "gated_deltanet", "ttt_linear"])
def test_delta_family_presets_are_the_delta_rule(gen, preset):
    """l2 bias, linear memory, GD: the per-token engine is the delta rule (eta = beta); Gated DeltaNet
    needs the gradient at alpha_t M_{t-1} (retention decay_first). The frozen-gradient chunk form
    equals it at chunk size 1 only."""
    B, H, T, K, V = 2, 2, 21, 7, 5
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    beta = random_gate(B, H, T, low=0.1, high=1.5, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.5, dtype=F64, generator=gen) if preset == "gated_deltanet" else None
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    ref, ref_s = delta_rule(q, k, v, beta, alpha=alpha, initial_state=h0, output_final_state=True,
                            backend="recurrent")
    for backend, b in (("recurrent", 16), ("chunk", 1), ("frozen_seq", 1)):
        o, s = miras(q, k, v, preset=preset, eta=beta, alpha=alpha, initial_state=h0, output_final_state=True,
                     backend=backend, chunk_size=b)
        assert_close(o, ref, tol=1e-12, name=f"o ({backend}, b={b})")
        assert_close(s.memory, ref_s, tol=1e-12, name=f"final state ({backend})")
    o, _ = miras(q, k, v, preset=preset, eta=beta, alpha=alpha, initial_state=h0, backend="chunk", chunk_size=4)
    assert rel_rmse(o, ref) > 1e-3, "frozen gradients must be an approximation of the delta rule for b > 1"


@pytest.mark.parametrize("gated", [False, True])
def test_proximal_retention_is_longhorn(gen, gated):
    B, H, T, K, V = 1, 2, 19, 6, 4
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, normalize_keys=False, generator=gen)
    beta = 4.0 * torch.rand(B, H, T, generator=gen, dtype=F64)
    alpha = random_gate(B, H, T, low=0.5, dtype=F64, generator=gen) if gated else None
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    ref, ref_s = delta_rule(q, k, v, beta, alpha=alpha, longhorn=True, initial_state=h0, output_final_state=True,
                            backend="recurrent")
    for backend in ("recurrent", "chunk"):
        o, s = miras(q, k, v, retention="proximal", eta=beta, alpha=alpha, initial_state=h0,
                     output_final_state=True, backend=backend, chunk_size=1)
        assert_close(o, ref, tol=1e-12, name=f"o ({backend})")
        assert_close(s.memory, ref_s, tol=1e-12, name="final state")


def test_decay_after_gradient_is_omega_with_window_one(gen):
    """Titans' placement without momentum, M_t = alpha_t M_{t-1} - eta_t grad l2(M_{t-1}), is chapter 4's
    Omega rule with c = 1 (which decays after the gradient) -- and differs from Gated DeltaNet."""
    B, H, T, K, V = 2, 1, 18, 5, 6
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.1, high=1.0, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.3, dtype=F64, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    ref, ref_s = omega_rule(q, k, v, window=1, alpha=alpha, eta=eta, initial_state=h0, output_final_state=True,
                            backend="recurrent")
    o, s = miras(q, k, v, preset="titans", memory="linear", eta=eta, alpha=alpha, initial_state=h0,
                 output_final_state=True, backend="recurrent")
    assert_close(o, ref, tol=1e-12)
    assert_close(s.memory, ref_s.memory, tol=1e-12, name="final state")
    o_first, _ = miras(q, k, v, preset="gated_deltanet", eta=eta, alpha=alpha, initial_state=h0, backend="recurrent")
    assert rel_rmse(o_first, ref) > 1e-3, "the two decay placements must differ"


# ---------------------------------------------------------------------------- oracles from book ch. 3

def gelu_prime(u):
    """d/du of u Phi(u) (exact GELU): Phi(u) + u phi(u)."""
    return 0.5 * (1 + torch.erf(u / math.sqrt(2))) + u * torch.exp(-0.5 * u * u) / math.sqrt(2 * math.pi)


def ln_forward_backward(z, dy, eps=1e-5):
    """LayerNorm without affine, y = (z - mean) / sqrt(var + eps), and its backward for upstream dy."""
    mu = z.mean(-1, keepdim=True)
    sd = ((z - mu).square().mean(-1, keepdim=True) + eps).sqrt()
    y = (z - mu) / sd
    dz = (dy - dy.mean(-1, keepdim=True) - y * (dy * y).mean(-1, keepdim=True)) / sd
    return y, dz


def oracle_memory(kind, W, x, ln=False):
    """Prediction of the memory at weights W for one key x [N, K] (written out, fp64)."""
    if kind == "linear":
        return torch.einsum("nvk,nk->nv", W["M"], x)
    if kind == "mlp":
        return torch.einsum("nvh,nh->nv", W["W2"], F.gelu(torch.einsum("nhk,nk->nh", W["W1"], x)))
    z = torch.einsum("nvh,nh->nv", W["W1"], F.gelu(torch.einsum("nhk,nk->nh", W["W2"], x)))
    return x + (F.layer_norm(z, z.shape[-1:]) if ln else z)


def oracle_grad(kind, W, x, psi, ln=False):
    """grad_W of a loss whose derivative in the prediction is psi, by hand (book ch. 3 §3)."""
    if kind == "linear":
        return {"M": psi[:, :, None] * x[:, None, :]}
    if kind == "mlp":          # y = W2 h, h = gelu(u), u = W1 x
        u = torch.einsum("nhk,nk->nh", W["W1"], x)
        h = F.gelu(u)
        du = torch.einsum("nvh,nv->nh", W["W2"], psi) * gelu_prime(u)
        return {"W2": psi[:, :, None] * h[:, None, :], "W1": du[:, :, None] * x[:, None, :]}
    # residual: y = x + LN(z), z = W1 h, h = gelu(u), u = W2 x
    u = torch.einsum("nhk,nk->nh", W["W2"], x)
    h = F.gelu(u)
    z = torch.einsum("nvh,nh->nv", W["W1"], h)
    dz = ln_forward_backward(z, psi)[1] if ln else psi
    du = torch.einsum("nvh,nv->nh", W["W1"], dz) * gelu_prime(u)
    return {"W1": dz[:, :, None] * h[:, None, :], "W2": du[:, :, None] * x[:, None, :]}


def oracle_psi(bias, e, delta, cfg):
    """d loss / d prediction, from book ch. 3 §4 (1/2 and 1/p conventions)."""
    if bias == "l2":
        return e
    if bias == "lp":        # smoothed: sign ~ tanh(a e), |e| ~ sqrt(e^2 + eps)
        return torch.tanh(cfg.sign_sharpness * e) * (e * e + cfg.abs_eps) ** ((cfg.p - 1) / 2)
    if bias == "huber_switch":
        small = e.norm(dim=-1, keepdim=True) <= delta[:, None]
        return torch.where(small, e, delta[:, None] * torch.sign(e))
    raise AssertionError(bias)


def oracle_run(name, q, k, v, gates, state, delta_ratio=None, **overrides):
    """The per-token recursion of each named model, written from book ch. 3 §4-§6 with hand-derived gradients.

    titans:  S_t = theta_t S_{t-1} - eta_t grad,   M_t = alpha_t M_{t-1} + S_t
    ttt_mlp: W_t = W_{t-1} - eta_t grad
    moneta:  Z_t = alpha_t Z_{t-1} - eta_t grad_lp(W_{t-1}),   W_t = Z_t / ||Z_t||_q^(q-2)
    yaad:    W_t = alpha_t W_{t-1} - eta_t {grad l2 if ||e|| <= delta_t else delta_t grad l1}
    memora:  W_t = c softmax(alpha_t log W_{t-1} - eta_t grad)   (naive form, on the weights)

    ``delta_ratio`` [B, H, T]: yaad's delta_t is set here to delta_ratio_t ||e_t|| (``switch_ratios``), and
    written into ``gates["delta"]`` for the run under test.
    """
    cfg = make_config(name, **overrides)
    B, H, T, K = q.shape
    N = B * H
    fl = lambda x: x.reshape(N, *x.shape[2:])                                     # noqa: E731
    q, k, v = fl(q), fl(k), fl(v)
    g = {n: (fl(x) if x is not None else None) for n, x in gates.items()}
    mem = state.memory if isinstance(state.memory, dict) else {"M": state.memory}
    Z = {n: fl(w).clone() for n, w in mem.items()}
    S = None
    if state.momentum is not None:
        mom = state.momentum if isinstance(state.momentum, dict) else {"M": state.momentum}
        S = {n: fl(w).clone() for n, w in mom.items()}
    kind, ln = cfg.memory, cfg.layer_norm
    c, qn = cfg.scale, cfg.lq

    def weights(Z):
        if cfg.retention == "lq":
            return {n: a / (a.abs() ** qn).sum((-2, -1), keepdim=True) ** ((qn - 2) / qn) for n, a in Z.items()}
        return Z

    outs, deltas = [], []
    for t in range(T):
        W = weights(Z)
        e = oracle_memory(kind, W, k[:, t], ln) - v[:, t]
        delta = g["delta"][:, t] if g.get("delta") is not None else None
        if delta_ratio is not None:
            delta = fl(delta_ratio)[:, t] * e.norm(dim=-1)
            deltas.append(delta)
        grad = oracle_grad(kind, W, k[:, t], oracle_psi(cfg.bias, e, delta, cfg), ln)
        eta = g["eta"][:, t, None, None]
        alpha = g["alpha"][:, t, None, None] if g.get("alpha") is not None else 1.0
        if cfg.optimizer == "momentum":
            S = {n: g["theta"][:, t, None, None] * S[n] - eta * grad[n] for n in grad}
            Z = {n: alpha * Z[n] + S[n] for n in Z}
        elif cfg.retention == "kl":
            new = {}
            for n, w in Z.items():
                logits = alpha * torch.log(w) - eta * grad[n]
                new[n] = c * torch.softmax(logits.flatten(-2), -1).view_as(w)
            Z = new
        else:
            Z = {n: alpha * Z[n] - eta * grad[n] for n in Z}
        outs.append(oracle_memory(kind, weights(Z), q[:, t], ln))
    if delta_ratio is not None:
        gates["delta"] = torch.stack(deltas, 1).reshape(B, H, T)
    return torch.stack(outs, 1).reshape(B, H, T, -1), Z


@pytest.mark.parametrize("name,overrides", [
    ("titans", {}), ("titans", {"memory": "linear"}), ("ttt_mlp", {}), ("moneta", {}), ("yaad", {}),
    ("memora", {}), ("memora", {"memory": "linear", "scale": 3.0})])
def test_per_token_engine_matches_oracle(gen, name, overrides):
    engine_against_oracle(gen, name, overrides, name, overrides)


def engine_against_oracle(gen, name, overrides, oracle_name, oracle_overrides):
    """miras(preset=name, **overrides), per token, against oracle_run on the config
    make_config(oracle_name, **oracle_overrides) (which also says which gates and state to draw)."""
    B, H, T, K = 1, 2, 11, 6
    cfg = make_config(oracle_name, **oracle_overrides)
    q, k, v = random_qkv(B, H, T, K, K, dtype=F64, generator=gen)
    gates = gates_for(cfg, gen, B, H, T)
    state = random_state(cfg, gen, B, H, K, K)
    if cfg.retention == "kl":                 # the naive form works on the weights: start from W_0 = c softmax(Z_0)
        mem = state.memory if isinstance(state.memory, dict) else {"M": state.memory}
        W0 = {n: cfg.scale * torch.softmax(z.flatten(-2), -1).view_as(z) for n, z in mem.items()}
        oracle_state = MirasState(W0 if isinstance(state.memory, dict) else W0["M"], state.momentum)
    else:
        oracle_state = state
    ratio = switch_ratios(gen, B, H, T) if "delta" in gates else None      # yaad: both sides of its switch
    ref, ref_Z = oracle_run(oracle_name, q, k, v, gates, oracle_state, delta_ratio=ratio, **oracle_overrides)
    o, s = miras(q, k, v, preset=name, initial_state=state, output_final_state=True, backend="recurrent",
                 **gates, **overrides)
    assert_close(o, ref, tol=1e-10, name=f"{name}: output")
    mem = s.memory if isinstance(s.memory, dict) else {"M": s.memory}
    for n, z in mem.items():
        got = z.reshape(B * H, *z.shape[2:])
        if cfg.retention == "kl":             # the log-domain state gives the naive weights exactly
            got = cfg.scale * torch.softmax(got.flatten(-2), -1).view_as(got)
        assert_close(got, ref_Z[n], tol=1e-10, name=f"{name}: final {n}")


# The models of book ch. 3 as the papers give them (book ch. 3 §3 and its summary table, [M] Table 1), written
# out here rather than read from PRESETS: deep memories of hidden width 4 d_k with GELU; Moneta (p, q) = (3, 4);
# Memora's simplex of mass c = 1 (the papers give no c: the library's default); LayerNorm on the residual
# branch of all three MIRAS models.
HIDDEN = dict(expansion=4, activation="gelu")
PAPER_MODELS = {
    "ttt_mlp": dict(memory="mlp", bias="l2", retention="none", optimizer="gd", **HIDDEN),
    "titans": dict(memory="mlp", bias="l2", retention="decay", optimizer="momentum", **HIDDEN),
    "moneta": dict(memory="residual", layer_norm=True, bias="lp", p=3.0, retention="lq", lq=4.0, optimizer="gd",
                   **HIDDEN),
    "yaad": dict(memory="residual", layer_norm=True, bias="huber_switch", retention="decay", optimizer="gd", **HIDDEN),
    "memora": dict(memory="residual", layer_norm=True, bias="l2", retention="kl", scale=1.0, optimizer="gd", **HIDDEN),
}


@pytest.mark.parametrize("name", list(PAPER_MODELS))
def test_presets_are_the_papers_models(gen, name):
    """preset=name runs the model of the papers: the oracle's config comes from PAPER_MODELS, not from the
    preset (test_per_token_engine_matches_oracle follows whatever the preset says)."""
    engine_against_oracle(gen, name, {}, None, PAPER_MODELS[name])


def test_linear_memory_axes_against_formulas(gen):
    """Every bias, and the elastic-net and lq retentions, with a linear memory: g = psi(e) k^T
    (book ch. 3 §4 and §5)."""
    B, H, T, K, V = 1, 2, 9, 5, 4
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    ratio = switch_ratios(gen, B, H, T)              # delta_t / ||e_t||: both sides of every threshold
    eta = random_gate(B, H, T, low=0.1, high=0.8, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.7, dtype=F64, generator=gen)
    h0 = 0.5 * torch.randn(B, H, V, K, generator=gen, dtype=F64)

    def psi(bias, e, d):
        n = e.norm(dim=-1, keepdim=True)
        d = d[..., None]
        return {"dot": None, "l2": e,
                "huber": torch.where(e.abs() <= d, e, d * torch.sign(e)),
                "huber_norm": torch.where(n <= d, e, d * e / n),
                "huber_switch": torch.where(n <= d, e, d * torch.sign(e)),
                "value_shift": e + d * e / n}[bias]

    for bias in ("dot", "l2", "huber", "huber_norm", "huber_switch", "value_shift"):
        for retention, extra in (("elastic", {"threshold": 0.03}), ("lq", {"lq": 3.0})):
            M = h0.clone()
            outs, deltas = [], []
            for t in range(T):
                A = M
                W = A if retention == "elastic" else A / (A.abs() ** 3).sum((-2, -1), keepdim=True) ** (1 / 3)
                e = torch.einsum("bhvk,bhk->bhv", W, k[:, :, t]) - v[:, :, t]
                deltas.append(ratio[:, :, t] * e.norm(dim=-1))
                g = (-v[:, :, t] if bias == "dot" else psi(bias, e, deltas[-1]))[..., None] * k[:, :, t, None, :]
                A = alpha[:, :, t, None, None] * A - eta[:, :, t, None, None] * g
                if retention == "elastic":
                    A = torch.sign(A) * (A.abs() - 0.03).clamp_min(0)
                    W = A
                else:
                    W = A / (A.abs() ** 3).sum((-2, -1), keepdim=True) ** (1 / 3)
                M = A
                outs.append(torch.einsum("bhvk,bhk->bhv", W, q[:, :, t]))
            kw = {"delta": torch.stack(deltas, 2)} if BIASES[bias].uses_delta else {}
            o, s = miras(q, k, v, memory="linear", bias=bias, retention=retention, eta=eta, alpha=alpha,
                         initial_state=h0, output_final_state=True, backend="recurrent", **extra, **kw)
            assert_close(o, torch.stack(outs, 2), tol=1e-10, name=f"{bias} + {retention}")
            assert_close(s.memory, M, tol=1e-10, name=f"{bias} + {retention}: final state")


def test_bias_psi_is_the_loss_gradient(gen):
    """For every bias without smoothing, psi = d loss / d prediction (autograd of the loss value)."""
    y = torch.randn(3, 7, 5, generator=gen, dtype=F64, requires_grad=True)
    v = torch.randn(3, 7, 5, generator=gen, dtype=F64)
    delta = random_gate(3, 7, 1, low=0.1, high=3.0, dtype=F64, generator=gen)[..., 0]
    for name, cls in BIASES.items():
        cfg = make_config(bias=name, **({"sign_sharpness": None, "abs_eps": 0.0, "p": 2.7} if name == "lp" else {}))
        bias = cls(cfg)
        d = delta if cls.uses_delta else None
        (grad,) = torch.autograd.grad(bias.loss(y, v, d).sum(), y)
        assert_close(bias.psi(y, v, d), grad, tol=1e-12, name=f"psi of {name}")
    lp = BIASES["lp"](make_config(bias="lp", p=3.0, sign_sharpness=1e4, abs_eps=1e-12))   # smoothing -> exact
    e = (y - v).detach()
    assert_close(lp.psi(y.detach(), v), torch.sign(e) * e.abs() ** 2, tol=1e-6, name="smoothed lp, sharp limit")


def test_bias_loss_values(gen):
    """Each bias's loss value (per row) against its formula, book ch. 3 §4 / [M] eqs 22-26, written out here
    (psi only fixes the loss up to a constant, so test_bias_psi_is_the_loss_gradient cannot see one); the
    value-shift loss also against a brute-force maximum over s on the sphere ||s|| = delta (V = 3)."""
    R, V = 8, 3
    y = torch.randn(2, R, V, generator=gen, dtype=F64)
    v = torch.randn(2, R, V, generator=gen, dtype=F64)
    e = y - v
    n = e.norm(dim=-1)
    d = switch_ratios(gen, 2, 1, R)[:, 0] * n               # delta / ||e|| alternates: both sides of every threshold

    def H(a, d):                                           # Huber's H_delta, a >= 0
        return torch.where(a <= d, 0.5 * a * a, d * (a - 0.5 * d))
    want = {"dot": -(y * v).sum(-1), "l2": 0.5 * n**2,
            "lp": e.abs().pow(2.7).sum(-1) / 2.7,
            "huber": H(e.abs(), d[..., None]).sum(-1),
            "huber_norm": H(n, d),
            "huber_switch": torch.where(n <= d, 0.5 * n**2, d * e.abs().sum(-1)),
            "value_shift": 0.5 * n**2 + d * n + 0.5 * d**2}
    assert set(want) == set(BIASES)
    for name, cls in BIASES.items():
        cfg = make_config(bias=name, **({"sign_sharpness": None, "abs_eps": 0.0, "p": 2.7} if name == "lp" else {}))
        loss = cls(cfg).loss(y, v, d if cls.uses_delta else None)
        assert_close(loss, want[name], tol=1e-12, name=f"loss of {name}")
    # max_{||s|| <= delta} 1/2 ||e - s||^2 is attained on the sphere (a convex function): a grid of 300 x 600
    # directions, each within an angle a < 0.008 of the best, comes within delta ||e|| a^2 / 2 < 2e-5 loss of it
    # and never above it (the loss without its delta^2 / 2 lies below the grid's maximum by over 5%)
    theta, phi = torch.meshgrid(torch.linspace(0, math.pi, 300, dtype=F64),
                                torch.linspace(0, 2 * math.pi, 600, dtype=F64), indexing="ij")
    u = torch.stack([theta.sin() * phi.cos(), theta.sin() * phi.sin(), theta.cos()], -1).reshape(-1, V)
    s = d[..., None, None] * u                                                    # [2, R, directions, V]
    brute = 0.5 * (e[..., None, :] - s).square().sum(-1).amax(-1)
    loss = BIASES["value_shift"](make_config(bias="value_shift")).loss(y, v, d)
    assert (brute <= loss + 1e-12).all(), "the closed form must be the maximum, not below a value attained"
    assert (brute >= loss * (1 - 1e-4)).all(), ((brute - loss) / loss).min().item()
    # Huber's H_delta is continuous at the threshold: per coordinate and on the norm
    dd = d[0, 0]
    for side in (1 - 1e-9, 1 + 1e-9):
        e1 = (dd * side) * F.normalize(e[0, 0], dim=-1)                           # ||e1|| = delta (1 +- 1e-9)
        got = BIASES["huber_norm"](make_config(bias="huber_norm")).loss(e1, torch.zeros_like(e1), dd)
        assert abs(got.item() - 0.5 * dd.item()**2) < 1e-8 * (1 + dd.item()**2), ("huber_norm", side)
        c1 = torch.zeros(V, dtype=F64)
        c1[0] = dd * side
        got = BIASES["huber"](make_config(bias="huber")).loss(c1, torch.zeros_like(c1), dd)
        assert abs(got.item() - 0.5 * dd.item()**2) < 1e-8 * (1 + dd.item()**2), ("huber", side)


def test_memory_gradient_by_hand(gen):
    """The TTT-MLP gradients of book ch. 3 §3, grad_W2 = -r h^T and grad_W1 = -[(W2^T r) * act'(u)] k^T."""
    cfg = make_config("ttt_mlp", expansion=3)
    N, K, V = 4, 5, 6
    W = {"W1": torch.randn(N, 15, K, generator=gen, dtype=F64), "W2": torch.randn(N, V, 15, generator=gen, dtype=F64)}
    k = torch.randn(N, 1, K, generator=gen, dtype=F64)
    v = torch.randn(N, 1, V, generator=gen, dtype=F64)
    g = memory_gradient(cfg, W, k, v)
    u = torch.einsum("nhk,nk->nh", W["W1"], k[:, 0])
    r = v[:, 0] - torch.einsum("nvh,nh->nv", W["W2"], F.gelu(u))
    assert_close(g["W2"], -r[:, :, None] * F.gelu(u)[:, None, :], tol=1e-12, name="grad W2")
    du = torch.einsum("nvh,nv->nh", W["W2"], r) * gelu_prime(u)
    assert_close(g["W1"], -du[:, :, None] * k[:, 0, None, :], tol=1e-12, name="grad W1")


def test_theorem_2_2_ftrl_equals_learning_retaining(gen):
    """[M] Thm 2.2 with linearised losses l_i(W) = <g_i, W> and R = 1/2 ||W||^2 (book ch. 3 §2): the
    learning-retaining iterates (GD from W_0 = 0, the engine) are the FTRL minimisers
    argmin_W sum_{i<=t} <g_i, W> + 1/(2 eta) ||W||^2, here found by a numerical solver."""
    B, H, T, K, V = 1, 1, 6, 4, 3
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    eta = 0.7
    grads = []
    W_t = torch.zeros(V, K, dtype=F64)                                   # W_0
    for t in range(1, T + 1):
        _, s = miras(q[:, :, :t], k[:, :, :t], v[:, :, :t], preset="deltanet", eta=eta, output_final_state=True,
                     backend="recurrent")
        W_prev, W_t = W_t, s.memory[0, 0]
        e = W_prev @ k[0, 0, t - 1] - v[0, 0, t - 1]
        grads.append(torch.outer(e, k[0, 0, t - 1]))                  # g_t = grad l2 at W_{t-1}
        X = torch.zeros(V, K, dtype=F64, requires_grad=True)
        opt = torch.optim.LBFGS([X], lr=1, max_iter=200, tolerance_grad=1e-14, tolerance_change=1e-16)

        def closure():
            opt.zero_grad()
            f = sum((gi * X).sum() for gi in grads) + X.square().sum() / (2 * eta)
            f.backward()
            return f
        opt.step(closure)
        assert_close(W_t, X.detach(), tol=1e-8, name=f"W_{t}: learning-retaining vs FTRL")


# ---------------------------------------------------------------------------- chunk form (book ch. 3 §8)

def run_all(name, gen, T, h0, B=1, H=2, D=6, dtype=F64):
    spec = dict(CONFIGS[name])
    cfg = make_config(spec.pop("preset", None), **spec)
    q, k, v = random_qkv(B, H, T, D, D, dtype=dtype, generator=gen)
    gates = gates_for(cfg, gen, B, H, T, dtype)
    state = random_state(cfg, gen, B, H, D, D, dtype) if h0 else None
    call = lambda backend, b: miras(q, k, v, config=cfg, initial_state=state, output_final_state=True,  # noqa: E731
                                    backend=backend, chunk_size=b, **gates)
    return cfg, call, (q, k, v, gates, state)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("T,h0", [(1, True), (21, False), (21, True)])
def test_chunk_equals_frozen_seq(gen, name, T, h0):
    cfg, call, _ = run_all(name, gen, T, h0)
    for b in (1, 3, 16):
        o_f, s_f = call("frozen_seq", b)
        o_c, s_c = call("chunk", b)
        assert_close(o_c, o_f, tol=1e-10, name=f"{name}: o, chunk vs frozen_seq (b={b})")
        assert_close(flat_state(s_c), flat_state(s_f), tol=1e-10, name=f"{name}: final state (b={b})")


@pytest.mark.parametrize("name", ["titans", "linear_lp_elastic", "residual_l2_decay_window"])
def test_a_chunk_longer_than_the_sequence_is_the_whole_sequence(gen, name):
    """chunk_size >= T is one chunk of the T tokens: the chunk form equals frozen_seq at chunk_size = T, with
    work and memory bounded by T (a chunk of 10^7 over 5 tokens asked for 10^14-entry matrices)."""
    cfg, call, _ = run_all(name, gen, 5, True)
    o_f, s_f = call("frozen_seq", 5)
    for b in (6, 10**7):
        o_c, s_c = call("chunk", b)
        assert_close(o_c, o_f, tol=1e-10, name=f"{name}: o, chunk({b}) vs frozen_seq(T)")
        assert_close(flat_state(s_c), flat_state(s_f), tol=1e-10, name=f"{name}: final state (b={b})")


@pytest.mark.parametrize("memory", ["linear", "mlp"])
def test_window_rows_before_the_first_token_leave_the_gradients_finite(gen, memory):
    """A window c > 1 reaches before token 0 in the first chunk, where no token exists (window gate 0). The lp
    bias at p < 2 without smoothing (abs_eps = 0) has an infinite derivative at a zero error: the chunk form
    evaluated those rows at zero keys and values, and its gradients were NaN (0 * inf) where frozen_seq's
    are finite. Now they are frozen_seq's (its own loop never visits such rows)."""
    q, k, v = random_qkv(1, 2, 7, 3, 3, dtype=F64, generator=gen)
    eta = 0.1 + 0.1 * torch.rand(1, 2, 7, dtype=F64, generator=gen)
    for c, b in ((2, 2), (3, 4)):
        cfg = make_config(memory=memory, bias="lp", p=1.5, abs_eps=0.0, window=c)
        start = init_state(cfg, 1, 2, 3, 3, dtype=F64, generator=gen).memory       # the linear memory: a tensor
        bare = isinstance(start, torch.Tensor)
        start = {n: 0.3 * torch.randn(w.shape, dtype=F64, generator=gen)
                 for n, w in ({"M": start} if bare else start).items()}
        grads = []
        for backend in ("frozen_seq", "chunk"):
            leaves = [x.clone().requires_grad_(True) for x in (q, k, v, eta, *start.values())]
            h0 = leaves[4] if bare else dict(zip(start, leaves[4:]))
            o, _ = miras(*leaves[:3], eta=leaves[3], config=cfg, initial_state=h0, backend=backend, chunk_size=b)
            w = torch.cos(torch.arange(o.numel(), dtype=F64)).view_as(o)
            grads.append(torch.autograd.grad((o * w).sum(), leaves))
        for name, g_f, g_c in zip(["q", "k", "v", "eta", *start], *grads):
            assert torch.isfinite(g_f).all(), name
            assert_close(g_c, g_f, tol=1e-9, name=f"{memory}, c={c}, b={b}: d/d{name}, chunk vs frozen_seq")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_one_is_recurrent_and_larger_chunks_are_not(gen, name):
    cfg, call, _ = run_all(name, gen, 21, True)
    o_r, s_r = call("recurrent", 1)
    o_1, s_1 = call("chunk", 1)
    assert_close(o_1, o_r, tol=1e-10, name=f"{name}: chunk(1) vs recurrent")
    assert_close(flat_state(s_1), flat_state(s_r), tol=1e-10, name=f"{name}: final state")
    o_8, _ = call("chunk", 8)
    gap = rel_rmse(o_8, o_r)
    if name in EXACT_CHUNK:
        assert gap < 1e-10, "linear attention's gradient does not depend on the state: chunking is exact"
    else:
        assert gap > 1e-4, f"{name}: frozen gradients must change the model for b > 1 (gap {gap:.2e})"


@pytest.mark.parametrize("name", ["ttt_mlp", "titans", "yaad", "deltanet", "moneta", "linear_hnorm_lq_mom",
                                  "residual_dot_decayfirst_mom", "residual_l2_decay_window"])
def test_dual_form_equals_materialised_weights(gen, name):
    """The readouts of the chunk form (dual form, also divided by Moneta's nu_t, vs per-token weight sets) agree."""
    cfg, _, (q, k, v, gates, state) = run_all(name, gen, 21, True)
    problem = prepare(q, k, v, config=cfg, initial_state=state, backend="chunk", chunk_size=5, **gates)
    o_d, Z_d, S_d = miras_chunk(*problem.args, chunk_size=5)
    o_m, Z_m, S_m = miras_chunk(*problem.args, chunk_size=5, materialize=True)
    assert_close(o_d, o_m, tol=1e-12, name="o")
    for n in Z_d:
        assert_close(Z_d[n], Z_m[n], tol=1e-12, name=f"final {n}")
        if S_d is not None:
            assert_close(S_d[n], S_m[n], tol=1e-12, name=f"final momentum {n}")


def test_run_takes_another_form_of_the_same_problem_and_refuses_the_rest(gen):
    """``run(problem, backend)`` is ``miras(..., backend=backend)`` on the same inputs; a backend it cannot run
    on them (the kernel's inputs were not prepared, a misspelling) is refused by name."""
    from atlaslib.miras import run
    cfg, _, (q, k, v, gates, state) = run_all("titans", gen, 13, True)
    problem = prepare(q, k, v, config=cfg, initial_state=state, backend="chunk", chunk_size=4, **gates)
    for backend in ("recurrent", "frozen_seq", "chunk"):
        o, st = run(problem, backend)
        want, want_st = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend=backend,
                              chunk_size=4, **gates)
        assert_close(o, want, tol=1e-12, name=backend)
        assert_close(st.memory["W1"], want_st.memory["W1"], tol=1e-12, name=f"{backend} W1")
    for bad in ("triton", "auto", "Chunk"):
        with pytest.raises(ValueError, match=f"run: backend must be .* got {bad!r}"):
            run(problem, bad)


@pytest.mark.parametrize("name", ["titans", "moneta", "memora", "yaad"])
def test_continuing_from_a_final_state(gen, name):
    """Two calls, the second started from the first's final state, equal one call (split at a chunk boundary)."""
    cfg, _, (q, k, v, gates, state) = run_all(name, gen, 20, True)
    for backend, b in (("recurrent", 1), ("chunk", 4)):
        whole, s_whole = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend=backend,
                               chunk_size=b, **gates)
        head = {n: (g[:, :, :12] if g is not None else None) for n, g in gates.items()}
        tail = {n: (g[:, :, 12:] if g is not None else None) for n, g in gates.items()}
        o1, s1 = miras(q[:, :, :12], k[:, :, :12], v[:, :, :12], config=cfg, initial_state=state,
                       output_final_state=True, backend=backend, chunk_size=b, **head)
        o2, s2 = miras(q[:, :, 12:], k[:, :, 12:], v[:, :, 12:], config=cfg, initial_state=s1,
                       output_final_state=True, backend=backend, chunk_size=b, **tail)
        assert_close(torch.cat([o1, o2], 2), whole, tol=1e-12, name=f"{name} ({backend})")
        assert_close(flat_state(s2), flat_state(s_whole), tol=1e-12, name=f"{name} final state ({backend})")


def test_default_initial_state_is_seeded(gen):
    q, k, v = random_qkv(2, 2, 9, 8, 8, generator=gen)
    a, s = miras(q, k, v, preset="titans", eta=0.1, output_final_state=False)
    b, _ = miras(q, k, v, preset="titans", eta=0.1, initial_state=init_state("titans", 2, 2, 8, 8))
    assert torch.equal(a, b)
    st = init_state("titans", 2, 2, 8, 8)
    assert torch.equal(st.memory["W1"][0], st.memory["W1"][1]), "one parameter set per head, shared by the batch"
    assert not torch.equal(init_state("titans", 1, 1, 8, 8, seed=1).memory["W1"], st.memory["W1"][:1, :1])
    assert float(st.momentum["W1"].abs().max()) == 0.0


@pytest.mark.parametrize("memory", ["mlp", "residual", "gated"])
def test_deep_memories_start_at_the_documented_scale(gen, memory):
    """Memory.init: every weight of a deep memory W ~ N(0, 1/in) (in: its input width). 256 heads give
    2^16 draws per weight, so std sqrt(in) is 1 within 0.05 (about 18 standard errors) and mean sqrt(in) 0
    within 0.02 (5 standard errors)."""
    K = 8
    cfg = make_config(memory=memory)
    st = init_state(cfg, 1, 256, K, K, generator=gen, dtype=F64)
    assert set(st.memory) == set(build_parts(cfg, K, K).memory.shapes)
    for n, w in st.memory.items():
        fan_in = w.shape[-1]
        assert abs(w.std().item() * math.sqrt(fan_in) - 1) < 0.05, (n, fan_in, w.std().item())
        assert abs(w.mean().item() * math.sqrt(fan_in)) < 0.02, (n, fan_in, w.mean().item())


# ---------------------------------------------------------------------------- gradients

def weighted_loss(o, s):
    w = torch.cos(torch.arange(o.numel(), dtype=o.dtype)).view_as(o)
    return (o * w).sum() + flat_state(s).square().sum()


@pytest.mark.parametrize("name,pairs", [("titans", [("recurrent", 1), ("chunk", 1)]),
                                        ("moneta", [("frozen_seq", 4), ("chunk", 4)]),
                                        ("residual_l2_decay_window", [("frozen_seq", 3), ("chunk", 3)])])
def test_gradients_flow_through_the_chunk_form(gen, name, pairs):
    """Outer-loop gradients (q, k, v, gates, initial state) of the chunk form equal those of its oracle."""
    cfg, _, (q, k, v, gates, state) = run_all(name, gen, 10, True, H=1, D=4)
    grads = []
    for backend, b in pairs:
        leaves = {"q": q, "k": k, "v": v, **{n: g for n, g in gates.items()}}
        leaves = {n: x.clone().requires_grad_(True) for n, x in leaves.items()}
        mem = {n: w.clone().requires_grad_(True) for n, w in state.memory.items()}
        mom = None if state.momentum is None else {n: w.clone().requires_grad_(True) for n, w in state.momentum.items()}
        o, s = miras(leaves.pop("q"), leaves.pop("k"), leaves.pop("v"), config=cfg,
                     initial_state=MirasState(mem, mom), output_final_state=True, backend=backend, chunk_size=b,
                     **leaves)
        weighted_loss(o, s).backward()
        grads.append([x.grad for x in [*leaves.values(), *mem.values(), *(mom or {}).values()]])
    for g_a, g_b in zip(*grads):
        assert g_a is not None and torch.isfinite(g_a).all()
        assert_close(g_b, g_a, tol=1e-9, name=f"{name}: gradient")


def test_gradient_matches_finite_differences(gen):
    """d loss / d eta of Titans (deep memory, chunk form) against central differences."""
    cfg, _, (q, k, v, gates, state) = run_all("titans", gen, 7, True, H=1, D=4)
    eta = gates.pop("eta").clone().requires_grad_(True)
    f = lambda e: miras(q, k, v, config=cfg, initial_state=state, eta=e, backend="chunk", chunk_size=3,  # noqa: E731
                        **gates)[0].square().sum()
    f(eta).backward()
    idx = (0, 0, 4)
    h = 1e-6
    up, down = eta.detach().clone(), eta.detach().clone()
    up[idx] += h
    down[idx] -= h
    fd = (f(up) - f(down)) / (2 * h)
    assert abs(eta.grad[idx].item() - fd.item()) < 1e-6 * max(1.0, abs(fd.item()))


# ---------------------------------------------------------------------------- configurations and errors

def test_presets_and_overrides():
    assert set(PRESETS) == {"linear_attention", "deltanet", "gated_deltanet", "ttt_linear", "ttt_mlp", "titans",
                            "moneta", "yaad", "memora", "atlas", "dla"}
    assert PRESETS["atlas"] == atlas_config().replace(name="atlas"), "one ATLAS from both doors"
    cfg = make_config("titans", memory="linear")
    assert (cfg.memory, cfg.retention, cfg.optimizer) == ("linear", "decay", "momentum")
    assert make_config("moneta", memory="mlp").layer_norm is False, "a preset's LN belongs to its residual memory"
    assert make_config("memora", bias="dot").bias == "dot"
    assert PRESETS["titans"].replace(optimizer="gd").optimizer == "gd"
    assert has_kernel(make_config("titans", memory="linear")) and has_kernel(PRESETS["ttt_linear"])
    assert not has_kernel(PRESETS["titans"]) and not has_kernel(PRESETS["gated_deltanet"])


def test_axes_table_is_generated_from_presets():
    rows = axes_table()
    assert [r["model"] for r in rows] == list(PRESETS)
    for r in rows:
        cfg = PRESETS[r["model"]]
        parts = build_parts(cfg, 4, 4)
        assert r["memory"] == type(parts.memory).describe(cfg)
        assert r["bias"] == type(parts.bias).describe(cfg)
        assert r["retention"] == type(parts.retention).describe(cfg)
        assert r["optimizer"] == type(parts.optimizer).describe(cfg)
    by = {r["model"]: r for r in rows}
    assert by["titans"]["optimizer"] != by["ttt_mlp"]["optimizer"]
    assert by["memora"]["retention"] != by["moneta"]["retention"] != by["yaad"]["retention"]
    md = axes_markdown()
    assert md.count("\n") == len(PRESETS) + 1 and all(p in md for p in PRESETS)
    custom = axes_table([make_config("titans", memory="linear", window=4)])[0]
    assert "linear" in custom["memory"] and "c=4" in custom["bias"]


@pytest.mark.parametrize("kwargs,match", [
    (dict(preset="mamba"), "unknown preset"),
    (dict(memory="transformer"), "memory must be one of"),
    (dict(bias="cosine"), "bias must be one of"),
    (dict(retention="forget"), "retention must be one of"),
    (dict(optimizer="adam"), "optimizer must be one of"),
    (dict(optimizer="muon", ns_steps=-1), "ns_steps"),
    (dict(optimizer="muon", ns_coeffs="septic"), "coeffs must be one of"),
    (dict(optimizer="momentum", ns_steps=3), "applies to optimizer"),
    (dict(bias="l2", p=2.0), "applies to bias"),
    (dict(bias="dot", delta=0.5), "applies to bias"),
    (dict(retention="none", scale=2.0), "applies to retention"),
    (dict(memory="linear", expansion=2), "applies to memory"),
    (dict(memory="mlp", layer_norm=True), "layer_norm=True applies to memory"),
    (dict(retention="proximal", memory="mlp"), "proximal"),
    (dict(retention="proximal", optimizer="momentum"), "proximal"),
    (dict(window=3, bias="dot"), "window"),
    (dict(window=2, retention="decay_first"), "window"),
    (dict(window=0), "window must be >= 1"),
    (dict(lq=0.5, retention="lq"), "lq must be"),
    (dict(scale=0.0, retention="kl"), "scale must be >"),
    (dict(scale=float("inf"), retention="kl"), "scale must be a finite number"),
    (dict(bias="lp", p=float("nan")), "p must be a finite number"),
    # p < 1 makes lp non-convex (a smaller error gets a larger step), sign_sharpness = 0 makes psi = 0 (nothing
    # is learnt), a negative Huber threshold makes the step point uphill
    (dict(bias="lp", p=0.5), "p must be >= 1"),
    (dict(bias="lp", sign_sharpness=0.0), "sign_sharpness must be > 0"),
    (dict(bias="huber", delta=-0.5), "delta must be >= 0"),
    (dict(expansion=0, memory="mlp"), "expansion must be"),
    (dict(activation="swish", memory="mlp"), "activation must be one of"),
])
def test_bad_configurations(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_config(kwargs.pop("preset", None), **kwargs)


def test_bad_calls(gen):
    q, k, v = random_qkv(1, 2, 5, 4, 4, generator=gen)
    T = torch.ones(1, 2, 5)
    q6, k6, v3 = random_qkv(1, 2, 5, 6, 3, generator=gen)
    Z = torch.zeros(1, 2, 4, 4)
    cases = [
        (ValueError, "K=6 and V=3", lambda: miras(q6, k6, v3, preset="moneta")),
        (ValueError, "K=6 and V=3", lambda: miras(q6, k6, v3, memory="gated")),
        (ValueError, "has no retention gate", lambda: miras(q, k, v, preset="deltanet", alpha=T)),
        (ValueError, "has no momentum", lambda: miras(q, k, v, preset="ttt_mlp", theta=T)),
        (ValueError, "takes no threshold", lambda: miras(q, k, v, preset="titans", delta=T)),
        (ValueError, "takes no threshold", lambda: miras(q, k, v, preset="linear_attention", delta=0.3)),
        (ValueError, r"alpha must lie in \[0.0, 1.0\]", lambda: miras(q, k, v, preset="titans", alpha=1.5 * T)),
        (ValueError, "alpha must lie", lambda: miras(q, k, v, preset="titans", alpha=-0.1)),
        (ValueError, r"theta must lie in \[0.0, 1.0\]", lambda: miras(q, k, v, preset="titans", theta=1.5)),
        (ValueError, r"theta must lie in \[0.0, 1.0\]", lambda: miras(q, k, v, preset="titans", theta=1.5 * T)),
        (ValueError, "eta must lie", lambda: miras(q, k, v, eta=-T)),
        (ValueError, r"theta must have shape \[1, 2, 5\]", lambda: miras(q, k, v, preset="titans", theta=T[..., :4])),
        (ValueError, "delta must lie", lambda: miras(q, k, v, preset="yaad", delta=-T)),
        (ValueError, "eta contains NaN", lambda: miras(q, k, v, eta=T * float("nan"))),
        (ValueError, r"eta must lie in \[0.0, inf\), got nan", lambda: miras(q, k, v, eta=float("nan"))),
        (ValueError, r"alpha must lie in \[0.0, 1.0\], got nan",
         lambda: miras(q, k, v, preset="titans", alpha=float("nan"))),
        (ValueError, "eta must be on cpu like q, got meta", lambda: miras(q, k, v, eta=T.to("meta"))),
        (ValueError, "gamma must have shape", lambda: miras(q, k, v, window=2, gamma=torch.ones(1, 2, 5, 3))),
        (ValueError, "chunk_size must be >= 1", lambda: miras(q, k, v, chunk_size=0)),
        (TypeError, "chunk_size must be a positive int", lambda: miras(q, k, v, chunk_size=2.0)),
        (ValueError, "backend must be one of", lambda: miras(q, k, v, backend="cuda")),
        (ValueError, "has a kernel only for", lambda: miras(q, k, v, preset="titans", backend="triton")),
        (ValueError, "has a kernel only for", lambda: miras(q, k, v, preset="gated_deltanet", backend="triton")),
        (ValueError, "either preset", lambda: miras(q, k, v, preset="titans", config=PRESETS["titans"])),
        (TypeError, "unknown config option", lambda: miras(q, k, v, preset="titans", lr=0.1)),
        (ValueError, r"v must have shape \[B, H, T, V\]", lambda: miras(q, k, v[:, :, :4])),
        (ValueError, r"initial_state must have shape \[1, 2, 4, 4\]",
         lambda: miras(q, k, v, initial_state=torch.zeros(1, 2, 4, 5))),
        (ValueError, "initial_state contains NaN", lambda: miras(q, k, v, initial_state=Z * float("nan"))),
        (TypeError, "must be a dict", lambda: miras(q, k, v, preset="ttt_mlp", initial_state=Z)),
        (ValueError, "must have the weights", lambda: miras(q, k, v, preset="ttt_mlp", initial_state={"M": Z})),
        (ValueError, r"initial_state\['W1'\] must have shape \[1, 2, 16, 4\]",
         lambda: miras(q, k, v, preset="ttt_mlp", initial_state={"W1": Z, "W2": torch.zeros(1, 2, 4, 16)})),
        (ValueError, "keeps none", lambda: miras(q, k, v, initial_state=MirasState(Z, Z))),
        (ValueError, "phi must map", lambda: miras(q, k, v, phi=lambda x: x[0])),
        # [B, T, H, K] for [B, H, T, K]: four dims, but not q's tokens
        (ValueError, r"phi must map .* but phi\(q\) has shape \[1, 5, 2, 4\]",
         lambda: miras(q, k, v, phi=lambda x: x.transpose(1, 2))),
        (ValueError, r"phi\(q\) and phi\(k\) must have the same shape, got \[1, 2, 5, 4\] and \[1, 2, 5, 2\]",
         lambda: miras(q, k, v, phi=lambda x: x if x is q else x[..., :2])),
        (TypeError, "output_final_state must be", lambda: miras(q, k, v, output_final_state="yes")),
    ]
    for exc, match, fn in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_config_type_errors():
    with pytest.raises(TypeError, match="preset must be"):
        make_config(3)
    with pytest.raises(TypeError, match="window must be an int"):
        make_config(window=2.0)
    with pytest.raises(TypeError, match="MirasConfig"):
        build_parts("titans", 4, 4)
    assert isinstance(make_config(PRESETS["yaad"]), MirasConfig)


# ---------------------------------------------------------------------------- the Triton kernel (if present)

@pytest.mark.parametrize("preset,overrides", [("titans", {"memory": "linear"}), ("ttt_linear", {})])
def test_triton_matches_chunk(gen, preset, overrides):
    pytest.importorskip("atlaslib.miras.kernel", reason="atlaslib/miras/kernel.py (the Titans kernel) not present yet")
    cfg = make_config(preset, **overrides)
    B, H, T, K, V = 1, 2, 37, 16, 12
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    gates = gates_for(cfg, gen, B, H, T, torch.float32)
    state = random_state(cfg, gen, B, H, K, V, torch.float32)
    for b in (1, 16):
        ref, ref_s = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend="chunk",
                           chunk_size=b, **gates)
        o, s = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend="triton",
                     chunk_size=b, **gates)
        assert_close(o, ref, tol=1e-5, name=f"o (b={b})")
        assert_close(flat_state(s), flat_state(ref_s), tol=1e-5, name=f"final state (b={b})")


def contract_oracle(q, k, v, alpha, eta, theta, M0, S0, b):
    """The kernel contract, literally: in each chunk [t0, t0 + b), with errors at M_{t0},
    S_t = theta_t S_{t-1} - eta_t (M_{t0} k_t - v_t) k_t^T,  M_t = alpha_t M_{t-1} + S_t,  y_t = M_t q_t."""
    B, H, T, K = q.shape
    V = v.shape[-1]
    M = torch.zeros(B, H, V, K, dtype=F64) if M0 is None else M0.double()
    S = torch.zeros(B, H, V, K, dtype=F64) if S0 is None else S0.double()
    ones = torch.ones(B, H, T, dtype=F64)
    alpha = ones if alpha is None else alpha.double()
    eta = ones if eta is None else eta.double()
    theta = 0 * ones if theta is None else theta.double()
    out = []
    for t in range(T):
        if t % b == 0:
            M_start = M
        err = torch.einsum("bhvk,bhk->bhv", M_start, k[:, :, t].double()) - v[:, :, t].double()
        S = theta[:, :, t, None, None] * S - eta[:, :, t, None, None] * err[..., None] * k[:, :, t, None, :].double()
        M = alpha[:, :, t, None, None] * M + S
        out.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t].double()))
    return torch.stack(out, 2).to(q.dtype), M.float(), S.float()


@pytest.mark.parametrize("preset,overrides", [("titans", {"memory": "linear"}), ("ttt_linear", {}),
                                              ("titans", {"memory": "linear", "retention": "none"})])
def test_triton_dispatch_follows_the_kernel_contract(gen, monkeypatch, preset, overrides):
    """backend="triton" calls kernel.titans_linear_triton with the agreed arguments (a stand-in kernel
    that computes the contract literally) and takes its gradients from the chunk form."""
    import importlib.machinery
    import sys
    import types
    calls = []

    def fake_kernel(q, k, v, alpha, eta, theta, initial_state, initial_momentum, chunk_size, log_alpha):
        calls.append(dict(alpha=alpha, eta=eta, theta=theta, M0=initial_state, S0=initial_momentum, b=chunk_size,
                          log_alpha=log_alpha))
        alpha = alpha if log_alpha is None else log_alpha.exp()
        return contract_oracle(q, k, v, alpha, eta, theta, initial_state, initial_momentum, chunk_size)

    fake = types.ModuleType("atlaslib.miras.kernel")
    fake.__spec__ = importlib.machinery.ModuleSpec("atlaslib.miras.kernel", None)
    fake.titans_linear_triton = fake_kernel
    monkeypatch.setitem(sys.modules, "atlaslib.miras.kernel", fake)
    cfg = make_config(preset, **overrides)
    B, H, T, K, V = 1, 2, 13, 5, 4
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    gates = gates_for(cfg, gen, B, H, T, torch.float32)
    state = random_state(cfg, gen, B, H, K, V, torch.float32)
    leaves = {n: g.clone().requires_grad_(True) for n, g in gates.items()}
    o, s = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend="triton",
                 chunk_size=4, **leaves)
    assert len(calls) == 1
    call = calls[0]
    assert call["b"] == 4 and call["eta"].shape == (B, H, T)
    assert (call["alpha"] is None) == (cfg.retention == "none") and call["log_alpha"] is None
    assert (call["theta"] is None) == (cfg.optimizer == "gd") and (call["S0"] is None) == (cfg.optimizer == "gd")
    assert_close(call["M0"], state.memory, tol=0, name="initial state passed through")
    ref, ref_s = miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend="chunk",
                       chunk_size=4, **gates)
    assert_close(o, ref, name="o")
    assert_close(flat_state(s), flat_state(ref_s), name="final state")
    assert (s.momentum is None) == (cfg.optimizer == "gd")
    o.square().sum().backward()
    chunk_leaves = {n: g.clone().requires_grad_(True) for n, g in gates.items()}
    o_chunk, _ = miras(q, k, v, config=cfg, initial_state=state, backend="chunk", chunk_size=4, **chunk_leaves)
    o_chunk.square().sum().backward()
    for n in leaves:
        assert_close(leaves[n].grad, chunk_leaves[n].grad, name=f"grad {n}")
    calls.clear()
    miras(q, k, v, config=cfg, initial_state=state, backend="auto", **gates)        # CPU tensors: auto is chunk
    assert not calls
    if "alpha" in gates:          # a retention given as a log reaches the kernel as that log, not exp'd
        log_alpha = gates["alpha"].log()
        logged = {**gates, "alpha": None, "log_alpha": log_alpha}
        o_log = miras(q, k, v, config=cfg, initial_state=state, backend="triton", chunk_size=4, **logged)[0]
        assert calls[-1]["alpha"] is None and calls[-1]["log_alpha"] is not None
        assert_close(calls[-1]["log_alpha"], log_alpha, tol=0, name="log_alpha passed through")
        assert_close(o_log, ref, name="o from log_alpha")


# ---------------------------------------------------------------------------- token mixers (atlaslib.nn)

MIXER_NAMES = ["ttt_linear", "ttt_mlp", "titans", "moneta", "yaad", "memora"]


@pytest.mark.parametrize("name", MIXER_NAMES)
def test_mixer_shape_causality_grad_and_backends(gen, name):
    from atlaslib.nn import available_mixers, make_mixer
    assert name in available_mixers()
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 16, 2, **({} if name == "ttt_linear" else {"expansion": 2}))
    x = torch.randn(2, 11, 16, generator=gen, requires_grad=True)
    assert_causal_mixer(mixer, x, 6, gen)
    assert any(n.startswith("initial.") for n, _ in mixer.named_parameters()), "W_0 is learned"
    with torch.no_grad():                              # chunk_size 1 is the per-token engine (fp64: Moneta's
        mixer.double()                                 # 1/||Z||^2 amplifies fp32 rounding)
        mixer.chunk_size = 1
        ref = mixer(x.double())
        mixer.backend = "recurrent"
        assert_close(mixer(x.double()), ref, tol=1e-10)
    cfg = mixer.config
    per_head = sum(o * i for o, i in build_parts(cfg, 8, 8).memory.shapes.values())
    assert mixer.state_size == 2 * per_head * (2 if cfg.optimizer == "momentum" else 1)


def test_mixer_overrides_and_seeding():
    from atlaslib.nn import make_mixer
    torch.manual_seed(0)
    a = make_mixer("titans", 16, 2, memory="linear")
    assert a.config.memory == "linear" and set(a.initial) == {"M"}
    torch.manual_seed(0)
    b = make_mixer("ttt_mlp", 16, 2)
    torch.manual_seed(0)
    c = make_mixer("ttt_mlp", 16, 2)
    d = make_mixer("ttt_mlp", 16, 2)
    assert torch.equal(b.initial["W1"], c.initial["W1"]), "torch.manual_seed fixes W_0"
    assert not torch.equal(c.initial["W1"], d.initial["W1"]), "two layers start from different W_0"
    with pytest.raises(ValueError, match="applies to bias"):
        make_mixer("titans", 16, 2, p=3.0)


# ---------------------------------------------------------------------------- window (Omega rule)

@pytest.mark.parametrize("gamma_mode", ["source", "offset", None])
def test_window_with_linear_memory_is_the_omega_rule(gen, gamma_mode):
    """window=c, linear memory, l2, decay after the gradient == chapter 4's omega_rule, backend by backend
    (the window rows of a chunk reach c - 1 tokens into the previous chunk in both)."""
    B, H, T, K, V, c = 1, 2, 23, 6, 5, 3
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=0.6, dtype=F64, generator=gen)
    alpha = random_gate(B, H, T, low=0.6, dtype=F64, generator=gen)
    gamma = None if gamma_mode is None else random_gate(B, H, T, c if gamma_mode == "offset" else None, low=0.3,
                                                         dtype=F64, generator=gen)
    h0 = torch.randn(B, H, V, K, generator=gen, dtype=F64)
    kw = dict(window=c, gamma=gamma, alpha=alpha, eta=eta, initial_state=h0, output_final_state=True)
    ref, ref_s = omega_rule(q, k, v, backend="recurrent", **kw)
    o, s = miras(q, k, v, preset="deltanet", retention="decay", backend="recurrent", **kw)
    assert_close(o, ref, tol=1e-12, name="recurrent")
    assert_close(s.memory, ref_s.memory, tol=1e-12, name="recurrent final state")
    for b in (1, 4, 16):
        ref, ref_s = omega_rule(q, k, v, backend="chunk", chunk_size=b, **kw)
        for backend in ("chunk", "frozen_seq"):
            o, s = miras(q, k, v, preset="deltanet", retention="decay", backend=backend, chunk_size=b, **kw)
            assert_close(o, ref, tol=1e-12, name=f"{backend} (b={b}) vs omega chunk")
            assert_close(s.memory, ref_s.memory, tol=1e-12, name=f"{backend} final state (b={b})")


def test_window_with_linear_memory_matches_the_omega_kernel(gen):
    pytest.importorskip("triton")
    B, H, T, K, V, c = 1, 1, 21, 8, 8, 3
    q, k, v = random_qkv(B, H, T, K, V, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=0.4, generator=gen)
    gamma = random_gate(B, H, T, c, low=0.3, generator=gen)
    ref, _ = omega_rule(q, k, v, window=c, gamma=gamma, eta=eta, backend="triton", chunk_size=8)
    o, _ = miras(q, k, v, preset="deltanet", window=c, gamma=gamma, eta=eta, backend="chunk", chunk_size=8)
    assert_close(o, ref, tol=1e-5)


def test_window_changes_deep_memories_and_reduces_to_one_pair(gen):
    """A deep memory with a window: gamma = (1, 0, ..., 0) per offset keeps only the newest pair (= window 1)."""
    B, H, T, D, c = 1, 2, 13, 6, 4
    q, k, v = random_qkv(B, H, T, D, D, dtype=F64, generator=gen)
    eta = random_gate(B, H, T, low=0.05, high=0.4, dtype=F64, generator=gen)
    only_newest = torch.zeros(B, H, T, c, dtype=F64)
    only_newest[..., 0] = 1.0
    for backend in ("recurrent", "chunk"):
        one, _ = miras(q, k, v, preset="ttt_mlp", eta=eta, backend=backend, chunk_size=5)
        win, _ = miras(q, k, v, preset="ttt_mlp", window=c, gamma=only_newest, eta=eta, backend=backend, chunk_size=5)
        assert_close(win, one, tol=1e-12, name=backend)
        full, _ = miras(q, k, v, preset="ttt_mlp", window=c, eta=eta, backend=backend, chunk_size=5)
        assert rel_rmse(full, one) > 1e-3, "the other window pairs must contribute"


def test_titans_linear_chunk_is_the_contract(gen):
    """The public chunk form with the kernel's signature equals the contract written out, and checks its inputs."""
    from atlaslib.miras import titans_linear_chunk
    B, H, T, K, V = 2, 1, 17, 5, 3
    q, k, v = random_qkv(B, H, T, K, V, dtype=F64, generator=gen)
    alpha, theta = (random_gate(B, H, T, low=0.5, dtype=F64, generator=gen) for _ in range(2))
    eta = random_gate(B, H, T, low=0.1, high=0.9, dtype=F64, generator=gen)
    M0, S0 = (torch.randn(B, H, V, K, generator=gen, dtype=F64) for _ in range(2))
    for args in ((alpha, eta, theta, M0, S0), (None, eta, None, None, None), (None, None, None, M0, None)):
        o, M, S = titans_linear_chunk(q, k, v, *args, chunk_size=6)
        ref_o, ref_M, ref_S = contract_oracle(q, k, v, *args, 6)
        assert_close(o, ref_o, tol=1e-12)
        assert_close(M, ref_M.double(), tol=1e-6, name="M_T")
        assert_close(S, ref_S.double(), tol=1e-6, name="S_T")
    with pytest.raises(ValueError, match="theta must lie"):
        titans_linear_chunk(q, k, v, theta=2 * theta)
    with pytest.raises(ValueError, match="initial_momentum must have shape"):
        titans_linear_chunk(q, k, v, initial_momentum=M0[..., :2])


@pytest.mark.parametrize("name", ["titans", "moneta", "memora", "residual_l2_decay_window", "linear_lp_elastic"])
def test_chunk_coefficients_built_in_groups(gen, name, monkeypatch):
    """The gate-only coefficients are built GROUP_TOKENS tokens at a time; groups must not change the result."""
    import atlaslib.miras.chunk as chunk_module
    cfg, call, _ = run_all(name, gen, 23, True)
    for b in (1, 3, 16):
        monkeypatch.setattr(chunk_module, "GROUP_TOKENS", 1024)
        ref, ref_s = call("frozen_seq", b)
        monkeypatch.setattr(chunk_module, "GROUP_TOKENS", 7)
        o, s = call("chunk", b)
        assert_close(o, ref, tol=1e-10, name=f"{name} (b={b}, groups of {max(1, 7 // b) * b} tokens)")
        assert_close(flat_state(s), flat_state(ref_s), tol=1e-10, name="final state")


@pytest.mark.parametrize("preset", ["titans", "moneta"])
def test_log_alpha_reaches_the_chunk_decays_without_a_round_trip(monkeypatch, gen, preset):
    """log alpha = -3e-9 per token is exactly 1.0 once exponentiated in fp32: the chunk form's decays
    must be the cumulative sums of the log-gates given, not of log(exp(.)) (which are all 0)."""
    import atlaslib.miras.chunk as chunk
    seen = []
    real = chunk.causal_decay
    monkeypatch.setattr(chunk, "causal_decay",
                        lambda ga, causal=None, dtype=None: seen.append(ga) or real(ga, causal, dtype))
    B, H, T, K, b = 1, 2, 20, 4, 8
    q, k, v = random_qkv(B, H, T, K, K, generator=gen)
    log_alpha = -3e-9 * (1 + torch.rand(B, H, T, generator=gen))
    assert torch.exp(log_alpha).eq(1).all()
    miras(q, k, v, preset=preset, log_alpha=log_alpha, eta=0.1, backend="chunk", chunk_size=b)
    ga = seen[-1].reshape(B * H, -1)[:, :T].double()
    want = torch.cat([log_alpha.double().reshape(B * H, T)[:, s:s + b].cumsum(-1) for s in range(0, T, b)], -1)
    assert_close(ga, want, tol=1e-6)


@pytest.mark.parametrize("name", ["titans", "yaad", "memora", "moneta"])
def test_gates_of_exactly_zero_have_finite_gradients_in_the_chunk_form(gen, name):
    """alpha_t = 0 (a full reset) and theta_t = 0 (momentum dropped): the chunk form takes their logs clamped
    first, so every gradient is finite; at b = 1 it equals the definition's everywhere but at the zero gates
    themselves (whose clamped log passes no gradient)."""
    B, H, T, K = 1, 2, 9, 4
    q, k, v = random_qkv(B, H, T, K, K, dtype=F64, generator=gen)
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    gates = gates_for(make_config(name), gen, B, H, T)
    zero = {"alpha": 3, "theta": 5}                                     # the token whose gate is exactly 0
    for n, t in zero.items():
        if n in gates:
            gates[n][..., t] = 0.0
    grads = {}
    for backend in ("recurrent", "chunk"):
        xs = {n: x.clone().requires_grad_() for n, x in dict(q=q, k=k, v=v, **gates).items()}
        o, _ = miras(xs["q"], xs["k"], xs["v"], preset=name, backend=backend, chunk_size=1,
                     **{n: xs[n] for n in gates})
        grads[backend] = dict(zip(xs, torch.autograd.grad((o * v).sum(), list(xs.values()))))
    for n, g in grads["chunk"].items():
        assert torch.isfinite(g).all(), f"{name}: d/d{n} is not finite"
        want = grads["recurrent"][n]
        if n in zero:
            g, want = g.clone(), want.clone()
            g[..., zero[n]] = want[..., zero[n]] = 0.0
        assert_close(g, want, tol=1e-10, name=f"{name}: d/d{n}")


@pytest.mark.parametrize("name,overrides", [("titans", {"memory": "linear"}), ("gated_deltanet", {}), ("memora", {}),
                                            ("linear_hnorm_lq_mom", {})])
def test_log_alpha_minus_inf_is_a_reset_in_every_form(gen, name, overrides):
    """log_alpha = -inf is a valid gate (alpha = 0, a full reset): the chunk form takes the given log floored
    (LOG_FLOOR), so the decays between tokens stay finite where -inf - (-inf) would be NaN. Every form
    equals its reference: recurrent is alpha = exp(log_alpha) = 0, chunk(1) is recurrent, chunk(b) is
    frozen_seq(b)."""
    spec = {**CONFIGS[name], **overrides}
    cfg = make_config(spec.pop("preset", None), **spec)
    B, H, T, D = 1, 2, 13, 4
    q, k, v = random_qkv(B, H, T, D, D, dtype=F64, generator=gen)
    gates = gates_for(cfg, gen, B, H, T)
    log_alpha = gates.pop("alpha").log()
    log_alpha[..., [3, 8]] = -math.inf                          # resets at b = 1 and inside a chunk of 4
    state = random_state(cfg, gen, B, H, D, D)

    def run(backend, b=1, **gate):
        return miras(q, k, v, config=cfg, initial_state=state, output_final_state=True, backend=backend,
                     chunk_size=b, **gates, **gate)
    ref = run("recurrent", alpha=log_alpha.exp())
    assert torch.isfinite(ref[0]).all() and (log_alpha.exp()[..., 3] == 0).all()
    cases = {("recurrent", 1): ref, ("chunk", 1): ref, ("chunk", 4): run("frozen_seq", 4, log_alpha=log_alpha)}
    for (backend, b), (want, want_s) in cases.items():
        o, s = run(backend, b, log_alpha=log_alpha)
        assert torch.isfinite(o).all() and torch.isfinite(flat_state(s)).all(), f"{name}: {backend}({b}) not finite"
        assert_close(o, want, tol=1e-10, name=f"{name}: {backend}({b})")
        assert_close(flat_state(s), flat_state(want_s), tol=1e-10, name=f"{name}: {backend}({b}) final state")


def test_helpers_check_their_arguments():
    """init_state's sizes and dtype, memory_gradient's weights, presets by name for describe/axes_table."""
    for bad, error in ((-1, ValueError), (0, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="B must be"):
            init_state("titans", bad, 2, 4, 3)
    with pytest.raises(TypeError, match="dtype must be a floating"):
        init_state("titans", 1, 2, 4, 3, dtype=torch.int64)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 3)
    with pytest.raises(ValueError, match=r"W must be a dict with the weights \['W1', 'W2'\]"):
        memory_gradient("titans", {"M": torch.zeros(3, 3, 4)}, k, v)
    with pytest.raises(ValueError, match=r"W\['W1'\] must be \[N, 16, 4\]"):
        memory_gradient("titans", {"W1": torch.zeros(3, 3, 16), "W2": torch.zeros(3, 16, 4)}, k, v)
    # rows of another (batch, head) count, or keys without that axis, are refused rather than broadcast
    M = {"M": torch.zeros(3, 3, 4)}
    with pytest.raises(ValueError, match=r"W\['M'\] must be \[N, 3, 4\] = \[2, 3, 4\]"):
        memory_gradient("deltanet", M, k[:2], v[:2])
    with pytest.raises(ValueError, match=r"k must have shape \[N, R, K\]"):
        memory_gradient("deltanet", M, k[0], v[0])
    with pytest.raises(ValueError, match=r"v must be \[N, R, V\] = \[3, 2, V\]"):
        memory_gradient("deltanet", M, k, torch.randn(3, 5, 3))
    with pytest.raises(ValueError, match=r"delta must have shape \[3, 2\]"):
        memory_gradient(make_config("deltanet", bias="huber"), M, k, v, delta=torch.ones(3, 5))
    assert describe("titans") == describe(make_config("titans"))
    with pytest.raises(ValueError, match="unknown preset 'foo'"):
        axes_table(["foo"])


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_elastic_net_at_threshold_zero_is_no_retention_in_its_gradients_too(gen, backend):
    """S_0 is the identity, so retention="elastic" with threshold 0 is retention="none", gradients included,
    also where the state is exactly 0 (a zero start memory and a first token that writes nothing, eta_0 = 0):
    sign(z) * |z| has the derivative 0 there."""
    B, H, T, K = 1, 2, 6, 3
    q, k, v = random_qkv(B, H, T, K, K, dtype=F64, generator=gen)

    def grads(retention):
        eta = (0.2 + 0.3 * torch.rand(B, H, T, generator=gen.manual_seed(7), dtype=F64))
        eta[..., 0] = 0.0
        eta.requires_grad_(True)
        extra = dict(threshold=0.0) if retention == "elastic" else {}
        o, _ = miras(q, k, v, memory="linear", bias="l2", retention=retention, eta=eta, backend=backend, chunk_size=2,
                     **extra)
        (g,) = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel(), dtype=F64).view_as(o)).sum(), eta)
        return g
    want = grads("none")
    assert want[..., 0].abs().min() > 1e-6, "eta_0's gradient must not vanish for the test to mean anything"
    assert_close(grads("elastic"), want, tol=1e-12, name="d/d eta, elastic at threshold 0")


def test_soft_threshold_lets_nan_and_inf_through():
    """A diverged state stays diverged: NaN is not thresholded to 0 (inf keeps its sign)."""
    from atlaslib.miras import soft_threshold
    z = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.5, -2.0])
    for gamma in (0.0, 1.0):
        got = soft_threshold(z, gamma)
        assert torch.isnan(got[0]) and got[1] == float("inf") and got[2] == -float("inf"), (gamma, got)
    assert torch.equal(soft_threshold(z[3:], 1.0), torch.tensor([0.0, -1.0]))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_value_shift_gradient_is_finite_at_an_exact_read(dtype):
    """psi = e + delta e / ||e||: its Jacobian in y is I + delta (I - u u^T) / ||e|| (u = e / ||e||) away from
    e = 0, and I at e = 0 (the direction term's derivative taken as 0 there, as torch.sign's); the floored
    norm gave 1 / sqrt(tiny) there, 1e19 in fp32 and 1e154 in fp64."""
    gen = torch.Generator().manual_seed(3)
    bias = BIASES["value_shift"](make_config(bias="value_shift"))
    v = torch.randn(4, dtype=dtype, generator=gen)
    delta = torch.tensor(0.5, dtype=dtype)
    for y in (v.clone(), v + torch.randn(4, dtype=dtype, generator=gen)):
        jac = torch.autograd.functional.jacobian(lambda y: bias.psi(y, v, delta), y)
        e = (y - v).double()
        n = e.norm()
        eye = torch.eye(4, dtype=F64)
        want = eye if n == 0 else eye + 0.5 * (eye - torch.outer(e, e) / n**2) / n
        assert_close(jac.double(), want, tol=1e-5 if dtype == torch.float32 else 1e-12, name=f"|e| = {n:.2f}")
