"""Naive dense full-length oracle of the TTT objective: the truth tests compare against.

Legend: B batch, S padded length, V target vocab, Vd draft vocab, k TTT length.

Deliberately written the way the reference trainers (EAGLE, SpecForge) compute it and
independent of ``rowmap``/``teacher``/``loss``: the teacher at *every* position,
padded by k and sliced ``[:, j : j + S]`` at step j, masks shifted one position left
per step, every row's loss computed and multiplied by its mask, ``local_mean`` over
``B*S``. Slow and memory-hungry on purpose; nothing here is trimmed.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from eagle3fn.loss import LossConfig
from eagle3fn.shapes import Objective


def reference_supervised_mask(loss_mask_BS: torch.Tensor, lengths_B: Sequence[int],
                              alignment: str = "eagle") -> torch.Tensor:
    """SPEC section 1 by brute force: bool ``[B, S]``, loops over every position."""
    B, S = loss_mask_BS.shape
    m = loss_mask_BS.bool().tolist()
    sup = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        L = int(lengths_B[b])
        for t in range(S):
            if alignment == "eagle":
                sup[b, t] = m[b][t] and t <= L - 2
            else:
                sup[b, t] = t + 2 <= L - 1 and m[b][t + 2]
    return sup.to(loss_mask_BS.device)


def _shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:, t + n]`` at ``t``, zeros past the end, by padding then slicing."""
    pad = [0, 0] * (x.dim() - 2) + [0, n]
    return F.pad(x, pad)[:, n : n + x.shape[1]]


def reference_objective(
    step_logits: Sequence[torch.Tensor],
    target_logits_BSV: torch.Tensor,
    loss_mask_BS: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    *,
    attention_mask_BS: torch.Tensor | None = None,
    alignment: str = "eagle",
    config: LossConfig = LossConfig(),
) -> Objective:
    """Dense per-step objective and metrics from full-length per-step draft logits.

    Args:
        step_logits: k tensors ``[B, S, Vd]``, the draft's logits at every row at step j.
        target_logits_BSV: ``[B, S, V]`` target logits ``z`` (unshifted: ``z[t]``
            predicts ``x_{t+1}``).
        loss_mask_BS: ``[B, S]`` chat loss mask ``m`` (unshifted).
        t2d, d2t: the vocab map.
        attention_mask_BS: right-padded validity ``[B, S]`` (None: no padding).
        alignment, config: as ``align.supervised_mask`` and ``loss.LossConfig``.
    """
    B, S, _ = target_logits_BSV.shape
    k = len(step_logits)
    lengths = [S] * B if attention_mask_BS is None else attention_mask_BS.sum(1).tolist()
    sup = reference_supervised_mask(loss_mask_BS, lengths, alignment)

    dtype = torch.promote_types(target_logits_BSV.dtype, torch.float32)
    z_shifted = _shift(target_logits_BSV.to(dtype), 1)  # z'[t] = z[t+1]
    zd = z_shifted[..., t2d]
    target_p = torch.softmax(zd, dim=-1)
    target_p_on_draft = torch.exp(zd - torch.logsumexp(z_shifted, dim=-1, keepdim=True))
    target_token = z_shifted.argmax(dim=-1)
    position_mask = sup & t2d[target_token]
    padded = lambda x: F.pad(x, [0, 0] * (x.dim() - 2) + [0, k])  # noqa: E731
    target_p, target_p_on_draft, target_token = map(
        padded, (target_p, target_p_on_draft, target_token)
    )

    losses, accs, accepts, alphas = [], [], [], []
    loss_mask, pmask = sup, position_mask
    for j in range(k):
        logits = step_logits[j].to(torch.promote_types(step_logits[j].dtype, torch.float32))
        p_j = target_p[:, j : j + S]
        pod_j = target_p_on_draft[:, j : j + S]
        tok_j = target_token[:, j : j + S]
        w = pmask.to(logits.dtype)
        row_loss = -(p_j * F.log_softmax(logits, dim=-1)).sum(-1)
        denom = B * S if config.normalization == "local_mean" else max(w.sum().item(), 1)
        losses.append((row_loss * w).sum() / denom)

        pred = logits.argmax(-1)
        correct = ((pred + d2t[pred] == tok_j) & loss_mask).sum()
        accs.append(correct.to(logits.dtype) / max(loss_mask.sum().item(), 1))

        a = torch.minimum(pod_j, torch.softmax(logits, dim=-1)).sum(-1)
        accepts.append((a * w).sum() / max(w.sum().item(), 1))
        log_a = torch.log(torch.where(pmask & (a > 0), a, 1.0))
        alphas.append(-log_a.sum() / max(w.sum().item(), 1))

        loss_mask, pmask = _shift(loss_mask, 1), _shift(pmask, 1)

    return _objective_of_steps(losses, accs, accepts, alphas, config)


def _objective_of_steps(losses: list[torch.Tensor], accs: list[torch.Tensor], accepts: list[torch.Tensor],
                        alphas: list[torch.Tensor], config: LossConfig) -> Objective:
    """The ``Objective`` of k steps' scalar terms (one list entry per step j): the KL
    losses, accuracies, expected acceptances and ``-log`` acceptances. Each step's loss
    is ``config.objective``'s (``kl``, ``alpha``, or the acceptance-weighted mix of KL
    and ``1 - accept``), the objective their sum weighted by ``step_weight_decay ** j``,
    and ``tau = 1 + sum_j prod_{i <= j} acc_i``; every field ``[k]`` but the scalars."""
    k = len(losses)
    kl = torch.stack(losses)
    accept = torch.stack(accepts)
    if config.objective == "kl":
        step_loss = kl
    elif config.objective == "alpha":
        step_loss = torch.stack(alphas)
    else:
        w = config.kl_scale * torch.exp(-config.kl_decay * accept.detach())
        step_loss = w * kl + (1 - w) * (1 - accept)
    acc = torch.stack(accs)
    tau = 1 + sum(torch.prod(acc[: j + 1]) for j in range(k))
    weights = torch.tensor([config.step_weight_decay ** j for j in range(k)], dtype=kl.dtype)
    return Objective(
        objective=(weights * step_loss).sum(),
        step_loss=step_loss,
        kl_loss=kl,
        acc=acc,
        accept=accept,
        tau=tau,
    )
