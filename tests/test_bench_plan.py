"""benchmarks/plan_host.py on CPU at tiny sizes: its batches are what it says (B packed
rows of T tokens of the chat set, documents restarting their positions), its figures
add up, the batched plan it times dispatches fewer ops than the per-step one under
``trim="backbone"``, and it refuses to time plans that differ (control: a batched
plan made wrong on purpose)."""

import json

import pytest
from recorders import load_benchmark

import eagle3fn.unrolled.layout as layout_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("plan_host")


def tiny(bench, out, **kw):
    return bench.Args(**{"shape": "tiny", "sizes": ((2, 256), (1, 512)), "batches": 2, "reps": 1,
                         "conversations": 40, "out": str(out), **kw})


def test_batches_are_packed_rows_of_the_chat_set(bench):
    args = tiny(bench, "unused")
    batches = bench.packed_batches(args, 2, 256)
    assert len(batches) == 2
    for f, masks in batches:
        assert f.aux.device.type == "meta" and f.input_ids.shape == (2, 256)
        pos, att = masks.positions, masks.attention_mask
        assert pos.shape == att.shape == masks.loss_mask.shape == (2, 256)
        docs = (pos[:, 1:] == 0).sum().item() + 2  # each restart opens a document
        assert docs > 2 and masks.loss_mask.any() and (masks.loss_mask <= att.bool()).all()
    with pytest.raises(ValueError, match="raise --conversations"):
        bench.packed_batches(tiny(bench, "unused", batches=50), 2, 256)


def test_report_adds_up(bench, tmp_path, capsys):
    report = bench.main(tiny(bench, tmp_path / "p.json"))
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(report))
    rows = report["results"]
    assert [(r["batch_size"], r["length"], r["trim"]) for r in rows] == [
        (2, 256, "backbone"), (2, 256, "loss"), (1, 512, "backbone"), (1, 512, "loss")]
    for r in rows:
        assert r["old_ms"] == pytest.approx(r["rowmap_ms"] + r["plan_old_ms"])
        assert r["new_ms"] == pytest.approx(r["rowmap_ms"] + r["plan_new_ms"])
        assert r["speedup"] == pytest.approx(r["old_ms"] / r["new_ms"])
        assert min(r["rowmap_ms"], r["plan_old_ms"], r["plan_new_ms"]) > 0 and 0 < r["supervised_frac"] < 1
        if r["trim"] == "backbone":  # k steps in one pass: far fewer ops than k passes
            assert 2 * r["ops"]["plan_new"] < r["ops"]["plan_old"]
    assert "speedup" in capsys.readouterr().out


def test_differing_plans_are_not_timed(bench, tmp_path, monkeypatch):
    """Control: a batched plan whose first layout starts one row late is refused."""
    real = layout_module._host_layouts

    def wrong(*a, **k):
        out = real(*a, **k)
        lay = out[0]
        out[0] = layout_module.PackedLayout(lay.num_queries, lay.start + 1, lay.last, lay.tables)
        return out
    monkeypatch.setattr(layout_module, "_host_layouts", wrong)
    with pytest.raises(RuntimeError, match="plans differ"):
        bench.main(tiny(bench, tmp_path / "p.json"))
