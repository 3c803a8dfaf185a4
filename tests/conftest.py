"""Test settings stricter than production: interpreter Triton, deterministic torch."""

import os

# Must be set before any @triton.jit runs (CI has no GPU).
os.environ.setdefault("TRITON_INTERPRET", "1")
# What deterministic cuBLAS needs on CUDA >= 10.2 (tests/test_gpu.py); no effect on a CPU.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

# Under pytest-xdist (the suite runs on as many workers as cores) each worker and the
# processes it starts compute on one thread: a second thread per worker would only
# contend for the same cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

torch.use_deterministic_algorithms(True)
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
settings.register_profile("ci", deadline=None, max_examples=200, derandomize=True)
settings.load_profile("ci")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after): tiny matmuls, where OpenMP
    fork-join costs more than the work on a loaded CPU. Opt in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def no_gpu():
    """The CPU machine's defaults for a whole module (auto device -> cpu, fp32), GPU or
    not. Opt in with ``pytestmark = pytest.mark.usefixtures("no_gpu")`` or by naming it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        yield


def pytest_collection_modifyitems(config, items):
    """The heaviest test files first, the rest after in their usual order: pytest-xdist's
    ``--dist loadfile`` hands whole files to the workers in collection order, so a heavy
    file collected last keeps one core busy while the other idles (the tail seen on CI's
    2 cores). ``file_costs.json`` holds each file's measured seconds (the sum of its
    ``--durations=0`` lines on a 2-core machine; refresh it after large changes); files
    not in it count 0. The order of the tests inside a file is kept (module fixtures)."""
    import json
    import pathlib

    costs = json.loads((pathlib.Path(__file__).parent / "file_costs.json").read_text())
    items.sort(key=lambda item: -costs.get(item.path.name, 0.0))  # stable: ties keep their order
