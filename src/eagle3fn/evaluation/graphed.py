"""Speculative decoding and the target alone on one decoding path: a static KV cache and
CUDA graphs for both (``generate(impl="graph")``, its default on CUDA).

Legend: B rows (the batch's prompts; a finished row keeps its row), k draft tokens per
round, K = k + 1 tokens verified per row, M target cache columns, V vocab, A*Ht aux
width, W the widest prompt.

Target side: a ``decoding.StaticKVCache`` of B rows x M columns. Row b holds positions
``0..n_b - 1`` (``n_b`` = its prompt length + tokens emitted - 1: the last emitted
token is pending, not read yet). The prompts are prefilled together (``decoding.prefill``,
left-padded, with aux) and loaded into columns ``0..L_b - 1``. One round::

    chain    the draft's k steps from each row's last context row (``StaticDraft.chain``)
    verify   one target forward of [pending, d_1..d_k] ([B, K]) at positions
             n_b..n_b + k (``cached_forward``, the aux of the K positions), greedy
             acceptance on the device: n accepted, then the target's token; the
             rollback is ``n_b += n + 1`` (rejected columns are overwritten by the next
             round); the draft's inputs of the round are written in place
    update   the K verified positions into the draft's cache (``StaticDraft.update``)
    read     one host sync: each row's accepted count, token and proposals

The draft side is ``static_draft.StaticDraft``, fed exactly as ``impl="static"`` feeds it
(aux, next tokens, positions, accepted counts and kept slots of the K verified slots).
On CUDA with greedy decoding chain, verify and update are each one CUDA-graph replay
(``decoding.Graphed``), recorded once per batch (the draft's again when its cache
doubles); inside them the draft's elementwise chains are compiled kernels
(``FUSED_DRAFT``). Sampling replays the verifying forward only; its acceptance and the draft's
draws run on the host. Elsewhere (the CPU) the same functions run eagerly.

A row that ends (EOS, ``max_new_tokens``) stays in place: its length stops moving, its
verified slots are never kept in the draft's cache, and its later rounds are computed and
ignored. Capacity: a live row at a round's start has ``n_b <= L_b + max_new - 2`` and
writes columns up to ``n_b + k``; a row that ends inside a round has moved at most
``k + 1`` past that and then keeps writing ``K`` columns: ``M = max L_b + max_new + 2k``.

The target alone (``target_generate_graphed``) is ``decoding.generate``: the same static
cache, prefill and ``cached_forward``, its ``[B, 1]`` decode step one CUDA-graph replay,
on the same batches with the same ``max_new_tokens`` and EOS ids.

``kv``'s, ``verify``'s and ``static_draft``'s functions are read through their modules
at call time (a test's control put in their place is the one run).
"""

from __future__ import annotations

from typing import Sequence

import torch

from eagle3fn.decoding.forward import cached_forward, prefill
from eagle3fn.decoding.generator import COLUMN_ALIGN, GenerateConfig, generate as decode
from eagle3fn.decoding.graphs import Graphed
from eagle3fn.decoding.pool import GraphPool, aligned
from eagle3fn.decoding.static_cache import StaticKVCache
from eagle3fn.evaluation import kv, static_draft, verify
from eagle3fn.evaluation.config import eos_ids, prompt_list
from eagle3fn.evaluation.results import SpecResult, emit, results
from eagle3fn.evaluation.rounds import live_positions, setup
from eagle3fn.io.target import TargetModel


FUSED_DRAFT = True
"""On CUDA the draft's elementwise chains run as compiled kernels inside its graphs
(``cached_draft.Draft.fused``): about 40 fewer kernels per draft step. A benchmark sets it
False to measure what that buys."""

PREFILL_TOKENS = GenerateConfig.prefill_tokens
"""Padded prompt tokens per prefill forward at most, on both sides (``decoding.generate``'s
default): the grouped attention of a prefill holds ``[R, h, W, W]`` fp32 scores."""


def capacity(prompt_lengths: Sequence[int], max_new_tokens: int, k: int, pool: GraphPool | None = None) -> int:
    """Target cache columns M: ``max L + max_new_tokens + 2k`` (module docstring),
    rounded up to ``COLUMN_ALIGN`` (``pool.COLUMN_ALIGN`` when pooled)."""
    return aligned(max(prompt_lengths) + max_new_tokens + 2 * k, pool, COLUMN_ALIGN)


def kept_columns(n_B: torch.Tensor, live_B: torch.Tensor) -> torch.Tensor:
    """``[B]``: the columns each row keeps of its K verified ones, ``n + 1`` (the pending
    token and the accepted drafts; the target's new token is the next pending one), 0
    for a finished row. ``n_b += kept_columns`` is the whole rollback."""
    return torch.where(live_B, n_B + 1, 0)


def _use_graphs(device: torch.device, draft_device: torch.device) -> bool:
    """CUDA graphs for the batch: the target and the draft on one CUDA device (a graph
    records one device's kernels; a copy between devices inside it would not replay)."""
    return device.type == "cuda" and draft_device == device


class _Verifier:
    """The target's side of a batch: its cache and the round's verifying forward.

    Buffers: ``token [B]`` (pending tokens), ``live [B]`` bool, ``n [B]`` (accepted
    counts of the last round); with sampling, ``logits [B, K, V]`` and ``aux [B, K, A*Ht]``
    of the last forward. ``step`` is the graphed function: with greedy decoding the whole
    round (forward, acceptance, rollback, the draft's inputs), with sampling the forward.
    """

    def __init__(self, target: TargetModel, cache: StaticKVCache, state, token_B: torch.Tensor,
                 greedy: bool, graph: bool) -> None:
        self.target, self.cache, self.state, self.greedy = target, cache, state, greedy
        device = token_B.device
        B, K = token_B.shape[0], state.tokens.shape[1] + 1
        self.token = token_B.clone()
        self.live = torch.ones(B, dtype=torch.bool, device=device)
        self.n = torch.zeros(B, dtype=torch.long, device=device)
        self.steps = torch.arange(K, device=device)
        if not greedy:
            V, width = target.lm_head.weight.shape[0], state.aux.shape[-1]
            self.logits = torch.zeros(B, K, V, dtype=cache.dtype, device=device)
            self.aux = torch.zeros(B, K, width, dtype=cache.dtype, device=device)
        self.step = Graphed(self._greedy_round if greedy else self._sampled_forward, graph, device)

    def reset(self, token_B: torch.Tensor) -> None:
        """A pooled verifier's next batch: pending tokens ``token``, every row live."""
        self.token.copy_(token_B)
        self.live.fill_(True)
        self.n.zero_()

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits ``[B, K, V]`` and aux ``[B, K, A*Ht]`` of ``[token, proposals]``."""
        ids = torch.cat((self.token[:, None], self.state.tokens.to(self.token.device)), 1)
        logits, aux = cached_forward(self.target.model, self.cache, ids, keep=ids.shape[1],
                                     aux_layers=self.target.aux_layer_ids, layers=self.target.backbone.layers)
        return logits, aux

    def _greedy_round(self) -> None:
        logits, aux = self._forward()
        proposal = self.state.tokens.to(self.token.device)
        n, token = verify.verify_batch(logits, proposal, None, 0.0, [], [])
        self._finish(aux, n, token)

    def _sampled_forward(self) -> None:
        logits, aux = self._forward()
        self.logits.copy_(logits)
        self.aux.copy_(aux)

    def _finish(self, aux_BKA: torch.Tensor, n_B: torch.Tensor, token_B: torch.Tensor) -> None:
        """Write the draft's round inputs, the accepted counts, the rollback and the
        pending tokens (finished rows: nothing kept, length and token unchanged)."""
        proposal = self.state.tokens.to(self.token.device)
        positions = self.cache.position_ids(self.steps.shape[0])  # before the rollback moves n_b
        kept = (self.steps[None] <= n_B[:, None]) & self.live[:, None]
        nxt = torch.cat((proposal, proposal[:, :1]), 1).scatter(1, n_B[:, None], token_B[:, None])
        for name, x in (("aux", aux_BKA), ("nxt", nxt), ("pos", positions), ("n", n_B), ("kept", kept)):
            getattr(self.state, name).copy_(x)
        self.n.copy_(n_B)
        self.cache.advance(kept_columns(n_B, self.live))
        self.token.copy_(torch.where(self.live, token_B, self.token))

    def record(self) -> None:
        """Record ``step``'s CUDA graph if due; the warm-up run's effects on the lengths
        and pending tokens are undone (its other writes repeat what the next step writes)."""
        if not self.step.due:
            return
        saved = [x.clone() for x in (self.token, self.cache.lengths)]
        self.step.prepare()
        for x, y in zip((self.token, self.cache.lengths), saved):
            x.copy_(y)

    def verify(self, live: list[int], temperature: float, generators: list[torch.Generator]) -> None:
        """One round's verification of the live rows (``live``: their indices)."""
        self.step()
        if self.greedy:
            return
        index = torch.tensor(live, device=self.token.device)
        probs = self.state.probs[index.cpu()]
        n, token = verify.verify_batch(self.logits[index], self.state.tokens.to(index.device)[index], probs,
                                       temperature, generators, live)
        n_B = torch.zeros_like(self.n).index_copy_(0, index, n)
        token_B = self.token.clone().index_copy_(0, index, token)
        self._finish(self.aux, n_B, token_B)


def _chunks(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive prompt indices in prefill chunks of at most ``budget`` padded tokens
    (one prompt at least), the rule by which ``decoding.generate`` admits a batch."""
    chunks: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if chunks and max(width, n) * (len(chunks[-1]) + 1) <= budget:
            chunks[-1].append(i)
            width = max(width, n)
        else:
            chunks.append([i])
            width = n
    return chunks


def _prefill(target: TargetModel, prompts: list[torch.Tensor], M: int, cache: StaticKVCache | None = None,
             ) -> tuple[StaticKVCache, torch.Tensor, torch.Tensor]:
    """The prompts into a fresh ``StaticKVCache`` of ``B`` rows x ``M`` columns, in the
    chunks ``decoding.generate`` prefills them in (``_chunks``; the target alone's first
    tokens are then bitwise these): ``(cache, logits [B, V] at each last prompt token,
    aux [B, W, A*Ht] left-padded)``. ``cache``: a pooled one of ``B`` rows x ``M``
    columns to load instead (every row's length is set by its load)."""
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    B, W = len(prompts), max(p.numel() for p in prompts)
    if cache is None:
        cache = StaticKVCache(target.model.config, B, M, dtype=dtype, device=device)
    logits = aux = None
    for chunk in _chunks([p.numel() for p in prompts], PREFILL_TOKENS):
        tmp, z, a, start, lengths = prefill(target.model, [prompts[i].tolist() for i in chunk], dtype=dtype,
                                            device=device, aux_layers=target.aux_layer_ids,
                                            layers=target.backbone.layers)
        rows = torch.tensor(chunk, device=device)
        cache.load_rows(rows, tmp, start, lengths)
        if logits is None:
            logits, aux = z.new_zeros(B, z.shape[-1]), a.new_zeros(B, W, a.shape[-1])
        logits[rows] = z
        aux[rows, W - a.shape[1]:] = a  # left-padded: the prompts end at column W - 1
    return cache, logits, aux


@torch.no_grad()
def generate_graphed(target: TargetModel, tokenizer_or_none, draft_params: dict[str, torch.Tensor], draft_cfg,
                     d2t: torch.Tensor, prompts: list[torch.Tensor], cfg, stage,
                     pool: GraphPool | None = None) -> list[SpecResult]:
    """``generation.generate`` with ``impl="graph"`` (module docstring): one
    ``SpecResult`` per prompt, the tokens and accepted counts of ``impl="static"``.

    Args:
        prompts: int64 ``[L_i]`` each (``config.prompt_list``'s output).
        cfg: ``SpecConfig``; stage: ``timing.Stage`` (stage timings).
        pool: a ``decoding.GraphPool`` (greedy decoding): the target's cache, the
            draft's state and their recorded graphs are taken from it when an earlier
            call of the same shapes, target and draft left them (columns rounded up to
            ``pool.COLUMN_ALIGN`` on CUDA, where the rounds are recorded), and put back at
            the end.
    """
    k, temperature, device, eos, generators, pick, draft = setup(target, tokenizer_or_none, draft_params,
                                                                 draft_cfg, prompts, cfg)
    B = len(prompts)
    rows = list(range(B))
    new: list[list[int]] = [[] for _ in rows]
    accepted: list[list[int]] = [[] for _ in rows]
    slots = [p.numel() for p in prompts]  # valid draft slots of each row (compaction rule)
    choose = verify.draft_chooser(d2t, draft_cfg.vocab_size, temperature, draft.device, generators, rows)
    graph = _use_graphs(device, draft.device)
    draft.fused = graph and FUSED_DRAFT
    pool = pool if temperature == 0 else None
    M = capacity(slots, cfg.max_new_tokens, k, pool if graph else None)  # rounded up only where recorded
    # The recorded graphs read the draft's tensors by address (the entry keeps them alive
    # through its Draft, and d2t and the config itself); a cache of at least M columns serves.
    key = ("spec", id(target), B, k, tuple(t.data_ptr() for t in draft_params.values()), id(d2t),
           id(draft_cfg), draft.fused, graph)
    entry = pool.take(key, lambda e: e[0].max_len >= M) if pool is not None else None

    ids, valid, pos = kv.left_pad(prompts, device)
    with stage("prefill_s"):
        cache, logits, aux = _prefill(target, prompts, M, entry[0] if entry else None)
    token = pick(logits, rows)
    S = ids.shape[1]  # draft cache slots in use
    if entry is None:
        state = static_draft.StaticDraft(draft, B, k, aux.shape[-1], choose, graph and temperature == 0,
                                         static_draft.initial_capacity(S + k + 1))
    else:
        state = entry[1]
    with stage("draft_context_s"):
        dpos, dvalid = pos.to(draft.device), valid.to(draft.device)
        g, u, keys, values = draft.context(aux, torch.cat((ids[:, 1:], token[:, None]), 1).to(draft.device),
                                           dpos, dvalid)
        state.prefill(g, u, dpos, keys, values, dvalid)
    if entry is None:
        verifier = _Verifier(target, cache, state, token, temperature == 0, graph)
    else:
        verifier = entry[2]
        verifier.reset(token)
    for b, t in enumerate(token.tolist()):
        new[b].append(t)
    was_live = rows
    while True:
        live = live_positions(rows, new, cfg, eos, stage)
        if not live:
            break
        if live != was_live:  # rows ended: they stop keeping anything
            verifier.live.copy_(torch.tensor([b in live for b in rows], device=device))
            was_live = live
        _round(state, verifier, S, k, live, temperature, generators, stage)
        host = torch.cat((verifier.n[:, None], verifier.token[:, None], state.tokens.to(device)), 1).tolist()
        host = [host[b] for b in live]  # the round's sync
        drop = k - max(h[0] for h in host)  # trailing slots no row kept: reused next round
        S += k + 1 - drop
        state.slots.add_(k + 1 - drop)
        for b, (count, *_) in zip(live, host):
            slots[b] += count + 1
        # Mostly rolled back; finished rows count too, as compaction keeps their slots.
        if S > 2 * max(slots) + kv.COMPACT_SLACK:
            order = kv.compaction_order(state.valid[:, :S])
            state.compact(state.rows, order, S, order.shape[1])
            S = order.shape[1]
        emit(new, accepted, live, host, eos, cfg.max_new_tokens)
    if pool is not None:
        pool.put(key, (cache, state, verifier, d2t, draft_cfg))
    return results(new, accepted, k)


def _round(state, verifier: _Verifier, S: int, k: int, live: list[int], temperature: float,
           generators: list[torch.Generator], stage) -> None:
    """Chain, verify, update (module docstring) with ``S`` draft slots in use, recording
    what is due."""
    state.propose(S + k + 1, stage)
    if verifier.step.due:
        with stage("record_s"):
            verifier.record()
    with stage("verify_s"):
        verifier.verify(live, temperature, generators)
    if state.update.due:
        with stage("record_s"):
            state.update.prepare()
    with stage("draft_context_s"):
        state.update()


@torch.no_grad()
def target_generate_graphed(target: TargetModel, tokenizer_or_none, prompts: Sequence[torch.Tensor],
                            cfg, pool: GraphPool | None = None) -> list[list[int]]:
    """The target alone on ``impl="graph"``'s path: ``decoding.generate`` (static cache,
    the ``[B, 1]`` decode step one CUDA-graph replay on CUDA) of the prompts as one batch,
    ``cfg.max_new_tokens`` each, stopping at ``config.eos_ids``: the new tokens of
    each prompt, in prompt order. Greedy output equals ``target_generate``'s; sampling
    draws request i's uniforms from seed ``cfg.seed + i`` (``decoding.request_uniforms``),
    so its samples differ from ``target_generate``'s (same distribution). ``pool``: the
    decode step's state and graph reused across calls (``decoding.generate``'s)."""
    prompts = prompt_list(prompts)
    eos = eos_ids(target, tokenizer_or_none)
    gen = GenerateConfig(max_new_tokens=cfg.max_new_tokens, batch_size=len(prompts), temperature=cfg.temperature,
                         seed=cfg.seed, eos_token_ids=tuple(sorted(eos)), prefill_tokens=PREFILL_TOKENS)
    out: list[list[int]] = [[] for _ in prompts]
    pool = pool if cfg.temperature == 0 else None  # as the speculative side: greedy only
    for index, tokens, _ in decode(target.model, [p.tolist() for p in prompts], gen, pool=pool):
        out[index] = tokens
    return out
