"""A training process killed with SIGKILL mid-run resumes to the same weights and curve,
online and from the offline feature cache.

Every run is on one thread (the subprocesses and the in-process run alike: the thread
count changes the rounding): two threads per process crawl on a busy 2-core machine."""

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from recorders import prepare_cache, save_tiny_target, write_tiny_chat

from eagle3fn.train.config import TrainConfig
from eagle3fn.train import CHECKPOINT, METRICS, train
from eagle3fn.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = dict(draft_vocab_size=64, batch_size=1, epochs=2, ttt_length=3, save_every=1, lr=1e-3,
                trim_loss_positions=True, pack=False)  # a step per conversation: room to kill mid-run


@pytest.mark.parametrize("source", ["online", "cache"])
def test_sigkill_mid_run_then_resume_matches_an_uninterrupted_run(tmp_path, source, monkeypatch):
    n = 12  # conversations; two epochs of one per step
    save_tiny_target(tmp_path / "model")
    write_tiny_chat(tmp_path / "chat.jsonl", n)
    total = 2 * n
    data = dict(model=str(tmp_path / "model"), data=str(tmp_path / "chat.jsonl"))
    if source == "cache":  # one conversation per shard, bf16 on disk: a micro-batch per shard
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        prepare_cache(tmp_path, tmp_path / "cache", "--batch-size", "1", storage="bfloat16")
        data = dict(model=str(tmp_path / "model"), cache=str(tmp_path / "cache"))
    killed = tmp_path / "killed"
    flags = [(f"--no-{k}" if v is False else f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}"))
             for k, v in {**data, **SETTINGS}.items()]
    cmd = [sys.executable, "-m", "eagle3fn.cli", "train", *flags, f"--out-dir={killed}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # Each step writes its metrics row, then its checkpoint (save_every=1): kill once a
    # few steps are in, well before the end (a step takes tens of milliseconds).
    while proc.poll() is None and len(read_metrics(killed / METRICS)) < 3:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    at_kill = torch.load(killed / CHECKPOINT, weights_only=False)["step"]
    assert 1 <= at_kill < total - 10, at_kill  # really interrupted mid-run

    resumed = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    assert f"resumed {killed / CHECKPOINT} at step {at_kill}" in resumed

    whole = tmp_path / "whole"
    train(TrainConfig(**data, **SETTINGS, out_dir=str(whole)), log=lambda s: None)
    a = torch.load(whole / CHECKPOINT, weights_only=False)["params"]
    b = torch.load(killed / CHECKPOINT, weights_only=False)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    curve = lambda out: [(r["step"], r["loss"], r["acc"]) for r in read_metrics(out / METRICS)]  # noqa: E731
    assert curve(killed) == curve(whole) and [s for s, _, _ in curve(whole)] == list(range(1, total + 1))
