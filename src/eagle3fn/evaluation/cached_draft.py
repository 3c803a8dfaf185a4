"""The draft on its own key/value cache, for a batch of rows: the step-0 keys and
values of context rows (``Draft.context``) and the k-step chain of each row's last
context row over them (``Draft.chain``), the batched form of ``chain.draft_chain``.

Legend: B rows, N tokens of one target forward, S cache slots, k draft tokens per
round, H draft hidden, Ht target hidden, V target vocab, Vd draft vocab, h heads,
g kv heads, d head dim.
"""

from __future__ import annotations

import math

import torch

from eagle3fn.draft import (DraftConfig, head, keys_values, layer_input, layer_output, project, qkv, queries,
                            rope_cos_sin)


class Draft:
    """The draft's parameters (``init_params`` names, not copied) and config, run by the
    draft's layer functions (``eagle3fn.draft``). ``fused``: their elementwise chains
    (RMSNorm, RoPE, SwiGLU, the layer input's norm pair) each one compiled kernel on CUDA
    (``draft.fused_on_cuda``, shape-dynamic; the same maths, rounding may differ in the
    last bit), set by the graph path, where a draft step is otherwise ~65 small kernels
    and about 40 of them are these chains; off (eager), every path keeps its kernels as
    they were."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: DraftConfig, fused: bool = False) -> None:
        self.params, self.cfg, self.fused = params, cfg, fused
        self.dtype, self.device = params["fc.weight"].dtype, params["fc.weight"].device

    def rope(self, pos_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, N, d]`` at positions ``pos [B, N]`` in the draft's dtype."""
        return rope_cos_sin(pos_BN, self.cfg.rope, self.cfg.d, self.dtype, self.fused)

    def context(self, aux_BN3: torch.Tensor, next_BN: torch.Tensor, pos_BN: torch.Tensor,
                keep_BN: torch.Tensor):
        """Context rows of one target forward: ``g = fc(a)`` ``[B, N, H]``, the layer
        input ``u [B, N, 2H]`` with the next tokens, and the step-0 keys and values
        ``[B, g, N, d]`` (zero where ``keep`` is False, so padding never carries NaN)."""
        p, cfg = self.params, self.cfg
        g = project(p, aux_BN3.to(self.dtype), cfg, self.fused)
        u = layer_input(p, next_BN, g, cfg, self.fused)
        cos, sin = self.rope(pos_BN)
        keys, values = keys_values(p, u, cos[:, :, None], sin[:, :, None], cfg, self.fused)  # [B, N, g, d]
        zero = ~keep_BN[:, None, :, None]
        return g, u, keys.transpose(1, 2).masked_fill(zero, 0), values.transpose(1, 2).masked_fill(zero, 0)

    def chain(self, g_BH: torch.Tensor, u_B2H: torch.Tensor, pos_B: torch.Tensor,
              keys_BgSd: torch.Tensor, values_BgSd: torch.Tensor, valid_BS: torch.Tensor,
              k: int, choose) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain unroll of each row's last context row t (features ``g``, input
        ``u``, position ``pos``) over the cached step-0 keys: ``(tokens [B, k] target
        ids, probs [B, k, V] fp64 or None)``. Step j's query and own key sit at
        ``pos + j`` and see every valid cached row plus the row's own keys of steps
        ``1..j``, as ``chain.draft_chain`` (SPEC section 3)."""
        p, cfg = self.params, self.cfg
        own_k, own_v, tokens, probs = [], [], [], []
        g, u = g_BH, u_B2H
        cos, sin = self.rope(pos_B[:, None] + torch.arange(k, device=pos_B.device))  # [B, k, d], once
        hidden = ~valid_BS[:, None, None, :]  # rolled-back and padding slots, once per round
        for j in range(k):
            rope = cos[:, j:j + 1], sin[:, j:j + 1]  # position pos + j, [B, 1, d]
            if j:
                u = layer_input(p, tokens[-1], g, cfg, self.fused)
                q, key, value = qkv(p, u, *rope, cfg, self.fused)  # [B, h, d], [B, g, d]
                own_k.append(key[:, :, None])
                own_v.append(value[:, :, None])
            else:
                q = queries(p, u, *rope, cfg, self.fused)
            out = layer_output(p, cached_attend(q[:, :, None], keys_BgSd, values_BgSd, hidden, own_k, own_v),
                               g, cfg, self.fused)
            token, q_V = choose(head(p, out, cfg, self.fused))
            tokens.append(token)
            probs.append(q_V)
            g = out  # the next step's feature: this step's pre-norm output
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)


def cached_attend(q_Bh1d: torch.Tensor, k_BgSd: torch.Tensor, v_BgSd: torch.Tensor,
                  hidden_B11S: torch.Tensor, own_k: list[torch.Tensor],
                  own_v: list[torch.Tensor]) -> torch.Tensor:
    """One query per row over the cached keys not ``hidden`` (bool ``[B, 1, 1, S]``,
    True for rolled-back and padding slots) and the row's own step keys (``own_k``:
    ``[B, g, 1, d]`` each, always visible): ``[B, 1, h*d]``. Query head i
    reads kv head ``i // (h / g)`` (grouped, the cache is never repeated); scores in the
    input dtype times ``1/sqrt(d)``, softmax in fp32 (fp64 for fp64), as ``chain.attend``."""
    B, h, _, d = q_Bh1d.shape
    g = k_BgSd.shape[1]
    q = q_Bh1d.reshape(B, g, h // g, d)
    scale = 1.0 / math.sqrt(d)
    scores = (q @ k_BgSd.transpose(-1, -2)) * scale  # [B, g, h/g, S]
    scores = scores.masked_fill(hidden_B11S, float("-inf"))
    if own_k:
        scores = torch.cat((scores, (q @ torch.cat(own_k, 2).transpose(-1, -2)) * scale), dim=-1)
    p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    S = k_BgSd.shape[2]
    out = p[..., :S] @ v_BgSd
    if own_v:
        out = out + p[..., S:] @ torch.cat(own_v, 2)
    return out.reshape(B, 1, h * d)

