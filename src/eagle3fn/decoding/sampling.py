"""Token choice from logits: greedy, or sampled by inverse CDF from one uniform per row.

Legend: B rows, V vocab, T draws per request.

Sampling takes its randomness as data: ``pick_tokens`` maps (logits, u) to a token, and
each request owns a stream of uniforms ``request_uniforms`` drawn up front from its own
seed. A request's answer is therefore a function of its prompt, its seed and the model,
whatever slot or batch it is decoded in (up to the floating-point effect of batch
composition on the logits, which is nil on the CPU and in fp64).
"""

from __future__ import annotations

import torch


def pick_tokens(logits_BV: torch.Tensor, u_B: torch.Tensor | None, temperature: float,
                top_p: float = 1.0) -> torch.Tensor:
    """Tokens ``[B]`` (int64): ``argmax`` when ``temperature == 0``; otherwise token j of
    the distribution ``p = softmax(logits / temperature)`` (fp32, fp64 for fp64 logits)
    restricted to its nucleus (the fewest most probable tokens whose mass reaches
    ``top_p``, renormalised) such that ``F(j-1) <= u * F(V-1) < F(j)``, F the cumulative
    sum in descending-probability order when ``top_p < 1`` (vocab order otherwise):
    token j is picked for a set of u of measure ``p_j``. ``u_B`` in ``[0, 1)``."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    dtype = torch.promote_types(logits_BV.dtype, torch.float32)
    probs = torch.softmax(logits_BV.to(dtype) / temperature, dim=-1)
    order = None
    if top_p < 1:
        probs, order = probs.sort(dim=-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the more probable tokens
        probs = probs.masked_fill(before >= top_p, 0)
    cdf = probs.cumsum(-1)
    x = u_B.to(dtype)[:, None] * cdf[:, -1:]
    j = torch.searchsorted(cdf, x, right=True).clamp_max(cdf.shape[-1] - 1)
    return j[:, 0] if order is None else order.gather(1, j)[:, 0]


def request_uniforms(seed: int, count: int) -> torch.Tensor:
    """The uniforms ``[count]`` (fp64, CPU) of the request seeded ``seed``: draw t decides
    its answer's token t. ``torch.rand(count, generator=torch.Generator().manual_seed(seed),
    dtype=torch.float64)``."""
    return torch.rand(count, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
