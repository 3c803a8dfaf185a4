"""The trimmed loss end composed from the stages, and its comparison with the oracle.

Legend: B batch, S padded length, V target vocab, Vd draft vocab, k TTT length.

``trimmed_objective`` runs the data flow of the loss end exactly as the trainer does
(alignment -> row map -> teacher table at U positions -> per-step terms on the
rows of each step -> objective), but takes full-length per-step draft logits so it
can be compared with ``reference.reference_objective`` on the same inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import torch

from eagle3fn.align import MaskAlignment, shift_left, supervised_mask
from eagle3fn.loss import LossConfig, objective, step_terms
from eagle3fn.reference import reference_objective
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Objective, RowMap
from eagle3fn.teacher import teacher_table_from_logits
from eagle3fn.vocab import build_vocab_map


def trimmed_objective(
    step_logits: Sequence[torch.Tensor],
    target_logits_BSV: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    *,
    attention_mask_BS: torch.Tensor | None = None,
    alignment: MaskAlignment = "eagle",
    config: LossConfig = LossConfig(),
    rowmap: RowMap | None = None,
) -> Objective:
    """The objective computed only at the supervised rows of each step.

    Arguments as ``reference.reference_objective``; only ``step_logits[j]`` at
    ``rowmap.rows[j]`` and the target logits at ``rowmap.teacher_positions`` are read.
    ``rowmap`` overrides the one built from the mask (tests use it for negative
    controls).
    """
    if rowmap is None:
        mask = supervised_mask(loss_mask_BS, attention_mask_BS, alignment=alignment)
        rowmap = build_rowmap(mask, len(step_logits))
    z_shifted = shift_left(target_logits_BSV, 1).flatten(0, 1)
    table = teacher_table_from_logits(z_shifted[rowmap.teacher_positions], t2d)
    terms = [
        step_terms(
            logits.flatten(0, 1)[rows], table, table_rows, d2t,
            accept_grad=config.objective != "kl",
        )
        for logits, rows, table_rows in zip(step_logits, rowmap.rows, rowmap.table_rows)
    ]
    return objective(terms, rowmap.denominator, config)


def max_rel_errors(got: Objective, want: Objective) -> dict[str, float]:
    """``max|got - want| / max(max|want|, tiny)`` for every field of two Objectives."""
    out = {}
    for f in fields(Objective):
        g, w = getattr(got, f.name).double(), getattr(want, f.name).double()
        scale = w.abs().max().clamp_min(1e-300)
        out[f.name] = ((g - w).abs().max() / scale).item()
    return out


@dataclass(frozen=True)
class RandomCase:
    """Random inputs for the loss end: see ``random_case``."""

    step_logits: list[torch.Tensor]
    target_logits: torch.Tensor
    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    t2d: torch.Tensor
    d2t: torch.Tensor


def random_case(
    *,
    batch: int,
    seq_len: int,
    vocab: int,
    draft_vocab: int,
    ttt_length: int,
    density: float,
    seed: int,
    dtype: torch.dtype = torch.float64,
    pattern: str = "scattered",
) -> RandomCase:
    """A seeded batch: right-padded lengths, loss masks of the given ``density`` and
    ``pattern`` (``scattered`` at random or a contiguous ``tail``), target logits whose
    argmax usually lands in the draft vocab, full-length per-step draft logits."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, seq_len // 2), seq_len + 1, (batch,), generator=g)
    lengths[0] = seq_len
    pos = torch.arange(seq_len)[None, :]
    attention = pos < lengths[:, None]
    if pattern == "tail":
        loss_mask = pos >= (lengths[:, None] * (1 - density)).long()
    elif pattern == "scattered":
        loss_mask = torch.rand(batch, seq_len, generator=g) < density
    else:
        raise ValueError(f"pattern must be 'scattered' or 'tail', got {pattern!r}")
    loss_mask &= attention
    counts = torch.randint(0, 1000, (vocab,), generator=g)
    d2t, t2d = build_vocab_map(counts, draft_vocab)
    target = torch.randn(batch, seq_len, vocab, generator=g, dtype=dtype) * 3
    target[..., t2d] += 2.0  # the teacher's argmax mostly lands in the draft vocab
    # Step j's logits lean toward the teacher of row p + j, so acc and accept are
    # neither 0 nor 1.
    step_logits = [
        shift_left(target[..., t2d], j + 1) * 0.7
        + torch.randn(batch, seq_len, draft_vocab, generator=g, dtype=dtype) * 2
        for j in range(ttt_length)
    ]
    return RandomCase(step_logits, target, loss_mask, attention, t2d, d2t)


def compare_with_reference(case: RandomCase, config: LossConfig = LossConfig()) -> dict[str, float]:
    """Run the trimmed and the dense path on ``case``, backpropagate both, and return
    the max relative error of every Objective field and of the step-logit gradients
    (``grad``), plus the rows each path computed (``rows_trimmed``, ``rows_full``)."""
    results = []
    for fn in (trimmed_objective, reference_objective):
        logits = [x.clone().requires_grad_(True) for x in case.step_logits]
        out = fn(logits, case.target_logits, case.loss_mask, case.t2d, case.d2t,
                 attention_mask_BS=case.attention_mask, config=config)
        out.objective.backward()
        results.append((out, torch.stack([x.grad for x in logits])))
    (got, grad_got), (want, grad_want) = results
    errors = max_rel_errors(got, want)
    errors["grad"] = ((grad_got - grad_want).abs().max() / grad_want.abs().max().clamp_min(1e-300)).item()
    mask = supervised_mask(case.loss_mask, case.attention_mask)
    rowmap = build_rowmap(mask, len(case.step_logits))
    errors["rows_trimmed"] = float(sum(r.numel() for r in rowmap.rows))
    errors["rows_full"] = float(mask.numel() * len(case.step_logits))
    return errors


def compare_ttt(case: RandomCase, config: LossConfig = LossConfig(), *, hidden: int = 64,
                seed: int = 0) -> dict[str, float]:
    """The whole TTT, ``trim="loss"`` vs ``trim="none"``, on ``case``'s batch with a
    small random draft (hidden ``hidden``) and random aux features: max relative
    error of every Objective field and of every parameter gradient (``grad``)."""
    from eagle3fn.draft import DraftConfig, init_params
    from eagle3fn.shapes import Features
    from eagle3fn.unrolled import TTTConfig, ttt

    B, S, V = case.target_logits.shape
    dtype = case.target_logits.dtype
    g = torch.Generator().manual_seed(seed)
    draft = DraftConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_heads=4,
                        num_kv_heads=2, vocab_size=V, draft_vocab_size=int(case.t2d.sum()))
    params = init_params(draft, dtype=dtype, seed=seed)
    with torch.no_grad():  # away from the near-zero init so every path matters
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=g, dtype=dtype) * 0.2)
    features = Features(input_ids=torch.randint(0, V, (B, S), generator=g),
                        aux=torch.randn(B, S, 3 * hidden, generator=g, dtype=dtype),
                        attention_mask=case.attention_mask, target_logits=case.target_logits)
    rowmap = build_rowmap(supervised_mask(case.loss_mask, case.attention_mask), len(case.step_logits))
    results = []
    for trim in ("loss", "none"):
        ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
        out = ttt(ps, features, rowmap, TTTConfig(draft=draft, ttt_length=rowmap.ttt_length,
                                                  trim=trim, attention="eager", loss=config),
                  d2t=case.d2t, t2d=case.t2d)
        out.objective.backward()
        results.append((out, {n: p.grad for n, p in ps.items() if p.requires_grad}))
    (got, grads_got), (want, grads_want) = results
    errors = max_rel_errors(got, want)
    errors["grad"] = max(
        ((grads_got[n] - grads_want[n]).abs().max() / grads_want[n].abs().max().clamp_min(1e-300)).item()
        for n in grads_want
    )
    return errors
