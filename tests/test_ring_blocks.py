"""``seqpar.ring_block_attention``: the local part of the sequence-parallel attention
(own block causal, earlier ring blocks in full, diagonal keys), eager and flex,
against a dense oracle over the concatenated keys. The flex forward runs on CPU
(no backward there: tests/test_gpu.py checks gradients on CUDA); the multi-rank path
around it is tests/test_parallel.py's."""

import math

import pytest
import torch

import eagle3fn.parallel.seqpar as seqpar
import eagle3fn.unrolled.merges as merges_module
from eagle3fn.parallel.seqpar import ring_block_attention

B, H, G, S, D = 2, 4, 2, 200, 16


def make(lengths_own, lengths_earlier, num_diag, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=dtype)  # noqa: E731
    prefix = lambda n: torch.arange(S)[None] < torch.tensor(n)[:, None]  # noqa: E731
    q = rand(B, H, S, D)
    own = (rand(B, G, S, D), rand(B, G, S, D), prefix(lengths_own))
    earlier = [(rand(B, G, S, D), rand(B, G, S, D), prefix(n)) for n in lengths_earlier]
    diag = [(rand(B, G, S, D), rand(B, G, S, D)) for _ in range(num_diag)]
    return q, own, earlier, diag


def dense_oracle(q, own, earlier, diag):
    """Softmax over [earlier blocks..., own block, diagonal keys] with one explicit
    mask, in fp64, with no block merge: query i sees every valid earlier key, own keys
    j <= i that are valid, and its own diagonal keys."""
    rep = H // G
    keys = [(k, v, valid[:, None, :].expand(B, S, S)) for k, v, valid in earlier]
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    keys.append((own[0], own[1], causal[None] & own[2][:, None, :]))
    out = torch.zeros(B, H, S, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // rep
            scores = [q[b, h].double() @ k[b, kv].double().T for k, _, _ in keys]
            masks = [m[b] for _, _, m in keys]
            scores += [(q[b, h].double() * k[b, kv].double()).sum(-1, keepdim=True) for k, _ in diag]
            masks += [torch.ones(S, 1, dtype=torch.bool) for _ in diag]
            values = [v[b, kv].double() for _, v, _ in keys]
            s = torch.cat(scores, 1) / math.sqrt(D)
            s = s.masked_fill(~torch.cat(masks, 1), -math.inf)
            p = torch.softmax(s, 1)
            p = torch.nan_to_num(p)  # rows that see nothing at all
            col = 0
            for V in values:
                out[b, h] += p[:, col:col + S] @ V
                col += S
            for i, (_, v) in enumerate(diag):
                out[b, h] += p[:, col + i, None] * v[b, kv].double()
    return out


CASES = [  # (own lengths, earlier blocks' lengths, diagonal steps)
    ([200, 150], [], 0),
    ([200, 150], [[200, 200]], 2),
    ([120, 200], [[200, 200], [200, 77]], 3),
    ([200, 200], [[200, 0], [200, 200]], 1),
    ([200, 0], [[200, 0]], 1),  # sample 1 sees no step-0 key at all: only its diagonal key
]


@pytest.mark.parametrize("impl", ["eager", "flex"])
@pytest.mark.parametrize("own_n,earlier_n,num_diag", CASES)
def test_block_attention_equals_dense_oracle(impl, own_n, earlier_n, num_diag):
    """Every query row that sees a key (padding queries included) equals the dense
    softmax over all its keys; a block with no real key (length 0) is skipped, not a
    NaN."""
    q, own, earlier, diag = make(own_n, earlier_n, num_diag)
    with torch.no_grad():
        got = ring_block_attention(q, own, earlier, diag, impl, fused=True)
    want = dense_oracle(q, own, earlier, diag)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_flex_rows_that_see_nothing_are_zero():
    """A row with no key at all (no step-0 key, no diagonal key: step 0 of an all-padding
    sample) gets 0 from the flex path, finite (the eager path's masked softmax
    averages the values there instead; such rows carry no loss)."""
    q, own, earlier, diag = make([200, 0], [[200, 0]], 0)
    with torch.no_grad():
        got = ring_block_attention(q, own, earlier, diag, "flex", fused=True)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[0], dense_oracle(q, own, earlier, diag)[0], rtol=1e-12, atol=1e-12)


def test_sequence_parallel_attention_flex_equals_eager_through_ttt(monkeypatch):
    """``SequenceParallelAttention(impl="flex")`` inside ``ttt`` (one-rank layout: the
    own block, its cache reused across the k steps, the diagonal keys) gives the
    eager implementation's losses and metrics; a flex path that drops the diagonal
    keys does not."""
    from test_ttt import CFG, K, make_batch

    from eagle3fn.align import supervised_mask
    from eagle3fn.parallel.mesh import Layout
    from eagle3fn.rowmap import build_rowmap
    from eagle3fn.unrolled import Collectives, TTTConfig, ttt

    f, lm, params, d2t, t2d = make_batch("random30", 2)
    rm = build_rowmap(supervised_mask(lm, f.attention_mask), K)
    layout = Layout(mesh=None, world_mesh=None, dp=1, ring=1, ulysses=1, dp_rank=0, ring_rank=0,
                    ulysses_rank=0)

    def run(impl):
        coll = Collectives(attend=seqpar.SequenceParallelAttention(layout, impl=impl, compile_elementwise=True),
                           reduce_terms=list,
                           denominator=rm.denominator)
        with torch.no_grad():
            return ttt(params, f, rm, TTTConfig(draft=CFG, ttt_length=K, trim="backbone"), d2t=d2t, t2d=t2d,
                       collectives=coll)

    eager, flex = run("eager"), run("flex")
    torch.testing.assert_close(flex.kl_loss, eager.kl_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(flex.acc, eager.acc)
    monkeypatch.setattr(merges_module, "merge_diagonal", lambda o, lse, q, k, v, scale: o)
    broken = run("flex")
    assert (broken.kl_loss - eager.kl_loss).abs().max() > 1e-6


def test_flex_negative_controls(monkeypatch):
    """The same comparison catches a flex path that drops the earlier blocks (no merge)
    and one whose own block is not causal."""
    q, own, earlier, diag = make([200, 150], [[200, 200], [200, 77]], 2)
    want = dense_oracle(q, own, earlier, diag)
    with monkeypatch.context() as m:
        m.setattr(seqpar, "merge_blocks", lambda o, lse, o_t, lse_t: (o, lse))
        with torch.no_grad():
            dropped = ring_block_attention(q, own, earlier, diag, "flex", fused=True)
    assert (dropped - want).abs().max() > 1e-2
    with monkeypatch.context() as m:  # every own key visible: the layout's window to the block's end
        real = seqpar.packed_layout

        def acausal(rows, lengths, num_rows, key_len):
            layout = real(rows, lengths, num_rows, key_len)
            last = layout.start + lengths[layout.start // num_rows] - 1
            return seqpar.PackedLayout(layout.num_queries, layout.start, last,
                                       seqpar.block_tables(layout.start, last,
                                                           layout.num_queries, key_len))
        m.setattr(seqpar, "packed_layout", acausal)
        with torch.no_grad():
            future = ring_block_attention(q, own, earlier, diag, "flex", fused=True)
    assert (future - want).abs().max() > 1e-2


def test_block_attention_refuses_bad_input():
    """Flex needs right-padded validity; unknown implementations are refused."""
    q, own, earlier, diag = make([200, 150], [], 0)
    holes = own[2].clone()
    holes[0, 5] = False
    with pytest.raises(ValueError, match="right-padded"):
        ring_block_attention(q, (own[0], own[1], holes), impl="flex", fused=True)
    with pytest.raises(ValueError, match="impl"):
        ring_block_attention(q, own, impl="dense", fused=True)
    with pytest.raises(ValueError, match="impl"):
        seqpar.SequenceParallelAttention(layout=None, impl="dense", compile_elementwise=True)
