"""benchmarks/train.py's synthetic chat data: the length profiles (``PROFILES``), the
conversation generator (``sample_conversations``), the step batches eagle3fn trains on
and their statistics (train.py's module docstring says what the distribution is)."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from train_target import FIRST_WORD

ZIPF_EXPONENT = 1.1
MESSAGE_OVERHEAD = 3
"""Tokens the ChatML template adds per message (``<|im_start|>``, the role, ``<|im_end|>``)."""


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class ChatProfile:
    """A chat length distribution: ``(mean, sd)`` of exchanges (a user turn and its
    answer) per conversation and of tokens per user / assistant turn; ``context``:
    ``(median, log-sd)`` tokens of one leading system message, or None."""

    source: str
    turns: tuple[float, float]
    user: tuple[float, float]
    assistant: tuple[float, float]
    context: tuple[float, float] | None = None


WILDCHAT = ("WildChat (Zhao et al., ICLR 2024), dataset comparison table: turns 2.52+-2.49, "
            "user tokens/turn 295.58+-1609.18, assistant tokens/turn 441.34+-410.91")
PROFILES = {
    "prompt-heavy": ChatProfile(
        source=WILDCHAT + "; plus one context message per conversation, log-normal median 800 tokens, "
               "log-sd 0.5 (assumed, calibrated to 30-40% assistant tokens at 2048)",
        turns=(2.52, 2.49), user=(295.58, 1609.18), assistant=(441.34, 410.91), context=(800.0, 0.5)),
    "wildchat": ChatProfile(source=WILDCHAT, turns=(2.52, 2.49), user=(295.58, 1609.18),
                            assistant=(441.34, 410.91)),
    "sharegpt": ChatProfile(
        source="ShareGPT row of the WildChat paper's dataset comparison table: turns 3.51+-2.31, "
               "user tokens/turn 94.46+-626.39, assistant tokens/turn 348.45+-269.93",
        turns=(3.51, 2.31), user=(94.46, 626.39), assistant=(348.45, 269.93)),
}


@dataclass(kw_only=True)
class DataArgs:
    """The settings of benchmarks/train.py's chat set that the CPU data benchmarks
    (cache_size.py, packing.py) share; each adds its own."""

    shape: str = "llama-3.1-8b"
    """A ``train_target.SHAPES`` entry: its hidden size, vocab, max length and length scale."""
    profile: str = "prompt-heavy"
    """A ``train_data.PROFILES`` entry."""
    conversations: int = 320
    """Conversations (benchmarks/train.py: --steps 80 x --batch-size 4)."""
    batch_size: int = 4
    """Conversations per cache shard (prepare --batch-size); packed, rows of max length per batch."""
    seed: int = 0


def _lognormal(rng, mean: float, sd: float, size: int):
    """Log-normal draws with the given mean and sd."""
    s2 = math.log1p((sd / mean) ** 2)
    return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), size)


def _exchanges(rng, mean: float, sd: float) -> int:
    """1 + a negative binomial with the given mean and sd (over-dispersed counts)."""
    m, var = mean - 1, sd * sd
    q = m / var
    return 1 + int(rng.negative_binomial(m * q / (1 - q), q))


def sample_conversations(n: int, profile: ChatProfile, *, vocab_size: int, max_length: int,
                         length_scale: float, seed: int) -> list[dict]:
    """``n`` chat JSONL rows ``{"messages": [...]}`` drawn from ``profile`` (module
    docstring): message contents are space-separated words ``w{id}`` of
    ``word_tokenizer(vocab_size)``, one token each, ids Zipf-distributed. Lengths are
    multiplied by ``length_scale``; a conversation whose first answer would start past
    ``0.9 * max_length`` is drawn again, and text past ``max_length`` is not written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab_size - FIRST_WORD + 1, dtype=np.float64)
    weights = ranks ** -ZIPF_EXPONENT
    ids_by_rank = FIRST_WORD + rng.permutation(vocab_size - FIRST_WORD)

    def scaled(x) -> int:
        return max(1, round(float(x) * length_scale))

    plans = []
    while len(plans) < n:
        turns = _exchanges(rng, *profile.turns)
        user = [scaled(x) for x in _lognormal(rng, *profile.user, turns)]
        answer = [scaled(x) for x in _lognormal(rng, *profile.assistant, turns)]
        context = (scaled(rng.lognormal(math.log(profile.context[0]), profile.context[1]))
                   if profile.context else 0)
        first_answer = (MESSAGE_OVERHEAD + context if context else 0) + MESSAGE_OVERHEAD + user[0] + 2
        if first_answer >= 0.9 * max_length:
            continue
        roles = ([("system", context)] if context else []) + [
            (role, k) for u, a in zip(user, answer) for role, k in (("user", u), ("assistant", a))]
        plan, pos = [], 0
        for role, k in roles:  # nothing past where eagle3fn cuts (a few tokens' margin)
            if pos >= max_length:
                break
            plan.append((role, min(k, max_length + 8 - pos)))
            pos += MESSAGE_OVERHEAD + k
        plans.append(plan)
    total = sum(k for plan in plans for _, k in plan)
    words = ids_by_rank[rng.choice(len(weights), size=total, p=weights / weights.sum())]
    rows, at = [], 0
    for plan in plans:
        messages = []
        for role, k in plan:
            messages.append({"role": role, "content": " ".join(f"w{i}" for i in words[at:at + k])})
            at += k
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def padding_fraction(batch_lengths: list[list[int]]) -> float:
    """1 - real / padded tokens of right-padded batches: ``batch_lengths[b]`` holds the
    lengths of batch b's sequences, each batch padded to its longest."""
    real = sum(sum(b) for b in batch_lengths)
    padded = sum(len(b) * max(b) for b in batch_lengths)
    return 1 - real / padded


def step_batches(examples: list, batch_size: int, seed: int) -> list[list]:
    """The micro-batches of ``eagle3fn train``'s first epoch in step order: groups of
    ``batch_size`` consecutive examples (online; ``prepare`` cuts its shards the same
    way), ordered by ``Source.order(0, seed)``."""
    from eagle3fn.train.sources import Source

    groups = [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]
    return [groups[i] for i in Source(groups, load=lambda *a: None).order(0, seed)]


def data_summary(examples: list, batches: list[list], profile: str, n_written: int, max_length: int) -> dict:
    """Measured statistics of the tokenized data and of its step batches."""
    from eagle3fn.align import supervised_mask

    lengths = [len(e) for e in examples]
    tokens = sum(lengths)
    return {"profile": profile, "source": PROFILES[profile].source, "conversations": len(examples),
            "dropped": n_written - len(examples), "tokens": tokens,
            "assistant_share": round(sum(int(e.loss_mask.sum()) for e in examples) / tokens, 4),
            "supervised_share": round(sum(int(supervised_mask(e.loss_mask[None]).sum()) for e in examples)
                                      / tokens, 4),
            "mean_length": round(tokens / len(examples), 1), "median_length": statistics.median(lengths),
            "cut_at_max_length": round(sum(L >= max_length for L in lengths) / len(lengths), 3),
            "padding_frac": round(padding_fraction([[len(e) for e in b] for b in batches]), 4)}
