"""TTT: trim="loss" == trim="none" == dense oracle (SPEC 3, 5, 8), scope, RoPE, init."""

import dataclasses

import pytest
import torch
from recorders import OpRecorder, ParamRows

from eagle3fn.align import supervised_mask
from eagle3fn.draft import DraftConfig, Eagle3Draft, RopeConfig, init_params, rope_frequencies
from eagle3fn.reference import reference_objective
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, backbone, eager_attention, ttt
from eagle3fn.vocab import build_vocab_map

K, S, V, VD, H, HT = 4, 11, 61, 23, 32, 24
CFG = DraftConfig(hidden_size=H, intermediate_size=40, num_heads=4, num_kv_heads=2, vocab_size=V,
                  draft_vocab_size=VD, target_hidden_size=HT,
                  rope=RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=8))
FAMILIES = ["all", "random30", "tail", "single", "last_k", "empty"]


def loss_mask_for(family, attention, g):
    B, S_ = attention.shape
    lengths = attention.sum(1)
    pos = torch.arange(S_)[None, :]
    m = {
        "all": torch.ones(B, S_, dtype=torch.bool),
        "random30": torch.rand(B, S_, generator=g) < 0.3,
        "tail": pos >= (lengths[:, None] * 0.6).long(),
        "single": pos == lengths[:, None] // 2,
        "last_k": pos >= lengths[:, None] - K,
        "empty": torch.zeros(B, S_, dtype=torch.bool),
    }[family]
    return m & attention.bool()


def make_batch(family, B, dtype=torch.float64, seed=0, cfg=CFG, hidden_teacher=False):
    g = torch.Generator().manual_seed(seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (cfg.vocab_size,), generator=g), cfg.draft_vocab_size)
    attention = torch.ones(B, S, dtype=torch.long)
    for b in range(1, B):
        attention[b, S - 2 * b:] = 0  # right padding of different lengths
    head = torch.randn(cfg.vocab_size, cfg.ht, generator=g, dtype=dtype)
    head[t2d] *= 1.5  # the teacher's argmax mostly in the draft vocab, as on real data
    final_hidden = torch.randn(B, S, cfg.ht, generator=g, dtype=dtype)
    features = Features(
        input_ids=torch.randint(0, cfg.vocab_size, (B, S), generator=g),
        aux=torch.randn(B, S, 3 * cfg.ht, generator=g, dtype=dtype),
        attention_mask=attention,
        target_logits=None if hidden_teacher else final_hidden @ head.T,
        final_hidden=final_hidden if hidden_teacher else None,
        target_head=head if hidden_teacher else None,
    )
    loss_mask = loss_mask_for(family, attention, g)
    params = init_params(cfg, dtype=dtype, seed=seed)
    with torch.no_grad():  # larger weights than the 0.02 init so every path matters
        for name, p in params.items():
            p.add_(torch.randn(p.shape, generator=g, dtype=dtype) * (0.3 if "norm" in name else 0.15))
    return features, loss_mask, params, d2t, t2d


def run(features, loss_mask, params, d2t, t2d, trim, rowmap=None, loss=None, cfg=CFG, **extra):
    config = TTTConfig(draft=cfg, ttt_length=K, trim=trim, **({"loss": loss} if loss else {}),
                       **extra)
    if rowmap is None:
        rowmap = build_rowmap(supervised_mask(loss_mask, features.attention_mask), K)
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    out = ttt(ps, features, rowmap, config, d2t=d2t, t2d=t2d)
    out.objective.backward()
    return out, {n: p.grad for n, p in ps.items() if p.requires_grad}


def assert_same(got, want, rtol_loss, rtol_grad):
    (o1, g1), (o2, g2) = got, want
    for f in ("objective", "step_loss", "kl_loss", "acc", "accept", "tau"):
        a, b = getattr(o1, f).detach().double(), getattr(o2, f).detach().double()
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()
        assert err <= rtol_loss, f"{f} differs by {err:.3g}"
    assert g1.keys() == g2.keys()
    for name in g2:
        g, w = g1[name].double(), g2[name].double()
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
        assert err <= rtol_grad, f"grad {name} differs by {err:.3g}"


@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_trim_equals_full_fp64(family, B):
    batch = make_batch(family, B)
    assert_same(run(*batch, trim="loss"), run(*batch, trim="none"), 1e-10, 1e-10)


@pytest.mark.parametrize("loss", [dict(normalization="token_mean"), dict(objective="alpha"),
                                  dict(objective="lambda", kl_scale=0.5)], ids=str)
def test_loss_trim_equals_full_other_objectives(loss):
    from eagle3fn.loss import LossConfig

    batch = make_batch("random30", 3, seed=2)
    cfg = LossConfig(**loss)
    assert_same(run(*batch, trim="loss", loss=cfg), run(*batch, trim="none", loss=cfg), 1e-10, 1e-10)


@pytest.mark.parametrize("family", ["all", "tail", "random30"])
def test_fp32_within_spec_tolerance(family):
    batch64 = make_batch(family, 3)
    f, lm, params, d2t, t2d = batch64
    f32 = dataclasses.replace(f, aux=f.aux.float(), target_logits=f.target_logits.float())
    p32 = {n: p.detach().float().requires_grad_(p.requires_grad) for n, p in params.items()}
    got = run(f32, lm, p32, d2t, t2d, trim="loss")
    want = run(*batch64, trim="none")
    got = (got[0], {n: g.double() for n, g in got[1].items()})
    assert_same(got, want, 1e-6, 1e-5)


def test_streamed_teacher_path_equals_logits_path():
    a = make_batch("random30", 3, seed=3)
    b = make_batch("random30", 3, seed=3, hidden_teacher=True)
    assert_same(run(*b, trim="loss"), run(*a, trim="none"), 1e-10, 1e-10)


@pytest.mark.parametrize("family", ["all", "random30", "tail", "last_k"])
def test_negative_control_unshifted_rows_caught(family):
    batch = make_batch(family, 3)
    f, lm = batch[0], batch[1]
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    bad = dataclasses.replace(rm, rows=(rm.rows[0],) * K, table_rows=(rm.table_rows[0],) * K)
    with pytest.raises(AssertionError):
        assert_same(run(*batch, trim="loss", rowmap=bad), run(*batch, trim="none"), 1e-10, 1e-10)


def materialize(params, cfg=CFG):
    m = Eagle3Draft(cfg).double()
    m.load_state_dict({n: p.detach() for n, p in params.items()})
    return m


@pytest.mark.parametrize("family", ["random30", "last_k"])
def test_full_path_equals_dense_oracle(family):
    """The full path's loss end against reference.reference_objective on its logits."""
    f, lm, params, d2t, t2d = batch = make_batch(family, 3)
    m = materialize(params)
    with torch.no_grad():
        logits = [m.head(o) for o in backbone(m, f, S, K)]
    want = reference_objective(logits, f.target_logits, lm, t2d, d2t, attention_mask_BS=f.attention_mask)
    got = run(*batch, trim="none")[0]
    for field in ("objective", "kl_loss", "acc", "accept", "tau"):
        torch.testing.assert_close(getattr(got, field).detach(), getattr(want, field), rtol=1e-12, atol=0)


def brute_attention(q, keys, valid):
    """One (b, head, row) at a time: causal step-0 keys over real positions, then the
    row's own diagonal keys."""
    B, h, C, d = q.shape
    rep = h // keys[0][0].shape[1]
    out = torch.zeros_like(q)
    for b in range(B):
        for hh in range(h):
            for p in range(C):
                ks = [keys[0][0][b, hh // rep, t] for t in range(p + 1) if valid[b, t]]
                vs = [keys[0][1][b, hh // rep, t] for t in range(p + 1) if valid[b, t]]
                ks += [k[b, hh // rep, p] for k, _ in keys[1:]]
                vs += [v[b, hh // rep, p] for _, v in keys[1:]]
                w = torch.softmax(torch.stack([q[b, hh, p] @ k for k in ks]) / d ** 0.5, 0)
                out[b, hh, p] = sum(wi * vi for wi, vi in zip(w, vs))
    return out


def test_eager_attention_against_brute_force():
    g = torch.Generator().manual_seed(0)
    B, h, gk, C, d = 2, 4, 2, 6, 8
    valid = torch.ones(B, C, dtype=torch.bool)
    valid[1, 4:] = False
    q = torch.randn(B, h, C, d, generator=g, dtype=torch.float64)
    keys = [(torch.randn(B, gk, C, d, generator=g, dtype=torch.float64),
             torch.randn(B, gk, C, d, generator=g, dtype=torch.float64)) for _ in range(3)]
    got = eager_attention(q, keys, valid)
    want = brute_attention(q, keys, valid)
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[1, :, :4], want[1, :, :4], rtol=1e-12, atol=1e-12)
    # Negative control: dropping the diagonal keys is caught.
    assert not torch.allclose(eager_attention(q, keys[:1], valid)[0], want[0])




def test_scope_of_loss_trimming():
    """Backbone projections see all B*S rows at every step; norm and lm_head see n_j
    rows at step j; no [B*S, Vd] teacher or logits tensor exists."""
    B = 3
    f, lm, params, d2t, t2d = batch = make_batch("tail", B)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    assert 0 < sum(r.numel() for r in rm.rows) < B * S * K
    names = ["midlayer.self_attn.q_proj", "midlayer.self_attn.k_proj", "midlayer.self_attn.v_proj",
             "midlayer.post_attention_layernorm", "midlayer.mlp.gate_proj", "norm", "lm_head"]
    with ParamRows(params, names) as uses, OpRecorder() as rec:
        run(*batch, trim="loss", rowmap=rm, fused_head=False)
    seen = uses.seen
    for n in names[:5]:
        assert seen[n] == [B * S] * K, n
    assert seen["lm_head"] == [r.numel() for r in rm.rows]
    assert seen["norm"] == [r.numel() for r in rm.rows]
    assert not [s for s in rec.shapes if s[-1:] == (VD,) and s[:-1] in ((B * S,), (B, S))]
    # The same recorder sees them on the full path (negative control).
    with OpRecorder() as rec:
        run(*batch, trim="none", rowmap=rm)
    assert (B * S, VD) in rec.shapes


@pytest.mark.parametrize("chunk_rows", [1, 5, 4096])
def test_fused_head_keeps_no_logits_and_changes_nothing(chunk_rows):
    """The fused head saves no [n_j, Vd] tensor for backward (the unfused one does),
    and gives the unfused result for any chunking."""
    f, lm, params, d2t, t2d = batch = make_batch("random30", 3)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    counts = {r.numel() for r in rm.rows}

    def saved_logit_shapes(**kw):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            out = run(*batch, trim="loss", rowmap=rm, **kw)
        return out, [s for s in shapes if len(s) == 2 and s[1] == VD and s[0] in counts]

    fused, saved = saved_logit_shapes(fused_head=True, head_chunk_rows=chunk_rows)
    assert saved == []
    unfused, saved = saved_logit_shapes(fused_head=False)
    assert saved  # negative control: the recorder does see kept logits
    assert_same(fused, unfused, 1e-12, 1e-12)


def test_fused_head_chunks_shrink_for_large_vocabularies(monkeypatch):
    """A fused-head chunk holds at most ``HEAD_CHUNK_LOGITS`` logits: the chunk the TTT
    hands ``head_step_terms`` shrinks with Vd (never below one row) and the result
    is the same. Fails if the cap is ignored (the chunk would be head_chunk_rows)."""
    import eagle3fn.unrolled.unroll as ttt_module

    assert ttt_module.fused_head_chunk(4096, 32000) == 4096
    assert ttt_module.fused_head_chunk(4096, 262144) == 512
    assert ttt_module.fused_head_chunk(4096, 2**28) == 1
    f, lm, params, d2t, t2d = batch = make_batch("random30", 3)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    whole = run(*batch, trim="loss", rowmap=rm, fused_head=False)
    seen = []
    real = ttt_module.head_step_terms
    monkeypatch.setattr(ttt_module, "head_step_terms",
                        lambda *a, chunk_rows, **k: (seen.append(chunk_rows), real(*a, chunk_rows=chunk_rows, **k))[1])
    monkeypatch.setattr(ttt_module, "HEAD_CHUNK_LOGITS", 3 * VD + 1)
    assert_same(run(*batch, trim="loss", rowmap=rm, head_chunk_rows=4096), whole, 1e-12, 1e-12)
    assert seen == [3] * K


def test_triton_loss_impl_in_the_ttt():
    """loss_impl="triton" (interpreter on CPU) inside the TTT equals the torch path."""
    f, lm, params, d2t, t2d = make_batch("random30", 2, dtype=torch.float32)
    f = dataclasses.replace(f, target_logits=f.target_logits.float())
    p32 = {n: p.detach().float().requires_grad_(p.requires_grad) for n, p in params.items()}
    torch_path = run(f, lm, p32, d2t, t2d, trim="loss", loss_impl="torch")
    triton_path = run(f, lm, p32, d2t, t2d, trim="loss", loss_impl="triton")
    assert_same(triton_path, torch_path, 1e-6, 1e-5)


def test_torch_func_grad_matches_autograd():
    f, lm, params, d2t, t2d = batch = make_batch("random30", 2)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    config = TTTConfig(draft=CFG, ttt_length=K, trim="loss")
    trainable = {n: p.detach() for n, p in params.items() if p.requires_grad}
    frozen = {n: p.detach() for n, p in params.items() if not p.requires_grad}
    grads = torch.func.grad(
        lambda tp: ttt({**tp, **frozen}, f, rm, config, d2t=d2t, t2d=t2d).objective)(trainable)
    _, want = run(*batch, trim="loss", rowmap=rm)
    for n in want:
        torch.testing.assert_close(grads[n], want[n], rtol=1e-12, atol=1e-14)


def test_mismatched_rowmap_is_a_clear_error():
    f, lm, params, d2t, t2d = make_batch("tail", 2)
    rm = build_rowmap(torch.zeros(2, S + 1, dtype=torch.bool), K)
    with pytest.raises(ValueError, match="row map is for B=2, T=12"):
        ttt(params, f, rm, TTTConfig(draft=CFG, ttt_length=K), d2t=d2t, t2d=t2d)
    rm = build_rowmap(torch.ones(2, S, dtype=torch.bool), K)  # includes t = L-1
    with pytest.raises(ValueError, match="last of its buffer"):
        ttt(params, f, rm, TTTConfig(draft=CFG, ttt_length=K), d2t=d2t, t2d=t2d)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
], ids=lambda s: s["rope_type"] if s else "default")
def test_rope_frequencies_match_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    theta, head_dim = 500000.0, 64
    ours, scale = rope_frequencies(RopeConfig.from_hf(theta, scaling), head_dim)
    if scaling is None:
        want = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        want_scale = 1.0
    else:
        cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, max_position_embeddings=131072,
                          rope_parameters={"rope_theta": theta, **scaling})
        want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, device="cpu")
    torch.testing.assert_close(ours.float(), want.float(), rtol=2e-6, atol=0)
    assert abs(scale - want_scale) < 1e-6


def test_init_params_copies_target_embedding_and_head_rows():
    g = torch.Generator().manual_seed(0)
    cfg = dataclasses.replace(CFG, target_hidden_size=None, fc_norm=True)
    embed = torch.randn(V, H, generator=g)
    head = torch.randn(V, H, generator=g)
    d2t, t2d = build_vocab_map(torch.randint(0, 9, (V,), generator=g), VD)
    p = init_params(cfg, embed_tokens=embed, target_lm_head=head, t2d=t2d)
    assert torch.equal(p["embed_tokens.weight"], embed) and not p["embed_tokens.weight"].requires_grad
    assert torch.equal(p["lm_head.weight"], head[d2t + torch.arange(VD)])
    assert {f"fc_norm.{i}.weight" for i in range(3)} <= p.keys()
    assert set(p) == {n for n, _ in Eagle3Draft(cfg).named_parameters()}
    with pytest.raises(ValueError, match="embed_tokens has shape"):
        init_params(cfg, embed_tokens=torch.randn(V, H + 1))
    with pytest.raises(ValueError, match="needs t2d"):
        init_params(cfg, target_lm_head=head)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(CFG, num_kv_heads=3)


def test_flex_path_forward_equals_eager_on_cpu():
    """FlexAttention (uncompiled, forward only on CPU) with the EAGLE-3 block mask
    against the exact path; the GPU run checks the compiled one with gradients."""
    f, lm, params, d2t, t2d = batch = make_batch("random30", 3, dtype=torch.float32)
    f = dataclasses.replace(f, target_logits=f.target_logits.float())
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    p32 = {n: p.detach().float() for n, p in params.items()}
    out = {}
    for attention in ("eager", "flex"):
        config = TTTConfig(draft=CFG, ttt_length=K, trim="loss", attention=attention)
        with torch.no_grad():
            out[attention] = ttt(p32, f, rm, config, d2t=d2t, t2d=t2d)
    torch.testing.assert_close(out["flex"].kl_loss, out["eager"].kl_loss, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(out["flex"].accept, out["eager"].accept, rtol=1e-5, atol=1e-7)


def _rows_of(pattern: str, lengths, C: int, seed: int = 0) -> torch.Tensor:
    """Flat rows ``b*C + p``: every row (padding included), each sample's last 30% of
    real rows (contiguous), or 30% of real rows at random (scattered)."""
    g = torch.Generator().manual_seed(seed)
    if pattern == "all":
        return torch.arange(len(lengths) * C)
    picked = []
    for b, L in enumerate(lengths):
        if pattern == "tail":
            p = torch.arange(L - max(1, int(0.3 * L)), L)
        else:
            p = torch.randperm(L, generator=g)[: max(1, int(0.3 * L))].sort().values
        picked.append(b * C + p)
    return torch.cat(picked)


def _packed_case(C, lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    B, h, gk, d = len(lengths), 4, 2, 8
    valid = torch.arange(C)[None] < torch.tensor(lengths)[:, None]
    q = torch.randn(B, h, C, d, generator=g)
    keys = [(torch.randn(B, gk, C, d, generator=g), torch.randn(B, gk, C, d, generator=g))
            for _ in range(4)]
    return q, keys, valid


@pytest.mark.parametrize("pattern", ["all", "tail", "scattered"])
@pytest.mark.parametrize("C,lengths", [(150, (150, 100, 128, 1)), (300, (300, 257, 129, 256)),
                                       (40, (40, 7, 1, 39))])
def test_packed_flex_against_exact_with_negative_control(C, lengths, pattern):
    """FlexAttention over packed query rows (step-0 keys, then the diagonal keys merged
    by log-sum-exp) equals the dense eager attention at those rows, for B > 1 with
    padding, rows spanning samples and block edges at every length."""
    from eagle3fn.unrolled import packed_flex_attention, packed_keys

    q, keys, valid = _packed_case(C, lengths)
    B, h, _, d = q.shape
    flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731 - [B*C, n, d]
    rows = _rows_of(pattern, lengths, C)
    lengths_t = torch.tensor(lengths)
    packed = packed_keys(flat(keys[0][0]), flat(keys[0][1]))
    for j in range(4):
        want = flat(eager_attention(q, keys[: j + 1], valid))[rows]
        diagonal = None if j == 0 else tuple(
            torch.stack([flat(kv[i])[rows] for kv in keys[1: j + 1]]) for i in (0, 1))
        got = packed_flex_attention(flat(q)[rows], rows, packed, diagonal, lengths_t, C, fused=True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Negative controls: one diagonal step missing; queries at rows shifted by one.
    wrong = packed_flex_attention(flat(q)[rows], rows, packed, tuple(x[:-1] for x in diagonal),
                                  lengths_t, C, fused=True)
    assert not torch.allclose(wrong, want, atol=1e-3)
    shifted = packed_flex_attention(flat(q)[rows], (rows - 1).clamp_min(0), packed, diagonal, lengths_t, C, fused=True)
    assert not torch.allclose(shifted, want, atol=1e-3)


def test_packed_query_len_buckets():
    """At least the rows and MIN_FLEX_BLOCKS blocks (dynamo specialises one block),
    whole flex blocks, at most the key length, and less than one bucket (key length /
    QUERY_BUCKETS, in blocks; at least the minimum) of padding: few distinct shapes."""
    from eagle3fn.unrolled import FLEX_BLOCK, packed_query_len
    from eagle3fn.unrolled import DEFAULT_QUERY_BUCKETS as QUERY_BUCKETS
    from eagle3fn.unrolled.blocks import MIN_FLEX_BLOCKS

    for Lp in (256, 1024, 8192, 8320, 262144):
        unit = max(-(-Lp // (QUERY_BUCKETS * FLEX_BLOCK)) * FLEX_BLOCK, MIN_FLEX_BLOCKS * FLEX_BLOCK)
        lens = {packed_query_len(n, Lp) for n in range(0, Lp + 1, 37)}
        assert len(lens) <= QUERY_BUCKETS
        for n in range(0, Lp + 1, 37):
            q = packed_query_len(n, Lp)
            assert q % FLEX_BLOCK == 0 and max(n, 1) <= q <= Lp and q - max(n, 1) < unit, (Lp, n, q)


@pytest.mark.parametrize("pattern", ["all", "tail", "scattered"])
@pytest.mark.parametrize("C,lengths", [(150, (150, 100, 128, 1)), (300, (300, 257, 129, 256)),
                                       (700, (700,)), (2000, (2000,))])
def test_packed_block_mask_equals_dense_derivation(C, lengths, pattern):
    """The block lists the compiled kernel reads (the CPU path never does) are, on every
    query block holding a real query, create_block_mask's derivation from the dense
    mask: the same full blocks, and its partial blocks (plus, where a query block
    spans samples, blocks inside the gap between their windows); blocks of padding
    queries list nothing. Negative control: windows one block too long give other lists."""
    from torch.nn.attention.flex_attention import create_block_mask

    from eagle3fn.unrolled import FLEX_BLOCK, packed_block_mask, packed_query_len

    def windows(rows):
        Lp = -(-len(lengths) * C // FLEX_BLOCK) * FLEX_BLOCK
        qflat = torch.cat([rows, rows[-1:].expand(packed_query_len(rows.numel(), Lp) - rows.numel())])
        start = qflat // C * C
        return start, torch.minimum(qflat, start + torch.tensor(lengths)[qflat // C] - 1), Lp

    def lists(bm, active_blocks):
        out = []
        for kind in ("kv", "full_kv"):
            n = getattr(bm, f"{kind}_num_blocks")[0, 0]
            idx = getattr(bm, f"{kind}_indices")[0, 0]
            out.append(sorted((m, int(idx[m, t])) for m in active_blocks for t in range(int(n[m]))))
        return out

    rows = _rows_of(pattern, lengths, C)
    start, last, Lp = windows(rows)
    mask_mod = lambda b, h, q, kv: (kv >= start[q]) & (kv <= last[q])  # noqa: E731
    ours = packed_block_mask(start, last, rows.numel(), Lp, mask_mod)
    dense = create_block_mask(mask_mod, 1, None, start.numel(), Lp, device="cpu")
    active = range(-(-rows.numel() // FLEX_BLOCK))
    (partial, full), (want_partial, want_full) = lists(ours, active), lists(dense, active)
    assert full == want_full
    # Partial lists may add a key block no window reaches, only where a query block
    # spans samples (the union of windows has a gap there; the mask_mod rejects it).
    assert set(want_partial) <= set(partial) and len(set(partial)) == len(partial)
    spans = {m for m in active if len(set((rows[m * FLEX_BLOCK:(m + 1) * FLEX_BLOCK] // C).tolist())) > 1}
    assert {m for m, _ in set(partial) - set(want_partial)} <= spans
    assert not ours.kv_num_blocks[0, 0, len(active):].any()
    assert not ours.full_kv_num_blocks[0, 0, len(active):].any()
    # Windows one block too long (and blind to sample starts) list other blocks.
    wrong = packed_block_mask(start * 0, last + FLEX_BLOCK, rows.numel(), Lp, mask_mod)
    assert lists(wrong, active)[1] != want_full


def _listed(num, idx):
    """{(row, column)} of a BlockMask table pair ``[1, 1, R]``, ``[1, 1, R, W]``."""
    n, idx = num[0, 0], idx[0, 0]
    pairs = [(r, int(idx[r, t])) for r in range(n.shape[0]) for t in range(int(n[r]))]
    assert len(set(pairs)) == len(pairs), "a column listed twice"
    return set(pairs)


@pytest.mark.parametrize("pattern", ["all", "tail", "scattered"])
@pytest.mark.parametrize("C,lengths", [(150, (150, 100, 128, 1)), (300, (300, 257, 129, 256)),
                                       (700, (700,)), (2000, (2000,))])
def test_packed_block_mask_key_major_tables_are_the_transpose(C, lengths, pattern):
    """The key-major tables FlexAttention's backward reads (``_transposed_tables``: from
    ranges by binary search) list exactly the (query block, key block) pairs of the
    query-major tables, partial and full apart, as torch's own dense transposition of
    them does, and they are what ``packed_block_mask`` hands FlexAttention. Negative
    control: the same ranges without skipping padding query blocks list more pairs."""
    from torch.nn.attention.flex_attention import _transpose_ordered

    from eagle3fn.unrolled.blocks import FLEX_BLOCK, _transposed_tables, packed_block_mask, packed_query_len

    rows = _rows_of(pattern, lengths, C)
    Lp = -(-len(lengths) * C // FLEX_BLOCK) * FLEX_BLOCK
    qflat = torch.cat([rows, rows[-1:].expand(packed_query_len(rows.numel(), Lp) - rows.numel())])
    start = qflat // C * C
    last = torch.minimum(qflat, start + torch.tensor(lengths)[qflat // C] - 1)
    bm = packed_block_mask(start, last, rows.numel(), Lp, None)
    M, N = start.numel() // FLEX_BLOCK, rows.numel()
    m = torch.arange(M)
    first, final = (m * FLEX_BLOCK).clamp(max=N - 1), (m * FLEX_BLOCK + FLEX_BLOCK - 1).clamp(max=N - 1)
    lo = start[first] // FLEX_BLOCK
    ranges = (lo, torch.maximum(last[final] // FLEX_BLOCK, lo), (start[final] + FLEX_BLOCK - 1) // FLEX_BLOCK,
              (last[first] + 1) // FLEX_BLOCK - 1)
    ours = _transposed_tables(*ranges, -(-N // FLEX_BLOCK), Lp // FLEX_BLOCK)
    for kind, (num, idx) in (("", ours[:2]), ("full_", ours[2:])):
        by_query = _listed(getattr(bm, f"{kind}kv_num_blocks"), getattr(bm, f"{kind}kv_indices"))
        assert _listed(num, idx) == {(c, m) for m, c in by_query}, kind
        assert _listed(num, idx) == _listed(*_transpose_ordered(getattr(bm, f"{kind}kv_num_blocks"),
                                                                getattr(bm, f"{kind}kv_indices"))), kind
        assert _listed(getattr(bm, f"{kind}q_num_blocks"), getattr(bm, f"{kind}q_indices")) == _listed(num, idx)
    from eagle3fn.unrolled.blocks import _block_mask_takes_q_tables

    assert _block_mask_takes_q_tables()  # this torch gets ours, not its own transposition
    wrong = _transposed_tables(*ranges, M, Lp // FLEX_BLOCK)
    differs = _listed(*wrong[:2]) | _listed(*wrong[2:]) != _listed(*ours[:2]) | _listed(*ours[2:])
    assert differs == (M > -(-N // FLEX_BLOCK)), "padding query blocks must be what differs"


def test_flex_kernel_options_reach_cuda_calls_only(monkeypatch):
    """``TTTConfig.flex_kernel_options`` (the tuning hook ``benchmarks/attention.py``
    sweeps) is handed, as a new dict, to FlexAttention calls on CUDA; CPU calls and an
    unset hook get ``None`` (inductor's defaults). The options reach the FlexAttention
    call itself (a spy on it, with the device test forced): fails if the keyword is
    dropped."""
    import torch.nn.attention.flex_attention as flex_module

    import eagle3fn.unrolled.flex as ttt_module

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert ttt_module.flex_kernel_options(cuda, None) is None
    options = {"bwd_num_stages": 2}
    hook = tuple(options.items())  # as TTTConfig holds them
    got = ttt_module.flex_kernel_options(cuda, hook)
    assert got == options and got is not options
    assert ttt_module.flex_kernel_options(cpu, hook) is None

    seen = []
    real = flex_module.flex_attention
    monkeypatch.setattr(flex_module, "flex_attention", lambda *a, kernel_options=None, **k: (
        seen.append(kernel_options), real(*a, **k))[1])
    monkeypatch.setattr(ttt_module, "flex_kernel_options", lambda device, given: dict(given))
    S, rows = 8, torch.arange(8)
    k0 = torch.randn(S, 1, 4)
    ttt_module.packed_flex_attention(torch.randn(S, 2, 4), rows, ttt_module.packed_keys(k0, k0),
                                     None, torch.tensor([S]), S, kernel_options=hook, fused=True)
    assert seen == [options]
