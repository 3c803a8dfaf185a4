"""--compile-step (train.onegraph): the optimizer step as one compiled graph (every row
count, no graph break) equals the eager step in fp64 on the CPU (params, optimizer
state, metrics), a wrong variant (one padding row left unmasked) is caught by the same
comparison, one graph serves every row count, unpadded (one per row bucket without
DYNAMIC_ROWS), the Triton soft cross-entropy and FlexAttention run inside it, and
unsupported settings are refused."""

import dataclasses
import json
from types import SimpleNamespace

import pytest
import torch
from recorders import save_tiny_target, write_tiny_chat

import eagle3fn.compiled as compiled
import eagle3fn.train.loop as loop
import eagle3fn.train.onegraph as onegraph
from eagle3fn.compiled import RecompileCounter, compile_on_cpu
from eagle3fn.train import CHECKPOINT, METRICS, train
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.config import TTTOptions
from eagle3fn.train.onegraph import MIN_ROWS, ROW_BUCKETS, bucket_size
from torch._dynamo.utils import counters

pytestmark = pytest.mark.usefixtures("one_thread")
BUCKETED = onegraph.bucketed


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("onegraph")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 8)
    return d


def config(workdir, out, **kw):
    """Packed rows of 64 tokens, 2 per batch (4 batches of different supervised counts),
    fp64, trimmed loss: what --compile-step supports."""
    base = dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                draft_vocab_size=64, batch_size=2, epochs=1, ttt_length=3, lr=1e-3, trim="loss", max_length=64,
                precision="float64", memory_check=False, save_every=100)
    return TrainConfig(**{**base, **kw})


def _result(out):
    state = torch.load(out / CHECKPOINT, weights_only=False)
    rows = [json.loads(r) for r in (out / METRICS).read_text().splitlines()]
    return state, rows


def _compiled(workdir, out, monkeypatch, wrong: bool = False, logs: list | None = None, **kw):
    """A --compile-step run (dynamo with aot_eager on the CPU); the (U, N) of every
    batch given to ``bucketed`` and the recompilations. ``wrong``: the first padding
    row of every step counts (the negative control). ``logs``: gets the run's lines."""
    seen, real = [], BUCKETED

    def spy(rowmap, *a):
        padded, masks = real(rowmap, *a)
        seen.append((rowmap.teacher_positions.numel(), padded.teacher_positions.numel()))
        if wrong:
            masks = masks.clone()
            masks[:, masks.sum(1).max()] = True
        return padded, masks
    monkeypatch.setattr(onegraph, "bucketed", spy)
    # Fresh dynamo state: a function another test of this worker compiled first (other
    # shapes, other dtypes) would recompile here and be counted as this run's.
    torch._dynamo.reset()
    breaks = sum(counters["graph_break"].values())
    with compile_on_cpu("aot_eager"), RecompileCounter() as counter:
        train(config(workdir, out, compile_step=True, **kw), log=(lambda s: None) if logs is None else logs.append)
    return seen, counter.count, sum(counters["graph_break"].values()) - breaks


@pytest.fixture(scope="module")
def runs(workdir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "plot_metrics", lambda *a, **k: None)  # not under test here
        train(config(workdir, out / "eager"), log=lambda s: None)
        train(config(workdir, out / "eager1", max_steps=1), log=lambda s: None)
        logs, static_logs = [], []
        seen, recompiles, breaks = _compiled(workdir, out / "compiled", mp, logs=logs)
        with pytest.MonkeyPatch.context() as static:  # one static graph per row bucket
            static.setattr(onegraph, "DYNAMIC_ROWS", False)
            # The negative control where padding rows exist: the buckets (a symbolic count pads none).
            _compiled(workdir, out / "wrong", mp, wrong=True, max_steps=1)
            static_seen, static_recompiles, _ = _compiled(workdir, out / "static", mp, logs=static_logs)
    assert breaks == 0  # the whole step is one graph
    names = ("eager", "eager1", "compiled", "wrong", "static")
    return ({name: _result(out / name) for name in names}, seen, recompiles, logs,
            (static_seen, static_recompiles, static_logs))


def _same(a, b) -> bool:
    """Params, AdamW state and logged metrics equal at fp64 tolerance."""
    (sa, ra), (sb, rb) = a, b
    params = all(torch.allclose(sa["params"][n], sb["params"][n], rtol=1e-10, atol=1e-14) for n in sa["params"])
    opt = all(torch.allclose(x[k].double(), sb["optimizer"]["state"][i][k].double(), rtol=1e-10, atol=1e-16)
              for i, x in sa["optimizer"]["state"].items() for k in ("exp_avg", "exp_avg_sq", "step"))
    keys = ("loss", "grad_norm", "kl", "acc", "accept", "tau", "lr")
    metrics = [{k: r[k] for k in keys} for r in ra] == [{k: r[k] for k in keys} for r in rb]
    return params and opt and metrics and sa["step"] == sb["step"]


def test_compiled_step_equals_the_eager_one(runs):
    results = runs[0]
    assert results["eager"][0]["step"] == 4
    assert _same(results["eager"], results["compiled"]) and _same(results["eager"], results["static"])
    # The negative control: one padding row counted changes the loss and the update.
    assert not _same(results["eager1"], results["wrong"])


def test_one_graph_serves_every_row_count(runs):
    """With ``DYNAMIC_ROWS`` the row count is symbolic: batches of different teacher
    counts run one graph, compiled once and logged once, with no padding rows (``N = U``).
    Control: the static graphs (``DYNAMIC_ROWS`` off) pad to buckets and recompile for
    every bucket after the first, and log each."""
    _, seen, recompiles, logs, (static_seen, static_recompiles, static_logs) = runs
    counts = {u for u, _ in seen}
    assert len(seen) == 4 and len(counts) >= 3 and all(n == max(u, MIN_ROWS) for u, n in seen)
    assert recompiles == 0
    buckets = {n for _, n in static_seen}
    assert [u for u, _ in static_seen] == [u for u, _ in seen] and all(n >= u for u, n in static_seen)
    assert 2 <= len(buckets) < len(counts) and static_recompiles == len(buckets) - 1
    seen = static_seen  # the static run's log lines name its buckets

    def said(lines):
        return [line for line in lines if line.startswith("compile-step: compiling")]
    assert len(said(logs)) == 1 and "for any trimmed row count" in said(logs)[0]
    # Static: each bucket's first step says it compiles (a run stalling there says why), then how long
    # it took; the batches of a bucket met again say nothing (more batches than buckets).
    assert [f"with {n} trimmed rows" in line for line, n in zip(said(static_logs), dict.fromkeys(n for _, n in seen))] \
        == [True] * len(buckets) and len(said(static_logs)) == len(buckets) < len(seen)
    assert sum(line.startswith("compile-step: compiled and ran it in ") for line in static_logs) == len(buckets)
    # Every count up to B*T lands in one of ROW_BUCKETS sizes, padding under one unit.
    sizes = {bucket_size(n, 1000) for n in range(1001)}
    assert len(sizes) == ROW_BUCKETS and all(bucket_size(n, 1000) - n <= 125 for n in range(1001))


def test_triton_soft_ce_and_flex_attention_run_inside_the_compiled_step(workdir, tmp_path, monkeypatch):
    """The GPU's paths inside the one graph, on the CPU: the Triton soft cross-entropy
    (interpreted) as a custom op, its kernels launched, and FlexAttention (torch's
    CPU-backward check lifted) traced into the graph rather than compiled again inside it
    (``compiled.compile_backend`` is None while a graph is being compiled; without that,
    this run fails as the first CUDA run did: "Attempt to trace forbidden callable
    maybe_mark_dynamic"), with the backbone trim's per-step layouts. No graph break, the
    eager step's result at fp32 tolerance;
    control: one weight off by 1e-3 is caught by the same comparison."""
    import torch.nn.attention.flex_attention as flex_module

    import eagle3fn.kernels.soft_ce as soft_ce

    monkeypatch.setattr(loop, "plot_metrics", lambda *a, **k: None)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *a, **kw: None)
    launched, real = [], soft_ce.soft_ce_fwd
    monkeypatch.setattr(soft_ce, "soft_ce_fwd", lambda *a, **k: launched.append(1) or real(*a, **k))
    # The backbone trim: per-step packed layouts, row counts symbolic (without a cat in place of
    # F.pad in flex.pack_queries, the traced backward's view of the queries' gradient fails).
    kw = dict(precision="float32", max_steps=1, trim="backbone", ttt=TTTOptions(loss_impl="triton", attention="flex"))
    train(config(workdir, tmp_path / "eager", **kw), log=lambda s: None)
    eager_launches = len(launched)
    _, _, breaks = _compiled(workdir, tmp_path / "compiled", monkeypatch, **kw)
    # One launch per TTT step (k = 3); the eager step launches each twice (forward, and
    # the fused head's recomputation in backward).
    assert breaks == 0 and eager_launches == 6 and len(launched) - eager_launches == 3
    (a, ra), (b, rb) = _result(tmp_path / "eager"), _result(tmp_path / "compiled")
    for n in a["params"]:
        torch.testing.assert_close(a["params"][n], b["params"][n], rtol=1e-5, atol=1e-6)
    assert [r["loss"] for r in ra] == pytest.approx([r["loss"] for r in rb], rel=1e-5)
    name = next(iter(b["params"]))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(a["params"][name], b["params"][name] + 1e-3, rtol=1e-5, atol=1e-6)


def test_backbone_trim_runs_as_one_graph(runs, workdir, tmp_path, monkeypatch):
    """``--trim backbone`` (the layer's rows trimmed too) in the one graph: every row list
    symbolic, so the 4 batches run one graph with 0 recompilations, logged once, and the
    result is the eager step's (the loss-trimmed eager run: the trims are exact). Control:
    the same graph reading each step's loss rows one position off is caught."""
    logs = []
    _, recompiles, breaks = _compiled(workdir, tmp_path / "bb", monkeypatch, logs=logs, trim="backbone")
    assert recompiles == 0 and breaks == 0
    said = [line for line in logs if line.startswith("compile-step: compiling")]
    assert len(said) == 1 and "backbone trimmed" in said[0]
    assert _same(runs[0]["eager"], _result(tmp_path / "bb"))
    real = onegraph._symbolic_backbone

    def off_by_one(rowmap, plan):
        rowmap, plan = real(rowmap, plan)
        return rowmap, dataclasses.replace(plan, at=[a.roll(1) for a in plan.at])
    monkeypatch.setattr(onegraph, "_symbolic_backbone", off_by_one)
    _compiled(workdir, tmp_path / "wrong", monkeypatch, trim="backbone", max_steps=1)
    assert not _same(runs[0]["eager1"], _result(tmp_path / "wrong"))


def test_the_step_compiles_without_mix_order_reductions(monkeypatch):
    """The compiled step turns inductor's mix-order reductions off (they failed on CUDA
    with the backbone trim's per-step row counts); the other compiles keep them."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    monkeypatch.setattr(onegraph, "vocab_chunk_bounds", lambda *a: None)
    run = SimpleNamespace(device=torch.device("cuda"), t2d=None, ttt_cfg=SimpleNamespace(teacher_chunk_size=0))
    onegraph.StepGraph(run)
    step = seen[-1]["options"]
    assert step["triton.mix_order_reduction"] is False
    assert all(step[k] == v for k, v in compiled.INDUCTOR_OPTIONS.items())
    # Control: the eager path's compiles (same helper, no options) keep inductor's default.
    compiled.compiler(lambda x: x, "inductor")
    assert "triton.mix_order_reduction" not in seen[-1]["options"]
    compiled.compiler(lambda x: x, "aot_eager", options={"triton.mix_order_reduction": False})
    assert seen[-1]["options"] is None


def test_unsupported_settings_are_refused_with_the_fix(workdir, tmp_path):
    cases = [(dict(grad_accum=2), "--grad-accum 1"), (dict(pack=False), "drop --no-pack")]
    for kw, fix in cases:
        with pytest.raises(ValueError, match=fix) as e:
            config(workdir, tmp_path / "x", compile_step=True, **kw)
        assert "--compile-step" in str(e.value) and "\n" not in str(e.value)
    config(workdir, tmp_path / "x", compile_step=False, grad_accum=2, trim="auto")  # off: nothing refused
