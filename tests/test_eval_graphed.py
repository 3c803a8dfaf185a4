"""``evaluation.generate(impl="graph")`` and its target-alone baseline
(``evaluation.graphed``): the target on a ``decoding.StaticKVCache``, its verifying
forward one CUDA graph on CUDA (eager here: the same code), held to independent oracles
on tiny fp64 Llama targets:

- greedy tokens equal ``model.generate`` of each prompt alone, batch sizes 1 and 3,
  k in {1, 3}, with oracle drafts whose rows accept every count 0..k (rows end at
  different rounds and stay in the batch);
- accepted counts per round equal ``impl="static"``'s with a real draft built to agree
  (every count, an EOS mid-way, the draft's cache compacted every round), greedy and
  sampled;
- the target alone on the same path equals ``target_generate``;
- the aux features of static-cache forwards, before and after a rollback, are
  ``target_features``'s (the input of layer i + 1);
- the capacity is exactly enough for a row that ends inside a round and keeps stepping;
- the graph mode's record-then-replay protocol, simulated on the CPU (a warm-up run,
  then replays), gives the eager output.

Negative controls: a rollback one column short (``n`` instead of ``n + 1``), a cache
one column short, aux read one layer late, and a recording that does not undo its
warm-up are each caught.
"""

import random
import types

import pytest
import torch

import eagle3fn.evaluation.cached_draft as cached_draft
import eagle3fn.evaluation.graphed as graphed
import eagle3fn.evaluation.kv as kv
import eagle3fn.evaluation.static_draft as static_draft
from eagle3fn.decoding.forward import cached_forward
from eagle3fn.decoding.graphs import Graphed
from eagle3fn.evaluation import SpecConfig, default_impl, evaluate, generate, sweep, target_generate
from eagle3fn.io.target import target_features
from spec_setup import NEW, PROMPTS, V, agreeing_pair, greedy, make_draft, references, target  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


class Oracle:
    """Proposals read from each row's greedy continuation, row b's tokens each made
    wrong with probability ``corrupt[b]`` (padded past the continuation: a finished
    row's proposals are computed and ignored). ``rows``: the batch's prompt indices."""

    def __init__(self, monkeypatch, references, corrupt, seed=0):
        self.references, self.corrupt, self.rng, self.rows = references, corrupt, random.Random(seed), []
        oracle = self

        def chain(draft, g, u, pos_B, keys, values, valid, k, choose):
            out = []
            for b, pos in enumerate(pos_B.tolist()):
                full = list(PROMPTS[oracle.rows[b]]) + oracle.references[oracle.rows[b]]
                tokens = (full[pos + 2:pos + 2 + k] + [0] * k)[:k]  # x_{T-1} sits at pos + 1
                out.append([(t + 1) % V if oracle.rng.random() < oracle.corrupt[oracle.rows[b]] else t
                            for t in tokens])
            return torch.tensor(out), None

        monkeypatch.setattr(cached_draft.Draft, "chain", chain)

    def run(self, target, batch_size, k, new=NEW, impl="graph", prompts=range(len(PROMPTS))):
        params, cfg, d2t = make_draft(target)
        prompts, out = list(prompts), []
        for i in range(0, len(prompts), batch_size):
            self.rows = prompts[i:i + batch_size]
            out += generate(target, None, params, cfg, d2t, [torch.tensor(PROMPTS[j]) for j in self.rows],
                            SpecConfig(num_draft_tokens=k, max_new_tokens=new), impl=impl)
        return [r.tokens for r in out], [r.accepted_per_round for r in out]


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_the_target_alone(target, references, monkeypatch, batch_size, k):
    tokens, counts = Oracle(monkeypatch, references, [0.3] * len(PROMPTS)).run(target, batch_size, k)
    assert tokens == [ref[:NEW] for ref in references]
    assert {n for c in counts for n in c} == set(range(k + 1))
    assert k == 1 or len({len(c) for c in counts}) > 1  # rows ended at different rounds


def test_greedy_with_a_real_draft(target, references):
    params, cfg, d2t = make_draft(target)
    out = generate(target, None, params, cfg, d2t, [torch.tensor(p) for p in PROMPTS],
                   SpecConfig(num_draft_tokens=3, max_new_tokens=NEW), impl="graph")
    assert [r.tokens for r in out] == [ref[:NEW] for ref in references]


def test_a_rollback_one_column_short_is_caught(target, references, monkeypatch):
    """Negative control of the first test: ``n_b += n`` (the pending token's column
    overwritten next round) changes the tokens."""
    oracle = Oracle(monkeypatch, references, [0.3] * len(PROMPTS))
    monkeypatch.setattr(graphed, "kept_columns", lambda n, live: torch.where(live, n, 0))
    assert oracle.run(target, 3, 3)[0] != [ref[:NEW] for ref in references]


def test_capacity_is_exact(target, references, monkeypatch):
    """The longest prompt's row accepts every proposal and ends inside a round
    (``max_new_tokens`` = 2 + 3 (k + 1)), then keeps stepping while the other row goes
    on rejecting: its ignored forwards write up to column ``L + max_new + 2k - 1``, the
    last of ``capacity`` (unaligned here). One column fewer fails."""
    k, new, rows = 3, 14, [2, 1]  # PROMPTS[2] is the longest
    oracle = Oracle(monkeypatch, references, {2: 0.0, 1: 1.0})
    monkeypatch.setattr(graphed, "COLUMN_ALIGN", 1)
    assert graphed.capacity([len(PROMPTS[r]) for r in rows], new, k) == len(PROMPTS[2]) + new + 2 * k
    tokens, counts = oracle.run(target, 2, k, new=new, prompts=rows)
    assert tokens == [references[r][:new] for r in rows]
    assert counts[0] == [k] * 4 and len(counts[1]) > 4
    real = graphed.capacity
    monkeypatch.setattr(graphed, "capacity", lambda *a: real(*a) - 1)
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        oracle.run(target, 2, k, new=new, prompts=rows)


def _agreeing_run(impl, monkeypatch, temperature=0.0):
    """``spec_setup.agreeing_pair``'s target and draft on its four prompts, row 1
    ending at an EOS only it emits, the draft's cache compacted every round:
    ``(tokens, accepted counts, references)``."""
    target, params, cfg, d2t = agreeing_pair()
    monkeypatch.setattr(kv, "COMPACT_SLACK", -10**6)
    new, k = 24, 3
    refs = [greedy(target, p, new) for p in PROMPTS]
    eos = refs[1][15]
    out = generate(target, types.SimpleNamespace(eos_token_id=eos), params, cfg, d2t,
                   [torch.tensor(p) for p in PROMPTS],
                   SpecConfig(num_draft_tokens=k, max_new_tokens=new, temperature=temperature, seed=3), impl=impl)
    want = [ref[:ref.index(eos) + 1] if eos in ref else ref for ref in refs]
    return [r.tokens for r in out], [r.accepted_per_round for r in out], want


def test_accepted_counts_equal_static(monkeypatch):
    tokens, counts, want = _agreeing_run("graph", monkeypatch)
    assert tokens == want
    assert {n for c in counts for n in c} == {0, 1, 2, 3}
    assert (tokens, counts) == _agreeing_run("static", monkeypatch)[:2]


def test_sampled_equals_static(monkeypatch):
    """Temperature 1.5: each row draws from its own generator in the same order on both
    paths (the draft's samples, the acceptance draws), so tokens and counts agree."""
    tokens, counts, _ = _agreeing_run("graph", monkeypatch, temperature=1.5)
    assert (tokens, counts) == _agreeing_run("static", monkeypatch, temperature=1.5)[:2]
    assert len({n for c in counts for n in c}) >= 3


def test_prefill_in_chunks(monkeypatch):
    """Prompts prefilled in three chunks (at most 12 padded tokens each, the rule by
    which ``decoding.generate`` admits them) give the one-chunk tokens and counts: each
    chunk's aux lands right-aligned in the batch's left-padded layout the draft reads."""
    want = _agreeing_run("graph", monkeypatch)[:2]
    monkeypatch.setattr(graphed, "PREFILL_TOKENS", 12)
    assert graphed._chunks([len(p) for p in PROMPTS], 12) == [[0, 1], [2], [3]]
    assert _agreeing_run("graph", monkeypatch)[:2] == want


class Replayed(Graphed):
    """Graph mode simulated on the CPU: the first ``prepare`` runs ``fn`` once (the
    warm-up; a capture itself runs nothing), every call runs it again (the replay)."""

    recorded_fns: list = []

    def prepare(self):
        if self.due:
            self.fn()
            self.recorded = True
            Replayed.recorded_fns.append(self.fn.__name__)

    def __call__(self):
        if self.graph:
            self.prepare()
        self.fn()


def test_graph_mode_protocol(monkeypatch):
    """With every ``Graphed`` in graph mode (simulated), the output is the eager path's
    and the verifying step is recorded once. Control: a recording that keeps its
    warm-up's rollback and token changes the output."""
    want = _agreeing_run("graph", monkeypatch)[:2]
    monkeypatch.setattr(graphed, "_use_graphs", lambda device, draft_device: True)
    monkeypatch.setattr(graphed, "Graphed", Replayed)
    monkeypatch.setattr(static_draft, "Graphed", Replayed)
    monkeypatch.setattr(Replayed, "recorded_fns", [])
    assert _agreeing_run("graph", monkeypatch)[:2] == want
    assert Replayed.recorded_fns.count("_greedy_round") == 1
    assert {"_chain", "_update"} <= set(Replayed.recorded_fns)
    monkeypatch.setattr(graphed._Verifier, "record", lambda self: self.step.prepare())
    assert _agreeing_run("graph", monkeypatch)[:2] != want


def test_graph_mode_compiles_the_drafts_elementwise_chains(monkeypatch):
    """In graph mode the draft's elementwise chains (norms, RoPE, SwiGLU) run compiled
    (``Draft.fused``; here dynamo's aot_eager on the CPU, the fp64 maths unchanged):
    the same tokens and accepted counts as the eager path, and every chain the chain
    and update steps call went through the compiler. Control: ``FUSED_DRAFT`` off
    compiles none of them."""
    import eagle3fn.draft as draft_module
    from eagle3fn.compiled import compile_on_cpu

    want = _agreeing_run("graph", monkeypatch)[:2]
    monkeypatch.setattr(graphed, "_use_graphs", lambda device, draft_device: True)
    monkeypatch.setattr(graphed, "Graphed", Replayed)
    monkeypatch.setattr(static_draft, "Graphed", Replayed)
    compiled = []
    real = draft_module.compiler
    monkeypatch.setattr(draft_module, "compiler", lambda fn, backend: compiled.append(fn.__name__) or real(fn, backend))
    for name in ("norm_pair", "rms_norm", "apply_rope", "apply_rope_pair", "swiglu", "_cos_sin"):
        monkeypatch.setattr(draft_module, name, draft_module.fused_on_cuda(getattr(draft_module, name).eager))
    with compile_on_cpu("aot_eager"):
        assert _agreeing_run("graph", monkeypatch)[:2] == want
        assert {"norm_pair", "rms_norm", "apply_rope", "apply_rope_pair", "swiglu", "_cos_sin"} <= set(compiled)
        compiled.clear()
        monkeypatch.setattr(graphed, "FUSED_DRAFT", False)
        assert _agreeing_run("graph", monkeypatch)[:2] == want
        assert compiled == []


def test_pooled_batches_reuse_the_recordings(monkeypatch):
    """``generate(impl="graph", pool=GraphPool())`` batch after batch (graph mode
    simulated; the draft's cache compacted every round; row 1 ends at an EOS only it
    emits, so its batch's ``live`` flags change mid-call): tokens and accepted counts
    equal the unpooled calls', and the verifying round is recorded once instead of once
    per batch; no slot past a new batch's prompts is visible to the draft (this draft's
    attention adds nothing, so stale slots could not change its counts). Controls: a
    pooled verifier that keeps the last batch's ``live`` flags changes the output; a
    pooled draft whose earlier slots stay valid leaves them visible."""
    from eagle3fn.decoding import GraphPool

    target, params, cfg, d2t = agreeing_pair()
    monkeypatch.setattr(kv, "COMPACT_SLACK", -10**6)
    new, k = 24, 3
    eos = types.SimpleNamespace(eos_token_id=greedy(target, PROMPTS[1], new)[15])
    spec = SpecConfig(num_draft_tokens=k, max_new_tokens=new)
    monkeypatch.setattr(graphed, "_use_graphs", lambda device, draft_device: True)
    monkeypatch.setattr(graphed, "Graphed", Replayed)
    monkeypatch.setattr(static_draft, "Graphed", Replayed)
    monkeypatch.setattr(Replayed, "recorded_fns", [])
    batches = [[0, 1], [2, 3], [1, 0]]

    def run(pool):
        return [(r.tokens, r.accepted_per_round) for b in batches
                for r in generate(target, eos, params, cfg, d2t, [torch.tensor(PROMPTS[i]) for i in b], spec,
                                  impl="graph", pool=pool)]

    visible = []  # per prefill: any slot after the prompts still valid
    real_reset, real_prefill = graphed._Verifier.reset, static_draft.StaticDraft.prefill

    def watched(prefill):
        def call(self, g, u, pos, keys, values, valid):
            prefill(self, g, u, pos, keys, values, valid)
            visible.append(bool(self.valid[:, valid.shape[1]:].any()))
        return call

    monkeypatch.setattr(static_draft.StaticDraft, "prefill", watched(real_prefill))
    want = run(None)
    assert Replayed.recorded_fns.count("_greedy_round") == len(batches)
    Replayed.recorded_fns.clear()
    pool = GraphPool()
    assert run(pool) == want
    assert Replayed.recorded_fns.count("_greedy_round") == 1 and pool.hits == len(batches) - 1
    assert len({n for _, counts in want for n in counts}) >= 3 and not any(visible)
    monkeypatch.setattr(graphed._Verifier, "reset", lambda self, token: self.token.copy_(token))
    assert run(GraphPool()) != want
    monkeypatch.setattr(graphed._Verifier, "reset", real_reset)

    def stale_prefill(self, g, u, pos, keys, values, valid):
        kept = self.valid.clone()
        real_prefill(self, g, u, pos, keys, values, valid)
        self.valid[:, valid.shape[1]:] = kept[:, valid.shape[1]:]

    monkeypatch.setattr(static_draft.StaticDraft, "prefill", watched(stale_prefill))
    visible.clear()
    run(GraphPool())
    assert visible == [False, True, True]


def test_target_alone_equals_target_generate(target, references):
    prompts = [torch.tensor(p) for p in PROMPTS]
    cfg = SpecConfig(max_new_tokens=NEW)
    assert target_generate(target, None, prompts, cfg, impl="graph") == target_generate(target, None, prompts, cfg)
    eos = types.SimpleNamespace(eos_token_id=references[1][4])
    alone = target_generate(target, eos, prompts[:3], cfg, impl="graph")
    assert alone == target_generate(target, eos, prompts[:3], cfg) and len(alone[1]) == 5


def test_aux_is_the_training_features(target):
    """A prefill, then two verifying forwards of three tokens, the first rolled back to
    two kept columns: the aux of every kept position equals ``target_features`` of the
    whole sequence. Control: the aux of the layer after each aux layer differs."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.tensor(p) for p in PROMPTS[1:3]]
    cache, _, aux = graphed._prefill(target, prompts, 32)
    W = aux.shape[1]
    fed = [p.tolist() for p in prompts]
    auxes = [[aux[b, W - p.numel():]] for b, p in enumerate(prompts)]
    for keep in (2, 3):
        ids = torch.randint(0, V, (len(prompts), 3), generator=g)
        _, aux = cached_forward(target.model, cache, ids, keep=3, aux_layers=target.aux_layer_ids,
                                layers=target.backbone.layers)
        cache.advance(keep)
        for b in range(len(prompts)):
            fed[b] += ids[b, :keep].tolist()
            auxes[b].append(aux[b, :keep])
    for b in range(len(prompts)):
        seq = torch.tensor(fed[b])[None]
        want = target_features(target, seq, torch.ones_like(seq)).aux[0]
        torch.testing.assert_close(torch.cat(auxes[b]), want, rtol=0, atol=1e-10)
    shifted = tuple(i + 1 for i in target.aux_layer_ids)
    _, late = cached_forward(target.model, cache, ids, keep=3, aux_layers=shifted, layers=target.backbone.layers)
    _, right = cached_forward(target.model, cache, ids, keep=3, aux_layers=target.aux_layer_ids,
                              layers=target.backbone.layers)
    assert (late - right).abs().max() > 1e-3


def test_evaluate_and_sweep_time_the_same_path(target):
    """``evaluate`` and ``sweep`` with ``impl="graph"`` run it on both sides and say so;
    the CPU's default stays ``"dynamic"``."""
    params, cfg, d2t = make_draft(target)
    prompts = [torch.tensor(p) for p in PROMPTS]
    result = evaluate(target, params, cfg, d2t, prompts, SpecConfig(num_draft_tokens=2, max_new_tokens=6),
                      batch_size=3, impl="graph")
    assert result["impl"] == "graph" and result["same_as_target"] == len(PROMPTS)
    assert result["identity"].startswith(f"{len(PROMPTS)}/{len(PROMPTS)} outputs identical")
    assert default_impl(target, params) == "dynamic"
    assert evaluate(target, params, cfg, d2t, prompts[:1], SpecConfig(max_new_tokens=2), baseline=False)["impl"] \
        == "dynamic"
    rows = sweep(target, params, cfg, d2t, prompts, ks=[2], batch_sizes=[4], max_new_tokens=4, impl="graph",
                 log=lambda s: None)["rows"]
    assert [r["impl"] for r in rows] == ["graph"] and rows[0]["identical"] == len(PROMPTS)


@pytest.mark.parametrize("first", [False, True])
def test_sweep_warms_up_on_the_widest_batch(target, monkeypatch, first):
    """``sweep``'s untimed warm-up decodes the batch with the longest prompt, so every
    timed batch finds its pooled cache and recordings large enough: each side's pool
    misses only at its warm-ups (one per k for the draft, one per batch size alone).
    Control (``first``): warming up on the first batch (the old choice; PROMPTS' first is
    the shortest) leaves longer batches to build theirs inside the timed region."""
    import importlib

    from eagle3fn.evaluation.timing import widest
    sweep_module = importlib.import_module("eagle3fn.evaluation.sweep")  # the package's name is the function
    pools = []

    class Counted(sweep_module.GraphPool):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            pools.append(self)
    monkeypatch.setattr(sweep_module, "GraphPool", Counted)
    if first:
        monkeypatch.setattr(sweep_module, "widest", lambda batches: batches[0])
    params, cfg, d2t = make_draft(target)
    prompts = [torch.tensor(p) for p in PROMPTS]
    assert widest([[p] for p in prompts])[0] is prompts[2]
    sweep(target, params, cfg, d2t, prompts, ks=[1, 2], batch_sizes=[1, 2], max_new_tokens=4, impl="graph",
          log=lambda s: None)
    spec, alone = pools
    if first:
        assert spec.misses > 2 * 2 or alone.misses > 2
    else:
        assert (spec.misses, alone.misses) == (2 * 2, 2)
