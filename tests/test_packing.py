"""Sequence packing (SPEC 9), the draft: a packed batch trains every conversation
exactly as the same conversations as separate right-padded samples, in fp64 at 1e-10
(per-step losses, metrics, every gradient; ``token_mean`` as is, ``local_mean`` up to
its documented divisor), for every trim, per conversation, with the eager and
(forward, on the CPU) the flex attention, whose block mask is the document mask. Each
dropped document boundary (in the row map, in the attention, in the positions) is
caught by the same comparison; a boundary dropped from RoPE alone is invisible by the
maths (``test_rope_offsets_inside_a_document_change_nothing``). Data, target and the
training loop: tests/test_packing_io.py."""

import dataclasses

import pytest
import torch
from test_ttt import CFG, K, assert_same

import eagle3fn.unrolled.attention as attention_module
import eagle3fn.unrolled.layout as layout_module
import eagle3fn.unrolled.unroll as unroll_module
from eagle3fn.align import document_starts, supervised_mask
from eagle3fn.draft import init_params
from eagle3fn.io.packing import pack_features
from eagle3fn.loss import LossConfig
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, eager_attention, ttt
from eagle3fn.vocab import build_vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: 2 threads crawl on a busy CPU

TOKEN, LOCAL = LossConfig(normalization="token_mean"), LossConfig()
DOCS = (7, 3, 9, 5, 2, 8, 6)  # best fit, longest first, into 16: rows [2, 0], [5, 6, 4], [3, 1]
ROW = 16


# ---------------------------------------------------------------------------- batches


def documents(seed=0, lengths=DOCS):
    """The conversations as one unpacked fp64 batch ``(Features [D, Lmax], loss_mask)``
    (teacher as logits), with the draft parameters and vocab map."""
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (CFG.vocab_size,), generator=g), CFG.draft_vocab_size)
    D, S = len(lengths), max(lengths)
    attention = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    head = torch.randn(CFG.vocab_size, CFG.ht, generator=g, dtype=torch.float64)
    head[t2d] *= 3.0  # the teacher's argmax in the draft vocab: every conversation's rows train
    hidden = torch.randn(D, S, CFG.ht, generator=g, dtype=torch.float64)
    features = Features(input_ids=torch.randint(0, CFG.vocab_size, (D, S), generator=g) * attention,
                        aux=torch.randn(D, S, 3 * CFG.ht, generator=g, dtype=torch.float64) * attention[..., None],
                        attention_mask=attention, target_logits=(hidden @ head.T) * attention[..., None])
    loss_mask = (torch.rand(D, S, generator=g) < 0.7) & attention.bool()
    loss_mask[:, 0] = True  # every conversation supervises something
    params = init_params(CFG, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if "norm" in name else 0.15))
    return features, loss_mask, params, d2t, t2d


def run(features, loss_mask, params, d2t, t2d, trim="loss", *, loss=TOKEN, attention="eager",
        rowmap_positions=True, grad=True, **extra):
    """``(objective, grads, local_mean divisor)`` of one batch, packed or not."""
    pos = features.positions
    sup = supervised_mask(loss_mask, features.attention_mask, positions=pos)
    rm = build_rowmap(sup, K, positions=pos if rowmap_positions else None)
    config = TTTConfig(draft=CFG, ttt_length=K, trim=trim, loss=loss, attention=attention, **extra)
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad and grad) for n, p in params.items()}
    with torch.set_grad_enabled(grad):
        out = ttt(ps, features, rm, config, d2t=d2t, t2d=t2d)
    if not grad:
        return out, {}, rm.denominator
    out.objective.backward()
    return out, {n: p.grad for n, p in ps.items() if p.requires_grad}, rm.denominator


def times(result, factor):
    """A result's sums: the loss terms and gradients times the local_mean divisor."""
    out, grads, _ = result
    scaled = dataclasses.replace(out, objective=out.objective * factor, step_loss=out.step_loss * factor,
                                 kl_loss=out.kl_loss * factor)
    return scaled, {n: g * factor for n, g in grads.items()}


def same(packed, unpacked, loss=TOKEN, tol=1e-10):
    """token_mean: equal; local_mean: equal once each is multiplied by its divisor."""
    if loss.normalization == "token_mean":
        assert_same(packed[:2], unpacked[:2], tol, tol)
    else:
        assert_same(times(packed, packed[2]), times(unpacked, unpacked[2]), tol, tol)


@pytest.fixture(scope="module")
def batches():
    features, loss_mask, params, d2t, t2d = documents()
    packed, packed_mask = pack_features(features, loss_mask, ROW)
    return (features, loss_mask, params, d2t, t2d), (packed, packed_mask, params, d2t, t2d)


# ---------------------------------------------------------------------------- exactness


def test_packed_layout_of_the_fixture(batches):
    _, (packed, *_) = batches
    assert packed.input_ids.shape == (3, ROW)
    assert packed.attention_mask.sum(1).tolist() == [16, 16, 8]
    assert packed.positions[0].tolist() == [*range(9), *range(7)]
    assert packed.positions[2].tolist() == [*range(5), *range(11)]  # padding continues the last
    assert document_starts(packed.positions)[1].tolist() == [0] * 8 + [8] * 6 + [14] * 2


@pytest.mark.parametrize("loss", [TOKEN, LOCAL], ids=["token_mean", "local_mean"])
@pytest.mark.parametrize("trim", ["none", "loss", "backbone", "auto"])
def test_packed_equals_unpacked_fp64(batches, trim, loss):
    """Every trim, both normalisations. local_mean divides by the positions each batch
    holds (B*C: 3*16 packed, 7*9 unpacked): the sums agree, the means by that ratio."""
    unpacked, packed = batches
    extra = {"auto_min_rows": 0} if trim == "auto" else {}
    p, u = run(*packed, trim, loss=loss, **extra), run(*unpacked, trim, loss=loss, **extra)
    assert (p[2], u[2]) == (3 * ROW, len(DOCS) * max(DOCS))
    same(p, u, loss)
    if loss is LOCAL:  # the means themselves differ by exactly the divisors' ratio
        torch.testing.assert_close(p[0].kl_loss * p[2] / u[2], u[0].kl_loss, rtol=1e-12, atol=0)
        _caught(p, u)  # control: the means compared as they are (one divisor for both)


def test_each_conversation_trains_as_if_alone(batches):
    """Supervising one conversation at a time, packed == that conversation unpacked:
    every document's terms and gradients are its own (not only their sum)."""
    (f, m, *rest), (pf, pm, *_) = batches
    for d in range(len(DOCS)):
        only = torch.zeros_like(m)
        only[d] = m[d]
        _, packed_only = pack_features(f, only, ROW)
        want = run(f, only, *rest, "backbone")
        assert want[0].kl_loss[0] > 0, f"conversation {d} trains nothing"
        same(run(pf, packed_only, *rest, "backbone"), want)


def _caught(packed, unpacked, loss=TOKEN):
    with pytest.raises(AssertionError, match="differs"):
        same(packed, unpacked, loss)


@pytest.mark.parametrize("trim", ["loss", "backbone"])
def test_negative_control_row_map_ignores_boundaries(batches, trim):
    """Row maps built without the document bound (rows taught across a boundary, their
    diagonal keys from the next conversation's tokens) are caught."""
    unpacked, packed = batches
    _caught(run(*packed, trim, rowmap_positions=False), run(*unpacked, trim))


def test_negative_control_full_path_ignores_boundaries(batches, monkeypatch):
    """The full path (trim none) counting rows whose teacher is in the next conversation:
    caught."""
    unpacked, packed = batches
    want = run(*unpacked, "none")
    real = unroll_module._dense_step
    monkeypatch.setattr(unroll_module, "_dense_step", lambda rm, j, sup, pos=None: real(rm, j, sup))
    _caught(run(*packed, "none"), want)


@pytest.mark.parametrize("trim", ["none", "backbone"])
def test_negative_control_attention_ignores_documents(batches, trim, monkeypatch):
    """Step-0 keys of earlier conversations in the same row visible: caught."""
    unpacked, packed = batches
    want = run(*unpacked, trim)
    monkeypatch.setattr(attention_module, "document_starts", torch.zeros_like)
    _caught(run(*packed, trim), want)


def test_negative_control_positions_not_restarting(batches):
    """The packed rows with positions counting on (the packing not announced to the
    draft: every boundary dropped at once), supervision still per conversation: caught."""
    unpacked, (pf, pm, *rest) = batches
    sup = supervised_mask(pm, pf.attention_mask, positions=pf.positions)
    flat = dataclasses.replace(pf, positions=None)
    config = TTTConfig(draft=CFG, ttt_length=K, trim="loss", loss=TOKEN)
    params, d2t, t2d = rest
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    out = ttt(ps, flat, build_rowmap(sup, K), config, d2t=d2t, t2d=t2d)
    out.objective.backward()
    _caught((out, {n: p.grad for n, p in ps.items() if p.requires_grad}, 0), run(*unpacked, "loss"))


def test_rope_offsets_inside_a_document_change_nothing(batches, monkeypatch):
    """Why no control drops a boundary from RoPE alone: with attention kept inside each
    document, every score depends on ``pos_q - pos_k`` of two positions of one
    document, so positions counting on across the row (not restarting) give the same
    result to rounding. Restarting positions are what the target and this code read
    the documents from (the other controls); the draft's RoPE cannot tell."""
    unpacked, packed = batches
    want = run(*unpacked, "none")
    pf = packed[0]
    restarted, counting = pf.positions.flatten(), torch.arange(pf.positions.numel())
    real = unroll_module.rope_cos_sin
    monkeypatch.setattr(unroll_module, "rope_cos_sin", lambda pos, *a: real(pos - (restarted - counting).view(pos.shape), *a))
    same(run(*packed, "none"), want, tol=1e-12)


def test_doc_end_teacher_is_refused(batches):
    """A mask built without the positions supervises each conversation's last token,
    whose z' is the next conversation's: ttt refuses it."""
    _, (pf, pm, params, d2t, t2d) = batches
    last = torch.zeros_like(pm)
    last[0, 8] = True  # the end of the first conversation (length 9)
    rm = build_rowmap(supervised_mask(last, pf.attention_mask), K, positions=pf.positions)
    with pytest.raises(ValueError, match="last of its packed document"):
        ttt(params, pf, rm, TTTConfig(draft=CFG, ttt_length=K), d2t=d2t, t2d=t2d)


def test_flex_forward_on_cpu_equals_unpacked(batches, monkeypatch):
    """FlexAttention (uncompiled forward on the CPU) on the packed rows: its windows
    start at each query's document. Against the unpacked eager path (fp32); control:
    windows from the sample start (documents ignored) are caught."""
    def f32(batch):
        f, m, params, d2t, t2d = batch
        f = dataclasses.replace(f, aux=f.aux.float(), target_logits=f.target_logits.float())
        return f, m, {n: p.detach().float() for n, p in params.items()}, d2t, t2d

    unpacked, packed = map(f32, batches)
    want = run(*unpacked, "loss", attention="eager", grad=False)[0]
    for trim in ("loss", "backbone"):
        got = run(*packed, trim, attention="flex", grad=False)[0]
        torch.testing.assert_close(got.kl_loss, want.kl_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got.accept, want.accept, rtol=1e-5, atol=1e-7)
    monkeypatch.setattr(layout_module, "document_starts", torch.zeros_like)
    monkeypatch.setattr(attention_module, "document_starts", torch.zeros_like)
    wrong = run(*packed, "loss", attention="flex", grad=False)[0]
    assert not torch.allclose(wrong.kl_loss, want.kl_loss, rtol=1e-3)


# ---------------------------------------------------------------------------- flex windows


def _packed_rows(C, docs_per_sample):
    """positions [B, C] of samples holding the given documents, then padding."""
    positions, lengths = [], []
    for docs in docs_per_sample:
        pos = torch.cat([torch.arange(n) for n in docs] + [torch.arange(C - sum(docs)) + docs[-1]])
        positions.append(pos)
        lengths.append(sum(docs))
    return torch.stack(positions), torch.tensor(lengths)


CASES = [(300, [(100, 29, 130, 1), (150, 150)]), (260, [(5,) * 52, (200, 60)])]


@pytest.mark.parametrize("pattern", ["all", "scattered"])
@pytest.mark.parametrize("C,docs", CASES)
def test_flex_windows_are_the_document_mask(C, docs, pattern):
    """Each query's window ``[document start, itself]`` (capped at the sample's last
    real key) is the document-id mask ``doc[kv] == doc[q] and kv <= q``, element by
    element; the block tables list the full blocks ``create_block_mask`` derives from
    that document-id mask_mod, and its partial blocks plus only blocks no window
    reaches. Negative control: windows from the sample start are another mask (and,
    with every row a query, list other full blocks)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eagle3fn.unrolled import FLEX_BLOCK, packed_block_mask, packed_layout

    positions, lengths = _packed_rows(C, docs)
    B = len(docs)
    starts = document_starts(positions)
    g = torch.Generator().manual_seed(1)
    valid = (torch.arange(C)[None] < lengths[:, None]).flatten()
    rows = torch.arange(B * C) if pattern == "all" else torch.nonzero(
        torch.rand(B * C, generator=g) < 0.3).flatten()
    Lp = -(-B * C // FLEX_BLOCK) * FLEX_BLOCK
    lay = packed_layout(rows, lengths, C, Lp, starts_BC=starts)
    Qp, N = lay.start.numel(), rows.numel()
    qrow = torch.cat([rows, rows[-1:].expand(Qp - N)])  # padding queries repeat the last row
    doc = (starts + torch.arange(B)[:, None] * C).flatten()  # a document id: its flat start
    pad = lambda x, fill: torch.cat([x, x.new_full((Lp - B * C,), fill)])  # noqa: E731
    doc_kv, valid_kv = pad(doc, -1), pad(valid, False)

    def doc_mod(b, h, q, kv):
        return (doc_kv[kv] == doc[qrow[q]]) & (kv <= qrow[q]) & valid_kv[kv]

    def window_mod(b, h, q, kv):
        return (kv >= lay.start[q]) & (kv <= lay.last[q])

    q, kv = torch.arange(Qp)[:, None], torch.arange(Lp)[None]
    assert torch.equal(doc_mod(0, 0, q, kv), window_mod(0, 0, q, kv))

    def lists(bm, kind):
        n, idx = getattr(bm, f"{kind}_num_blocks")[0, 0], getattr(bm, f"{kind}_indices")[0, 0]
        return {(m, int(idx[m, t])) for m in range(-(-N // FLEX_BLOCK)) for t in range(int(n[m]))}

    ours = packed_block_mask(lay.start, lay.last, N, Lp, window_mod, tables=lay.tables)
    dense = create_block_mask(doc_mod, 1, None, Qp, Lp, device="cpu")
    assert lists(ours, "full_kv") == lists(dense, "full_kv")
    assert lists(dense, "kv") <= lists(ours, "kv")
    for m, c in lists(ours, "kv") - lists(dense, "kv"):  # listed, but no window reaches it
        qs, ks = torch.arange(m * FLEX_BLOCK, (m + 1) * FLEX_BLOCK), torch.arange(c * FLEX_BLOCK, (c + 1) * FLEX_BLOCK)
        assert not doc_mod(0, 0, qs[:, None], ks[None]).any()
    wrong = packed_layout(rows, lengths, C, Lp)  # windows from the sample start
    assert not torch.equal((kv >= wrong.start[q]) & (kv <= wrong.last[q]), doc_mod(0, 0, q, kv))
    if pattern == "all":
        assert lists(packed_block_mask(wrong.start, wrong.last, N, Lp, None, tables=wrong.tables),
                     "full_kv") != lists(ours, "full_kv")


@pytest.mark.parametrize("C,docs", CASES)
def test_packed_flex_attention_equals_eager_with_documents(C, docs):
    """FlexAttention over packed query rows with document windows equals the eager
    attention with document starts (step-0 keys, then the diagonal keys), across
    blocks and documents; control: no document starts."""
    from eagle3fn.unrolled import packed_flex_attention, packed_keys

    positions, lengths = _packed_rows(C, docs)
    starts = document_starts(positions)
    B, h, gk, d = len(docs), 4, 2, 8
    g = torch.Generator().manual_seed(2)
    valid = torch.arange(C)[None] < lengths[:, None]
    q = torch.randn(B, h, C, d, generator=g)
    keys = [(torch.randn(B, gk, C, d, generator=g), torch.randn(B, gk, C, d, generator=g)) for _ in range(3)]
    flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731
    rows = torch.nonzero(valid.flatten()).flatten()
    packed = packed_keys(flat(keys[0][0]), flat(keys[0][1]))
    diagonal = tuple(torch.stack([flat(kv[i])[rows] for kv in keys[1:]]) for i in (0, 1))
    want = flat(eager_attention(q, keys, valid, starts))[rows]
    got = packed_flex_attention(flat(q)[rows], rows, packed, diagonal, lengths, C, starts_BC=starts, fused=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    blind = packed_flex_attention(flat(q)[rows], rows, packed, diagonal, lengths, C, fused=True)
    assert not torch.allclose(blind, want, atol=1e-3)


# ---------------------------------------------------------------------------- row maps, alignment


def test_packed_golden_row_map():
    """Two documents [0, 5) and [5, 10), k = 3. Each document's last position is never
    supervised; a row never comes from the other document (unpacked, position 5 would
    teach rows 4 and 3, position 6 row 4)."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4]])
    loss_mask = torch.zeros(1, 10, dtype=torch.bool)
    loss_mask[0, [1, 3, 4, 5, 6, 8, 9]] = True
    sup = supervised_mask(loss_mask, positions=positions)
    assert sup[0].nonzero().flatten().tolist() == [1, 3, 5, 6, 8]
    rm = build_rowmap(sup, 3, positions=positions)
    assert [r.tolist() for r in rm.rows] == [[1, 3, 5, 6, 8], [0, 2, 5, 7], [1, 6]]
    assert rm.teacher_positions.tolist() == [1, 3, 5, 6, 8]
    assert [t.tolist() for t in rm.table_rows] == [[0, 1, 2, 3, 4], [0, 1, 3, 4], [1, 4]]
    assert [r.tolist() for r in rm.backbone_rows[1:]] == [[0, 1, 2, 5, 6, 7], [1, 6]]
    assert [r.tolist() for r in build_rowmap(sup, 3).rows] == [[1, 3, 5, 6, 8], [0, 2, 4, 5, 7], [1, 3, 4, 6]]


def brute_rows(mask, k, C, positions):
    """SPEC 9 by enumeration: ``{b*C + s - j : mask, j <= s, s - j < C, s - j >= start(doc(s))}``."""
    B, T = mask.shape
    rows = [[] for _ in range(k)]
    for j in range(k):
        for b in range(B):
            for s in range(T):
                start = s - int(positions[b, s])
                if mask[b, s] and j <= s and s - j < C and s - j >= start:
                    rows[j].append(b * C + s - j)
    return [sorted(r) for r in rows]


def test_row_maps_match_brute_force_and_alignment_per_document():
    g = torch.Generator().manual_seed(3)
    for trial in range(40):
        B, T, k = 2, 12, 1 + trial % 4
        positions = torch.stack([_random_positions(T, g) for _ in range(B)])
        loss_mask = torch.rand(B, T, generator=g) < 0.6
        for alignment, reach in (("eagle", 1), ("target", 2)):
            sup = supervised_mask(loss_mask, positions=positions, alignment=alignment)
            for b in range(B):
                for t in range(T):
                    # t's teacher z[t+1] (and, for "target", the gating token t+2) in t's document
                    inside = t + reach < T and int(positions[b, t + reach]) == int(positions[b, t]) + reach
                    gate = loss_mask[b, t] if alignment == "eagle" else loss_mask[b, min(t + 2, T - 1)]
                    assert bool(sup[b, t]) == (inside and bool(gate)), (alignment, b, t)
        C = T - trial % 3
        rm = build_rowmap(sup, k, num_rows=C, positions=positions)
        assert [r.tolist() for r in rm.rows] == brute_rows(sup, k, C, positions)


def _random_positions(T, g):
    cuts = sorted(set(torch.randint(1, T, (3,), generator=g).tolist()))
    starts = [0, *cuts]
    return torch.cat([torch.arange(b - a) for a, b in zip(starts, [*cuts, T])])


def test_held_out_evaluation_of_packed_batches(batches):
    """The held-out objective (``train.evaluate``) reads the packed positions: the same
    acc and accept as unpacked, and a loss pooled over its own local_mean divisor."""
    from eagle3fn.train.evaluate import evaluate_holdout
    from eagle3fn.train.sources import Source

    (f, m, params, d2t, t2d), (pf, pm, *_) = batches
    config = TTTConfig(draft=CFG, ttt_length=K, trim="loss")
    got = evaluate_holdout(params, Source([0], lambda i: (pf, pm)), config, d2t=d2t, t2d=t2d)
    want = evaluate_holdout(params, Source([0], lambda i: (f, m)), config, d2t=d2t, t2d=t2d)
    assert (got["acc"], got["accept"], got["tau"]) == (want["acc"], want["accept"], want["tau"])
    assert abs(got["loss"] * 3 * ROW - want["loss"] * len(DOCS) * max(DOCS)) < 1e-10 * want["loss"]


def test_auto_attention_takes_flex_only_for_heads_inductor_compiles():
    """``attention="auto"`` on CUDA is FlexAttention only for heads of at least 16
    (inductor's kernels refuse smaller ones: "NYI: embedding dimension ... at least 16",
    seen on the GPU with the tests' 8-wide heads); below that it attends eagerly. An
    explicit ``flex`` is kept; the CPU and a sequence-parallel ``attend`` never take it.
    Control: 16 takes flex."""
    import types

    from eagle3fn.unrolled.attention import FLEX_MIN_HEAD_DIM, is_flex_path

    cuda = types.SimpleNamespace(aux=types.SimpleNamespace(is_cuda=True))
    cpu = types.SimpleNamespace(aux=types.SimpleNamespace(is_cuda=False))
    assert FLEX_MIN_HEAD_DIM == 16
    assert not is_flex_path("auto", None, cuda, 8)
    assert is_flex_path("auto", None, cuda, 16)
    assert is_flex_path("flex", None, cuda, 8)
    assert not is_flex_path("auto", None, cpu, 64)
    assert not is_flex_path("auto", object(), cuda, 64)
