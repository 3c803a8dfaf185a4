"""Test settings stricter than production: interpreter Triton, deterministic torch."""

import os

# Must be set before any @triton.jit runs (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.use_deterministic_algorithms(True)
settings.register_profile("ci", deadline=None, max_examples=200, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
