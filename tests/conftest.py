"""Test set-up: Triton's interpreter on (before atlaslib is imported), fixed threads, reproducible seeds,
and the interpreter made to behave more like a GPU in two ways (``tests/interpreter_checks.py``: programs in
reversed order, every load and store inside a tensor argument; ``ATLAS_INTERPRETER_CHECKS=0`` turns it off).

Random inputs are reproducible: every test starts from a seed derived from one base seed and the
test's id (so a test draws the same inputs whether it runs alone or in the whole suite, whatever
the order). The base seed is printed in pytest's header; ``ATLASLIB_TEST_SEED=<int>`` changes it,
``ATLASLIB_TEST_SEED=random`` draws a fresh one (also printed, so a failure can be replayed).
"""
import os
import zlib

os.environ.setdefault("TRITON_INTERPRET", "1")
# The tolerances are those of exact fp32 products: a reader's ATLASLIB_TF32=1 (the benchmark's opt-in)
# would fail every fp32 kernel test; tests that want TF32 set it themselves (monkeypatch).
TF32_IGNORED = os.environ.pop("ATLASLIB_TF32", None) is not None

import pytest  # noqa: E402
import torch  # noqa: E402

# Two threads, the two cores CI has; one per process when pytest-xdist runs two (`make test-rest`,
# `make test-fast`).
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)

INTERPRETER_CHECKS = os.environ["TRITON_INTERPRET"] == "1" and os.environ.get("ATLAS_INTERPRETER_CHECKS") != "0"
if INTERPRETER_CHECKS:
    import interpreter_checks  # noqa: E402
    interpreter_checks.install()

DEFAULT_SEED = 20250101


def _base_seed() -> int:
    value = os.environ.get("ATLASLIB_TEST_SEED", "").strip()
    if value == "random":
        seed = int.from_bytes(os.urandom(4), "little")
        os.environ["ATLASLIB_TEST_SEED"] = str(seed)   # pytest-xdist's processes, started later, draw no other
        return seed
    try:
        return int(value) if value else DEFAULT_SEED
    except ValueError:
        raise pytest.UsageError(f"ATLASLIB_TEST_SEED must be an integer or 'random', got {value!r}") from None


try:                     # a bad value is reported by pytest_configure as a usage error, not as a broken conftest
    BASE_SEED, SEED_ERROR = _base_seed(), None
except pytest.UsageError as e:
    BASE_SEED, SEED_ERROR = DEFAULT_SEED, e


def pytest_report_header(config):
    lines = [f"atlaslib test seed: {BASE_SEED} (ATLASLIB_TEST_SEED=<int> or =random to change it)"]
    if TF32_IGNORED:
        lines.append("ATLASLIB_TF32 ignored: the tests check exact fp32 products")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The seed again at the end (``-q`` hides the header), where a failure or a chosen seed needs it."""
    if exitstatus != 0 or os.environ.get("ATLASLIB_TEST_SEED"):
        terminalreporter.write_line(f"atlaslib test seed: {BASE_SEED} (rerun with ATLASLIB_TEST_SEED={BASE_SEED})")


def seed_of(nodeid: str) -> int:
    """The seed of one test: the base seed mixed with the test's id (stable across runs and orders)."""
    return zlib.crc32(f"{BASE_SEED}:{nodeid}".encode()) & 0x7FFFFFFF


@pytest.fixture(autouse=True)
def seeded_global_rng(request):
    """Seed torch's global generator for every test, so draws from it are reproducible too."""
    torch.manual_seed(seed_of(request.node.nodeid))


@pytest.fixture
def gen(request):
    """A generator seeded for this test (see the module's docstring); its seed is printed on failure."""
    seed = seed_of(request.node.nodeid) ^ 0x5EED
    print(f"generator seed: {seed} (base seed {BASE_SEED}: rerun with ATLASLIB_TEST_SEED={BASE_SEED})")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poisoned(monkeypatch):
    """The kernels' output buffers NaN-filled for the whole test (as ``core.testing.poisoned_outputs``)."""
    from atlaslib.core import alloc
    from atlaslib.core.testing import nan_filled
    monkeypatch.setattr(alloc, "allocate", nan_filled(alloc.allocate))


def pytest_configure(config):
    if SEED_ERROR is not None:
        raise SEED_ERROR
    config.addinivalue_line("markers", "library_rules: keep the exercises' ban on calling the library's answer")
    config.addinivalue_line("markers", "slow: left out by `make test-fast` (see SLOW_FILES and SLOW_TESTS)")


# What `make test-fast` (pytest -m "not slow") leaves out, so that it runs in a few minutes on 2 cores:
# the files that build the book, drive a browser, run notebooks or the grader, compile, train or launch
# processes, and the library tests that take longest (measured CPU time, one thread, Triton's
# interpreter). Everything here still runs in `make test-lib`.
SLOW_FILES = {
    "test_book.py", "test_browser.py", "test_lab.py", "test_grader.py", "test_exercises.py",
    "test_exercises_ch02.py", "test_exercises_ch03.py", "test_exercises_ch04.py", "test_exercises_ch05.py",
    "test_exercises_ch06.py", "test_exercises_ch07.py", "test_aot.py", "test_ddp.py", "test_experiments.py",
    "test_nn_train.py", "test_compile.py", "test_workflows.py", "test_bench.py",
    # GPU tests (`make gpu-test`), and the chapters' long files: chapters 3-7 reach test-fast through
    # their mixers, test_log_alpha and the deep memories' files instead.
    "test_atlas.py", "test_caching.py", "test_caching_kernel.py", "test_deep.py", "test_deep_dot.py",
    "test_deep_kernel.py", "test_entry_points.py", "test_gpu.py", "test_miras.py", "test_miras_kernel.py",
    "test_omega.py", "test_step.py", "test_tasks.py",
}
# Tests as file::function (every parametrization) or file::function[parameters] (that one).
SLOW_TESTS: set[str] = {
    "test_caching_mixers.py::test_mqar_training_lowers_the_loss",
    "test_deep_mixers.py::test_shape_causality_and_gradients[dla-kw8]",
    "test_deep_mixers.py::test_tinylm_trains_and_generates[deep_transformer-kw0]",
    "test_deep_mixers.py::test_tinylm_trains_and_generates[dla-kw4]",
    "test_deep_mixers.py::test_tinylm_trains_and_generates[dot-kw3]",
    "test_deep_mixers.py::test_tinylm_trains_and_generates[swdt-kw1]",
    "test_delta.py::test_chunk_matches_recurrent[False-None-shape2]",
    "test_delta.py::test_chunk_matches_recurrent[False-channel-shape2]",
    "test_kernels.py::test_views_give_the_contiguous_result_and_match_the_chunk_form",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[miras-chunk]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[miras-triton]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[omega_rule-recurrent]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[omega_rule-triton]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[swla-chunk]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[swla-recurrent]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[swla-triton]",
    "test_log_alpha.py::test_a_gate_bf16_rounds_to_one_still_decays_as_log_alpha[titans_linear_chunk-chunk]",
    "test_log_alpha.py::test_log_alpha_gives_what_alpha_gives[omega_rule (mlp)-recurrent]",
    "test_omega_mixers.py::test_bench_rows",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path, _, rest = item.nodeid.partition("::")
        file = path.rsplit("/", 1)[-1]
        function = f"{file}::{getattr(item, 'originalname', None) or item.name}"
        if file in SLOW_FILES or function in SLOW_TESTS or f"{file}::{rest}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def interpreter_as_learners_see_it(request):
    """The exercise tests feed the graders deliberately wrong kernels (unmasked loads, stores past the
    end): the graders must meet them as a learner's notebook does, without the suite's stricter checks."""
    if not INTERPRETER_CHECKS or "exercises" not in request.node.fspath.basename:
        yield
        return
    import interpreter_checks
    interpreter_checks.checking(False)
    yield
    interpreter_checks.checking(True)


@pytest.fixture(autouse=True)
def library_answers_allowed(request, monkeypatch):
    """The exercise tests check each check's judgement of right and wrong answers, and their
    right answers often call the library (the reference written once). The ban on doing so
    (``Exercise.forbidden``) is lifted for them, except in tests marked ``library_rules``."""
    if "library_rules" in request.keywords or "exercises" not in request.node.fspath.basename:
        return
    from atlaslib.exercises import CHAPTERS, registry
    for chapter in CHAPTERS:
        for exercise in registry(chapter):
            monkeypatch.setattr(exercise, "forbidden", ())
