"""``seqpar.ring_block_attention``: the local part of the sequence-parallel attention
(own block causal, earlier ring blocks in full, diagonal keys), eager and flex,
against a dense oracle over the concatenated keys. The flex forward runs on CPU
(no backward there: tests/test_gpu.py checks gradients on CUDA); the multi-rank path
around it is tests/test_parallel.py's."""

import math

import pytest
import torch

import eagle3fn.parallel.seqpar as seqpar
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
]


@pytest.mark.parametrize("impl", ["eager", "flex"])
@pytest.mark.parametrize("own_n,earlier_n,num_diag", CASES)
def test_block_attention_equals_dense_oracle(impl, own_n, earlier_n, num_diag):
    """Every query row that sees a key (padding queries included) equals the dense
    softmax over all its keys; a block with no real key (length 0) is skipped, not a
    NaN."""
    q, own, earlier, diag = make(own_n, earlier_n, num_diag)
    with torch.no_grad():
        got = ring_block_attention(q, own, earlier, diag, impl)
    want = dense_oracle(q, own, earlier, diag)
    assert torch.isfinite(got).all()
    tol = 1e-12 if impl == "eager" else 1e-6  # flex's CPU reference computes in fp32
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_flex_negative_controls(monkeypatch):
    """The same comparison catches a flex path that drops the earlier blocks (no merge)
    and one whose own block is not causal."""
    q, own, earlier, diag = make([200, 150], [[200, 200], [200, 77]], 2)
    want = dense_oracle(q, own, earlier, diag)
    with monkeypatch.context() as m:
        m.setattr(seqpar, "_merge_blocks", lambda o, lse, o_t, lse_t: (o, lse))
        with torch.no_grad():
            dropped = ring_block_attention(q, own, earlier, diag, "flex")
    assert (dropped - want).abs().max() > 1e-2
    with monkeypatch.context() as m:  # every own key visible: the layout's window to the block's end
        real = seqpar.ttt_module.packed_layout

        def acausal(rows, lengths, num_rows, key_len):
            layout = real(rows, lengths, num_rows, key_len)
            last = layout.start + lengths[layout.start // num_rows] - 1
            return seqpar.ttt_module.PackedLayout(layout.num_queries, layout.start, last,
                                                  seqpar.ttt_module.block_tables(layout.start, last,
                                                                                 layout.num_queries, key_len))
        m.setattr(seqpar.ttt_module, "packed_layout", acausal)
        with torch.no_grad():
            future = ring_block_attention(q, own, earlier, diag, "flex")
    assert (future - want).abs().max() > 1e-2


def test_block_attention_refuses_bad_input():
    """Flex needs right-padded validity; unknown implementations are refused."""
    q, own, earlier, diag = make([200, 150], [], 0)
    holes = own[2].clone()
    holes[0, 5] = False
    with pytest.raises(ValueError, match="right-padded"):
        ring_block_attention(q, (own[0], own[1], holes), impl="flex")
    with pytest.raises(ValueError, match="impl"):
        ring_block_attention(q, own, impl="dense")
    with pytest.raises(ValueError, match="impl"):
        seqpar.SequenceParallelAttention(layout=None, impl="dense")
