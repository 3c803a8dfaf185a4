"""SPEC section 4 teacher table: per-row oracle, ties, streaming, memory, SpecForge."""

import math

import pytest
import torch
from recorders import OpRecorder

from eagle3fn.teacher import teacher_table_from_hidden, teacher_table_from_logits
from eagle3fn.vocab import build_vocab_map


def oracle_row(z, t2d):
    """SPEC section 4 for one position, in Python floats."""
    m = max(z)
    token = z.index(m)  # lowest id among ties
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    zd = [x for x, keep in zip(z, t2d) if keep]
    md = max(zd)
    norm = sum(math.exp(x - md) for x in zd)
    probs = [math.exp(x - md) / norm for x in zd]
    return probs, [math.exp(x - lse) for x in zd], token, bool(t2d[token])


def random_map(V, Vd, seed=0):
    g = torch.Generator().manual_seed(seed)
    return build_vocab_map(torch.randint(0, 50, (V,), generator=g), Vd)


def assert_table_close(got, want, rtol):
    for name in ("probs", "probs_on_draft"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert ((a - b).abs().max() / b.abs().max()).item() <= rtol, name
    assert torch.equal(got.target_token, want.target_token)
    assert torch.equal(got.gate, want.gate)


def test_from_logits_matches_per_row_oracle_fp64():
    U, V, Vd = 9, 57, 20
    d2t, t2d = random_map(V, Vd)
    z = torch.randn(U, V, dtype=torch.float64) * 4
    z[3, :] = 1.5  # a full tie: token 0
    z[4, 10] = z[4, 11] = z[4].max() + 1  # tie between 10 and 11
    table = teacher_table_from_logits(z, t2d)
    for u in range(U):
        probs, pod, token, gate = oracle_row(z[u].tolist(), t2d.tolist())
        assert torch.allclose(table.probs[u], torch.tensor(probs, dtype=torch.float64), rtol=1e-12, atol=0)
        assert torch.allclose(table.probs_on_draft[u], torch.tensor(pod, dtype=torch.float64), rtol=1e-12, atol=1e-300)
        assert table.target_token[u].item() == token and table.gate[u].item() == gate
    assert table.target_token[3] == 0 and table.target_token[4] == 10
    assert table.probs.dtype == torch.float64


def test_low_precision_logits_give_fp32_table():
    d2t, t2d = random_map(40, 16)
    table = teacher_table_from_logits(torch.randn(5, 40, dtype=torch.bfloat16), t2d)
    assert table.probs.dtype == torch.float32 and table.probs_on_draft.dtype == torch.float32


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 99, 100, 1000])
@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_streamed_equals_dense(chunk_size, dtype, rtol):
    U, H, V, Vd = 11, 16, 100, 30
    d2t, t2d = random_map(V, Vd, seed=2)
    hidden = torch.randn(U, H, dtype=dtype)
    head = torch.randn(V, H, dtype=dtype)
    dense = teacher_table_from_logits(hidden @ head.T, t2d)
    streamed = teacher_table_from_hidden(hidden, head, t2d, chunk_size=chunk_size)
    assert_table_close(streamed, dense, rtol)


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 25])
def test_streamed_ties_break_to_lowest_id_across_chunks(chunk_size):
    # Integer logits tie exactly; duplicated head rows put the same maximum in
    # several chunks.
    U, H, V = 40, 3, 50
    g = torch.Generator().manual_seed(3)
    hidden = torch.randint(-2, 3, (U, H), generator=g).double()
    head = torch.randint(-2, 3, (V, H), generator=g).double()
    head[[7, 23, 41]] = torch.tensor([3.0, 3.0, 3.0], dtype=torch.float64)
    _, t2d = random_map(V, 20, seed=4)
    z = hidden @ head.T
    want = [row.index(max(row)) for row in z.tolist()]
    streamed = teacher_table_from_hidden(hidden, head, t2d, chunk_size=chunk_size)
    assert streamed.target_token.tolist() == want
    assert teacher_table_from_logits(z, t2d).target_token.tolist() == want
    assert ((z == z.max(1, keepdim=True).values).sum(1) > 1).sum() >= 5  # ties do occur




def test_streamed_never_allocates_U_by_V():
    U, H, V, Vd, chunk = 6, 8, 1000, 100, 128
    _, t2d = random_map(V, Vd)
    hidden, head = torch.randn(U, H), torch.randn(V, H)
    with OpRecorder() as rec:
        teacher_table_from_hidden(hidden, head, t2d, chunk_size=chunk)
    assert rec.shapes, "the recorder saw no ops"
    assert not [s for s in rec.shapes if len(s) >= 2 and s[-1] == V]
    # The same recorder does see [U, V] in the dense path (negative control).
    with OpRecorder() as rec:
        teacher_table_from_logits(hidden @ head.T, t2d)
    assert (U, V) in rec.shapes


def test_bad_inputs_are_clear_errors():
    _, t2d = random_map(40, 16)
    with pytest.raises(ValueError, match="t2d has 40 entries but the logits cover a vocab of 41"):
        teacher_table_from_logits(torch.randn(3, 41), t2d)
    with pytest.raises(ValueError, match="t2d must be bool"):
        teacher_table_from_logits(torch.randn(3, 40), t2d.long())
    with pytest.raises(ValueError, match="hidden size 7"):
        teacher_table_from_hidden(torch.randn(3, 7), torch.randn(40, 8), t2d)
    with pytest.raises(ValueError, match="chunk_size"):
        teacher_table_from_hidden(torch.randn(3, 8), torch.randn(40, 8), t2d, chunk_size=0)


def test_empty_table():
    _, t2d = random_map(40, 16)
    for table in (
        teacher_table_from_logits(torch.randn(0, 40), t2d),
        teacher_table_from_hidden(torch.randn(0, 8), torch.randn(40, 8), t2d, chunk_size=7),
    ):
        assert table.probs.shape == (0, 16) and table.target_token.shape == (0,)


def _specforge():
    pytest.importorskip("specforge")
    from specforge.algorithms.eagle3 import model as sf_model
    from specforge.core import compact_teacher

    compute = getattr(sf_model._compute_target_p, "_torchdynamo_orig_callable",
                      sf_model._compute_target_p)  # its formula, without compiling
    return compute, compact_teacher.compute_target_from_hidden


def test_specforge_teacher_formulas_agree():
    compute_target_p, compute_from_hidden = _specforge()
    B, S, H, V, Vd = 2, 13, 16, 300, 64
    _, t2d = random_map(V, Vd, seed=5)
    hidden = torch.randn(B, S, H)
    head = torch.randn(V, H)
    head[t2d] *= 1.5
    logits = hidden @ head.T
    loss_mask = (torch.rand(B, S, 1) < 0.5).int()
    sf_p, sf_pod, sf_tok, sf_pm = compute_target_p(logits, t2d, loss_mask)
    ours = teacher_table_from_logits(logits.flatten(0, 1), t2d)
    assert torch.allclose(ours.probs, sf_p.flatten(0, 1), rtol=1e-6, atol=1e-7)
    assert torch.allclose(ours.probs_on_draft, sf_pod.flatten(0, 1), rtol=1e-6, atol=1e-7)
    assert torch.equal(ours.target_token, sf_tok.flatten())
    assert torch.equal(ours.gate & loss_mask.flatten().bool(), sf_pm.flatten().bool())

    hp, hpod, htok, hpm = compute_from_hidden(hidden, head, t2d, loss_mask, chunk_size=37)
    streamed = teacher_table_from_hidden(hidden.flatten(0, 1), head, t2d, chunk_size=37)
    assert torch.allclose(streamed.probs, hp.flatten(0, 1), rtol=1e-5, atol=1e-7)
    assert torch.allclose(streamed.probs_on_draft, hpod.flatten(0, 1), rtol=1e-5, atol=1e-7)
    assert torch.equal(streamed.target_token, htok.flatten())
    # Negative control: the teacher of the neighbouring position does not pass.
    assert not torch.allclose(ours.probs[1:], sf_p.flatten(0, 1)[:-1], rtol=1e-3, atol=1e-5)
