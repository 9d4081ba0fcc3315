"""Exercise machinery: student copies up to date, the generator, and checks that can fail.

Every chapter-1 check must pass a correct answer (written here from the library, not
from the solution notebook) and reject typical wrong answers with a message that says
what is wrong. TRITON_INTERPRET=1 is set by conftest.py before triton is imported.
"""
import json
import math
import os
from pathlib import Path

import nbformat
import pytest
import torch
import triton
import triton.language as tl

from atlaslib.exercises import ch01, registry
from atlaslib.exercises.checking import MIME, Verdict
from atlaslib.exercises.generate import SOLUTIONS, render, strip_solutions, target_of
from atlaslib.linear import linear_attention
from atlaslib.linear.chunk import chunk_step as library_chunk_step
from atlaslib.tasks.capacity import least_squares_memory

ROOT = Path(__file__).resolve().parents[1]
SOLUTION_NOTEBOOKS = sorted(SOLUTIONS.glob("ch*.ipynb"))


# ---- generator ---------------------------------------------------------------------------

def test_there_are_solution_notebooks():
    assert SOLUTION_NOTEBOOKS, "no exercises/solutions/ch*.ipynb"


@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.name)
def test_student_notebook_is_up_to_date(path):
    target = target_of(path)
    assert target.exists(), f"{target} missing: run `make exercises`"
    assert target.read_text() == render(path), f"{target.name} is stale: run `make exercises`"


@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_declares_every_exercise_with_stub_and_check(path):
    nb = nbformat.read(path, as_version=4)
    exercises = registry(nb.metadata["atlaslib"]["chapter"])
    assert len(exercises.exercises) >= 4
    student = nbformat.read(target_of(path), as_version=4)
    for ex in exercises:
        tagged = [c for c in student.cells if c.get("metadata", {}).get("atlaslib", {}).get("exercise") == ex.name]
        assert any("raise NotImplementedError" in c.source for c in tagged), f"{ex.name}: no stub"
        assert any(f"check.{ex.name}(" in c.source for c in tagged), f"{ex.name}: no check call"
        assert not any("BEGIN SOLUTION" in c.source or c.outputs for c in tagged)


def test_strip_solutions_keeps_indentation_and_the_rest():
    src = ("def f(x):\n    y = 1\n    # BEGIN SOLUTION\n    return x + y\n    # END SOLUTION\n\n"
           "# BEGIN SOLUTION\nz = 2\n# END SOLUTION\nprint(3)")
    out = strip_solutions(src, "Exercise 9: f", "test")
    assert out == ("def f(x):\n    y = 1\n    raise NotImplementedError('Exercise 9: f')\n\n"
                   "raise NotImplementedError('Exercise 9: f')\nprint(3)")


def test_a_long_stub_is_wrapped_and_raises_the_whole_message():
    title = "Exercise 12: " + " ".join(f"word{i}" for i in range(40))
    src = "def f():\n        # BEGIN SOLUTION\n        return 1\n        # END SOLUTION\n"
    out = strip_solutions(src, title, "test")
    assert max(len(line) for line in out.splitlines()) <= 88
    namespace = {}
    exec(out, namespace)
    with pytest.raises(NotImplementedError) as raised:
        namespace["f"]()
    assert str(raised.value) == title


@pytest.mark.parametrize("src", ["# BEGIN SOLUTION\nx = 1", "x = 1\n# END SOLUTION",
                                 "# BEGIN SOLUTION\n# BEGIN SOLUTION\n# END SOLUTION"])
def test_strip_solutions_rejects_unbalanced_markers(src):
    with pytest.raises(ValueError, match="SOLUTION"):
        strip_solutions(src, "msg", "test")


def test_generator_help_names_the_module(capsys):
    from atlaslib.exercises.generate import main
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith("usage: python -m atlaslib.exercises.generate ")


def test_generator_without_the_solutions_says_so(capsys, monkeypatch, tmp_path):
    """Away from the checkout (an installed atlaslib) there is nothing to render: an error, not a silent 0."""
    from atlaslib.exercises import generate
    monkeypatch.setattr(generate, "SOLUTIONS", tmp_path / "exercises" / "solutions")
    for argv in ([], ["--check"]):
        with pytest.raises(SystemExit) as exit_:
            generate.main(argv)
        assert exit_.value.code == 2 and "no exercises/solutions/ch*.ipynb" in capsys.readouterr().err


def test_generator_check_fails_on_a_stale_notebook_and_writing_fixes_it(capsys, monkeypatch, tmp_path):
    """``--check`` exits 1 on a stale student notebook and leaves it as it is (CI relies on the status);
    without ``--check`` the notebook is rewritten, after which ``--check`` exits 0."""
    from atlaslib.exercises import generate
    solution = SOLUTIONS / "ch01_linear.ipynb"
    (tmp_path / "exercises" / "solutions").mkdir(parents=True)
    (tmp_path / "exercises" / "solutions" / solution.name).write_text(solution.read_text())
    student = tmp_path / "exercises" / solution.name
    stale = target_of(solution).read_text().replace("raise NotImplementedError", "pass  # stale", 1)
    student.write_text(stale)
    monkeypatch.setattr(generate, "ROOT", tmp_path)
    monkeypatch.setattr(generate, "SOLUTIONS", tmp_path / "exercises" / "solutions")
    assert generate.main(["--check"]) == 1
    assert "STALE" in capsys.readouterr().out and student.read_text() == stale
    assert generate.main([]) == 0 and student.read_text() == target_of(solution).read_text()
    assert generate.main(["--check"]) == 0


# ---- verdicts ----------------------------------------------------------------------------

def hebbian_step_ok(M, q, k, v, alpha):
    o, M_t = linear_attention(q[:, :, None], k[:, :, None], v[:, :, None], alpha=alpha[:, :, None],
                              initial_state=M, output_final_state=True, backend="chunk")
    return M_t, o[:, :, 0]


def test_success_text_is_deterministic_and_machine_readable():
    a, b = ch01.hebbian_step.evaluate(hebbian_step_ok), ch01.hebbian_step.evaluate(hebbian_step_ok)
    assert a.status == "passed" and a.earned == a.points == 2
    assert a.text() == b.text()       # no random numbers in the success line (nbval stays strict)
    payload = json.loads(json.dumps(a.__dict__))
    assert Verdict(**payload) == a


def test_each_run_of_a_check_draws_fresh_inputs():
    """The notebooks promise fresh random inputs on every run: with the same inputs each time, an answer
    that replays the numbers of an earlier run, or is right by luck on those inputs, would keep passing."""
    seen = []

    def recording(M, q, k, v, alpha):
        seen.append(k.clone())
        return hebbian_step_ok(M, q, k, v, alpha)
    assert ch01.hebbian_step.evaluate(recording).status == "passed"
    first = list(seen)
    assert ch01.hebbian_step.evaluate(recording).status == "passed"
    second = seen[len(first):]
    assert len(first) == len(second) > 0
    assert not any(torch.equal(a, b) for a, b in zip(first, second))


def test_display_carries_the_grader_payload(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.get_ipython", lambda: object())
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    ch01.hebbian_step(hebbian_step_ok)
    assert shown and json.loads(shown[0][MIME])["status"] == "passed"
    assert shown[0]["text/plain"].startswith("PASSED Exercise 1")


def test_stub_raising_not_implemented_scores_zero():
    def stub(*args):
        raise NotImplementedError("Exercise 1: write me")
    v = ch01.hebbian_step.evaluate(stub)
    assert v.status == "not_implemented" and v.earned == 0


def test_exception_is_reported_by_name_without_traceback():
    v = ch01.hebbian_step.evaluate(lambda *a: {}["missing"])
    assert v.status == "error" and "KeyError" in v.message and "Traceback" not in v.message
    assert "B=2, H=3" in v.message    # says which case


def test_a_cuda_fault_says_to_restart_the_kernel():
    """After an illegal memory access every later CUDA call of the process fails: the verdict says so."""
    def faults(*a):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    v = ch01.hebbian_step.evaluate(faults)
    assert v.status == "error" and "restart the notebook's kernel" in v.message, v.message
    v = ch01.hebbian_step.evaluate(lambda *a: {}["missing"])
    assert "restart" not in v.message


def test_wrong_return_type_and_shape_are_explained():
    v = ch01.hebbian_step.evaluate(lambda M, q, k, v, a: M)
    assert v.status == "failed" and "expected a tuple (M_t, y_t)" in v.message
    v = ch01.hebbian_step.evaluate(lambda M, q, k, v, a: (M.transpose(-1, -2), q))
    assert v.status == "failed" and "shape" in v.message


@pytest.mark.parametrize("setting", ["float64 default", "grad mode off"])
def test_a_check_cell_draws_and_checks_as_the_grader_whatever_the_notebook_set(setting):
    """A notebook under torch.set_default_dtype(torch.float64) mixed float64 and float32 inputs in every check,
    and one under torch.set_grad_enabled(False) broke the checks whose reference uses autograd: correct answers
    got ERROR in the notebook and full points from the grader. The settings are the notebook's again afterwards,
    and its function runs under them."""
    from atlaslib.exercises import ch02

    def loss_gradient(M, k, v):                             # (M k - v) k^T
        return (torch.einsum("bhvk,bhk->bhv", M, k) - v)[..., None] * k[..., None, :]

    def delta_step(M, k, v, beta, alpha):                   # A - beta (A k - v) k^T, A = alpha M
        A = alpha[..., None, None] * M
        seen.add((torch.get_default_dtype(), torch.is_grad_enabled()))
        return A - beta[..., None, None] * loss_gradient(A, k, v)
    seen = set()
    before = torch.get_default_dtype()
    setting_now = (torch.float64, True) if setting == "float64 default" else (torch.float32, False)
    torch.set_default_dtype(setting_now[0])
    try:
        with torch.set_grad_enabled(setting_now[1]):
            verdicts = [ch01.hebbian_step.evaluate(hebbian_step_ok),
                        ch02.delta_step.evaluate(loss_gradient, delta_step)]
            assert (torch.get_default_dtype(), torch.is_grad_enabled()) == setting_now
    finally:
        torch.set_default_dtype(before)
    assert [v.status for v in verdicts] == ["passed", "passed"], [v.message for v in verdicts]
    assert seen == {setting_now}


def test_a_numpy_result_gets_the_graders_verdict_in_the_notebook():
    """The grader's kernel sends numpy arrays back as tensors (and passed them); the check cell refused them."""
    def as_numpy(M, q, k, v, alpha):
        M_t, y_t = hebbian_step_ok(M, q, k, v, alpha)
        return M_t.numpy(), y_t.numpy()
    assert ch01.hebbian_step.evaluate(as_numpy).status == "passed"


def test_answers_that_modify_their_inputs_in_place_fail():
    def in_place(M, q, k, v, alpha):
        M.mul_(alpha[:, :, None, None]).add_(v[..., :, None] * k[..., None, :])
        return M, torch.einsum("bhvk,bhk->bhv", M, q)

    def out_of_place(M, q, k, v, alpha):
        return in_place(M.clone(), q, k, v, alpha)
    v = ch01.hebbian_step.evaluate(in_place)
    assert v.status == "failed" and "changed its input (argument 1) in place" in v.message
    assert ch01.hebbian_step.evaluate(out_of_place).status == "passed"


@pytest.mark.library_rules
def test_answers_that_call_the_library_answer_fail():
    from atlaslib.linear import linear_attention

    def library_backed(q, k, v, alpha, chunk_size):
        return linear_attention(q, k, v, alpha=alpha, output_final_state=True, backend="chunk",
                                chunk_size=chunk_size)
    v = ch01.chunkwise.evaluate(library_backed)
    assert v.status == "failed" and "your answer calls atlaslib.linear." in v.message, v.message


@pytest.mark.library_rules
def test_the_loop_exercises_refuse_the_librarys_chunk_step():
    """chunk_step is the notebook's helper for the chunkwise exercise; over one chunk of one token, or of
    all T tokens, it is the answer to exercises 1 and 2, which must refuse it."""
    def hebbian_step(M, q, k, v, alpha):
        o, M_t = library_chunk_step(M, q[:, :, None], k[:, :, None], v[:, :, None], torch.log(alpha)[:, :, None])
        return M_t, o[:, :, 0]

    def gated_loop(q, k, v, alpha):
        M = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], q.shape[-1])
        return library_chunk_step(M, q, k, v, torch.log(alpha).cumsum(2))
    for exercise, answer in ((ch01.hebbian_step, hebbian_step), (ch01.gated_loop, gated_loop)):
        v = exercise.evaluate(answer)
        assert v.status == "failed" and "atlaslib.linear.chunk.chunk_step" in v.message, v.message


# ---- chapter 1: each check passes a correct answer and rejects typical mistakes ----------

def test_hebbian_step_rejects_read_before_write():
    def read_first(M, q, k, v, alpha):
        y = torch.einsum("bhvk,bhk->bhv", alpha[:, :, None, None] * M, q)
        return alpha[:, :, None, None] * M + v[..., :, None] * k[..., None, :], y
    v = ch01.hebbian_step.evaluate(read_first)
    assert v.status == "failed" and "y_t" in v.message and "relative RMSE" in v.message


def test_hebbian_step_rejects_a_missing_gate():
    """M_t = M + v k^T: right only where alpha = 1, so the check must draw gates below 1."""
    def ungated(M, q, k, v, alpha):
        M_t = M + v[..., :, None] * k[..., None, :]
        return M_t, torch.einsum("bhvk,bhk->bhv", M_t, q)
    v = ch01.hebbian_step.evaluate(ungated)
    assert v.status == "failed" and "M_t: relative RMSE" in v.message, v.message


def gated_loop_ok(q, k, v, alpha):
    return linear_attention(q, k, v, alpha=alpha, output_final_state=True, backend="chunk", chunk_size=4)


def test_gated_loop_passes_and_rejects_left_multiplied_channel_gates():
    assert ch01.gated_loop.evaluate(gated_loop_ok).status == "passed"

    def left_gate(q, k, v, alpha):      # Diag(alpha) M: decays value rows instead of key columns
        if alpha.dim() == 3:
            return gated_loop_ok(q, k, v, alpha)
        M = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], q.shape[-1])
        out = []
        for t in range(q.shape[2]):
            a = alpha[:, :, t, : v.shape[-1]]
            M = a[..., :, None] * M + v[:, :, t, :, None] * k[:, :, t, None, :]
            out.append(torch.einsum("bhvk,bhk->bhv", M, q[:, :, t]))
        return torch.stack(out, 2), M
    v = ch01.gated_loop.evaluate(left_gate)
    assert v.status != "passed" and "per-channel" in v.message


def test_chunk_step_passes_and_rejects_missing_inter_chunk_decay():
    assert ch01.chunk_step.evaluate(library_chunk_step).status == "passed"

    def no_decay_on_past(M, q, k, v, g):
        o, M_next = library_chunk_step(M, q, k, v, g)
        return o - (torch.exp(g)[..., None] - 1) * (q @ M.transpose(-1, -2)), M_next
    v = ch01.chunk_step.evaluate(no_decay_on_past)
    assert v.status == "failed" and "o:" in v.message


def chunk_step_masked(after_exp):
    """chapter 1's chunk by its matrix form; the mask on e^{g_t - g_i} as -inf before exp, or as 0/1 after it."""
    def step(M, q, k, v, g):
        b = q.shape[2]
        diff = g[..., :, None] - g[..., None, :]
        lower = torch.ones(b, b, dtype=torch.bool).tril()
        D = torch.exp(diff) * lower if after_exp else torch.exp(diff.masked_fill(~lower, -math.inf))
        o = torch.exp(g)[..., None] * (q @ M.transpose(-1, -2)) + ((q @ k.transpose(-1, -2)) * D) @ v
        tail = torch.exp(g[..., -1:] - g)[..., None]
        return o, torch.exp(g[..., -1])[..., None, None] * M + (v * tail).transpose(-1, -2) @ k
    return step


def chunkwise_over(step):
    def run(q, k, v, alpha, chunk_size):
        M = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], q.shape[-1])
        outs = []
        for s in range(0, q.shape[2], chunk_size):
            e = min(s + chunk_size, q.shape[2])
            g = torch.log(alpha[:, :, s:e]).clamp_min(-60.0).cumsum(-1)    # floored: a gate may be 0
            o, M = step(M, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g)
            outs.append(o)
        return torch.cat(outs, 2), M
    return run


def test_chunkwise_rejects_an_answer_that_takes_the_log_of_a_reset_gate():
    """alpha_t = 0 is allowed (a full reset): log 0 = -inf, and -inf - (-inf) is NaN unless the log is floored."""
    def unfloored(q, k, v, alpha, chunk_size):
        M = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], q.shape[-1])
        outs = []
        for s in range(0, q.shape[2], chunk_size):
            e = min(s + chunk_size, q.shape[2])
            g = torch.log(alpha[:, :, s:e]).cumsum(-1)                      # log 0 = -inf at a reset
            o, M = library_chunk_step(M, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g)
            outs.append(o)
        return torch.cat(outs, 2), M
    v = ch01.chunkwise.evaluate(unfloored)
    assert v.status == "failed" and "NaN" in v.message and "resets" in v.message, v.message


def test_chunk_exercises_reject_a_mask_applied_after_the_exponential():
    """The statement: mask before you exponentiate. A 0/1 mask after it is right until e^{g_t - g_i} above the
    diagonal overflows (strong gates over a long chunk), then inf * 0 is NaN: the checks have such a chunk."""
    for exercise, wrap in ((ch01.chunk_step, lambda f: f), (ch01.chunkwise, chunkwise_over)):
        assert exercise.evaluate(wrap(chunk_step_masked(after_exp=False))).status == "passed"
        v = exercise.evaluate(wrap(chunk_step_masked(after_exp=True)))
        assert v.status == "failed" and "NaN" in v.message and "gates in [0.01, 0.05]" in v.message, v.message


def test_chunkwise_passes_and_rejects_a_gate_that_is_not_restarted():
    def chunkwise_ok(q, k, v, alpha, chunk_size):
        return linear_attention(q, k, v, alpha=alpha, output_final_state=True, backend="chunk", chunk_size=chunk_size)
    assert ch01.chunkwise.evaluate(chunkwise_ok).status == "passed"

    def global_cumsum(q, k, v, alpha, chunk_size):
        g_all = torch.log(alpha).clamp_min(-60.0).cumsum(-1)
        M = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1], q.shape[-1])
        outs = []
        for s in range(0, q.shape[2], chunk_size):
            e = min(s + chunk_size, q.shape[2])
            o, M = library_chunk_step(M, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], g_all[:, :, s:e])
            outs.append(o)
        return torch.cat(outs, 2), M
    v = ch01.chunkwise.evaluate(global_cumsum)
    assert v.status == "failed" and "chunk_size=" in v.message


def test_a_float32_step_inside_a_float64_answer_is_named():
    """The answer's dtype is right (float64), its digits are float32's: the message says so."""
    def pinv_in_float32(K, V):
        return (V.float() @ torch.linalg.pinv(K.float())).double()
    v = ch01.capacity.evaluate(pinv_in_float32, lambda d_k, d_v: d_k)
    assert v.status == "failed" and "float32's rounding" in v.message and "dtype=x.dtype" in v.message, v.message
    v = ch01.capacity.evaluate(lambda K, V: V @ torch.linalg.pinv(K) * (1 + 1e-3), lambda d_k, d_v: d_k)
    assert v.status == "failed" and "float32" not in v.message, v.message        # a real error: no such hint


def test_a_nan_in_a_torch_answer_points_at_the_computation():
    """A NaN from torch code is an undefined operation, not an entry a kernel never stored."""
    def log_of_zero(q, k, v, alpha):
        o, M = gated_loop_ok(q, k, v, alpha)
        return o * (torch.log(torch.zeros(())) - torch.log(torch.zeros(()))), M
    v = ch01.gated_loop.evaluate(log_of_zero)
    assert v.status == "failed" and "inf - inf" in v.message and "never wrote" not in v.message, v.message


@triton.jit
def _nan_source_kernel(x, out, n, CAUSE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    if CAUSE == "unstored":             # the last entry's store masked off
        tl.store(out + i, tl.load(x + i, mask=i < n, other=0.0), mask=i < n - 1)
    elif CAUSE == "lane":               # a sum over the masked-off lanes of a load without other=
        a = tl.load(x + i, mask=i < n).to(tl.float32)
        tl.store(out + i, (tl.sum(a, axis=0) + a * 0).to(out.dtype.element_ty), mask=i < n)
    else:                               # 0/0
        a = tl.load(x + i, mask=i < n, other=0.0) * 0.0
        tl.store(out + i, a / a, mask=i < n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("cause, says", [("unstored", "never stored"), ("lane", "other=0.0"),
                                         ("invalid", "computed it: a 0/0")])
def test_a_nan_in_a_kernel_output_is_told_by_its_payload(cause, says, dtype):
    """A NaN in a kernel's output names its likely cause: an entry no store reached keeps the output buffer's
    NaN, a masked-off lane of a load without other= holds the interpreter's, and an invalid operation makes
    the default NaN (each message was "never wrote" before, written or not)."""
    from atlaslib.exercises.checking import CheckFailed, compare, guarded_output
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the interpreter (its undefined lanes are what the kernel reads)")
    out = guarded_output((5,), dtype=dtype)
    _nan_source_kernel[(1,)](torch.ones(5, dtype=dtype), out, 5, CAUSE=cause, BLOCK=8)
    with pytest.raises(CheckFailed, match="NaN at index") as failure:
        compare("out", out, torch.full((5,), 5.0 if cause == "lane" else 1.0, dtype=dtype), 1e-3,
                kernel_output=True)
    assert says in str(failure.value) and "never wrote" not in str(failure.value), str(failure.value)


def test_capacity_passes_and_rejects_hebbian_and_normal_equations():
    def memory_ok(K, V):
        return least_squares_memory(K.T, V.T)
    assert ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: d_k).status == "passed"
    assert ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: torch.tensor(float(d_k))).status == "passed"
    assert ch01.capacity.evaluate(lambda K, V: V @ K.T, lambda d_k, d_v: d_k).status == "failed"
    # (K^T K)^{-1} K^T is K^+ only for independent keys: wrong (or singular) beyond m = d_k
    normal = ch01.capacity.evaluate(lambda K, V: V @ torch.linalg.inv(K.T @ K) @ K.T, lambda d_k, d_v: d_k)
    # (at m = d_k it is K^{-1} through K^T K, whose squared condition number can cost the 1e-8 on a draw)
    assert normal.status in ("failed", "error") and any(f"({m} d_k)" in normal.message for m in ("m =", "m >", "m >>"))
    wrong = ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: min(d_k, d_v))
    assert wrong.status == "failed" and "your answer" in wrong.message
    assert ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: True).status == "failed"
    # a number is compared as a number: d_k + 0.5 is not d_k, a float d_k is
    half = ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: d_k + 0.5)
    assert half.status == "failed" and "is not right" in half.message, half.message
    assert ch01.capacity.evaluate(memory_ok, lambda d_k, d_v: float(d_k)).status == "passed"


def test_capacity_rejects_pseudo_inverses_that_need_full_rank_keys():
    """(K^T K)^{-1} K^T for m <= d_k and K^T (K K^T)^{-1} beyond: K^+ whenever the keys have full rank, so
    only keys of lower rank (6 keys spanning 3 dimensions) tell it from V K^+."""
    def by_cases(K, V):
        d_k, m = K.shape
        if m <= d_k:
            return V @ torch.linalg.solve(K.T @ K, K.T)
        return V @ K.T @ torch.linalg.inv(K @ K.T)
    v = ch01.capacity.evaluate(by_cases, lambda d_k, d_v: d_k)
    assert v.status in ("failed", "error") and "rank-deficient keys" in v.message, v.message


# ---- the Triton exercise: a correct kernel, and the masking mistakes it must catch --------

@triton.jit
def state_update_variants(M_ptr, k_ptr, v_ptr, g_ptr, out_ptr, n, K, V,
                          BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                          MASK_LOADS: tl.constexpr, MASK_STORE: tl.constexpr, LAST_OF_BLOCK: tl.constexpr,
                          OTHER: tl.constexpr, ONE_PAST: tl.constexpr, PRECISION: tl.constexpr,
                          BF16: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    t, c, r = tl.arange(0, BT), tl.arange(0, BK), tl.arange(0, BV)
    if MASK_LOADS:
        m_t, m_c, m_r = t < n, c < K, r < V
    else:
        m_t, m_c, m_r = t < BT, c < BK, r < BV
    if OTHER:
        k = tl.load(k_ptr + i * n * K + t[:, None] * K + c[None, :], mask=m_t[:, None] & m_c[None, :], other=0.0)
        v = tl.load(v_ptr + i * n * V + t[:, None] * V + r[None, :], mask=m_t[:, None] & m_r[None, :], other=0.0)
    else:                                               # padding rows left to whatever the card holds
        k = tl.load(k_ptr + i * n * K + t[:, None] * K + c[None, :], mask=m_t[:, None] & m_c[None, :])
        v = tl.load(v_ptr + i * n * V + t[:, None] * V + r[None, :], mask=m_t[:, None] & m_r[None, :])
    g = tl.load(g_ptr + i * n + t, mask=t < n, other=0.0)
    if LAST_OF_BLOCK:
        g_last = tl.sum(tl.where(t == BT - 1, g, 0.0))   # the padded row, not the last real token
    else:
        g_last = tl.load(g_ptr + i * n + n - 1)
    state = i * V * K + r[:, None] * K + c[None, :]
    M = tl.load(M_ptr + state, mask=(r < V)[:, None] & (c < K)[None, :], other=0.0)
    vw = tl.trans(v * tl.exp(g_last - g)[:, None])
    if BF16:                                            # operands rounded to 8 bits: "ieee" cannot undo that
        M_next = M * tl.exp(g_last) + tl.dot(vw.to(tl.bfloat16), k.to(tl.bfloat16), input_precision=PRECISION)
    else:
        M_next = M * tl.exp(g_last) + tl.dot(vw, k, input_precision=PRECISION)
    if ONE_PAST:                                        # also row V, column 0: the entry just past the matrix
        inside = (r < V)[:, None] & (c < K)[None, :]
        tl.store(out_ptr + state, M_next, mask=inside | ((r[:, None] == V) & (c[None, :] == 0)))
    elif MASK_STORE:
        tl.store(out_ptr + state, M_next, mask=(r < V)[:, None] & (c < K)[None, :])
    else:
        tl.store(out_ptr + state, M_next, mask=(r < V)[:, None] & (c < BK)[None, :])


def launcher(mask_loads=True, mask_store=True, last_of_block=False, other=True, one_past=False, precision="ieee",
             bf16=False):
    def state_update(M, k, v, g, out):
        N, n, K = k.shape
        V = v.shape[-1]
        BT, BK, BV = (max(16, triton.next_power_of_2(x)) for x in (n, K, V))
        state_update_variants[(N,)](M, k, v, g, out, n, K, V, BT=BT, BK=BK, BV=BV, MASK_LOADS=mask_loads,
                                    MASK_STORE=mask_store, LAST_OF_BLOCK=last_of_block, OTHER=other,
                                    ONE_PAST=one_past, PRECISION=precision, BF16=bf16)
        return out
    return state_update


def test_triton_check_passes_a_correct_kernel():
    v = ch01.triton_state_update.evaluate(launcher())
    assert v.status == "passed", v.message


@triton.jit
def decay_state_kernel(M_ptr, g_ptr, out_ptr, n, K, V, BK: tl.constexpr, BV: tl.constexpr):
    i = tl.program_id(0)
    c, r = tl.arange(0, BK), tl.arange(0, BV)
    at, inside = i * V * K + r[:, None] * K + c[None, :], (r < V)[:, None] & (c < K)[None, :]
    g_last = tl.load(g_ptr + i * n + n - 1)
    tl.store(out_ptr + at, tl.load(M_ptr + at, mask=inside, other=0.0) * tl.exp(g_last), mask=inside)


@triton.jit
def add_token_kernel(k_ptr, v_ptr, g_ptr, out_ptr, t, n, K, V, BK: tl.constexpr, BV: tl.constexpr):
    i = tl.program_id(0)
    c, r = tl.arange(0, BK), tl.arange(0, BV)
    at, inside = i * V * K + r[:, None] * K + c[None, :], (r < V)[:, None] & (c < K)[None, :]
    k_t = tl.load(k_ptr + i * n * K + t * K + c, mask=c < K, other=0.0)
    v_t = tl.load(v_ptr + i * n * V + t * V + r, mask=r < V, other=0.0)
    w = tl.exp(tl.load(g_ptr + i * n + n - 1) - tl.load(g_ptr + i * n + t))
    old = tl.load(out_ptr + at, mask=inside, other=0.0)              # what the launches before stored
    tl.store(out_ptr + at, old + w * v_t[:, None] * k_t[None, :], mask=inside)


def test_triton_check_passes_launches_that_accumulate_into_the_output():
    """A correct answer in n + 1 launches, each after the first reading what the one before stored:
    the outputs are filled with NaN before the first launch only."""
    def state_update(M, k, v, g, out):
        N, n, K = k.shape
        V = v.shape[-1]
        BK, BV = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
        decay_state_kernel[(N,)](M, g, out, n, K, V, BK=BK, BV=BV)          # out = e^{g_n} M
        for t in range(n):                                                   # out += e^{g_n - g_t} v_t k_t^T
            add_token_kernel[(N,)](k, v, g, out, t, n, K, V, BK=BK, BV=BV)
        return out
    v = ch01.triton_state_update.evaluate(state_update)
    assert v.status == "passed", v.message


@triton.jit
def negate_kernel(o_ptr, n, BL: tl.constexpr):
    i = tl.arange(0, BL)
    tl.store(o_ptr + i, -tl.load(o_ptr + i, mask=i < n), mask=i < n)


@triton.jit
def zero_kernel(o_ptr, n, BL: tl.constexpr):
    i = tl.arange(0, BL)
    tl.store(o_ptr + i, tl.zeros([BL], tl.float32), mask=i < n)


@triton.jit
def idle_kernel(o_ptr, n, BL: tl.constexpr):
    pass


@triton.jit
def copy_kernel(src_ptr, o_ptr, n, BL: tl.constexpr):
    i = tl.arange(0, BL)
    tl.store(o_ptr + i, tl.load(src_ptr + i, mask=i < n), mask=i < n)


def torch_answer(M, k, v, g):
    g_last = g[:, -1:]
    return torch.exp(g_last)[:, :, None] * M + torch.einsum("nt,ntv,ntk->nvk", torch.exp(g_last - g), v, k)


def smuggled(how):
    """Answers whose numbers come from torch, carried into the output through the kernels' launches."""
    def state_update(M, k, v, g, out):
        n, BL = out.numel(), triton.next_power_of_2(out.numel())
        if how == "torch before a negating launch":
            idle_kernel[(1,)](out, n, BL=BL)
            out.copy_(-torch_answer(M, k, v, g))
            negate_kernel[(1,)](out, n, BL=BL)
        elif how == "torch before the first launch":
            out.copy_(-torch_answer(M, k, v, g))
            idle_kernel[(1,)](out, n, BL=BL)
            negate_kernel[(1,)](out, n, BL=BL)
        elif how == "torch between launches":
            zero_kernel[(1,)](out, n, BL=BL)
            out.copy_(torch_answer(M, k, v, g))
            idle_kernel[(1,)](out, n, BL=BL)
        elif how == "torch into a scratch buffer":       # the kernel only copies what torch computed
            scratch = torch_answer(M, k, v, g).contiguous()
            copy_kernel[(1,)](scratch, out, n, BL=BL)
        else:                                            # through an input, undone after the launch
            M0 = M.clone()
            M.copy_(torch_answer(M0, k, v, g))
            copy_kernel[(1,)](M, out, n, BL=BL)
            M.copy_(M0)
        return out
    return state_update


@pytest.mark.parametrize("how, where", [
    ("torch before a negating launch", "changed between two launches"),
    ("torch before the first launch", "written with torch before it"),
    ("torch between launches", "changed between two launches"),
    ("torch through an input", "(an input) was changed before a launch"),
    ("torch into a scratch buffer", "not one of your function's arguments"),
])
def test_triton_check_refuses_values_written_with_torch(how, where):
    v = ch01.triton_state_update.evaluate(smuggled(how))
    assert v.status == "failed" and where in v.message, v.message


def test_triton_check_requires_a_kernel_launch():
    def plain_torch(M, k, v, g, out):     # the right numbers, without a kernel
        g_last = g[:, -1:]
        w = torch.exp(g_last - g)
        out.copy_(torch.exp(g_last)[:, :, None] * M + torch.einsum("nt,ntv,ntk->nvk", w, v, k))
    v = ch01.triton_state_update.evaluate(plain_torch)
    assert v.status == "failed" and "without launching a @triton.jit kernel" in v.message, v.message


@triton.jit
def _put(out_ptr, i, x):
    tl.store(out_ptr + i, x)


@triton.jit
def _put_row(out_ptr, row_ptr, i, K, BK: tl.constexpr):
    c = tl.arange(0, BK)        # one row, loaded from an input it was given: a read, so a replay changes it
    tl.store(out_ptr + i * K + c, tl.load(row_ptr + c, mask=c < K, other=0.0), mask=c < K)


def test_triton_check_refuses_values_handed_to_the_kernel_as_numbers():
    """Computed with torch and stored entry by entry by a kernel that receives each value as a number: every
    entry is stored by the notebook's own kernel, from its own arguments, yet the kernel computes nothing. The
    launches, run again on the inputs reordered, store the same values: refused."""
    def smuggler(M, k, v, g, out):
        g_last = g[:, -1:]
        want = torch.exp(g_last)[:, :, None] * M + torch.einsum("nt,ntv,ntk->nvk", torch.exp(g_last - g), v, k)
        for i, x in enumerate(want.reshape(-1).tolist()):
            _put[(1,)](out, i, x)
        return out
    v = ch01.triton_state_update.evaluate(smuggler)
    assert v.status == "failed" and "stored the same values when the check ran its launches again" in v.message, \
        v.message


@triton.jit
def _put_if_unmoved(out_ptr, k_ptr, i, x, k0):
    if tl.load(k_ptr) != k0:          # raises (in the interpreter) once the inputs are reordered
        tl.static_assert(False, "the inputs moved")
    tl.store(out_ptr + i, x)


def test_triton_check_refuses_a_kernel_whose_replay_always_raises():
    """The smuggler above, with a kernel that reads one input only to fail when its values move: no replay
    stores anything, so the replay cannot vouch for the kernel, and the check says so."""
    def smuggler(M, k, v, g, out):
        g_last = g[:, -1:]
        want = torch.exp(g_last)[:, :, None] * M + torch.einsum("nt,ntv,ntk->nvk", torch.exp(g_last - g), v, k)
        k0 = k.reshape(-1)[0].item()
        for i, x in enumerate(want.reshape(-1).tolist()):
            _put_if_unmoved[(1,)](out, k, i, x, k0)
        return out
    v = ch01.triton_state_update.evaluate(smuggler)
    assert v.status == "failed" and "raised whenever the check ran its launches again" in v.message, v.message


def test_triton_check_names_both_outcomes_when_a_replay_raises_on_some_cases_only():
    """The smuggler once more, raising on every other case's replay and storing the same values on the rest:
    refused, and the message says both, not only "the same values"."""
    calls = []

    def smuggler(M, k, v, g, out):
        calls.append(None)
        g_last = g[:, -1:]
        want = torch.exp(g_last)[:, :, None] * M + torch.einsum("nt,ntv,ntk->nvk", torch.exp(g_last - g), v, k)
        k0 = k.reshape(-1)[0].item()
        for i, x in enumerate(want.reshape(-1).tolist()):
            if len(calls) % 2:
                _put_if_unmoved[(1,)](out, k, i, x, k0)
            else:
                _put[(1,)](out, i, x)
        return out
    v = ch01.triton_state_update.evaluate(smuggler)
    assert len(calls) > 1
    assert v.status == "failed" and "raised or stored the same values when the check ran" in v.message, v.message


def test_a_kernel_that_reads_an_input_it_was_given_is_not_taken_for_a_smuggler():
    """The replay only refuses kernels whose stores never changed: one that copies a row of its input (whatever
    else it does) stores other values once the inputs are reordered."""
    from atlaslib.exercises.checking import guarded, guarded_output, run_under_rules
    rows = guarded(torch.randn(3, 5))

    def copy_rows(x, out):
        for i in range(3):
            _put_row[(1,)](out, x[i], i, 5, BK=8)
        return out
    out = guarded_output((3, 5))
    result, (launches, moved) = run_under_rules(copy_rows, (rows, out), {}, (), outputs=(1,))
    assert torch.equal(out, rows) and launches == 3 and moved is True
    constant = guarded(torch.ones(3, 5))            # nothing to reorder: no verdict either way
    assert run_under_rules(copy_rows, (constant, guarded_output((3, 5))), {}, (), outputs=(1,))[1] == (3, None)


@triton.jit
def _exp_of_steps(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    step = tl.load(x_ptr + r + 1, mask=r < n - 1, other=0.0) - tl.load(x_ptr + r, mask=r < n - 1, other=0.0)
    tl.store(out_ptr + r, tl.exp(step), mask=r < n - 1)


def test_the_replay_keeps_its_overflows_to_itself():
    """Reordered, a decreasing input (cumulative log-gates) increases: e^{x_{i+1} - x_i} overflows in the
    replay, which must not warn the learner about a kernel that is correct on the inputs it was given."""
    import warnings

    from atlaslib.exercises.checking import guarded, guarded_output, run_under_rules
    x = guarded(-100.0 * torch.arange(6, dtype=torch.float32))

    def steps(x, out):
        _exp_of_steps[(1,)](x, out, 6, BLOCK=8)
        return out
    out = guarded_output((5,))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, (launches, moved) = run_under_rules(steps, (x, out), {}, (), outputs=(1,))
    assert launches == 1 and moved is True and torch.allclose(out, torch.full((5,), math.exp(-100.0)))


def test_triton_check_catches_unmasked_loads():
    v = ch01.triton_state_update.evaluate(launcher(mask_loads=False))
    assert v.status == "failed" and "loaded" in v.message and "mask every load" in v.message


def test_triton_check_catches_masked_loads_without_other():
    """Padding rows loaded without other=0.0 are undefined on a GPU; atlaslib's interpreter makes them NaN."""
    v = ch01.triton_state_update.evaluate(launcher(other=False))
    assert v.status == "failed" and "NaN" in v.message and "other=0.0" in v.message, v.message


def test_triton_check_catches_stores_past_the_end():
    v = ch01.triton_state_update.evaluate(launcher(mask_store=False))
    assert v.status == "failed" and "wrote" in v.message


def test_triton_check_catches_one_store_past_the_end():
    """The last program's stray store lands on the very first entry after the output (the others' land on the
    next matrix, which its own program then overwrites): the band must be checked from that entry on."""
    v = ch01.triton_state_update.evaluate(launcher(one_past=True))
    assert v.status == "failed" and "wrote 1 value(s) past the end of out" in v.message, v.message


def test_triton_check_catches_gate_of_the_padded_row():
    v = ch01.triton_state_update.evaluate(launcher(last_of_block=True))
    assert v.status == "failed"


def test_triton_check_names_tf32_products():
    """tl.dot's default TF32 products (as a card makes them; the interpreter copies it) fail the check with the
    same tolerance as on a card, and the message says what the error's size means."""
    v = ch01.triton_state_update.evaluate(launcher(precision="tf32"))
    assert v.status == "failed" and 'input_precision="ieee"' in v.message, v.message
    v = ch01.triton_state_update.evaluate(launcher(last_of_block=True))     # a wrong kernel gets no such hint
    assert v.status == "failed" and "TF32" not in v.message, v.message


def test_triton_check_names_operands_cast_to_16_bits():
    """Operands cast to bf16 cost an error of the same size, which input_precision="ieee" does not remove: the
    hint names both causes."""
    v = ch01.triton_state_update.evaluate(launcher(bf16=True))
    assert v.status == "failed" and "fp16/bf16" in v.message and 'input_precision="ieee"' in v.message, v.message


@pytest.mark.library_rules
@pytest.mark.parametrize("path", SOLUTION_NOTEBOOKS, ids=lambda p: p.name)
def test_every_statement_names_what_its_check_forbids(path):
    """The statement (the markdown cell before an exercise's first cell) lists, by dotted name, every
    function its check refuses, so a learner learns the rules before the grader enforces them."""
    nb = nbformat.read(path, as_version=4)
    missing = {}
    for ex in registry(nb.metadata["atlaslib"]["chapter"]):
        first = next(i for i, c in enumerate(nb.cells)
                     if c.get("metadata", {}).get("atlaslib", {}).get("exercise") == ex.name)
        statement = next(c.source for c in reversed(nb.cells[:first]) if c.cell_type == "markdown")
        absent = [name for name in ex.forbidden if f"`{name}`" not in statement]
        if ex.needs_launch and "passed to a kernel as numbers do not count" not in statement:
            absent.append("the replay rule (values passed to a kernel as numbers)")
        if absent:
            missing[ex.name] = absent
    assert not missing, f"statements do not name what their checks forbid: {missing}"


@triton.jit
def _add_two_inputs(a_ptr, b_ptr, out_ptr, n, BLOCK: tl.constexpr, OVER: tl.constexpr):
    r = tl.arange(0, BLOCK)
    x = tl.load(a_ptr + r, mask=r < n + OVER, other=0.0) + tl.load(b_ptr + r, mask=r < n, other=0.0)
    tl.store(out_ptr + r, x, mask=r < n)


def test_loads_are_checked_by_address_and_views_of_one_buffer_are_not_each_others_band():
    """Under the interpreter a load outside every argument fails the check; two arguments that are views of
    one buffer (side by side) may read each other, the band beyond both may not be read, not even its first
    entry."""
    from atlaslib.exercises.checking import guarded, guarded_output, run_under_rules
    both = guarded(torch.randn(10))

    def add(a, b, out, over):
        _add_two_inputs[(1,)](a, b, out, 5, BLOCK=16, OVER=over)
        return out
    for over in (0, 5):                   # a[5:10] is b: allowed
        out = guarded_output((5,))
        run_under_rules(add, (both[:5], both[5:], out, over), {}, (), outputs=(2,))
        assert torch.equal(out, both[:5] + both[5:])
    with pytest.raises(Exception, match="loaded 1 value.s. past the end of argument 1"):
        run_under_rules(add, (both[:5], both[5:], guarded_output((5,)), 6), {}, (), outputs=(2,))
    with pytest.raises(Exception, match="loaded 1 value.s. past the end of argument 1"):
        # one past the end of an input that is not next to another argument: the band's very first entry
        run_under_rules(add, (guarded(torch.randn(5)), guarded(torch.randn(5)), guarded_output((5,)), 1), {}, (),
                        outputs=(2,))


@triton.jit
def _read_around(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    r = tl.arange(0, BLOCK)
    tl.store(o_ptr + r, tl.load(x_ptr + r - 1, mask=r < n + 2), mask=r < n + 2)


def test_a_guarded_input_sits_between_nan():
    """On a GPU no load is watched: a load just before or past a guarded input must read NaN, which then shows
    in the output (a band of zeros would let an unmasked load of padding pass unseen)."""
    from atlaslib.exercises.checking import guarded
    x = torch.randn(5)
    around = torch.zeros(7)
    _read_around[(1,)](guarded(x), around, 5, BLOCK=8)
    assert around[0].isnan() and around[-1].isnan() and torch.equal(around[1:-1], x), around


@triton.jit
def _gather(idx_ptr, x_ptr, out_ptr, n, BLOCK: tl.constexpr, INDEX: tl.constexpr):
    r = tl.arange(0, BLOCK)
    if INDEX == "other":
        j = tl.load(idx_ptr + r, mask=r < n, other=-1)
    elif INDEX == "no_other":                           # the masked-off lanes undefined (the largest int here)
        j = tl.load(idx_ptr + r, mask=r < n)
    else:                                               # past the end of the index table
        j = tl.load(idx_ptr + r)
    tl.store(out_ptr + r, tl.load(x_ptr + j, mask=j >= 0, other=0.0), mask=r < n)


def test_a_load_outside_every_argument_is_refused_before_it_runs():
    """An address in no argument's storage (an index read from masked-off lanes, or from past the end of a table)
    is refused before the load, which could crash the process; a stray load of the band before it is the cause
    named. Either fails the check."""
    from atlaslib.exercises import checking
    from atlaslib.exercises.checking import guarded, guarded_output, run_under_rules
    x = guarded(torch.randn(8))

    def gather(index):
        def fn(idx, x, out):
            _gather[(1,)](idx, x, out, 5, BLOCK=8, INDEX=index)
            return out
        return fn
    idx = torch.tensor([3, -1, 0, 7, 2], dtype=torch.int32)
    out = guarded_output((5,))
    run_under_rules(gather("other"), (guarded(idx), x, out), {}, (), outputs=(2,))
    assert torch.equal(out, torch.where(idx >= 0, x[idx.clamp_min(0).long()], 0.0))
    with pytest.raises(Exception, match="loaded 3 value.s. outside every tensor .* other=-1"):
        run_under_rules(gather("no_other"), (guarded(idx), x, guarded_output((5,))), {}, (), outputs=(2,))
    with pytest.raises(Exception, match="loaded 3 value.s. past the end of argument 1"):
        run_under_rules(gather("unmasked"), (guarded(idx), x, guarded_output((5,))), {}, (), outputs=(2,))

    @checking.Registry("test").check("gather", title="A gather", points=1, functions=("fn",), needs_launch=True)
    def gather_check(fn, gen):
        out = guarded_output((5,))
        checking.call(fn, guarded(idx), x, out)
        return "gathered"
    v = gather_check.evaluate(gather("no_other"))
    assert v.status == "failed" and "outside every tensor" in v.message, v.message
