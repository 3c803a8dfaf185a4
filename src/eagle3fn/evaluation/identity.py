"""Greedy speculative output against the target alone, token for token.

Greedy speculative decoding emits exactly the target's greedy tokens in exact arithmetic.
In low precision a verifying forward over ``k + 1`` tokens and a one-token forward round
differently, so where the target's two best logits nearly tie the two paths may pick
different tokens and then continue differently. ``check_identity`` finds each prompt's
first differing token and re-scores that position with one plain forward of the target:
if the two candidates' logits are within ``tie_tolerance`` it is a near-tie (counted and
reported); otherwise the outputs disagree where the target is not in doubt, which is a
bug, and ``OutputMismatch`` is raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from eagle3fn.errors import Eagle3fnError

# Logit gap under which two candidates count as tied, by the target's compute dtype:
# a few units in the last place of the logits' magnitude (|z| ~ 10-30) in that dtype.
TIE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.05}


class OutputMismatch(Eagle3fnError):
    """Greedy speculative output differs from the target alone where the target's choice
    is clear (not a near-tie): a bug in the decoding, never acceptable."""


@dataclass(frozen=True)
class Divergence:
    """A prompt whose two outputs differ.

    Fields:
        prompt: index of the prompt.
        position: index (in the new tokens) of the first differing token.
        target_token, spec_token: the target alone's and the speculative token there.
        gap: |z[target_token] - z[spec_token]| of one plain target forward at that position.
    """

    prompt: int
    position: int
    target_token: int
    spec_token: int
    gap: float


@dataclass
class IdentityReport:
    """``identical`` prompts of ``n_prompts``; the rest are ``near_ties`` (all of them
    when the check passes)."""

    n_prompts: int
    identical: int
    near_ties: list[Divergence] = field(default_factory=list)

    def line(self) -> str:
        """One human line: ``12/12 outputs identical to the target's own`` (+ near-ties)."""
        text = f"{self.identical}/{self.n_prompts} outputs identical to the target's own"
        if self.near_ties:
            gaps = ", ".join(f"{d.gap:.3g}" for d in self.near_ties[:4])
            text += (f", {len(self.near_ties)} diverging at an argmax near-tie of the target "
                     f"(logit gaps {gaps}{', ...' if len(self.near_ties) > 4 else ''})")
        return text


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


@torch.no_grad()
def _gap(model, prompt_L: torch.Tensor, prefix: Sequence[int], a: int, b: int) -> float:
    ids = torch.cat((prompt_L.flatten(), prompt_L.new_tensor(list(prefix), dtype=torch.long)))[None]
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    return abs(float(logits[a] - logits[b]))


def check_identity(model, prompts: Sequence[torch.Tensor], target_outputs: Sequence[Sequence[int]],
                   spec_outputs: Sequence[Sequence[int]], *, tie_tolerance: float | None = None,
                   ) -> IdentityReport:
    """Compare greedy outputs prompt by prompt; raise ``OutputMismatch`` on a real one.

    Args:
        model: the HF causal LM (the target's ``model``), for re-scoring divergences.
        prompts: int64 ``[L_i]`` or ``[1, L_i]``.
        target_outputs, spec_outputs: the new tokens of each prompt, target alone and
            speculative.
        tie_tolerance: logit gap counted as a tie (default by the model's dtype,
            ``TIE_TOLERANCE``).

    A prompt whose one output is a strict prefix of the other (one stopped early) is a
    divergence at the shorter length with ``gap`` of the token the longer one chose
    against the EOS the shorter ended with, or a mismatch when neither ended by EOS.
    """
    if tie_tolerance is None:
        dtype = next(model.parameters()).dtype
        tie_tolerance = TIE_TOLERANCE.get(dtype, 1e-3)
    report = IdentityReport(n_prompts=len(prompts), identical=0)
    for i, (prompt, alone, spec) in enumerate(zip(prompts, target_outputs, spec_outputs)):
        alone, spec = list(alone), list(spec)
        if alone == spec:
            report.identical += 1
            continue
        at = _first_difference(alone, spec)
        if at >= min(len(alone), len(spec)):
            raise OutputMismatch(
                f"prompt {i}: the speculative output ({len(spec)} tokens) and the target's own "
                f"({len(alone)} tokens) agree until one stops early at token {at}: the decoding "
                "stops rows wrongly; rerun with --debug and report it")
        gap = _gap(model, prompt.to(next(model.parameters()).device), alone[:at], alone[at], spec[at])
        d = Divergence(prompt=i, position=at, target_token=alone[at], spec_token=spec[at], gap=gap)
        if gap > tie_tolerance:
            raise OutputMismatch(
                f"prompt {i}: greedy speculative output differs from the target alone at new token "
                f"{at} (target {alone[at]}, speculative {spec[at]}; logit gap {gap:.4g} > "
                f"{tie_tolerance:g}, not a near-tie): a decoding bug; rerun with --debug and report it")
        report.near_ties.append(d)
    return report
