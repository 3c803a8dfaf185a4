"""A training step waits on the device once: the finiteness check, the gradient norm
and every logged metric come to the host in one copy (``train.step._download``), so
logging (``metrics_row``, the progress bar) reads host memory only.

On the CPU every tensor is a host tensor, so the test marks the step's objective as
"on the device": ``ttt``'s ``Objective`` is handed to the loop as a tensor subclass that
counts every read of its values into Python (``item``, ``tolist``, ``float``, ``int``,
``bool``, ``.cpu()``...); whatever is computed from it (the non-finite flag, the stack
that is downloaded) stays that subclass, as a CUDA tensor's results stay on CUDA.
Control: the metrics row made from the device objective directly, as the loop did
before, reads every number on its own (at least 3k + 2 reads), and the counter sees them.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from test_train import workdir  # noqa: F401 - the tiny target and 8 conversations

import eagle3fn.train.step as step_module
from eagle3fn.shapes import Objective
from eagle3fn.train import METRICS, train
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.metrics import read_metrics

READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "numpy", "cpu", "__array__"}


class OnDevice(torch.Tensor):
    """A tensor standing for one on the device: ``reads`` counts the reads of its
    values into Python or host memory; a ``.cpu()`` copy is a plain tensor."""

    reads: ClassVar[list[str]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            cls.reads.append(name)
        out = super().__torch_function__(func, types, args, kwargs or {})
        if name == "cpu":
            with torch._C.DisableTorchFunctionSubclass():
                return out.as_subclass(torch.Tensor)
        return out


def on_device(obj: Objective) -> Objective:
    return Objective(**{f.name: getattr(obj, f.name).as_subclass(OnDevice) for f in dataclasses.fields(obj)})


def test_one_read_of_the_device_per_step(workdir, tmp_path, monkeypatch):  # noqa: F811
    ttt = step_module.ttt
    monkeypatch.setattr(step_module, "ttt", lambda *a, **k: on_device(ttt(*a, **k)))
    per_step = []

    def on_step(step):
        per_step.append(list(OnDevice.reads))
        OnDevice.reads.clear()

    OnDevice.reads.clear()
    cfg = TrainConfig(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(tmp_path / "run"),
                      draft_vocab_size=64, batch_size=2, epochs=1, ttt_length=3, max_steps=3, device="cpu",
                      save_every=1000, compile_target=False, pack=False)
    train(cfg, log=lambda s: None, on_step=on_step)
    assert per_step == [["cpu"]] * 3, per_step
    rows = [r for r in read_metrics(tmp_path / "run" / METRICS) if r.get("split") != "eval"]
    assert len(rows) == 3 and all(len(r["kl"]) == 3 and r["loss"] is not None for r in rows), rows


def test_control_reading_each_metric_is_counted():
    k = 3
    obj = on_device(Objective(objective=torch.tensor(1.0), step_loss=torch.ones(k), kl_loss=torch.ones(k),
                              acc=torch.ones(k), accept=torch.ones(k), tau=torch.tensor(2.0)))
    OnDevice.reads.clear()
    step_module.metrics_row(1, 0.1, 1.0, obj, 1.0, 0)
    assert len(OnDevice.reads) >= 3 * k + 2, OnDevice.reads  # each number at least once
