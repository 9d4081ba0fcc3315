"""Retention gates as logs, end to end.

Every public function that takes ``alpha`` also takes ``log_alpha``:
* on fresh random inputs it gives what alpha = exp(log_alpha) gives, in fp64, on every backend
  the model has (the kernels under TRITON_INTERPRET=1, against the fp64 chunk form);
* it reaches the memory unrounded: a gate 1 - 2^-12, exactly 1.0 in bf16, still decays with bf16
  q, k, v when given as an fp32 log, and the state after T tokens matches an fp64 reference,
  whereas the same gate given as a bf16 alpha never decays;
* it is checked like alpha (shape, NaN, range <= 0, fp32/fp64 only, not together with alpha).
"""
import math

import pytest
import torch

from atlaslib.atlas import atlas
from atlaslib.core import assert_close, random_qkv, rel_rmse
from atlaslib.delta import delta_rule
from atlaslib.linear import linear_attention
from atlaslib.miras import miras, titans_linear_chunk
from atlaslib.omega import omega_rule, swla

F64 = torch.float64
B, H, T, K, V = 1, 2, 13, 8, 8          # T not a multiple of the chunk: the padded tail is exercised


class Case:
    """One public function with its non-gate inputs drawn once: ``run(q, k, v, backend, **gate)``
    returns the tensors to compare (output and final state)."""

    def __init__(self, name, backends, call, per_channel=False, extras=None, oracle="recurrent"):
        self.name, self.backends, self.call, self.per_channel = name, backends, call, per_channel
        self.extras = extras or (lambda g, dtype: {})
        # the per-token form that the chunk forms equal: (backend, call); "frozen_seq" where b freezes gradients
        self.oracle = oracle if isinstance(oracle, tuple) else (oracle, call)

    def __repr__(self):
        return self.name


def _state(s):
    """The final state as a list of tensors: a tensor, or a MirasState (weights and momentum)."""
    if isinstance(s, torch.Tensor):
        return [s]
    parts = []
    for part in (s.memory, s.momentum):
        if part is None:
            continue
        parts += list(part.values()) if isinstance(part, dict) else [part]
    return parts


def _omega_extras(g, dtype):
    return dict(gamma=torch.rand(B, H, T, 3, generator=g).to(dtype),
                eta=(0.1 + 0.2 * torch.rand(B, H, T, generator=g)).to(dtype))


def _miras_extras(g, dtype):
    return dict(eta=(0.05 + 0.2 * torch.rand(B, H, T, generator=g)).to(dtype),
                theta=(0.5 * torch.rand(B, H, T, generator=g)).to(dtype))


def _beta(g, dtype):
    return dict(beta=(0.2 + 0.8 * torch.rand(B, H, T, generator=g)).to(dtype))


def _linear(q, k, v, backend, **kw):
    return linear_attention(q, k, v, backend=backend, chunk_size=4, output_final_state=True, **kw)


def _delta(q, k, v, backend, beta, **kw):
    return delta_rule(q, k, v, beta, backend=backend, chunk_size=4, output_final_state=True, **kw)


def _omega(q, k, v, backend, **kw):
    return omega_rule(q, k, v, window=3, backend=backend, chunk_size=4, output_final_state=True, **kw)


def _omega_mlp(q, k, v, backend, **kw):
    return omega_rule(q, k, v, window=3, memory="mlp", backend=backend, chunk_size=4, output_final_state=True, **kw)


def _swla(q, k, v, backend, **kw):
    return swla(q, k, v, window=3, backend=backend, chunk_size=4, output_final_state=True, **kw)


def _titans_linear(q, k, v, backend, **kw):
    return miras(q, k, v, preset="titans", memory="linear", backend=backend, chunk_size=4, output_final_state=True,
                 **kw)


def _titans(q, k, v, backend, **kw):
    return miras(q, k, v, preset="titans", backend=backend, chunk_size=4, output_final_state=True, **kw)


def _memora(q, k, v, backend, theta=None, **kw):      # the KL retention: alpha is not a decay of Z
    return miras(q, k, v, preset="memora", backend=backend, chunk_size=4, output_final_state=True, **kw)


def _titans_chunk(q, k, v, backend, **kw):
    assert backend == "chunk"
    o, M, S = titans_linear_chunk(q, k, v, chunk_size=4, **kw)
    return o, M


CASES = [
    Case("linear_attention", ("recurrent", "chunk", "triton"), _linear),
    Case("linear_attention (GLA)", ("recurrent", "chunk", "triton"), _linear, per_channel=True),
    Case("delta_rule", ("recurrent", "chunk", "triton"), _delta, extras=_beta),
    Case("delta_rule (KDA)", ("recurrent", "chunk", "triton"), _delta, per_channel=True, extras=_beta),
    Case("omega_rule", ("recurrent", "chunk", "triton"), _omega, extras=_omega_extras, oracle="frozen_seq"),
    Case("omega_rule (mlp)", ("recurrent", "chunk"), _omega_mlp, extras=_omega_extras, oracle="frozen_seq"),
    Case("swla", ("recurrent", "chunk", "triton"), _swla, extras=_omega_extras),
    Case("miras (titans, linear)", ("recurrent", "frozen_seq", "chunk", "triton"), _titans_linear,
         extras=_miras_extras, oracle="frozen_seq"),
    Case("miras (titans)", ("recurrent", "frozen_seq", "chunk"), _titans, extras=_miras_extras,
         oracle="frozen_seq"),
    Case("miras (memora)", ("recurrent", "chunk"), _memora, extras=_miras_extras, oracle="frozen_seq"),
    Case("titans_linear_chunk", ("chunk",), _titans_chunk, extras=_miras_extras,
         oracle=("frozen_seq", _titans_linear)),
]
BACKEND_CASES = [(c, b) for c in CASES for b in c.backends]


def draw(gen, case, dtype):
    """Fresh q, k, v, the case's other inputs, and log-gates in [log 0.4, 0] (one exactly 0)."""
    q, k, v = random_qkv(B, H, T, K, V, dtype=dtype, generator=gen)
    shape = (B, H, T, K) if case.per_channel else (B, H, T)
    log_alpha = torch.rand(shape, generator=gen, dtype=F64) * math.log(0.4)
    log_alpha[0, 0, 0] = 0.0                                     # alpha = 1 is allowed
    return q, k, v, case.extras(gen, dtype), log_alpha


def outputs(case, q, k, v, backend, extras, **gate):
    o, s = case.call(q, k, v, backend, **extras, **gate)
    return [o] + _state(s)


@pytest.mark.parametrize("case, backend", BACKEND_CASES, ids=[f"{c.name}-{b}" for c, b in BACKEND_CASES])
def test_log_alpha_gives_what_alpha_gives(gen, case, backend):
    """log_alpha vs alpha = exp(log_alpha), both in fp64 on the PyTorch backends; the kernels take
    fp32 inputs and a fp32 log_alpha and are held to the fp64 chunk form with alpha."""
    q, k, v, extras, log_alpha = draw(gen, case, F64)
    ref = outputs(case, q, k, v, "chunk" if backend == "triton" else backend, extras, alpha=log_alpha.exp())
    if backend == "triton":
        f32 = lambda x: x.float()                                   # noqa: E731
        got = outputs(case, f32(q), f32(k), f32(v), backend, {n: f32(x) for n, x in extras.items()},
                      log_alpha=f32(log_alpha))
        tol = 1e-4
    else:
        got = outputs(case, q, k, v, backend, extras, log_alpha=log_alpha)
        tol = 1e-12
    ungated = outputs(case, q, k, v, "chunk" if backend == "triton" else backend, extras)
    assert rel_rmse(ungated[0], ref[0]) > 1e-3, "the gates must matter for the comparison to mean anything"
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close(a, b, tol=tol, name=f"{case.name} {backend} {'output' if i == 0 else f'state {i}'}")


@pytest.mark.parametrize("case, backend", BACKEND_CASES, ids=[f"{c.name}-{b}" for c, b in BACKEND_CASES])
def test_a_log_gate_of_minus_inf_is_the_full_reset_of_alpha_zero(gen, case, backend):
    """log_alpha = -inf (allowed: alpha = 0) resets the memory as alpha = 0 does, finite on every backend: the
    chunk forms and kernels clamp it, as they clamp alpha = 0 (an unclamped -inf makes -inf - (-inf) = NaN).
    The reference is the per-token form (``Case.oracle``) in fp64, given alpha = 0: a multiplication by 0."""
    dtype = torch.float32 if backend == "triton" else F64
    q, k, v, extras, log_alpha = draw(gen, case, dtype)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    extras = {n: x.to(dtype) for n, x in extras.items()}
    log_alpha = log_alpha.to(dtype)
    log_alpha[:, :, T // 2] = -math.inf                      # a reset mid-sequence, inside a chunk
    got = outputs(case, q, k, v, backend, extras, log_alpha=log_alpha)
    oracle_backend, oracle_call = case.oracle if backend != "recurrent" else ("recurrent", case.call)
    o, s = oracle_call(*(x.double() for x in (q, k, v)), oracle_backend, **{n: x.double() for n, x in extras.items()},
                       alpha=log_alpha.double().exp())
    ref = ([o] + _state(s))[:len(got)]               # titans_linear_chunk returns no momentum: o and M
    for i, (a, b) in enumerate(zip(got, ref)):
        name = f"{case.name} {backend} {'output' if i == 0 else f'state {i}'}"
        assert torch.isfinite(a).all(), f"{name} is not finite"
        assert_close(a.to(b.dtype), b, tol=1e-5 if backend == "triton" else 1e-12, name=name)


@pytest.mark.parametrize("case, backend", [(c, b) for c, b in BACKEND_CASES if c.name in
                                           ("linear_attention (GLA)", "delta_rule", "omega_rule", "swla",
                                            "miras (titans, linear)")],
                         ids=lambda x: getattr(x, "name", x))
def test_gradient_reaches_log_alpha(gen, case, backend):
    """Mixers train through log_alpha: d loss / d log_alpha equals the chain rule through alpha = exp(log_alpha)."""
    dtype = torch.float32 if backend == "triton" else F64
    q, k, v, extras, log_alpha = draw(gen, case, dtype)
    w = torch.randn(B, H, T, V, generator=gen, dtype=dtype)

    def grad(use_log, backend):
        la = log_alpha.to(dtype).clone().requires_grad_(True)
        gate = dict(log_alpha=la) if use_log else dict(alpha=la.exp())
        o = outputs(case, q, k, v, backend, extras, **gate)[0]
        (g,) = torch.autograd.grad((o * w).sum(), la)
        return g
    ref = grad(False, "chunk" if backend == "triton" else backend)
    assert_close(grad(True, backend), ref, tol=1e-4 if backend == "triton" else 1e-10, name="d/d log_alpha")


# ---- a gate that bf16 rounds to 1 -----------------------------------------------------------

GATE = 1.0 - 2.0 ** -12              # above 1 - 2^-9: exactly 1.0 in bf16
T_LONG = 1024                        # GATE^T = e^-0.25: the decay is a quarter of the state's log
# The kernels multiply bf16 tiles on bf16 tensor cores: each decayed value (chapters 1-2) or state
# (Titans, the Omega rule, SWLA) is rounded to bf16 (relative 2^-9) before its product, so their states
# carry bf16 rounding (measured 1.7e-3 to 1.9e-3); a lost decay costs far more (rel. RMSE above 0.1 here)
BF16_PRODUCTS = {(name, "triton"): 5e-3 for name in ("linear_attention", "delta_rule", "omega_rule", "swla", "miras")}


def _eta(q, x):
    return torch.full(q.shape[:3], x, dtype=torch.float32)


# Each returns the final state; small steps so that the decay, not the overwrite, shapes old memory.
LONG_CALLS = {
    "linear_attention": lambda q, k, v, backend, **g: linear_attention(
        q, k, v, backend=backend, output_final_state=True, **g)[1],
    "delta_rule": lambda q, k, v, backend, **g: delta_rule(
        q, k, v, _eta(q, 0.02), backend=backend, output_final_state=True, **g)[1],
    "omega_rule": lambda q, k, v, backend, **g: omega_rule(
        q, k, v, window=2, eta=_eta(q, 0.02), backend=backend, chunk_size=16, output_final_state=True, **g)[1].memory,
    "swla": lambda q, k, v, backend, **g: swla(
        q, k, v, window=2, eta=_eta(q, 0.5), backend=backend, chunk_size=16, output_final_state=True, **g)[1],
    "miras": lambda q, k, v, backend, **g: miras(
        q, k, v, preset="titans", memory="linear", eta=_eta(q, 0.02), backend=backend, chunk_size=16,
        output_final_state=True, **g)[1].memory,
    "titans_linear_chunk": lambda q, k, v, backend, **g: titans_linear_chunk(
        q, k, v, eta=_eta(q, 0.02), chunk_size=16, **g)[1],
}
EXACT_CHUNK = ("linear_attention", "delta_rule", "swla")      # chunk(b) == recurrent for these


LONG = [("linear_attention", b) for b in ("recurrent", "chunk", "triton")] + \
       [("delta_rule", b) for b in ("recurrent", "chunk", "triton")] + \
       [("omega_rule", b) for b in ("recurrent", "chunk", "triton")] + \
       [("swla", b) for b in ("recurrent", "chunk", "triton")] + \
       [("miras", b) for b in ("recurrent", "chunk", "triton")] + [("titans_linear_chunk", "chunk")]


@pytest.mark.parametrize("name, backend", LONG, ids=[f"{n}-{b}" for n, b in LONG])
def test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha(gen, name, backend):
    """State after T tokens, bf16 q, k, v: with log_alpha in fp32 it matches an fp64 reference (the
    same bf16 values in fp64, alpha = 1 - 2^-12 in fp64) to 1e-3 (bf16 rounding for kernels with
    bf16 products); with alpha in bf16 it is ten times further off."""
    assert torch.tensor(GATE, dtype=torch.bfloat16).item() == 1.0
    q, k, v = random_qkv(1, 2, T_LONG, 16, 16, generator=gen, dtype=torch.bfloat16)
    call = LONG_CALLS[name]
    shape = (1, 2, T_LONG)
    # the fp64 reference: the definition (recurrent) where the chunk form is exact; frozen-gradient
    # chunk forms and their kernels against the fp64 chunk form of the same chunk size
    ref_backend = "recurrent" if backend == "recurrent" or name in EXACT_CHUNK else "chunk"
    ref = call(q.double(), k.double(), v.double(), ref_backend, alpha=torch.full(shape, GATE, dtype=F64))
    log_gate = torch.full(shape, math.log1p(-2.0 ** -12), dtype=torch.float32)
    got = call(q, k, v, backend, log_alpha=log_gate)
    tol = BF16_PRODUCTS.get((name, backend), 1e-3)
    assert rel_rmse(got, ref) < tol
    rounded = call(q, k, v, backend, alpha=torch.full(shape, GATE, dtype=torch.bfloat16))
    assert rel_rmse(rounded, ref) > 10 * tol, "a bf16 alpha should have lost the decay"


# ---- checked like alpha ---------------------------------------------------------------------

CHECKED = {
    "linear_attention": lambda q, k, v, **g: linear_attention(q, k, v, **g),
    "delta_rule": lambda q, k, v, **g: delta_rule(q, k, v, torch.full(q.shape[:3], 0.5), **g),
    "omega_rule": lambda q, k, v, **g: omega_rule(q, k, v, window=2, **g),
    "omega_rule (mlp)": lambda q, k, v, **g: omega_rule(q, k, v, window=2, memory="mlp", **g),
    "swla": lambda q, k, v, **g: swla(q, k, v, window=2, **g),
    "miras": lambda q, k, v, **g: miras(q, k, v, preset="titans", **g),
    "titans_linear_chunk": lambda q, k, v, **g: titans_linear_chunk(q, k, v, **g),
}


@pytest.mark.parametrize("name", list(CHECKED))
def test_log_alpha_is_checked_like_alpha(name):
    fn = CHECKED[name]
    q, k, v = random_qkv(1, 2, 6, 4, 4, seed=0)
    ok = torch.full((1, 2, 6), -0.1)
    fn(q, k, v, log_alpha=ok)
    with pytest.raises(ValueError, match="either as alpha or as log_alpha, not both"):
        fn(q, k, v, alpha=ok.exp(), log_alpha=ok)
    with pytest.raises(ValueError, match=r"log_alpha must lie in \[-inf, 0.0\]"):
        fn(q, k, v, log_alpha=torch.full((1, 2, 6), 0.01))
    with pytest.raises(ValueError, match="log_alpha contains NaN"):
        fn(q, k, v, log_alpha=torch.full((1, 2, 6), float("nan")))
    with pytest.raises(ValueError, match=r"log_alpha must have shape \[1, 2, 6\]"):
        fn(q, k, v, log_alpha=torch.full((1, 2, 5), -0.1))
    with pytest.raises(TypeError, match="log_alpha must be fp32 or fp64"):
        fn(q, k, v, log_alpha=ok.to(torch.bfloat16))
    fn(q, k, v, log_alpha=torch.full((1, 2, 6), -math.inf))      # alpha = 0: a full reset is allowed


NUMBER_GATES = ["linear_attention", "delta_rule", "omega_rule", "swla"]     # the ones that take a gate as a number


@pytest.mark.parametrize("name", NUMBER_GATES)
def test_log_alpha_as_a_number_is_alpha_as_its_exp(name):
    """log_alpha = x (a number, for every token) is alpha = e^x; x = 0.0, the gate 1 that keeps everything, included."""
    fn = CHECKED[name]
    q, k, v = random_qkv(1, 2, 6, 4, 4, seed=0, dtype=F64)
    for x in (0.0, -0.25):
        assert_close(fn(q, k, v, log_alpha=x)[0], fn(q, k, v, alpha=math.exp(x))[0], tol=1e-12, name=f"log_alpha={x}")
    with pytest.raises(ValueError, match="log_alpha must be <= 0"):
        fn(q, k, v, log_alpha=0.01)


def test_miras_refuses_log_alpha_where_the_retention_has_no_gate():
    q, k, v = random_qkv(1, 2, 6, 4, 4, seed=0)
    with pytest.raises(ValueError, match="log_alpha was given but retention='none'"):
        miras(q, k, v, preset="ttt_linear", log_alpha=torch.full((1, 2, 6), -0.1))


@pytest.mark.parametrize("backend", ["recurrent", "chunk"])
def test_a_number_gate_in_a_bf16_model_is_not_rounded(gen, backend):
    # alpha = 0.999 rounds to exactly 1.0 in bf16; given as a number it must become an fp32 gate
    # (``core.gates.retention_gates``), so the bf16 model forgets as the fp64 loop with 0.999 does
    B, H, T, K, V = 1, 2, 200, 8, 8
    q, k, v = (x.bfloat16() for x in random_qkv(B, H, T, K, V, generator=gen))
    assert torch.tensor(0.999).bfloat16().item() == 1.0
    o, s = linear_attention(q, k, v, alpha=0.999, output_final_state=True, backend=backend)
    alpha = torch.full((B, H, T), 0.999, dtype=torch.float64)
    ref_o, ref_s = linear_attention(q.double(), k.double(), v.double(), alpha=alpha, output_final_state=True,
                                    backend="recurrent")
    assert_close(o.double(), ref_o, tol=1e-2, name="o")
    assert_close(s.double(), ref_s, tol=1e-5, name="final state (fp32)")


@pytest.mark.parametrize("model", ["linear", "delta"])
def test_fp64_loop_takes_exp_of_an_fp32_log_alpha_in_fp64(gen, model):
    # fp64 inputs with an fp32 log_alpha: the chunk form uses the log as given (exact in fp64), the loop
    # multiplies by exp(log_alpha) computed in fp64: both agree to fp64 rounding, not just to fp32's
    B, H, T, K, V = 1, 2, 30, 6, 5
    q, k, v = random_qkv(B, H, T, K, V, dtype=torch.float64, generator=gen)
    log_alpha = (0.5 + 0.5 * torch.rand(B, H, T, K, generator=gen)).log()          # fp32
    beta = torch.rand(B, H, T, generator=gen, dtype=torch.float64)
    out = {}
    for backend in ("recurrent", "chunk"):
        if model == "linear":
            out[backend] = linear_attention(q, k, v, log_alpha=log_alpha, output_final_state=True,
                                            backend=backend, chunk_size=8)
        else:
            out[backend] = delta_rule(q, k, v, beta, log_alpha=log_alpha, output_final_state=True,
                                      backend=backend, chunk_size=8)
    assert_close(out["recurrent"][0], out["chunk"][0], tol=1e-12, name="o")
    assert_close(out["recurrent"][1], out["chunk"][1], tol=1e-12, name="final state")


# ---- fp32 chunk forms after resets ------------------------------------------------------------

def _kw(q, **g):
    return dict(eta=torch.full(q.shape[:3], 0.2, dtype=q.dtype), theta=torch.full(q.shape[:3], 0.5, dtype=q.dtype),
                **g)


# (call, per-channel gates, the per-token oracle the chunk form equals)
RESET_CASES = {
    "linear_attention": (lambda q, k, v, backend, b, **g: linear_attention(q, k, v, backend=backend, chunk_size=b,
                                                                           **g), False, "recurrent"),
    "linear_attention (GLA)": (lambda q, k, v, backend, b, **g: linear_attention(q, k, v, backend=backend,
                                                                                 chunk_size=b, **g),
                               True, "recurrent"),
    "delta_rule (KDA)": (lambda q, k, v, backend, b, **g: delta_rule(q, k, v, torch.full(q.shape[:3], 0.5,
                                                                                         dtype=q.dtype),
                                                                     backend=backend, chunk_size=b, **g),
                         True, "recurrent"),
    "omega_rule": (lambda q, k, v, backend, b, **g: omega_rule(q, k, v, window=3, eta=_kw(q)["eta"], backend=backend,
                                                               chunk_size=b, **g), False, "frozen_seq"),
    "swla": (lambda q, k, v, backend, b, **g: swla(q, k, v, window=3, backend=backend, chunk_size=b, **g),
             False, "recurrent"),
    "miras (titans)": (lambda q, k, v, backend, b, **g: miras(q, k, v, preset="titans", backend=backend,
                                                              chunk_size=b, **_kw(q, **g)), False, "frozen_seq"),
}


def _resets(gen, per_channel):
    """Gates [1, 2, 96(, 8)]: a quarter of them 0, the rest within 1e-3 of 1 (fp64)."""
    shape = (1, 2, 96, 8) if per_channel else (1, 2, 96)
    alpha = 1 - 1e-3 * torch.rand(shape, generator=gen, dtype=F64)
    alpha[torch.rand(shape, generator=gen) < 0.25] = 0.0
    return alpha


@pytest.mark.parametrize("name", list(RESET_CASES))
def test_fp32_chunk_forms_keep_their_digits_after_resets(gen, name):
    """A quarter of the gates 0 (resets, log-gate -60 once clamped), the rest within 1e-3 of 1: every later
    cumulative log-gate of the chunk lies far below 0, and fp32 differences of such sums lose digits (the
    chunk forms were 50x-100x further from the fp64 definition than the fp32 loop). The cumulative logs
    are fp64 (``core.chunking.cumulative_logs``): the fp32 chunk form is as close as the fp32 loop."""
    call, per_channel, oracle = RESET_CASES[name]
    b = 32
    q, k, v = random_qkv(1, 2, 96, 8, 8, generator=gen)
    alpha = _resets(gen, per_channel)
    ref = call(q.double(), k.double(), v.double(), oracle, b, alpha=alpha)[0]
    loop = rel_rmse(call(q, k, v, oracle, b, alpha=alpha.float())[0].double(), ref)
    chunk = rel_rmse(call(q, k, v, "chunk", b, alpha=alpha.float())[0].double(), ref)
    assert chunk < 2.5 * loop, f"fp32 chunk form {chunk:.2e} from the fp64 definition, the fp32 loop {loop:.2e}"


RESET_CASES_TRITON = {name: RESET_CASES[name] for name in ("linear_attention", "linear_attention (GLA)",
                                                             "delta_rule (KDA)", "omega_rule", "swla")}
RESET_CASES_TRITON["delta_rule (Gated DeltaNet)"] = (
    lambda q, k, v, backend, b, **g: delta_rule(q, k, v, torch.full(q.shape[:3], 0.5, dtype=q.dtype),
                                                backend=backend, chunk_size=b, **g), False, "recurrent")
WITH_BACKWARD_KERNELS = ("linear_attention", "linear_attention (GLA)", "delta_rule (KDA)",
                         "delta_rule (Gated DeltaNet)")


@pytest.mark.parametrize("name", list(RESET_CASES_TRITON))
def test_triton_kernels_keep_their_digits_after_resets(gen, name):
    """The kernels' forward after resets, as the chunk forms' above: fp32 inputs get fp64 chunk-local sums
    (``core.kernels.gate_sum_dtype``), differenced before rounding (with fp32 sums: 50x-150x the loop's error)."""
    call, per_channel, oracle = RESET_CASES_TRITON[name]
    q, k, v = random_qkv(1, 2, 96, 8, 8, generator=gen)
    alpha = _resets(gen, per_channel)
    ref = call(q.double(), k.double(), v.double(), oracle, 32, alpha=alpha)[0]
    loop = rel_rmse(call(q, k, v, oracle, 32, alpha=alpha.float())[0].double(), ref)
    kernel = rel_rmse(call(q, k, v, "triton", 32, alpha=alpha.float())[0].double(), ref)
    assert kernel < 2.5 * loop, f"fp32 Triton kernels {kernel:.2e} from the fp64 definition, the fp32 loop {loop:.2e}"


@pytest.mark.parametrize("name", WITH_BACKWARD_KERNELS)
def test_triton_backward_keeps_its_digits_after_resets(gen, name):
    """The same for the backward kernels: dq, dk, dv of a random projection of the outputs (with fp32 sums
    120x-170x the loop's error)."""
    call, per_channel, oracle = RESET_CASES_TRITON[name]
    q, k, v = random_qkv(1, 2, 96, 8, 8, generator=gen)
    alpha = _resets(gen, per_channel)
    w = torch.randn(1, 2, 96, 8, generator=gen, dtype=F64)

    def grads(dtype, backend):
        xs = [x.to(dtype).clone().requires_grad_() for x in (q, k, v)]
        (call(*xs, backend, 32, alpha=alpha.to(dtype))[0] * w.to(dtype)).sum().backward()
        return torch.cat([x.grad.double().flatten() for x in xs])
    ref = grads(F64, oracle)
    loop, kernel = rel_rmse(grads(torch.float32, oracle), ref), rel_rmse(grads(torch.float32, "triton"), ref)
    assert kernel < 2.5 * loop, f"fp32 Triton backward {kernel:.2e} from the fp64 definition, the fp32 loop {loop:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_channel", [False, True])
def test_kernels_get_chunk_local_sums_of_the_log_gates(gen, dtype, per_channel):
    """``chunk_local_log_gate``: the running sums restart at every chunk of BT tokens, the padding adds log-gate
    0, and the sums come in fp64 for fp32 inputs, fp32 (the fp64 sums rounded) for 16-bit ones."""
    from atlaslib.core.kernels import chunk_local_log_gate
    T, BT = 21, 8
    logs = -torch.rand((1, 2, T, 3) if per_channel else (1, 2, T), generator=gen) * 30
    g, Tp = chunk_local_log_gate(logs, BT, dtype)
    assert Tp == 24 and g.shape[2] == 24
    assert g.dtype == (torch.float64 if dtype == torch.float32 else torch.float32)
    padded = torch.cat([logs.double(), torch.zeros_like(logs[:, :, :3]).double()], dim=2)
    for c in range(3):
        ref = padded[:, :, c * BT:(c + 1) * BT].cumsum(2)
        assert torch.equal(g[:, :, c * BT:(c + 1) * BT], ref.to(g.dtype)), f"chunk {c}"


def test_atlas_chunk_form_keeps_its_digits_after_resets(gen):
    """The same for ATLAS (momentum and retention decays through ``core.chunking.chunk_decay``), zero gates
    in both; Newton-Schulz off (ns_steps=0), whose steps amplify the loop's own rounding 10x (1.3e-6)."""
    B_, H_, T_, b = 1, 2, 96, 32
    q, k, v = random_qkv(B_, H_, T_, 8, 8, generator=gen)

    def gate():
        g = 1 - 1e-3 * torch.rand(B_, H_, T_, generator=gen, dtype=F64)
        g[torch.rand(B_, H_, T_, generator=gen) < 0.25] = 0.0
        return g
    alpha, theta = gate(), gate()

    def run(dtype, backend):
        x = lambda t: t.to(dtype)                                    # noqa: E731
        return atlas(x(q), x(k), x(v), window=2, alpha=x(alpha), theta=x(theta), eta=torch.full((B_, H_, T_), 0.2,
                     dtype=dtype), backend=backend, chunk_size=b, ns_steps=0)[0].double()
    ref = run(F64, "frozen_seq")
    loop, chunk = rel_rmse(run(torch.float32, "frozen_seq"), ref), rel_rmse(run(torch.float32, "chunk"), ref)
    assert chunk < 2.5 * loop, f"fp32 chunk form {chunk:.2e} from the fp64 definition, the fp32 loop {loop:.2e}"


PRODUCTS = ("mm", "bmm", "baddbmm", "addmm", "linalg_solve_triangular", "einsum")


@pytest.mark.parametrize("name", list(RESET_CASES))
def test_fp64_cumulative_logs_never_reach_the_products(gen, name):
    """The fp64 log-gates are differenced and rounded before anything else sees them: with fp32 inputs
    every matrix product of the chunk form multiplies fp32 tensors (an fp64 decay matrix would promote
    the whole chunk to fp64, correct and several times slower)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    seen = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ in PRODUCTS:
                seen.append((func.overloadpacket.__name__, {a.dtype for a in args if isinstance(a, torch.Tensor)}))
            return func(*args, **(kwargs or {}))
    call, per_channel, _ = RESET_CASES[name]
    q, k, v = random_qkv(1, 2, 20, 8, 8, generator=gen)
    alpha = torch.rand((1, 2, 20, 8) if per_channel else (1, 2, 20), generator=gen)
    with Products():
        call(q, k, v, "chunk", 8, alpha=alpha)
    assert seen, "no matrix product was seen"
    assert all(dt == {torch.float32} for _, dt in seen), [s for s in seen if s[1] != {torch.float32}]
