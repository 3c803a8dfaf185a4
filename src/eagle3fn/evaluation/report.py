"""The report of a draft: speculative decoding of every prompt timed beside the target
alone on the same batches (``evaluate``), and the training-time objective on the
generated text (``simulated_tau``).

Legend: B prompts, L_i prompt lengths, T_i prompt + generated lengths, k draft tokens
per round, V target vocab, Vd draft vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from eagle3fn.align import supervised_mask
from eagle3fn.decoding.cpu_linear import choice_record, few_rows
from eagle3fn.decoding.pool import GraphPool
from eagle3fn.draft import DraftConfig
from eagle3fn.evaluation.baseline import target_generate
from eagle3fn.evaluation.config import SpecConfig, prompt_list
from eagle3fn.evaluation.generation import default_impl, generate
from eagle3fn.evaluation.identity import check_identity
from eagle3fn.evaluation.results import acceptance_stats
from eagle3fn.evaluation.timing import interleaved
from eagle3fn.io.target import TargetModel, target_features
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Objective
from eagle3fn.unrolled import TTTConfig, ttt


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool ``[V]``: the target ids in the draft vocab (``i + d2t[i]`` for every draft id i)."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[d2t.long() + torch.arange(d2t.shape[0], device=d2t.device)] = True
    return t2d


@torch.no_grad()
def simulated_tau(target: TargetModel, draft_params: dict[str, torch.Tensor],
                  draft_cfg: DraftConfig, d2t: torch.Tensor, sequences: Sequence[torch.Tensor],
                  prompt_lengths: Sequence[int], ttt_length: int) -> Objective:
    """The training-time objective and metrics (``unrolled.ttt``, SPEC section 5) on texts.

    Each sequence (int64 ``[T_i]``, prompt + generated) is one right-padded sample of a
    batch; the loss mask is ``m_p = 1`` for ``p >= L_i - 1`` (``L_i`` its prompt length),
    so the supervised rows predict ``x_{L_i + 1}`` onward, the tokens that verification
    rounds judge. ``d2t`` may live on another device than the target (``eagle3fn eval``
    reads it on the CPU): it is moved to the sequences' device. Returns the
    ``Objective``; ``tau = 1 + sum_j prod_{i<=j} acc_j``.
    """
    lengths = [int(s.numel()) for s in sequences]
    B, S = len(sequences), max(lengths)
    device = sequences[0].device
    d2t = d2t.to(device)
    ids = torch.zeros(B, S, dtype=torch.long, device=device)
    attention = torch.zeros(B, S, dtype=torch.long, device=device)
    loss_mask = torch.zeros(B, S, dtype=torch.bool, device=device)
    for b, (seq, L) in enumerate(zip(sequences, prompt_lengths)):
        ids[b, :seq.numel()] = seq.flatten()
        attention[b, :seq.numel()] = 1
        loss_mask[b, max(L - 1, 0):seq.numel()] = True
    features = target_features(target, ids, attention)
    weight = draft_params["fc.weight"]
    features = dataclasses.replace(features, aux=features.aux.to(weight.dtype))
    rowmap = build_rowmap(supervised_mask(loss_mask, attention), ttt_length)
    config = TTTConfig(draft=draft_cfg, ttt_length=ttt_length, fused_head=False)
    return ttt(draft_params, features, rowmap, config, d2t=d2t,
               t2d=_t2d(d2t, draft_cfg.vocab_size))


def evaluate(target: TargetModel, draft_params: dict[str, torch.Tensor], draft_cfg: DraftConfig,
             d2t: torch.Tensor, prompts: Sequence[torch.Tensor], cfg: SpecConfig, *,
             tokenizer=None, batch_size: int = 8, baseline: bool = True,
             impl: str | None = None) -> dict:
    """Speculative decoding of every prompt (``generate``, ``batch_size`` prompts at a
    time), timed beside the target alone on the same batches (``target_generate``), and
    the training-time tau on the speculative output.

    Args:
        prompts: int64 ``[L]`` or ``[1, L]`` each.
        tokenizer: EOS ids only (``generate``).
        batch_size: prompts decoded together (>= 1).
        baseline: also time the target alone (the speedup's denominator), on the
            decoding path of ``impl`` (``target_generate(impl=impl)``).
        impl: ``generate``'s implementation (None: ``default_impl``, ``"graph"`` on CUDA).
            With ``"graph"`` each side keeps its recorded CUDA graphs across batches
            (a ``decoding.GraphPool`` each, both held until the end). On CUDA each side's
            first batch runs once untimed before the timing (compilation, recordings).
            The two sides run batch by batch, alternating which goes first
            (``interleaved``), so a drift in the machine's speed shifts both alike.

    Returns:
        ``acceptance_length`` (mean of ``accepted + 1`` over the rounds of all
        prompts), ``per_position_acceptance`` (k floats, rounds of all prompts pooled),
        ``n_prompts``, ``tokens`` (new tokens, all prompts), ``rounds``,
        ``target_forwards`` (prefills included), ``seconds`` and ``tokens_per_s``
        (wall clock of the speculative decoding), ``simulated_tau`` and ``simulated_acc``
        (k floats): ``unrolled.ttt``'s tau and per-step acc with ``ttt_length = k`` on the
        prompts + generated texts (``simulated_tau``). With ``baseline``:
        ``target_seconds``, ``target_tokens_per_s`` (the target alone, its own tokens),
        ``speedup`` (tokens/s with the draft over tokens/s alone) and ``same_as_target``
        (prompts whose two outputs are identical). Greedy: ``identity`` (one line) and
        ``near_ties``; every difference must be an argmax near-tie of the target
        (``evaluation.check_identity``), else ``OutputMismatch`` is raised. ``impl``:
        the implementation that ran (both sides). ``cpu_linear``: both sides' linear
        layers (``decoding.cpu_linear.few_rows``' choice).
    """
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = target.lm_head.weight.device
    prompts = [p.to(device) for p in prompt_list(prompts)]
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    impl = default_impl(target, draft_params) if impl is None else impl

    def spec(batch):
        return generate(target, tokenizer, draft_params, draft_cfg, d2t, batch, cfg, impl=impl, pool=pools[0])

    def alone(batch):
        return target_generate(target, tokenizer, batch, cfg, impl=impl, pool=pools[1])

    pools = (GraphPool(), GraphPool())  # each side keeps its recorded CUDA graphs across batches
    sides = (spec, alone) if baseline else (spec,)
    with few_rows(target.model, batch_size * (cfg.num_draft_tokens + 1)) as linear_form:
        outputs, seconds = interleaved(sides, batches, device)
    for pool in pools:
        pool.clear()
    results, rounds = outputs[0], [n for r in outputs[0] for n in r.accepted_per_round]
    length, per_position = acceptance_stats(rounds, cfg.num_draft_tokens)
    tokens = sum(len(r.tokens) for r in results)
    out = {"acceptance_length": length, "per_position_acceptance": per_position,
           "n_prompts": len(prompts), "tokens": tokens, "rounds": len(rounds),
           "target_forwards": sum(r.target_forwards for r in results),
           "seconds": seconds[0], "tokens_per_s": tokens / seconds[0], "impl": impl,
           "cpu_linear": choice_record(linear_form)}
    if baseline:
        alone_out, target_seconds = outputs[1], seconds[1]
        target_tps = sum(map(len, alone_out)) / target_seconds
        out.update(target_seconds=target_seconds, target_tokens_per_s=target_tps,
                   speedup=out["tokens_per_s"] / target_tps,
                   same_as_target=sum(a == r.tokens for a, r in zip(alone_out, results)))
        if cfg.temperature == 0:  # raises OutputMismatch unless every difference is a near-tie
            report = check_identity(target.model, prompts, alone_out, [r.tokens for r in results])
            out.update(identity=report.line(), near_ties=len(report.near_ties))
    sequences = [torch.cat((p, p.new_tensor(r.tokens))) for p, r in zip(prompts, results)]
    sim = simulated_tau(target, draft_params, draft_cfg, d2t, sequences,
                        [p.numel() for p in prompts], cfg.num_draft_tokens)
    out.update(simulated_tau=float(sim.tau), simulated_acc=[float(a) for a in sim.acc])
    return out
