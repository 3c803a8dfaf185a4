"""The readable twin of speculative decoding: one prompt, no KV cache
(``speculative_generate``). Each round re-runs the target on the whole sequence and the
draft's step-0 keys on every context row; ``generate`` is held to it token for token.

Legend: V target vocab, Ht target hidden, T tokens so far (prompt + generated), C = T - 1
context rows (positions whose target aux features are known), k draft tokens per round.

State between target forwards: tokens ``x_0..x_{T-1}`` and aux ``a_0..a_{C-1}``. The
target chose ``x_{T-1}`` from its logits but has not read it yet, so its aux is unknown.
One round (t = C - 1, the last context row)::

    propose   the draft at row t, k steps (``chain.propose``) -> d_1..d_k
    verify    one target forward on x_0..x_{T-1}, d_1..d_k: its distributions at
              positions T-1..T-1+k judge d_1..d_k (+ one bonus), and it yields the aux
              features of every position, so the accepted ones become context rows
    accept    greedy: the longest prefix where the target's argmax equals d, then the
              target's own token; sampling: d_i kept with probability min(1, p/q), the
              first rejected one replaced by a sample of norm(max(0, p - q)) (``verify``)
    append    n accepted draft tokens + 1 target token: n + 1 tokens per target forward

After a round, the accepted positions get step-0 keys from their target aux features
(the draft's own step keys are dropped), as a serving engine refills its draft cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3fn.draft import DraftConfig
from eagle3fn.evaluation.chain import propose
from eagle3fn.evaluation.config import SpecConfig, check_inputs, eos_ids
from eagle3fn.evaluation.results import SpecResult, acceptance_stats
from eagle3fn.evaluation.verify import sample_from, verify_greedy, verify_sampled
from eagle3fn.io.target import TargetModel, target_features


def target_step(target: TargetModel, ids_T: torch.Tensor, last: int,
                check_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward on ``ids [T]`` with the training-time feature hooks:
    aux ``[T, 3*Ht]`` and the logits ``[last, V]`` of the last ``last`` positions."""
    f = target_features(target, ids_T[None], torch.ones_like(ids_T)[None], check_head=check_head)
    hidden = f.final_hidden[0, -last:].to(f.target_head.device)
    return f.aux[0], F.linear(hidden, f.target_head)


@torch.no_grad()
def speculative_generate(target: TargetModel, tokenizer_or_none,
                         draft_params: dict[str, torch.Tensor], draft_cfg: DraftConfig,
                         d2t: torch.Tensor, input_ids: torch.Tensor, cfg: SpecConfig) -> SpecResult:
    """Generate after one prompt by chain speculative decoding (module docstring).

    Greedy (``temperature = 0``) output equals ``target.model.generate(do_sample=False)``
    token for token, for any draft. Sampling output is distributed as the target's own
    sampling at that temperature (no top-k / top-p).

    Args:
        target: from ``io.target.load_target``.
        tokenizer_or_none: only read for ``eos_token_id`` (beside the model's
            ``generation_config.eos_token_id``); None to use the model's alone.
        draft_params, draft_cfg, d2t: the draft (``init_params`` names) and its vocab map.
        input_ids: int64 ``[1, L]``, the prompt (no padding), on the target's device.
        cfg: ``SpecConfig``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be one prompt [1, L], got shape {tuple(input_ids.shape)}")
    check_inputs(target, draft_cfg, d2t)
    k, temperature = cfg.num_draft_tokens, cfg.temperature
    generator = torch.Generator().manual_seed(cfg.seed)
    eos = eos_ids(target, tokenizer_or_none)

    def pick(logits_V: torch.Tensor) -> int:
        if temperature == 0:
            return int(logits_V.argmax())
        return sample_from(torch.softmax(logits_V.double() / temperature, dim=-1), generator)

    ids = input_ids[0]
    aux, logits = target_step(target, ids, 1, check_head=True)  # prefill: x_L
    new = [pick(logits[0])]
    ids = torch.cat((ids, ids.new_tensor(new)))
    accepted: list[int] = []
    while len(new) < cfg.max_new_tokens and new[-1] not in eos:
        proposal = propose(draft_params, draft_cfg, d2t, aux, ids, k,
                           temperature=temperature, generator=generator)
        T = ids.shape[0]
        aux_all, logits = target_step(target, torch.cat((ids, proposal.tokens)), k + 1)
        if temperature == 0:
            n, token = verify_greedy(logits, proposal.tokens)
        else:
            p = torch.softmax(logits.double().cpu() / temperature, dim=-1)
            n, token = verify_sampled(p, proposal.probs, proposal.tokens.cpu(), generator)
        accepted.append(n)
        step = proposal.tokens[:n].tolist() + [token]
        ids = torch.cat((ids, ids.new_tensor(step)))
        aux = aux_all[:T + n]  # rows 0..T-1+n: x_{T-1} and d_1..d_n are now read
        for t in step:
            new.append(t)
            if t in eos or len(new) == cfg.max_new_tokens:
                break
    length, per_position = acceptance_stats(accepted, k)
    return SpecResult(tokens=new, accepted_per_round=accepted, acceptance_length=length,
                      per_position_acceptance=per_position, target_forwards=len(accepted) + 1)
