"""What a speculative-decoding run takes: its settings, its implementations, and the
checks of its inputs (prompts, EOS ids, the draft against the target).

Legend: V target vocab, Vd draft vocab, Ht target hidden, L prompt length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from eagle3fn.draft import DraftConfig
from eagle3fn.io.target import TargetModel


@dataclass(kw_only=True)
class SpecConfig:
    """How speculative generation runs."""

    num_draft_tokens: int = 6
    """k, draft tokens proposed per round (one target forward verifies them)."""
    max_new_tokens: int = 64
    """New tokens per prompt at most (the target's first token included)."""
    temperature: float = 0.0
    """0 = greedy (output equals the target's greedy output); > 0 = speculative sampling
    at this temperature (output distributed as the target's sampling)."""
    seed: int = 0
    """Seed of the sampling generator (draft samples, acceptance draws, residuals)."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


IMPLS = ("static", "dynamic")
"""``generate``'s implementations with the target on transformers' ``DynamicCache``."""

GRAPH = "graph"
"""``generate``'s implementation with the target on a ``decoding.StaticKVCache`` and CUDA
graphs for both sides (``evaluation.graphed``)."""


def prompt_list(prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Prompts ``[L]`` or ``[1, L]`` as ``[L]`` each; ValueError for none, an empty one
    or another shape."""
    bad = [p for p in prompts if p.numel() < 1 or not (p.dim() == 1 or p.dim() == 2 and p.shape[0] == 1)]
    if not prompts or bad:
        raise ValueError(f"need one or more non-empty prompts [L] or [1, L], got shapes "
                         f"{[tuple(p.shape) for p in prompts]}")
    return [p.reshape(-1) for p in prompts]


def eos_ids(target: TargetModel, tokenizer) -> set[int]:
    """The ids that end generation: the model's ``generation_config.eos_token_id`` (what
    ``model.generate`` stops at) and the tokenizer's ``eos_token_id`` when given."""
    ids: set[int] = set()
    for source in (getattr(getattr(target.model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else [int(i) for i in source])
    return ids


def check_inputs(target: TargetModel, draft_cfg: DraftConfig, d2t: torch.Tensor) -> None:
    """ValueError unless the draft was built for this target (vocab V, hidden Ht) and
    ``d2t`` is its vocab map (int64 ``[Vd]``)."""
    if draft_cfg.vocab_size != target.vocab_size or draft_cfg.ht != target.hidden_size:
        raise ValueError(
            f"the draft was built for vocab_size={draft_cfg.vocab_size}, target hidden "
            f"{draft_cfg.ht} but the target has vocab {target.vocab_size}, hidden "
            f"{target.hidden_size}; load the draft trained for this target"
        )
    if d2t.shape != (draft_cfg.draft_vocab_size,):
        raise ValueError(
            f"d2t has shape {tuple(d2t.shape)}, the draft needs [draft_vocab_size="
            f"{draft_cfg.draft_vocab_size}]; load the vocab map saved with the draft"
        )
