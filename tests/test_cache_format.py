"""Format 3 of the feature cache: training from it is bitwise training from the padded
features it replaces, its size is estimated before prepare runs, fp8 aux is bounded
and recorded."""

import json
import re

import pytest
import torch
from recorders import prepare_cache, save_tiny_target, write_tiny_chat
from safetensors.torch import load_file

from eagle3fn.cli.main import main
from eagle3fn.io.cache import FeatureCache, cache_info, layout
from eagle3fn.train import CHECKPOINT, train
from eagle3fn.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("no_gpu", "one_thread")  # one thread: tiny runs crawl with 2 on a busy CPU


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, no_gpu):
    d = tmp_path_factory.mktemp("format3")
    save_tiny_target(d / "model")
    write_tiny_chat(d / "chat.jsonl", 8)
    return d


def config(workdir, out, **kw):
    base = dict(model=str(workdir / "model"), data=str(workdir / "chat.jsonl"), out_dir=str(out),
                draft_vocab_size=64, batch_size=2, epochs=1, ttt_length=3, save_every=4, lr=1e-3,
                pack=False)  # one conversation per row: the comparison is batch by batch
    return TrainConfig(**{**base, **kw})


def params(out):
    return torch.load(out / CHECKPOINT, weights_only=False)["params"]


def bf16_features(monkeypatch):
    """Online features and head rounded through bf16 storage, padding included: what the
    padded format 2 held for a bf16 cache (its reader upcast them to the compute dtype)."""
    import eagle3fn.io.target

    real = eagle3fn.io.target.target_features

    def rounded(*args, **kwargs):
        f = real(*args, **kwargs)
        cast = lambda x: x.to(torch.bfloat16).to(x.dtype)  # noqa: E731
        return type(f)(**{**f.__dict__, "aux": cast(f.aux), "final_hidden": cast(f.final_hidden),
                          "target_head": cast(f.target_head)})
    monkeypatch.setattr(eagle3fn.io.target, "target_features", rounded)


@pytest.mark.parametrize("trim_loss_positions,precision", [(True, "bfloat16"), (False, "float32")])
def test_bf16_cache_trains_bitwise_like_padded_bf16_features(workdir, tmp_path, monkeypatch,
                                                             trim_loss_positions, precision):
    """The ragged cache (aux at real tokens, final hidden at teacher positions, zeros
    elsewhere) trains the same weights, bitwise, as the padded bf16 features: on the
    loss-trimmed path with the target and the step in bf16, and on the full-length path
    (trim_loss_positions=False: a teacher read at every position) in fp32. Negative
    control: final hidden kept at the supervised t instead of t + 1."""
    run = dict(trim_loss_positions=trim_loss_positions, precision=precision, max_steps=2)
    cache = prepare_cache(workdir, tmp_path / "cache", "--model.dtype", precision, storage="bfloat16")
    train(config(workdir, tmp_path / "off", cache=str(cache), **run), log=lambda s: None)
    with monkeypatch.context() as patch:
        bf16_features(patch)
        train(config(workdir, tmp_path / "on", **run), log=lambda s: None)
    want, got = params(tmp_path / "on"), params(tmp_path / "off")
    assert all(torch.equal(want[n], got[n]) for n in want)
    if trim_loss_positions:  # every step's wait on input is in metrics.jsonl (0 online)
        from eagle3fn.train.metrics import read_metrics

        waits = lambda run: [r["input_wait_s"] for r in read_metrics(tmp_path / run / "metrics.jsonl")  # noqa: E731
                             if r.get("split") != "eval"]
        assert len(waits("off")) == 2 and all(w > 0 for w in waits("off")) and set(waits("on")) == {0.0}
        return
    with monkeypatch.context() as patch:  # the control: teacher rows not shifted
        patch.setattr(layout, "teacher_mask", lambda loss, attention: loss.bool() & attention.bool())
        wrong = prepare_cache(workdir, tmp_path / "wrong", storage="bfloat16")
    train(config(workdir, tmp_path / "wrong-run", cache=str(wrong), **run), log=lambda s: None)
    bad = params(tmp_path / "wrong-run")
    assert not all(torch.equal(want[n], bad[n]) for n in want)


def test_estimate_within_5_percent_and_cache_info(workdir, tmp_path, capsys):
    """prepare prints its estimate before the target runs and the measured size at the
    end (within 5%); cache info's counts match the tokenized data and its bytes per
    token sum to the files' bytes. Control: format 2's padded size is not within 5%."""
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.testing import tiny_chat_tokenizer

    capsys.readouterr()
    cache = prepare_cache(workdir, tmp_path / "cache", storage="bfloat16")
    out = capsys.readouterr().out
    estimate = int(re.search(r"estimated [\d.]+ GiB \((\d+) bytes", out).group(1))
    measured = int(re.search(r"measured [\d.]+ GiB \((\d+) bytes", out).group(1))
    assert out.index("estimated") < out.index("wrote shard") < out.index("measured")
    on_disk = sum(p.stat().st_size for p in cache.glob("*.safetensors"))
    assert measured == on_disk and abs(estimate - measured) <= 0.05 * measured
    padded = int(re.search(r"padded format 2: (\d+)\)", out).group(1))
    info = cache_info(cache)
    assert abs(padded * info["tokens"] - measured) > 0.05 * measured
    examples = tokenize_file(workdir / "chat.jsonl", tiny_chat_tokenizer(), max_length=2048)
    assert info["conversations"] == len(examples) == 8
    assert info["tokens"] == sum(len(e) for e in examples)
    assert info["supervised"] == sum(int(e.loss_mask.sum()) for e in examples)
    assert info["teacher_rows"] == sum(int(e.loss_mask[:-1].sum()) for e in examples)
    assert info["bytes"] == on_disk
    assert sum(info["per_token"].values()) * info["tokens"] == pytest.approx(on_disk, rel=1e-12)
    assert info["per_token"]["aux"] == 3 * 32 * 2 and info["dtype"] == "bfloat16"
    main(["cache", "info", str(cache)])
    printed = capsys.readouterr().out
    assert f"conversations 8; real tokens {info['tokens']}; supervised tokens {info['supervised']}" in printed
    assert f"bytes {on_disk} " in printed and "aux 192.0" in printed
    assert "storage dtype bfloat16; aux dtype storage; hidden size 32" in printed


def test_fp8_aux_is_bounded_recorded_and_refused_on_mismatch(workdir, tmp_path, capsys):
    """fp8 e4m3 aux with a scale per position and layer: each value within e4m3's
    rounding (2^-4 relative, 2^-9 of the scale near zero) of the fp32 cache; the final
    hidden is stored as --storage. Control: the scale dropped breaks the bound. The
    aux dtype is in the fingerprint: a resume with another is refused."""
    exact = FeatureCache(prepare_cache(workdir, tmp_path / "f32"))
    fp8 = prepare_cache(workdir, tmp_path / "fp8", "--aux-dtype", "float8_e4m3")
    shard = load_file(str(fp8 / "shard-000000.safetensors"))
    assert shard["aux"].dtype == torch.float8_e4m3fn and shard["aux_scale"].shape == (len(shard["aux"]), 3)
    cache = FeatureCache(fp8)
    for i in range(len(cache)):
        want, got = exact[i].features, cache[i].features
        assert torch.equal(got.final_hidden, want.final_hidden) and torch.equal(got.input_ids, want.input_ids)
        x, y = want.aux, got.aux
        scale = x.unflatten(-1, (3, -1)).abs().amax(-1, keepdim=True).expand(*x.shape[:-1], 3, 32).flatten(-2) / 448
        assert bool(((y - x).abs() <= 2 ** -4 * x.abs() + 2 ** -9 * scale + 1e-30).all())
        assert (y - x).abs().max() > 0  # lossy indeed
    q, s = layout.quantize_fp8(exact[0].features.aux[0])
    assert not bool(((q.float() - exact[0].features.aux[0]).abs() <= 2 ** -4 * exact[0].features.aux[0].abs()
                     + 2 ** -9 * s.repeat_interleave(32, -1)).all())
    m = json.loads((fp8 / "manifest.json").read_text())
    assert m["aux_dtype"] == m["fingerprint"]["aux_dtype"] == "float8_e4m3"
    assert cache_info(fp8)["per_token"]["aux"] == 3 * 32 + 3 * 4
    with pytest.raises(SystemExit) as e:
        prepare_cache(workdir, fp8)
    assert e.value.code == 2 and "aux_dtype: float8_e4m3 -> storage" in capsys.readouterr().err


def test_a_windowed_read_equals_the_whole_shard_cut(workdir, tmp_path):
    """A sequence-parallel window reads slices of each conversation's rows and equals
    the whole shard cut to it, for aux (fp8 too) and final hidden; past the end it is
    empty. Control: the window shifted by one position differs."""
    cache = FeatureCache(prepare_cache(workdir, tmp_path / "fp8", "--aux-dtype", "float8_e4m3"))
    whole = cache[1].features
    S = whole.input_ids.shape[1]
    for a, c in ((0, 5), (3, S - 2), (S - 4, S + 7), (S, S + 3), (0, 0)):
        part = cache.read(1, (a, c)).features
        assert torch.equal(part.aux, whole.aux[:, a:c]) and torch.equal(part.final_hidden, whole.final_hidden[:, a:c])
        assert torch.equal(part.input_ids, whole.input_ids)
    assert whole.final_hidden[:, 3:S - 2].any()  # the teacher rows are inside the windows
    part = cache.read(1, (4, 12)).features
    assert not torch.equal(part.aux, whole.aux[:, 5:13])


def test_prefetcher_returns_what_a_direct_read_returns(workdir, tmp_path, monkeypatch):
    """The background reader serves the epoch order (stride 2: one data-parallel rank of
    two) from loads started ahead, with sequence-parallel windows given as new partials
    each call; every result equals a direct read, a guess it did not make is read in
    place, a background error is raised by the get that asks for it. Control: keyed
    without its window, a prefetched shard of another window is caught."""
    import functools

    import eagle3fn.io.prefetch as prefetch
    from eagle3fn.parallel import chunk_window

    cache = FeatureCache(prepare_cache(workdir, tmp_path / "c", "--batch-size", "1"))
    direct = lambda i, w=None: cache.read(i, w).features.aux  # noqa: E731
    order = [5, 2, 7, 0, 3, 6, 1, 4]
    window = lambda: functools.partial(chunk_window, sp=2, sp_rank=1, ttt_length=3)  # noqa: E731
    fetch = prefetch.Prefetcher(direct, lambda x: x, order, depth=2)
    for pos in range(0, len(order), 2):
        assert torch.equal(fetch.get(order[pos], window()), direct(order[pos], window()))
    assert fetch.hits == 3 and fetch.misses == 1 and fetch.take_wait() > 0 and fetch.take_wait() == 0
    assert torch.equal(fetch.get(order[1]), direct(order[1]))  # not guessed: read in place
    fetch.close()

    def broken(i, w=None):
        if i == 2:
            raise RuntimeError("shard 2 is broken")
        return direct(i, w)
    fetch = prefetch.Prefetcher(broken, lambda x: x, [0, 1, 2], depth=2)
    fetch.get(0)
    with pytest.raises(RuntimeError, match="shard 2 is broken"):
        fetch.get(1), fetch.get(2)
    fetch.close()
    monkeypatch.setattr(prefetch, "window_key", lambda w: None)  # the control
    fetch = prefetch.Prefetcher(direct, lambda x: x, [0, 1, 2], depth=2)
    fetch.get(0, (0, 4))
    assert not torch.equal(fetch.get(1, (2, 6)), direct(1, (2, 6)))
    fetch.close()


def test_offline_source_pins_and_moves_no_head_per_batch(workdir, tmp_path, monkeypatch):
    """The background half of a load hands over no target head (it is moved to the
    device once), so no batch pins or copies ``[V, Ht]``; every batch shares one head."""
    from eagle3fn.train.sources import offline_source

    cache = prepare_cache(workdir, tmp_path / "c")
    seen = []
    import eagle3fn.io.prefetch as prefetch

    real_pin = prefetch.pin
    monkeypatch.setattr(prefetch, "pin", lambda x: seen.append(x) or real_pin(x))
    (_, source), _ = offline_source(config(workdir, tmp_path / "run", cache=str(cache)), torch.device("cpu"))
    order = source.order(0, 0)
    got = [source.load(source.items[i]) for i in order]
    handed = [x for x in seen if isinstance(x, tuple)]  # (features, loss_mask) per background load
    assert handed and all(features.target_head is None for features, _ in handed)
    assert all(f.target_head is got[0][0].target_head for f, _ in got)  # one head for every batch
    assert source.take_wait() > 0 and source.take_wait() == 0
