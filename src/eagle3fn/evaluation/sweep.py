"""Speculative decoding over a grid of k (draft tokens per round) and batch sizes.

For each batch size ``b`` and each ``k`` the prompts are decoded in batches of ``b`` by
speculative decoding (``generation.generate``) and by the target alone (the speedup's
denominator, timed again beside every ``k``), batch by batch in alternating order
(``timing.interleaved``: a drift in the machine's speed shifts both sides alike), after
one untimed warm-up of each on the batch with the longest prompt (``timing.widest``: CUDA
context, allocator blocks and graph recordings, at the largest cache a batch needs, are
not charged to any timed batch). The target alone runs on the
decoding path of the implementation (``target_generate(impl=...)``: with ``"graph"``, the
default on CUDA, a static cache and CUDA graphs on both sides). Both sides keep their
recorded graphs across batches (a ``decoding.GraphPool`` each, columns rounded up to its
``COLUMN_ALIGN``; the draft's emptied after each configuration, the target's after each
batch size): each shape is recorded once, as a server records at start-up, not once per
batch. Greedy outputs are held to the target alone's
(``identity.check_identity``) in every configuration.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from eagle3fn.decoding.cpu_linear import choice_record, few_rows
from eagle3fn.decoding.pool import GraphPool
from eagle3fn.evaluation.baseline import target_generate
from eagle3fn.evaluation.config import SpecConfig
from eagle3fn.evaluation.generation import default_impl, generate
from eagle3fn.evaluation.identity import check_identity
from eagle3fn.evaluation.results import acceptance_stats
from eagle3fn.evaluation.timing import interleaved, widest


def implied_acceptance_length(acc: Sequence[float], k: int) -> float:
    """``1 + sum_{j<k} prod_{i<=j} acc_i``: the acceptance length of a chain of ``k``
    draft tokens if draft token ``j + 1`` were accepted with probability ``acc_j``
    (the training-time per-step top-1 agreement), independently of the others."""
    out, run = 1.0, 1.0
    for a in list(acc)[:k]:
        run *= float(a)
        out += run
    return out


def sweep(target, draft_params: dict[str, torch.Tensor], draft_cfg, d2t: torch.Tensor,
          prompts: Sequence[torch.Tensor], *, ks: Sequence[int], batch_sizes: Sequence[int],
          max_new_tokens: int, temperature: float = 0.0, seed: int = 0, tokenizer=None,
          impl: str | None = None, warmup: bool = True, log: Callable[[str], None] = print,
          on_row: Callable[[list[dict]], None] | None = None) -> dict:
    """Acceptance and speedup for every ``(batch size, k)``.

    Args:
        target: ``io.target.load_target``'s model; draft_params (embed included),
            draft_cfg, d2t: the draft, as ``generation.generate`` takes them.
        prompts: int64 ``[L_i]`` or ``[1, L_i]`` each.
        ks, batch_sizes: the grid (each >= 1).
        impl: ``generation.generate``'s implementation, the target alone's path too
            (None: ``generation.default_impl``).
        on_row: called with the rows so far after each configuration (the CLI writes its
            JSON there, so a sweep stopped by a time limit keeps what it measured).

    Returns ``{"rows": [...], "best": {b: row}, "cpu_linear": ...}``; each row has
    ``batch_size``, ``k``, ``acceptance_length``, ``per_position_acceptance`` (k floats), ``rounds``,
    ``tokens``, ``seconds``, ``tokens_per_s``, ``target_seconds`` and ``target_tokens_per_s``
    (the target alone, timed beside this k), ``speedup``, ``impl`` and
    (greedy) ``identical`` / ``near_ties``; ``best[b]`` is the row of the fastest k;
    ``cpu_linear``: what ``decoding.cpu_linear.few_rows`` measured and chose for both
    sides' linear layers over the whole grid (on a CPU; ``form`` ``"linear"`` elsewhere).
    """
    device = target.lm_head.weight.device
    impl = default_impl(target, draft_params) if impl is None else impl
    prompts = [p.reshape(-1).to(device) for p in prompts]
    rows, best = [], {}
    spec_pool, alone_pool = GraphPool(), GraphPool()  # each side records once per shape, as a server
    with few_rows(target.model, max(batch_sizes) * (max(ks) + 1)) as linear_form:
        for b in batch_sizes:
            batches = [prompts[i:i + b] for i in range(0, len(prompts), b)]
            base_cfg = SpecConfig(num_draft_tokens=1, max_new_tokens=max_new_tokens,
                                  temperature=temperature, seed=seed)
            alone_run = lambda batch: target_generate(target, tokenizer, batch, base_cfg, impl=impl,  # noqa: E731
                                                      pool=alone_pool)
            warm = widest(batches)
            if warmup:
                alone_run(warm)
            for k in ks:
                cfg = SpecConfig(num_draft_tokens=k, max_new_tokens=max_new_tokens,
                                 temperature=temperature, seed=seed)
                run = lambda batch: generate(target, tokenizer, draft_params, draft_cfg, d2t, batch, cfg,  # noqa: E731
                                             impl=impl, pool=spec_pool)
                if warmup:
                    run(warm)
                (results, alone), (seconds, alone_s) = interleaved((run, alone_run), batches, device, warmup=False)
                spec_pool.clear()
                alone_tps = sum(map(len, alone)) / alone_s
                counts = [n for r in results for n in r.accepted_per_round]
                length, per_position = acceptance_stats(counts, k)
                tokens = sum(len(r.tokens) for r in results)
                row = {"batch_size": b, "k": k, "acceptance_length": length,
                       "per_position_acceptance": per_position, "rounds": len(counts), "tokens": tokens,
                       "seconds": seconds, "tokens_per_s": tokens / seconds,
                       "target_seconds": alone_s, "target_tokens_per_s": alone_tps,
                       "speedup": tokens / seconds / alone_tps, "impl": impl}
                if temperature == 0:
                    report = check_identity(target.model, prompts, alone, [r.tokens for r in results])
                    row.update(identical=report.identical, near_ties=len(report.near_ties),
                               identity=report.line())
                rows.append(row)
                log(f"  batch {b:>3} k {k}: acceptance length {length:.2f}, {row['tokens_per_s']:.1f} tokens/s, "
                    f"target alone {alone_tps:.1f}: speedup {row['speedup']:.2f}x"
                    + (f"; {row['identity']}" if "identity" in row else ""))
                if on_row is not None:
                    on_row(rows)
            alone_pool.clear()  # no later configuration reuses these shapes: their memory goes now
            best[b] = max((r for r in rows if r["batch_size"] == b), key=lambda r: r["speedup"])
    return {"rows": rows, "best": best, "cpu_linear": choice_record(linear_form)}
