"""Sequence packing (SPEC 9), data to loop: the packers (first-fit, windowed best fit
against a plain twin and exhaustive search) and collation, the target's features of a
packed batch (equal to each conversation alone, with controls that leak across
conversations), the refusals, the training loop's first gradient packed vs unpacked
(online and from the cache, rows of --max-length and longer) in fp64 at 1e-10, the
offline plan across shards, reading a shard's conversations alone, packed resume and
its fingerprint."""

import pathlib

import pytest
import torch
from recorders import prepare_cache
from test_train import workdir  # noqa: F401 - the tiny target + data fixture

import eagle3fn.unrolled.attention as attention_module
from eagle3fn.io.data import Example
from eagle3fn.io.packing import (PACK_WINDOW, best_fit_decreasing, collate_packed, first_fit, pack_examples,
                                 pack_features)
from eagle3fn.loss import LossConfig
from eagle3fn.shapes import Features

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny runs: 2 threads crawl on a busy CPU

TOKEN, LOCAL = LossConfig(normalization="token_mean"), LossConfig()


# ---------------------------------------------------------------------------- data


def test_first_fit_golden_and_brute_force():
    assert first_fit([5, 3, 4, 2, 6, 1], 8) == [[0, 1], [2, 3, 5], [4]]
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        cap = int(torch.randint(4, 40, (1,), generator=g))
        lengths = torch.randint(1, cap + 1, (int(torch.randint(0, 60, (1,), generator=g)),), generator=g).tolist()
        bins, room = [], []
        for i, L in enumerate(lengths):
            b = next((b for b, r in enumerate(room) if r >= L), len(bins))
            if b == len(bins):
                bins.append([])
                room.append(cap)
            bins[b].append(i)
            room[b] -= L
        assert first_fit(lengths, cap) == bins
    with pytest.raises(ValueError, match="lengths must be in"):
        first_fit([3, 9], 8)


def plain_bfd(lengths, cap, window, carry=True):
    """A readable twin of ``best_fit_decreasing``: scan every open bin for the least room
    that fits. ``carry=False`` closes each window's bins at its end (a wrong variant)."""
    bins, opened, room = [], [], []
    for w, lo in enumerate(range(0, len(lengths), window)):
        for i in sorted(range(lo, min(lo + window, len(lengths))), key=lambda i: (-lengths[i], i)):
            fits = [b for b in range(len(bins)) if room[b] >= lengths[i]
                    and opened[b] in ((w - 1, w) if carry else (w,))]
            if fits:
                b = min(fits, key=lambda b: (room[b], b))
            else:
                b = len(bins)
                bins.append([])
                opened.append(w)
                room.append(cap)
            bins[b].append(i)
            room[b] -= lengths[i]
    return bins


def optimal_bins(lengths, cap):
    """The fewest bins of ``cap`` holding items of ``lengths`` unsplit (exhaustive search)."""
    items, best = sorted(lengths, reverse=True), [len(lengths)]

    def place(k, rooms):
        if len(rooms) >= best[0]:
            return
        if k == len(items):
            best[0] = len(rooms)
            return
        for b in sorted(set(range(len(rooms))), key=lambda b: rooms[b]):
            if rooms[b] >= items[k] and rooms[b] not in rooms[:b]:  # equal rooms are the same choice
                rooms[b] -= items[k]
                place(k + 1, rooms)
                rooms[b] += items[k]
        place(k + 1, rooms + [cap - items[k]])
    place(0, [])
    return best[0]


def check_plan(lengths, cap, window, rows):
    """What every packing plan must be: each item exactly once, none split, no row over
    ``cap``, no row mixing items ``2 * window`` or more apart."""
    assert sorted(i for r in rows for i in r) == list(range(len(lengths))), "items lost or repeated"
    assert all(sum(lengths[i] for i in r) <= cap for r in rows), "a row over its length"
    assert all(max(r) - min(r) < 2 * window for r in rows), "a row mixes items from far apart"


def test_best_fit_decreasing_against_twin_and_exhaustive_search():
    """The packer equals its plain twin (windows carried over one window), keeps every
    plan invariant, is deterministic, never beats the exhaustive optimum, and on random
    inputs needs no more rows than first-fit in order. Controls: the twin without the
    carry-over differs; corrupted plans fail ``check_plan``."""
    g = torch.Generator().manual_seed(1)
    differs = 0
    ff = bfd = 0
    for trial in range(60):
        cap = int(torch.randint(4, 30, (1,), generator=g))
        n = int(torch.randint(0, 8 if trial < 30 else 60, (1,), generator=g))
        lengths = torch.randint(1, cap + 1, (n,), generator=g).tolist()
        for window in (1, 2, 3, 5, 64):
            rows = best_fit_decreasing(lengths, cap, window)
            assert rows == plain_bfd(lengths, cap, window) == best_fit_decreasing(lengths, cap, window)
            check_plan(lengths, cap, window, rows)
            differs += rows != plain_bfd(lengths, cap, window, carry=False)
            if trial < 30:
                assert len(rows) >= optimal_bins(lengths, cap)
        ff, bfd = ff + len(first_fit(lengths, cap)), bfd + len(best_fit_decreasing(lengths, cap, max(n, 1)))
    assert bfd < ff, (bfd, ff)
    assert differs > 0
    assert optimal_bins([5, 5, 4, 3, 3], 10) == 2 and best_fit_decreasing([5, 5, 4, 3, 3], 10) == [[0, 1], [2, 3, 4]]
    lengths, rows = [3, 4, 2, 5], [[0, 1], [2, 3]]
    check_plan(lengths, 8, 2, rows)
    for bad, why in (([[0, 1], [2]], "lost"), ([[0, 1], [1, 2, 3]], "repeated"), ([[1, 3], [0, 2]], "over"),
                     ([[0, 2], [1], [3]], None), ([[3, 0], [1], [2]], "far apart")):
        if why is None:
            check_plan(lengths, 8, 2, bad)
            continue
        with pytest.raises(AssertionError, match=why):
            check_plan(lengths, 8, 1, bad) if why == "far apart" else check_plan(lengths, 8, 2, bad)
    with pytest.raises(ValueError, match="lengths must be in"):
        best_fit_decreasing([3, 9], 8)
    assert PACK_WINDOW >= 1


def _example(n, source):
    return Example(torch.arange(n) + 1, torch.arange(n) % 2 == 1, source)


def test_pack_examples_and_collate():
    """Best fit, longest first, never splitting; a conversation longer than max_length
    is cut (as without packing); positions restart, padding continues the last."""
    ex = [_example(n, f"f:{i}") for i, n in enumerate([5, 3, 12, 2, 4])]
    rows = pack_examples(ex, 8)
    assert [[e.source for e in r] for r in rows] == [["f:2"], ["f:0", "f:1"], ["f:4", "f:3"]]
    assert len(rows[0][0]) == 8 and torch.equal(rows[0][0].input_ids, ex[2].input_ids[:8])
    assert rows[1][0] is ex[0]  # a short conversation is passed as it is
    assert [[e.source for e in r] for r in pack_examples(ex, 8)] == [[e.source for e in r] for r in rows]
    b = collate_packed(rows, pad_token_id=0, length=10)
    assert {k: tuple(v.shape) for k, v in b.items()} == {k: (3, 10) for k in b}
    assert b["position_ids"][0].tolist() == list(range(10))
    assert b["position_ids"][2].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]
    assert b["attention_mask"].sum(1).tolist() == [8, 8, 6]
    assert b["input_ids"][2].tolist() == [1, 2, 3, 4, 1, 2, 0, 0, 0, 0]
    assert b["loss_mask"][1].tolist() == [False, True, False, True, False, False, True, False, False, False]
    # Rows of 16 (two conversations cut at 8 now share one): still cut at max_length.
    long_rows = pack_examples(ex, 8, length=16)
    assert [[e.source for e in r] for r in long_rows] == [["f:2", "f:0", "f:1"], ["f:4", "f:3"]]
    assert collate_packed(long_rows, 0, 16)["position_ids"][0].tolist() == [*range(8), *range(5), *range(3)]
    with pytest.raises(ValueError, match="row length"):
        pack_examples(ex, 8, length=7)


def test_packing_flags_are_checked():
    """--pack-length below --max-length and --pack-window < 1 are refused at once,
    naming the value and the fix; the row length defaults to --max-length."""
    from eagle3fn.train.config import TrainConfig

    assert TrainConfig(model="m", data="d", max_length=512).row_length == 512
    assert TrainConfig(model="m", data="d", max_length=512, pack_length=2048).row_length == 2048
    with pytest.raises(ValueError, match=r"--pack-length 256: must be >= --max-length \(512\)"):
        TrainConfig(model="m", data="d", max_length=512, pack_length=256)
    with pytest.raises(ValueError, match="--pack-window 0: must be >= 1"):
        TrainConfig(model="m", data="d", pack_window=0)


# ---------------------------------------------------------------------------- target


def tiny_target(impl):
    from transformers import LlamaConfig, LlamaForCausalLM

    from eagle3fn.io.target import load_target

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, attn_implementation=impl)
    return load_target(LlamaForCausalLM(cfg), aux_layer_ids=(1, 3, 5), dtype=torch.float64)


def err(x, y):
    return ((x - y).abs().max() / y.abs().max()).item()


@pytest.mark.parametrize("impl,tol", [("sdpa", 1e-10), ("eager", 1e-6)])
def test_target_features_of_a_packed_batch(impl, tol, monkeypatch):
    """The target on packed rows (position_ids restarting, transformers' packed-sequence
    masks) gives each conversation's aux and final hidden as it alone does; the packed
    cache path (``pack_features`` of unpacked features) equals it. fp64; eager at 1e-6
    because transformers' eager softmax runs in fp32 whatever the dtype. Controls: no
    position_ids, and the packed-sequence detection switched off (attention leaking
    across conversations, positions still restarting)."""
    import transformers.masking_utils as masking

    from eagle3fn.io.target import target_features

    target = tiny_target(impl)
    ex = [Example(torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)),
                  torch.ones(n, dtype=torch.bool), f"f:{n}") for n in (5, 7, 3, 9, 6)]
    rows = pack_examples(ex, 16)
    b = collate_packed(rows, 0, 16)
    packed = target_features(target, b["input_ids"], b["attention_mask"], position_ids=b["position_ids"])
    assert torch.equal(packed.positions, b["position_ids"])
    alone = {e.source: target_features(target, e.input_ids[None], torch.ones(1, len(e), dtype=torch.long))
             for e in ex}

    def worst(f):
        out = 0.0
        for r, row in enumerate(rows):
            start = 0
            for e in row:
                for name in ("aux", "final_hidden"):
                    got = getattr(f, name)[r, start:start + len(e)]
                    out = max(out, err(got, getattr(alone[e.source], name)[0]))
                start += len(e)
        return out
    assert worst(packed) <= tol
    from eagle3fn.io.batching import collate

    u = collate(ex, 0)
    cached, _ = pack_features(target_features(target, u["input_ids"], u["attention_mask"]), u["loss_mask"], 16)
    assert worst(cached) <= tol
    assert worst(target_features(target, b["input_ids"], b["attention_mask"])) > 1e-3
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    assert worst(target_features(target, b["input_ids"], b["attention_mask"],
                                 position_ids=b["position_ids"])) > 1e-3


def test_packed_target_refuses_multimodal_inputs():
    from eagle3fn.errors import UsageError
    from eagle3fn.io.target import target_features

    target = tiny_target("sdpa")
    ids = torch.ones(1, 4, dtype=torch.long)
    with pytest.raises(UsageError, match="text targets"):
        target_features(target, ids, ids, position_ids=torch.arange(4)[None], pixel_values=torch.zeros(1))


# ---------------------------------------------------------------------------- refusals


def test_sequence_parallelism_runs_unpacked():
    """Packing is on by default and off under sequence parallelism (its rows are split
    across ranks). A packed sequence cannot be split."""
    from eagle3fn.errors import UsageError
    from eagle3fn.parallel import ParallelConfig, shard_sequence
    from eagle3fn.train.config import TrainConfig

    assert TrainConfig(model="m", data="d").packs  # the default
    for par in (ParallelConfig(ring=2), ParallelConfig(ulysses=2)):
        assert not TrainConfig(model="m", data="d", parallel=par).packs
    assert not TrainConfig(model="m", data="d", pack=False).packs
    f = Features(input_ids=torch.zeros(1, 6, dtype=torch.long), aux=torch.zeros(1, 6, 3),
                 attention_mask=torch.ones(1, 6), positions=torch.tensor([[0, 1, 2, 0, 1, 2]]))
    with pytest.raises(UsageError, match="cannot be split by sequence parallelism"):
        shard_sequence(f, torch.zeros(1, 6, dtype=torch.bool), 2, 0, 2)


# ---------------------------------------------------------------------------- the loop


def _loop_config(workdir, out, **kw):  # noqa: F811
    """test_train's tiny run, fp64 on the CPU, every conversation in the first step."""
    from test_train import config

    return config(workdir, out, device="cpu", precision="float64", epochs=1, max_length=160, **kw)


def _rel(got, want):
    return max(((got[n] - want[n]).abs().max() / want[n].abs().max()).item() for n in want)


@pytest.fixture(scope="module")
def loop_cache(workdir, tmp_path_factory):  # noqa: F811
    return prepare_cache(workdir, tmp_path_factory.mktemp("packing") / "cache")


def test_loop_packed_equals_unpacked(workdir, tmp_path, monkeypatch):  # noqa: F811
    """The loop's first gradient (every conversation in one micro-batch: 8 x 77
    unpacked, 4 packed rows x 160, 2 rows x 320 with --pack-length 320) is the same
    packed or not under token_mean, and under local_mean once each is multiplied by its
    divisor (B*S: 640, 640 and 616). Controls: the local_mean gradients unscaled; in
    the rows of 320, the draft's or the target's attention leaking across
    conversations."""
    from loop_grad_cases import first_grads

    for loss in (TOKEN, LOCAL):
        kw = dict(loss=loss, trim="backbone", trim_loss_positions=False)
        unpacked = first_grads(_loop_config(workdir, tmp_path / f"u{loss.normalization}", batch_size=8, **kw))
        for rows, length in ((4, None), (2, 320)):
            packed = first_grads(_loop_config(workdir, tmp_path / f"p{loss.normalization}{rows}", batch_size=rows,
                                              pack=True, pack_length=length, **kw))
            if loss is TOKEN:
                assert _rel(packed, unpacked) <= 1e-10
            else:
                scaled = lambda g, x: {n: v * x for n, v in g.items()}  # noqa: E731
                assert _rel(scaled(packed, rows * (length or 160)), scaled(unpacked, 8 * 77)) <= 1e-10
                assert _rel(packed, unpacked) > 1e-3
    # Controls: the draft's attention, or the target's, blind to the documents. (Row maps
    # without document bounds change nothing here: chat data never supervises a
    # conversation's first k tokens, its prompt comes first.)
    import transformers.masking_utils as masking

    want = first_grads(_loop_config(workdir, tmp_path / "want", batch_size=8, loss=TOKEN))
    for module, name, blind in ((attention_module, "document_starts", torch.zeros_like),
                                (masking, "find_packed_sequence_indices", lambda position_ids: None)):
        with monkeypatch.context() as patch:
            patch.setattr(module, name, blind)
            got = first_grads(_loop_config(workdir, tmp_path / f"blind-{name}", batch_size=2, pack=True,
                                           pack_length=320, loss=TOKEN))
        assert _rel(got, want) > 1e-3, name


def test_loop_packed_cache_equals_unpacked(workdir, loop_cache, tmp_path):  # noqa: F811
    """The offline cache (four shards of 2 conversations) packed across its shards, in
    rows of 160 (grad_accum 4) and of 320: the unpacked cache's gradient (token_mean).
    Control: the offline rows gathered with each conversation's positions counted from
    its row's start (no restart) change it."""
    import eagle3fn.io.packing as packing
    from loop_grad_cases import first_grads

    kw = dict(cache=str(loop_cache), grad_accum=4, loss=TOKEN)
    unpacked = first_grads(_loop_config(workdir, tmp_path / "u", **kw))
    for length in (None, 320):
        packed = first_grads(_loop_config(workdir, tmp_path / f"p{length}", pack=True, pack_length=length, **kw))
        assert _rel(packed, unpacked) <= 1e-10
    real = packing._positions
    try:
        packing._positions = lambda lengths, width: torch.arange(width)
        wrong = first_grads(_loop_config(workdir, tmp_path / "wrong", pack=True, pack_length=320, **kw))
    finally:
        packing._positions = real
    assert _rel(wrong, unpacked) > 1e-3


def test_cache_reads_some_conversations_of_a_shard(loop_cache):
    """``FeatureCache.read(i, conversations=)``: those conversations alone, in that
    order, as the whole shard's rows (cut to their longest); a window applies to them.
    Control: the rows in the shard's order differ."""
    from eagle3fn.io.cache import FeatureCache

    cache = FeatureCache(loop_cache)
    whole = cache.read(0)
    L = whole.features.attention_mask.sum(1).tolist()
    part = cache.read(0, conversations=[1, 0])
    S = max(L)
    for name in ("input_ids", "aux", "attention_mask", "final_hidden"):
        assert torch.equal(getattr(part.features, name), getattr(whole.features, name)[[1, 0], :S]), name
    assert torch.equal(part.loss_mask, whole.loss_mask[[1, 0], :S])
    assert not torch.equal(part.features.aux, whole.features.aux[[0, 1], :S])
    one = cache.read(0, conversations=[1])
    assert torch.equal(one.features.aux, whole.features.aux[[1], :L[1]])
    chunk = cache.read(0, (2, 5), conversations=[1])
    assert torch.equal(chunk.features.aux, whole.features.aux[[1], 2:5])


def test_offline_packing_plan_and_resume_fingerprint(workdir, loop_cache, tmp_path):  # noqa: F811
    """Offline packed batches: every training conversation exactly once, rows of at
    most --pack-length, the held-out shard's conversations apart, the same items on
    every build, each loaded batch of the planned shape; a run resumed after its first
    step ends bitwise as one uninterrupted run. The run fingerprint records how rows
    are packed: a resume with another --pack-window is refused, naming it; an unpacked
    run records none of it."""
    import dataclasses

    from eagle3fn.errors import RunError
    from eagle3fn.train.checkpoint import run_fingerprint
    from eagle3fn.train.loop import train
    from eagle3fn.train.sources import offline_source

    cfg = _loop_config(workdir, tmp_path / "run", cache=str(loop_cache), pack=True, pack_length=200,
                       batch_size=1, eval_holdout=2, loss=TOKEN)
    (train_ex, src), (_, holdout) = offline_source(cfg, torch.device("cpu"), prefetch=0)
    again = offline_source(cfg, torch.device("cpu"), prefetch=0)[0][1]
    assert src.items == again.items
    refs = [ref for item in src.items for row in item for ref in row]
    assert sorted(refs) == [(i, b) for i in range(3) for b in range(2)]  # shards 0-2 train, shard 3 is held out
    assert {i for item in holdout.items for row in item for i, _ in row} == {3}
    lengths = {(i, b): len(train_ex[2 * i + b]) for i in range(3) for b in range(2)}
    for item in src.items:
        features, _ = src.load(item)
        assert features.input_ids.shape == (len(item), 200)
        assert features.attention_mask.sum(1).tolist() == [sum(lengths[r] for r in row) for row in item]
    fp = lambda c: run_fingerprint(c, device=torch.device("cpu"), precision=torch.float64, world={},  # noqa: E731
                                   d2t=torch.zeros(1), t2d=torch.zeros(1))["settings"]
    assert fp(cfg)["pack_rows"] == {"length": 200, "window": PACK_WINDOW}
    assert not {"pack", "pack_rows", "pack_length", "pack_window"} & fp(dataclasses.replace(cfg, pack=False)).keys()
    # Resumed after step 1 (background prefetch on, as train runs it): step 2 bitwise
    # as in one uninterrupted run; another window is refused.
    from test_train import final_params

    whole = dataclasses.replace(cfg, max_steps=2, out_dir=str(tmp_path / "whole"))
    train(whole, log=lambda s: None)
    train(dataclasses.replace(whole, max_steps=1, out_dir=str(tmp_path / "cut")), log=lambda s: None)
    a, b = final_params(tmp_path / "whole"), final_params(tmp_path / "cut")
    assert not all(torch.equal(a[n], b[n]) for n in a)  # control: step 2 changes the weights
    train(dataclasses.replace(whole, out_dir=str(tmp_path / "cut")), log=lambda s: None)
    b = final_params(tmp_path / "cut")
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(RunError, match=f"settings.pack_rows.window: {PACK_WINDOW} -> 4"):
        train(dataclasses.replace(whole, out_dir=str(tmp_path / "cut"), pack_window=4), log=lambda s: None)


def test_offline_on_cuda_packs_a_batch_into_one_row(workdir, tmp_path, loop_cache):  # noqa: F811
    """Offline on CUDA with no --pack-length, --batch-size B rows of --max-length L become
    one row of B x L per micro-batch (``TrainConfig.packed_rows``, while B x L <=
    ``OFFLINE_ROW_TOKENS``): the plan packs every conversation once into rows of B x L,
    the memory check sizes one such row, and the run fingerprint records it (a resume
    with the other layout is refused). Everywhere else the rows stay as asked: on the
    CPU, online, with --pack-length, with eager draft attention, or past the bound."""
    import dataclasses

    from transformers import AutoConfig

    from eagle3fn.train.checkpoint import run_fingerprint
    from eagle3fn.train.config import OFFLINE_ROW_TOKENS
    from eagle3fn.train.preflight import step_memory
    from eagle3fn.train.sources import packed_batches

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    cfg = _loop_config(workdir, tmp_path / "run", cache=str(loop_cache), pack=True, batch_size=2)
    L = cfg.max_length
    assert cfg.packed_rows(cuda) == (1, 2 * L) and cfg.packed_rows(cpu) == (2, L)
    for other in (dict(cache=None), dict(pack_length=2 * L), dict(batch_size=OFFLINE_ROW_TOKENS // L + 1)):
        c = dataclasses.replace(cfg, **other)
        assert c.packed_rows(cuda) == (c.batch_size, c.row_length), other
    eager = dataclasses.replace(cfg, ttt=dataclasses.replace(cfg.ttt, attention="eager"))
    assert eager.packed_rows(cuda) == (2, L)
    lengths = [[30, 150], [90, 60], [160, 10]]
    long_rows = packed_batches(lengths, cfg, *cfg.packed_rows(cuda))
    assert all(len(batch) == 1 and sum(lengths[i][b] for i, b in batch[0]) <= 2 * L for batch in long_rows)
    assert sorted(ref for batch in long_rows for ref in batch[0]) == [(i, b) for i in range(3) for b in range(2)]
    assert len(long_rows) < sum(len(batch) for batch in packed_batches(lengths, cfg, 2, L))
    need = step_memory(cfg, AutoConfig.from_pretrained(workdir / "model"), cuda, torch.bfloat16)
    assert (need.rows, need.seq_len) == (1, 2 * L)
    fp = lambda c, device: run_fingerprint(c, device=device, precision=torch.float64, world={},  # noqa: E731
                                           d2t=torch.zeros(1), t2d=torch.zeros(1))["settings"]["pack_rows"]
    assert fp(cfg, cuda) == {"length": 2 * L, "window": PACK_WINDOW, "rows": 1}
    assert fp(cfg, cpu) == {"length": L, "window": PACK_WINDOW}  # the format runs before this default have
    assert fp(dataclasses.replace(cfg, pack_length=2 * L), cuda) == {"length": 2 * L, "window": PACK_WINDOW}


def test_a_resume_of_an_offline_run_packed_the_old_way_says_how():
    """A checkpoint whose fingerprint packed rows of --max-length, resumed where the new
    offline default packs one row per micro-batch: refused, naming the difference and the
    flag that resumes it as it was. Control: another difference gets no such hint."""
    from eagle3fn.errors import RunError
    from eagle3fn.train.checkpoint import check_resume

    old = {"settings": {"pack_rows": {"length": 2048, "window": PACK_WINDOW}, "lr": 1e-4}}
    new = {"settings": {"pack_rows": {"length": 8192, "window": PACK_WINDOW, "rows": 1}, "lr": 1e-4}}
    state = {"config": {"max_steps": None}, "fingerprint": old, "params": {}}
    with pytest.raises(RunError, match="pack_rows.length: 2048 -> 8192.*pass --pack-length 2048 to resume it"):
        check_resume(pathlib.Path("run/checkpoint.pt"), state, new, {}, max_steps=None)
    other = {"settings": {**old["settings"], "lr": 2e-4}}
    with pytest.raises(RunError) as raised:
        check_resume(pathlib.Path("run/checkpoint.pt"), state, other, {}, max_steps=None)
    assert "lr" in str(raised.value) and "--pack-length" not in str(raised.value)


def test_a_resume_in_another_precision_names_the_flag():
    """A CPU run trained in fp32, resumed where ``--precision auto`` is now bf16 (a CPU
    with AMX): refused, naming the difference and ``--precision float32``. Control: the
    same precision resumes past this check; another difference gets no such hint."""
    from eagle3fn.errors import RunError
    from eagle3fn.train.checkpoint import check_resume

    old = {"settings": {"precision": "float32", "lr": 1e-4}}
    state = {"config": {"max_steps": None}, "fingerprint": old, "params": {}}
    with pytest.raises(RunError, match="precision: float32 -> bfloat16.*pass --precision float32 to resume it"):
        check_resume(pathlib.Path("run/checkpoint.pt"), state,
                     {"settings": {**old["settings"], "precision": "bfloat16"}}, {}, max_steps=None)
    check_resume(pathlib.Path("run/checkpoint.pt"), state, old, {}, max_steps=None)
    with pytest.raises(RunError) as raised:
        check_resume(pathlib.Path("run/checkpoint.pt"), state, {"settings": {**old["settings"], "lr": 2e-4}}, {},
                     max_steps=None)
    assert "lr" in str(raised.value) and "--precision" not in str(raised.value)
