"""The draft's chain of one row, without a cache: the readable twin of the batched
draft (``cached_draft``) and what ``twin.speculative_generate`` proposes with.

Legend: V target vocab, Vd draft vocab, H draft hidden, Ht target hidden, T tokens so
far (prompt + generated), C = T - 1 context rows (positions whose target aux features
are known), k draft tokens per round, h heads, g kv heads, d head dim, M keys.

The draft at row t = C - 1, steps j = 0..k-1 (SPEC section 3 for the one row t)::

    step 0: feature fc(a_t),    token x_{t+1}   -> d_1
    step j: feature out_{j-1},  token d_j       -> d_{j+1}

The draft's attention at step j (row t, RoPE position t + j) reads the step-0 keys and
values of every context row ``p <= t`` (at RoPE position p, built from ``fc(a_p)`` and
``x_{p+1}``) plus row t's own keys of steps 1..j (positions t+1..t+j). That is SPEC
section 3's pattern for row ``p = t``: step-0 keys ``{q' <= p}`` (every context row, since
t is the last) plus the row's own keys of steps ``1..j``, at ``pos[p] + j``; the chain
is the TTT unroll of its last row, with the proposals in place of the teacher-forced
tokens ``ids'[t + j]``, and the same layer functions (``eagle3fn.draft``).
``tests/test_speculative.py`` checks it against ``unrolled.backbone``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle3fn.draft import (DraftConfig, head, keys_values, layer_input, layer_output, project, qkv, queries,
                            rope_cos_sin)
from eagle3fn.evaluation.verify import Choose, chooser
from eagle3fn.unrolled import COMPILE_ELEMENTWISE_DEFAULT


@dataclass(frozen=True)
class Proposal:
    """The k draft tokens of one round.

    Fields:
        tokens: int64 ``[k]``, target ids ``d_1..d_k`` (draft id i -> ``i + d2t[i]``).
        probs: fp64 ``[k, V]`` or None: the distribution each token was sampled from,
            ``softmax(logits / temperature)`` over the draft vocab scattered to target
            ids through d2t, zero elsewhere. None when greedy.
        hidden: ``[k, H]``, the draft's pre-norm outputs ``out_0..out_{k-1}`` of row t.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    hidden: torch.Tensor


def draft_chain(params: dict[str, torch.Tensor], cfg: DraftConfig, aux_C3: torch.Tensor, ids_T: torch.Tensor,
                num_tokens: int, choose: Choose) -> tuple[list[int], list, list[torch.Tensor]]:
    """Row t = C - 1 unrolled ``num_tokens`` steps with the draft's layer functions
    (``eagle3fn.draft``, elementwise chains compiled as
    ``unrolled.COMPILE_ELEMENTWISE_DEFAULT`` says): proposed target ids, their draft
    distributions ``[V]`` (or None), pre-norm outputs ``[H]``."""
    fused = COMPILE_ELEMENTWISE_DEFAULT
    C = aux_C3.shape[0]
    positions = torch.arange(C + num_tokens, device=aux_C3.device)

    def rope(position):  # cos, sin [N, 1, d] at positions [N]
        cos, sin = rope_cos_sin(position, cfg.rope, cfg.d, aux_C3.dtype, fused)
        return cos[:, None], sin[:, None]

    # Step 0 keys/values of every context row p: fc(a_p) and ids'[p] = x_{p+1}.
    g_CH = project(params, aux_C3, cfg, fused)
    u_C2H = layer_input(params, ids_T[1:], g_CH, cfg, fused)
    k, v = keys_values(params, u_C2H, *rope(positions[:C]), cfg, fused)
    keys, values = [k.transpose(0, 1)], [v.transpose(0, 1)]  # [g, M, d] each
    g_1H, u_12H = g_CH[-1:], u_C2H[-1:]  # row t = C - 1; its step-0 key is keys[0][:, -1]
    tokens, probs, hidden = [], [], []
    for j in range(num_tokens):
        cos, sin = rope(positions[C - 1 + j:C + j])  # pos[t] + j
        if j:
            u_12H = layer_input(params, torch.tensor(tokens[-1:], device=aux_C3.device), g_1H, cfg, fused)
            q, k, v = qkv(params, u_12H, cos, sin, cfg, fused)
            keys.append(k.transpose(0, 1))
            values.append(v.transpose(0, 1))
        else:
            q = queries(params, u_12H, cos, sin, cfg, fused)
        a = attend(q.transpose(0, 1), torch.cat(keys, dim=1), torch.cat(values, dim=1))
        out = layer_output(params, a, g_1H, cfg, fused)
        token, q_V = choose(head(params, out, cfg, fused)[0])
        tokens.append(token)
        probs.append(q_V)
        hidden.append(out[0])
        g_1H = out  # the next step's feature: this step's pre-norm output
    return tokens, probs, hidden


def attend(q_h1d: torch.Tensor, k_gMd: torch.Tensor, v_gMd: torch.Tensor) -> torch.Tensor:
    """One query row over M keys, no mask (every key is visible): ``[1, h*d]``.

    As ``unrolled.eager_attention``: query head i reads kv head ``i // (h / g)``, scores in
    the input dtype times ``1/sqrt(d)``, softmax in fp32 (fp64 for fp64).
    """
    h, _, d = q_h1d.shape
    rep = h // k_gMd.shape[0]
    k, v = k_gMd.repeat_interleave(rep, dim=0), v_gMd.repeat_interleave(rep, dim=0)
    scores = (q_h1d @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [h, 1, M]
    probs = torch.softmax(scores, dim=-1,
                          dtype=torch.promote_types(q_h1d.dtype, torch.float32)).to(q_h1d.dtype)
    return (probs @ v).transpose(0, 1).reshape(1, h * d)


@torch.no_grad()
def propose(draft_params: dict[str, torch.Tensor], draft_cfg: DraftConfig, d2t: torch.Tensor,
            aux_C3: torch.Tensor, ids_T: torch.Tensor, num_tokens: int, *,
            temperature: float = 0.0, generator: torch.Generator | None = None) -> Proposal:
    """The draft's k proposals after ``x_0..x_{T-1}`` (chain, SPEC section 3 at row t).

    Args:
        draft_params: ``init_params``-style dict (any dtype/device).
        draft_cfg: its config.
        d2t: int64 ``[Vd]``, draft id i -> target id ``i + d2t[i]``.
        aux_C3: ``[C, 3*Ht]``, target aux of the context rows ``0..C-1``, ``C = T - 1``
            (cast to the draft's dtype).
        ids_T: int64 ``[T]``, the tokens; ``ids_T[p + 1]`` is row p's step-0 token.
        num_tokens: k.
        temperature: 0 = the draft's argmax; > 0 = sample its tempered softmax.
        generator: for the samples (temperature > 0).

    Returns:
        ``Proposal`` (tokens ``[k]`` on ``ids_T.device``, probs, hidden ``[k, H]``).
    """
    if aux_C3.shape[0] != ids_T.shape[0] - 1 or aux_C3.shape[0] < 1:
        raise ValueError(
            f"propose needs aux for every token but the last: got aux rows "
            f"{aux_C3.shape[0]} for {ids_T.shape[0]} tokens"
        )
    weight = draft_params["fc.weight"]
    choose = chooser(d2t, draft_cfg.vocab_size, temperature,
                     generator if generator is not None else torch.Generator())
    tokens, probs, hidden = draft_chain(draft_params, draft_cfg,
                                        aux_C3.to(device=weight.device, dtype=weight.dtype),
                                        ids_T.to(weight.device), num_tokens, choose)
    return Proposal(
        tokens=torch.tensor(tokens, dtype=torch.long, device=ids_T.device),
        probs=None if temperature == 0 else torch.stack(probs),
        hidden=torch.stack(hidden),
    )


