"""The target alone, the baseline of the speedup: one token per cached forward, batched
and stopped as ``generate`` (left padding, explicit positions, rows leaving when done),
on transformers' ``DynamicCache`` or on ``impl="graph"``'s static cache.

Legend: B rows (finished ones leave the batch), S cache slots, V target vocab.

``kv.target_forward`` is read through its module at call time (a benchmark's timer put
in its place is the one run).
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagle3fn.evaluation import kv
from eagle3fn.evaluation.config import GRAPH, SpecConfig, eos_ids, prompt_list
from eagle3fn.evaluation.graphed import target_generate_graphed
from eagle3fn.evaluation.verify import picker
from eagle3fn.io.target import TargetModel


@torch.no_grad()
def target_generate(target: TargetModel, tokenizer_or_none, prompts: Sequence[torch.Tensor],
                    cfg: SpecConfig, *, impl: str | None = None, pool=None) -> list[list[int]]:
    """The target alone, one token per cached forward, batched and stopped as
    ``generate`` (left padding, explicit positions, rows leaving when done): the new
    tokens of each prompt. Greedy, or sampling at ``cfg.temperature`` with prompt i's
    generator seeded ``cfg.seed + i``; the baseline of the speedup, so it runs the
    same forward as ``generate`` without the aux hooks. ``impl="graph"``: on
    ``generate(impl="graph")``'s path instead (``graphed.target_generate_graphed``:
    a static cache, the decode step one CUDA-graph replay on CUDA); any other value or
    None: transformers' ``DynamicCache`` as ``"static"`` and ``"dynamic"`` run it.
    ``pool``: a ``decoding.GraphPool`` for ``impl="graph"`` (its decode step's state and
    graph reused across calls); ignored otherwise."""
    from transformers import DynamicCache

    if impl == GRAPH:
        return target_generate_graphed(target, tokenizer_or_none, prompts, cfg, pool=pool)
    prompts = prompt_list(prompts)
    device = target.lm_head.weight.device
    eos = eos_ids(target, tokenizer_or_none)
    generators = [torch.Generator().manual_seed(cfg.seed + i) for i in range(len(prompts))]
    pick = picker(cfg.temperature, generators)
    rows = list(range(len(prompts)))
    new: list[list[int]] = [[] for _ in rows]
    ids, valid, pos = kv.left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    _, logits = kv.target_forward(target, ids, valid, pos, cache, 1, aux=False)
    pos_t = pos[:, -1]
    one = torch.ones(len(rows), 1, dtype=torch.bool, device=device)
    while True:
        token = pick(logits[:, -1], rows)
        for r, t in zip(rows, token.tolist()):
            new[r].append(t)
        live = [i for i, r in enumerate(rows) if len(new[r]) < cfg.max_new_tokens and new[r][-1] not in eos]
        if not live:
            return new
        if len(live) < len(rows):
            index = torch.tensor(live, device=device)
            cache.batch_select_indices(index)
            rows, valid, pos_t, token = [rows[i] for i in live], valid[index], pos_t[index], token[index]
        pos_t = pos_t + 1
        valid = torch.cat((valid, one[:len(rows)]), 1)
        _, logits = kv.target_forward(target, token[:, None], valid, pos_t[:, None], cache, 1, aux=False)
