"""What the batched paths share round by round: their starting state (``setup``), the
rows still decoding (``live_positions``), and one round's verification on transformers'
``DynamicCache`` (``verify_round``, ``impl="dynamic"`` and ``"static"``).

Legend: B rows, S cache slots, k draft tokens per round, K = k + 1 verified positions,
V target vocab, Ht target hidden.

``kv.target_forward`` and ``kv.kept`` are read through their module at call time, so
that a benchmark's timer or a test's negative control put in their place is the one run.
"""

from __future__ import annotations

import torch

from eagle3fn.draft import DraftConfig
from eagle3fn.evaluation import kv
from eagle3fn.evaluation.cached_draft import Draft
from eagle3fn.evaluation.config import SpecConfig, eos_ids
from eagle3fn.evaluation.verify import picker, verify_batch
from eagle3fn.io.target import TargetModel


def setup(target: TargetModel, tokenizer_or_none, draft_params: dict[str, torch.Tensor],
          draft_cfg: DraftConfig, prompts: list[torch.Tensor], cfg: SpecConfig):
    """What both implementations start from: ``(k, temperature, the target's device,
    EOS ids, one generator per prompt seeded cfg.seed + i, the target's token picker,
    the draft as a module)``."""
    generators = [torch.Generator().manual_seed(cfg.seed + i) for i in range(len(prompts))]
    return (cfg.num_draft_tokens, cfg.temperature, target.lm_head.weight.device,
            eos_ids(target, tokenizer_or_none), generators, picker(cfg.temperature, generators),
            Draft(draft_params, draft_cfg))


def live_positions(rows: list[int], new: list[list[int]], cfg: SpecConfig, eos: set[int], stage) -> list[int]:
    """Positions in ``rows`` of the prompts still decoding (fewer than
    ``max_new_tokens`` new tokens, the last not an EOS); a round is counted in
    ``stage.times`` when any is."""
    live = [i for i, r in enumerate(rows) if len(new[r]) < cfg.max_new_tokens and new[r][-1] not in eos]
    if live and stage.times is not None:
        stage.times.rounds += 1
    return live


def verify_round(target: TargetModel, cache, token_B: torch.Tensor, proposal_BK: torch.Tensor,
                 probs_BKV: torch.Tensor | None, valid_BS: torch.Tensor, pos_B: torch.Tensor,
                 steps: torch.Tensor, temperature: float, generators: list[torch.Generator],
                 rows: list[int], stage) -> tuple[torch.Tensor, ...]:
    """One round's verification, the same in both implementations: the cached target
    forward on ``x_{T-1}, d_1..d_k`` (``token [B]`` then ``proposal [B, k]``) at
    positions ``pos + 1 + steps``, timed as ``verify_s``, and its acceptance. Returns
    ``(aux [B, k+1, 3*Ht], positions [B, k+1], n [B] accepted counts, token [B] the
    next token, kept [B, k+1] (``kv.kept``), nxt [B, k+1])``, ``nxt`` being each verified
    slot's next token (the proposal shifted, the target's token at slot ``n``)."""
    k = proposal_BK.shape[1]
    positions = pos_B[:, None] + 1 + steps  # x_{T-1}, d_1..d_k
    fresh = torch.ones(len(rows), k + 1, dtype=torch.bool, device=valid_BS.device)
    with stage("verify_s"):
        aux, logits = kv.target_forward(target, torch.cat((token_B[:, None], proposal_BK), 1),
                                        torch.cat((valid_BS, fresh), 1), positions, cache, k + 1)
    n, token = verify_batch(logits, proposal_BK, probs_BKV, temperature, generators, rows)
    kept = kv.kept(n, steps)
    nxt = torch.cat((proposal_BK, proposal_BK[:, :1]), 1).scatter(1, n[:, None].long(), token[:, None])
    return aux, positions, n, token, kept, nxt

