"""The sampling and verification rules of speculative decoding (Leviathan et al. 2023,
Chen et al. 2023): drawing a token, the residual a rejected draft token is replaced
by, greedy and sampled verification of one row and of a batch, and the choosers that
turn the draft's and the target's logits into tokens.

Legend: V target vocab, Vd draft vocab, k draft tokens per round, K = k + 1 verified
positions, B rows of a batch.

Greedy: the longest prefix where the target's argmax equals the proposal, then the
target's own token. Sampling: ``d_i`` kept with probability ``min(1, p/q)``, the first
rejected one replaced by a sample of ``norm(max(0, p - q))``; the emitted tokens are
then distributed as the target's own sampling.
"""

from __future__ import annotations

from typing import Callable

import torch

def sample_from(probs_V: torch.Tensor, generator: torch.Generator) -> int:
    """One index drawn from ``probs [V]`` by inverse CDF with one uniform draw.

    ``probs`` must already sum to 1: nothing renormalises here (a uniform beyond the
    total mass lands on the last index with mass), so an unnormalised input shows up
    as a wrong distribution.
    """
    cdf = probs_V.detach().to(device="cpu", dtype=torch.float64).cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= cdf.shape[0]:  # u above the float total: the last index with mass
        i = int((probs_V > 0).nonzero()[-1])
    return i


def residual_distribution(p_V: torch.Tensor, q_V: torch.Tensor) -> torch.Tensor:
    """``norm(max(0, p - q))`` ``[V]``: what a rejected draft token is replaced by.

    With ``accept`` having probability ``min(1, p(d)/q(d))`` for ``d ~ q``, the emitted
    token is distributed as ``min(p, q) + (1 - sum min(p, q)) * residual = p``.
    """
    residual = (p_V - q_V).clamp_min(0)
    total = residual.sum()
    # A rejection means q(d) > p(d), so the residual has mass; only rounding of p ~ q
    # can empty it, where p itself is the limit.
    return residual / total if total > 0 else p_V


def verify_greedy(logits_KV: torch.Tensor, tokens_K: torch.Tensor) -> tuple[int, int]:
    """Greedy verification: ``(n, token)``.

    Args:
        logits_KV: ``[k+1, V]``, the target's logits at the positions that predict
            ``d_1..d_k`` and the bonus token.
        tokens_K: int64 ``[k]``, the proposals.

    Returns:
        n = the longest prefix with ``argmax == d`` (ties to the lowest id, as
        ``generate``), and the target's argmax after it (the correction, or the bonus
        token when ``n = k``).
    """
    best = logits_KV.argmax(dim=-1)
    n = int((best[:-1] == tokens_K.to(best.device)).int().cumprod(0).sum())
    return n, int(best[n])


def verify_sampled(p_KV: torch.Tensor, q_KV: torch.Tensor, tokens_K: torch.Tensor,
                   generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): ``(n, token)``.

    Args:
        p_KV: ``[k+1, V]``, the target's distributions at the k + 1 verified positions.
        q_KV: ``[k, V]``, the draft distributions ``d_1..d_k`` were sampled from.
        tokens_K: int64 ``[k]``, the proposals.
        generator: one uniform draw per judged token, one more for the emitted token.

    Returns:
        n accepted tokens (``d_i`` kept with probability ``min(1, p_i(d_i)/q_i(d_i))``,
        stopping at the first rejection) and the next token: a sample of
        ``residual_distribution(p_n, q_n)`` after a rejection, of ``p_k`` after all k.
    """
    for i, d in enumerate(tokens_K.tolist()):
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * float(q_KV[i, d]) < float(p_KV[i, d]):  # u < p/q without dividing
            continue
        return i, sample_from(residual_distribution(p_KV[i], q_KV[i]), generator)
    return len(tokens_K), sample_from(p_KV[-1], generator)


Choose = Callable[[torch.Tensor], tuple[int, torch.Tensor | None]]
"""``choose(logits [Vd]) -> (target id, probs [V] fp64 or None)``: the draft's pick."""


def chooser(d2t: torch.Tensor, vocab_size: int, temperature: float,
            generator: torch.Generator) -> Choose:
    """``choose(logits [Vd]) -> (target id, probs [V] or None)``: the draft's argmax
    (greedy) or a sample of ``softmax(logits / temperature)`` scattered to ``[V]``."""
    d2t_cpu = d2t.detach().cpu().long()
    target_ids = d2t_cpu + torch.arange(d2t_cpu.shape[0])

    def choose(logits_Vd: torch.Tensor):
        if temperature == 0:
            i = int(logits_Vd.argmax())
            return int(target_ids[i]), None
        q_Vd = torch.softmax(logits_Vd.detach().cpu().double() / temperature, dim=-1)
        i = sample_from(q_Vd, generator)
        q_V = torch.zeros(vocab_size, dtype=torch.float64)
        q_V[target_ids] = q_Vd
        return int(target_ids[i]), q_V

    return choose


def picker(temperature: float, generators: list[torch.Generator]):
    """``pick(logits [B, V], rows) -> [B]``: the target's next token per row (argmax, or
    a sample of its tempered softmax with row ``rows[b]``'s generator)."""
    def pick(logits_BV: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if temperature == 0:
            return logits_BV.argmax(-1)
        p = torch.softmax(logits_BV.double().cpu() / temperature, dim=-1)
        return torch.tensor([sample_from(p[b], generators[r]) for b, r in enumerate(rows)],
                            device=logits_BV.device)
    return pick


def draft_chooser(d2t: torch.Tensor, vocab_size: int, temperature: float, device,
                  generators: list[torch.Generator], rows: list[int]):
    """``choose(logits [B, Vd]) -> (target ids [B], probs [B, V] fp64 or None)``: per
    row, ``chooser``'s rule with that row's generator."""
    target_ids = (d2t.detach().long() + torch.arange(d2t.shape[0], device=d2t.device)).to(device)
    if temperature == 0:
        return lambda logits_BVd: (target_ids[logits_BVd.argmax(-1)], None)
    choosers = [chooser(d2t, vocab_size, temperature, generators[r]) for r in rows]

    def choose(logits_BVd):
        picks = [c(z) for c, z in zip(choosers, logits_BVd)]
        return (torch.tensor([t for t, _ in picks], device=device),
                torch.stack([q for _, q in picks]))
    return choose


def verify_batch(logits_BKV: torch.Tensor, tokens_BK: torch.Tensor, probs_BKV: torch.Tensor | None,
                 temperature: float, generators: list[torch.Generator],
                 rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's accepted count ``n [B]`` and next token ``[B]`` (``verify_greedy`` /
    ``verify_sampled`` per row; greedy stays on the device, no host sync)."""
    if temperature == 0:
        best = logits_BKV.argmax(-1)
        n = (best[:, :-1] == tokens_BK).int().cumprod(1).sum(1)
        return n, best.gather(1, n[:, None].long())[:, 0]
    p = torch.softmax(logits_BKV.double().cpu() / temperature, dim=-1)
    out = [verify_sampled(p[b], probs_BKV[b], tokens_BK[b].cpu(), generators[r])
           for b, r in enumerate(rows)]
    return (torch.tensor([n for n, _ in out], device=tokens_BK.device),
            torch.tensor([t for _, t in out], device=tokens_BK.device))
