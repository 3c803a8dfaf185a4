"""The frozen embedding is kept in the compute dtype, not as an fp32 master
(``train.build.frozen_in_compute_dtype``): bf16 training is bitwise the same as with the
fp32 copy cast at every step, and the run holds half the bytes for it. Control: an
embedding 1% off is seen by the same comparison."""

from __future__ import annotations

import pytest
import torch
from test_train import config, workdir  # noqa: F401 - the tiny target and chat

import eagle3fn.train.build as build_module
from eagle3fn.train.checkpoint import CHECKPOINT, read_checkpoint
from eagle3fn.train.loop import train


def trained(workdir, out, monkeypatch, frozen=None):  # noqa: F811
    """Params after 2 bf16 steps on the CPU, and the dtype the run held the embedding in."""
    held = {}
    real = build_module.frozen_in_compute_dtype
    cast = frozen or real

    def spy(params, precision):
        out_params = cast(params, precision)
        held["embed"] = out_params["embed_tokens.weight"].dtype
        return out_params
    monkeypatch.setattr(build_module, "frozen_in_compute_dtype", spy)
    train(config(workdir, out, max_steps=2, precision="bfloat16"), log=lambda s: None)
    return read_checkpoint(out / CHECKPOINT)["params"], held["embed"]


def test_frozen_embedding_in_bf16_trains_the_same(workdir, tmp_path, monkeypatch):  # noqa: F811
    got, dtype = trained(workdir, tmp_path / "bf16", monkeypatch)
    assert dtype == torch.bfloat16
    want, master = trained(workdir, tmp_path / "fp32", monkeypatch, frozen=lambda params, precision: params)
    assert master == torch.float32
    for name, p in want.items():
        assert torch.equal(got[name], p), name

    # control: an embedding 1% off in the compute dtype changes the trained weights
    off, _ = trained(workdir, tmp_path / "off", monkeypatch, frozen=lambda params, precision: {
        n: p if p.requires_grad else (p * 1.01).to(precision) for n, p in params.items()})
    with pytest.raises(AssertionError):
        for name, p in want.items():
            assert torch.equal(off[name], p), name
