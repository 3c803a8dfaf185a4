"""Speculative decoding of a batch of prompts with the target and the draft on KV
caches (``generate``), and the implementation chosen when none is named
(``default_impl``).

Legend: B prompts decoded together, L_i prompt lengths, V target vocab, Vd draft vocab.

Three implementations give the same tokens and accepted counts: ``"dynamic"``
(``dynamic``: tensors grown per round, every kernel launched from Python),
``"static"`` (``static``: the draft on fixed-shape buffers, on CUDA with greedy
decoding each round's draft work is two CUDA-graph replays) and ``"graph"``
(``graphed``; the default on CUDA: the target on a static cache too, its verifying
forward one CUDA-graph replay). Tests hold ``generate`` to ``model.generate`` and to
``twin.speculative_generate`` (greedy and sampled, token for token).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from eagle3fn.decoding.static_cache import check_full_attention
from eagle3fn.draft import DraftConfig
from eagle3fn.evaluation.config import GRAPH, IMPLS, SpecConfig, check_inputs, prompt_list
from eagle3fn.evaluation.dynamic import generate_dynamic
from eagle3fn.evaluation.graphed import generate_graphed
from eagle3fn.evaluation.results import SpecResult
from eagle3fn.evaluation.static import generate_static
from eagle3fn.evaluation.timing import Stage, StageTimes
from eagle3fn.io.target import TargetModel


def default_impl(target: TargetModel, draft_params: dict[str, torch.Tensor]) -> str:
    """``generate``'s implementation when none is named: ``"graph"`` when the target and
    the draft are on one CUDA device and every target layer attends fully (the static
    cache's condition), else ``"static"`` for a CUDA draft, else ``"dynamic"``."""
    device, draft_device = target.lm_head.weight.device, draft_params["fc.weight"].device
    if device.type == "cuda" and draft_device == device:
        try:
            check_full_attention(target.model.config)
            return GRAPH
        except ValueError:
            pass
    return "static" if draft_device.type == "cuda" else "dynamic"


@torch.no_grad()
def generate(target: TargetModel, tokenizer_or_none, draft_params: dict[str, torch.Tensor],
             draft_cfg: DraftConfig, d2t: torch.Tensor, prompts: Sequence[torch.Tensor],
             cfg: SpecConfig, *, impl: str | None = None,
             stages: StageTimes | None = None, pool=None) -> list[SpecResult]:
    """Speculative decoding of several prompts at once, the target and the draft on KV
    caches (``kv`` describes the slot layout): one ``SpecResult`` per prompt, each equal to
    ``twin.speculative_generate`` of that prompt alone.

    Greedy output equals ``target.model.generate(do_sample=False)`` of each prompt token
    for token; sampling follows the standard rule with prompt i drawing from its own
    generator seeded ``cfg.seed + i`` (so it equals ``twin.speculative_generate`` with that
    seed). Rows accept independently; a row that ends (EOS or ``max_new_tokens``) leaves
    the target's batch. One host sync per round (the accepted counts; sampling reads on
    the host).

    Args:
        target: from ``io.target.load_target`` (a text model whose forward takes
            ``past_key_values`` and ``position_ids``).
        tokenizer_or_none: only read for ``eos_token_id``.
        draft_params, draft_cfg, d2t: the draft (``init_params`` names, embed included)
            and its vocab map; any dtype, on any device.
        prompts: int64 ``[L_i]`` or ``[1, L_i]`` each, of any lengths.
        cfg: ``SpecConfig``.
        impl: ``"static"``: the draft on preallocated buffers of fixed shapes (its cache
            in doubling capacity, finished rows kept in place), so that on CUDA with
            greedy decoding each round's draft work is two CUDA-graph replays;
            ``"dynamic"``: the draft's cache grown by concatenation each round, finished
            rows removed, every kernel launched from Python. Both run the target on
            transformers' ``DynamicCache``. ``"graph"`` (``evaluation.graphed``): the
            target on a ``decoding.StaticKVCache`` of fixed shapes, its verifying
            forward (with acceptance and rollback when greedy) one CUDA-graph replay on
            CUDA, the draft as ``"static"``. All give the same tokens and accepted
            counts. None: ``default_impl``.
        stages: a ``StageTimes`` to fill (adds device syncs around every stage).
        pool: a ``decoding.GraphPool`` (``impl="graph"``, greedy): the buffers and
            recorded graphs of an earlier call of the same shapes are reused
            (``graphed.generate_graphed``); other implementations ignore it.
    """
    prompts = prompt_list(prompts)
    check_inputs(target, draft_cfg, d2t)
    if impl is None:
        impl = default_impl(target, draft_params)
    if impl not in IMPLS + (GRAPH,):
        raise ValueError(f"impl={impl!r} is not one of {IMPLS + (GRAPH,)}")
    stage = Stage(stages, target.lm_head.weight.device)
    t0 = time.perf_counter()
    if impl == GRAPH:
        results = generate_graphed(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage,
                                   pool=pool)
    else:
        run = {"static": generate_static, "dynamic": generate_dynamic}[impl]
        results = run(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage)
    if stages is not None:
        if stage.cuda:
            torch.cuda.synchronize(stage.device)
        stages.total_s += time.perf_counter() - t0
    return results

