"""Chapter 7's graded exercises: every check passes a correct answer and rejects typical mistakes,
and the grader gives the solutions full marks, the student copy zero, and a planted wrong
answer exactly its exercise's points less.

The correct answers here are written from the math or the library, not copied from
exercises/solutions/ch07_caching.ipynb. TRITON_INTERPRET=1 is set by conftest.py before
triton is imported.
"""

import pytest
import torch
import triton
import triton.language as tl

from atlaslib.caching import cached_readout, dyadic_blocks, readout_weights
from atlaslib.exercises import ch07, registry
from grading_helpers import (TIMEOUT, assert_full_marks, assert_planted_loses_its_points, assert_student_scores_zero,
                             chapter_notebooks)

SOLUTION, STUDENT = chapter_notebooks("ch07_caching")
POINTS = {e.name: e.points for e in registry("ch07")}


def test_registered_with_five_exercises():
    assert list(POINTS) == ["dyadic", "grm_readout", "soup", "ssc_weights", "triton_grm_weights"]
    assert sum(POINTS.values()) == 12


# ---- exercise 1: the dyadic segments -------------------------------------------------------------

def segments_by_bits(t, order="largest", base=0, closed=False):
    """The blocks of t's binary expansion, walked from the top bit (or the lowest), with switchable slips."""
    bits = [b for b in range(t.bit_length()) if t >> b & 1]
    lengths = [1 << b for b in (reversed(bits) if order == "largest" else bits)]
    out, start = [], base
    for n in lengths:
        out.append((start, start + n - (1 if closed else 0)))
        start += n
    return out


def popcount(t):
    return bin(t).count("1")


def test_dyadic_passes_correct_answers():
    for segments, count in ((segments_by_bits, popcount), (dyadic_blocks, lambda t: len(dyadic_blocks(t))),
                            (lambda t: [list(b) for b in segments_by_bits(t)], lambda t: torch.tensor(popcount(t)))):
        v = ch07.dyadic.evaluate(segments, count)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(order="smallest"), "largest first"),                      # the lowest bit first
    (dict(base=1), "0-based half-open"),                             # 1-based starts
    (dict(closed=True), "expected"),                                 # closed [start, end] ranges
], ids=["smallest_first", "one_based", "closed_ranges"])
def test_dyadic_rejects_wrong_segments(kw, where):
    v = ch07.dyadic.evaluate(lambda t: segments_by_bits(t, **kw), popcount)
    assert v.status == "failed" and "dyadic_segments(" in v.message and where in v.message, v.message


@pytest.mark.parametrize("count", [
    lambda t: t.bit_length(),                                        # floor(log2 t) + 1: the bound, not the count
    lambda t: popcount(t - 1) if t > 1 else 1,                       # the 0-based index's bits
], ids=["bit_length", "zero_based"])
def test_dyadic_rejects_wrong_counts(count):
    v = ch07.dyadic.evaluate(segments_by_bits, count)
    assert v.status == "failed" and "segment_count(" in v.message and "is not right" in v.message, v.message


def test_dyadic_checks_positions_beyond_32_bits():
    v = ch07.dyadic.evaluate(lambda t: segments_by_bits(t % 2 ** 32 or t), popcount)
    assert v.status == "failed" and f"t={2 ** 53 - 1}" in v.message, v.message


def test_dyadic_catches_float_log2():
    import math

    def by_log2(t):            # the top bit from a float logarithm: wrong once t no longer fits a double
        out, start = [], 0
        while t > 0:
            n = 2 ** int(math.log2(t))
            out.append((start, start + n))
            start, t = start + n, t - n
        return out
    v = ch07.dyadic.evaluate(by_log2, popcount)
    assert v.status == "failed" and "t=" in v.message, v.message
    big = int(v.message.split("t=")[1].split("]")[0])
    assert big > 2 ** 52, v.message


# ---- exercises 2 and 3: one token's GRM readout and the soup ----------------------------------------

def grm_math(q, u, states, pooled, online, online_pool, include_online=True, shift=True, weights="softmax",
             transpose=False, shift_by_cached_only=False):
    """gamma = softmax(<u, p_i>, <u, p_s>); y = gamma_s online + sum_i gamma_i M^(i) q, with switchable slips."""
    r = torch.einsum("bhk,bhnk->bhn", u, pooled)
    r_s = (u * online_pool).sum(-1, keepdim=True)
    logits = torch.cat([r, r_s], dim=-1) if include_online else r
    if weights == "ones":
        gamma = torch.ones_like(logits)
    elif shift_by_cached_only and r.shape[-1]:                 # the largest *cached* score subtracted
        e = torch.exp(logits - r.amax(-1, keepdim=True))
        gamma = e / e.sum(-1, keepdim=True)
    elif shift:
        gamma = torch.softmax(logits, dim=-1)
    else:
        e = torch.exp(logits)
        gamma = e / e.sum(-1, keepdim=True)
    reads = torch.einsum("bhnkv,bhk->bhnv" if transpose else "bhnvk,bhk->bhnv", states, q)   # M^T q if transposed
    y = torch.einsum("bhn,bhnv->bhv", gamma[..., :r.shape[-1]], reads)
    return y + (gamma[..., -1:] * online if include_online else online)


def grm_by_library(q, u, states, pooled, online, online_pool):
    N = states.shape[2]
    r_s = (u * online_pool).sum(-1)
    return cached_readout(q[:, :, None], u[:, :, None], states, pooled, online[:, :, None], r_s[:, :, None],
                          torch.arange(N)[None], aggregate="grm")[:, :, 0]


def test_grm_readout_passes_correct_answers():
    for fn in (grm_math, grm_by_library):
        v = ch07.grm_readout.evaluate(fn)
        assert v.status == "passed" and v.earned == 3, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(include_online=False), "y: relative RMSE"),     # the softmax over the cached states only, online added as is
    (dict(weights="ones"), "y: relative RMSE"),           # residual memory, not GRM
    (dict(shift=False), "not finite"),                     # exp(100) in fp32
    (dict(shift_by_cached_only=True), "an online relevance of 100"),   # exp(99): the online score is the largest
], ids=["online_outside_softmax", "residual", "no_shift", "shift_by_the_cached_scores"])
def test_grm_readout_rejects_typical_mistakes(kw, where):
    v = ch07.grm_readout.evaluate(lambda *a: grm_math(*a, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_grm_readout_rejects_a_transposed_state():
    # M^T q needs K = V to run at all: the first case (K=5, V=7) raises, the square one would compare
    v = ch07.grm_readout.evaluate(lambda *a: grm_math(*a, transpose=True))
    assert v.status in ("failed", "error") and "N=4, K=5, V=7" in v.message, v.message


def weights_shifted_by_the_cached_maximum(u, pooled, online_pool):
    """GRM's weights, the softmax shifted by the larger of the largest cached relevance and the online one:
    right whenever a state is cached, an error (the maximum of no relevances) when none is."""
    r = torch.einsum("bhk,bhnk->bhn", u, pooled)
    r_s = (u * online_pool).sum(-1)
    m = torch.maximum(r.max(-1).values, r_s)
    e, e_s = torch.exp(r - m[..., None]), torch.exp(r_s - m)
    z = e.sum(-1) + e_s
    return e / z[..., None], e_s / z


def test_grm_readout_and_soup_check_a_token_with_nothing_cached():
    """A token of the first segment has no cached state (N = 0): both checks must meet one."""
    def grm(q, u, states, pooled, online, online_pool):
        w, g_s = weights_shifted_by_the_cached_maximum(u, pooled, online_pool)
        return torch.einsum("bhn,bhnvk,bhk->bhv", w, states, q) + g_s[..., None] * online

    def soup(q, u, states, pooled, online_state, online_pool):
        w, g_s = weights_shifted_by_the_cached_maximum(u, pooled, online_pool)
        M = torch.einsum("bhn,bhnvk->bhvk", w, states) + g_s[..., None, None] * online_state
        return M, torch.einsum("bhvk,bhk->bhv", M, q)
    for exercise, answer in ((ch07.grm_readout, grm), (ch07.soup, soup)):
        v = exercise.evaluate(answer)
        assert v.status == "error" and "N=0" in v.message and "no cached state" in v.message, v.message


def soup_math(q, u, states, pooled, online_state, online_pool, normalise=True, online=True):
    r = torch.einsum("bhk,bhnk->bhn", u, pooled)
    logits = torch.cat([r, (u * online_pool).sum(-1, keepdim=True)], dim=-1)
    gamma = torch.softmax(logits, dim=-1) if normalise else torch.ones_like(logits)
    M = torch.einsum("bhn,bhnvk->bhvk", gamma[..., :-1], states)
    if online:
        M = M + gamma[..., -1, None, None] * online_state
    return M, torch.einsum("bhvk,bhk->bhv", M, q)


def test_soup_passes_correct_answers():
    def through_grm(q, u, states, pooled, online_state, online_pool):     # y by reading each state, M by mixing
        M, _ = soup_math(q, u, states, pooled, online_state, online_pool)
        return M, grm_by_library(q, u, states, pooled, torch.einsum("bhvk,bhk->bhv", online_state, q), online_pool)
    for fn in (soup_math, through_grm):
        v = ch07.soup.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw", [dict(normalise=False), dict(online=False)], ids=["unweighted_sum", "no_online"])
def test_soup_rejects_typical_mistakes(kw):
    v = ch07.soup.evaluate(lambda *a: soup_math(*a, **kw))
    assert v.status == "failed" and "M_star: relative RMSE" in v.message, v.message


def test_soup_asks_for_both_results():
    v = ch07.soup.evaluate(lambda *a: soup_math(*a)[1])
    assert v.status == "failed" and "expected a tuple (M_star, y)" in v.message, v.message
    v = ch07.soup.evaluate(lambda *a: (soup_math(*a)[0], soup_math(*a)[0].sum(-1)))   # not M_star q
    assert v.status == "failed" and "y = M_star q" in v.message, v.message


# ---- exercise 4: SSC --------------------------------------------------------------------------------

def ssc_math(scores, online_score, top_k, renormalise=True, with_online=True, largest=True, k_shift=0):
    J = scores.shape[-1]
    k = J if top_k is None else min(top_k + k_shift, J)
    keep = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.topk(k, dim=-1, largest=largest).indices,
                                                              True) if k > 0 else torch.zeros_like(scores).bool()
    if renormalise:
        logits = scores.masked_fill(~keep, float("-inf"))
    else:
        logits = scores                                    # the softmax over all, then the unselected zeroed
    if with_online:
        p = torch.softmax(torch.cat([logits, online_score[..., None]], dim=-1), dim=-1)
        return p[..., :J] * keep, p[..., J]
    p = torch.softmax(logits, dim=-1) * keep
    return p, torch.zeros_like(online_score)


def test_ssc_weights_passes_correct_answers():
    def by_library(scores, online_score, top_k):
        B, H, T, J = scores.shape
        w, g = readout_weights(scores, torch.eye(J).expand(B, H, J, J), online_score,
                               torch.arange(J).expand(T, J), top_k, "ssc")
        return w, g
    for fn in (ssc_math, by_library):
        v = ch07.ssc_weights.evaluate(fn)
        assert v.status == "passed" and v.earned == 2, v.message


@pytest.mark.parametrize("kw, where", [
    (dict(renormalise=False), "relative RMSE"),            # GRM's weights with the dropped slots zeroed
    (dict(with_online=False), "relative RMSE"),            # the online memory left out of the softmax
    (dict(largest=False), "w: relative RMSE"),             # the least relevant states
    (dict(k_shift=-1), "w: relative RMSE"),                # top_k - 1: the online slot counted among the k
], ids=["not_renormalised", "no_online", "smallest", "k_minus_1"])
def test_ssc_weights_rejects_typical_mistakes(kw, where):
    v = ch07.ssc_weights.evaluate(lambda s, o, k: ssc_math(s, o, k, **kw))
    assert v.status == "failed" and where in v.message, v.message


def test_ssc_weights_rejects_an_unnormalised_online_weight():
    """w right, gamma_s = exp(s - m) not divided by the softmax's sum: gamma_s is checked on its own."""
    def unnormalised(scores, online_score, top_k):
        w, _ = ssc_math(scores, online_score, top_k)
        k = scores.shape[-1] if top_k is None else min(top_k, scores.shape[-1])
        m = torch.maximum(scores.topk(k, dim=-1).values.amax(-1), online_score)
        return w, torch.exp(online_score - m)
    v = ch07.ssc_weights.evaluate(unnormalised)
    assert v.status == "failed" and "gamma_s: relative RMSE" in v.message, v.message


def test_ssc_weights_must_take_top_k_none():
    v = ch07.ssc_weights.evaluate(lambda s, o, k: ssc_math(s, o, int(k)))
    assert v.status == "error" and "top_k=None" in v.message and "TypeError" in v.message, v.message


# ---- exercise 5: the Triton kernel ----------------------------------------------------------------

@triton.jit
def grm_weights_variants(u_ptr, p_ptr, b_ptr, r_ptr, w_ptr, g_ptr, T, S, K, J,
                         BT: tl.constexpr, BK: tl.constexpr, BJ: tl.constexpr, MASK_LOADS: tl.constexpr,
                         MASK_PAD: tl.constexpr, MASK_STORE: tl.constexpr, ONLINE: tl.constexpr,
                         SHIFT: tl.constexpr, MAX_ONLINE: tl.constexpr, G_ONE_PAST: tl.constexpr,
                         TABLE: tl.constexpr, ROWS_OF_BJ: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    c, j_ = tl.arange(0, BK), tl.arange(0, BJ)
    m_t = t < T
    m_c = c < K if MASK_LOADS else c < BK
    u = tl.load(u_ptr + i * T * K + t[:, None] * K + c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
    r = tl.zeros([BT, BJ], dtype=tl.float32) - float("inf")
    for j in range(J):
        if ROWS_OF_BJ == "blocks":                                         # a row of blocks taken as BJ long
            at = b_ptr + t * BJ + j
        else:
            at = b_ptr + t * J + j
        if TABLE == "unmasked":                                            # the padded tokens read past the table
            n = tl.load(at)
        elif TABLE == "no_other":                                          # their slots undefined, not -1
            n = tl.load(at, mask=m_t)
        else:
            n = tl.load(at, mask=m_t, other=-1)
        m_n = n >= 0 if MASK_PAD else m_t
        if TABLE == "unmasked":
            m_n = m_n & m_t
        p = tl.load(p_ptr + i * S * K + n[:, None] * K + c[None, :], mask=m_n[:, None] & m_c[None, :], other=0.0)
        r_j = tl.sum(u * p, axis=1)
        if MASK_PAD:
            r_j = tl.where(m_n, r_j, float("-inf"))
        r = tl.where(j_[None, :] == j, r_j[:, None], r)
    s = tl.load(r_ptr + i * T + t, mask=m_t, other=0.0)
    if not ONLINE:
        s = s * 0.0 - float("inf")
    m = tl.maximum(tl.max(r, axis=1), s) if SHIFT else tl.zeros([BT], dtype=tl.float32)
    if not MAX_ONLINE:                                                     # the maximum over the cached slots only
        m = tl.where(tl.max(r, axis=1) > float("-inf"), tl.max(r, axis=1), s)
    if not ONLINE:
        m = tl.max(r, axis=1)
    e, e_s = tl.exp(r - m[:, None]), tl.exp(s - m)
    z = tl.sum(e, axis=1) + e_s
    m_j = j_ < J if MASK_STORE else j_ < BJ
    if ROWS_OF_BJ == "w":                                                  # a row of w taken as BJ long
        at_w = w_ptr + i * T * BJ + t[:, None] * BJ + j_[None, :]
    else:
        at_w = w_ptr + i * T * J + t[:, None] * J + j_[None, :]
    tl.store(at_w, e / z[:, None], mask=m_t[:, None] & m_j[None, :])
    tl.store(g_ptr + i * T + t, e_s / z, mask=t <= T if G_ONE_PAST else m_t)      # t <= T: one entry too many


def grm_launcher(mask_loads=True, mask_pad=True, mask_store=True, online=True, shift=True, max_online=True,
                 g_one_past=False, table="masked", rows_of_bj=""):
    def launch(u, pooled, blocks, online_score, w, g):
        N, T, K = u.shape
        S, J = pooled.shape[1], blocks.shape[1]
        BT, BK, BJ = 16, max(16, triton.next_power_of_2(K)), max(2, triton.next_power_of_2(J))
        grm_weights_variants[(N, triton.cdiv(T, BT))](u, pooled, blocks, online_score, w, g, T, S, K, J, BT=BT, BK=BK,
                                                      BJ=BJ, MASK_LOADS=mask_loads, MASK_PAD=mask_pad,
                                                      MASK_STORE=mask_store, ONLINE=online, SHIFT=shift,
                                                      MAX_ONLINE=max_online, G_ONE_PAST=g_one_past, TABLE=table,
                                                      ROWS_OF_BJ=rows_of_bj)
    return launch


def test_triton_check_passes_a_correct_kernel():
    v = ch07.triton_grm_weights.evaluate(grm_launcher())
    assert v.status == "passed" and v.earned == 3, v.message


def test_triton_check_requires_a_kernel_launch():
    def plain_torch(u, pooled, blocks, online_score, w, g):
        w_ref, g_ref = readout_weights(u[:, None], pooled[:, None], online_score[:, None], blocks.long())
        w.copy_(w_ref[:, 0])
        g.copy_(g_ref[:, 0])
    v = ch07.triton_grm_weights.evaluate(plain_torch)
    assert v.status == "failed" and "without launching a @triton.jit kernel" in v.message, v.message


def test_triton_check_catches_unmasked_loads():
    v = ch07.triton_grm_weights.evaluate(grm_launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message, v.message


def test_triton_check_catches_unmasked_padding_slots():
    v = ch07.triton_grm_weights.evaluate(grm_launcher(mask_pad=False))
    assert v.status == "failed" and "before the start of argument 2" in v.message and "slot of -1" in v.message, \
        v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch07.triton_grm_weights.evaluate(grm_launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message, v.message


def test_triton_check_catches_a_store_past_the_end_of_gamma_s():
    """gamma_s's store mask t <= T: each row stores one entry past its end, the last row past the end of
    gamma_s."""
    v = ch07.triton_grm_weights.evaluate(grm_launcher(g_one_past=True))
    assert v.status == "failed" and "past the end of gamma_s" in v.message, v.message


@pytest.mark.parametrize("rows_of", ["w", "blocks"])
def test_triton_check_catches_rows_taken_as_block_size_long(rows_of):
    """A row of w or of blocks is J long; BJ is J rounded up to a power of two: a case has J = 3."""
    v = ch07.triton_grm_weights.evaluate(grm_launcher(rows_of_bj=rows_of))
    assert v.status == "failed" and "J=3 slots" in v.message, v.message


def test_triton_check_catches_an_unmasked_load_of_the_table():
    """The padded tokens' slots read past the end of blocks, then masked: the table is guarded as well."""
    v = ch07.triton_grm_weights.evaluate(grm_launcher(table="unmasked"))
    assert v.status == "failed" and "past the end of argument 3" in v.message, v.message


def test_triton_check_catches_a_gather_through_undefined_slots():
    """The table loaded without other=-1: the padded tokens' slots are undefined (the largest int here), and the
    rows of pooled they index lie outside every tensor. The load is refused (a real one may crash the process)."""
    v = ch07.triton_grm_weights.evaluate(grm_launcher(table="no_other"))
    assert v.status == "failed" and "outside every tensor" in v.message and "other=-1" in v.message, v.message


def test_triton_check_catches_the_missing_online_slot():
    v = ch07.triton_grm_weights.evaluate(grm_launcher(online=False))
    assert v.status == "failed" and ("w: relative RMSE" in v.message or "not finite" in v.message), v.message


def test_triton_check_catches_an_unshifted_softmax():
    v = ch07.triton_grm_weights.evaluate(grm_launcher(shift=False))
    assert v.status == "failed" and "overflows fp32" in v.message and "scores of about 100" in v.message, v.message


# ---- the rules: the library's answers are off limits ----------------------------------------------

@pytest.mark.library_rules
def test_answers_that_call_the_library_fail():
    import atlaslib.caching as caching_package        # as a notebook reaches it: through a module, not a closure
    v = ch07.dyadic.evaluate(lambda t: caching_package.dyadic_blocks(t), popcount)
    assert v.status == "failed" and "your answer calls atlaslib.caching.segments.dyadic_blocks" in v.message, v.message
    v = ch07.dyadic.evaluate(segments_by_bits, lambda t: len(caching_package.make_layout(t, "log").visible[-1]) + 1)
    assert v.status == "failed" and "atlaslib.caching.segments.make_layout" in v.message, v.message
    v = ch07.grm_readout.evaluate(lambda q, u, M, p, o, po: caching_package.cached_readout(
        q[:, :, None], u[:, :, None], M, p, o[:, :, None], (u * po).sum(-1)[:, :, None],
        torch.arange(M.shape[2])[None])[:, :, 0])
    assert v.status == "failed" and "atlaslib.caching.chunk.cached_readout" in v.message, v.message
    assert ch07.grm_readout.evaluate(grm_math).status == "passed"
    v = ch07.ssc_weights.evaluate(lambda s, o, k: caching_package.readout_weights(
        s, torch.eye(s.shape[-1]).expand(*s.shape[:2], -1, -1), o, torch.arange(s.shape[-1]).expand(s.shape[2], -1),
        k, "ssc"))
    assert v.status == "failed" and "atlaslib.caching.chunk.readout_weights" in v.message, v.message


# ---- the grader on chapter 7 ----------------------------------------------------------------------

def test_solutions_score_full_marks():
    assert_full_marks(SOLUTION, POINTS, TIMEOUT)


def test_untouched_student_notebook_scores_zero_via_cli():
    assert_student_scores_zero(STUDENT, POINTS, TIMEOUT)


def test_planted_residual_grm_loses_exactly_its_points(tmp_path):
    # every gamma 1: residual memory instead of GRM
    body = "return online + torch.einsum('bhnvk,bhk->bhv', states, q)"
    assert_planted_loses_its_points(SOLUTION, tmp_path, "grm_readout", body, POINTS)


def test_triton_check_always_catches_a_maximum_over_the_cached_slots_only():
    for _ in range(3):           # not a matter of luck: a case makes the online score the largest by far
        v = ch07.triton_grm_weights.evaluate(grm_launcher(max_online=False))
        assert v.status == "failed" and "online scores of about 100" in v.message, v.message


def test_an_unmasked_load_of_row_minus_one_is_named_when_nothing_is_cached():
    from atlaslib.caching import make_layout
    from atlaslib.exercises.checking import guarded, guarded_output, run_under_rules
    layout = make_layout(1, "log")                               # one token: S = 0 cached states
    blocks = layout.blocks().to(torch.int32).contiguous()
    assert len(layout.cached) == 0 and blocks.shape[1] >= 1 and (blocks == -1).all()
    u, pooled, score = guarded(torch.randn(1, 1, 4)), guarded(torch.randn(1, 0, 4)), guarded(torch.randn(1, 1))
    w, g = guarded_output((1, 1, blocks.shape[1])), guarded_output((1, 1))
    args = (u, pooled, blocks, score, w, g)
    with pytest.raises(Exception, match=r"loaded \d+ value.s. before the start of argument 2"):   # no crash, named
        run_under_rules(grm_launcher(mask_pad=False), args, {}, (), outputs=(4, 5))
