"""Regeneration: rewrite the assistant turns of chat data with the target itself.

A draft learns to predict the *target's* next tokens; trained on the target's own
answers it accepts more at inference. The prompts (system, user, tool turns) are kept;
assistant turn t is regenerated conditioned on the regenerated turns before it.
Conversations are generated in batches, turn by turn, with left padding.
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


def _generate(model, tokenizer, prompts: list[list[dict]], tools: list, cfg: GenerationConfig) -> list[str]:
    texts = [tokenizer.apply_chat_template(p, tools=t, tokenize=False, add_generation_prompt=True)
             for p, t in zip(prompts, tools)]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    enc = {k: v.to(model.device) for k, v in enc.items()}
    sample = cfg.temperature > 0
    out = model.generate(**enc, max_new_tokens=cfg.max_new_tokens, do_sample=sample,
                         temperature=cfg.temperature if sample else None,
                         top_p=cfg.top_p if sample else None,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    return [tokenizer.decode(row, skip_special_tokens=True).strip() for row in new]


@torch.no_grad()
def regenerate(conversations: Sequence, model, tokenizer, cfg: GenerationConfig) -> list[list[dict]]:
    """New message lists with every assistant turn written by ``model``.

    Args:
        conversations: objects with ``messages`` (dicts with ``role``/``content``) and
            ``tools`` (or None), e.g. ``io.data.Conversation``.
        model, tokenizer: a HF causal LM and its tokenizer (with a chat template).

    Returns:
        One message list per conversation, prompts unchanged, assistant contents new.
    """
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")
    torch.manual_seed(cfg.seed)
    result = [[dict(m) for m in c.messages] for c in conversations]
    tools = [getattr(c, "tools", None) for c in conversations]
    for start in range(0, len(result), cfg.batch_size):
        chunk = list(range(start, min(start + cfg.batch_size, len(result))))
        turns = max(sum(m["role"] == "assistant" for m in result[i]) for i in chunk)
        for t in range(turns):
            todo = []  # (conversation, message index of its t-th assistant turn)
            for i in chunk:
                where = [k for k, m in enumerate(result[i]) if m["role"] == "assistant"]
                if t < len(where):
                    todo.append((i, where[t]))
            answers = _generate(model, tokenizer, [result[i][:k] for i, k in todo],
                                [tools[i] for i, _ in todo], cfg)
            for (i, k), text in zip(todo, answers):
                result[i][k]["content"] = text
    return result


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
