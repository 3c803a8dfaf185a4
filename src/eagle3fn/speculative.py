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

No KV cache anywhere: each round re-runs the target on the whole sequence and the draft's
step-0 keys on every context row. Exact and simple; meant for small models and CPU tests,
not for speed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from eagle3fn.align import supervised_mask
from eagle3fn.draft import DraftConfig, Eagle3Draft, apply_rope, elementwise, rope_cos_sin
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
             tokenizer=None) -> dict:
    """Speculative generation on every prompt, and the training-time tau on its output.

    Args:
        prompts: int64 ``[L]`` or ``[1, L]`` each.
        tokenizer: passed to ``speculative_generate`` (EOS ids only).

    Returns:
        ``acceptance_length`` (mean of ``accepted + 1`` over the rounds of all
        prompts), ``per_position_acceptance`` (k floats, rounds of all prompts pooled),
        ``n_prompts``, ``tokens`` (new tokens, all prompts), ``rounds``,
        ``target_forwards`` (prefills included), ``simulated_tau`` and ``simulated_acc``
        (k floats): ``unrolled.ttt``'s tau and per-step acc with ``ttt_length = k`` on the
        prompts + generated texts (``simulated_tau``).
    """
    if not prompts:
        raise ValueError("evaluate needs at least one prompt")
    prompts = [p.reshape(1, -1) for p in prompts]
    results = [speculative_generate(target, tokenizer, draft_params, draft_cfg, d2t, p, cfg)
               for p in prompts]
    rounds = [n for r in results for n in r.accepted_per_round]
    length, per_position = acceptance_stats(rounds, cfg.num_draft_tokens)
    sequences = [torch.cat((p[0], p.new_tensor(r.tokens))) for p, r in zip(prompts, results)]
    sim = simulated_tau(target, draft_params, draft_cfg, d2t, sequences,
                        [p.shape[1] for p in prompts], cfg.num_draft_tokens)
    return {
        "acceptance_length": length,
        "per_position_acceptance": per_position,
        "n_prompts": len(prompts),
        "tokens": sum(len(r.tokens) for r in results),
        "rounds": len(rounds),
        "target_forwards": sum(r.target_forwards for r in results),
        "simulated_tau": float(sim.tau),
        "simulated_acc": [float(a) for a in sim.acc],
    }
