"""Offline feature cache: identical to the online features where it keeps them (aux at
every real token, final hidden at the teacher positions), resumable after a kill."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from eagle3fn.errors import UsageError
from eagle3fn.io.cache import FeatureCache, write_cache
from eagle3fn.io.cache import layout
from eagle3fn.shapes import Features

AUX = (0, 1, 2)
N_BATCHES = 5


def tiny_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def batches():
    g = torch.Generator().manual_seed(1)
    for _ in range(N_BATCHES):
        attention = torch.ones(2, 10, dtype=torch.long)
        attention[1, 7:] = 0
        yield {"input_ids": torch.randint(0, 97, (2, 10), generator=g) * attention,
               "attention_mask": attention,
               "loss_mask": (torch.rand(2, 10, generator=g) < 0.5) & attention.bool()}


def features_fn(model):
    @torch.no_grad()
    def run(batch):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    output_hidden_states=True)
        hs = out.hidden_states
        return Features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        aux=torch.cat([hs[i + 1] for i in AUX], dim=-1), final_hidden=hs[-1],
                        target_head=model.lm_head.weight.detach())
    return run


FP = {"target": "tiny-llama", "aux_layer_ids": list(AUX)}


def teacher_positions_oracle(loss_mask_S, length):
    """Brute force (SPEC 1): the teacher of supervised t (m_t = 1, t <= L-2) is z'[t] =
    z_{t+1}, so the final hidden is read at t + 1."""
    return {t + 1 for t in range(length - 1) if loss_mask_S[t]}


def test_cached_batches_equal_the_online_ones(tmp_path):
    model = tiny_target()
    online = features_fn(model)
    manifest = write_cache(tmp_path, batches(), online, fingerprint=FP, dtype=torch.float32, log=lambda s: None)
    assert manifest["complete"] and len(manifest["shards"]) == N_BATCHES and manifest["format"] == 3
    cache = FeatureCache(tmp_path)
    assert len(cache) == N_BATCHES
    for batch, cached in zip(batches(), cache):
        want, got = online(batch), cached.features
        real = batch["attention_mask"].bool()
        for field in ("input_ids", "target_head"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
        assert torch.equal(got.attention_mask, batch["attention_mask"])
        assert torch.equal(cached.loss_mask, batch["loss_mask"])
        assert torch.equal(got.aux[real], want.aux[real]) and not got.aux[~real].any()
        for b, L in enumerate(real.sum(1).tolist()):
            kept = {p for p in range(got.final_hidden.shape[1]) if got.final_hidden[b, p].any()}
            assert kept == teacher_positions_oracle(batch["loss_mask"][b], L), b
            for p in kept:
                assert torch.equal(got.final_hidden[b, p], want.final_hidden[b, p])
    # Negative control: the oracle tells the shifted rows from the unshifted ones here.
    last = list(batches())[-1]
    unshifted = {t for t in range(9) if last["loss_mask"][0, t]}
    assert unshifted != teacher_positions_oracle(last["loss_mask"][0], 10)
    # A rank reads only its own shards (here: rank 1 of 2).
    mine = FeatureCache(tmp_path, shards=range(1, N_BATCHES, 2))
    assert len(mine) == 2 and torch.equal(mine[1].features.aux, cache[3].features.aux)
    # Negative control: the comparison sees a one-layer shift of the aux features.
    shifted = torch.cat([model(input_ids=batch["input_ids"], output_hidden_states=True)
                         .hidden_states[i] for i in AUX], dim=-1)
    assert not torch.equal(cache[N_BATCHES - 1].features.aux, shifted)


def test_bf16_shards_are_ragged_and_their_size_is_computed(tmp_path):
    write_cache(tmp_path, batches(), features_fn(tiny_target()), fingerprint=FP, log=lambda s: None)
    shard = load_file(str(tmp_path / "shard-000000.safetensors"))
    first = next(batches())
    N = int(first["attention_mask"].sum())
    M = sum(len(teacher_positions_oracle(first["loss_mask"][b], L))
            for b, L in enumerate(first["attention_mask"].sum(1).tolist()))
    assert N == 17 and shard["aux"].dtype == torch.bfloat16 and shard["aux"].shape == (N, 96)
    assert shard["final_hidden"].shape == (M, 32) and shard["offsets"].tolist() == [0, 10, 17]
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in shard.items()}
    assert layout.file_bytes(shapes) - (tmp_path / "shard-000000.safetensors").stat().st_size in range(0, 64)
    parts = layout.component_bytes(shapes)
    assert sum(parts.values()) == sum(t.numel() * t.element_size() for t in shard.values())
    assert parts["aux"] == N * 96 * 2 and parts["final_hidden"] == M * (32 * 2 + 4) + 3 * 8


def _killed_run(out_dir):
    """Writes shards until the third batch, then dies without cleanup (like a kill)."""
    run = features_fn(tiny_target())
    calls = []

    def dying(batch):
        calls.append(1)
        if len(calls) == 3:
            os._exit(17)
        return run(batch)
    write_cache(out_dir, batches(), dying, fingerprint=FP, log=lambda s: None)


def test_killed_run_resumes_losing_only_the_shard_in_flight(tmp_path):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    here = pathlib.Path(__file__).parent
    proc = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(here)!r}); "
                           f"import test_cache; test_cache._killed_run({str(killed)!r})"])
    assert proc.returncode == 17
    assert sorted(p.name for p in killed.glob("shard-*")) == ["shard-000000.safetensors",
                                                              "shard-000001.safetensors"]
    with pytest.raises(ValueError, match="unfinished cache"):
        FeatureCache(killed)
    run = features_fn(tiny_target())
    calls = []
    write_cache(killed, batches(), lambda b: calls.append(1) or run(b), fingerprint=FP, log=lambda s: None)
    assert len(calls) == N_BATCHES - 2  # the two finished shards were not recomputed
    write_cache(clean, batches(), run, fingerprint=FP, log=lambda s: None)
    for name in sorted(p.name for p in clean.glob("*.safetensors")):
        a, b = load_file(str(killed / name)), load_file(str(clean / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert not list(killed.glob("*.tmp"))


def test_bad_caches_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a feature cache"):
        FeatureCache(tmp_path)
    run = features_fn(tiny_target())
    write_cache(tmp_path, batches(), run, fingerprint=FP, log=lambda s: None)
    with pytest.raises(UsageError, match="other settings .old -> new: target: tiny-llama -> other.;"):
        write_cache(tmp_path, batches(), run, fingerprint={**FP, "target": "other"}, log=lambda s: None)


def test_sequence_parallel_rank_reads_only_its_window(tmp_path):
    """A rank reads aux/final_hidden only for its chunk + tail (a slice of the file), and
    its local batch equals the one cut from the whole shard. Negative control: another
    rank's window gives another batch."""
    from eagle3fn.align import supervised_mask
    from eagle3fn.parallel import chunk_window, shard_sequence

    write_cache(tmp_path, batches(), features_fn(tiny_target()), fingerprint=FP, dtype=torch.float32,
                log=lambda s: None)
    cache = FeatureCache(tmp_path)
    sp, k = 3, 2
    for r in range(sp):
        whole = cache[1]
        L = whole.features.input_ids.shape[1]
        sup = supervised_mask(whole.loss_mask, whole.features.attention_mask)
        want, want_sup, _ = shard_sequence(whole.features, sup, sp, r, k)
        window = chunk_window(L, sp, r, k)
        part = cache.read(1, window)
        assert part.features.aux.shape[1] == min(window[1], L) - window[0]
        got, got_sup, _ = shard_sequence(part.features, sup, sp, r, k, windowed=("aux", "final_hidden"))
        for name in ("input_ids", "aux", "attention_mask", "final_hidden", "positions"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (r, name)
        assert torch.equal(got_sup, want_sup)
    other = cache.read(1, chunk_window(L, sp, 0, k))
    got, _, _ = shard_sequence(other.features, sup, sp, 1, k, windowed=("aux", "final_hidden"))
    assert not torch.equal(got.aux, shard_sequence(whole.features, sup, sp, 1, k)[0].aux)
