"""SIGTERM / SIGINT stop ``eagle3fn train`` gracefully (``io.stop``): the step in flight
finishes, a checkpoint is saved, the exit code is 143 / 130, and rerunning the same
command resumes to the weights and curve of an uninterrupted run, online and from the
offline cache; a second signal stops at once. The stop module alone: handlers
installed, the request recorded, the old handlers restored.

Every run is on one thread, as in test_kill_resume (same fixtures, same comparison)."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from recorders import prepare_cache, save_tiny_target, write_tiny_chat

from eagle3fn.io.stop import Stopped, graceful_stop
from eagle3fn.train import CHECKPOINT, METRICS, train
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
# No periodic save: whatever checkpoint exists after the stop is the stop's own.
SETTINGS = dict(draft_vocab_size=64, batch_size=1, epochs=2, ttt_length=3, save_every=1000, lr=1e-3,
                trim_loss_positions=True, pack=False)
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


def test_graceful_stop_records_the_signal_and_restores_the_handlers():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with graceful_stop(unit="step") as stop:
        assert stop.installed and not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while not stop.requested and time.monotonic() < deadline:  # the handler runs between bytecodes
            time.sleep(0.001)
        assert stop.requested and stop.signal == signal.SIGTERM and stop.name == "SIGTERM"
        # a second signal would take the default action (stop at once)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL == signal.getsignal(signal.SIGINT)
        err = stop.stopped("step 7")
    assert {s: signal.getsignal(s) for s in before} == before
    assert isinstance(err, Stopped) and err.exit_code == 143
    assert str(err) == "stopped by SIGTERM at step 7; rerun the same command to resume"
    assert Stopped(signal.SIGINT, "step 1").exit_code == 130


def _wait(condition):
    deadline = time.monotonic() + 5
    while not condition() and time.monotonic() < deadline:  # handlers run between bytecodes
        time.sleep(0.001)


def test_under_torchrun_the_launchers_forwarded_copy_is_ignored(monkeypatch):
    """Under torchrun (``TORCHELASTIC_RUN_ID``) a scheduler's SIGTERM reaches a worker
    directly and again through the launcher: the repeat of the same signal within
    ``LAUNCHER_REPEAT_S`` is ignored (the stop stays graceful), a later repeat or the
    other signal stops at once. Control: outside a launcher the first signal already
    puts the default action back (a repeat would kill the process)."""
    import eagle3fn.io.stop as stop_module

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    with graceful_stop() as stop:
        assert stop.repeat_window_s == stop_module.LAUNCHER_REPEAT_S > 0
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(lambda: stop.requested)
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's copy: this process lives on
        time.sleep(0.05)
        assert stop.requested and stop.signal == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) == stop._handle  # still ours: not the default action
        with monkeypatch.context() as patch:  # os.kill recorded, not sent (the module is os itself)
            killed = []
            patch.setattr(stop_module.os, "kill", lambda pid, signum: killed.append(signum))
            stop._handle(signal.SIGINT, None)  # the other signal: at once
            assert killed == [signal.SIGINT] and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
            signal.signal(signal.SIGTERM, stop._handle)
            signal.signal(signal.SIGINT, stop._handle)
            stop.first_at -= stop.repeat_window_s + 1  # the first signal, long ago
            stop._handle(signal.SIGTERM, None)  # the same signal, later: a real second request
            assert killed == [signal.SIGINT, signal.SIGTERM]
            assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    with graceful_stop() as stop:
        assert stop.repeat_window_s == 0
        os.kill(os.getpid(), signal.SIGTERM)
        _wait(lambda: stop.requested)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a repeat would stop at once


def _setup(tmp_path, source, monkeypatch, n=12):
    save_tiny_target(tmp_path / "model")
    write_tiny_chat(tmp_path / "chat.jsonl", n)
    data = dict(model=str(tmp_path / "model"), data=str(tmp_path / "chat.jsonl"))
    if source == "cache":  # one conversation per shard, bf16 on disk: a micro-batch per shard
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        prepare_cache(tmp_path, tmp_path / "cache", "--batch-size", "1", storage="bfloat16")
        data = dict(model=str(tmp_path / "model"), cache=str(tmp_path / "cache"))
    return data


def _command(data: dict, out) -> list[str]:
    flags = [(f"--no-{k}" if v is False else f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}"))
             for k, v in {**data, **SETTINGS}.items()]
    return [sys.executable, "-m", "eagle3fn.cli", "train", *flags, f"--out-dir={out}"]


def _signal_after(proc, out, rows: int, signum: int) -> None:
    """Send ``signum`` once ``rows`` steps are logged (each step writes its row)."""
    while proc.poll() is None and len(read_metrics(out / METRICS)) < rows:
        time.sleep(0.005)
    assert proc.poll() is None, "the run ended before it could be signalled"
    proc.send_signal(signum)


@pytest.mark.parametrize("source,signum", [("online", signal.SIGTERM), ("cache", signal.SIGINT)])
def test_signal_mid_run_saves_and_the_rerun_matches_an_uninterrupted_run(tmp_path, source, signum, monkeypatch):
    data = _setup(tmp_path, source, monkeypatch)
    total = 24
    stopped = tmp_path / "stopped"
    cmd = _command(data, stopped)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    _signal_after(proc, stopped, 3, signum)
    err = proc.communicate()[1]
    assert proc.returncode == 128 + signum, err[-2000:]
    at_stop = torch.load(stopped / CHECKPOINT, weights_only=True)["step"]
    assert 3 <= at_stop < total - 10, at_stop  # the checkpoint is the stop's (save_every=1000)
    name = signal.Signals(signum).name
    assert f"stopped by {name} at step {at_stop}; rerun the same command to resume" in err.splitlines()
    assert [r["step"] for r in read_metrics(stopped / METRICS)] == list(range(1, at_stop + 1))

    resumed = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=True).stdout
    assert f"resumed {stopped / CHECKPOINT} at step {at_stop}" in resumed

    whole = tmp_path / "whole"
    train(TrainConfig(**data, **SETTINGS, out_dir=str(whole)), log=lambda s: None)
    a = torch.load(whole / CHECKPOINT, weights_only=True)["params"]
    b = torch.load(stopped / CHECKPOINT, weights_only=True)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    curve = lambda out: [(r["step"], r["loss"], r["acc"]) for r in read_metrics(out / METRICS)]  # noqa: E731
    assert curve(stopped) == curve(whole) and [s for s, _, _ in curve(whole)] == list(range(1, total + 1))


def test_a_second_signal_stops_at_once(tmp_path, monkeypatch):
    data = _setup(tmp_path, "online", monkeypatch)
    out = tmp_path / "run"
    proc = subprocess.Popen(_command(data, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env=ENV)
    _signal_after(proc, out, 2, signal.SIGTERM)
    for line in proc.stderr:  # the first one is acknowledged before the second is sent
        if line.startswith("SIGTERM received: finishing the optimizer step in flight"):
            break
    proc.send_signal(signal.SIGTERM)
    proc.communicate()
    assert proc.returncode == -signal.SIGTERM  # the default action: no save, no message
    assert not (out / CHECKPOINT).exists()
