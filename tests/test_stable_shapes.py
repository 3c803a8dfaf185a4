"""Stable shapes: after its first optimizer step a training run compiles nothing more,
whatever the lengths and row counts of its batches. (A held-out evaluation compiles
its no-grad graphs once, at the first evaluation.)

A CPU has no inductor path for FlexAttention's backward, but dynamo's guards (what
decides a recompilation) do not depend on the backend: ``compile_on_cpu("eager")``
sends the CPU tensors through the compiled paths a CUDA run takes (the elementwise
chains and the flex path's FlexAttention), and the test lifts FlexAttention's
"no backward on CPU" check for its duration. FlexAttention's block is 16 rows instead of
128 here, so that short conversations give as many different lengths as long ones. ``RecompileCounter`` counts dynamo's
recompilations, as benchmarks/train.py does on the GPU. Control: FlexAttention compiled
shape-static (the earlier ``dynamic=False``, lengths not marked) recompiles as the
lengths change. Plans uploaded as on a GPU compile nothing more either (control: their
attention inputs as views of one buffer recompile).
"""

from __future__ import annotations

import json

import pytest
import torch
from recorders import WORDS, save_tiny_target

import eagle3fn.unrolled.blocks as blocks_module
import eagle3fn.unrolled.flex as unrolled_flex
from eagle3fn.compiled import RecompileCounter, compile_on_cpu
from eagle3fn.train.config import TrainConfig, TTTOptions
from eagle3fn.train.loop import train


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """The tiny target and 30 conversations of 3-40 + 3-30 words (lengths vary a lot)."""
    d = tmp_path_factory.mktemp("shapes")
    save_tiny_target(d / "model")
    g = torch.Generator().manual_seed(0)

    def words(lo, hi):
        n = int(torch.randint(lo, hi, (1,), generator=g))
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))
    rows = [{"messages": [{"role": "user", "content": words(3, 40)},
                          {"role": "assistant", "content": words(3, 30)}]} for _ in range(30)]
    (d / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def recompiles_per_step(workdir, out, monkeypatch, **kw) -> tuple[list[int], list[str], set, set]:
    """Train on the CPU through the compiled paths; dynamo's recompilation count after
    each optimizer step, the first messages, and the query and key lengths that reached
    FlexAttention."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    monkeypatch.setattr(blocks_module, "FLEX_BLOCK", 16)  # GPU-sized lengths at CPU cost
    queries, keys = set(), set()
    compiled = unrolled_flex.compiled_flex

    def spy(backend):
        attend = compiled(backend)

        def call(q, k, v, **kwargs):
            queries.add(q.shape[2])
            keys.add(k.shape[2])
            return attend(q, k, v, **kwargs)
        return call
    monkeypatch.setattr(unrolled_flex, "compiled_flex", spy)
    cfg = TrainConfig(**{**dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                                draft_vocab_size=64, batch_size=4, epochs=1, ttt_length=3, lr=1e-3,
                                device="cpu", save_every=1000, ttt=TTTOptions(attention="flex"),
                                # The target's own graphs are tests/test_target_compile.py's: a batch
                                # whose rows hold one conversation each (packed) or no padding
                                # (unpacked) gives SDPA no mask, a second graph whenever it first comes.
                                compile_target=False), **kw})
    counts, lines = [], []
    torch._dynamo.reset()  # what earlier tests of this process compiled (other dtypes) is not this run's
    with compile_on_cpu("eager"), RecompileCounter(keep=8) as counter:
        train(cfg, log=lines.append, on_step=lambda step: counts.append(counter.count))
    # A compiling run says so before its first step (tests/test_train.py: an eager one does not).
    first = next(i for i, line in enumerate(lines) if line.startswith("step "))
    assert sum(line.startswith("compiling:") for line in lines[:first]) == 1, lines[:first]
    return counts, counter.examples, queries, keys


@pytest.mark.parametrize("kw", [dict(trim="backbone", max_steps=6, pack=False),
                                dict(trim="auto", pack=True, max_length=96, batch_size=2,
                                     ttt=TTTOptions(attention="flex", auto_min_rows=1))],
                         ids=["backbone-unpacked", "auto-packed"])
def test_no_recompilation_after_the_first_step(workdir, tmp_path, monkeypatch, kw):
    counts, examples, queries, keys = recompiles_per_step(workdir, tmp_path / "run", monkeypatch, **kw)
    assert len(counts) >= 5 and len(queries) >= 3, (counts, queries)  # lengths did vary
    if not kw.get("pack"):
        assert len(keys) >= 3, keys
    assert counts[-1] == counts[0], (counts, examples)
    # Step 1 too: each compiled function is traced once (no second graph for a view
    # where another step passes a fresh tensor), so warm-up compiles nothing twice.
    assert counts[0] == 0, (counts, examples)


@pytest.mark.parametrize("own_storage", [True, False], ids=["own-storage", "control-views"])
def test_uploaded_plans_do_not_recompile(workdir, tmp_path, monkeypatch, own_storage):
    """Plans uploaded as on a GPU: FlexAttention's inputs get storages of their own
    (``layout._own_storage``), so nothing recompiles. Control: as views of the one
    upload buffer, their storage offsets become symbols of the compiled attention and a
    batch of another layout breaks a guard the first one set (duck sizing)."""
    import eagle3fn.unrolled.layout as layout_module

    monkeypatch.setattr(layout_module, "_sends_plan", lambda device: True)
    if not own_storage:
        monkeypatch.setattr(layout_module, "_own_storage", lambda tensors: list(tensors))
    counts, examples, _, _ = recompiles_per_step(workdir, tmp_path / "run", monkeypatch, trim="auto", pack=True,
                                                max_length=96, batch_size=2,
                                                ttt=TTTOptions(attention="flex", auto_min_rows=1))
    if own_storage:
        assert counts[-1] == counts[0] == 0, (counts, examples)
    else:
        assert counts[-1] > 0 and any("storage_offset" in e for e in examples), (counts, examples)


def test_control_a_view_argument_compiles_a_second_graph():
    """What keeps step 1 at one graph per function: a graph compiled for a view
    argument guards the view's base, so the same elementwise function called with a
    view and then with a fresh tensor of the same shape is compiled twice (the
    unrolled step passes no views)."""
    from eagle3fn.draft import rms_norm

    x, w = torch.randn(2, 6, 8), torch.randn(8)
    with compile_on_cpu("eager"), RecompileCounter(keep=4) as counter:
        torch._dynamo.reset()
        rms_norm(x.flatten(0, 1), w, 1e-6)  # a view of x
        rms_norm(x.flatten(0, 1), w, 1e-6)
        assert counter.count == 0
        rms_norm(x.flatten(0, 1).clone(), w, 1e-6)  # fresh
    assert counter.count == 1, counter.examples


def test_control_static_flex_recompiles(workdir, tmp_path, monkeypatch):
    """The same run with FlexAttention compiled shape-static and its lengths unmarked."""
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(unrolled_flex, "_dynamic_lengths", lambda *args: None)
    static = {}
    monkeypatch.setattr(unrolled_flex, "compiled_flex",
                        lambda backend: static.setdefault(backend, torch.compile(flex_attention, dynamic=False,
                                                                                 backend=backend)))
    counts, examples, _, _ = recompiles_per_step(workdir, tmp_path / "run", monkeypatch, trim="backbone",
                                                max_steps=4, pack=False)
    assert counts[-1] - counts[0] >= 2, (counts, examples)
    assert any("flex_attention" in e for e in examples), examples
