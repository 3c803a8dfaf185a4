"""KV-cached, batched speculative decoding (``evaluation.generate``) and the target-alone
baseline (``target_generate``), held to independent oracles on tiny fp64 Llama targets:

- greedy, several prompts of different lengths per batch (left padding): each output
  equals ``model.generate`` of that prompt alone, token for token, with a real draft
  and with oracle drafts that accept every count per row (rows then finish at
  different rounds and leave the batch; compaction forced on or left to its rule);
- sampled: each row equals the uncached one-prompt ``speculative_generate`` (the
  readable twin) with that row's seed, tokens and accepted counts, with a real draft
  whose proposals depend on its cache and rows accepting different counts.

Both implementations (``impl="dynamic"``: the draft cache grown by concatenation;
``impl="static"``: preallocated buffers of fixed shapes, what CUDA graphs record) run
every test; with a real draft built to agree with its target often (every acceptance
count, rows ending at different rounds by EOS, compaction forced) the two give the same
tokens and the same accepted counts round for round.

Negative controls: a target cache whose rejected slots stay visible, a draft cache
whose rejected and padding slots stay visible, and compaction that skips the target's
cache are each caught by the same comparison; so is a static draft that continues from
the wrong row after a round.
"""

import random
import types
from collections import Counter

import pytest
import torch

import eagle3fn.evaluation.cached_draft as cached_draft
import eagle3fn.evaluation.config as config
import eagle3fn.evaluation.kv as kv
import eagle3fn.evaluation.static_draft as static_draft
import eagle3fn.evaluation.verify as verify
from eagle3fn.evaluation import SpecConfig, evaluate, generate, speculative_generate, target_generate
from spec_setup import NEW, PROMPTS, V, agreeing_pair, greedy, make_draft, references, target  # noqa: F401
from test_train import workdir  # noqa: F401 - the tiny target + data fixture

pytestmark = pytest.mark.usefixtures("one_thread")
IMPLS = pytest.mark.parametrize("impl", config.IMPLS)


def prompts():
    return [torch.tensor(p) for p in PROMPTS]


def oracle_chain(monkeypatch, references, corrupt, seed=0):
    """Replace the draft's proposals by each row's greedy continuation, each token made
    wrong with probability ``corrupt``: rows accept every count 0..k. The rows of a
    round are read from the chooser ``generate`` builds just before the chain."""
    rng = random.Random(seed)
    seen = {}
    real_chooser = verify.draft_chooser

    def chooser(d2t, vocab, temperature, device, generators, rows):
        seen["rows"] = list(rows)
        return real_chooser(d2t, vocab, temperature, device, generators, rows)

    def chain(self, g, u, pos_B, keys, values, valid, k, choose):
        out = []
        for r, pos in zip(seen["rows"], pos_B.tolist()):
            full = list(PROMPTS[r]) + references[r]
            tokens = full[pos + 2:pos + 2 + k]  # x_{T-1} sits at pos + 1
            out.append([(t + 1) % V if rng.random() < corrupt else t for t in tokens])
        return torch.tensor(out), None

    monkeypatch.setattr(verify, "draft_chooser", chooser)
    monkeypatch.setattr(cached_draft.Draft, "chain", chain)


@IMPLS
@pytest.mark.parametrize("k", [1, 4])
def test_batched_greedy_equals_generate(target, references, k, impl):
    params, cfg, d2t = make_draft(target)
    out = generate(target, None, params, cfg, d2t, prompts(), SpecConfig(num_draft_tokens=k, max_new_tokens=NEW),
                   impl=impl)
    for r, ref in zip(out, references):
        assert r.tokens == ref[:NEW]
        assert r.target_forwards == len(r.accepted_per_round) + 1
    alone = target_generate(target, None, prompts(), SpecConfig(max_new_tokens=NEW))
    assert alone == [ref[:NEW] for ref in references]


@IMPLS
@pytest.mark.parametrize("compact", [False, True])
def test_batched_rollback_every_acceptance_count(target, references, monkeypatch, compact, impl):
    """Rows accept different counts each round (holes in the shared slot layout), and
    finish at different rounds; with ``compact`` the caches are compacted every round."""
    params, cfg, d2t = make_draft(target)
    oracle_chain(monkeypatch, references, corrupt=0.3)
    if compact:
        monkeypatch.setattr(kv, "COMPACT_SLACK", -10**6)
    k = 3
    run = lambda: generate(target, None, params, cfg, d2t, prompts(),  # noqa: E731
                           SpecConfig(num_draft_tokens=k, max_new_tokens=NEW), impl=impl)
    out = run()
    assert [r.tokens for r in out] == [ref[:NEW] for ref in references]
    counts = [n for r in out for n in r.accepted_per_round]
    assert set(counts) == set(range(k + 1))
    assert len({len(r.accepted_per_round) for r in out}) > 1  # rows left at different rounds
    # Negative control: rejected slots left visible in the target's cache.
    monkeypatch.setattr(kv, "kept", lambda n, steps: torch.ones(n.shape[0], steps.shape[0], dtype=torch.bool))
    assert [r.tokens for r in run()] != [ref[:NEW] for ref in references]


@IMPLS
def test_compaction_must_move_both_caches(target, references, monkeypatch, impl):
    """Negative control of compaction: reordering only the draft's cache is caught."""
    params, cfg, d2t = make_draft(target)
    oracle_chain(monkeypatch, references, corrupt=0.3, seed=2)
    monkeypatch.setattr(kv, "COMPACT_SLACK", -10**6)

    def cut_only(cache, order):  # the target's slots cut to the new length, not reordered
        for layer in cache.layers:
            layer.keys, layer.values = layer.keys[:, :, :order.shape[1]], layer.values[:, :, :order.shape[1]]

    monkeypatch.setattr(kv, "compact_target", cut_only)
    out = generate(target, None, params, cfg, d2t, prompts(), SpecConfig(num_draft_tokens=3, max_new_tokens=NEW),
                   impl=impl)
    assert [r.tokens for r in out] != [ref[:NEW] for ref in references]


@IMPLS
def test_batched_sampling_equals_the_uncached_twin(target, monkeypatch, impl):
    """Temperature 1.5, a real fp64 draft: every row's tokens and accepted counts equal
    ``speculative_generate`` of that prompt with seed ``seed + i``. The draft's
    proposals (its distribution q) read its cache, so a draft cache that keeps
    rejected or padding slots visible changes the samples (the negative control)."""
    params, cfg, d2t = make_draft(target, dtype=torch.float64)
    cfg_ = dict(num_draft_tokens=3, max_new_tokens=20, temperature=1.5)
    twins = [speculative_generate(target, None, params, cfg, d2t, p[None], SpecConfig(**cfg_, seed=4 + i))
             for i, p in enumerate(prompts())]
    out = generate(target, None, params, cfg, d2t, prompts(), SpecConfig(**cfg_, seed=4), impl=impl)
    assert [r.tokens for r in out] == [t.tokens for t in twins]
    assert [r.accepted_per_round for r in out] == [t.accepted_per_round for t in twins]
    assert len({n for t in twins for n in t.accepted_per_round}) >= 3
    real = cached_draft.cached_attend
    monkeypatch.setattr(cached_draft, "cached_attend",
                        lambda q, k, v, hidden, ok, ov: real(q, k, v, torch.zeros_like(hidden), ok, ov))
    out = generate(target, None, params, cfg, d2t, prompts(), SpecConfig(**cfg_, seed=4), impl=impl)
    assert [r.tokens for r in out] != [t.tokens for t in twins]


@IMPLS
def test_batched_eos_rows_leave(target, references, impl):
    """A row that emits the EOS stops there (kept, as ``generate``) and leaves the batch;
    the others go on unchanged."""
    import types

    eos = references[1][4]
    params, cfg, d2t = make_draft(target)
    out = generate(target, types.SimpleNamespace(eos_token_id=eos), params, cfg, d2t, prompts(),
                   SpecConfig(num_draft_tokens=2, max_new_tokens=NEW), impl=impl)
    for r, ref in zip(out, references):
        want = ref[:NEW]
        assert r.tokens == (want[:want.index(eos) + 1] if eos in want else want)
    assert len(out[1].tokens) == references[1].index(eos) + 1 < NEW


def test_static_equals_dynamic_with_an_agreeing_draft(monkeypatch):
    """A real draft accepting every count 0..k, rows ending at different rounds (EOS),
    compaction every round: ``impl="static"`` gives the tokens and accepted counts of
    ``impl="dynamic"``, and the tokens are ``model.generate``'s. Negative control: a
    static draft that continues from the wrong row after a round (one accepted position
    too early) changes the accepted counts, not the tokens."""
    target, params, cfg, d2t = agreeing_pair()
    monkeypatch.setattr(kv, "COMPACT_SLACK", -10**6)
    new, k = 24, 3
    refs = [greedy(target, p.tolist(), new) for p in prompts()]
    eos = refs[1][15]  # a token only row 1 emits: it ends early

    def run(impl):
        out = generate(target, types.SimpleNamespace(eos_token_id=eos), params, cfg, d2t, prompts(),
                       SpecConfig(num_draft_tokens=k, max_new_tokens=new), impl=impl)
        return [r.tokens for r in out], [r.accepted_per_round for r in out]

    tokens, counts = run("dynamic")
    assert tokens == [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in refs]
    assert set(Counter(n for c in counts for n in c)) == set(range(k + 1))
    assert len({len(c) for c in counts}) > 1  # rows left at different rounds
    assert run("static") == (tokens, counts)
    real_put = static_draft.StaticDraft.put

    def one_back(self, live, **inputs):  # row t one accepted position too early
        real_put(self, live, **dict(inputs, n=(inputs["n"] - 1).clamp_min(0)))

    monkeypatch.setattr(static_draft.StaticDraft, "put", one_back)
    wrong_tokens, wrong_counts = run("static")
    assert wrong_tokens == tokens and wrong_counts != counts


def test_static_cache_grows_and_errors(target, references, monkeypatch):
    """A static draft cache that starts at 8 slots doubles as the rows grow and gives
    the tokens of a large one; an unknown ``impl`` is refused by name."""
    params, cfg, d2t = make_draft(target)
    sizes = []
    real_reserve = static_draft.StaticDraft.reserve

    def reserve(self, slots):
        real_reserve(self, slots)
        sizes.append(self.cap)

    monkeypatch.setattr(static_draft, "initial_capacity", lambda slots: 8)
    monkeypatch.setattr(static_draft.StaticDraft, "reserve", reserve)
    out = generate(target, None, params, cfg, d2t, prompts(), SpecConfig(num_draft_tokens=3, max_new_tokens=NEW),
                   impl="static")
    assert [r.tokens for r in out] == [ref[:NEW] for ref in references]
    assert sorted(set(sizes)) == sizes[:1] + sorted(set(sizes))[1:] and len(set(sizes)) >= 2
    assert all(c & (c - 1) == 0 for c in sizes)
    with pytest.raises(ValueError, match="impl='fast' is not one of"):
        generate(target, None, params, cfg, d2t, prompts(), SpecConfig(), impl="fast")


def test_evaluate_reports_speed(target):
    params, cfg, d2t = make_draft(target)
    result = evaluate(target, params, cfg, d2t, prompts(), SpecConfig(num_draft_tokens=2, max_new_tokens=8),
                      batch_size=3)
    assert result["n_prompts"] == 4 and result["tokens"] == 4 * 8 and result["same_as_target"] == 4
    assert result["tokens_per_s"] == pytest.approx(result["tokens"] / result["seconds"])
    assert result["speedup"] == pytest.approx(result["tokens_per_s"] / result["target_tokens_per_s"])
    assert "speedup" not in evaluate(target, params, cfg, d2t, prompts()[:1], SpecConfig(max_new_tokens=2),
                                     baseline=False)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate(target, params, cfg, d2t, prompts(), SpecConfig(), batch_size=0)
    with pytest.raises(ValueError, match="non-empty prompts"):
        generate(target, None, params, cfg, d2t, [torch.tensor([], dtype=torch.long)], SpecConfig())


def test_eval_cli_prompts_file(workdir, tmp_path, capsys):  # noqa: F811
    """``eagle3fn eval --prompts FILE``: the first --num-prompts conversations of any chat
    JSONL, timed beside the target alone; more than the file holds, or a missing file,
    is a one-line error naming the value."""
    from eagle3fn.cli.main import main
    from eagle3fn.cli.run import EvalArgs
    from eagle3fn.train import train
    from test_errors import fails_in_one_line
    from test_train import config

    out = tmp_path / "run"
    train(config(workdir, out, max_steps=1), log=lambda s: None)
    capsys.readouterr()
    data = str(workdir / "chat.jsonl")
    main(["eval", "--run", str(out), "--prompts", data, "--num-prompts", "3", "--max-new-tokens", "5",
          "--num-draft-tokens", "2", "--batch-size", "2"])
    printed = capsys.readouterr().out
    assert f"3 prompts from {data}, 15 tokens: acceptance length" in printed and "note:" not in printed
    assert "tokens/s with the draft" in printed and "speedup" in printed and "3/3 outputs identical" in printed
    fails_in_one_line(capsys, ["eval", "--run", str(out), "--prompts", data, "--num-prompts", "9"], 2,
                      "--num-prompts 9 but", "has 8 conversations", "--num-prompts 8 or less")
    fails_in_one_line(capsys, ["eval", "--run", str(out), "--prompts", str(tmp_path / "nope.jsonl")], 2,
                      "nope.jsonl")
    with pytest.raises(ValueError, match="--batch-size 0 must be >= 1"):
        EvalArgs(batch_size=0)
