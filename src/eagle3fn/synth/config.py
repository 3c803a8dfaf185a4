"""What a synthesis run makes: the settings that define its content (typed, checked)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eagle3fn.errors import UsageError

DEFAULT_CONVERSATIONS = 100
"""Conversations synthesized when --num-conversations is not given (and no --prompts)."""


@dataclass(kw_only=True)
class SynthConfig:
    """How conversations are written (these settings define the output: a rerun over
    the same --out must repeat them)."""

    num_conversations: int | None = None
    """Conversations to write (kept after the filters). Default: 100 synthesized, or
    every conversation of --prompts (then the first N)."""
    turns: int = 1
    """User/assistant exchanges per synthesized conversation; each later user turn is
    sampled by the target from the conversation so far (Magpie)."""
    max_new_tokens: int = 512
    """Tokens per assistant answer at most; an answer cut there is 'truncated'."""
    temperature: float = 0.0
    """Answers: 0 = greedy (the default), else sampled at this temperature (use the one
    you will serve at)."""
    top_p: float = 1.0
    """Answers: nucleus sampling threshold (with --temperature > 0)."""
    max_prompt_tokens: int = 256
    """Tokens per sampled user turn at most; a user turn cut there is dropped
    ('truncated_prompt')."""
    prompt_temperature: float = 0.8
    """User turns: sampling temperature (Magpie samples at 1.0, the target's own
    distribution of user messages; a small target then rambles past the token limit
    more often: docs/how-to/make-training-data.md)."""
    prompt_top_p: float = 0.9
    """User turns: nucleus threshold (drops the rarest tenth of the mass, the source of
    most broken user turns; duplicates are filtered)."""
    seed: int = 0
    """Base seed; request seeds are derived from it, the conversation index and the turn."""
    system_prompts: str | None = None
    """A text file, one system prompt per line: conversation i gets line i mod the
    number of lines (its user turn is then sampled after that system prompt)."""
    topics: str | None = None
    """A text file, one topic per line: conversation i gets the system prompt 'You are a
    helpful assistant. The user will ask you something about the following topic:
    <line i mod lines>.' (the topic steers through the system prompt; the user turn is
    still written freely)."""
    keep_truncated: bool = False
    """Keep conversations whose answer hit --max-new-tokens (default: drop them, since a
    cut answer never shows the model's end-of-turn)."""
    requests_only: bool = True
    """Drop a first user turn that is neither a question nor a request (a conservative
    heuristic: eagle3fn.synth.filters.is_request)."""
    near_duplicate_threshold: float = 0.7
    """Drop a first user turn whose word-3-gram Jaccard similarity (MinHash estimate) to
    an earlier one is at least this (1.0 keeps near duplicates, dropping exact ones only)."""

    def __post_init__(self) -> None:
        def need(ok: bool, flag: str, value, rule: str) -> None:
            if not ok:
                raise UsageError(f"--{flag} {value}: must be {rule}")

        finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
        need(self.num_conversations is None or self.num_conversations >= 1, "num-conversations",
             self.num_conversations, ">= 1, e.g. --num-conversations 1000")
        for flag in ("turns", "max_new_tokens", "max_prompt_tokens"):
            need(getattr(self, flag) >= 1, flag.replace("_", "-"), getattr(self, flag), ">= 1")
        for flag in ("temperature", "prompt_temperature"):
            v = getattr(self, flag)
            need(finite(v) and v >= 0, flag.replace("_", "-"), v, "a finite number >= 0 (0: greedy)")
        for flag in ("top_p", "prompt_top_p"):
            v = getattr(self, flag)
            need(finite(v) and 0 < v <= 1, flag.replace("_", "-"), v, "in (0, 1]")
        need(self.seed >= 0, "seed", self.seed, ">= 0")
        need(finite(self.near_duplicate_threshold) and 0 < self.near_duplicate_threshold <= 1,
             "near-duplicate-threshold", self.near_duplicate_threshold, "in (0, 1], e.g. 0.7")
        if self.system_prompts and self.topics:
            raise UsageError("--system-prompts and --topics both set the system prompt; pass one")


def read_lines(path: str, flag: str) -> list[str]:
    """The non-blank lines of a steering file, stripped (UsageError when there are none)."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--{flag} {path}: no such file; pass a text file with one entry per line")
    lines = [line.strip() for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"--{flag} {path} has no non-blank line; write one entry per line")
    return lines
