"""A graceful stop with several ranks: ``eagle3fn train`` as two gloo ranks on the CPU
(launched as torchrun launches them: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR/PORT`` in the
environment), a real SIGTERM sent to every rank (a scheduler's preemption) or to rank 0
alone. Every rank must finish the same optimizer step, one checkpoint is saved, each rank
prints ``stopped by SIGTERM at step N; rerun the same command to resume`` and exits 143,
and the rerun is bitwise equal to an uninterrupted two-rank run.

Control: ranks that each read their own request instead of the step's all-reduced one
(``loop._agreed`` monkeypatched to the local flag) fail the same scenario: with rank 0
signalled alone, rank 1 does not stop with it (it fails in a collective or trains on).

Every rank on one thread; the uninterrupted run is shared by the module."""

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed import TCPStore
from recorders import save_tiny_target, write_tiny_chat

from eagle3fn.train import CHECKPOINT, METRICS
from eagle3fn.train.metrics import read_metrics

WORLD = 2
TIMEOUT = 120
# No periodic save: the checkpoint found after a stop is the stop's own. Two ranks of
# data parallelism, one conversation each per step: 12 steps over 2 epochs.
FLAGS = ["--draft-vocab-size", "64", "--batch-size", "1", "--epochs", "2", "--ttt-length", "3",
         "--save-every", "1000", "--lr", "1e-3", "--trim-loss-positions", "--no-pack"]
TOTAL = 12
# The control's ranks read only their own flag (the pre-fix loop).
LOCAL_ONLY = ("import eagle3fn.train.loop as loop\n"
              "loop._agreed = lambda run, result, stop: stop.signal or 0\n")


def _store() -> TCPStore:
    """The run's rendezvous store, held by the test for the run's life as torchrun's agent
    holds it: its port is bound from the start (``port=0``: the system picks a free one),
    so no concurrent test can take it between choosing it and the ranks' use (a port
    found free and released first could be, and a rank then waited on a stranger's store)."""
    return TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=TIMEOUT))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop_ranks")
    save_tiny_target(root / "model")
    write_tiny_chat(root / "chat.jsonl", 12)
    return root


def _launch(workdir, out, patch: str = "", timeout_s: int = 30) -> list[subprocess.Popen]:
    """The ranks of one ``eagle3fn train`` run, each with torchrun's environment (the ranks
    join the store the test holds, ``TORCHELASTIC_USE_AGENT_STORE``); ``timeout_s``: how
    long a collective waits for a missing peer."""
    store = _store()
    code = patch + "from eagle3fn.cli.main import main\nmain()\n"
    cmd = [sys.executable, "-c", code, "train", "--model", str(workdir / "model"),
           "--data", str(workdir / "chat.jsonl"), "--out-dir", str(out), *FLAGS,
           "--parallel.timeout-s", str(timeout_s)]
    procs = []
    for rank in range(WORLD):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD),
               "LOCAL_WORLD_SIZE": str(WORLD)}
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        procs[-1].store = store  # kept alive (and its port bound) while a rank runs
    return procs


def _wait(procs, timeout: float = TIMEOUT) -> list[tuple[int | None, str]]:
    """(exit code, stderr) of every rank; a rank still running after ``timeout`` is
    killed and reported with exit code None (a hang)."""
    deadline = time.monotonic() + timeout
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
            results.append((p.returncode, err))
        except subprocess.TimeoutExpired:
            p.kill()
            results.append((None, p.communicate()[1]))
    return results


def _run(workdir, out) -> None:
    for code, err in _wait(_launch(workdir, out)):
        assert code == 0, err[-3000:]


def _stop(workdir, out, *, targets: str, patch: str = "", after: int = 3, timeout_s: int = 30):
    """Launch, send SIGTERM to ``targets`` ("all" or "rank0") once ``after`` steps are
    logged, and wait for every rank."""
    procs = _launch(workdir, out, patch, timeout_s)
    while all(p.poll() is None for p in procs) and len(read_metrics(out / METRICS)) < after:
        time.sleep(0.005)
    assert all(p.poll() is None for p in procs), "a rank ended before it could be signalled"
    for p in procs if targets == "all" else procs[:1]:
        p.send_signal(signal.SIGTERM)
    return _wait(procs)


def _params(out) -> dict[str, torch.Tensor]:
    return torch.load(out / CHECKPOINT, weights_only=True)["params"]


def _curve(out) -> list[tuple]:
    return [(r["step"], r["loss"], r["acc"]) for r in read_metrics(out / METRICS)]


@pytest.fixture(scope="module")
def whole(workdir, tmp_path_factory):
    """The uninterrupted two-rank run the stopped-and-resumed ones must reproduce."""
    out = tmp_path_factory.mktemp("whole") / "run"
    _run(workdir, out)
    assert [s for s, _, _ in _curve(out)] == list(range(1, TOTAL + 1))
    return out


@pytest.mark.parametrize("targets", ["all", "rank0"])
def test_sigterm_stops_every_rank_after_the_same_step_and_resumes_bitwise(workdir, whole, tmp_path, targets):
    out = tmp_path / "run"
    results = _stop(workdir, out, targets=targets)
    at_stop = torch.load(out / CHECKPOINT, weights_only=True)["step"]
    assert 3 <= at_stop < TOTAL, at_stop  # the stop's checkpoint, not the end's
    line = f"stopped by SIGTERM at step {at_stop}; rerun the same command to resume"
    for rank, (code, err) in enumerate(results):  # every rank stopped after the same step
        assert code == 143, (rank, code, err[-3000:])
        assert line in err.splitlines(), (rank, err[-3000:])
    assert [s for s, _, _ in _curve(out)] == list(range(1, at_stop + 1))
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [CHECKPOINT]

    _run(workdir, out)  # the same command resumes and finishes
    a, b = _params(whole), _params(out)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert _curve(out) == _curve(whole)


def test_control_a_stop_read_on_one_rank_only_breaks_the_run(workdir, tmp_path):
    """Without the agreement, rank 0 alone signalled stops after its step while rank 1
    goes on into the next one: rank 0's checkpoint gather and rank 1's step wait on each
    other until the collective timeout (5 s here), so the ranks do not all stop with the
    message and exit 143 (the contract the test above checks)."""
    out = tmp_path / "run"
    results = _stop(workdir, out, targets="rank0", patch=LOCAL_ONLY, timeout_s=5)
    stopped = [code == 143 and any(s.startswith("stopped by SIGTERM at step") for s in err.splitlines())
               for code, err in results]
    assert not all(stopped), [(code, err[-1000:]) for code, err in results]
    assert not any(code == 0 for code, _ in results)  # neither rank ended as if nothing happened
