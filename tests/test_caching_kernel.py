"""Chapter 7's Triton readout (``caching.kernel``) against the formula, written here in fp64.

y_t = gamma_s online_t + sum_i gamma_i M^(i) q_t over the cached states token t sees (its row of
``blocks``), with residual (all weights 1), GRM (softmax of <u_t, p_i> and r_s) or SSC (the same
softmax over the top_k scores and r_s). Odd sizes (T = 37, K = 24, V = 40), per-token different
sets of states in a random order with -1 padding anywhere, fresh random inputs each run.
"""
import pytest
import torch

from atlaslib.caching import cached_readout
from atlaslib.caching.kernel import MAX_KEY, SLOT_TILE, cached_readout_triton, kernel_limits
from atlaslib.core.testing import TOLERANCE, assert_close, assert_within_rounding

B, H, T, K, V, N, J = 1, 2, 37, 24, 40, 5, 6


def readout_reference(q, u, states, pooled, online, online_score, blocks, top_k, aggregate):
    """The readout token by token in fp64, from the definition."""
    q, u, states, pooled, online, online_score = (None if x is None else x.double()
                                                  for x in (q, u, states, pooled, online, online_score))
    y = torch.empty(*online.shape, dtype=torch.float64)
    for t in range(q.shape[2]):
        seen = [i for i in blocks[t].tolist() if i >= 0]
        reads = torch.einsum("bhnvk,bhk->bhnv", states[:, :, seen], q[:, :, t])          # M^(i) q_t
        if aggregate == "residual":
            y[:, :, t] = online[:, :, t] + reads.sum(2)
            continue
        r = torch.einsum("bhnk,bhk->bhn", pooled[:, :, seen], u[:, :, t])                 # <u_t, p_i>
        if aggregate == "ssc" and top_k is not None and top_k < len(seen):
            best = r.sort(dim=2, descending=True, stable=True).indices[..., :top_k]     # ties: the lowest slot
            kept = torch.zeros_like(r, dtype=torch.bool).scatter(2, best, True)
            r = r.masked_fill(~kept, float("-inf"))
        gamma = torch.softmax(torch.cat([r, online_score[:, :, t, None]], 2), 2)
        y[:, :, t] = gamma[..., -1:] * online[:, :, t] + (gamma[..., :-1, None] * reads).sum(2)
    return y


def random_blocks(gen, T=T, J=J, N=N):
    """[T, J]: each token a random set of distinct states (0 to J of them) in random order, -1 elsewhere."""
    blocks = torch.full((T, J), -1, dtype=torch.int64)
    for t in range(1, T):                       # token 0 sees no cached state
        n = int(torch.randint(0, min(J, N) + 1, (1,), generator=gen))
        states = torch.randperm(N, generator=gen)[:n]
        slots = torch.randperm(J, generator=gen)[:n]
        blocks[t, slots] = states
    blocks[T - 1, :min(J, N)] = torch.arange(min(J, N))   # one token sees every state
    return blocks


def random_inputs(gen, dtype=torch.float32, score_scale=1.0, N=N):
    """q and online as [B, T, H, C] views (read through their strides), the rest contiguous; N cached states."""
    q = torch.randn(B, T, H, K, generator=gen).to(dtype).transpose(1, 2)
    u = (score_scale * torch.randn(B, H, T, K, generator=gen)).to(dtype)
    states = torch.randn(B, H, N, V, K, generator=gen) / K ** 0.5
    pooled = torch.randn(B, H, N, K, generator=gen).to(dtype)
    online = torch.randn(B, T, H, V, generator=gen).to(dtype).transpose(1, 2)
    online_score = score_scale * torch.randn(B, H, T, generator=gen) * 2
    return q, u, states, pooled, online, online_score, random_blocks(gen, N=N)


CASES = [("residual", None), ("grm", None), ("ssc", 1), ("ssc", 2), ("ssc", J), ("ssc", 100), ("ssc", None)]


@pytest.mark.parametrize("aggregate,top_k", CASES)
def test_readout_matches_the_formula(gen, aggregate, top_k):
    inputs = random_inputs(gen)
    y = cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate)
    assert y.dtype == torch.float32 and y.shape == (B, H, T, V)
    assert_close(y, readout_reference(*inputs, top_k, aggregate), name=f"{aggregate} top_k={top_k}")


def test_soup_is_grm_as_in_the_pytorch_readout(gen):
    """The kernel takes the same arguments as ``cached_readout`` (its contract), soup included: over matrix
    memories the soup's parameters read q as GRM's states do."""
    inputs = random_inputs(gen)
    y = cached_readout_triton(*inputs, aggregate="soup")
    assert_close(y, readout_reference(*inputs, None, "grm"), name="soup vs the GRM formula")
    assert_close(y, cached_readout(*inputs, None, "soup"), name="soup vs cached_readout")


@pytest.mark.parametrize("aggregate,top_k", [("grm", None), ("ssc", 2), ("residual", None)])
def test_no_router_reads_with_q_as_in_the_pytorch_readout(gen, aggregate, top_k):
    """u=None scores the cached states with q, in the kernel as in ``cached_readout`` (its contract)."""
    q, _, states, pooled, online, online_score, blocks = random_inputs(gen)
    y = cached_readout_triton(q, None, states, pooled, online, online_score, blocks, top_k, aggregate)
    assert_close(y, readout_reference(q, q, states, pooled, online, online_score, blocks, top_k, aggregate),
                 name=f"{aggregate}: u=None vs the formula with u = q")


@pytest.mark.parametrize("top_k", [J - 1, J - 2])
def test_ssc_just_below_the_slots_drops_the_weakest_states(gen, top_k):
    # more cached states than slots, so some tokens see all J of them: SSC keeping J - 1 (or J - 2) must drop
    # the weakest there, not read them all as GRM
    inputs = random_inputs(gen, N=J + 2)
    blocks = inputs[-1]
    assert ((blocks >= 0).sum(1) == J).any()
    assert_close(cached_readout_triton(*inputs, top_k=top_k, aggregate="ssc"),
                 readout_reference(*inputs, top_k, "ssc"), name=f"ssc top_k={top_k}")


def test_residual_reads_only_the_states_and_online(gen):
    q, u, states, pooled, online, online_score, blocks = random_inputs(gen)
    y = cached_readout_triton(q, None, states, None, online, None, blocks, aggregate="residual")
    assert_close(y, readout_reference(q, u, states, pooled, online, online_score, blocks, None, "residual"))


def test_ssc_keeping_every_state_is_grm_and_keeping_one_is_not(gen):
    inputs = random_inputs(gen)
    grm = cached_readout_triton(*inputs, aggregate="grm")
    assert torch.equal(cached_readout_triton(*inputs, top_k=J, aggregate="ssc"), grm)
    assert (cached_readout_triton(*inputs, top_k=1, aggregate="ssc") - grm).abs().max() > 1e-3


@pytest.mark.parametrize("aggregate,top_k", [("grm", None), ("ssc", 2)])
def test_large_scores_stay_finite(gen, aggregate, top_k):
    # scores of order 1e3-1e4: exp without the max shift would overflow fp32
    inputs = random_inputs(gen, score_scale=300.0)
    y = cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate)
    assert torch.isfinite(y).all()
    assert_close(y, readout_reference(*inputs, top_k, aggregate))


@pytest.mark.parametrize("aggregate,top_k", [("residual", None), ("grm", None), ("ssc", 2)])
def test_bf16_inputs(gen, aggregate, top_k):
    inputs = random_inputs(gen, dtype=torch.bfloat16)
    y = cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate)
    assert y.dtype == torch.bfloat16
    # the reference reads the same bf16 inputs; SSC's selection can flip on near ties after
    # rounding the scores, so the tolerance is bf16's
    assert_close(y, readout_reference(*inputs, top_k, aggregate), tol=TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("aggregate,top_k", [("residual", None), ("grm", None), ("ssc", 2)])
def test_16_bit_products_cost_about_the_outputs_rounding(gen, dtype, aggregate, top_k):
    """16-bit queries meet the fp32 states rounded to their dtype (tensor-core products, fp32 sums): y is
    within a small multiple of what rounding it to that dtype costs (1.26x-1.39x over 12 draws in the
    interpreter, which rounds as a card does; a sum over the states rounded to 16 bits after each state,
    residual: 1.66x-2.07x)."""
    for _ in range(3):
        inputs = random_inputs(gen, dtype=dtype)
        y = cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate)
        assert_within_rounding(y.double(), readout_reference(*inputs, top_k, aggregate), dtype, 1.6)


def test_a_block_of_tokens_sharing_its_states(gen):
    # constant segments of 8 tokens: every token sees all earlier segments, in order
    Tc, Nc = 40, 5
    blocks = torch.full((Tc, Nc), -1, dtype=torch.int64)
    for t in range(Tc):
        blocks[t, :t // 8] = torch.arange(t // 8)
    q, u = torch.randn(2, B, H, Tc, K, generator=gen)
    states, pooled = torch.randn(B, H, Nc, V, K, generator=gen), torch.randn(B, H, Nc, K, generator=gen)
    online, score = torch.randn(B, H, Tc, V, generator=gen), torch.randn(B, H, Tc, generator=gen)
    inputs = (q, u, states, pooled, online, score, blocks)
    assert_close(cached_readout_triton(*inputs), readout_reference(*inputs, None, "grm"))


def log_linear_blocks(T):
    """[T, J]: token t reads the dyadic blocks of its prefix 0..t-1, largest first (37 = 32 + 4 + 1),
    each aligned block numbered once (a Fenwick tree's nodes); returns (blocks, number of blocks)."""
    index, rows = {}, []
    for t in range(T):
        start, row = 0, []
        for bit in reversed(range(t.bit_length())):
            if t >> bit & 1:
                row.append(index.setdefault((start, 2 ** bit), len(index)))
                start += 2 ** bit
        rows.append(row)
    J = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (J - len(r)) for r in rows]), len(index)


@pytest.mark.parametrize("aggregate,top_k", [("grm", None), ("ssc", 2)])
def test_log_linear_segments(gen, aggregate, top_k):
    # tokens of one block of 16 read different short blocks: many distinct states per program
    Tl = 67
    blocks, Nl = log_linear_blocks(Tl)
    assert blocks.shape[1] == 6 and Nl > 16
    q, u = torch.randn(2, B, H, Tl, K, generator=gen)
    states, pooled = torch.randn(B, H, Nl, V, K, generator=gen), torch.randn(B, H, Nl, K, generator=gen)
    online, score = torch.randn(B, H, Tl, V, generator=gen), torch.randn(B, H, Tl, generator=gen)
    inputs = (q, u, states, pooled, online, score, blocks)
    assert_close(cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate),
                 readout_reference(*inputs, top_k, aggregate))


@pytest.mark.parametrize("aggregate,top_k", [("residual", None), ("grm", None), ("ssc", 1), ("ssc", 3)])
def test_more_slots_than_one_tile(gen, aggregate, top_k):
    """J = 2 SLOT_TILE + 3 slots: three tiles (the last one partial) walked in a loop, each token a random
    set of states in random slots; scores spread wide, so the running max moves between tiles."""
    Tm, Jm, Nm = 20, 2 * SLOT_TILE + 3, 2 * SLOT_TILE + 8
    blocks = random_blocks(gen, T=Tm, J=Jm, N=Nm)
    q, u = torch.randn(2, B, H, Tm, K, generator=gen)
    u = 3 * u
    states = torch.randn(B, H, Nm, V, K, generator=gen) / K ** 0.5
    pooled = torch.randn(B, H, Nm, K, generator=gen)
    online, score = torch.randn(B, H, Tm, V, generator=gen), 3 * torch.randn(B, H, Tm, generator=gen)
    inputs = (q, u, states, pooled, online, score, blocks)
    assert_close(cached_readout_triton(*inputs, top_k=top_k, aggregate=aggregate),
                 readout_reference(*inputs, top_k, aggregate))


@pytest.mark.parametrize("aggregate", ["residual", "grm"])
def test_no_cached_state_gives_the_online_output(gen, aggregate):
    q, u, states, pooled, online, online_score, _ = random_inputs(gen)
    none = torch.empty(T, 0, dtype=torch.int64)
    assert torch.equal(cached_readout_triton(q, u, states, pooled, online, online_score, none, aggregate=aggregate),
                       online)


def test_bad_inputs_are_refused(gen):
    q, u, states, pooled, online, online_score, blocks = random_inputs(gen)
    args = (q, u, states, pooled, online, online_score)
    for top_k, error in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="top_k"):
            cached_readout_triton(*args, blocks, top_k=top_k, aggregate="ssc")
    with pytest.raises(ValueError, match="top_k"):
        cached_readout_triton(*args, blocks, top_k=2, aggregate="grm")
    with pytest.raises(ValueError, match="aggregate"):
        cached_readout_triton(*args, blocks, aggregate="average")
    with pytest.raises(ValueError, match=r"\[0, N=5\)"):
        cached_readout_triton(*args, blocks.clamp(max=N - 1) + 1)
    with pytest.raises(ValueError, match="blocks"):
        cached_readout_triton(*args, blocks[:-1])
    with pytest.raises(ValueError, match="pooled"):
        cached_readout_triton(q, u, states, None, online, online_score, blocks)
    with pytest.raises(ValueError, match="states"):
        cached_readout_triton(q, u, states[..., :-1], pooled, online, online_score, blocks)
    with pytest.raises(TypeError, match="float64"):
        cached_readout_triton(*(x.double() for x in args), blocks)
    with pytest.raises(ValueError, match=r"on q's device \(cpu\), got states on meta"):
        cached_readout_triton(q, u, states.to("meta"), pooled, online, online_score, blocks)


def test_unsupported_names_what_the_kernel_refuses():
    q, blocks = torch.zeros(1, 1, 4, K), torch.full((4, J), -1)
    assert kernel_limits(q, blocks) is None
    assert "fp64" in kernel_limits(q.double(), blocks)
    assert "K=" in kernel_limits(torch.zeros(1, 1, 4, MAX_KEY + 1), blocks)
    assert kernel_limits(q, torch.full((4, 4 * SLOT_TILE + 1), -1)) is None       # any number of slots
    assert "feature map" in kernel_limits(torch.zeros(1, 1, 4, 2 * K), blocks, u=q)


def test_a_base_with_a_feature_map_reads_without_the_kernel(gen):
    """A base whose feature map widens q (D = 2K here) gives the readout queries wider than the router u,
    which the kernel cannot read: the readout runs cached_readout (it raised on a GPU under "auto")."""
    from atlaslib.caching import memory_caching
    from atlaslib.omega import omega_rule
    q, k, v = (torch.randn(1, 2, 16, 4, generator=gen) / 2 for _ in range(3))
    kw = dict(base=omega_rule, segments=4, aggregate="grm",
              base_kwargs={"window": 1, "phi": lambda x: torch.cat([x, x * x], -1)})
    tri, _ = memory_caching(q, k, v, backend="triton", **kw)
    assert_close(tri, memory_caching(q, k, v, backend="chunk", **kw)[0], tol=1e-5, name="triton vs chunk")


@pytest.mark.parametrize("segments, aggregate, top_k", [(8, "soup", None), (8, "ssc", 2), ("log", "grm", None),
                                                         (2, "grm", None)])
def test_memory_caching_runs_the_kernel(monkeypatch, segments, aggregate, top_k):
    """memory_caching(backend="triton") == its recurrent form, the readout in the kernel every time: soup
    over matrix memories as GRM, and more cached states per token than one slot tile (segments of 2
    over 70 tokens: 34)."""
    import atlaslib.caching.kernel as kernel
    from atlaslib.caching import memory_caching
    from atlaslib.linear import linear_attention
    calls, real = [], kernel.cached_readout_triton
    monkeypatch.setattr(kernel, "cached_readout_triton", lambda *a: calls.append(a[6].shape[1]) or real(*a))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    q, k, v = (torch.randn(1, 2, 70, n, generator=gen) / 3 for n in (8, 8, 6))
    kw = dict(base=linear_attention, segments=segments, aggregate=aggregate, top_k=top_k, mode="independent",
              chunk_size=2 if segments == 2 else 8)
    tri, _ = memory_caching(q, k, v, backend="triton", **kw)
    assert len(calls) == 1 and (calls[0] > SLOT_TILE) == (segments == 2)
    ref, _ = memory_caching(q.double(), k.double(), v.double(), backend="recurrent", **kw)
    assert torch.allclose(tri.double(), ref, atol=1e-5, rtol=1e-4), (tri.double() - ref).abs().max()


@pytest.mark.parametrize("J", [6, 2 * SLOT_TILE + 3])
@pytest.mark.parametrize("top_k", [1, 2])
def test_ssc_ties_go_to_the_lowest_slot(gen, J, top_k):
    """Cached states in pairs with equal pooled keys (so equal scores) but different memories: which of a
    tied pair SSC keeps changes the output. J = 6: one slot tile; J = 2 tiles + 3: ties across tiles."""
    B, H, T, K, V = 1, 2, 20, 8, 5
    N = J + 2
    blocks = torch.full((T, J), -1, dtype=torch.int64)
    for t in range(1, T):
        n = int(torch.randint(2, J + 1, (1,), generator=gen))
        blocks[t, torch.randperm(J, generator=gen)[:n]] = torch.randperm(N, generator=gen)[:n]
    q, u = torch.randn(2, B, H, T, K, generator=gen)
    states = torch.randn(B, H, N, V, K, generator=gen)
    pooled = torch.randn(B, H, N, K, generator=gen)
    pooled[:, :, 1::2] = pooled[:, :, 0::2][:, :, :N // 2]                # states 2i and 2i + 1 tie
    online, score = torch.randn(B, H, T, V, generator=gen), torch.randn(B, H, T, generator=gen)
    inputs = (q, u, states, pooled, online, score, blocks)
    assert_close(cached_readout_triton(*inputs, top_k=top_k, aggregate="ssc"),
                 readout_reference(*inputs, top_k, "ssc"), name=f"SSC top_k={top_k}, J={J}")
