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
