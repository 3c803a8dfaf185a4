"""SPEC section 4 teacher table: per-row oracle, ties, streaming, memory, SpecForge.

The table is compact (``shapes.TeacherTable``): draft-vocab logits in the target's
dtype and two log-sum-exps per row; ``probs`` / ``probs_on_draft`` are computed from
them and checked here against the formulas computed independently.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from recorders import OpRecorder
from torch.utils._python_dispatch import TorchDispatchMode

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
    for name in ("probs", "probs_on_draft", "logits", "lse_draft", "lse_full"):
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
    assert table.logits.dtype == table.lse_draft.dtype == table.lse_full.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_logits_are_kept_as_given_with_fp32_lse(dtype):
    _, t2d = random_map(40, 16)
    z = (torch.randn(5, 40) * 3).to(dtype)
    table = teacher_table_from_logits(z, t2d)
    assert table.logits.dtype == dtype and torch.equal(table.logits, z[:, t2d])
    assert table.lse_draft.dtype == table.lse_full.dtype == torch.float32
    assert table.probs.dtype == torch.float32 and table.probs_on_draft.dtype == torch.float32


def old_formulas(z_UV, t2d):
    """The previous table's fields, computed independently in fp64 from the same
    values: ``softmax(z[t2d])`` and ``exp(z[t2d] - logsumexp_V z)``."""
    z = z_UV.double()
    return torch.softmax(z[:, t2d], dim=-1), torch.exp(z[:, t2d] - torch.logsumexp(z, -1, True))


def max_rel(x, y):
    return ((x.double() - y).abs().max() / y.abs().max()).item()


@pytest.mark.parametrize("src", ["logits", "hidden"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["fp64", "bf16"])
def test_compact_probs_equal_the_old_formulas(dtype, src):
    """``exp(logits - lse_draft)`` and ``exp(logits - lse_full)``, read densely and by
    row, equal the old table's formulas; the same check catches ``lse_draft`` where
    ``lse_full`` belongs. Logits ~ 20 + N(0, 3^2), a few larger: lse ~ 30-40. fp64
    agrees to 1e-12; bf16 inputs to fp32 rounding, which here is dominated by the
    rounding of the fp32 lse (an absolute error of ``|lse| * 2^-24`` in the exponent,
    a relative one in every probability of the row)."""
    U, H, V, Vd = 23, 16, 600, 200
    _, t2d = random_map(V, Vd, seed=8)
    g = torch.Generator().manual_seed(9)
    hidden = torch.randn(U, H, generator=g, dtype=torch.float64).to(dtype)
    head = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.75).to(dtype)
    hidden[:, 0], head[:, 0] = 1, 20  # every logit shifted by 20
    head[t2d.nonzero()[:5, 0]] *= 1.5  # a few large draft-vocab logits
    z = F.linear(hidden, head)  # [U, V] in dtype, as the target produces it
    if src == "logits":
        table = teacher_table_from_logits(z, t2d)
    else:
        table = teacher_table_from_hidden(hidden, head, t2d, chunk_size=128)
        z = torch.cat([F.linear(hidden, head[s:s + 128]) for s in range(0, V, 128)], 1)
    lse_max = table.lse_full.abs().max().item()
    assert lse_max > 16  # the hard case for the fp32 lse
    tol = 1e-12 if dtype == torch.float64 else 2**-23 * (1 + lse_max)
    probs, probs_on_draft = old_formulas(z, t2d)
    rows = torch.tensor([3, 3, 0, 22, 7])
    for got, want in ((table.probs, probs), (table.probs_on_draft, probs_on_draft),
                      (table.probs_at(rows), probs[rows]),
                      (table.probs_on_draft_at(rows), probs_on_draft[rows])):
        assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert max_rel(got, want) <= tol
    if dtype != torch.float64:  # the bound is fp32 rounding: the old fp32 code meets it too
        zd = z.float()[:, t2d]
        assert max_rel(torch.softmax(zd, dim=-1), probs) <= tol
    # Negative control: the renormalised probabilities are not probs_on_draft.
    wrong = torch.exp(table.logits.to(table.lse_draft.dtype) - table.lse_draft[:, None])
    assert max_rel(wrong, probs_on_draft) > tol


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


@pytest.mark.parametrize("chunk_size", [1, 7, 10, 33, 100])
def test_streamed_logits_are_the_targets_values_in_place(chunk_size):
    """bf16: the table's logits are, bitwise, the head's bf16 logits at the draft-vocab
    columns, with draft ids clustered so that some chunks hold none and one chunk holds
    all of a run; the lse equal the dense table's to fp32 rounding."""
    U, H, V = 9, 16, 100
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[0, 1, 2, 3, 9, 55, 56, 57, 58, 59, 60, 61, 62, 63, 99]] = True
    g = torch.Generator().manual_seed(6)
    hidden = torch.randn(U, H, generator=g).bfloat16()
    head = torch.randn(V, H, generator=g).bfloat16()
    z = torch.cat([F.linear(hidden, head[s:s + chunk_size]) for s in range(0, V, chunk_size)], 1)
    streamed = teacher_table_from_hidden(hidden, head, t2d, chunk_size=chunk_size)
    assert streamed.logits.dtype == torch.bfloat16 and streamed.logits.is_contiguous()
    assert torch.equal(streamed.logits, z[:, t2d])
    dense = teacher_table_from_logits(z, t2d)
    for name in ("lse_draft", "lse_full"):
        assert max_rel(getattr(streamed, name), getattr(dense, name).double()) <= 1e-6
    assert torch.equal(streamed.target_token, dense.target_token)
    # Negative control: the columns of the neighbouring target ids differ.
    assert not torch.equal(streamed.logits, z[:, t2d.roll(1)])


class _HostReads(TorchDispatchMode):
    """Ops whose output shape or value must be read by the host (a GPU sync), and
    boolean-mask indexing (which is one)."""

    SYNCING = {"nonzero", "masked_select", "_local_scalar_dense", "is_nonzero", "item"}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        bool_index = name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in self.SYNCING or bool_index:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_streamed_loop_never_reads_the_device():
    """The one host read of the streamed build (``.tolist()`` of the chunk bounds, before
    the loop) is no dispatched op: none are recorded, whatever the chunk count."""
    _, t2d = random_map(1000, 100)
    hidden, head = torch.randn(6, 8), torch.randn(1000, 8)
    for chunk in (7, 128, 1000):
        with _HostReads() as rec:
            teacher_table_from_hidden(hidden, head, t2d, chunk_size=chunk)
        assert rec.seen == [], (chunk, rec.seen)
    with _HostReads() as rec:  # negative control: the dense build masks by t2d
        teacher_table_from_logits(hidden @ head.T, t2d)
    assert "index" in rec.seen


def storage_bytes(table):
    """Bytes of the storages behind the table (a view of a larger buffer counts whole)."""
    fields = (table.logits, table.lse_draft, table.lse_full, table.target_token, table.gate)
    return sum(t.untyped_storage().nbytes() for t in fields)


@pytest.mark.parametrize("src", ["logits", "hidden"])
def test_table_bytes_are_compact(src):
    """bf16 inputs: ``2*U*Vd`` bytes of logits plus ``17*U`` (two fp32 lse, int64 token,
    bool gate), not the previous ``8*U*Vd`` of two fp32 ``[U, Vd]``."""
    U, H, V, Vd = 300, 8, 6000, 2000
    _, t2d = random_map(V, Vd, seed=3)
    hidden, head = torch.randn(U, H).bfloat16(), torch.randn(V, H).bfloat16()
    if src == "logits":
        table = teacher_table_from_logits(hidden @ head.T, t2d)
    else:
        table = teacher_table_from_hidden(hidden, head, t2d, chunk_size=1024)
    want = U * Vd * 2 + U * (4 + 4 + 8 + 1)
    assert storage_bytes(table) == table.nbytes == want
    assert storage_bytes(table) < 8 * U * Vd / 3.9
    # Negative control: fp32 inputs keep fp32 logits, twice the bytes.
    fp32 = teacher_table_from_logits(hidden.float() @ head.float().T, t2d)
    assert storage_bytes(fp32) == U * Vd * 4 + U * 17 != want


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
