"""The training objective on the held-out conversations (no grad), pooled over batches."""

from __future__ import annotations

import torch

from eagle3fn.align import supervised_mask
from eagle3fn.parallel import Layout, all_reduce, collectives, shard_sequence
from eagle3fn.rowmap import build_rowmap
from eagle3fn.train.sources import Source
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
        features, loss_mask = source.load(item)
        supervised = supervised_mask(loss_mask, features.attention_mask, positions=features.positions)
        if layout is not None and layout.sp > 1:
            features, supervised, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank, k)
            rowmap = build_rowmap(supervised, k, num_rows=C)
            coll = collectives(layout, rowmap.denominator, features.input_ids.device, config.attention,
                               kernel_options=config.flex_kernel_options,
                               compile_elementwise=config.compile_elementwise)
            obj = ttt(params, features, rowmap, config, d2t=d2t, t2d=t2d, collectives=coll)
            n = all_reduce(torch.tensor([r.numel() for r in rowmap.rows], dtype=torch.float64))
            denominator = float(coll.denominator)
        else:
            rowmap = build_rowmap(supervised, k, positions=features.positions)
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
