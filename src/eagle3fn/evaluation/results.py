"""What a speculative-decoding run returns: one ``SpecResult`` per prompt, the
acceptance statistics of its rounds, and the bookkeeping that appends a verified round
to a prompt's tokens.

Legend: k draft tokens per round, B rows (prompts) of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass
class SpecResult:
    """One prompt's speculative generation.

    Fields:
        tokens: the new token ids (at most ``max_new_tokens``; ends at the first EOS,
            which is kept, as ``model.generate`` does).
        accepted_per_round: draft tokens accepted in each verification round, in
            ``0..k``. A round is counted as the target judged it, also when the output
            was cut inside it by EOS or ``max_new_tokens``.
        acceptance_length: mean over rounds of ``accepted + 1``, the tokens each
            verifying target forward produces (0.0 when no round ran). The prefill
            forward, which yields one token, is not a round.
        per_position_acceptance: k floats; entry i = #rounds accepting > i draft
            tokens / #rounds accepting >= i (draft token i + 1 accepted given the
            earlier ones were; 0.0 when no round reached it).
        target_forwards: target forwards run, prefill included (rounds + 1).
    """

    tokens: list[int]
    accepted_per_round: list[int]
    acceptance_length: float
    per_position_acceptance: list[float]
    target_forwards: int


def acceptance_stats(accepted: Sequence[int], k: int) -> tuple[float, list[float]]:
    """``(acceptance_length, per_position_acceptance)`` of rounds with ``accepted``
    draft tokens each (see ``SpecResult``)."""
    length = sum(n + 1 for n in accepted) / len(accepted) if accepted else 0.0
    reached = [sum(n >= i for n in accepted) for i in range(k)]
    passed = [sum(n > i for n in accepted) for i in range(k)]
    return length, [p / r if r else 0.0 for p, r in zip(passed, reached)]


def results(new: list[list[int]], accepted: list[list[int]], k: int) -> list[SpecResult]:
    """One ``SpecResult`` per prompt from its new tokens and accepted counts per round
    (one target forward per round plus the prefill)."""
    out = []
    for tokens, counts in zip(new, accepted):
        length, per_position = acceptance_stats(counts, k)
        out.append(SpecResult(tokens=tokens, accepted_per_round=counts, acceptance_length=length,
                              per_position_acceptance=per_position, target_forwards=len(counts) + 1))
    return out


def emit(new: list[list[int]], accepted: list[list[int]], rows: list[int], host: list[list[int]],
         eos: set[int], max_new: int) -> None:
    """Append each row's round (``host`` rows: accepted n, the target's token, the k
    proposals) to its tokens, stopping at EOS or ``max_new`` tokens."""
    for r, (count, t, *drafted) in zip(rows, host):
        accepted[r].append(count)
        for x in drafted[:count] + [t]:
            new[r].append(x)
            if x in eos or len(new[r]) == max_new:
                break
