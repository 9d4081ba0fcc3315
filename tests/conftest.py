"""Test set-up: Triton's interpreter on (before atlaslib is imported), fixed threads."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture
def gen():
    """A fresh, unseeded-by-hand generator: every run draws new inputs (seed printed on failure)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"generator seed: {seed}")
    return torch.Generator().manual_seed(seed)


def pytest_configure(config):
    config.addinivalue_line("markers", "library_rules: keep the exercises' ban on calling the library's answer")


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
