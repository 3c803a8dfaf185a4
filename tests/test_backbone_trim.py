"""trim="backbone" (SPEC 6): the layer runs only on the rows a later loss needs, and
the result equals trim="none" (fp64 1e-10, fp32 SPEC 8); using rows_j instead of the
union backbone_rows_j is caught; the scope is what SPEC 6 says."""

import dataclasses

import pytest
import torch
from recorders import ParamRows
from test_ttt import CFG, FAMILIES, K, S, assert_same, make_batch, run

import eagle3fn.unrolled as ttt_module
import eagle3fn.unrolled.blocks as blocks_module
import eagle3fn.unrolled.flex as unrolled_flex
import eagle3fn.unrolled.layout as layout_module
import eagle3fn.unrolled.policy as policy_module
from eagle3fn.align import supervised_mask
from eagle3fn.loss import LossConfig
from eagle3fn.rowmap import build_rowmap
from eagle3fn.unrolled import computed_rows


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_backbone_trim_equals_full_fp64(family, B):
    batch = make_batch(family, B)
    assert_same(run(*batch, trim="backbone"), run(*batch, trim="none"), 1e-10, 1e-10)


@pytest.mark.parametrize("loss", [LossConfig(normalization="token_mean"), LossConfig(objective="alpha"),
                                  LossConfig(objective="lambda")], ids=["token_mean", "alpha", "lambda"])
def test_backbone_trim_other_objectives(loss):
    batch = make_batch("random30", 3)
    assert_same(run(*batch, trim="backbone", loss=loss), run(*batch, trim="none", loss=loss),
                1e-10, 1e-10)


@pytest.mark.parametrize("family", ["random30", "tail", "single"])
def test_backbone_trim_fp32_and_unfused_head(family):
    f, lm, params, d2t, t2d = make_batch(family, 3, dtype=torch.float32)
    f = dataclasses.replace(f, target_logits=f.target_logits.float())
    p32 = {n: p.detach().float().requires_grad_(p.requires_grad) for n, p in params.items()}
    full = run(f, lm, p32, d2t, t2d, trim="none")
    assert_same(run(f, lm, p32, d2t, t2d, trim="backbone"), full, 1e-6, 1e-5)
    assert_same(run(f, lm, p32, d2t, t2d, trim="backbone", fused_head=False), full, 1e-6, 1e-5)


def test_streamed_teacher_and_length_one():
    batch = make_batch("random30", 2, hidden_teacher=True)
    assert_same(run(*batch, trim="backbone"), run(*batch, trim="none"), 1e-10, 1e-10)
    f, lm, params, d2t, t2d = make_batch("random30", 2)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), 1)
    results = []
    for trim in ("backbone", "none"):
        ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
        out = ttt_module.ttt(ps, f, rm, ttt_module.TTTConfig(draft=CFG, ttt_length=1, trim=trim),
                             d2t=d2t, t2d=t2d)
        out.objective.backward()
        results.append((out, {n: p.grad for n, p in ps.items() if p.requires_grad}))
    assert_same(*results, 1e-10, 1e-10)


@pytest.mark.parametrize("family", ["random30", "tail"])
def test_negative_control_rows_instead_of_union(family, monkeypatch):
    """The closed SpecForge prototype's bug: computing rows_j instead of the union of
    later rows. The same comparison must fail."""
    batch = make_batch(family, 3)
    full = run(*batch, trim="none")
    monkeypatch.setattr(layout_module, "computed_rows", lambda rm: rm.rows)
    with pytest.raises(AssertionError, match="differs"):
        assert_same(run(*batch, trim="backbone"), full, 1e-10, 1e-10)
    monkeypatch.undo()  # the same bug entering through the row map
    rm = build_rowmap(supervised_mask(batch[1], batch[0].attention_mask), K)
    wrong = dataclasses.replace(rm, backbone_rows=(rm.backbone_rows[0],) + rm.rows[1:])
    with pytest.raises(AssertionError, match="differs"):
        assert_same(run(*batch, trim="backbone", rowmap=wrong), full, 1e-10, 1e-10)


def test_computed_rows_are_nested_and_golden():
    """SPEC 6 golden table row 2: backbone_rows = -, [1,2,3,6,7], [1,2,6]; step 0
    computes rows_0 | backbone_rows_1."""
    mask = torch.zeros(1, 10, dtype=torch.bool)
    mask[0, [0, 3, 4, 8]] = True
    rm = build_rowmap(mask, 3)
    got = [c.tolist() for c in computed_rows(rm)]
    assert got == [[0, 1, 2, 3, 4, 6, 7, 8], [1, 2, 3, 6, 7], [1, 2, 6]]
    for a, b in zip(got, got[1:]):
        assert set(b) <= set(a)


def test_scope_of_backbone_trimming():
    """k_proj sees every row at step 0; q, the post-attention norm and the MLP see rows_0 | backbone_rows_1 at
    step 0 and backbone_rows_j after; the loss trim (negative control) sees B*S."""
    B = 3
    f, lm, params, d2t, t2d = batch = make_batch("tail", B)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    want = [c.numel() for c in computed_rows(rm)]
    assert sum(want) < B * S * K
    names = ["midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj",
             "midlayer.post_attention_layernorm", "midlayer.mlp.gate_proj"]

    def seen_rows(trim):
        with ParamRows(params, names) as uses:
            run(*batch, trim=trim, rowmap=rm)
        return uses.seen

    seen = seen_rows("backbone")
    assert seen["midlayer.self_attn.k_proj"] == [B * S] + want[1:]
    for n in ("midlayer.self_attn.q_proj", "midlayer.post_attention_layernorm", "midlayer.mlp.gate_proj"):
        assert seen[n] == want, n
    assert seen_rows("loss")["midlayer.mlp.gate_proj"] == [B * S] * K


def test_flex_backbone_forward_equals_eager_on_cpu():
    """trim="backbone" through FlexAttention (uncompiled, forward only on CPU; query
    blocks without a needed row skipped) against the exact path."""
    f, lm, params, d2t, t2d = make_batch("tail", 3, dtype=torch.float32)
    f = dataclasses.replace(f, target_logits=f.target_logits.float())
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    p32 = {n: p.detach().float() for n, p in params.items()}
    out = {}
    for attention in ("eager", "flex"):
        config = ttt_module.TTTConfig(draft=CFG, ttt_length=K, trim="backbone", attention=attention)
        with torch.no_grad():
            out[attention] = ttt_module.ttt(p32, f, rm, config, d2t=d2t, t2d=t2d)
    torch.testing.assert_close(out["flex"].kl_loss, out["eager"].kl_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["flex"].acc, out["eager"].acc)


def brute_fractions(mask, attention_mask):
    """(computed, supervised) fractions of k*B*C by loops over the supervision mask:
    step j supervises own row s - j for every supervised s, and computes the rows some
    step >= j supervises (step 0 also those of step 1's union)."""
    sup = supervised_mask(mask, attention_mask)
    B, T = sup.shape
    need = [set() for _ in range(K)]
    for b in range(B):
        for s in range(T):
            for j in range(K):
                if sup[b, s] and 0 <= s - j < T:
                    need[j].add((b, s - j))
    computed = [set().union(*need[j:]) for j in range(K)]
    computed[0] = need[0] | computed[1] if K > 1 else need[0]
    total = K * B * T
    return sum(map(len, computed)) / total, sum(map(len, need)) / total


def auto_mismatches() -> list:
    """Where ``choose_trim`` disagrees with the rule computed by loops: backbone iff
    (1 - w) * computed + w * supervised <= auto_backbone_fraction, just above and just
    below that boundary, for tail / all / empty / scattered masks and w in {0, 0.45, 1}."""
    from eagle3fn.unrolled import TTTConfig, choose_trim

    wrong = []
    for family in ("tail", "all", "empty", "random30"):
        f, lm, *_ = make_batch(family, 3)
        rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
        computed, supervised = brute_fractions(lm, f.attention_mask)
        for share in (0.0, 0.45, 1.0):
            score = (1 - share) * computed + share * supervised
            for theta, want in ((score + 1e-12, "backbone"), (score - 1e-6, "none")):
                config = TTTConfig(draft=CFG, ttt_length=K, trim="auto", auto_backbone_fraction=theta,
                                   auto_loss_share=share, auto_min_rows=0)
                if choose_trim(rm, config) != want:
                    wrong.append((family, share, want))
    return wrong


def test_auto_picks_by_its_score_and_stays_exact(monkeypatch):
    """trim="auto" resolves as the loop-counted rule of ``auto_mismatches`` and either
    path gives the one-rank full result. Negative control: a score on the computed
    rows alone (the session-7 rule) is caught on the scattered mask."""
    from eagle3fn.unrolled import TTTConfig, choose_trim

    assert auto_mismatches() == []
    for family in ("random30", "tail"):
        f, lm, params, d2t, t2d = batch = make_batch(family, 3)
        computed, supervised = brute_fractions(lm, f.attention_mask)
        knobs = dict(auto_backbone_fraction=0.55 * computed + 0.45 * supervised + 1e-12,
                     auto_loss_share=0.45, auto_min_rows=0)
        rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
        assert choose_trim(rm, TTTConfig(draft=CFG, ttt_length=K, trim="auto", **knobs)) == "backbone"
        assert_same(run(*batch, trim="auto", **knobs), run(*batch, trim="none"), 1e-10, 1e-10)
    assert choose_trim(rm, TTTConfig(draft=CFG, ttt_length=K, trim="none")) == "none"
    empty = build_rowmap(torch.zeros(0, 5, dtype=torch.bool), K)  # no rows: nothing to trim
    assert choose_trim(empty, TTTConfig(draft=CFG, ttt_length=K, trim="auto", auto_min_rows=0)) == "none"
    monkeypatch.setattr(policy_module, "auto_score", lambda computed, supervised, share: computed)
    assert "random30" in {family for family, share, _ in auto_mismatches() if share > 0}


def test_auto_takes_the_full_path_below_min_rows():
    """Fewer own rows than ``auto_min_rows`` (launch-bound short batches): none, even
    where the fraction says backbone; at the threshold the fraction decides."""
    from eagle3fn.unrolled import TTTConfig, choose_trim

    f, lm, *_ = make_batch("tail", 3)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    rows = rm.batch_size * rm.num_rows
    auto = lambda n: TTTConfig(draft=CFG, ttt_length=K, trim="auto", auto_backbone_fraction=1.0,  # noqa: E731
                               auto_min_rows=n)
    assert choose_trim(rm, auto(rows)) == "backbone"
    assert choose_trim(rm, auto(rows + 1)) == "none"
    assert TTTConfig(draft=CFG).auto_min_rows == 4096
    assert TTTConfig(draft=CFG).auto_backbone_fraction == 0.85
    assert TTTConfig(draft=CFG).auto_loss_share == 0.45
    with pytest.raises(ValueError, match="auto_min_rows"):
        auto(-1)
    for share in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="auto_loss_share"):
            TTTConfig(draft=CFG, auto_loss_share=share)
    with pytest.raises(ValueError, match="auto_backbone_fraction"):
        TTTConfig(draft=CFG, auto_backbone_fraction=float("nan"))


@pytest.mark.parametrize("family", ["random30", "tail"])
def test_host_plan_equals_per_step_index_maths(family):
    """The index maths ``ttt`` now does once on the host (``plan_steps``) equals what
    each step derived on its own: the positions of step j's computed rows inside step
    j-1's and of rows_j inside step j's, and every step's packed FlexAttention layout.
    Negative control: the plan of another batch's row map differs."""
    B = 3
    f, lm, params, d2t, t2d = make_batch(family, B)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    plan = layout_module.plan_steps(rm, "backbone", f, flex=True)
    computed = computed_rows(rm)
    lengths = f.attention_mask.sum(1)
    for j, (c, r) in enumerate(zip(computed, rm.rows)):
        assert torch.equal(plan.at[j], torch.searchsorted(c, r))
        if j:
            assert torch.equal(plan.within[j], torch.searchsorted(computed[j - 1], c))
        want = blocks_module.packed_layout(c, lengths, S, blocks_module.padded_key_len(B * S))
        got = plan.layouts[j]
        assert got.num_queries == want.num_queries == c.numel()
        for x, y in zip((got.start, got.last, *got.tables), (want.start, want.last, *want.tables)):
            assert torch.equal(x, y)
    other = build_rowmap(supervised_mask(make_batch("single", B)[1], f.attention_mask), K)
    wrong = layout_module.plan_steps(other, "backbone", f, flex=True)
    assert any(not torch.equal(a, b) for a, b in zip(wrong.at, plan.at))


def _plan_tensors(plan):
    lays = [t for lay in plan.layouts or [] for t in (lay.start, lay.last, *lay.tables)]
    return lays + [w for w in (plan.within or [])[1:]] + list(plan.at)


@pytest.mark.parametrize("trim", ["backbone", "loss", "none"])
def test_host_plan_survives_its_upload(monkeypatch, trim):
    """The plan as a GPU batch gets it (packed into ``_upload``'s buffers, rebuilt in
    order; forced on the CPU through ``_sends_plan``) equals the plan kept on the host.
    For none / loss every step shares one every-row layout, built and sent once, equal
    to ``packed_layout`` of every row. Negative control: tensors rebuilt in another
    order than sent differ."""
    B = 3
    f, lm, *_ = make_batch("random30", B)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    host = layout_module.plan_steps(rm, trim, f, flex=True)
    monkeypatch.setattr(layout_module, "_sends_plan", lambda device: True)
    sent = []
    real = layout_module._upload
    monkeypatch.setattr(layout_module, "_upload", lambda ts, d: (sent.append(len(ts)), real(ts, d))[1])
    moved = layout_module.plan_steps(rm, trim, f, flex=True)
    a, b = _plan_tensors(host), _plan_tensors(moved)
    assert sent and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    if trim != "backbone":
        assert all(lay is moved.layouts[0] for lay in moved.layouts)
        every = blocks_module.packed_layout(torch.arange(B * S), f.attention_mask.sum(1), S,
                                            blocks_module.padded_key_len(B * S))
        assert all(torch.equal(x, y) for x, y in zip(
            (every.start, every.last, *every.tables), _plan_tensors(host)[:2 + len(every.tables)]))
        assert sent[0] == 2 + len(every.tables)  # one layout sent, not k
    rotated = lambda ts, d: (lambda out: out[1:] + out[:1])(real(ts, d))  # noqa: E731
    monkeypatch.setattr(layout_module, "_upload", rotated)
    shuffled = _plan_tensors(layout_module.plan_steps(rm, trim, f, flex=True))
    assert any(x.shape != y.shape or not torch.equal(x, y) for x, y in zip(a, shuffled))


def test_packed_flex_attention_checks_its_layout():
    """A layout planned for another step's rows is refused, not silently padded."""
    f, lm, *_ = make_batch("random30", 2)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    plan = layout_module.plan_steps(rm, "backbone", f, flex=True)
    rows = computed_rows(rm)
    j = next(j for j in range(1, K) if rows[j].numel() != rows[0].numel())
    q = torch.zeros(rows[j].numel(), 2, 4)
    k0 = torch.zeros(2 * S, 1, 4)
    with pytest.raises(ValueError, match="layout is for"):
        unrolled_flex.packed_flex_attention(q, rows[j], unrolled_flex.packed_keys(k0, k0), None,
                                            f.attention_mask.sum(1), S, plan.layouts[0], fused=True)


def test_host_plan_runs_on_one_thread(monkeypatch):
    """The host index maths runs with one intra-op thread (a thread pool's wake-up cost
    more than the small ops, docs/benchmarks.md) and gives the caller's count back,
    also when it raises. Fails if ``plan_steps`` loses its ``_one_thread``."""
    f, lm, params, d2t, t2d = make_batch("random30", 2)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    seen = []
    real = torch.bincount  # the batched plan's counting op (layout._insides, the key-major tables)
    monkeypatch.setattr(torch, "bincount", lambda *a, **k: (seen.append(torch.get_num_threads()),
                                                           real(*a, **k))[1])
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        layout_module.plan_steps(rm, "backbone", f, flex=True)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2

        def boom(*a, **k):
            raise RuntimeError("boom")
        monkeypatch.setattr(torch, "bincount", boom)
        with pytest.raises(RuntimeError, match="boom"):
            layout_module.plan_steps(rm, "backbone", f, flex=True)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_upload_packs_and_aligns():
    """``_upload`` returns every tensor intact (int32 and int64 mixed, empty ones too),
    each starting on a 64-byte boundary of one buffer per dtype."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dt)
               for shape, dt in [((5,), torch.int64), ((1, 1, 3, 7), torch.int32), ((0,), torch.int32),
                                 ((1, 1, 9), torch.int32), ((130,), torch.int64)]]
    sent = layout_module._upload(tensors, torch.device("cpu"))
    for x, y in zip(sent, tensors):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
        assert (x.storage_offset() * x.element_size()) % 64 == 0
    assert sent[1].untyped_storage().data_ptr() == sent[3].untyped_storage().data_ptr()
