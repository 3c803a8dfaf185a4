"""Triton indexed soft cross-entropy (kernels/soft_ce.py) vs its PyTorch twins.

Runs in the Triton interpreter (conftest sets TRITON_INTERPRET=1): small N, large
vocab blocks. Every kernel output comes from a NaN-poisoned allocator, so a row or
column the kernels forget to write fails the comparisons. The teacher is the compact
table (draft-vocab logits + two log-sum-exps), fp32 or bf16.
"""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import eagle3fn.kernels.soft_ce as soft_ce_module
from eagle3fn.kernels import indexed_soft_ce, indexed_soft_ce_naive
from eagle3fn.loss import LossConfig, objective, soft_cross_entropy, step_terms
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import TeacherTable
from eagle3fn.teacher import teacher_table_from_logits

SIZES = [(0, 1000), (1, 1000), (5, 1000), (37, 1000), (5, 32000), (3, 163840), (2, 262144)]
FP32_LOSS, FP32_GRAD = 1e-6, 1e-5  # SPEC section 8, fp32 line
LOW_TOL = 1e-5  # three-way rule: kernel error <= torch error + LOW_TOL


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    def alloc(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(soft_ce_module, "_alloc", alloc)


@dataclasses.dataclass
class Case:
    logits: torch.Tensor  # fp32 [N, Vd]
    table: TeacherTable
    table_rows: torch.Tensor
    d2t: torch.Tensor
    row_mask: torch.Tensor


def make_case(N, Vd, seed=0, teacher_dtype=torch.float32, table_rows=None):
    """Teacher table over a target vocab of Vd + 17 where every third teacher's argmax
    leaves the draft vocab (gate off); half the rows lean toward their teacher's token
    so ``correct`` is neither all 0 nor all 1; a random row mask. The target logits
    are rounded to ``teacher_dtype`` first (the table keeps them in that dtype).
    ``table_rows`` (``[N]``, into ``U = N // 2 + 2`` rows) defaults to random."""
    g = torch.Generator().manual_seed(seed)
    V = Vd + 17
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    d2t = torch.nonzero(t2d).squeeze(1) - torch.arange(Vd)
    U = N // 2 + 2
    target = torch.randn(U, V, generator=g) * 2
    target[1::3, torch.nonzero(~t2d)[0, 0]] += 30
    table = teacher_table_from_logits(target.to(teacher_dtype), t2d)
    if table_rows is None:
        table_rows = torch.randint(0, U, (N,), generator=g)
    logits = torch.randn(N, Vd, generator=g) * 2
    draft_id = (torch.cumsum(t2d, 0) - 1)[table.target_token[table_rows]]
    logits[torch.arange(0, N, 2), draft_id[::2]] += 8
    row_mask = torch.rand(N, generator=g) < 0.7
    return Case(logits, table, table_rows, d2t, row_mask)


def err(x, y):
    """``max|x - y| / max|y|``; 0 for empty tensors."""
    if y.numel() == 0:
        return 0.0
    x, y = x.double(), y.double()
    return ((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()


def run_rows(fn, case, logits, *, row_mask=None, table_rows=None):
    """Per-row outputs of ``fn`` (the kernel or its twin) and the logits gradient of
    ``sum_i w_i * loss_i`` with random row weights w (exercises the upstream grad)."""
    t = case.table
    x = logits.detach().clone().requires_grad_(True)
    out = fn(x, t.logits, t.lse_draft, t.lse_full, t.gate,
             case.table_rows if table_rows is None else table_rows,
             target_token_U=t.target_token, d2t_V=case.d2t, row_mask_N=row_mask)
    w = torch.randn(x.shape[0], generator=torch.Generator().manual_seed(1), dtype=out.loss.dtype)
    (out.loss * w).sum().backward()
    return out, x.grad


def assert_rows_match(got, want, *, tol_out, tol_grad):
    (out_g, grad_g), (out_w, grad_w) = got, want
    for name in ("loss", "lse", "accept"):
        x = getattr(out_g, name)
        assert torch.isfinite(x).all(), f"{name} has NaN/inf: {x}"
        e = err(x, getattr(out_w, name))
        assert e <= tol_out, f"{name} differs by {e:.3g}"
    assert torch.equal(out_g.argmax, out_w.argmax), "argmax differs"
    assert torch.equal(out_g.correct, out_w.correct), "correct differs"
    assert grad_g.dtype == grad_w.dtype and torch.isfinite(grad_g).all()
    e = err(grad_g, grad_w)
    assert e <= tol_grad, f"gradient differs by {e:.3g}"


def run_step(case, logits, impl, *, row_mask=None, accept_grad=False):
    x = logits.detach().clone().requires_grad_(True)
    terms = step_terms(x, case.table, case.table_rows, case.d2t, row_mask_N=row_mask,
                       impl=impl, accept_grad=accept_grad)
    total = terms.loss_sum
    if accept_grad:
        total = total + terms.accept_sum + terms.log_accept_sum
    total.backward()
    return terms, x.grad


def assert_steps_match(got, want, *, tol_loss, tol_grad):
    (tg, grad_g), (tw, grad_w) = got, want
    for name in ("correct", "rows", "gated"):
        assert torch.equal(getattr(tg, name), getattr(tw, name)), name
    for name in ("loss_sum", "accept_sum", "log_accept_sum"):
        e = err(getattr(tg, name), getattr(tw, name))
        assert e <= tol_loss, f"{name} differs by {e:.3g}"
    e = err(grad_g, grad_w)
    assert e <= tol_grad, f"gradient differs by {e:.3g}"


@pytest.mark.parametrize("masked", [False, True], ids=["all-rows", "row-mask"])
@pytest.mark.parametrize("N,Vd", SIZES)
def test_fp32_matches_torch(N, Vd, masked):
    case = make_case(N, Vd)
    mask = case.row_mask if masked else None
    assert_rows_match(run_rows(indexed_soft_ce, case, case.logits, row_mask=mask),
                      run_rows(indexed_soft_ce_naive, case, case.logits, row_mask=mask),
                      tol_out=FP32_LOSS, tol_grad=FP32_GRAD)
    assert_steps_match(run_step(case, case.logits, "triton", row_mask=mask),
                       run_step(case, case.logits, "torch", row_mask=mask),
                       tol_loss=FP32_LOSS, tol_grad=FP32_GRAD)


def test_case_exercises_every_branch():
    """The random cases above hold gated, ungated, masked and correct rows."""
    case = make_case(37, 1000)
    gate = case.table.gate[case.table_rows]
    out, _ = run_rows(indexed_soft_ce_naive, case, case.logits, row_mask=case.row_mask)
    assert 0 < gate.sum() < 37 and 0 < case.row_mask.sum() < 37
    assert 0 < out.correct.sum() < case.row_mask.sum()


def fp64_table(case):
    """The same table, exactly, in fp64 (the teacher's probabilities in fp64 math)."""
    t = case.table
    return dataclasses.replace(case, table=dataclasses.replace(
        t, logits=t.logits.double(), lse_draft=t.lse_draft.double(),
        lse_full=t.lse_full.double()))


def assert_three_way(kernel, torch_same, truth, tol, what):
    e_k, e_t = err(kernel, truth), err(torch_same, truth)
    assert e_k <= e_t + tol, f"{what}: kernel {e_k:.3g} vs torch {e_t:.3g} (+{tol:g})"


THREE_WAY = [(N, Vd, dtype) for N, Vd in [(5, 1000), (4, 32000), (2, 262144)]
             for dtype in (torch.float32, torch.bfloat16)] + [(5, 1000, torch.float16)]


@pytest.mark.parametrize("N,Vd,dtype", THREE_WAY, ids=lambda x: str(x).replace("torch.", ""))
def test_three_way_against_fp64(N, Vd, dtype):
    """err(kernel, fp64) <= err(torch in the same dtype, fp64) + tol for every output,
    every step sum and the gradient (in the logits' dtype for both), all on the same
    rounded inputs (STYLE example 2). Direct kernel-vs-torch bounds would be wrong here:
    at large Vd torch's own fp32 sums are the less accurate side."""
    tol = FP32_LOSS if dtype == torch.float32 else LOW_TOL
    # bf16 draft logits come with a bf16 target, whose table keeps bf16 teacher logits
    teacher = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    case = make_case(N, Vd, teacher_dtype=teacher)
    case64 = fp64_table(case)
    low = case.logits.to(dtype)
    mask = case.row_mask
    truth = run_rows(indexed_soft_ce_naive, case64, low.double(), row_mask=mask)
    kernel = run_rows(indexed_soft_ce, case, low, row_mask=mask)
    torch_low = run_rows(indexed_soft_ce_naive, case, low, row_mask=mask)
    assert kernel[1].dtype == dtype
    for name in ("loss", "lse", "accept"):
        assert_three_way(getattr(kernel[0], name), getattr(torch_low[0], name),
                         getattr(truth[0], name), tol, name)
    assert_three_way(kernel[1], torch_low[1], truth[1], tol, "gradient")
    assert torch.equal(kernel[0].argmax, torch_low[0].argmax)
    assert torch.equal(kernel[0].correct, torch_low[0].correct)

    truth = run_step(case64, low.double(), "torch", row_mask=mask)
    kernel = run_step(case, low, "triton", row_mask=mask)
    torch_low = run_step(case, low, "torch", row_mask=mask)
    for name in ("loss_sum", "accept_sum", "log_accept_sum"):
        assert_three_way(getattr(kernel[0], name), getattr(torch_low[0], name),
                         getattr(truth[0], name), tol, name)
    assert_three_way(kernel[1], torch_low[1], truth[1], tol, "step gradient")
    assert kernel[0].correct == torch_low[0].correct == truth[0].correct


@pytest.mark.parametrize("N,Vd,block", [(5, 1000, 128), (3, 32000, 4096)])
def test_many_vocab_blocks(N, Vd, block, monkeypatch):
    """Online softmax across blocks (4096 is the GPU block) with a partial last block."""
    monkeypatch.setattr(soft_ce_module, "INTERPRETER_BLOCK_V", block)
    case = make_case(N, Vd, seed=3)
    assert_rows_match(run_rows(indexed_soft_ce, case, case.logits, row_mask=case.row_mask),
                      run_rows(indexed_soft_ce_naive, case, case.logits, row_mask=case.row_mask),
                      tol_out=FP32_LOSS, tol_grad=FP32_GRAD)


@pytest.mark.parametrize("block", [128, 65536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_argmax_ties_go_to_the_lowest_id(dtype, block, monkeypatch):
    monkeypatch.setattr(soft_ce_module, "INTERPRETER_BLOCK_V", block)
    Vd = 1000
    case = make_case(6, Vd)
    z = case.logits.clone()
    z[0, [5, 700]] = 50.0  # tie across blocks (block 128)
    z[1] = 1.0  # every entry ties
    z[2, [300, 301, 999]] = 40.0  # tie inside one block, and in the partial last block
    z[3, 999] = 60.0  # maximum in the partial last block
    z[4, [100, 900]] = torch.tensor([30.001, 30.002])  # equal once rounded to bf16
    out, _ = run_rows(indexed_soft_ce, case, z.to(dtype))
    want = z.to(dtype).argmax(dim=-1)
    assert torch.equal(out.argmax, want)
    assert out.argmax[:4].tolist() == [5, 0, 300, 999]
    assert out.argmax[4].item() == (100 if dtype == torch.bfloat16 else 900)


def test_teacher_mass_other_than_one():
    """dz = g (softmax(z) * sum_v p_v - p): the mass term matters when the teacher rows
    do not sum to exactly 1 (a backward that drops it fails here, not above)."""
    case = make_case(9, 1000)
    scale = torch.linspace(0.5, 1.5, case.table.num_positions)
    case = dataclasses.replace(case, table=dataclasses.replace(
        case.table, lse_draft=case.table.lse_draft - scale.log()))
    assert_rows_match(run_rows(indexed_soft_ce, case, case.logits),
                      run_rows(indexed_soft_ce_naive, case, case.logits),
                      tol_out=FP32_LOSS, tol_grad=FP32_GRAD)


def test_all_gates_off_cost_no_loss_but_keep_acc():
    case = make_case(9, 1000)
    table = dataclasses.replace(case.table, gate=torch.zeros_like(case.table.gate))
    case = dataclasses.replace(case, table=table)
    (out, grad), (want, _) = (run_rows(f, case, case.logits)
                              for f in (indexed_soft_ce, indexed_soft_ce_naive))
    assert torch.equal(out.loss, torch.zeros(9)) and torch.equal(out.accept, torch.zeros(9))
    assert torch.equal(grad, torch.zeros_like(grad))
    assert torch.equal(out.argmax, case.logits.argmax(dim=-1))
    assert torch.equal(out.correct, want.correct) and out.correct.sum() > 0
    terms, _ = run_step(case, case.logits, "triton")
    assert terms.loss_sum.item() == 0 and terms.gated.item() == 0 and terms.correct > 0


def test_empty_row_mask_gives_zeros():
    case = make_case(7, 1000)
    # Every teacher's token is draft id 0's: a row outside the mask (argmax 0) would
    # count as correct if the mask were not applied.
    table = dataclasses.replace(case.table, target_token=torch.full_like(
        case.table.target_token, case.d2t[0].item()))
    case = dataclasses.replace(case, table=table)
    none = torch.zeros(7, dtype=torch.bool)
    out, grad = run_rows(indexed_soft_ce, case, case.logits, row_mask=none)
    for x in (out.loss, out.lse, out.accept, out.argmax, out.correct, grad):
        assert torch.equal(x, torch.zeros_like(x))


def test_poisoned_allocator_is_active():
    """Negative control for the poison: kernels' outputs start as NaN / -1."""
    x = soft_ce_module._alloc((3,), torch.float32, torch.device("cpu"))
    assert torch.isnan(x).all()
    assert (soft_ce_module._alloc((3,), torch.int64, torch.device("cpu")) == -1).all()


@pytest.mark.parametrize("shift", [1, 2])
def test_negative_control_shifted_table_rows_is_caught(shift):
    """Rows read the wrong teacher: the same comparisons fail."""
    case = make_case(37, 1000)
    U = case.table.num_positions
    shifted = (case.table_rows + shift) % U
    want = run_rows(indexed_soft_ce_naive, case, case.logits, row_mask=case.row_mask)
    with pytest.raises(AssertionError):
        assert_rows_match(run_rows(indexed_soft_ce, case, case.logits, row_mask=case.row_mask,
                                   table_rows=shifted),
                          want, tol_out=FP32_LOSS, tol_grad=FP32_GRAD)
    wrong = dataclasses.replace(case, table_rows=shifted)
    with pytest.raises(AssertionError):
        assert_steps_match(run_step(wrong, case.logits, "triton"),
                           run_step(case, case.logits, "torch"),
                           tol_loss=FP32_LOSS, tol_grad=FP32_GRAD)


# ---- torch.func, objectives, fallbacks -----------------------------------------------


def test_under_torch_func_grad():
    case = make_case(11, 1000)

    def loss(x, impl):
        return soft_cross_entropy(x, case.table, case.table_rows, row_mask_N=case.row_mask,
                                  impl=impl)

    got = torch.func.grad(loss)(case.logits, "triton")
    x = case.logits.clone().requires_grad_(True)
    loss(x, "torch").backward()
    assert torch.isfinite(got).all() and err(got, x.grad) <= FP32_GRAD
    assert err(got, torch.func.grad(loss)(case.logits, "torch")) <= FP32_GRAD


def test_under_functional_call_of_a_head():
    """Params -> logits -> step_terms inside torch.func.grad(functional_call(...))."""
    case = make_case(9, 1000)
    head = torch.nn.Linear(16, 1000, bias=False)
    hidden = torch.randn(9, 16)
    params = {k: v.detach() for k, v in head.named_parameters()}

    def loss(p, impl):
        logits = torch.func.functional_call(head, p, (hidden,))
        return step_terms(logits, case.table, case.table_rows, case.d2t, impl=impl).loss_sum

    got, want = (torch.func.grad(loss)(params, impl)["weight"] for impl in ("triton", "torch"))
    assert got.abs().max() > 0 and err(got, want) <= FP32_GRAD


CONFIGS = [LossConfig(), LossConfig(normalization="token_mean"), LossConfig(objective="alpha"),
           LossConfig(objective="lambda", kl_scale=0.7, kl_decay=2.0)]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.objective}-{c.normalization}")
def test_objective_matches_torch(config):
    """k steps through rowmap + table + step_terms + objective: every Objective field
    and every step gradient, fp32 line of SPEC 8 (alpha/lambda use the accept fallback)."""
    k, B, S, Vd = 4, 2, 12, 300
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(B, S, generator=g) < 0.5
    rm = build_rowmap(mask, k)
    V = Vd + 40
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    d2t = torch.nonzero(t2d).squeeze(1) - torch.arange(Vd)
    target = torch.randn(rm.teacher_positions.numel(), V, generator=g) * 3
    target[:, t2d] += 1.5
    table = teacher_table_from_logits(target, t2d)
    logits = [torch.randn(r.numel(), Vd, generator=g) * 2 for r in rm.rows]
    results = []
    for impl in ("triton", "torch"):
        xs = [x.clone().requires_grad_(True) for x in logits]
        terms = [step_terms(x, table, tr, d2t, impl=impl, accept_grad=config.objective != "kl")
                 for x, tr in zip(xs, rm.table_rows)]
        out = objective(terms, rm.denominator, config)
        out.objective.backward()
        results.append((out, [x.grad for x in xs]))
    (got, grads_g), (want, grads_w) = results
    for f in dataclasses.fields(got):
        e = err(getattr(got, f.name), getattr(want, f.name))
        assert e <= FP32_LOSS, f"{f.name} differs by {e:.3g}"
    for j, (a, b) in enumerate(zip(grads_g, grads_w)):
        assert err(a, b) <= FP32_GRAD, f"step {j} gradient"


def test_accept_grad_falls_back_to_torch():
    case = make_case(13, 1000)
    got = run_step(case, case.logits, "triton", accept_grad=True)
    assert got[0].accept_sum.requires_grad and got[0].log_accept_sum.requires_grad
    assert_steps_match(got, run_step(case, case.logits, "torch", accept_grad=True),
                       tol_loss=FP32_LOSS, tol_grad=FP32_GRAD)
    plain, _ = run_step(case, case.logits, "triton")
    assert not plain.accept_sum.requires_grad and plain.loss_sum.requires_grad


def test_fp64_runs_the_torch_twin():
    case = make_case(9, 1000)
    x = case.logits.double()
    case64 = fp64_table(case)
    got, want = (run_rows(f, case64, x) for f in (indexed_soft_ce, indexed_soft_ce_naive))
    assert_rows_match(got, want, tol_out=0, tol_grad=0)
    assert_steps_match(run_step(case64, x, "triton"), run_step(case64, x, "torch"),
                       tol_loss=1e-12, tol_grad=1e-12)


def test_errors_are_clear(monkeypatch):
    case = make_case(3, 1000)
    x = case.logits.clone().requires_grad_(True)
    with pytest.raises(ValueError, match="impl must be 'torch' or 'triton'"):
        step_terms(x, case.table, case.table_rows, case.d2t, impl="cuda")
    loss = soft_cross_entropy(x, case.table, case.table_rows, impl="triton")
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        g.sum().backward()
    with pytest.raises(ValueError, match="bf16, fp16, fp32 or fp64"):
        soft_cross_entropy(x.long(), case.table, case.table_rows, impl="triton")
    monkeypatch.setattr(soft_ce_module, "_INTERPRETED", False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        soft_cross_entropy(x, case.table, case.table_rows, impl="triton")


# ---- the table is read by index, never gathered --------------------------------------


class _TableGathers(TorchDispatchMode):
    """Records the output size of every index/gather op that reads one of ``tables``."""

    OPS = {"index", "_unsafe_index", "index_select", "gather", "take"}

    def __init__(self, tables):
        super().__init__()
        self.storages = {t.untyped_storage().data_ptr() for t in tables}
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        src = args[0] if args else None
        if (func.overloadpacket.__name__ in self.OPS and isinstance(src, torch.Tensor)
                and src.untyped_storage().data_ptr() in self.storages):
            self.sizes.append(out.numel())
        return out


@pytest.mark.parametrize("N,Vd", [(5, 1000), (3, 32000)])
def test_triton_path_never_gathers_the_table(N, Vd):
    case = make_case(N, Vd, teacher_dtype=torch.bfloat16)
    tables = (case.table.logits, case.table.lse_draft, case.table.lse_full)
    with _TableGathers(tables) as triton_ops:
        run_step(case, case.logits, "triton", row_mask=case.row_mask)
    with _TableGathers(tables) as torch_ops:
        run_step(case, case.logits, "torch", row_mask=case.row_mask)
    assert triton_ops.sizes == []
    # Negative control: the same recorder sees the torch path's [N, Vd] gathers.
    assert torch_ops.sizes.count(N * Vd) >= 2, torch_ops.sizes


# ---- the compact table: kernels == torch path, and no [U, Vd] fp32 -------------------

# Rows that repeat and skip table rows (U = 9: rows 1, 2, 6, 7 unused; row 4 has its
# gate off, since make_case turns off every third teacher's gate).
REPEAT_SKIP = torch.tensor([8, 8, 0, 4, 3, 3, 8, 5, 0, 5, 4, 8, 0, 5])
COMPACT = [(1000, 128), (4099, 4096), (4096, 1024), (777, 65536)]


@pytest.mark.parametrize("teacher_dtype", [torch.bfloat16, torch.float32],
                         ids=["bf16-table", "fp32-table"])
@pytest.mark.parametrize("Vd,block", COMPACT, ids=[f"Vd{v}-block{b}" for v, b in COMPACT])
def test_compact_table_kernels_match_torch(Vd, block, teacher_dtype, monkeypatch):
    """Kernels (teacher probabilities from logits + lse in registers) == the torch path
    (probabilities of the gathered rows): per-row outputs, loss sums, counts,
    acceptance and logits gradients, for Vd a multiple of the block or not, with
    repeated and skipped table rows; the same comparisons catch a swapped lse."""
    monkeypatch.setattr(soft_ce_module, "INTERPRETER_BLOCK_V", block)
    case = make_case(len(REPEAT_SKIP), Vd, seed=7, teacher_dtype=teacher_dtype,
                     table_rows=REPEAT_SKIP)
    assert case.table.logits.dtype == teacher_dtype and case.table.num_positions == 9
    gate = case.table.gate[REPEAT_SKIP]
    assert 0 < gate.sum() < len(REPEAT_SKIP)
    for mask in (None, case.row_mask):
        assert_rows_match(run_rows(indexed_soft_ce, case, case.logits, row_mask=mask),
                          run_rows(indexed_soft_ce_naive, case, case.logits, row_mask=mask),
                          tol_out=FP32_LOSS, tol_grad=FP32_GRAD)
        got = run_step(case, case.logits, "triton", row_mask=mask)
        want = run_step(case, case.logits, "torch", row_mask=mask)
        assert_steps_match(got, want, tol_loss=FP32_LOSS, tol_grad=FP32_GRAD)
        assert 0 < want[0].correct < want[0].rows and want[0].accept_sum > 0
    # Negative control: the kernels read lse_full where lse_draft belongs.
    t = case.table
    swapped = dataclasses.replace(case, table=dataclasses.replace(t, lse_draft=t.lse_full))
    with pytest.raises(AssertionError):
        assert_steps_match(run_step(swapped, case.logits, "triton"),
                           run_step(case, case.logits, "torch"),
                           tol_loss=FP32_LOSS, tol_grad=FP32_GRAD)
    with pytest.raises(AssertionError):
        assert_rows_match(run_rows(indexed_soft_ce, swapped, case.logits),
                          run_rows(indexed_soft_ce_naive, case, case.logits),
                          tol_out=FP32_LOSS, tol_grad=FP32_GRAD)


class _Outputs(TorchDispatchMode):
    """Records ``(shape, dtype)`` of every op output."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.seen.add((tuple(t.shape), t.dtype))
        return out


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_loss_paths_never_build_dense_teacher_probabilities(impl):
    """Neither path (forward, backward, with the acceptance gradient too) allocates an
    fp32 ``[U, Vd]``: the torch one works on the ``[N, Vd]`` rows, the kernels in
    registers."""
    N, Vd = 5, 1000
    case = make_case(N, Vd, teacher_dtype=torch.bfloat16)
    dense = ((case.table.num_positions, Vd), torch.float32)
    assert case.table.num_positions != N
    with _Outputs() as rec:
        for accept_grad in (False, True):
            run_step(case, case.logits, impl, row_mask=case.row_mask, accept_grad=accept_grad)
    assert ((N, Vd), torch.float32) in rec.seen  # the recorder sees the step's tensors
    assert dense not in rec.seen
    with _Outputs() as rec:  # negative control: the dense property does build it
        case.table.probs
    assert dense in rec.seen
