"""Chain speculative decoding with a HF target and an EAGLE-3 draft (evaluation).

Legend: V target vocab, Vd draft vocab, H draft hidden, Ht target hidden, T tokens so
far (prompt + generated), C = T - 1 context rows (positions whose target aux features
are known), k draft tokens per round, h heads, g kv heads, d head dim, M keys.

State between target forwards: tokens ``x_0..x_{T-1}`` and aux ``a_0..a_{C-1}``. The
target chose ``x_{T-1}`` from its logits but has not read it yet, so its aux is unknown.
One round (t = C - 1, the last context row)::

    propose   the draft at row t, steps j = 0..k-1 (SPEC section 3 for the one row t):
                step 0: feature fc(a_t),    token x_{t+1}   -> d_1
                step j: feature out_{j-1},  token d_j       -> d_{j+1}
    verify    one target forward on x_0..x_{T-1}, d_1..d_k: its distributions at
              positions T-1..T-1+k judge d_1..d_k (+ one bonus), and it yields the aux
              features of every position, so the accepted ones become context rows
    accept    greedy: the longest prefix where the target's argmax equals d, then the
              target's own token; sampling: d_i kept with probability min(1, p/q), the
              first rejected one replaced by a sample of norm(max(0, p - q))
    append    n accepted draft tokens + 1 target token: n + 1 tokens per target forward

The draft's attention at step j (row t, RoPE position t + j) reads the step-0 keys and
values of every context row ``p <= t`` (at RoPE position p, built from ``fc(a_p)`` and
``x_{p+1}``) plus row t's own keys of steps 1..j (positions t+1..t+j). That is SPEC
section 3's pattern for row ``p = t``: step-0 keys ``{q' <= p}`` (every context row, since
t is the last) plus the row's own keys of steps ``1..j``, at ``pos[p] + j``; the chain
is the TTT unroll of its last row, with the proposals in place of the teacher-forced
tokens ``ids'[t + j]``. ``tests/test_speculative.py`` checks it against ``unrolled.backbone``.
After a round, the accepted positions get step-0 keys from their target aux features
(the draft's own step keys are dropped), as a serving engine refills its draft cache.

Two implementations of the same decoding. ``speculative_generate`` (one prompt, no KV
cache: each round re-runs the target on the whole sequence and the draft's step-0 keys
on every context row) is the readable twin. ``generate`` (several prompts per batch, the
target on a transformers ``DynamicCache`` and the draft on its own key/value cache, both
rolled back on rejection) is what ``evaluate`` and ``eagle3fn eval`` run, timed against
the target alone (``target_generate``). Tests hold ``generate`` to ``model.generate`` and
to ``speculative_generate`` (greedy and sampled, token for token). ``generate`` has two
implementations of its draft side with the same output: ``impl="static"`` (fixed-shape
buffers; on CUDA with greedy decoding each round's draft work is two CUDA-graph
replays) and ``impl="dynamic"`` (tensors grown per round, every kernel launched from
Python). ``impl="graph"`` (``evaluation.graphed``; the default on CUDA) also runs the
target on a static cache with its verifying forward one CUDA-graph replay, and times
the target alone on the same path (``target_generate(impl="graph")``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle3fn.align import supervised_mask
from eagle3fn.decoding.graphs import Graphed
from eagle3fn.draft import DraftConfig, Eagle3Draft, apply_rope, elementwise, rope_cos_sin
from eagle3fn.evaluation.identity import check_identity
from eagle3fn.io.target import TargetModel, target_features
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Objective
from eagle3fn.unrolled import COMPILE_ELEMENTWISE_DEFAULT, TTTConfig, skeleton, ttt


@dataclass(kw_only=True)
class SpecConfig:
    """How speculative generation runs."""

    num_draft_tokens: int = 6
    """k, draft tokens proposed per round (one target forward verifies them)."""
    max_new_tokens: int = 64
    """New tokens per prompt at most (the target's first token included)."""
    temperature: float = 0.0
    """0 = greedy (output equals the target's greedy output); > 0 = speculative sampling
    at this temperature (output distributed as the target's sampling)."""
    seed: int = 0
    """Seed of the sampling generator (draft samples, acceptance draws, residuals)."""

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")


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


def acceptance_stats(accepted: Sequence[int], k: int) -> tuple[float, list[float]]:
    """``(acceptance_length, per_position_acceptance)`` of rounds with ``accepted``
    draft tokens each (see ``SpecResult``)."""
    length = sum(n + 1 for n in accepted) / len(accepted) if accepted else 0.0
    reached = [sum(n >= i for n in accepted) for i in range(k)]
    passed = [sum(n > i for n in accepted) for i in range(k)]
    return length, [p / r if r else 0.0 for p, r in zip(passed, reached)]


# ---------------------------------------------------------------------------- sampling


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


def _chooser(d2t: torch.Tensor, vocab_size: int, temperature: float,
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


# ------------------------------------------------------------------------------- draft


class _Chain(nn.Module):
    """``forward`` = the chain unroll of the last context row; run with
    ``functional_call`` on ``unrolled.skeleton`` (the same layer code as TTT; its
    elementwise chains compiled on CUDA unless ``EAGLE3FN_COMPILE=0``)."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        self.draft = draft

    def _input(self, g_NH: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
        """``u = [input_layernorm(embed(tokens)) ; hidden_norm(g)]`` ``[N, 2H]``."""
        layer = self.draft.midlayer
        emb = self.draft.embed_tokens(tokens_N).to(g_NH.dtype)
        return torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g_NH)), dim=-1)

    def _heads(self, proj: nn.Linear, u_N2H: torch.Tensor, n: int,
               position: torch.Tensor | None) -> torch.Tensor:
        """``proj(u)`` as ``[n, N, d]``, RoPE applied at ``position [N]`` unless None."""
        cfg = self.draft.cfg
        x = proj(u_N2H).view(u_N2H.shape[0], n, cfg.d).transpose(0, 1)
        if position is None:
            return x
        cos, sin = rope_cos_sin(position, cfg.rope, cfg.d, x.dtype, COMPILE_ELEMENTWISE_DEFAULT)
        return elementwise(apply_rope, COMPILE_ELEMENTWISE_DEFAULT)(x, cos[None], sin[None])

    def forward(self, aux_C3: torch.Tensor, ids_T: torch.Tensor, num_tokens: int,
                choose: Choose) -> tuple[list[int], list, list[torch.Tensor]]:
        """Row t = C - 1 unrolled ``num_tokens`` steps: proposed target ids, their
        draft distributions ``[V]`` (or None), pre-norm outputs ``[H]``."""
        draft, cfg = self.draft, self.draft.cfg
        attn = draft.midlayer.self_attn
        C = aux_C3.shape[0]
        positions = torch.arange(C + num_tokens, device=aux_C3.device)
        # Step 0 keys/values of every context row p: fc(a_p) and ids'[p] = x_{p+1}.
        g_CH = draft.project(aux_C3)
        u_C2H = self._input(g_CH, ids_T[1:])
        keys = [self._heads(attn.k_proj, u_C2H, cfg.num_kv_heads, positions[:C])]
        values = [self._heads(attn.v_proj, u_C2H, cfg.num_kv_heads, None)]
        g_1H, u_12H = g_CH[-1:], u_C2H[-1:]  # row t = C - 1; its step-0 key is keys[0][:, -1]
        tokens, probs, hidden = [], [], []
        for j in range(num_tokens):
            pos = positions[C - 1 + j:C + j]  # pos[t] + j
            if j:
                u_12H = self._input(g_1H, torch.tensor(tokens[-1:], device=aux_C3.device))
                keys.append(self._heads(attn.k_proj, u_12H, cfg.num_kv_heads, pos))
                values.append(self._heads(attn.v_proj, u_12H, cfg.num_kv_heads, None))
            q = self._heads(attn.q_proj, u_12H, cfg.num_heads, pos)
            a = _attend(q, torch.cat(keys, dim=1), torch.cat(values, dim=1))
            r = g_1H + attn.o_proj(a)
            out = r + draft.midlayer.mlp(draft.midlayer.post_attention_layernorm(r))
            token, q_V = choose(draft.head(out)[0])
            tokens.append(token)
            probs.append(q_V)
            hidden.append(out[0])
            g_1H = out  # the next step's feature: this step's pre-norm output
        return tokens, probs, hidden


def _attend(q_h1d: torch.Tensor, k_gMd: torch.Tensor, v_gMd: torch.Tensor) -> torch.Tensor:
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
    choose = _chooser(d2t, draft_cfg.vocab_size, temperature,
                      generator if generator is not None else torch.Generator())
    named = {f"draft.{k}": v for k, v in draft_params.items()}
    tokens, probs, hidden = torch.func.functional_call(
        _Chain(skeleton(draft_cfg)), named,
        (aux_C3.to(device=weight.device, dtype=weight.dtype), ids_T.to(weight.device),
         num_tokens, choose))
    return Proposal(
        tokens=torch.tensor(tokens, dtype=torch.long, device=ids_T.device),
        probs=None if temperature == 0 else torch.stack(probs),
        hidden=torch.stack(hidden),
    )


# ------------------------------------------------------------------------------ target


def _target_step(target: TargetModel, ids_T: torch.Tensor, last: int,
                 check_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward on ``ids [T]`` with the training-time feature hooks:
    aux ``[T, 3*Ht]`` and the logits ``[last, V]`` of the last ``last`` positions."""
    f = target_features(target, ids_T[None], torch.ones_like(ids_T)[None], check_head=check_head)
    hidden = f.final_hidden[0, -last:].to(f.target_head.device)
    return f.aux[0], F.linear(hidden, f.target_head)


def _eos_ids(target: TargetModel, tokenizer) -> set[int]:
    """The ids that end generation: the model's ``generation_config.eos_token_id`` (what
    ``model.generate`` stops at) and the tokenizer's ``eos_token_id`` when given."""
    ids: set[int] = set()
    for source in (getattr(getattr(target.model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else [int(i) for i in source])
    return ids


def _check_inputs(target: TargetModel, draft_cfg: DraftConfig, d2t: torch.Tensor) -> None:
    if draft_cfg.vocab_size != target.vocab_size or draft_cfg.ht != target.hidden_size:
        raise ValueError(
            f"the draft was built for vocab_size={draft_cfg.vocab_size}, target hidden "
            f"{draft_cfg.ht} but the target has vocab {target.vocab_size}, hidden "
            f"{target.hidden_size}; load the draft trained for this target"
        )
    if d2t.shape != (draft_cfg.draft_vocab_size,):
        raise ValueError(
            f"d2t has shape {tuple(d2t.shape)}, the draft needs [draft_vocab_size="
            f"{draft_cfg.draft_vocab_size}]; load the vocab map saved with the draft"
        )


@torch.no_grad()
def speculative_generate(target: TargetModel, tokenizer_or_none,
                         draft_params: dict[str, torch.Tensor], draft_cfg: DraftConfig,
                         d2t: torch.Tensor, input_ids: torch.Tensor, cfg: SpecConfig) -> SpecResult:
    """Generate after one prompt by chain speculative decoding (see the module docstring).

    Greedy (``temperature = 0``) output equals ``target.model.generate(do_sample=False)``
    token for token, for any draft. Sampling output is distributed as the target's own
    sampling at that temperature (no top-k / top-p).

    Args:
        target: from ``io.target.load_target``.
        tokenizer_or_none: only read for ``eos_token_id`` (beside the model's
            ``generation_config.eos_token_id``); None to use the model's alone.
        draft_params, draft_cfg, d2t: the draft (``init_params`` names) and its vocab map.
        input_ids: int64 ``[1, L]``, the prompt (no padding), on the target's device.
        cfg: ``SpecConfig``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
        raise ValueError(f"input_ids must be one prompt [1, L], got shape {tuple(input_ids.shape)}")
    _check_inputs(target, draft_cfg, d2t)
    k, temperature = cfg.num_draft_tokens, cfg.temperature
    generator = torch.Generator().manual_seed(cfg.seed)
    eos = _eos_ids(target, tokenizer_or_none)

    def pick(logits_V: torch.Tensor) -> int:
        if temperature == 0:
            return int(logits_V.argmax())
        return sample_from(torch.softmax(logits_V.double() / temperature, dim=-1), generator)

    ids = input_ids[0]
    aux, logits = _target_step(target, ids, 1, check_head=True)  # prefill: x_L
    new = [pick(logits[0])]
    ids = torch.cat((ids, ids.new_tensor(new)))
    accepted: list[int] = []
    while len(new) < cfg.max_new_tokens and new[-1] not in eos:
        proposal = propose(draft_params, draft_cfg, d2t, aux, ids, k,
                           temperature=temperature, generator=generator)
        T = ids.shape[0]
        aux_all, logits = _target_step(target, torch.cat((ids, proposal.tokens)), k + 1)
        if temperature == 0:
            n, token = verify_greedy(logits, proposal.tokens)
        else:
            p = torch.softmax(logits.double().cpu() / temperature, dim=-1)
            n, token = verify_sampled(p, proposal.probs, proposal.tokens.cpu(), generator)
        accepted.append(n)
        step = proposal.tokens[:n].tolist() + [token]
        ids = torch.cat((ids, ids.new_tensor(step)))
        aux = aux_all[:T + n]  # rows 0..T-1+n: x_{T-1} and d_1..d_n are now read
        for t in step:
            new.append(t)
            if t in eos or len(new) == cfg.max_new_tokens:
                break
    length, per_position = acceptance_stats(accepted, k)
    return SpecResult(tokens=new, accepted_per_round=accepted, acceptance_length=length,
                      per_position_acceptance=per_position, target_forwards=len(accepted) + 1)


# ------------------------------------------------------------- cached, batched decoding
#
# Legend here: B prompts decoded together (rows; finished ones leave the batch), S cache
# slots, N tokens in one target forward (the padded prompts, then 1 + k per round).
#
# Both caches share one slot layout and one validity mask ``valid [B, S]``: target slot s
# holds the keys of the token read there, draft slot s the step-0 keys of the context row
# at that token's position (built from its aux and the next token). Prompts are
# left-padded (pad slots invalid); every round appends the k + 1 verified slots to both,
# marks those after the accepted prefix invalid, and crops the slots no row keeps. The
# explicit position ids carry each row's true positions, so a row's attention and RoPE see
# exactly its own tokens, as if it were decoded alone. The static path (``_StaticDraft``)
# keeps the draft's slots 0..S-1 in a larger buffer whose slots past S are invalid, and
# keeps finished rows in the draft's buffers (the target's batch still shrinks).


COMPACT_SLACK = 64
"""Caches are compacted (``_compact``) once they hold more than twice the most valid
slots of a row plus this many."""


class _Draft:
    """An ``Eagle3Draft`` holding the given tensors (no copy), elementwise chains eager
    (the batch shapes change as rows finish; compiling would recompile)."""

    def __init__(self, params: dict[str, torch.Tensor], cfg: DraftConfig) -> None:
        with torch.device("meta"):
            module = Eagle3Draft(cfg, compile_elementwise=False)
        module.load_state_dict(params, assign=True)
        self.m, self.cfg = module, cfg
        self.dtype, self.device = params["fc.weight"].dtype, params["fc.weight"].device

    def _input(self, g_NH: torch.Tensor, tokens_N: torch.Tensor) -> torch.Tensor:
        """``u = [input_layernorm(embed(tokens)) ; hidden_norm(g)]`` ``[..., 2H]``."""
        layer = self.m.midlayer
        emb = self.m.embed_tokens(tokens_N).to(g_NH.dtype)
        return torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g_NH)), dim=-1)

    def rope(self, pos_BN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[B, N, d]`` at positions ``pos [B, N]`` in the draft's dtype."""
        return rope_cos_sin(pos_BN, self.cfg.rope, self.cfg.d, self.dtype, False)

    def _heads(self, proj: nn.Linear, u_BN2H: torch.Tensor, n: int,
               rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """``proj(u)`` as ``[B, n, N, d]``, RoPE applied with ``rope`` = cos, sin
        ``[B, N, d]`` unless None."""
        B, N, _ = u_BN2H.shape
        x = proj(u_BN2H).view(B, N, n, self.cfg.d).transpose(1, 2)
        if rope is None:
            return x
        return apply_rope.eager(x, rope[0][:, None], rope[1][:, None])

    def context(self, aux_BN3: torch.Tensor, next_BN: torch.Tensor, pos_BN: torch.Tensor,
                keep_BN: torch.Tensor):
        """Context rows of one target forward: ``g = fc(a)`` ``[B, N, H]``, the layer
        input ``u [B, N, 2H]`` with the next tokens, and the step-0 keys and values
        ``[B, g, N, d]`` (zero where ``keep`` is False, so padding never carries NaN)."""
        attn = self.m.midlayer.self_attn
        g = self.m.project(aux_BN3.to(self.dtype))
        u = self._input(g, next_BN)
        zero = ~keep_BN[:, None, :, None]
        keys = self._heads(attn.k_proj, u, self.cfg.num_kv_heads, self.rope(pos_BN)).masked_fill(zero, 0)
        values = self._heads(attn.v_proj, u, self.cfg.num_kv_heads, None).masked_fill(zero, 0)
        return g, u, keys, values

    def chain(self, g_BH: torch.Tensor, u_B2H: torch.Tensor, pos_B: torch.Tensor,
              keys_BgSd: torch.Tensor, values_BgSd: torch.Tensor, valid_BS: torch.Tensor,
              k: int, choose) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chain unroll of each row's last context row t (features ``g``, input
        ``u``, position ``pos``) over the cached step-0 keys: ``(tokens [B, k] target
        ids, probs [B, k, V] fp64 or None)``. Step j's query and own key sit at
        ``pos + j`` and see every valid cached row plus the row's own keys of steps
        ``1..j``, as ``_Chain`` (SPEC section 3)."""
        layer, cfg = self.m.midlayer, self.cfg
        attn = layer.self_attn
        own_k, own_v, tokens, probs = [], [], [], []
        g, u = g_BH[:, None], u_B2H[:, None]
        cos, sin = self.rope(pos_B[:, None] + torch.arange(k, device=pos_B.device))  # [B, k, d], once
        hidden = ~valid_BS[:, None, None, :]  # rolled-back and padding slots, once per round
        for j in range(k):
            rope = cos[:, j:j + 1], sin[:, j:j + 1]  # position pos + j
            if j:
                u = self._input(g, tokens[-1][:, None])
                own_k.append(self._heads(attn.k_proj, u, cfg.num_kv_heads, rope))
                own_v.append(self._heads(attn.v_proj, u, cfg.num_kv_heads, None))
            q = self._heads(attn.q_proj, u, cfg.num_heads, rope)
            a = _cached_attend(q, keys_BgSd, values_BgSd, hidden, own_k, own_v)
            r = g + attn.o_proj(a)
            out = r + layer.mlp(layer.post_attention_layernorm(r))
            token, q_V = choose(self.m.head(out[:, 0]))
            tokens.append(token)
            probs.append(q_V)
            g = out  # the next step's feature: this step's pre-norm output
        return torch.stack(tokens, 1), None if probs[0] is None else torch.stack(probs, 1)


def _cached_attend(q_Bh1d: torch.Tensor, k_BgSd: torch.Tensor, v_BgSd: torch.Tensor,
                   hidden_B11S: torch.Tensor, own_k: list[torch.Tensor],
                   own_v: list[torch.Tensor]) -> torch.Tensor:
    """One query per row over the cached keys not ``hidden`` (bool ``[B, 1, 1, S]``,
    True for rolled-back and padding slots) and the row's own step keys (``own_k``:
    ``[B, g, 1, d]`` each, always visible): ``[B, 1, h*d]``. Query head i
    reads kv head ``i // (h / g)`` (grouped, the cache is never repeated); scores in the
    input dtype times ``1/sqrt(d)``, softmax in fp32 (fp64 for fp64), as ``_attend``."""
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


_Graphed = Graphed  # moved to eagle3fn.decoding.graphs; the old name stays importable


class _StaticDraft:
    """The draft side of ``generate``'s static path: every tensor a round reads or writes
    preallocated for the batch's ``B`` rows (finished rows keep their row, computed but
    never read; rows are independent), the step-0 cache in ``cap`` slots of which each row
    attends those marked in ``valid``, so every round runs the same shapes. Two functions,
    each one CUDA graph when ``graph`` (``_Graphed``): ``update`` turns one verifying
    forward's ``k + 1`` positions into context rows (``_Draft.context``, written at cache
    slots ``slots``) and picks each row's last context row t; ``chain`` runs the k draft
    steps from row t (``_Draft.chain``). The cache grows by doubling (``reserve``), which
    records the graphs again.

    Buffers (inputs ``aux``, ``nxt``, ``pos``, ``n``, ``kept``, ``slots``; state ``keys``,
    ``values`` ``[B, g, cap, d]``, ``valid [B, cap]``, ``g_t [B, H]``, ``u_t [B, 2H]``,
    ``pos_t [B]``; output ``tokens [B, k]``, ``probs [B, k, V]`` or None).
    """

    def __init__(self, draft: _Draft, B: int, k: int, aux_width: int, choose, graph: bool, cap: int) -> None:
        cfg, dev, dt = draft.cfg, draft.device, draft.dtype
        self.draft, self.k, self.choose, self.graph, self.cap = draft, k, choose, graph, cap
        self.keys = torch.zeros(B, cfg.num_kv_heads, cap, cfg.d, dtype=dt, device=dev)
        self.values = torch.zeros_like(self.keys)
        self.valid = torch.zeros(B, cap, dtype=torch.bool, device=dev)
        self.aux = torch.zeros(B, k + 1, aux_width, dtype=dt, device=dev)
        self.nxt = torch.zeros(B, k + 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, k + 1, dtype=torch.long, device=dev)
        self.n = torch.zeros(B, dtype=torch.long, device=dev)
        self.kept = torch.zeros(B, k + 1, dtype=torch.bool, device=dev)
        self.slots = torch.arange(k + 1, device=dev)
        self.g_t = torch.zeros(B, cfg.hidden_size, dtype=dt, device=dev)
        self.u_t = torch.zeros(B, 2 * cfg.hidden_size, dtype=dt, device=dev)
        self.pos_t = torch.zeros(B, dtype=torch.long, device=dev)
        self.rows = torch.arange(B, device=dev)
        self.tokens = torch.zeros(B, k, dtype=torch.long, device=dev)
        self.probs: torch.Tensor | None = None
        self._record()

    def _record(self) -> None:
        self.update = _Graphed(self._update, self.graph, self.keys.device)
        self.chain = _Graphed(self._chain, self.graph, self.keys.device)

    def propose(self, slots: int, stage) -> None:
        """The round's k proposals into ``tokens`` (and ``probs``): room for ``slots``
        draft slots, the chain recorded if due (timed as ``record_s``), then run (timed
        as ``draft_chain_s``)."""
        self.reserve(slots)
        if self.chain.due:
            with stage("record_s"):
                self.chain.prepare()
        with stage("draft_chain_s"):
            self.chain()
    def _update(self) -> None:
        g, u, keys, values = self.draft.context(self.aux, self.nxt, self.pos, self.kept)
        self.keys.index_copy_(2, self.slots, keys)
        self.values.index_copy_(2, self.slots, values)
        self.valid.index_copy_(1, self.slots, self.kept)
        self.g_t.copy_(g[self.rows, self.n])
        self.u_t.copy_(u[self.rows, self.n])
        self.pos_t.copy_(self.pos[self.rows, self.n])

    def _chain(self) -> None:
        tokens, self.probs = self.draft.chain(self.g_t, self.u_t, self.pos_t, self.keys, self.values,
                                              self.valid, self.k, self.choose)
        self.tokens.copy_(tokens)

    def prefill(self, g_BLH: torch.Tensor, u_BL2H: torch.Tensor, pos_BL: torch.Tensor,
                keys_BgLd: torch.Tensor, values_BgLd: torch.Tensor, valid_BL: torch.Tensor) -> None:
        """The prompts' context rows into slots ``0..L-1``; row t = each row's last."""
        L = valid_BL.shape[1]
        self.reserve(L)
        self.keys[:, :, :L], self.values[:, :, :L], self.valid[:, :L] = keys_BgLd, values_BgLd, valid_BL
        self.g_t.copy_(g_BLH[:, -1])
        self.u_t.copy_(u_BL2H[:, -1])
        self.pos_t.copy_(pos_BL[:, -1])
        self.slots.copy_(torch.arange(L, L + self.k + 1, device=self.slots.device))

    def reserve(self, slots: int) -> None:
        """At least ``slots`` cache slots: the capacity doubles until it holds them (the
        cache copied over, the graphs recorded again)."""
        if slots <= self.cap:
            return
        cap = self.cap
        while cap < slots:
            cap *= 2
        grow = lambda x: torch.cat((x, x.new_zeros(*x.shape[:-2], cap - self.cap, x.shape[-1])), -2)  # noqa: E731
        self.keys, self.values = grow(self.keys), grow(self.values)
        self.valid = torch.cat((self.valid, self.valid.new_zeros(self.valid.shape[0], cap - self.cap)), 1)
        self.cap = cap
        self._record()

    def put(self, live: torch.Tensor | None, **inputs: torch.Tensor) -> None:
        """Copy a round's inputs (``aux``, ``nxt``, ``pos``, ``n``, ``kept``: live rows
        only) into their buffers at the live rows (all rows when ``live`` is None)."""
        for name, x in inputs.items():
            buffer = getattr(self, name)
            if live is None:
                buffer.copy_(x)
            else:
                buffer.index_copy_(0, live, x.to(device=buffer.device, dtype=buffer.dtype))

    def compact(self, live: torch.Tensor, order_BS: torch.Tensor, S: int, S_new: int) -> None:
        """Live rows' slots ``0..S-1`` reordered by ``order [B_live, S_new]`` (each row's
        valid slots first, ``_compact``), the slots past ``S_new`` invalid."""
        keys, values = self.keys[live, :, :S], self.values[live, :, :S]
        self.keys[live, :, :S_new] = _gather_slots(keys, order_BS.to(keys.device))
        self.values[live, :, :S_new] = _gather_slots(values, order_BS.to(keys.device))
        valid = self.valid[live, :S].gather(1, order_BS.to(keys.device))
        self.valid[live, :S] = torch.cat((valid, valid.new_zeros(valid.shape[0], S - S_new)), 1)
        self.slots.copy_(torch.arange(S_new, S_new + self.k + 1, device=self.slots.device))


def _left_pad(prompts: Sequence[torch.Tensor], device) -> tuple[torch.Tensor, ...]:
    """Prompts ``[L_i]`` left-padded: ids ``[B, L]`` (pad 0), valid ``[B, L]`` bool and
    positions ``[B, L]`` (0 at each row's first token; pads at 0)."""
    L = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), L, dtype=torch.long, device=device)
    valid = torch.zeros(len(prompts), L, dtype=torch.bool, device=device)
    for b, p in enumerate(prompts):
        ids[b, L - p.numel():] = p.reshape(-1).to(device)
        valid[b, L - p.numel():] = True
    return ids, valid, (valid.long().cumsum(1) - 1).clamp_min(0)


@functools.lru_cache(maxsize=8)
def _cache_kwarg_of(forward_type: type) -> str:
    return "cache" if "cache" in inspect.signature(forward_type.forward).parameters else "past_key_values"


def _cache_kwarg(model) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.25, where
    ``past_key_values`` is deprecated) or ``past_key_values`` (earlier)."""
    return _cache_kwarg_of(type(model))


def _target_forward(target: TargetModel, ids_BN: torch.Tensor, valid_BS: torch.Tensor,
                    pos_BN: torch.Tensor, cache, keep: int,
                    aux: bool = True) -> tuple[torch.Tensor | None, torch.Tensor]:
    """One cached target forward on ``ids [B, N]`` at positions ``pos``, attending the
    cache slots and the new ones where ``valid [B, S + N]``: the aux ``[B, N, 3*Ht]`` (the
    training-time hooks; None when ``aux`` is False) and the logits ``[B, keep, V]`` of
    the last ``keep`` tokens."""
    from eagle3fn.io.target import _Capture

    capture = _Capture(len(target.aux_layer_ids))
    handles = [target.backbone.layers[i + 1].register_forward_pre_hook(
        functools.partial(capture.stream, slot), with_kwargs=True)
        for slot, i in enumerate(target.aux_layer_ids)] if aux else []
    try:
        out = target.model(input_ids=ids_BN, attention_mask=valid_BS.long(), position_ids=pos_BN,
                           use_cache=True, logits_to_keep=keep, **{_cache_kwarg(target.model): cache})
    finally:
        for handle in handles:
            handle.remove()
    return capture.aux, out.logits[:, -keep:]


def _crop(cache, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, drop: int):
    """Remove the last ``drop`` slots (rejected in every row) from both caches."""
    if drop:
        cache.crop(-drop)
        keys, values, valid = keys[:, :, :-drop], values[:, :, :-drop], valid[:, :-drop]
    return keys, values, valid


def _compaction_order(valid_BS: torch.Tensor) -> torch.Tensor:
    """``[B, S']``: each row's valid slots first, in order (a stable sort of ``~valid``),
    cut to ``S'`` = the most valid slots of a row."""
    order = torch.sort((~valid_BS).to(torch.int8), dim=1, stable=True).indices
    return order[:, :int(valid_BS.sum(1).max())]


def _gather_slots(x_BgSd: torch.Tensor, order_BS: torch.Tensor) -> torch.Tensor:
    """``x [B, g, S_old, d]`` at slots ``order [B, S]`` per row: ``[B, g, S, d]``."""
    index = order_BS[:, None, :, None].expand(-1, x_BgSd.shape[1], -1, x_BgSd.shape[3])
    return x_BgSd.gather(2, index)


def _compact_target(cache, order_BS: torch.Tensor) -> None:
    """The target's cache (every layer) at slots ``order [B, S]`` (``_compaction_order``)."""
    for layer in cache.layers:
        layer.keys = _gather_slots(layer.keys, order_BS.to(layer.keys.device))
        layer.values = _gather_slots(layer.values, order_BS.to(layer.values.device))


def _compact(cache, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor):
    """Both caches with each row's valid slots first, in order, cut to the most valid
    slots of a row: rejected slots inside the cache (other rows accepted more) stop
    costing attention. Attention only reads valid slots and the explicit positions, so
    the order of the slots changes nothing but the summation order."""
    order = _compaction_order(valid)
    _compact_target(cache, order)
    order = order.to(keys.device)
    return _gather_slots(keys, order), _gather_slots(values, order), valid.gather(1, order)


def _kept(n_B: torch.Tensor, steps_K: torch.Tensor) -> torch.Tensor:
    """``[B, k+1]``: which verified slots stay (``x_{T-1}``, ``d_1..d_n``); the rest are
    rolled back (invalid in both caches, cropped where no row keeps them)."""
    return steps_K[None] <= n_B[:, None]


def _picker(temperature: float, generators: list[torch.Generator]):
    """``pick(logits [B, V], rows) -> [B]``: the target's next token per row (argmax, or
    a sample of its tempered softmax with row ``rows[b]``'s generator)."""
    def pick(logits_BV: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if temperature == 0:
            return logits_BV.argmax(-1)
        p = torch.softmax(logits_BV.double().cpu() / temperature, dim=-1)
        return torch.tensor([sample_from(p[b], generators[r]) for b, r in enumerate(rows)],
                            device=logits_BV.device)
    return pick


def _draft_chooser(d2t: torch.Tensor, vocab_size: int, temperature: float, device,
                   generators: list[torch.Generator], rows: list[int]):
    """``choose(logits [B, Vd]) -> (target ids [B], probs [B, V] fp64 or None)``: per
    row, ``_chooser``'s rule with that row's generator."""
    target_ids = (d2t.detach().long() + torch.arange(d2t.shape[0], device=d2t.device)).to(device)
    if temperature == 0:
        return lambda logits_BVd: (target_ids[logits_BVd.argmax(-1)], None)
    choosers = [_chooser(d2t, vocab_size, temperature, generators[r]) for r in rows]

    def choose(logits_BVd):
        picks = [c(z) for c, z in zip(choosers, logits_BVd)]
        return (torch.tensor([t for t, _ in picks], device=device),
                torch.stack([q for _, q in picks]))
    return choose


def _verify(logits_BKV: torch.Tensor, tokens_BK: torch.Tensor, probs_BKV: torch.Tensor | None,
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


def _verify_round(target: TargetModel, cache, token_B: torch.Tensor, proposal_BK: torch.Tensor,
                  probs_BKV: torch.Tensor | None, valid_BS: torch.Tensor, pos_B: torch.Tensor,
                  steps: torch.Tensor, temperature: float, generators: list[torch.Generator],
                  rows: list[int], stage) -> tuple[torch.Tensor, ...]:
    """One round's verification, the same in both implementations: the cached target
    forward on ``x_{T-1}, d_1..d_k`` (``token [B]`` then ``proposal [B, k]``) at
    positions ``pos + 1 + steps``, timed as ``verify_s``, and its acceptance. Returns
    ``(aux [B, k+1, 3*Ht], positions [B, k+1], n [B] accepted counts, token [B] the
    next token, kept [B, k+1] (``_kept``), nxt [B, k+1])``, ``nxt`` being each verified
    slot's next token (the proposal shifted, the target's token at slot ``n``)."""
    k = proposal_BK.shape[1]
    positions = pos_B[:, None] + 1 + steps  # x_{T-1}, d_1..d_k
    fresh = torch.ones(len(rows), k + 1, dtype=torch.bool, device=valid_BS.device)
    with stage("verify_s"):
        aux, logits = _target_forward(target, torch.cat((token_B[:, None], proposal_BK), 1),
                                      torch.cat((valid_BS, fresh), 1), positions, cache, k + 1)
    n, token = _verify(logits, proposal_BK, probs_BKV, temperature, generators, rows)
    kept = _kept(n, steps)
    nxt = torch.cat((proposal_BK, proposal_BK[:, :1]), 1).scatter(1, n[:, None].long(), token[:, None])
    return aux, positions, n, token, kept, nxt


def _prompt_list(prompts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Prompts ``[L]`` or ``[1, L]`` as ``[L]`` each; ValueError for none, an empty one
    or another shape."""
    bad = [p for p in prompts if p.numel() < 1 or not (p.dim() == 1 or p.dim() == 2 and p.shape[0] == 1)]
    if not prompts or bad:
        raise ValueError(f"need one or more non-empty prompts [L] or [1, L], got shapes "
                         f"{[tuple(p.shape) for p in prompts]}")
    return [p.reshape(-1) for p in prompts]


@dataclass
class StageTimes:
    """Where ``generate``'s time goes, filled when passed to it (``stages=``): every stage
    bracketed by device syncs (which slow the run a little), seconds summed over the
    batch's rounds. What no field names (``total_s`` minus the others) is bookkeeping:
    acceptance, rollback, compaction, finished rows leaving, the host's reading of the
    accepted counts, Python."""

    total_s: float = 0.0
    """Wall time of ``generate``."""
    prefill_s: float = 0.0
    """The target's prefill forward."""
    verify_s: float = 0.0
    """The target's verifying forwards (``k + 1`` tokens per row each)."""
    draft_context_s: float = 0.0
    """The draft's context rows: ``fc`` of the target's aux, step-0 keys and values, into
    the draft's cache (the prompts' included)."""
    draft_chain_s: float = 0.0
    """The draft's k-step chains."""
    record_s: float = 0.0
    """Recording the CUDA graphs (the static path on CUDA; each includes one eager run)."""
    rounds: int = 0
    """Verification rounds of the batch (each judges every live row)."""


class _Stage:
    """``with stage("verify_s"):`` adds the block's synchronised wall time to that field
    of ``StageTimes`` (nothing, not even a sync, when there is none)."""

    def __init__(self, times: StageTimes | None, device: torch.device) -> None:
        self.times, self.device, self.cuda = times, device, device.type == "cuda"

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.times is None:
            yield
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize(self.device)
        setattr(self.times, name, getattr(self.times, name) + time.perf_counter() - t0)


IMPLS = ("static", "dynamic")
"""``generate``'s implementations with the target on transformers' ``DynamicCache``."""

GRAPH = "graph"
"""``generate``'s implementation with the target on a ``decoding.StaticKVCache`` and CUDA
graphs for both sides (``evaluation.graphed``)."""


def default_impl(target: TargetModel, draft_params: dict[str, torch.Tensor]) -> str:
    """``generate``'s implementation when none is named: ``"graph"`` when the target and
    the draft are on one CUDA device and every target layer attends fully (the static
    cache's condition), else ``"static"`` for a CUDA draft, else ``"dynamic"``."""
    from eagle3fn.decoding.static_cache import check_full_attention

    device, draft_device = target.lm_head.weight.device, draft_params["fc.weight"].device
    if device.type == "cuda" and draft_device == device:
        try:
            check_full_attention(target.model.config)
            return GRAPH
        except ValueError:
            pass
    return "static" if draft_device.type == "cuda" else "dynamic"


@torch.no_grad()
def generate(target: TargetModel, tokenizer_or_none, draft_params: dict[str, torch.Tensor],
             draft_cfg: DraftConfig, d2t: torch.Tensor, prompts: Sequence[torch.Tensor],
             cfg: SpecConfig, *, impl: str | None = None,
             stages: StageTimes | None = None) -> list[SpecResult]:
    """Speculative decoding of several prompts at once, the target and the draft on KV
    caches (see the section comment): one ``SpecResult`` per prompt, each equal to
    ``speculative_generate`` of that prompt alone.

    Greedy output equals ``target.model.generate(do_sample=False)`` of each prompt token
    for token; sampling follows the standard rule with prompt i drawing from its own
    generator seeded ``cfg.seed + i`` (so it equals ``speculative_generate`` with that
    seed). Rows accept independently; a row that ends (EOS or ``max_new_tokens``) leaves
    the target's batch. One host sync per round (the accepted counts; sampling reads on
    the host).

    Args:
        target: from ``io.target.load_target`` (a text model whose forward takes
            ``past_key_values`` and ``position_ids``).
        tokenizer_or_none: only read for ``eos_token_id``.
        draft_params, draft_cfg, d2t: the draft (``init_params`` names, embed included)
            and its vocab map; any dtype, on any device.
        prompts: int64 ``[L_i]`` or ``[1, L_i]`` each, of any lengths.
        cfg: ``SpecConfig``.
        impl: ``"static"``: the draft on preallocated buffers of fixed shapes (its cache
            in doubling capacity, finished rows kept in place), so that on CUDA with
            greedy decoding each round's draft work is two CUDA-graph replays;
            ``"dynamic"``: the draft's cache grown by concatenation each round, finished
            rows removed, every kernel launched from Python. Both run the target on
            transformers' ``DynamicCache``. ``"graph"`` (``evaluation.graphed``): the
            target on a ``decoding.StaticKVCache`` of fixed shapes, its verifying
            forward (with acceptance and rollback when greedy) one CUDA-graph replay on
            CUDA, the draft as ``"static"``. All give the same tokens and accepted
            counts. None: ``default_impl``.
        stages: a ``StageTimes`` to fill (adds device syncs around every stage).
    """
    prompts = _prompt_list(prompts)
    _check_inputs(target, draft_cfg, d2t)
    if impl is None:
        impl = default_impl(target, draft_params)
    if impl not in IMPLS + (GRAPH,):
        raise ValueError(f"impl={impl!r} is not one of {IMPLS + (GRAPH,)}")
    stage = _Stage(stages, target.lm_head.weight.device)
    t0 = time.perf_counter()
    if impl == GRAPH:
        from eagle3fn.evaluation.graphed import generate_graphed as run
    else:
        run = _generate_static if impl == "static" else _generate_dynamic
    results = run(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage)
    if stages is not None:
        if stage.cuda:
            torch.cuda.synchronize(stage.device)
        stages.total_s += time.perf_counter() - t0
    return results


def _results(new: list[list[int]], accepted: list[list[int]], k: int) -> list[SpecResult]:
    out = []
    for tokens, counts in zip(new, accepted):
        length, per_position = acceptance_stats(counts, k)
        out.append(SpecResult(tokens=tokens, accepted_per_round=counts, acceptance_length=length,
                              per_position_acceptance=per_position, target_forwards=len(counts) + 1))
    return out


def _emit(new: list[list[int]], accepted: list[list[int]], rows: list[int], host: list[list[int]],
          eos: set[int], max_new: int) -> None:
    """Append each row's round (``host`` rows: accepted n, the target's token, the k
    proposals) to its tokens, stopping at EOS or ``max_new`` tokens."""
    for r, (count, t, *drafted) in zip(rows, host):
        accepted[r].append(count)
        for x in drafted[:count] + [t]:
            new[r].append(x)
            if x in eos or len(new[r]) == max_new:
                break


def _setup(target: TargetModel, tokenizer_or_none, draft_params: dict[str, torch.Tensor],
           draft_cfg: DraftConfig, prompts: list[torch.Tensor], cfg: SpecConfig):
    """What both implementations start from: ``(k, temperature, the target's device,
    EOS ids, one generator per prompt seeded cfg.seed + i, the target's token picker,
    the draft as a module)``."""
    generators = [torch.Generator().manual_seed(cfg.seed + i) for i in range(len(prompts))]
    return (cfg.num_draft_tokens, cfg.temperature, target.lm_head.weight.device,
            _eos_ids(target, tokenizer_or_none), generators, _picker(cfg.temperature, generators),
            _Draft(draft_params, draft_cfg))


def _live(rows: list[int], new: list[list[int]], cfg: SpecConfig, eos: set[int], stage) -> list[int]:
    """Positions in ``rows`` of the prompts still decoding (fewer than
    ``max_new_tokens`` new tokens, the last not an EOS); a round is counted in
    ``stage.times`` when any is."""
    live = [i for i, r in enumerate(rows) if len(new[r]) < cfg.max_new_tokens and new[r][-1] not in eos]
    if live and stage.times is not None:
        stage.times.rounds += 1
    return live


def _generate_dynamic(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage):
    """``generate`` with ``impl="dynamic"``."""
    from transformers import DynamicCache

    k, temperature, device, eos, generators, pick, draft = _setup(target, tokenizer_or_none, draft_params,
                                                                  draft_cfg, prompts, cfg)
    rows = list(range(len(prompts)))
    new: list[list[int]] = [[] for _ in rows]
    accepted: list[list[int]] = [[] for _ in rows]
    slots = [p.numel() for p in prompts]  # valid slots of each row

    ids, valid, pos = _left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    with stage("prefill_s"):
        aux, logits = _target_forward(target, ids, valid, pos, cache, 1)
    token = pick(logits[:, -1], rows)
    with stage("draft_context_s"):
        g, u, keys, values = draft.context(aux, torch.cat((ids[:, 1:], token[:, None]), 1).to(draft.device),
                                           pos.to(draft.device), valid.to(draft.device))
    g_t, u_t, pos_t = g[:, -1], u[:, -1], pos[:, -1]  # each row's last context row t
    dvalid = valid.to(draft.device)
    for b, t in enumerate(token.tolist()):
        new[b].append(t)
    steps = torch.arange(k + 1, device=device)
    while True:
        live = _live(rows, new, cfg, eos, stage)
        if not live:
            break
        if len(live) < len(rows):  # finished rows leave both caches
            index = torch.tensor(live, device=device)
            dindex = index.to(draft.device)
            cache.batch_select_indices(index)
            rows = [rows[i] for i in live]
            valid, pos_t, token = valid[index], pos_t[index], token[index]
            keys, values, dvalid = keys[dindex], values[dindex], dvalid[dindex]
            g_t, u_t = g_t[dindex], u_t[dindex]
        choose = _draft_chooser(d2t, draft_cfg.vocab_size, temperature, draft.device, generators, rows)
        with stage("draft_chain_s"):
            proposal, probs = draft.chain(g_t, u_t, pos_t.to(draft.device), keys, values, dvalid, k, choose)
        proposal = proposal.to(device)
        aux, positions, n, token, kept, nxt = _verify_round(target, cache, token, proposal, probs, valid, pos_t,
                                                            steps, temperature, generators, rows, stage)
        with stage("draft_context_s"):
            g, u, new_keys, new_values = draft.context(aux, nxt.to(draft.device), positions.to(draft.device),
                                                       kept.to(draft.device))
            keys, values = torch.cat((keys, new_keys), 2), torch.cat((values, new_values), 2)
        valid, dvalid = torch.cat((valid, kept), 1), torch.cat((dvalid, kept.to(draft.device)), 1)
        at = n.to(draft.device).long()
        g_t, u_t = g[torch.arange(len(rows)), at], u[torch.arange(len(rows)), at]
        pos_t = positions.gather(1, n[:, None].long())[:, 0]
        host = torch.cat((n[:, None], token[:, None], proposal), 1).tolist()  # the round's sync
        keys, values, dvalid = _crop(cache, keys, values, dvalid, k - max(h[0] for h in host))
        valid = valid[:, :dvalid.shape[1]]
        for r, (count, *_) in zip(rows, host):
            slots[r] += count + 1
        if valid.shape[1] > 2 * max(slots[r] for r in rows) + COMPACT_SLACK:  # mostly rolled back
            keys, values, dvalid = _compact(cache, keys, values, dvalid)
            valid = dvalid.to(device)
        _emit(new, accepted, rows, host, eos, cfg.max_new_tokens)
    return _results(new, accepted, k)


def _initial_capacity(slots: int) -> int:
    """The static draft cache's first capacity: the next power of two >= ``slots``, at
    least 64 (doubling from there keeps the recordings to a few per batch)."""
    return max(64, 1 << (slots - 1).bit_length())


def _generate_static(target, tokenizer_or_none, draft_params, draft_cfg, d2t, prompts, cfg, stage):
    """``generate`` with ``impl="static"`` (``_StaticDraft``): the same rounds as
    ``_generate_dynamic``; the target's side (cache, ``valid``, rows leaving, crop,
    compaction) is the same code."""
    from transformers import DynamicCache

    k, temperature, device, eos, generators, pick, draft = _setup(target, tokenizer_or_none, draft_params,
                                                                  draft_cfg, prompts, cfg)
    B = len(prompts)
    rows = list(range(B))
    new: list[list[int]] = [[] for _ in rows]
    accepted: list[list[int]] = [[] for _ in rows]
    slots = [p.numel() for p in prompts]  # valid slots of each row
    # One chooser for the whole batch (the recorded chain keeps the tensors it reads).
    choose = _draft_chooser(d2t, draft_cfg.vocab_size, temperature, draft.device, generators, rows)
    graph = draft.device.type == "cuda" and temperature == 0

    ids, valid, pos = _left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    with stage("prefill_s"):
        aux, logits = _target_forward(target, ids, valid, pos, cache, 1)
    token = pick(logits[:, -1], rows)
    S = ids.shape[1]  # cache slots in use (both caches)
    state = _StaticDraft(draft, B, k, aux.shape[-1], choose, graph, _initial_capacity(S + k + 1))
    with stage("draft_context_s"):
        dpos, dvalid = pos.to(draft.device), valid.to(draft.device)
        g, u, keys, values = draft.context(aux, torch.cat((ids[:, 1:], token[:, None]), 1).to(draft.device),
                                           dpos, dvalid)
        state.prefill(g, u, dpos, keys, values, dvalid)
    pos_t = pos[:, -1]
    for b, t in enumerate(token.tolist()):
        new[b].append(t)
    steps = torch.arange(k + 1, device=device)
    live_rows = None  # the live rows' indices into the buffers; None: all
    while True:
        live = _live(rows, new, cfg, eos, stage)
        if not live:
            break
        if len(live) < len(rows):  # finished rows leave the target's cache, keep their draft rows
            index = torch.tensor(live, device=device)
            cache.batch_select_indices(index)
            rows = [rows[i] for i in live]
            valid, pos_t, token = valid[index], pos_t[index], token[index]
            live_rows = torch.tensor(rows, device=draft.device)
        state.propose(S + k + 1, stage)
        proposal = (state.tokens.clone() if live_rows is None else state.tokens[live_rows]).to(device)
        probs = None if state.probs is None else state.probs if live_rows is None else state.probs[live_rows.cpu()]
        aux, positions, n, token, kept, nxt = _verify_round(target, cache, token, proposal, probs, valid, pos_t,
                                                            steps, temperature, generators, rows, stage)
        state.put(live_rows, aux=aux, nxt=nxt, pos=positions, n=n, kept=kept)
        if state.update.due:
            with stage("record_s"):
                state.update.prepare()
        with stage("draft_context_s"):
            state.update()
        valid = torch.cat((valid, kept), 1)
        pos_t = positions.gather(1, n[:, None].long())[:, 0]
        host = torch.cat((n[:, None], token[:, None], proposal), 1).tolist()  # the round's sync
        drop = k - max(h[0] for h in host)
        S += k + 1 - drop
        state.slots.add_(k + 1 - drop)
        if drop:  # no row kept these: off both caches (the draft's slots are invalid already)
            cache.crop(-drop)
            valid = valid[:, :S]
        for r, (count, *_) in zip(rows, host):
            slots[r] += count + 1
        if S > 2 * max(slots[r] for r in rows) + COMPACT_SLACK:  # mostly rolled back
            order = _compaction_order(valid)
            _compact_target(cache, order)
            state.compact(live_rows if live_rows is not None else state.rows, order, S, order.shape[1])
            valid, S = valid.gather(1, order), order.shape[1]
        _emit(new, accepted, rows, host, eos, cfg.max_new_tokens)
    return _results(new, accepted, k)


@torch.no_grad()
def target_generate(target: TargetModel, tokenizer_or_none, prompts: Sequence[torch.Tensor],
                    cfg: SpecConfig, *, impl: str | None = None) -> list[list[int]]:
    """The target alone, one token per cached forward, batched and stopped as
    ``generate`` (left padding, explicit positions, rows leaving when done): the new
    tokens of each prompt. Greedy, or sampling at ``cfg.temperature`` with prompt i's
    generator seeded ``cfg.seed + i``; the baseline of the speedup, so it runs the
    same forward as ``generate`` without the aux hooks. ``impl="graph"``: on
    ``generate(impl="graph")``'s path instead (``evaluation.graphed.target_generate_graphed``:
    a static cache, the decode step one CUDA-graph replay on CUDA); any other value or
    None: transformers' ``DynamicCache`` as ``"static"`` and ``"dynamic"`` run it."""
    from transformers import DynamicCache

    if impl == GRAPH:
        from eagle3fn.evaluation.graphed import target_generate_graphed

        return target_generate_graphed(target, tokenizer_or_none, prompts, cfg)
    prompts = _prompt_list(prompts)
    device = target.lm_head.weight.device
    eos = _eos_ids(target, tokenizer_or_none)
    generators = [torch.Generator().manual_seed(cfg.seed + i) for i in range(len(prompts))]
    pick = _picker(cfg.temperature, generators)
    rows = list(range(len(prompts)))
    new: list[list[int]] = [[] for _ in rows]
    ids, valid, pos = _left_pad(prompts, device)
    cache = DynamicCache(config=target.model.config)
    _, logits = _target_forward(target, ids, valid, pos, cache, 1, aux=False)
    pos_t = pos[:, -1]
    one = torch.ones(len(rows), 1, dtype=torch.bool, device=device)
    while True:
        token = pick(logits[:, -1], rows)
        for r, t in zip(rows, token.tolist()):
            new[r].append(t)
        live = [i for i, r in enumerate(rows) if len(new[r]) < cfg.max_new_tokens and new[r][-1] not in eos]
        if not live:
            return new
        if len(live) < len(rows):
            index = torch.tensor(live, device=device)
            cache.batch_select_indices(index)
            rows, valid, pos_t, token = [rows[i] for i in live], valid[index], pos_t[index], token[index]
        pos_t = pos_t + 1
        valid = torch.cat((valid, one[:len(rows)]), 1)
        _, logits = _target_forward(target, token[:, None], valid, pos_t[:, None], cache, 1, aux=False)


# -------------------------------------------------------------------------- evaluation


def _t2d(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    t2d = torch.zeros(vocab_size, dtype=torch.bool, device=d2t.device)
    t2d[d2t.long() + torch.arange(d2t.shape[0], device=d2t.device)] = True
    return t2d


@torch.no_grad()
def simulated_tau(target: TargetModel, draft_params: dict[str, torch.Tensor],
                  draft_cfg: DraftConfig, d2t: torch.Tensor, sequences: Sequence[torch.Tensor],
                  prompt_lengths: Sequence[int], ttt_length: int) -> Objective:
    """The training-time objective and metrics (``unrolled.ttt``, SPEC section 5) on texts.

    Each sequence (int64 ``[T_i]``, prompt + generated) is one right-padded sample of a
    batch; the loss mask is ``m_p = 1`` for ``p >= L_i - 1`` (``L_i`` its prompt length),
    so the supervised rows predict ``x_{L_i + 1}`` onward, the tokens that verification
    rounds judge. Returns the ``Objective``; ``tau = 1 + sum_j prod_{i<=j} acc_j``.
    """
    lengths = [int(s.numel()) for s in sequences]
    B, S = len(sequences), max(lengths)
    device = sequences[0].device
    ids = torch.zeros(B, S, dtype=torch.long, device=device)
    attention = torch.zeros(B, S, dtype=torch.long, device=device)
    loss_mask = torch.zeros(B, S, dtype=torch.bool, device=device)
    for b, (seq, L) in enumerate(zip(sequences, prompt_lengths)):
        ids[b, :seq.numel()] = seq.flatten()
        attention[b, :seq.numel()] = 1
        loss_mask[b, max(L - 1, 0):seq.numel()] = True
    features = target_features(target, ids, attention)
    weight = draft_params["fc.weight"]
    features = dataclasses.replace(features, aux=features.aux.to(weight.dtype))
    rowmap = build_rowmap(supervised_mask(loss_mask, attention), ttt_length)
    config = TTTConfig(draft=draft_cfg, ttt_length=ttt_length, fused_head=False)
    return ttt(draft_params, features, rowmap, config, d2t=d2t,
               t2d=_t2d(d2t, draft_cfg.vocab_size))


def evaluate(target: TargetModel, draft_params: dict[str, torch.Tensor], draft_cfg: DraftConfig,
             d2t: torch.Tensor, prompts: Sequence[torch.Tensor], cfg: SpecConfig, *,
             tokenizer=None, batch_size: int = 8, baseline: bool = True,
             impl: str | None = None) -> dict:
    """Speculative decoding of every prompt (``generate``, ``batch_size`` prompts at a
    time), timed beside the target alone on the same batches (``target_generate``), and
    the training-time tau on the speculative output.

    Args:
        prompts: int64 ``[L]`` or ``[1, L]`` each.
        tokenizer: EOS ids only (``generate``).
        batch_size: prompts decoded together (>= 1).
        baseline: also time the target alone (the speedup's denominator), on the
            decoding path of ``impl`` (``target_generate(impl=impl)``).
        impl: ``generate``'s implementation (None: ``default_impl``, ``"graph"`` on CUDA).

    Returns:
        ``acceptance_length`` (mean of ``accepted + 1`` over the rounds of all
        prompts), ``per_position_acceptance`` (k floats, rounds of all prompts pooled),
        ``n_prompts``, ``tokens`` (new tokens, all prompts), ``rounds``,
        ``target_forwards`` (prefills included), ``seconds`` and ``tokens_per_s``
        (wall clock of the speculative decoding), ``simulated_tau`` and ``simulated_acc``
        (k floats): ``unrolled.ttt``'s tau and per-step acc with ``ttt_length = k`` on the
        prompts + generated texts (``simulated_tau``). With ``baseline``:
        ``target_seconds``, ``target_tokens_per_s`` (the target alone, its own tokens),
        ``speedup`` (tokens/s with the draft over tokens/s alone) and ``same_as_target``
        (prompts whose two outputs are identical). Greedy: ``identity`` (one line) and
        ``near_ties``; every difference must be an argmax near-tie of the target
        (``evaluation.check_identity``), else ``OutputMismatch`` is raised. ``impl``:
        the implementation that ran (both sides).
    """
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = target.lm_head.weight.device
    prompts = [p.to(device) for p in _prompt_list(prompts)]
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    impl = default_impl(target, draft_params) if impl is None else impl

    def timed(fn):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = [r for batch in batches for r in fn(batch)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out, time.perf_counter() - t0

    results, seconds = timed(lambda batch: generate(target, tokenizer, draft_params, draft_cfg, d2t,
                                                    batch, cfg, impl=impl))
    rounds = [n for r in results for n in r.accepted_per_round]
    length, per_position = acceptance_stats(rounds, cfg.num_draft_tokens)
    tokens = sum(len(r.tokens) for r in results)
    out = {"acceptance_length": length, "per_position_acceptance": per_position,
           "n_prompts": len(prompts), "tokens": tokens, "rounds": len(rounds),
           "target_forwards": sum(r.target_forwards for r in results),
           "seconds": seconds, "tokens_per_s": tokens / seconds, "impl": impl}
    if baseline:
        alone, target_seconds = timed(lambda batch: target_generate(target, tokenizer, batch, cfg, impl=impl))
        target_tps = sum(map(len, alone)) / target_seconds
        out.update(target_seconds=target_seconds, target_tokens_per_s=target_tps,
                   speedup=out["tokens_per_s"] / target_tps,
                   same_as_target=sum(a == r.tokens for a, r in zip(alone, results)))
        if cfg.temperature == 0:  # raises OutputMismatch unless every difference is a near-tie
            report = check_identity(target.model, prompts, alone, [r.tokens for r in results])
            out.update(identity=report.line(), near_ties=len(report.near_ties))
    sequences = [torch.cat((p, p.new_tensor(r.tokens))) for p, r in zip(prompts, results)]
    sim = simulated_tau(target, draft_params, draft_cfg, d2t, sequences,
                        [p.numel() for p in prompts], cfg.num_draft_tokens)
    out.update(simulated_tau=float(sim.tau), simulated_acc=[float(a) for a in sim.acc])
    return out
