"""Chapter 4 token mixers (OmegaNet with a linear memory, SWLA) and chapter 4's bench rows.

The mixers are checked against a per-token loop written out here from the definition
(gradient of the window loss by autograd), not against atlaslib.omega.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from atlaslib import bench
from atlaslib.core.testing import assert_causal_mixer
from atlaslib.nn import TinyLM, available_mixers, make_mixer
from atlaslib.nn.omega_mixers import OmegaNet, SWLA
from mixer_helpers import projections, seeded

CONFIGS = [
    ("omeganet", {}),
    ("omeganet", {"gamma": "source"}),
    ("omeganet", {"gamma": None, "retention": "none"}),
    ("omeganet", {"degree": 2}),
    ("omeganet", {"degree": 2, "poly": "monomial", "window": 3}),
    ("omeganet", {"degree": 2, "constant": False}),
    ("swla", {}),
    ("swla", {"gamma": "source", "degree": 2}),
]


def test_registered():
    assert {"omeganet", "swla"} <= set(available_mixers())


@pytest.mark.parametrize("name, kw", CONFIGS)
def test_shape_causality_and_grad(gen, name, kw):
    seeded(gen)
    mixer = make_mixer(name, 24, 3, backend="chunk", chunk_size=4, **kw)
    assert_causal_mixer(mixer, torch.randn(2, 13, 24, generator=gen, requires_grad=True), 6, gen)


def test_gates_ranges_and_shapes():
    x = torch.randn(2, 5, 32)
    m = make_mixer("omeganet", 32, 4, window=6)
    g, a, e = m.gammas(x), m.alpha(x), m.eta(x)
    assert g.shape == (2, 4, 5, 6) and ((g > 0) & (g < 1)).all()
    assert a.shape == (2, 4, 5) and ((a > 0) & (a < 1)).all()
    # the step bound of the Omega rule: eta_t * c < 1 < 2 for unit features
    assert e.shape == (2, 4, 5) and ((e > 0) & (e * 6 < 1)).all()
    s = make_mixer("omeganet", 32, 4, window=6, gamma="source", retention="none")
    assert s.gammas(x).shape == (2, 4, 5) and s.alpha(x) is None
    assert make_mixer("omeganet", 32, 4, gamma=None).gammas(x) is None
    w = make_mixer("swla", 32, 4, window=6)
    assert ((w.eta(x) > 0) & (w.eta(x) < 1)).all() and w.eta(x).max() > 1 / 6


def test_state_sizes():
    assert make_mixer("omeganet", 32, 4).state_size == 4 * 8 * 8
    assert make_mixer("swla", 32, 4, head_k_dim=6).state_size == 4 * 6 * 8
    # polynomial features of degree p: D = C(d_k + p, p) feature channels per head
    m = make_mixer("omeganet", 32, 4, head_k_dim=4, degree=2)
    assert m.state_size == 4 * math.comb(6, 2) * 8 == 4 * 15 * 8
    assert make_mixer("omeganet", 32, 4, head_k_dim=4, degree=3, poly="monomial").state_size == 4 * 35 * 8
    assert m(torch.randn(1, 5, 32)).shape == (1, 5, 32)
    # without the constant feature: one channel less, for both maps
    for poly in ("taylor", "monomial"):
        nc = make_mixer("omeganet", 32, 4, head_k_dim=4, degree=2, poly=poly, constant=False)
        assert nc.state_size == 4 * 14 * 8
        fq, fk = nc.features(*torch.randn(2, 1, 1, 3, 4))
        assert fk.shape[-1] == 14 and torch.allclose(fk.norm(dim=-1), torch.ones(1, 1, 3))
    lm = TinyLM(50, 32, 2, "omeganet", 4, head_k_dim=4, degree=2)
    assert lm.state_size == 2 * 4 * 15 * 8
    # the window of c pairs is not state: it does not change the size
    assert make_mixer("omeganet", 32, 4, window=64).state_size == make_mixer("omeganet", 32, 4, window=1).state_size


def test_features_without_constant_keep_the_kernel_of_the_rest():
    """Taylor map without a_0: phi(x).phi(y) is proportional to (x.y) + (x.y)^2 / 2 for unit x, y."""
    m = make_mixer("omeganet", 32, 4, head_k_dim=5, degree=2, constant=False)
    x, y = F.normalize(torch.randn(2, 7, 5, dtype=torch.float64), dim=-1)
    m.poly.double()
    fx, fy = m.features(x, y)
    s = (x * y).sum(-1)
    assert torch.allclose((fx * fy).sum(-1), (s + s**2 / 2) / 1.5, atol=1e-6)


def test_each_layer_has_its_own_taylor_coefficients():
    lm = TinyLM(50, 32, 2, "omeganet", 4, degree=2)
    a, b = (blk.mixer.poly.raw for blk in lm.blocks)
    assert a is not b


# ---- against an independent per-token loop ----------------------------------------------------

def window_loop(q, k, v, gam, alpha, eta, c, hebbian, per_offset):
    """M_t = alpha_t M_{t-1} - eta_t grad_M sum_{i in window} gamma_i^(t) loss_i(M) at M_{t-1}, y_t = M_t q_t.

    loss_i = 1/2 ||M k_i - v_i||^2 (OmegaNet) or -<M k_i, v_i> (SWLA); gradients by autograd.
    """
    B, H, T, D = q.shape
    M = torch.zeros(B, H, v.shape[-1], D, dtype=torch.float64)
    q, k, v, gam, alpha, eta = (t.detach().double() for t in (q, k, v, gam, alpha, eta))
    out = []
    for t in range(T):
        Mv = M.clone().requires_grad_(True)
        loss = 0.0
        for i in range(max(0, t - c + 1), t + 1):
            w = gam[:, :, t, t - i] if per_offset else gam[:, :, i, 0]
            pred = torch.einsum("bhvd,bhd->bhv", Mv, k[:, :, i])
            li = -(pred * v[:, :, i]).sum(-1) if hebbian else 0.5 * (pred - v[:, :, i]).square().sum(-1)
            loss = loss + (w * li).sum()
        (grad,) = torch.autograd.grad(loss, Mv)
        M = alpha[:, :, t, None, None] * M - eta[:, :, t, None, None] * grad
        out.append(torch.einsum("bhvd,bhd->bhv", M, q[:, :, t]))
    return torch.stack(out, 2)


@pytest.mark.parametrize("name, kw", [("omeganet", {}), ("omeganet", {"gamma": "source", "degree": 2}),
                                      ("swla", {"window": 3}), ("swla", {"gamma": "source"})])
def test_mixer_is_the_windowed_rule(gen, name, kw):
    """Without the convolution, the mixer is o_proj of the per-token rule on its own projections."""
    seeded(gen)
    m = make_mixer(name, 12, 2, conv_size=0, qk_norm=True, backend="recurrent", head_k_dim=3, **kw)
    x = torch.randn(2, 11, 12, generator=gen)
    q, k, v, gam, alpha, eta = projections(m, x)
    y = window_loop(q, k, v, gam, alpha, eta, m.window, hebbian=name == "swla",
                    per_offset=m.gamma_mode == "offset")
    B, H, T, V = y.shape
    expected = m.o_proj(y.transpose(1, 2).reshape(B, T, H * V).float())
    with torch.no_grad():
        assert torch.allclose(m(x), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [{}, {"gamma": "source"}, {"degree": 2}])
def test_omeganet_chunk_size_one_equals_recurrent(gen, kw):
    seeded(gen)
    m = make_mixer("omeganet", 16, 2, backend="recurrent", **kw)
    x = torch.randn(2, 15, 16, generator=gen)
    ref = m(x)
    m.backend, m.chunk_size = "chunk", 1
    assert torch.allclose(m(x), ref, atol=1e-5, rtol=1e-4)
    # chunk size > 1 freezes the gradients at each chunk's start: a different model
    m.chunk_size = 8
    assert not torch.allclose(m(x), ref, atol=1e-4, rtol=1e-3)


def test_swla_chunk_equals_recurrent_for_every_chunk_size(gen):
    seeded(gen)
    m = make_mixer("swla", 16, 2, backend="recurrent", window=5)
    x = torch.randn(2, 19, 16, generator=gen)
    ref = m(x)
    m.backend = "chunk"
    for b in (1, 4, 7, 64):
        m.chunk_size = b
        assert torch.allclose(m(x), ref, atol=1e-5, rtol=1e-4), b


def test_triton_backend_matches_chunk(gen):
    seeded(gen)
    m = make_mixer("omeganet", 16, 2, backend="chunk", chunk_size=4, window=3)
    x = torch.randn(1, 9, 16, generator=gen)
    ref = m(x)
    m.backend = "triton"
    assert torch.allclose(m(x), ref, atol=1e-5, rtol=1e-4)


def test_defaults_and_bad_arguments():
    assert isinstance(make_mixer("omeganet", 16, 2), OmegaNet) and isinstance(make_mixer("swla", 16, 2), SWLA)
    m = make_mixer("omeganet", 16, 2)
    assert m.chunk_size == 16 and m.qk_norm and m.eta_max == pytest.approx(1 / 8)
    assert make_mixer("swla", 16, 2).eta_max == 1.0
    with pytest.raises(ValueError, match="window must be >= 1"):
        make_mixer("omeganet", 16, 2, window=0)
    with pytest.raises(TypeError, match="window"):
        make_mixer("swla", 16, 2, window=2.0)
    with pytest.raises(ValueError, match="gamma must be one of"):
        make_mixer("omeganet", 16, 2, gamma="per_token")
    for name in ("omeganet", "swla", "dot", "deep_transformer", "swdt"):   # the MIRAS axis names, as chapter 3's
        for bad in (False, True, "kl"):
            with pytest.raises(ValueError, match="retention must be 'decay'"):
                make_mixer(name, 16, 2, retention=bad)
        assert make_mixer(name, 16, 2, retention="none").gate_proj is None
        assert make_mixer(name, 16, 2).gate_proj is not None and make_mixer(name, 16, 2).retention == "decay"
    with pytest.raises(ValueError, match="poly must be one of"):
        make_mixer("omeganet", 16, 2, degree=2, poly="hermite")
    with pytest.raises(ValueError, match="degree must be >= 0"):
        make_mixer("swla", 16, 2, degree=-1)
    with pytest.raises(ValueError, match="eta_max must be a finite number > 0"):
        make_mixer("omeganet", 16, 2, eta_max=0.0)


# ---- chapter 4's bench rows ---------------------------------------------------------------------

def test_bench_rows():
    bench.load_chapter_cases()
    rows = ["omega", "swla", "omega_c1", "omega_c4", "omega_c16", "omega_c64"]
    assert set(rows) <= set(bench.BENCH_CASES)
    assert bench.BENCH_CASES["omega"].backends == ("recurrent", "chunk", "triton")
    assert bench.BENCH_CASES["omega_c64"].backends == ("chunk", "triton")
    out = bench.run_benchmarks(rows, [12], B=1, H=2, K=5, V=3, chunk_size=4, warmup=0, repeats=1, progress=False)
    got = {(r["model"], r["backend"]) for r in out}
    assert got == {("omega", "recurrent"), ("omega", "chunk"), ("swla", "recurrent"), ("swla", "chunk")} | \
        {(f"omega_c{c}", "chunk") for c in (1, 4, 16, 64)}
    assert all(r["time_ms"] >= 0 and r["peak_MiB"] >= 0 for r in out)
    # the FLOP count of the chunk form grows with the window c
    s = bench.BenchShape(1, 4, 4096, 64, 64)
    flops = [bench.BENCH_CASES[f"omega_c{c}"].flops(s) for c in (1, 4, 16, 64)]
    assert flops == sorted(flops) and flops[0] < flops[-1]


def test_bench_case_runs_the_rule_it_names(gen):
    """The row's call is omega_rule / swla on its inputs: chunk(1) == recurrent for omega, and chunk(4) is
    not (frozen gradients), while SWLA's chunk form is exact for every chunk length."""
    bench.load_chapter_cases()
    seed = int(torch.randint(0, 2**31 - 1, (), generator=gen))
    omega = {b: bench.BENCH_CASES["omega"].builder(bench.BenchShape(1, 2, 10, 4, 3, chunk_size=b),
                                                   torch.Generator().manual_seed(seed)) for b in (1, 4)}
    assert torch.allclose(omega[1]("chunk")[0], omega[1]("recurrent")[0], atol=1e-5)
    assert not torch.allclose(omega[4]("chunk")[0], omega[4]("recurrent")[0], atol=1e-3)
    call = bench.BENCH_CASES["swla"].builder(bench.BenchShape(1, 2, 10, 4, 3, chunk_size=4), gen)
    assert torch.allclose(call("chunk")[0], call("recurrent")[0], atol=1e-5)


@pytest.mark.parametrize("name", ["omeganet", "swla", "atlas"])
@pytest.mark.parametrize("poly", ["taylor", "monomial"])
def test_a_polynomial_map_without_features_is_refused_when_built(name, poly):
    """degree=0 without the constant leaves D = 0 features: refused by the constructor (naming both
    arguments), not at the first forward; a negative degree too, whichever map."""
    with pytest.raises(ValueError, match=r"degree=0 with constant=False leaves no feature"):
        make_mixer(name, 16, 2, degree=0, constant=False, poly=poly)
    with pytest.raises(ValueError, match="degree must be >= 0, got -1"):
        make_mixer(name, 16, 2, degree=-1, poly=poly)
    assert make_mixer(name, 16, 2, degree=0, poly=poly).feature_dim() == 1          # the constant alone
