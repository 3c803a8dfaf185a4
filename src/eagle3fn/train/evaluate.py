"""On the held-out conversations, with no grad: the training objective pooled over
batches (``evaluate_holdout``), and the acceptance length of real speculative decoding
of their prompts (``holdout_acceptance``)."""

from __future__ import annotations

import torch

from eagle3fn.evaluation import SpecConfig, acceptance_stats, generate
from eagle3fn.parallel import Layout, all_reduce, collectives, shard_sequence
from eagle3fn.rowmap import build_rowmap
from eagle3fn.train.sources import Source, batch_rowmap, device_supervised
from eagle3fn.unrolled import TTTConfig, ttt


@torch.no_grad()
def evaluate_holdout(params: dict[str, torch.Tensor], source: Source, config: TTTConfig, *,
                     d2t: torch.Tensor, t2d: torch.Tensor, layout: Layout | None = None) -> dict:
    """The training objective and metrics on held-out batches, with no grad.

    Batches are pooled: ``loss`` and ``kl`` weighted by each batch's ``B*C`` (the
    local_mean divisor), ``acc`` and ``accept`` by each step's rows; ``tau`` is
    ``1 + sum_j prod_{i<=j} acc_i`` of the pooled acc. Returns floats and k-lists.

    With a sequence-parallel ``layout`` (``sp > 1``) every batch is evaluated in the
    run's layout: each rank computes its own chunk (``C`` rows + the ``k`` tail), the
    sums reduced over the ranks, so no rank holds the whole length (every data-parallel
    group evaluates every batch; the pooled values are the one-rank ones).
    """
    k = config.ttt_length
    loss, weight = 0.0, 0
    kl, acc, accept, rows = (torch.zeros(k, dtype=torch.float64) for _ in range(4))
    for item in source.items:
        features, masks = source.load(item)
        if layout is not None and layout.sp > 1:
            supervised = device_supervised(features, masks)
            features, supervised, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank, k)
            rowmap = build_rowmap(supervised, k, num_rows=C)
            coll = collectives(layout, rowmap.denominator, features.input_ids.device, config.attention,
                               kernel_options=config.flex_kernel_options,
                               compile_elementwise=config.compile_elementwise)
            obj = ttt(params, features, rowmap, config, d2t=d2t, t2d=t2d, collectives=coll)
            n = all_reduce(torch.tensor([r.numel() for r in rowmap.rows], dtype=torch.float64))
            denominator = float(coll.denominator)
        else:
            rowmap = batch_rowmap(features, masks, k)
            obj = ttt(params, features, rowmap, config, d2t=d2t, t2d=t2d)
            n = torch.tensor([r.numel() for r in rowmap.rows], dtype=torch.float64)
            denominator = rowmap.denominator
        loss += float(obj.objective) * denominator
        kl += obj.kl_loss.double().cpu() * denominator
        acc += obj.acc.double().cpu() * n
        accept += obj.accept.double().cpu() * n
        weight, rows = weight + denominator, rows + n
    acc, accept = acc / rows.clamp(min=1), accept / rows.clamp(min=1)
    as_list = lambda t: [round(float(x), 6) for x in t]  # noqa: E731
    return {"loss": loss / weight, "kl": as_list(kl / weight), "acc": as_list(acc),
            "accept": as_list(accept), "tau": float(1 + torch.cumprod(acc, 0).sum())}


@torch.no_grad()
def holdout_acceptance(target, params: dict[str, torch.Tensor], draft_cfg, d2t: torch.Tensor,
                       prompts: list[list[int]], *, num_draft_tokens: int, max_new_tokens: int) -> dict:
    """Acceptance length of greedy speculative decoding (``evaluation.generate``, KV
    caches, all prompts in one batch) of ``prompts`` (token id lists) with the draft
    ``params`` (the whole dict, embedding included) and the target.

    Returns ``acceptance_length`` (mean of ``accepted + 1`` over every round of every
    prompt), ``per_position_acceptance`` (``num_draft_tokens`` floats) and
    ``accept_tokens`` (new tokens decoded).
    """
    device = target.lm_head.weight.device
    results = generate(target, None, params, draft_cfg, d2t,
                       [torch.tensor(p, dtype=torch.long, device=device) for p in prompts],
                       SpecConfig(num_draft_tokens=num_draft_tokens, max_new_tokens=max_new_tokens))
    length, per_position = acceptance_stats([n for r in results for n in r.accepted_per_round],
                                            num_draft_tokens)
    return {"acceptance_length": length, "per_position_acceptance": [round(a, 6) for a in per_position],
            "accept_tokens": sum(len(r.tokens) for r in results)}
