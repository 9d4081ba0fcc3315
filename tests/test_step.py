"""One-token steps: each model's step, run token by token, is its full forward pass.

Library steps are compared with the chunk forms (a different algorithm) and with
references written here from the math (a dense quadratic form, explicit projectors,
autograd on the window loss); mixer steps with the mixers' forward; TinyLM's stepped
logits with its forward, and its generation with the forward's own argmax.
"""
import pytest
import torch
import torch.nn.functional as F

from atlaslib.core.testing import TOLERANCE, assert_close, random_gate, random_qkv, rel_rmse, window_gate
from atlaslib.delta import delta_rule
from atlaslib.delta.recurrent import delta_rule_recurrent, delta_rule_step
from atlaslib.linear import linear_attention
from atlaslib.linear.recurrent import linear_attention_recurrent, linear_attention_step
from atlaslib.miras import prepare, run
from atlaslib.miras.recurrent import TokenState, miras_step
from atlaslib.nn import ShortConv, TinyLM, TokenMixer, available_mixers, make_mixer
from atlaslib.nn.linear_mixers import GatedLinear
from atlaslib.omega import omega_rule, swla
from atlaslib.omega.recurrent import omega_step, start_window, swla_step
from mixer_helpers import step_through

DTYPES = [torch.float32, torch.float64]


def steps(step, M, q, k, v, *per_token):
    """Run ``step(M, q_t, k_t, v_t, *gates_t)`` over T tokens; per_token gates are [B,H,T,...] or None."""
    ys = []
    for t in range(q.shape[2]):
        gates_t = [None if g is None else g[:, :, t] for g in per_token]
        M, y_t = step(M, q[:, :, t], k[:, :, t], v[:, :, t], *gates_t)
        ys.append(y_t)
    return torch.stack(ys, dim=2), M


def gate_of(kind, B, H, T, K, dtype, gen):
    if kind == "none":
        return None
    return random_gate(B, H, T, K if kind == "channel" else None, low=0.7, dtype=dtype, generator=gen)


# ---------------------------------------------------------------- chapter 1: linear attention

def linear_attention_dense(q, k, v, alpha, M0):
    """y_t = sum_{j<=t} v_j k_j^T Diag(A_t / A_j) q_t + M0 Diag(A_t) q_t with A_t = alpha_1 ... alpha_t."""
    B, H, T, K = q.shape
    a = torch.ones(B, H, T, K, dtype=q.dtype) if alpha is None else \
        (alpha if alpha.dim() == 4 else alpha[..., None].expand(B, H, T, K))
    A = torch.cumprod(a, dim=2)                                             # [B, H, T, K]
    scores = torch.einsum("bhtk,bhjk->bhtj", q * A, k / A).tril()           # (A_t q_t) . (k_j / A_j), j <= t
    return scores @ v + torch.einsum("bhvk,bhtk->bhtv", M0, q * A)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "scalar", "channel"])
def test_linear_attention_step_is_the_forward_pass(gen, dtype, kind):
    B, H, T, K, V = 2, 3, 19, 6, 5
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    alpha = gate_of(kind, B, H, T, K, dtype, gen)
    M0 = 0.3 * torch.randn(B, H, V, K, generator=gen).to(dtype)
    o, M = steps(linear_attention_step, M0, q, k, v, alpha)
    assert o.dtype == M.dtype == dtype
    assert_close(o, linear_attention_dense(q, k, v, alpha, M0), name="steps vs dense form")
    o_chunk, M_chunk = linear_attention(q, k, v, alpha=alpha, initial_state=M0, output_final_state=True,
                                        backend="chunk", chunk_size=5)
    assert_close(o, o_chunk, name="steps vs chunk form")
    assert_close(M, M_chunk, name="final state vs chunk form")
    o_rec, M_rec = linear_attention_recurrent(q, k, v, alpha, M0)
    assert torch.equal(o, o_rec) and torch.equal(M, M_rec)        # the loop is made of these steps


def test_linear_attention_step_keeps_the_state_precision(gen):
    """A bf16 token is cast to the fp32 state, so one step equals the fp32 step on the same values."""
    q, k, v = (x[:, :, 0] for x in random_qkv(1, 2, 1, 8, 4, dtype=torch.bfloat16, generator=gen))
    M = torch.randn(1, 2, 4, 8, generator=gen)
    alpha = torch.full((1, 2), 1 - 2 ** -10)                      # rounds to 1.0 in bf16
    M_t, y_t = linear_attention_step(M, q, k, v, alpha)
    M_ref, y_ref = linear_attention_step(M, q.float(), k.float(), v.float(), alpha)
    assert M_t.dtype == y_t.dtype == torch.float32
    assert torch.equal(M_t, M_ref) and torch.equal(y_t, y_ref)


# ---------------------------------------------------------------- chapter 2: the delta rule

def delta_rule_projectors(q, k, v, beta, alpha, M0):
    """M_t = M_{t-1} Diag(alpha_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T with the K x K matrices formed."""
    B, H, T, K = q.shape
    eye = torch.eye(K, dtype=q.dtype)
    M, ys = M0, []
    for t in range(T):
        a = torch.ones(B, H, K, dtype=q.dtype) if alpha is None else \
            (alpha[:, :, t] if alpha.dim() == 4 else alpha[:, :, t, None].expand(B, H, K))
        kt = k[:, :, t]
        P = eye - beta[:, :, t, None, None] * kt[..., :, None] * kt[..., None, :]
        M = M @ torch.diag_embed(a) @ P + beta[:, :, t, None, None] * v[:, :, t, :, None] * kt[..., None, :]
        ys.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))
    return torch.stack(ys, dim=2), M


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["none", "scalar", "channel"])
def test_delta_rule_step_is_the_forward_pass(gen, dtype, kind):
    B, H, T, K, V = 2, 2, 17, 6, 5
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    beta = random_gate(B, H, T, low=0.1, high=1.5, dtype=dtype, generator=gen)
    alpha = gate_of(kind, B, H, T, K, dtype, gen)
    M0 = 0.3 * torch.randn(B, H, V, K, generator=gen).to(dtype)
    o, M = steps(delta_rule_step, M0, q, k, v, beta, alpha)
    o_ref, M_ref = delta_rule_projectors(q, k, v, beta, alpha, M0)
    assert_close(o, o_ref, name="steps vs explicit projectors")
    assert_close(M, M_ref, name="final state vs explicit projectors")
    o_chunk, M_chunk = delta_rule(q, k, v, beta, alpha=alpha, initial_state=M0, output_final_state=True,
                                  backend="chunk", chunk_size=4)
    assert_close(o, o_chunk, name="steps vs chunk form")
    assert_close(M, M_chunk, name="final state vs chunk form")
    o_rec, M_rec = delta_rule_recurrent(q, k, v, beta, alpha, M0)
    assert torch.equal(o, o_rec) and torch.equal(M, M_rec)


# ---------------------------------------------------------------- chapter 4: Omega rule and SWLA

def window_rule_by_autograd(q, k, v, c, gamma, alpha, eta, M0, hebbian):
    """One GD step per token on sum_i gamma_i^{(t)} l(M; k_i, v_i) over the last c pairs, by autograd."""
    B, H, T, D = k.shape
    M, ys = M0, []
    for t in range(T):
        M_var = M.clone().requires_grad_(True)
        loss = 0.0
        for i in range(max(0, t - c + 1), t + 1):
            w = window_gate(gamma, t, i)
            pred = torch.einsum("bhvd,bhd->bhv", M_var, k[:, :, i])
            l_i = -(pred * v[:, :, i]).sum(-1) if hebbian else 0.5 * (pred - v[:, :, i]).square().sum(-1)
            loss = loss + (w * l_i).sum()
        (grad,) = torch.autograd.grad(loss, M_var)
        M = alpha[:, :, t, None, None] * M - eta[:, :, t, None, None] * grad
        ys.append(torch.einsum("bhvd,bhd->bhv", M, q[:, :, t]))
    return torch.stack(ys, dim=2), M


def run_window_steps(step, c, M0, q, k, v, gamma, alpha, eta):
    state, ys, sizes = start_window(M0), [], []
    for t in range(q.shape[2]):
        g_t = None if gamma is None else gamma[:, :, t]
        state, y_t = step(state, q[:, :, t], k[:, :, t], v[:, :, t], c, g_t, alpha[:, :, t], eta[:, :, t])
        ys.append(y_t)
        sizes.append(state.keys.shape[2])
    return torch.stack(ys, dim=2), state, sizes


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rule", ["omega", "swla"])
@pytest.mark.parametrize("gamma_kind", ["offset", "source", "none"])
def test_window_steps_are_the_forward_pass(gen, dtype, rule, gamma_kind):
    B, H, T, D, V, c = 2, 2, 14, 5, 4, 4
    q, k, v = random_qkv(B, H, T, D, V, dtype=dtype, generator=gen)
    gamma = {"offset": random_gate(B, H, T, c, low=0.2, dtype=dtype, generator=gen),
             "source": random_gate(B, H, T, low=0.2, dtype=dtype, generator=gen), "none": None}[gamma_kind]
    alpha = random_gate(B, H, T, low=0.7, dtype=dtype, generator=gen)
    eta = random_gate(B, H, T, low=0.1, dtype=dtype, generator=gen) / c
    M0 = 0.3 * torch.randn(B, H, V, D, generator=gen).to(dtype)
    step = omega_step if rule == "omega" else swla_step
    o, state, sizes = run_window_steps(step, c, M0, q, k, v, gamma, alpha, eta)
    assert sizes == [min(t + 1, c - 1) for t in range(T)]        # the window state stops growing at c - 1
    o_ref, M_ref = window_rule_by_autograd(q, k, v, c, gamma, alpha, eta, M0, hebbian=rule == "swla")
    assert_close(o, o_ref, name="steps vs autograd on the window loss")
    assert_close(state.M, M_ref, name="final state vs autograd")
    fn = omega_rule if rule == "omega" else swla
    o_chunk, M_chunk = fn(q, k, v, window=c, gamma=gamma, alpha=alpha, eta=eta, initial_state=M0,
                          output_final_state=True, backend="chunk", chunk_size=1 if rule == "omega" else 5)
    M_chunk = M_chunk.memory if rule == "omega" else M_chunk          # omega_rule: MirasState(M, None)
    assert_close(o, o_chunk, name="steps vs chunk form")
    assert_close(state.M, M_chunk, name="final state vs chunk form")


def test_window_of_one_keeps_no_pairs(gen):
    q, k, v = random_qkv(1, 2, 6, 4, 3, generator=gen)
    ones = torch.ones(1, 2, 6)
    o, state, sizes = run_window_steps(omega_step, 1, torch.zeros(1, 2, 3, 4), q, k, v, None, ones, ones * 0.5)
    assert sizes == [0] * 6
    assert_close(o, delta_rule(q, k, v, ones * 0.5, backend="chunk")[0], name="c = 1 vs the delta rule")


# ---------------------------------------------------------------- chapter 3: the MIRAS engine

MIRAS_CASES = [
    ("ttt_linear", {}),
    ("ttt_mlp", {"window": 3}),
    ("titans", {}),
    ("yaad", {}),
    ("memora", {}),
    ("moneta", {}),
    ("gated_deltanet", {"retention": "proximal"}),
]


def miras_steps_and_chunk(preset, kw, q, k, v, gates):
    """(outputs, final raw state) of the one-token steps and of the chunk form at b = 1."""
    problem = prepare(q, k, v, preset=preset, chunk_size=1, **kw, **gates)
    parts = problem.parts
    _, fq, fk, fv, g, Z, S = problem.args
    state = TokenState(Z, S, fk[:, :0], fv[:, :0], None if g.delta is None else g.delta[:, :0])
    ys = []
    for t in range(q.shape[2]):
        state, y_t = miras_step(parts, state, fq[:, t], fk[:, t], fv[:, t], g.at(t))
        ys.append(y_t)
        assert state.keys.shape[1] == min(t + 1, parts.cfg.window - 1)
    o_chunk, final = run(problem, "chunk")                              # chunk form, b = 1: the same model
    memory = final.memory if isinstance(final.memory, dict) else {"M": final.memory}
    steps = [torch.stack(ys, 1).reshape(o_chunk.shape)] + [state.Z[n].reshape(w.shape) for n, w in memory.items()]
    return steps, [o_chunk] + list(memory.values()), ["output"] + [f"final {n}" for n in memory]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("preset, kw", MIRAS_CASES)
def test_miras_step_is_the_forward_pass(gen, dtype, preset, kw):
    B, H, T, K, V = 1, 2, 9, 4, 4
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    gates = {"eta": 0.5 * random_gate(B, H, T, low=0.1, dtype=dtype, generator=gen)}
    parts = prepare(q, k, v, preset=preset, chunk_size=1, **kw, **gates).parts
    if parts.retention.uses_alpha:
        gates["alpha"] = random_gate(B, H, T, low=0.7, dtype=dtype, generator=gen)
    if parts.optimizer.uses_theta:
        gates["theta"] = random_gate(B, H, T, low=0.3, dtype=dtype, generator=gen)
    if parts.bias.uses_delta:
        gates["delta"] = random_gate(B, H, T, low=0.2, high=2.0, dtype=dtype, generator=gen)
    if parts.cfg.window > 1:
        gates["gamma"] = random_gate(B, H, T, parts.cfg.window, low=0.2, dtype=dtype, generator=gen)
    steps, chunk, names = miras_steps_and_chunk(preset, kw, q, k, v, gates)
    tols = [TOLERANCE[dtype]] * len(names)
    if dtype == torch.float32:
        # The two forms round differently, and deep memories, Memora's softmax and Moneta's lq
        # normalisation amplify rounding by a factor that depends on the draw (Memora's last layer:
        # 0.5% apart in fp32 for one draw in 150). The same inputs in fp64 measure that factor: the
        # fp32 gap may be the fp64 gap times 2^29 (the ratio of the two roundings), 4 times over.
        wide = lambda x: x.double()                                             # noqa: E731
        s64, c64, _ = miras_steps_and_chunk(preset, kw, wide(q), wide(k), wide(v),
                                            {n: wide(x) for n, x in gates.items()})
        for a, b, name in zip(s64, c64, names):     # the fp64 gap is rounding, not a model difference
            assert_close(a, b, tol=TOLERANCE[torch.float64], name=f"fp64 steps vs chunk form (b = 1): {name}")
        tols = [max(1e-4, 4 * 2**29 * rel_rmse(a, b)) for a, b in zip(s64, c64)]
    for a, b, name, tol in zip(steps, chunk, names, tols):
        assert_close(a, b, tol=tol, name=f"steps vs chunk form (b = 1): {name}")


# ---------------------------------------------------------------- mixers

MIXER_CASES = [
    ("softmax", {}),
    ("linear", {"backend": "chunk", "chunk_size": 4}),
    ("linear", {"backend": "chunk", "normalize": True}),
    ("retnet", {"backend": "chunk", "chunk_size": 4}),
    ("mamba2", {"backend": "chunk", "chunk_size": 4}),
    ("gla", {"backend": "chunk", "chunk_size": 4, "conv_size": 0}),
    ("deltanet", {"backend": "chunk"}),
    ("gated_deltanet", {"backend": "chunk"}),
    ("kda", {"backend": "chunk"}),
    ("omeganet", {"backend": "chunk", "chunk_size": 1, "window": 3}),          # b = 1 is the per-token rule
    ("omeganet", {"backend": "chunk", "chunk_size": 1, "gamma": "source", "degree": 2}),
    ("swla", {"backend": "chunk", "chunk_size": 4, "window": 3}),
    ("swla", {"backend": "chunk", "chunk_size": 4, "gamma": None, "retention": "none"}),
    ("ttt_linear", {"backend": "chunk", "chunk_size": 1}),
    ("ttt_linear", {"backend": "chunk", "chunk_size": 1, "window": 2}),
    ("ttt_linear", {"backend": "chunk", "chunk_size": 1, "retention": "proximal"}),   # the implicit step
    ("ttt_mlp", {"backend": "chunk", "chunk_size": 1}),
    ("titans", {"backend": "chunk", "chunk_size": 1}),
    ("yaad", {"backend": "chunk", "chunk_size": 1}),
    ("memora", {"backend": "chunk", "chunk_size": 1}),
    ("moneta", {"backend": "chunk", "chunk_size": 1}),
    ("atlas", {"backend": "chunk", "chunk_size": 1}),
    ("atlas", {"backend": "chunk", "chunk_size": 1, "window": 3, "ns_steps": 3}),
    ("atlas", {"backend": "chunk", "chunk_size": 1, "window": 3, "gamma": "source"}),
    # deep memories: chapter 3's engine (Muon, the Omega window) one token at a time
    ("atlas", {"backend": "chunk", "chunk_size": 1, "memory": "mlp"}),
    ("atlas", {"backend": "chunk", "chunk_size": 1, "memory": "mlp", "window": 3}),
    ("atlas", {"backend": "chunk", "chunk_size": 1, "memory": "residual"}),
    ("atlas", {"backend": "chunk", "chunk_size": 1, "memory": "residual", "window": 3, "gamma": "source"}),
    ("atlas++", {"backend": "chunk", "chunk_size": 1}),
    ("atlas++", {"backend": "chunk", "chunk_size": 1, "window": 3}),
    ("atlas++", {"backend": "chunk", "chunk_size": 1, "window": 3, "gamma": None, "momentum": False}),
    # chapter 6: the kernel forms step on cached keys (a growing state; SWDT's is bounded by its window)
    ("deep_transformer", {"backend": "chunk", "chunk_size": 4}),
    ("deep_transformer", {"backend": "chunk", "chunk_size": 4, "retention": "none", "normalize": False}),
    ("swdt", {"backend": "chunk", "chunk_size": 4, "window": 3}),
    ("dot", {"backend": "chunk", "chunk_size": 4}),                             # c = 1: exact at every b
    ("dot", {"backend": "chunk", "chunk_size": 1, "window": 3, "gamma": "offset"}),
    ("dot", {"backend": "chunk", "chunk_size": 1, "window": 3, "gamma": "source", "phi_star": ("taylor", 2)}),
    ("dla", {"backend": "chunk", "chunk_size": 1}),
    ("dla", {"backend": "chunk", "chunk_size": 1, "phi_star": ("taylor", 2), "memory": "linear"}),
    # chapter 7: the online memory is the base's step, cached states and pooled keys grow per segment
    ("memory_caching", {"backend": "chunk", "segments": 3}),
    ("memory_caching", {"backend": "chunk", "segments": 2, "mode": "checkpoint", "base": "deltanet"}),
    ("memory_caching", {"backend": "chunk", "segments": 2, "aggregate": "ssc", "top_k": 1, "base": "kda"}),
    ("memory_caching", {"backend": "chunk", "segments": 3, "aggregate": "residual", "base": "linear"}),
    ("memory_caching", {"backend": "chunk", "segments": 2, "aggregate": "soup", "base": "gla", "pool": "sum"}),
    ("memory_caching", {"backend": "chunk", "segments": 4, "mode": "checkpoint", "base": "mamba2",
                        "chunk_size": 2}),
    ("swa", {"window": 3}),
    ("mal", {"memory": "atlas", "window": 3, "backend": "chunk", "chunk_size": 1}),
    ("mag", {"memory": "gla", "window": 4, "backend": "chunk", "chunk_size": 4}),
]


@pytest.mark.parametrize("name, kw", [case for case in MIXER_CASES if "backend" in case[1]])
def test_the_backend_reaches_the_chapter_function(monkeypatch, name, kw):
    # an explicit backend="triton" must reach the model: with the interpreter off on a CPU it is refused (a model
    # with a kernel: "needs Triton's interpreter"; one without: "has no backend 'triton'"), where a mixer that
    # dropped it would run "auto", the chunk form, without a word
    import atlaslib.core.dispatch
    monkeypatch.setattr(atlaslib.core.dispatch, "interpreter_on", lambda: False)
    mixer = make_mixer(name, 12, 2, **dict(kw, backend="triton"))
    with pytest.raises((RuntimeError, ValueError), match="[Tt]riton"), torch.no_grad():
        mixer(torch.randn(1, 5, 12))


def test_every_registered_mixer_has_a_case():
    registered = {name for name in available_mixers() if not name.startswith("_")}   # "_": other tests' probes
    assert registered <= {case.values[0] if hasattr(case, "values") else case[0] for case in MIXER_CASES}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name, kw", MIXER_CASES)
def test_mixer_step_is_its_forward(gen, dtype, name, kw):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 12, 2, **kw).to(dtype)
    x = torch.randn(2, 7, 12, generator=gen).to(dtype)
    with torch.no_grad():
        y, _ = step_through(mixer, x)
        ref = mixer(x)
    tol = None
    # ATLAS's Newton-Schulz (Muon's coefficients, not a contraction) amplifies fp32 rounding
    if name in ("atlas", "atlas++", "mag", "mal") and dtype == torch.float32:
        tol = 5e-4
    # Moneta's l4 normalisation and Yaad's Huber switch amplify fp32 rounding on some draws: over 300
    # draws the two orders of summation differed by up to 1.2e-5 (Moneta) and 5.5e-6 (Yaad), and one CI
    # draw gave Yaad 1.3e-5, while in fp64 the same mixers agree to 5e-15 (rounding, not a mismatch)
    if name in ("moneta", "yaad") and dtype == torch.float32:
        tol = 1e-4
    assert_close(y, ref, tol=tol, name=f"{name}: step by step vs forward")


def test_short_conv_step_is_its_forward(gen):
    conv = ShortConv(5, 4)
    x = torch.randn(3, 9, 5, generator=gen)
    buffer, ys = conv.start(x[:, 0]), []
    for t in range(9):
        y_t, buffer = conv.step(x[:, t], buffer)
        ys.append(y_t)
        assert buffer.shape == (3, 3, 5)
    # independent: y_t = silu(sum_j w_j x_{t-3+j}) with zeros before the start
    padded = F.pad(x, (0, 0, 3, 0))
    ref = F.silu(sum(padded[:, j:j + 9] * conv.conv.weight[:, 0, j] for j in range(4)))
    assert_close(torch.stack(ys, 1), ref)


def test_mixer_without_a_step_says_so():
    class NoStep(TokenMixer):
        def mix(self, q, k, v, x):
            return v

    class NewMix(GatedLinear):                   # a new mix must not run its parent's (Hebbian) step
        def mix(self, q, k, v, x):
            return v
    for cls in (NoStep, NewMix):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__}.*no one-token step"):
            cls(8, 2).step(torch.randn(1, 8))
    with pytest.raises(ValueError, match=r"\[B, 8\]"):
        make_mixer("linear", 8, 2).step(torch.randn(1, 3, 8))
    with pytest.raises(NotImplementedError, match="segments='log' has no one-token step"):
        make_mixer("memory_caching", 8, 2, segments="log").step(torch.randn(1, 8))


# ---------------------------------------------------------------- TinyLM

def cache_numel(obj) -> int:
    """Numbers held in tensors anywhere inside a (nested) cache."""
    if isinstance(obj, torch.Tensor):
        return obj.numel()
    if isinstance(obj, dict):
        return sum(cache_numel(x) for x in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(cache_numel(x) for x in obj)
    return 0


LM_CASES = [
    ("softmax", {"max_len": 40}),
    ("gla", {}),
    ("gated_deltanet", {}),
    ("omeganet", {"chunk_size": 1}),
    ("titans", {"chunk_size": 1}),
    ("atlas++", {"chunk_size": 1, "window": 2}),                # a deep memory, generated token by token
    ("swdt", {"window": 3}),                                    # a kernel form with a bounded cache
    ("dot", {"phi_star": ("taylor", 2), "window": 2, "chunk_size": 1}),
    ("dla", {"chunk_size": 1}),
]


@pytest.mark.parametrize("name, kw", LM_CASES)
def test_tinylm_step_logits_are_the_forward_logits(gen, name, kw):
    """With the RMSNorm weights of a trained model (at init all are 1, so norm1 and norm2 would be
    interchangeable and a step that mixed them up would still match)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    lm = TinyLM(17, 16, 2, name, 2, backend="chunk", **kw).double()
    with torch.no_grad():
        for m in lm.modules():
            if isinstance(m, torch.nn.RMSNorm):
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=gen, dtype=torch.float64))
    ids = torch.randint(0, 17, (2, 9), generator=gen)
    state, logits = None, []
    with torch.no_grad():
        for t in range(ids.shape[1]):
            out, state = lm.step(ids[:, t], state)
            logits.append(out)
        ref = lm(ids)
    assert_close(torch.stack(logits, 1), ref, name="stepped logits vs forward")
    assert state.position == 9


@pytest.mark.parametrize("name, kw", LM_CASES)
def test_greedy_generation_is_the_forward_argmax_and_state_stays_put(gen, name, kw):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    lm = TinyLM(17, 16, 2, name, 2, backend="chunk", **kw).double()
    prompt = torch.randint(0, 17, (2, 4), generator=gen)
    out8, state8 = lm.generate(prompt, 4, return_state=True)                 # 8 tokens in the state
    out32, state32 = lm.generate(prompt, 28, return_state=True)              # 32 tokens
    assert out32.shape == (2, 32) and torch.equal(out32[:, :4], prompt)
    assert torch.equal(out8, out32[:, :8])                                   # deterministic
    with torch.no_grad():
        teacher = lm(out32).argmax(-1)                                       # forward on the whole output
    assert torch.equal(teacher[:, 3:-1], out32[:, 4:])                       # each new token = its argmax
    n8, n32 = cache_numel(state8), cache_numel(state32)
    if name == "softmax":                                                    # the KV cache grows by 2 H d / layer
        assert n32 - n8 == 24 * 2 * 2 * 16 * 2
    else:
        assert n8 == n32 > 0


def test_position_embeddings_take_exactly_max_len_tokens(gen):
    """With ``max_len`` position embeddings, forward takes sequences of up to max_len tokens, as step takes
    positions 0 .. max_len - 1: at T = max_len its logits are the stepped ones, and one token more is refused
    by both (ValueError)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    L = 8
    lm = TinyLM(20, 8, 1, "softmax", 2, max_len=L).double()
    ids = torch.randint(0, 20, (2, L + 1), generator=gen)
    state, logits = None, []
    with torch.no_grad():
        for t in range(L):
            out, state = lm.step(ids[:, t], state)
            logits.append(out)
        assert_close(lm(ids[:, :L]), torch.stack(logits, 1), name="forward at T = max_len vs step")
        with pytest.raises(ValueError, match=f"sequence length {L + 1} exceeds max_len={L}"):
            lm(ids)
        with pytest.raises(ValueError, match=f"position {L} is past max_len={L}"):
            lm.step(ids[:, L], state)


def test_sampling_is_seeded_and_top_k_one_is_greedy(gen):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    lm = TinyLM(23, 16, 1, "gla", 2)
    prompt = torch.randint(0, 23, (3, 2), generator=gen)
    seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
    draw = lambda **kw: lm.generate(prompt, 10, greedy=False, generator=torch.Generator().manual_seed(seed), **kw)  # noqa: E731
    assert torch.equal(draw(temperature=2.0), draw(temperature=2.0))
    assert torch.equal(draw(top_k=1), lm.generate(prompt, 10))
    assert torch.equal(lm.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(prompt, -1)
    with pytest.raises(ValueError, match="temperature"):
        lm.generate(prompt, 3, greedy=False, temperature=0.0)
    with pytest.raises(ValueError, match="prompt_ids"):
        lm.generate(prompt[0], 3)


def test_retnet_step_keeps_the_decay_of_every_head(gen):
    """RetNet's decays 1 - 2^(-5-h) round to 1 in fp32 from head 19 on: the fp64 step must use the fp64 decay
    that ``mix`` uses, or its memory never forgets there while the forward's does."""
    mixer = make_mixer("retnet", 48, 24, backend="chunk").double()
    assert (mixer.log_alpha(torch.float32).exp() == 1).any()
    x = torch.randn(1, 40, 48, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y, _ = step_through(mixer, x)
        ref = mixer(x)
    assert_close(y, ref, tol=1e-12, name="retnet, 24 heads, fp64: step by step vs forward")


@pytest.mark.parametrize("name, kw", [("atlas", {}), ("mag", {}), ("mal", {}), ("deltanet", {}),
                                      ("linear", {"normalize": True})])
def test_mixer_step_under_autocast_keeps_its_precision(gen, name, kw):
    """Generation under torch.autocast: the step runs with autocast off, as the forward's library call does,
    so its error against the fp32 step is about the forward's against the fp32 forward (ATLAS's Newton-Schulz
    products under autocast's bf16 were 4x that, 15x inside MAL)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer(name, 16, 2, **kw)
    x = torch.randn(2, 24, 16, generator=gen)
    with torch.no_grad():
        ref, _ = step_through(mixer, x)
        ref_forward = mixer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, _ = step_through(mixer, x)
            y_forward = mixer(x)
    err, err_forward = rel_rmse(y.float(), ref), rel_rmse(y_forward.float(), ref_forward)
    assert err <= 1.5 * err_forward + 2e-3, (err, err_forward)


def test_normalized_linear_step_divides_before_rounding(gen):
    """A bf16 normalised linear-attention mixer: the step divides its fp32 read before rounding, as the
    forward does, so the two agree to fp32 summation order (they differed by two bf16 roundings, 4e-3)."""
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    mixer = make_mixer("linear", 16, 2, normalize=True).to(torch.bfloat16)
    x = torch.randn(2, 64, 16, generator=gen).bfloat16()
    with torch.no_grad():
        y, _ = step_through(mixer, x)
        ref = mixer(x)
    assert rel_rmse(y.double(), ref.double()) < 5e-4
