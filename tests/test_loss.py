"""Trimmed loss end == dense full-length oracle (SPEC sections 5, 6, 8), and SpecForge."""

import dataclasses

import pytest
import torch

from eagle3fn.align import supervised_mask
from eagle3fn.check import max_rel_errors, random_case, trimmed_objective
from eagle3fn.loss import LossConfig, soft_cross_entropy, step_terms
from eagle3fn.reference import reference_objective
from eagle3fn.rowmap import build_rowmap
from eagle3fn.teacher import teacher_table_from_logits

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: 2 threads crawl on a busy CPU

K = 7
S = 16
FAMILIES = ["all", "random30", "tail", "single", "last_k", "empty"]


def loss_mask_for(family, attention, seed):
    B, S_ = attention.shape
    lengths = attention.sum(1)
    pos = torch.arange(S_)[None, :]
    g = torch.Generator().manual_seed(seed)
    if family == "all":
        m = torch.ones(B, S_, dtype=torch.bool)
    elif family == "random30":
        m = torch.rand(B, S_, generator=g) < 0.3
    elif family == "tail":
        m = pos >= (lengths[:, None] * 0.6).long()
    elif family == "single":
        m = pos == (lengths[:, None] // 2)
    elif family == "last_k":
        m = pos >= (lengths[:, None] - K)
    else:
        m = torch.zeros(B, S_, dtype=torch.bool)
    return m & attention


def make_case(family, B, dtype=torch.float64, seed=0):
    c = random_case(batch=B, seq_len=S, vocab=48, draft_vocab=20, ttt_length=K,
                    density=0.3, seed=seed, dtype=dtype)
    return dataclasses.replace(c, loss_mask=loss_mask_for(family, c.attention_mask, seed))


def run(fn, case, config, **kw):
    logits = [x.clone().requires_grad_(True) for x in case.step_logits]
    out = fn(logits, case.target_logits, case.loss_mask, case.t2d, case.d2t,
             attention_mask_BS=case.attention_mask, config=config, **kw)
    out.objective.backward()
    return out, [x.grad for x in logits]


def assert_equivalent(got, want, rtol_loss, rtol_grad):
    """Every Objective field and every step-logit gradient, max-abs over max-abs."""
    (obj_g, grads_g), (obj_w, grads_w) = got, want
    errors = max_rel_errors(obj_g, obj_w)
    bad = {k: v for k, v in errors.items() if not v <= rtol_loss}
    assert not bad, f"objective fields differ: {bad}"
    for j, (g, w) in enumerate(zip(grads_g, grads_w)):
        err = ((g - w).abs().max() / w.abs().max().clamp_min(1e-300)).item()
        assert err <= rtol_grad, f"step {j} gradient differs by {err:.3g}"


CONFIGS = [
    LossConfig(),
    LossConfig(normalization="token_mean"),
    LossConfig(objective="alpha"),
    LossConfig(objective="lambda", kl_scale=0.7, kl_decay=2.0),
    LossConfig(objective="lambda", normalization="token_mean", step_weight_decay=1.0),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.objective}-{c.normalization}")
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_trimmed_equals_dense_fp64(family, B, config):
    case = make_case(family, B)
    want = run(reference_objective, case, config)
    got = run(trimmed_objective, case, config)
    assert_equivalent(got, want, 1e-12, 1e-12)


@pytest.mark.parametrize("family", ["all", "random30", "tail", "single", "last_k"])
def test_negative_control_unshifted_rows_is_caught(family):
    """Rows that stay at s instead of moving to s - j fail the same comparison."""
    case = make_case(family, 3)
    mask = supervised_mask(case.loss_mask, case.attention_mask)
    rm = build_rowmap(mask, K)
    unshifted = dataclasses.replace(
        rm, rows=(rm.rows[0],) * K, table_rows=(rm.table_rows[0],) * K
    )
    want = run(reference_objective, case, LossConfig())
    with pytest.raises(AssertionError):
        assert_equivalent(run(trimmed_objective, case, LossConfig(), rowmap=unshifted),
                          want, 1e-12, 1e-12)


def test_negative_control_wrong_denominator_is_caught():
    case = make_case("random30", 3)
    rm = build_rowmap(supervised_mask(case.loss_mask, case.attention_mask), K)
    want = run(reference_objective, case, LossConfig())
    with pytest.raises(AssertionError):
        per_sample = dataclasses.replace(rm, denominator=rm.denominator // 3)
        assert_equivalent(run(trimmed_objective, case, LossConfig(), rowmap=per_sample),
                          want, 1e-12, 1e-12)


def test_dead_steps_are_exact_zeros():
    case = make_case("single", 1)
    lm = torch.zeros_like(case.loss_mask)
    lm[0, 0] = True  # only position 0: steps >= 1 have no rows
    case = dataclasses.replace(case, loss_mask=lm)
    rm = build_rowmap(supervised_mask(case.loss_mask, case.attention_mask), K)
    assert rm.dead_steps == (False,) + (True,) * (K - 1)
    for config in CONFIGS:
        got = run(trimmed_objective, case, config)
        assert_equivalent(got, run(reference_objective, case, config), 1e-12, 1e-12)
        assert torch.all(got[0].kl_loss[1:] == 0) and torch.all(got[0].acc[1:] == 0)


@pytest.mark.parametrize("family", ["all", "random30", "tail"])
def test_fp32_within_spec_tolerance(family):
    """SPEC section 8 fp32 line: loss 1e-6, gradients 1e-5, against the fp64 oracle."""
    case64 = make_case(family, 3)
    case32 = dataclasses.replace(
        case64,
        step_logits=[x.float() for x in case64.step_logits],
        target_logits=case64.target_logits.float(),
    )
    want = run(reference_objective, case64, LossConfig())
    obj, grads = run(trimmed_objective, case32, LossConfig())
    errors = max_rel_errors(obj, want[0])
    assert max(errors["objective"], errors["kl_loss"], errors["accept"]) <= 1e-6, errors
    assert errors["acc"] <= 1e-7  # the same counts, divided in fp32
    assert_equivalent((want[0], [g.double() for g in grads]), want, 1, 1e-5)


def test_soft_cross_entropy_edges():
    case = make_case("random30", 1)
    table = teacher_table_from_logits(case.target_logits[0], case.t2d)
    empty = torch.zeros(0, 20, dtype=torch.float64, requires_grad=True)
    rows = torch.zeros(0, dtype=torch.long)
    out = soft_cross_entropy(empty, table, rows)
    out.backward()
    assert out.item() == 0 and empty.grad.shape == (0, 20)
    terms = step_terms(empty, table, rows, case.d2t)
    assert terms.rows.item() == 0 and terms.gated.item() == 0
    with pytest.raises(ValueError, match="21 draft-vocab columns but the teacher table has 20"):
        soft_cross_entropy(torch.zeros(2, 21), table, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[N, Vd\]"):
        soft_cross_entropy(torch.zeros(2, 20), table, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="impl"):
        soft_cross_entropy(torch.zeros(2, 20), table, torch.zeros(2, dtype=torch.long),
                           impl="cuda")
    with pytest.raises(ValueError, match="normalization"):
        LossConfig(normalization="mean")


def test_bf16_logits_use_fp32_math():
    case = make_case("random30", 1)
    table = teacher_table_from_logits(case.target_logits[0].float(), case.t2d)
    rows = torch.arange(S)
    x = case.step_logits[0][0]
    got = soft_cross_entropy(x.bfloat16(), table, rows)
    want = soft_cross_entropy(x.bfloat16().float(), table, rows)
    assert got.dtype == torch.float32 and got.item() == want.item()


# ---- SpecForge 0.2.0 as an external oracle -------------------------------------------


def specforge_steps(case, config):
    """Per-step loss / accept / acc from SpecForge's own functions, driven by the
    shift-per-step loop of its OnlineEagle3Model (padded teacher sliced at j)."""
    pytest.importorskip("specforge")
    with torch._dynamo.config.patch(disable=True):  # its formulas, run eagerly
        return _specforge_steps(case, config)


def _specforge_steps(case, config):
    from specforge.algorithms.eagle3 import model as sf
    from specforge.utils import padding

    B, S_, _ = case.target_logits.shape
    sup = supervised_mask(case.loss_mask, case.attention_mask)  # loss_mask[L-1] = 0
    shifted = padding(case.target_logits.float(), left=False)
    loss_mask = sup[..., None].int()
    tp, tpod, tok, pmask = sf._compute_target_p_padded(shifted, case.t2d, loss_mask, K)
    out = {"kl": [], "loss": [], "accept": [], "acc": [], "grads": []}
    for j in range(K):
        logits = case.step_logits[j].float().clone().requires_grad_(True)
        accept, loss = sf._compute_loss_and_acceptance_rate(
            logits=logits.clone(), target_p=tp[:, j : j + S_], target_p_on_draft=tpod[:, j : j + S_],
            position_mask=pmask, lk_loss_type=None if config.objective == "kl" else config.objective,
            kl_scale=config.kl_scale, kl_decay=config.kl_decay,
        )
        correct, denom = sf._compute_metric_counts(logits.detach(), tok[:, j : j + S_], loss_mask, case.d2t)
        loss.backward()
        out["loss"].append(loss.item())
        out["accept"].append(accept.item())
        out["acc"].append((correct / denom).item())
        out["grads"].append(logits.grad)
        pmask, loss_mask = padding(pmask, left=False), padding(loss_mask, left=False)
    return out


@pytest.mark.parametrize("config", [LossConfig(), LossConfig(objective="alpha"),
                                    LossConfig(objective="lambda", kl_scale=0.7, kl_decay=2.0)],
                         ids=lambda c: c.objective)
@pytest.mark.parametrize("family", ["random30", "last_k"])
def test_specforge_formulas_agree(family, config):
    case = make_case(family, 3, dtype=torch.float32, seed=4)
    sf = specforge_steps(case, config)
    logits = [x.float().clone().requires_grad_(True) for x in case.step_logits]
    ours = trimmed_objective(logits, case.target_logits.float(), case.loss_mask, case.t2d,
                             case.d2t, attention_mask_BS=case.attention_mask, config=config)
    torch.autograd.backward(list(ours.step_loss), [torch.ones(())] * K)
    torch.testing.assert_close(ours.step_loss, torch.tensor(sf["loss"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.accept, torch.tensor(sf["accept"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.acc, torch.tensor(sf["acc"]), rtol=1e-5, atol=1e-6)
    for j in range(K):
        torch.testing.assert_close(logits[j].grad, sf["grads"][j], rtol=1e-4, atol=1e-7)
    # Negative control: our per-step losses against SpecForge's one step off differ.
    assert not torch.allclose(ours.step_loss[1:], torch.tensor(sf["loss"][:-1]), rtol=1e-3)
