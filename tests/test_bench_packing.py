"""benchmarks/packing.py on CPU at tiny sizes: every padding figure against a
brute-force count of the padded positions in the batches the library builds from the
same conversations (online: ``pack_examples`` + ``collate_packed``; offline:
``packed_batches`` + ``gather_packed``; unpacked: ``io.batching.collate``), and its lower
bound against exhaustive bin packing."""

import json

import pytest
import torch
from recorders import load_benchmark
from test_packing_io import optimal_bins

from eagle3fn.io.batching import collate
from eagle3fn.io.data import Example
from eagle3fn.io.packing import collate_packed, first_fit, gather_packed, pack_examples
from eagle3fn.shapes import Features
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.sources import packed_batches

pytestmark = pytest.mark.usefixtures("one_thread")


def _zeros_share(masks):
    """Padded positions / all positions of attention masks (the brute-force count)."""
    return sum(int((m == 0).sum()) for m in masks) / sum(m.numel() for m in masks)


def brute_force(row, lengths, max_length, batch_size):
    """The padding of ``row``'s method, counted in the batches the library builds."""
    ex = [Example(torch.arange(L) + 1, torch.ones(L, dtype=torch.bool), f"f:{i}") for i, L in enumerate(lengths)]
    N, per_batch, method = row["pack_length"], row["rows_per_batch"], row["method"]
    shards = [list(range(i, min(i + batch_size, len(ex)))) for i in range(0, len(ex), batch_size)]
    if method == "unpacked":
        return _zeros_share([collate([ex[i] for i in s], 0)["attention_mask"] for s in shards])
    if method == "first-fit":
        rows = [[ex[i] for i in r] for r in first_fit(lengths, N)]
    elif method == "first-fit/shard":
        rows = [[ex[s[i]] for i in r] for s in shards for r in first_fit([lengths[i] for i in s], N)]
    elif row["loop"] == "online":
        rows = pack_examples(ex, max_length, length=N, window=row["window"])
    else:  # offline: gathered from shard-shaped feature batches, as offline_source does
        cfg = TrainConfig(model="m", cache="c", max_length=max_length, pack_length=N, pack_window=row["window"],
                          batch_size=per_batch)
        batches = packed_batches([[lengths[i] for i in s] for s in shards], cfg, per_batch, N)
        parts = []
        for s in shards:
            b = collate([ex[i] for i in s], 0)
            parts.append((Features(input_ids=b["input_ids"], aux=torch.zeros(*b["input_ids"].shape, 3),
                                   attention_mask=b["attention_mask"]), b["loss_mask"]))
        opened = [{i for r in batch for i, _ in r} for batch in batches]
        assert row["shards"] == pytest.approx(sum(map(len, opened)) / len(batches))
        return _zeros_share([gather_packed(parts, batch, N, max_length)[0].attention_mask for batch in batches])
    batches = [rows[i:i + per_batch] for i in range(0, len(rows), per_batch)]
    return _zeros_share([collate_packed(b, 0, N)["attention_mask"] for b in batches])


def test_padding_figures_are_the_batches_padding(tmp_path, capsys):
    """Each figure of a tiny run (24 conversations of the ``tiny`` shape, cut at 128)
    equals the padded share of the batches built from the same conversations; the
    bound is below every packing's rows. Control: a figure off by one row is caught."""
    bench = load_benchmark("packing")
    args = bench.Args(shape="tiny", conversations=24, batch_size=4, windows=(4,), out=str(tmp_path / "p.json"))
    report = bench.main(args)
    assert json.loads((tmp_path / "p.json").read_text())["results"] == report["results"]
    assert "bfd/4" in capsys.readouterr().out
    lengths, max_length = bench.conversation_lengths(args)
    assert report["data"]["tokens"] == sum(lengths) and max(lengths) <= max_length == 128
    rows = report["results"]
    assert {r["pack_length"] for r in rows} == {128, 256, 512}
    for row in rows:
        if row["method"] == "bound":
            packed = [r["rows"] for r in rows if r["pack_length"] == row["pack_length"] and r["method"] != "bound"]
            assert row["rows"] <= min(packed)
            continue
        assert row["padding_frac"] == pytest.approx(brute_force(row, lengths, max_length, 4), abs=1e-12), row
    wrong = next(r for r in rows if r["method"] == "bfd/4" and r["loop"] == "offline")
    N = wrong["pack_length"]
    wrong = {**wrong, "padding_frac": 1 - sum(lengths) / ((wrong["rows"] + 1) * N)}
    assert wrong["padding_frac"] != pytest.approx(brute_force(wrong, lengths, max_length, 4), abs=1e-12)


def test_lower_bound_against_exhaustive_packing():
    """Martello-Toth's L2 never exceeds the exhaustive optimum and reaches it where the
    ceiling of total length over capacity does not (items over half a row). Control:
    the bound plus one exceeds the optimum somewhere (the check can fail)."""
    bound = load_benchmark("packing").lower_bound_rows
    g = torch.Generator().manual_seed(3)
    over = tighter = 0
    for _ in range(60):
        cap = int(torch.randint(4, 24, (1,), generator=g))
        lengths = torch.randint(1, cap + 1, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist()
        best, lb = optimal_bins(lengths, cap), bound(lengths, cap)
        assert lb <= best, (lengths, cap)
        over += lb + 1 > best
        tighter += lb > -(-sum(lengths) // cap)
    assert over > 0 and tighter > 0
    assert bound([6, 6, 6, 1], 10) == 3 == optimal_bins([6, 6, 6, 1], 10)  # ceil(19 / 10) = 2
