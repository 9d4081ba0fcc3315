"""Checks for chapter 1's exercises (exercises/ch01_linear.ipynb).

Each check draws fresh random inputs, runs the learner's function and compares it with
``atlaslib`` (the per-token loop ``linear_attention(..., backend="recurrent")``, or the
capacity helpers), then shows a verdict. Use in a notebook as::

    from atlaslib.exercises import ch01 as check
    check.hebbian_step(hebbian_step)
"""
from __future__ import annotations

import torch

from ..core.dispatch import interpreter_on
from ..core.testing import random_gate, random_qkv
from ..linear import linear_attention
from ..tasks.capacity import least_squares_memory
from .checking import (CheckFailed, Registry, call, case, check_guards, compare, compare_kernel_output, compare_number,
                       guarded, guarded_output, uneven_norms, unpack, with_resets)

EXERCISES = Registry("ch01", helpers={"atlaslib.linear.chunk": ("chunk_step",)})   # what the notebook may import

# fp32 inputs; a correct answer agrees to ~1e-6, a wrong one is off by far more than this.
TOL = 1e-4


def reference(q, k, v, alpha=None, initial_state=None):
    """The library's per-token loop: (o, final state)."""
    return linear_attention(q, k, v, alpha=alpha, initial_state=initial_state,
                            output_final_state=True, backend="recurrent")


def clones(*xs):
    """Fresh copies, so a learner who updates an input in place cannot spoil the reference."""
    return tuple(None if x is None else x.clone() for x in xs)


def gate_kind(alpha) -> str:
    return "per-channel alpha [B,H,T,K]" if alpha.dim() == 4 else "scalar alpha [B,H,T]"


# the library's linear attention in each of its forms: the answer to every exercise that writes one
LIBRARY_FORMS = ("atlaslib.linear.linear_attention", "atlaslib.linear.recurrent.linear_attention_recurrent",
                 "atlaslib.linear.recurrent.linear_attention_step", "atlaslib.linear.chunk.linear_attention_chunk")


@EXERCISES.check("hebbian_step", title="One gated Hebbian write and read", points=2,
                  functions=("hebbian_step",),
                  forbidden=("atlaslib.linear.recurrent.linear_attention_step", "atlaslib.linear.chunk.chunk_step"))
def hebbian_step(fn, gen):
    """fn(M, q, k, v, alpha) -> (M_t, y_t) with M [B,H,V,K], q,k [B,H,K], v [B,H,V], alpha [B,H]."""
    shapes = [(2, 3, 5, 7), (1, 1, 4, 4), (2, 1, 16, 3)]   # K != V first: a transposed answer fails on shape
    for B, H, K, V in shapes:
        q, k, v = random_qkv(B, H, 1, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        alpha = random_gate(B, H, 1, low=0.3, high=1.0, generator=gen)
        M = torch.randn(B, H, V, K, generator=gen)
        y_ref, M_ref = reference(q, k, v, alpha, M)
        with case(f"B={B}, H={H}, K={K}, V={V}"):
            got = call(fn, *clones(M, q[:, :, 0], k[:, :, 0], v[:, :, 0], alpha[:, :, 0]))
            M_t, y_t = unpack(got, ("M_t", "y_t"))
            compare("M_t", M_t, M_ref, TOL)
            compare("y_t", y_t, y_ref[:, :, 0], TOL)
    return f"M_t and y_t match the library on {len(shapes)} random cases"


@EXERCISES.check("gated_loop", title="The gated per-token loop", points=2,
                  functions=("gated_loop",),
                  forbidden=LIBRARY_FORMS + ("atlaslib.linear.chunk.chunk_step",))   # a chunk of T tokens is the loop
def gated_loop(fn, gen):
    """fn(q, k, v, alpha) -> (o [B,H,T,V], M_T [B,H,V,K]); alpha [B,H,T] or [B,H,T,K]."""
    cases = [  # (B, H, T, K, V, per_channel, lowest gate)
        (2, 2, 9, 5, 3, False, 0.8),
        (1, 2, 7, 6, 4, True, 0.8),
        (1, 1, 1, 3, 5, False, 0.5),
        (2, 1, 12, 8, 8, True, 1.0),    # gate exactly 1: plain linear attention
        (1, 3, 10, 4, 6, False, 0.1),   # strong forgetting
    ]
    for B, H, T, K, V, per_channel, low in cases:
        q, k, v = random_qkv(B, H, T, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        if T == 1:      # read the key just stored: a random q.k can cancel to ~1e-4, beyond fp32's relative reach
            q = k.clone()
        alpha = random_gate(B, H, T, K if per_channel else None, low=low, generator=gen)
        o_ref, M_ref = reference(q, k, v, alpha)
        with case(f"B={B}, H={H}, T={T}, K={K}, V={V}, {gate_kind(alpha)}, gates in [{low}, 1]"):
            o, M_T = unpack(call(fn, *clones(q, k, v, alpha)), ("o", "M_T"))
            compare("o", o, o_ref, TOL)
            compare("M_T", M_T, M_ref, TOL)
    return f"o and M_T match the library on {len(cases)} random cases (scalar and per-channel gates)"


@EXERCISES.check("chunk_step", title="One chunk: intra-chunk matmul + inter-chunk memory", points=3,
                  functions=("chunk_step",),
                  forbidden=("atlaslib.linear.chunk.chunk_step",
                             "atlaslib.linear.linear_attention",
                             "atlaslib.linear.chunk.linear_attention_chunk"))
def chunk_step(fn, gen):
    """fn(M, q, k, v, g) -> (o [B,H,b,V], M_next [B,H,V,K]); g [B,H,b] = cumsum of log alpha in the chunk."""
    cases = [  # (B, H, b, K, V, gates' range)
        (2, 2, 1, 5, 3, (0.5, 1.0)), (1, 2, 4, 6, 6, (0.5, 1.0)), (2, 1, 9, 7, 4, (0.5, 1.0)),
        (1, 1, 16, 16, 8, (0.5, 1.0)),
        (1, 1, 32, 4, 3, (0.01, 0.05)),  # strong gates: e^{g_t - g_i} above the diagonal overflows
    ]
    for B, H, b, K, V, (low, high) in cases:
        q, k, v = random_qkv(B, H, b, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        alpha = random_gate(B, H, b, low=low, high=high, generator=gen)
        M = torch.randn(B, H, V, K, generator=gen)
        g = torch.log(alpha).cumsum(dim=-1)
        o_ref, M_ref = reference(q, k, v, alpha, M)
        with case(f"B={B}, H={H}, chunk length b={b}, K={K}, V={V}, gates in [{low}, {high}]"):
            o, M_next = unpack(call(fn, *clones(M, q, k, v, g)), ("o", "M_next"))
            compare("o", o, o_ref, TOL)
            compare("M_next", M_next, M_ref, TOL)
    return f"o and M_next match the per-token loop on {len(cases)} random chunks"


@EXERCISES.check("chunkwise", title="The whole chunkwise forward pass", points=3,
                  functions=("chunkwise",),
                  forbidden=LIBRARY_FORMS)
def chunkwise(fn, gen):
    """fn(q, k, v, alpha, chunk_size) -> (o, M_T); scalar gates alpha [B,H,T]."""
    cases = [  # (B, H, T, K, V, chunk sizes, gates' range[, "resets"])
        (2, 2, 13, 5, 4, (1, 3, 4, 13, 20), (0.5, 1.0)),
        (1, 1, 32, 8, 8, (8, 16, 7), (0.5, 1.0)),
        (1, 2, 1, 4, 3, (1, 4), (0.5, 1.0)),
        (1, 1, 40, 4, 3, (32,), (0.01, 0.05)),  # strong gates: e^{g_t - g_i} above the diagonal overflows
        (1, 2, 20, 5, 4, (1, 6, 20), (0.5, 1.0, "resets")),  # gates of exactly 0: log 0 = -inf
    ]
    for B, H, T, K, V, sizes, (low, high, *resets) in cases:
        q, k, v = random_qkv(B, H, T, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        alpha = random_gate(B, H, T, low=low, high=high, generator=gen)
        alpha = with_resets(alpha) if resets else alpha
        o_ref, M_ref = reference(q, k, v, alpha)
        gates = f"gates in [{low}, {high}]" + (", gates of 0 (resets) at t = 3, 10, 17" if resets else "")
        for c in sizes:
            with case(f"B={B}, H={H}, T={T}, K={K}, V={V}, chunk_size={c}, {gates}"):
                o, M_T = unpack(call(fn, *clones(q, k, v, alpha), c), ("o", "M_T"))
                compare("o", o, o_ref, TOL)
                compare("M_T", M_T, M_ref, TOL)
    n = sum(len(c[5]) for c in cases)
    return f"matches the per-token loop for {n} (sequence, chunk size) pairs, T a multiple of the chunk or not"


@EXERCISES.check("capacity", title="Capacity: the min-norm interpolant V K^+", points=2,
                  functions=("min_norm_memory", "largest_exact_m"))
def capacity(memory_fn, largest_m_fn, gen):
    """memory_fn(K [d_k, m], V [d_v, m]) -> M [d_v, d_k];  largest_m_fn(d_k, d_v) -> int."""
    cases = [(8, 3, 5, "m < d_k"), (8, 3, 8, "m = d_k"), (8, 3, 13, "m > d_k"), (5, 6, 20, "m >> d_k"),
             (8, 4, 6, "rank-deficient keys")]
    for d_k, d_v, m, label in cases:
        K = torch.randn(d_k, m, generator=gen, dtype=torch.float64)
        if label == "rank-deficient keys":   # 6 keys spanning only 3 dimensions
            basis = torch.randn(d_k, 3, generator=gen, dtype=torch.float64)
            K = basis @ torch.randn(3, m, generator=gen, dtype=torch.float64)
        V = torch.randn(d_v, m, generator=gen, dtype=torch.float64)
        M_ref = least_squares_memory(K.T, V.T)      # the library stores keys as rows
        with case(f"d_k={d_k}, d_v={d_v}, m={m} ({label})"):
            M = call(memory_fn, K.clone(), V.clone())
            compare("M", M, M_ref, 1e-8)
    for d_k, d_v in [(12, 5), (7, 20), (16, 16)]:
        with case(f"largest_exact_m(d_k={d_k}, d_v={d_v})"):
            compare_number("your answer", call(largest_m_fn, d_k, d_v), d_k)
    return "V K^+ matches the library (m below, at and above d_k, rank-deficient keys) and the capacity is right"


def triton_device() -> str:
    return "cuda" if torch.cuda.is_available() and not interpreter_on() else "cpu"


def triton_setup(tol: float, gpu_tol: float | None = None) -> tuple[str, float]:
    """The device a Triton check runs on and its tolerance there: ``tol`` on both (``gpu_tol``, when given,
    on a GPU). One tolerance, so a kernel scores the same on a card and in the interpreter, which rounds
    as a card does (``core.interpreter.as_a_gpu``): a ``tl.dot`` left at its default TF32 products is
    about 1e-3 off on both, and the failure says so (``checking.tf32_hint``).

    Without a GPU and without Triton's interpreter no kernel can run: the check says how to fix that.
    """
    device = triton_device()
    if device == "cpu" and not interpreter_on():
        raise CheckFailed("no GPU and no Triton interpreter: set os.environ['TRITON_INTERPRET'] = '1' before "
                          "importing triton (the notebook's set-up cell does), then restart the kernel")
    return device, (tol if device == "cpu" or gpu_tol is None else gpu_tol)


@EXERCISES.check("triton_state_update", title="A Triton kernel for the chunk's state update", points=3,
                  functions=("state_update",),
                  forbidden=("atlaslib.linear.chunk.chunk_step",), needs_launch=True)
def triton_state_update(fn, gen):
    """fn(M [N,V,K], k [N,b,K], v [N,b,V], g [N,b], out [N,V,K]) -> out = e^{g_last} M + (v e^{g_last-g})^T k."""
    device, tol = triton_setup(TOL)
    cases = [(2, 5, 6, 3), (1, 16, 16, 16), (3, 11, 20, 9), (1, 1, 4, 4)]   # (N, b, K, V): odd sizes on purpose
    for N, b, K, V in cases:
        q, k, v = random_qkv(N, 1, b, K, V, generator=gen)
        q, k = uneven_norms(gen, q, k)
        alpha = random_gate(N, 1, b, low=0.5, generator=gen)
        M = torch.randn(N, 1, V, K, generator=gen)
        _, M_ref = reference(q, k, v, alpha, M)
        g = torch.log(alpha).cumsum(dim=-1)
        ins = [guarded(x[:, 0].to(device)) for x in (M, k, v, g)]
        out = guarded_output((N, V, K), device=device)
        with case(f"N={N}, b={b}, K={K}, V={V}"):
            call(fn, *ins, out)
            if device == "cuda":
                torch.cuda.synchronize()
            check_guards("out", out)
            compare_kernel_output("out", out, M_ref[:, 0].to(device), tol)
    # the same text on CPU and GPU, so the stored output is valid on both
    return f"the kernel matches the library on {len(cases)} odd-sized cases, with no stray loads or stores"
