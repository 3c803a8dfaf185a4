"""Regeneration: rewrite the assistant turns of chat data with the target itself.

A draft learns to predict the *target's* next tokens; trained on the target's own
answers it accepts more at inference. The prompts (system, user, tool turns) are kept;
assistant turn t is regenerated conditioned on the regenerated turns before it.

This is ``eagle3fn synthesize --prompts`` in memory (``eagle3fn.synth``): the batched
static-cache engine (continuous refill) writes the answers; ``eagle3fn regenerate`` is
that command under its old name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Sequence

import torch


@dataclasses.dataclass(kw_only=True, frozen=True)
class GenerationConfig:
    """How the target writes the new answers."""

    max_new_tokens: int = 256
    """Tokens generated per assistant turn at most."""
    temperature: float = 0.0
    """0 = greedy; otherwise sampling at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (with temperature > 0)."""
    batch_size: int = 8
    """Conversations generated together."""
    seed: int = 0
    """Sampling seed."""


@torch.no_grad()
def regenerate(conversations: Sequence, model, tokenizer, cfg: GenerationConfig) -> list[list[dict]]:
    """New message lists with every assistant turn written by ``model``.

    Args:
        conversations: objects with ``messages`` (dicts with ``role``/``content``) and
            ``tools`` (or None), e.g. ``io.data.Conversation``.
        model, tokenizer: a HF causal LM and its tokenizer (with a chat template).

    Returns:
        One message list per conversation, prompts unchanged, assistant contents new
        (answers cut by ``max_new_tokens`` kept as they are).
    """
    from eagle3fn.synth import EngineBackend, GivenPrompt, SynthConfig, Synthesizer
    from eagle3fn.synth.pipeline import new_conv
    from eagle3fn.synth.run import stop_ids_for

    synth_cfg = SynthConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                            seed=cfg.seed, keep_truncated=True)
    given = [GivenPrompt(tuple(c.messages), getattr(c, "tools", None)) for c in conversations]
    convs = [new_conv(i, given, ()) for i in range(len(given))]
    if convs:
        synth = Synthesizer(EngineBackend(model, tokenizer, batch_size=cfg.batch_size), tokenizer, synth_cfg,
                            stop_ids=stop_ids_for(tokenizer, model))
        synth.run_chunk(convs, None, lambda n: None)
    return [c.messages for c in convs]


def write_jsonl(path: str | Path, message_lists: Iterable[list[dict]], tools: Iterable = ()) -> int:
    """Write OpenAI-form JSONL (``{"messages": [...]}``, ``tools`` when given); returns lines."""
    n = 0
    tools = list(tools)
    with open(path, "w") as f:
        for i, messages in enumerate(message_lists):
            row = {"messages": messages}
            if i < len(tools) and tools[i]:
                row["tools"] = tools[i]
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            n += 1
    return n
