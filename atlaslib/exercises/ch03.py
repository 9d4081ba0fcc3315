"""Checks for chapter 3's exercises (exercises/ch03_miras.ipynb): the four MIRAS axes.

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib.miras`` (the memory gradient ``memory_gradient`` of the per-token engine, one
token of ``miras(..., backend="recurrent")`` for Yaad's step and Memora's log-domain
loop, the optimizer and retention parts ``Momentum.step`` / ``Decay.combine`` for the
chunk's momentum, and the chunk decay ratios ``atlaslib.core.chunking.causal_decay`` for
the kernel), then shows a verdict. Use in a notebook as::

    from atlaslib.exercises import ch03 as check
    check.ttt_mlp_grads(ttt_mlp_grads)
"""
from __future__ import annotations

import torch

from ..core.testing import random_gate, random_qkv
from ..core.chunking import causal_decay
from ..miras import make_config, memory_gradient, miras
from ..miras.optimizer import build_optimizer
from ..miras.retention import build_retention
from .ch01 import clones, triton_setup
from .checking import (NAN_HINT, CheckFailed, Registry, call, case, check_guards, check_shape, compare,
                       compare_kernel_output, guarded, guarded_output, uneven_norms, unpack)

EXERCISES = Registry("ch03")

# fp32 inputs unless stated; a correct answer agrees to ~1e-6, a wrong one is off by far more.
TOL = 1e-4


@EXERCISES.check("ttt_mlp_grads", title="TTT-MLP's inner gradients by hand", points=2,
                  functions=("ttt_mlp_grads",),
                  forbidden=("atlaslib.miras.miras", "atlaslib.miras.memory_gradient", "torch.autograd.grad",
                             "torch.autograd.backward", "torch.autograd.forward_ad.make_dual"))
def ttt_mlp_grads(fn, gen):
    """fn(W1 [N,h,K], W2 [N,V,h], k [N,K], v [N,V]) -> (grad_W1, grad_W2) of 1/2 ||W2 gelu(W1 k) - v||^2.

    The reference is the per-token engine's gradient (``miras.memory_gradient``, autograd
    through the library's MLP memory), one (W1, W2) pair per row n.
    """
    cases = [(3, 5, 2, 7), (1, 4, 4, 4), (2, 6, 1, 3), (4, 3, 3, 8)]   # (N, K, expansion, V): K != V first
    for N, K, e, V in cases:
        h = e * K
        W1 = torch.randn(N, h, K, generator=gen, dtype=torch.float64) / K ** 0.5
        W2 = torch.randn(N, V, h, generator=gen, dtype=torch.float64) / h ** 0.5
        k = torch.randn(N, K, generator=gen, dtype=torch.float64)
        v = torch.randn(N, V, generator=gen, dtype=torch.float64)
        ref = memory_gradient(make_config("ttt_mlp", expansion=e), {"W1": W1, "W2": W2}, k[:, None], v[:, None])
        with case(f"N={N}, K={K}, hidden h={h}, V={V}"):
            with torch.no_grad():                # by hand: no graph to walk back through either
                g1, g2 = unpack(call(fn, *clones(W1, W2, k, v)), ("grad_W1", "grad_W2"))
            check_shape("grad_W1", g1, W1.shape)
            check_shape("grad_W2", g2, W2.shape)
            compare("grad_W2", g2, ref["W2"], 1e-8)
            compare("grad_W1", g1, ref["W1"], 1e-8)
    return f"both gradients match the engine's autograd on {len(cases)} random MLP memories"


def _switch_deltas(M, k, v, gen):
    """Per-row thresholds clearly below or above ||e|| (never within 10% of it), so both branches occur."""
    e = torch.einsum("bhvk,bhk->bhv", M, k) - v
    n = e.norm(dim=-1)
    below = torch.rand(n.shape, generator=gen) < 0.5
    r = torch.where(below, 0.3 + 0.6 * torch.rand(n.shape, generator=gen),
                    1.1 + 0.9 * torch.rand(n.shape, generator=gen))
    below[..., 0] = True                                    # at least one row of each kind per head
    r[..., 0] = 0.5
    if n.shape[-1] > 1:
        below[..., 1] = False
        r[..., 1] = 1.5
    return n * r


@EXERCISES.check("yaad_step", title="One Yaad step: the Huber switch with retention", points=2,
                  functions=("yaad_step",),
                  forbidden=("atlaslib.miras.miras",))
def yaad_step(fn, gen):
    """fn(M [B,H,V,K], k [B,H,K], v [B,H,V], alpha [B,H], eta [B,H], delta [B,H]) -> M_t.

    M_t = alpha M - eta psi k^T, psi = e if ||e|| <= delta else delta sign(e), e = M k - v.
    """
    cases = [(2, 3, 5, 7), (1, 4, 6, 6), (3, 2, 16, 3), (1, 1, 2, 9)]     # (B, H, K, V): K != V first
    for B, H, K, V in cases:
        _, k, v = random_qkv(B, H, 1, K, V, generator=gen)
        k = uneven_norms(gen, k)
        k, v = k[:, :, 0], v[:, :, 0]
        M = torch.randn(B, H, V, K, generator=gen)
        alpha = random_gate(B, H, 1, low=0.5, generator=gen)[..., 0]
        eta = 0.1 + 0.9 * torch.rand(B, H, generator=gen)
        delta = _switch_deltas(M, k, v, gen)
        _, state = miras(k[:, :, None], k[:, :, None], v[:, :, None], preset="yaad", memory="linear",
                         alpha=alpha[..., None], eta=eta[..., None], delta=delta[..., None], initial_state=M,
                         output_final_state=True, backend="recurrent")
        with case(f"B={B}, H={H}, K={K}, V={V}, rows on both sides of the threshold"):
            got = call(fn, *clones(M, k, v, alpha, eta, delta))
            check_shape("M_t", got, M.shape)
            compare("M_t", got, state.memory, TOL)
    return f"M_t matches atlaslib.miras (preset yaad, linear memory) on {len(cases)} random steps, both branches"


@EXERCISES.check("memora_loop", title="Memora in the log domain", points=2,
                  functions=("memora_loop",),
                  forbidden=("atlaslib.miras.miras",))
def memora_loop(fn, gen):
    """fn(Z0 [B,H,V,K], q, k [B,H,T,K], v [B,H,T,V], alpha [B,H,T], eta [B,H,T], c) -> (o [B,H,T,V], W_T [B,H,V,K]).

    Z_t = alpha_t Z_{t-1} - eta_t (W_{t-1} k_t - v_t) k_t^T, W_t = c softmax(Z_t) over all V*K
    entries, y_t = W_t q_t. W_T is compared (not Z_T), so a shift of Z by a constant is fine.
    """
    cases = [(2, 2, 9, 5, 4, 1.0), (1, 3, 16, 6, 6, 3.0), (1, 1, 1, 3, 7, 0.5), (2, 1, 40, 8, 5, 8.0)]
    for B, H, T, K, V, c in cases:
        q, k, v = random_qkv(B, H, T, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        Z0 = torch.randn(B, H, V, K, generator=gen)
        alpha = random_gate(B, H, T, low=0.6, generator=gen)
        eta = 0.5 + 4.5 * torch.rand(B, H, T, generator=gen)       # large steps: the memory moves a lot
        o_ref, state = miras(q, k, v, memory="linear", retention="kl", scale=c, alpha=alpha, eta=eta,
                             initial_state=Z0, output_final_state=True, backend="recurrent")
        W_ref = c * torch.softmax(state.memory.flatten(-2), dim=-1).view_as(state.memory)
        with case(f"B={B}, H={H}, T={T}, K={K}, V={V}, c={c:g}"):
            o, W_T = unpack(call(fn, *clones(Z0, q, k, v, alpha, eta), c), ("o", "W_T"))
            check_shape("o", o, o_ref.shape)
            check_shape("W_T", W_T, W_ref.shape)
            compare("o", o, o_ref, TOL)
            compare("W_T", W_T, W_ref, TOL)
    return f"outputs and final weights match atlaslib.miras (retention='kl') on {len(cases)} random sequences"


def titans_parts():
    cfg = make_config("titans", memory="linear")
    return build_optimizer(cfg), build_retention(cfg)


@EXERCISES.check("momentum_chunk", title="Titans' momentum over a chunk as masked matmuls", points=3,
                  functions=("momentum_chunk",),
                  forbidden=("atlaslib.miras.miras", "atlaslib.miras.titans_linear_chunk"))
def momentum_chunk(fn, gen):
    """fn(M0 [N,V,K], S0 [N,V,K], G [N,b,V,K], alpha [N,b], theta [N,b], eta [N,b]) -> (M [N,b,V,K], S_b [N,V,K]).

    The chunk's gradients G are given (frozen at the chunk start); the reference runs the
    library's optimizer and retention token by token: S_t = theta_t S_{t-1} - eta_t G_t,
    M_t = alpha_t M_{t-1} + S_t.
    """
    opt, ret = titans_parts()
    # (N, b, V, K, momentum decay range, retention range); the last two chunks' cumulative products underflow
    # fp32 (a gate <= 0.2 over 64 tokens: log of the product about -150 +- 5, below fp32's -103 for every draw;
    # over 48 tokens about 1 draw in 100 stayed above it), where quotients of cumulative products give 0/0
    cases = [(2, 5, 3, 4, (0.3, 1.0), (0.5, 1.0)), (1, 16, 4, 4, (0.05, 1.0), (0.5, 1.0)),
             (3, 1, 2, 5, (0.5, 1.0), (0.5, 1.0)), (2, 9, 6, 2, (0.8, 1.0), (0.8, 1.0)),
             (1, 64, 3, 3, (0.02, 0.2), (0.5, 1.0)), (1, 64, 3, 3, (0.5, 1.0), (0.02, 0.2))]
    for N, b, V, K, (low, high), (a_low, a_high) in cases:
        M0 = torch.randn(N, V, K, generator=gen)
        S0 = torch.randn(N, V, K, generator=gen)
        G = torch.randn(N, b, V, K, generator=gen)
        alpha = random_gate(N, 1, b, low=a_low, high=a_high, generator=gen)[:, 0]
        theta = random_gate(N, 1, b, low=low, high=high, generator=gen)[:, 0]
        eta = 0.1 + 0.9 * torch.rand(N, b, generator=gen)
        M, S, states = {"M": M0}, {"M": S0}, []
        for t in range(b):                                        # the per-token definition
            u, S = opt.step(S, {"M": G[:, t]}, eta[:, t], theta[:, t])
            M = ret.combine(M, u, alpha[:, t])
            states.append(M["M"])
        M_ref, S_ref = torch.stack(states, dim=1), S["M"]
        with case(f"N={N}, chunk b={b}, V={V}, K={K}, momentum decay theta in [{low}, {high}], "
                  f"retention alpha in [{a_low}, {a_high}]"):
            got_M, got_S = unpack(call(fn, *clones(M0, S0, G, alpha, theta, eta)), ("M", "S_b"))
            check_shape("M", got_M, M_ref.shape)
            check_shape("S_b", got_S, S_ref.shape)
            for name, got in (("M", got_M), ("S_b", got_S)):
                if got.is_floating_point() and got.isnan().any():
                    raise CheckFailed(f"{name} is NaN at {int(got.isnan().sum())} entries where the memories are "
                                      "finite: a division by zero (0/0), or inf * 0. Over this chunk the cumulative "
                                      "products of the gates underflow fp32 to 0, so their quotients are 0/0: build "
                                      "the ratios as exp of differences of cumulative log-gates, masked before the "
                                      "exponential (exp of an unmasked difference above the diagonal overflows to "
                                      "inf, and a 0/1 mask multiplied after it gives inf * 0 = NaN: use "
                                      "torch.where(mask, diff, -inf) before exp)")
            compare("M", got_M, M_ref, TOL)
            compare("S_b", got_S, S_ref, TOL)
    return f"all the chunk's memories and its final momentum match the per-token recursion on {len(cases)} chunks"


# strong gates make l_t - l_m large and positive above the diagonal and for pairs with a padding row
OVERFLOW_HINT = (" With gates this strong, NaN also comes from inf * 0: exp(l_t - l_m) overflows fp32 above the "
                 "diagonal and for pairs with a padding row, so a 0/1 mask applied after tl.exp gives NaN; select "
                 "the differences with tl.where(keep, diff, -inf) before tl.exp, keep only pairs of real rows.")


@EXERCISES.check("triton_decay_product", title="A Triton kernel for the momentum weights D_alpha D_theta", points=3,
                  functions=("decay_product",), needs_launch=True)
def triton_decay_product(fn, gen):
    """fn(la [N,b], lb [N,b], out [N,b,b]) -> out = D_alpha D_theta: D_alpha[t, m] = exp(la_t - la_m) for m <= t,
    else 0, and D_theta likewise from lb."""
    device, tol = triton_setup(TOL)
    # (N, b, gates in [low, high]); the last case's cumulative products underflow fp32 (A_t < 1e-45)
    cases = [(2, 5, 0.5, 1.0), (1, 16, 0.8, 1.0), (3, 11, 0.3, 1.0), (1, 1, 0.5, 1.0), (2, 30, 0.001, 0.05)]
    for N, b, low, high in cases:
        la = torch.log(random_gate(N, 1, b, low=low, high=high, generator=gen)[:, 0]).cumsum(-1)
        lb = torch.log(random_gate(N, 1, b, low=low, high=high, generator=gen)[:, 0]).cumsum(-1)
        causal = torch.ones(b, b, dtype=torch.bool).tril()
        ref = causal_decay(la[None], causal)[0] @ causal_decay(lb[None], causal)[0]
        ins = [guarded(x.contiguous().to(device)) for x in (la, lb)]
        out = guarded_output((N, b, b), device=device)
        with case(f"N={N}, b={b}, gates in [{low}, {high}]"):
            call(fn, *ins, out)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            if torch.isinf(out).any():
                raise CheckFailed("out contains inf: exponentiate only differences lx_t - lx_m with m <= t "
                                  "(mask with -inf *before* tl.exp; above the diagonal the difference is large "
                                  "and positive)")
            hint = NAN_HINT + OVERFLOW_HINT if high < 0.1 else NAN_HINT
            compare_kernel_output("out", out, ref.to(device), tol, hint)
    # the same text on CPU and GPU, so the stored output is valid on both
    return (f"the kernel matches atlaslib on {len(cases)} odd-sized chunks, strong gates included, "
            "with no stray loads or stores")


__all__ = ["EXERCISES", "ttt_mlp_grads", "yaad_step", "memora_loop", "momentum_chunk", "triton_decay_product"]
