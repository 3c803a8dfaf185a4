"""Training under torchrun (gloo, CPU): sequence parallelism trains the one-process
weights; data parallelism runs, resumes, and writes a layout-free checkpoint."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import config, final_params, workdir  # noqa: F401 - the tiny target + data fixture

from eagle3fn.loss import LossConfig
from eagle3fn.train.loop import train

TIMEOUT = 300


def one_process(cfg) -> dict:
    """Final weights of ``cfg``'s run in this process, on one thread like each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(cfg, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    return final_params(Path(cfg.out_dir))


@pytest.fixture(scope="module")
def one(workdir, tmp_path_factory):  # noqa: F811
    """Final weights of the one-process run the sequence-parallel runs must reproduce
    (trim backbone, token_mean, one epoch): one run for the module."""
    return one_process(config(workdir, tmp_path_factory.mktemp("one"), epochs=1, trim="backbone",
                              trim_loss_positions=False, loss=LossConfig(normalization="token_mean")))


@pytest.fixture(scope="module")
def other_seed(workdir, tmp_path_factory):  # noqa: F811
    """Final weights of the same one-epoch run with another seed (the negative control)."""
    return one_process(config(workdir, tmp_path_factory.mktemp("other"), epochs=1, seed=3))


def torchrun(nproc, workdir, out, *extra):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "eagle3fn.cli", "train", "--model", str(workdir / "model"),
           *([] if "--cache" in extra else ["--data", str(workdir / "chat.jsonl")]),  # never both
           "--out-dir", str(out), "--draft-vocab-size", "64",
           "--batch-size", "2", "--epochs", "1", "--ttt-length", "3", "--save-every", "2",
           "--lr", "1e-3", "--precision", "float32", "--trim", "backbone", "--loss.normalization", "token_mean", "--no-pack", *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


@pytest.mark.parametrize("layout", [("--parallel.ring", "2"), ("--parallel.ulysses", "2")],
                         ids=["ring2", "ulysses2"])
def test_sequence_parallel_training_equals_one_process(workdir, tmp_path, layout, one, other_seed):  # noqa: F811
    """token_mean divides by global gated rows, so the sequence padding to sp*C does not
    change the objective: two ranks must train the one-process weights (fp32 rounding).
    Negative control: another seed is far from both."""
    two = tmp_path / "two"
    printed = torchrun(2, workdir, two, *layout)
    assert printed.count("step 4/4") == 1  # rank 0 alone logs
    a, b = one, final_params(two)
    rel = lambda x, y: ((x - y).abs().max() / y.abs().max()).item()  # noqa: E731 - SPEC 8
    # Adam turns fp32 rounding of tiny gradients (summed in another order across the
    # ranks) into steps of up to lr, so after 4 steps the weights agree to a few 1e-4,
    # not 1e-5: 1.5e-4 on an AVX2 CPU with MKL (gate_proj, Ulysses-2), and other CPUs
    # round differently.
    TOL = 5e-4
    for n in a:
        assert rel(b[n], a[n]) <= TOL, (n, rel(b[n], a[n]))
    c = other_seed
    # Negative control: another seed is far outside the tolerance on some weight.
    assert max(rel(c[n], a[n]) for n in a) > 20 * TOL


def test_data_parallel_runs_resumes_and_saves_full_tensors(workdir, tmp_path, one):  # noqa: F811
    out = tmp_path / "dp"
    torchrun(2, workdir, out, "--max-steps", "1")
    assert torch.load(out / "checkpoint.pt", weights_only=False)["step"] == 1
    printed = torchrun(2, workdir, out)  # resumes at step 1 and finishes the epoch
    assert "resumed" in printed and "step 2/2" in printed
    shapes = {n: p.shape for n, p in final_params(out).items()}  # whole tensors, not shards
    assert shapes == {n: p.shape for n, p in one.items()}  # the one-process run's


def test_world_size_not_divisible_is_a_clear_error(workdir, tmp_path):  # noqa: F811
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "eagle3fn.cli", "train", "--model", str(workdir / "model"), "--data",
           str(workdir / "chat.jsonl"), "--out-dir", str(tmp_path), "--parallel.ring", "4"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode != 0 and "not divisible" in run.stdout + run.stderr


def test_offline_cache_under_sequence_parallelism(workdir, tmp_path, one):  # noqa: F811
    """Each rank reads only its window of the cache's large tensors; the run trains the
    one-process online weights."""
    from eagle3fn.cli.main import main

    cache = tmp_path / "cache"
    main(["prepare", "--model.path", str(workdir / "model"), "--data.path", str(workdir / "chat.jsonl"),
          "--out", str(cache), "--batch-size", "2", "--storage", "float32", "--model.dtype", "float32"])
    two = tmp_path / "two"
    torchrun(2, workdir, two, "--parallel.ring", "2", "--cache", str(cache))
    a, b = one, final_params(two)
    for n in a:
        assert ((b[n] - a[n]).abs().max() / a[n].abs().max()).item() <= 1e-4, n
