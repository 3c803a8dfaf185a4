"""``--precompile``: the draft step's graphs compile in a background thread while the
run loads, so its first step compiles nothing, and the run is bitwise the same as
without it (parameters, metrics, RNG state).

On the CPU nothing compiles, so the test sends CPU tensors through the compiled paths a
CUDA run takes (``compile_on_cpu("eager")``, FlexAttention's CPU check lifted, as
tests/test_stable_shapes.py does): dynamo's graphs and guards, which decide whether the
run's first step finds the graphs compiled, do not depend on the backend. The plans
are uploaded as on a GPU (views of one buffer, then ``layout._own_storage``). Controls:
a precompile in another dtype leaves the run's graphs to its first step (the count
catches it), the uploaded views without storages of their own make the run recompile,
and a precompile that draws from the global RNG changes the run's RNG state (the
equality catches it).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_stable_shapes import workdir  # noqa: F401 - the tiny target and varied conversations

import eagle3fn.train.precompile as precompile_module
import eagle3fn.unrolled.attention as attention_module
import eagle3fn.unrolled.layout as layout_module
from eagle3fn.compiled import RecompileCounter, compile_on_cpu
from eagle3fn.train.checkpoint import CHECKPOINT, read_checkpoint
from eagle3fn.train.config import TrainConfig, TTTOptions
from eagle3fn.train.loop import train
from eagle3fn.train.metrics import read_metrics


def run(workdir, out, monkeypatch, **kw):  # noqa: F811
    """A short packed ``auto`` run through the compiled paths: ``(log lines, graphs
    compiled by the precompile, graphs compiled after it, recompilations, checkpoint,
    metrics rows)``."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    monkeypatch.setattr(attention_module, "FLEX_BLOCK", 16)
    monkeypatch.setattr(layout_module, "_sends_plan", lambda device: True)  # as on a GPU: plans uploaded
    cfg = TrainConfig(**{**dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                                draft_vocab_size=64, batch_size=2, epochs=1, ttt_length=3, lr=1e-3, max_length=96,
                                device="cpu", save_every=1000, max_steps=3, compile_target=False,
                                ttt=TTTOptions(attention="flex", auto_min_rows=1)), **kw})
    joined = {}
    join = precompile_module.Precompile.join

    def counted_join(self, log):
        join(self, log)
        joined["graphs"] = RecompileCounter.graphs()
    monkeypatch.setattr(precompile_module.Precompile, "join", counted_join)
    lines = []
    torch.manual_seed(0)  # each run starts from the same global RNG state, which its checkpoint records
    torch._dynamo.reset()
    before = RecompileCounter.graphs()
    with compile_on_cpu("eager"), RecompileCounter(keep=4) as counter:
        train(cfg, log=lines.append)
    after = RecompileCounter.graphs()
    at_join = joined.get("graphs", before)
    return (lines, at_join - before, after - at_join, counter.count, read_checkpoint(out / CHECKPOINT),
            read_metrics(out / "metrics.jsonl"))


def same_run(a, b) -> None:
    """Bitwise the same training: parameters, optimizer state, RNG state, metrics."""
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name
    assert torch.equal(a["rng"], b["rng"])
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq"))


@pytest.fixture(scope="module")
def plain(workdir, tmp_path_factory):  # noqa: F811
    """The run without a precompile (the reference of the equality tests)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run(workdir, tmp_path_factory.mktemp("plain"), monkeypatch)


def test_precompile_leaves_nothing_to_compile_and_changes_nothing(workdir, plain, tmp_path, monkeypatch):  # noqa: F811
    lines, early, late, recompiles, ckpt, rows = run(workdir, tmp_path / "pre", monkeypatch, precompile=True)
    said = [line for line in lines if line.startswith("precompile:")]
    assert len(said) == 1 and "compiled in" in said[0] and "(backbone, none)" in said[0], said
    first = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert lines.index(said[0]) < first  # joined before the first step
    assert early >= 4, early  # the elementwise chains, FlexAttention, the teacher's update
    assert late == 0 and recompiles == 0, (late, recompiles)

    plain_lines, _, plain_late, _, plain_ckpt, plain_rows = plain
    assert not any(line.startswith("precompile:") for line in plain_lines)
    assert plain_late >= early  # without it, the run itself compiles them
    same_run(ckpt, plain_ckpt)
    assert [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows] == \
        [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in plain_rows]


def test_precompile_unpacked_trim_loss(workdir, tmp_path, monkeypatch):  # noqa: F811
    """Unpacked batches (lengths vary, right padding) and another trim path."""
    lines, early, late, recompiles, _, _ = run(workdir, tmp_path / "loss", monkeypatch, precompile=True,
                                               pack=False, trim="loss")
    assert any("(loss)" in line for line in lines if line.startswith("precompile:")), lines
    assert early >= 4 and late == 0 and recompiles == 0, (early, late, recompiles)


def test_control_precompile_in_another_dtype_leaves_the_graphs_to_the_run(workdir, tmp_path, monkeypatch):  # noqa: F811
    """The count sees graphs the precompile did not make: the synthetic step in fp64
    while the run computes in fp32."""
    step = precompile_module.compile_step
    monkeypatch.setattr(precompile_module, "compile_step", lambda *a, **kw: step(*a, **{**kw, "dtype": torch.float64,
                                                                                       "master": torch.float64}))
    _, early, late, _, _, _ = run(workdir, tmp_path / "f64", monkeypatch, precompile=True)
    assert early >= 4 and late >= 4, (early, late)


def test_control_uploaded_views_make_the_run_recompile(workdir, tmp_path, monkeypatch):  # noqa: F811
    """Why the uploaded plan's attention inputs get storages of their own
    (``layout._own_storage``): as views of one buffer their storage offsets are symbols
    of the compiled FlexAttention, and the synthetic batch's offsets set guards that
    the run's batches break."""
    monkeypatch.setattr(layout_module, "_own_storage", lambda tensors: list(tensors))
    _, early, late, recompiles, _, _ = run(workdir, tmp_path / "views", monkeypatch, precompile=True)
    assert early >= 4 and late + recompiles > 0, (early, late, recompiles)


def test_control_a_precompile_drawing_random_numbers_is_seen(workdir, plain, tmp_path, monkeypatch):  # noqa: F811
    """The equality sees a precompile that touches the run's RNG."""
    batch = precompile_module.synthetic_batch

    def noisy(**kw):
        torch.rand(3)  # the global generator, which the run's checkpoint records
        return batch(**kw)
    monkeypatch.setattr(precompile_module, "synthetic_batch", noisy)
    ckpt = run(workdir, tmp_path / "noisy", monkeypatch, precompile=True)[4]
    with pytest.raises(AssertionError):
        same_run(ckpt, plain[4])


def test_a_failed_precompile_is_said_and_the_run_goes_on(workdir, tmp_path, monkeypatch):  # noqa: F811
    def broken(*a, **kw):
        raise RuntimeError("CUDA out of memory (synthetic)")
    monkeypatch.setattr(precompile_module, "compile_step", broken)
    lines, _, late, _, ckpt, _ = run(workdir, tmp_path / "broken", monkeypatch, precompile=True)
    said = [line for line in lines if line.startswith("precompile:")]
    assert len(said) == 1 and "failed (RuntimeError: CUDA out of memory (synthetic))" in said[0], said
    assert late >= 4 and ckpt["step"] == 3


@pytest.mark.parametrize("kw", [dict(device="cpu"), dict(parallel_sp=2)], ids=["eager-cpu", "sequence-parallel"])
def test_no_precompile_where_nothing_compiles_or_under_sequence_parallelism(workdir, kw):  # noqa: F811
    """The CPU runs eagerly (nothing to compile); sequence parallelism needs every rank."""
    from eagle3fn.parallel.mesh import ParallelConfig
    from eagle3fn.unrolled import TTTConfig

    cfg = TrainConfig(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), precompile=True)
    if "parallel_sp" in kw:
        cfg = dataclasses.replace(cfg, parallel=ParallelConfig(ulysses=2))
    started = []
    with compile_on_cpu("eager") if "parallel_sp" in kw else _nothing():
        job = precompile_module.start_precompile(cfg, torch.device("cpu"), TTTConfig(draft=None), target_hidden=8,
                                                 master=torch.float32, dtype=torch.float32)
        started.append(job)
    assert started == [None]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
