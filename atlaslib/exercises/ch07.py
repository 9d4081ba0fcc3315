"""Checks for chapter 7's exercises (exercises/ch07_caching.ipynb): Memory Caching's segments and readouts.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib.caching`` (the log-linear segmentation ``dyadic_blocks``; the weights of the cached
states ``readout_weights`` and the readout of matrix memories ``cached_readout``, the contract of
the chapter's Triton kernel), then shows a verdict. Use in a notebook as::

    from atlaslib.exercises import ch07 as check
    check.grm_readout(grm_readout)
"""
from __future__ import annotations

import torch

from ..caching import cached_readout, dyadic_blocks, make_layout, readout_weights
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, CheckFailed, Registry, call, case, check_guards, check_shape, compare,
                       compare_finite, compare_number, guarded, guarded_output, unpack)

EXERCISES = Registry("ch07")

# fp32 inputs; a correct answer agrees to ~1e-6, a wrong one is off by far more.
TOL = 1e-4

# Everything in the library that weighs or reads the cached states for the learner (exercises 2 to 5)
READOUTS = ("atlaslib.caching.memory_caching", "atlaslib.caching.log_linear_pp",
            "atlaslib.caching.chunk.memory_caching_chunk", "atlaslib.caching.chunk.cached_readout",
            "atlaslib.caching.chunk.readout_weights", "atlaslib.caching.chunk.weighted_reads",
            "atlaslib.caching.recurrent.memory_caching_recurrent", "atlaslib.caching.recurrent.token_weights",
            "atlaslib.caching.recurrent.weights_at", "atlaslib.caching.recurrent.caching_step",
            "atlaslib.caching.kernel.cached_readout_triton", "atlaslib.caching.kernel_readout")

OVERFLOW_HINT = (" (exp of a score above 88.7 overflows fp32: subtract the largest score of the softmax, the "
                 "online one included, before exp; the factor cancels)")


# A kernel's output that is not finite: an overflow, or NaN read from outside an input
KERNEL_HINT = (f".{NAN_HINT} A slot of -1 is padding: mask its load of pooled (row -1 lies before the start) "
               "and give it the score -inf. A score above 88.7 makes exp overflow fp32: subtract each row's "
               "largest score, the online one included, before exp.")


# ---- exercise 1 ------------------------------------------------------------------------------------

def _as_blocks(got, t):
    """The learner's segments as a list of (start, end) int pairs, or a CheckFailed saying why not."""
    if not isinstance(got, (list, tuple)):
        raise CheckFailed(f"dyadic_segments({t}) should return a list of (start, end) pairs, got {type(got).__name__}")
    out = []
    for pair in got:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise CheckFailed(f"dyadic_segments({t}) should hold (start, end) pairs, got an entry {pair!r}")
        try:
            out.append(tuple(int(x) for x in pair))
        except (TypeError, ValueError):
            raise CheckFailed(f"dyadic_segments({t}) has an entry {pair!r} that is not a pair of ints") from None
    return out


def _show(blocks, most=6):
    text = ", ".join(f"({a}, {b})" for a, b in blocks[:most])
    return f"[{text}{', ...' if len(blocks) > most else ''}]"


def _segments_hint(got, want):
    if sorted(got) == sorted(want):
        return " (the right blocks in the wrong order: largest first, so the starts increase)"
    if [b - a for a, b in got] == [b - a for a, b in want]:
        return " (the right lengths at the wrong places: 0-based half-open ranges, consecutive from 0)"
    if sorted(b - a for a, b in got) == sorted(b - a for a, b in want):
        return " (the right lengths in the wrong order: largest first)"
    return ""


@EXERCISES.check("dyadic", title="The log-linear segments of a position", points=2,
                  functions=("dyadic_segments", "segment_count"),
                  forbidden=("atlaslib.caching.segments.dyadic_blocks", "atlaslib.caching.segments.log_layout",
                             "atlaslib.caching.segments.make_layout"))
def dyadic(segments_fn, count_fn, gen):
    """segments_fn(t) -> [(start, end), ...] (0-based half-open, largest first) for a 1-based position t;
    count_fn(t) -> how many there are."""
    # above 2^53 a float (math.log2, 2.0 ** b) cannot hold every position: only integer arithmetic is right
    draws = (torch.randint(1, 2 ** 40, (6,), generator=gen, dtype=torch.int64).tolist()
             + torch.randint(2 ** 53, 2 ** 62, (6,), generator=gen, dtype=torch.int64).tolist())
    positions = ([*range(1, 41)] + [2 ** n for n in (6, 7, 10, 31, 53, 62)]
                 + [2 ** n - 1 for n in (6, 7, 10, 31, 53, 62)] + [37, 100, 1000, 12345] + draws)
    for t in positions:
        want = dyadic_blocks(t)
        with case(f"t={t}"):
            got = _as_blocks(call(segments_fn, t), t)
            if got != want:
                raise CheckFailed(f"dyadic_segments({t}) = {_show(got)}, expected {_show(want)}"
                                  f"{_segments_hint(got, want)}")
            compare_number(f"segment_count({t})", call(count_fn, t), len(want))
    return (f"the segments and their number are right at {len(positions)} positions, powers of two and "
            "2^n - 1 included")


# ---- exercises 2 and 3: one token's readout -------------------------------------------------------

def _token_inputs(B, H, N, K, V, gen, large=False):
    """q, u [B,H,K]; states [B,H,N,V,K]; pooled [B,H,N,K]; the online state [B,H,V,K] and pooled key [B,H,K]."""
    q = torch.randn(B, H, K, generator=gen)
    u = torch.randn(B, H, K, generator=gen)
    states = torch.randn(B, H, N, V, K, generator=gen) / K ** 0.5
    pooled = torch.randn(B, H, N, K, generator=gen) / K ** 0.5
    online_state = torch.randn(B, H, V, K, generator=gen) / K ** 0.5
    online_pool = torch.randn(B, H, K, generator=gen) / K ** 0.5
    if large is True and N:     # a cached segment with a relevance of 100 and the online one at 95: exp overflows fp32
        unit = u / u.square().sum(-1, keepdim=True)
        pooled[:, :, 0] = 100 * unit
        online_pool = 95 * unit
    if large == "online":   # the online relevance at 100, the cached ones about 1: a maximum over the cached only
        online_pool = 100 * u / u.square().sum(-1, keepdim=True)       # leaves exp(99), which overflows fp32
    return q, u, states, pooled, online_state, online_pool


def _grm_reference(q, u, states, pooled, online, online_pool):
    """The library's readout for one token that sees every cached state: y [B,H,V]."""
    N = states.shape[2]
    blocks = torch.arange(N, dtype=torch.int64)[None]                    # [T=1, J=N]
    r_s = (u * online_pool).sum(-1)
    y = cached_readout(q[:, :, None], u[:, :, None], states, pooled, online[:, :, None], r_s[:, :, None], blocks,
                       aggregate="grm")
    return y[:, :, 0]


TOKEN_CASES = [(2, 3, 4, 5, 7, False), (1, 2, 1, 6, 3, False), (1, 1, 0, 4, 4, False), (2, 2, 9, 8, 5, False),
               (1, 2, 6, 4, 3, True), (1, 2, 5, 4, 3, "online")]      # (B, H, N, K, V, large scores)


def _label(B, H, N, K, V, large):
    extra = (" (an online relevance of 100, cached ones about 1: exp overflows fp32)" if large == "online" else
             " (relevances of 100: exp overflows fp32)" if large else "")
    extra += " (no cached state: a token of the first segment)" if N == 0 else ""
    return f"B={B}, H={H}, N={N}, K={K}, V={V}{extra}"


@EXERCISES.check("grm_readout", title="One GRM readout over cached matrix memories", points=3,
                  functions=("grm_readout",), forbidden=READOUTS)
def grm_readout(fn, gen):
    """fn(q [B,H,K], u [B,H,K], states [B,H,N,V,K], pooled [B,H,N,K], online [B,H,V], online_pool [B,H,K])
    -> y [B,H,V] = gamma_s online + sum_i gamma_i M^(i) q, gamma = softmax(<u, pooled_i>, <u, online_pool>)."""
    for B, H, N, K, V, large in TOKEN_CASES:
        q, u, states, pooled, online_state, online_pool = _token_inputs(B, H, N, K, V, gen, large)
        online = torch.einsum("bhvk,bhk->bhv", online_state, q)         # the base's own output
        ref = _grm_reference(q, u, states, pooled, online, online_pool)
        with case(_label(B, H, N, K, V, large)):
            got = call(fn, *clones(q, u, states, pooled, online, online_pool))
            check_shape("y", got, ref.shape)
            compare_finite("y", got, ref, TOL, OVERFLOW_HINT)
    return f"y matches atlaslib.caching's GRM readout on {len(TOKEN_CASES)} random cases, large relevances included"


@EXERCISES.check("soup", title="Memory soup for a matrix memory", points=2,
                  functions=("memory_soup",), forbidden=(*READOUTS, "atlaslib.caching.base.mix_states"))
def soup(fn, gen):
    """fn(q, u, states, pooled, online_state [B,H,V,K], online_pool) -> (M_star [B,H,V,K], y [B,H,V]):
    M_star = gamma_s M^(s) + sum_i gamma_i M^(i) with GRM's gammas, y = M_star q.

    M_star is compared with the GRM-weighted sum of the states; y with the GRM readout, which reads
    each state on its own: the two agree because reading a matrix memory is linear in the matrix.
    """
    for B, H, N, K, V, large in TOKEN_CASES:
        q, u, states, pooled, online_state, online_pool = _token_inputs(B, H, N, K, V, gen, large)
        r_s = (u * online_pool).sum(-1)
        blocks = torch.arange(N, dtype=torch.int64)[None]
        w, g_s = readout_weights(u[:, :, None], pooled, r_s[:, :, None], blocks, aggregate="grm")
        M_ref = torch.einsum("bhn,bhnvk->bhvk", w[:, :, 0], states) + g_s[:, :, 0, None, None] * online_state
        y_ref = _grm_reference(q, u, states, pooled, torch.einsum("bhvk,bhk->bhv", online_state, q), online_pool)
        with case(_label(B, H, N, K, V, large)):
            got = call(fn, *clones(q, u, states, pooled, online_state, online_pool))
            M_star, y = unpack(got, ("M_star", "y"))
            check_shape("M_star", M_star, M_ref.shape, " (one matrix [V, K] per batch and head)")
            compare_finite("M_star", M_star, M_ref, TOL, OVERFLOW_HINT)
            check_shape("y", y, y_ref.shape)
            compare_finite("y = M_star q", y, y_ref, TOL, OVERFLOW_HINT)
    return (f"the soup's memory is GRM's mixture of the states and its read equals the GRM readout on "
            f"{len(TOKEN_CASES)} random cases")


# ---- exercise 4: SSC --------------------------------------------------------------------------------

@EXERCISES.check("ssc_weights", title="SSC's top-k selection and its weights", points=2,
                  functions=("ssc_weights",), forbidden=READOUTS)
def ssc_weights(fn, gen):
    """fn(scores [B,H,T,J], online_score [B,H,T], top_k) -> (w [B,H,T,J], gamma_s [B,H,T]): the softmax over
    the top_k largest scores of each token and its online score, 0 for the other slots (top_k None: all)."""
    cases = [(2, 3, 4, 6, 2), (1, 2, 5, 8, 1), (1, 1, 7, 5, 4), (2, 1, 3, 5, 5), (1, 2, 4, 3, 7),
             (2, 2, 6, 4, None), (1, 1, 3, 1, 1)]                     # (B, H, T, J, top_k)
    for B, H, T, J, top_k in cases:
        scores = 3 * torch.randn(B, H, T, J, generator=gen)            # continuous: no ties
        online_score = 3 * torch.randn(B, H, T, generator=gen)
        # the library reads r = <u, pooled>: with pooled the identity, the relevances are the scores
        eye = torch.eye(J).expand(B, H, J, J)
        blocks = torch.arange(J, dtype=torch.int64).expand(T, J)
        w_ref, g_ref = readout_weights(scores, eye, online_score, blocks, top_k, "ssc")
        note = " (top_k >= J: every state, i.e. GRM)" if top_k is None or top_k >= J else ""
        with case(f"B={B}, H={H}, T={T}, J={J}, top_k={top_k}{note}"):
            got = call(fn, *clones(scores, online_score), top_k)
            w, g_s = unpack(got, ("w", "gamma_s"))
            check_shape("w", w, w_ref.shape, " (one weight per slot, 0 for the slots not selected)")
            check_shape("gamma_s", g_s, g_ref.shape)
            compare_finite("w", w, w_ref, TOL, OVERFLOW_HINT)
            compare_finite("gamma_s", g_s, g_ref, TOL, OVERFLOW_HINT)
    return f"the weights match atlaslib.caching's SSC on {len(cases)} random cases, top_k >= J included"


# ---- exercise 5: the Triton kernel -----------------------------------------------------------------

@EXERCISES.check("triton_grm_weights", title="A Triton kernel for the GRM weights of a block of tokens",
                  points=3, functions=("grm_weights_triton",), forbidden=READOUTS, needs_launch=True)
def triton_grm_weights(fn, gen):
    """fn(u [N,T,K], pooled [N,S,K], blocks int32 [T,J] (-1 padded), online_score [N,T], w [N,T,J],
    gamma_s [N,T]): r_tj = <u_t, pooled[blocks[t, j]]>, (w_t, gamma_s_t) = softmax over the visible slots and
    the online score."""
    device, tol = triton_setup(TOL, 1e-3)
    # (N, T, K, segments, size of u, online scores): the second case's online scores are about 100 and
    # its cached ones about 1, so a row maximum over the cached slots only overflows exp on every token;
    # the fourth has no cached state at all (S = 0: every slot is padding); the fifth has J = 3 slots,
    # not a power of two (where J is one, a kernel that takes a row of blocks or w as BJ long passes)
    cases = [(2, 13, 5, "log", 1.0, 0.0), (1, 37, 16, 8, 1.0, 100.0), (3, 5, 3, 2, 1.0, 0.0),
             (1, 1, 4, "log", 1.0, 0.0), (2, 13, 5, 4, 1.0, 0.0), (2, 40, 6, "log", 1.0, 0.0),
             (1, 20, 16, 4, 100.0, 0.0)]
    for N, T, K, segments, size, shift in cases:
        layout = make_layout(T, segments)
        blocks = layout.blocks()
        S, J = len(layout.cached), blocks.shape[1]
        u = size * torch.randn(N, T, K, generator=gen)
        pooled = torch.randn(N, S, K, generator=gen) / K ** 0.5
        online_score = torch.randn(N, T, generator=gen) + shift
        w_ref, g_ref = readout_weights(u[:, None], pooled[:, None], online_score[:, None], blocks, aggregate="grm")
        w_ref, g_ref = w_ref[:, 0].to(device), g_ref[:, 0].to(device)
        ins = [guarded(x.to(device)) for x in (u, pooled)]
        table = guarded(blocks.to(device=device, dtype=torch.int32))   # an index read past it: the largest int
        score = guarded(online_score.to(device))
        w, gamma_s = guarded_output((N, T, J), device=device), guarded_output((N, T), device=device)
        kind = "log-linear" if segments == "log" else f"segments of {segments}"
        label = f"N={N}, T={T}, K={K}, {kind}: S={S} cached states, J={J} slots"
        label += " (J is not a power of two: a row of blocks or w is J long, not BJ)" if J & (J - 1) else ""
        label += " (scores of about 100: exp overflows fp32)" if size > 1 else ""
        label += " (online scores of about 100, cached ones of about 1: exp overflows fp32)" if shift else ""
        with case(label):
            call(fn, *ins, table, score, w, gamma_s)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("w", w)
            check_guards("gamma_s", gamma_s)
            # inf or NaN in either output first: the hint names the cause
            for name, got in (("w", w), ("gamma_s", gamma_s)):
                if not torch.isfinite(got).all():
                    raise CheckFailed(f"{name} is not finite (inf or NaN){KERNEL_HINT}")
            compare("gamma_s", gamma_s, g_ref, tol)
            if shift:   # cached weights of about e^-99 are subnormal in fp32 (a GPU may flush them to 0):
                # checked on the scale of the weights, 1, not on their own
                err = (w - w_ref).abs().max().item()
                if not err <= tol:
                    raise CheckFailed(f"w: largest difference {err:.3g} > {tol:g} (the weights sum to 1 with gamma_s)")
            else:
                compare("w", w, w_ref, tol)
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel's weights match atlaslib.caching's GRM on {len(cases)} odd-sized cases (log-linear and "
            "constant segments), with no stray loads or stores")


__all__ = ["EXERCISES", "dyadic", "grm_readout", "soup", "ssc_weights", "triton_grm_weights"]
