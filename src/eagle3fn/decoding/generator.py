"""Batched generation with continuous refill over a ``StaticKVCache``.

Legend: N requests, B slots (cache rows), M cache columns, T = the largest token limit,
V vocab, R requests admitted together.

Every slot decodes one request. A decode step is one ``[B, 1]`` forward of every slot's
pending token (``cached_forward``), then on the device: pick each slot's next token
(``pick_tokens``), append it to the slot's output row, advance the live slots, and mark a
slot done when its token is an EOS id or it reached its limit. On CUDA (``graph``) the
step is recorded once as a CUDA graph and replayed; on the CPU with ``compile`` it is
compiled once per (B, M) shape by inductor, the weights frozen into the graph, and attends
all M columns. Every ``check_every`` steps the host
reads which slots are done (the only host sync of the loop), yields their requests, and
refills those slots with the next pending prompts: the prompts are prefilled together
(left-padded, one forward, ``forward.prefill``), their keys and values copied into the
slots (``load_rows``), and their first token picked from the prefill logits. No slot
waits for another's answer.

Slot state (device): ``token [B]`` (picked, not yet in the cache), ``count [B]`` (tokens
picked), ``limit [B]``, ``done [B]`` (also True for an empty slot), ``out [B, T]``,
``u [B, T]`` (the request's uniforms), and the cache's ``n [B]`` = prompt length +
count - 1. A done slot keeps stepping on its own last token without moving (its column
n_b < M is rewritten with the same values), so every step has the same shapes. Without
a graph, each block of ``check_every`` steps attends only the first columns any slot can
reach in it (``set_window``, from a host-side upper bound per slot): the CPU's steps then
cost what a growing cache's would.

Memory: the cache (``static_cache.cache_bytes``: ``2 * L * B * g * M * d * itemsize``
with ``M = max prompt length + T``), plus one step's activations and the ``[B, V]``
logits, plus the prefill of up to ``prefill_tokens`` padded tokens.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, NamedTuple, Sequence

import torch
from torch import nn

from eagle3fn.decoding.forward import cache_kwarg, cached_forward, prefill
from eagle3fn.decoding.graphs import Graphed
from eagle3fn.decoding.pool import GraphPool, aligned
from eagle3fn.decoding.sampling import pick_tokens, request_uniforms
from eagle3fn.decoding.static_cache import StaticKVCache


WINDOW_STEP = 64
"""Eager decoding attends the first multiple of this many columns that covers every slot."""

COLUMN_ALIGN = 16
"""Cache columns are rounded up to a multiple of this (aligned mask and key rows for the
attention kernels), within ``max_len``."""

COMPILED_COLUMN_ALIGN = 256
"""With ``GenerateConfig.compile``, cache columns are rounded up to a multiple of this
(within ``max_len``): each distinct (slots, columns) shape compiles once, so calls whose
longest prompt differs by less than this share one compiled step."""


@dataclass(kw_only=True)
class GenerateConfig:
    """How ``generate`` decodes."""

    max_new_tokens: int = 512
    """New tokens per request at most (EOS included), unless ``generate`` gets per-request limits."""
    batch_size: int = 64
    """Slots B decoded together (rows of the static cache)."""
    temperature: float = 0.0
    """0: greedy (argmax); > 0: sampling from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus: sample among the fewest most probable tokens whose mass reaches top_p (1: all)."""
    seed: int = 0
    """Request i draws its uniforms from torch.Generator().manual_seed(seed + i) (see sampling.py)."""
    max_len: int | None = None
    """Cache columns M at most (None: max prompt length + the largest token limit)."""
    check_every: int = 8
    """Decode steps between host reads of the finished slots (a finished slot idles up to this many steps)."""
    prefill_tokens: int = 16384
    """Padded prompt tokens per prefill forward at most (bounds the prefill's activations)."""
    graph: bool | None = None
    """Record the decode step as a CUDA graph (None: on CUDA)."""
    compile: bool = False
    """CPU only: compile the decode step with torch.compile (inductor, the weights frozen
    into the graph, which also pre-packs bf16 weights for the CPU's matrix units). Costs
    tens of seconds once per (slots, columns) shape; worth it for long runs. Columns are
    then rounded up to ``COMPILED_COLUMN_ALIGN`` so that calls over prompts of other
    lengths reuse the compiled step."""
    attention: str = "grouped"
    """grouped: attention.grouped_attention (the cache read once per layer); model: the model's own."""
    eos_token_ids: tuple[int, ...] | None = None
    """Ids that end an answer (None: eos_token_ids(model, tokenizer))."""

    def __post_init__(self) -> None:
        checks = [("max_new_tokens", self.max_new_tokens >= 1, ">= 1"), ("batch_size", self.batch_size >= 1, ">= 1"),
                  ("temperature", self.temperature >= 0, ">= 0"), ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("check_every", self.check_every >= 1, ">= 1"), ("prefill_tokens", self.prefill_tokens >= 1, ">= 1"),
                  ("attention", self.attention in ("grouped", "model"), "'grouped' or 'model'")]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)} must be {want}")


class Finished(NamedTuple):
    """One request's answer: its index in the prompts, its new tokens (the EOS kept, as
    ``model.generate``), and whether it ended on an EOS id (False: cut at its limit)."""

    index: int
    tokens: list[int]
    eos: bool


@dataclass
class Counters:
    """What ``generate`` did so far: answers, new tokens, forwards and wall seconds
    (from the first request for output to the last answer)."""

    answers: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    prefills: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


def eos_token_ids(model: nn.Module, tokenizer=None) -> tuple[int, ...]:
    """The ids that end an answer: the model's ``generation_config.eos_token_id`` (what
    ``model.generate`` stops at) and the tokenizer's ``eos_token_id`` when given."""
    ids: set[int] = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                   getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None):
        if source is not None:
            ids.update([source] if isinstance(source, int) else [int(i) for i in source])
    return tuple(sorted(ids))


def _frozen(fn):
    """``fn()`` under inductor's ``freezing`` (read when a call compiles): the weights
    become constants of the graph, bf16 ones pre-packed for the CPU's matrix units."""
    import torch._inductor.config as inductor_config

    def call() -> None:
        with inductor_config.patch(freezing=True):
            fn()

    return call


class _Slots:
    """The slot state (module docstring) and the one decode step over it."""

    def __init__(self, model: nn.Module, B: int, M: int, T: int, cfg: GenerateConfig, eos: Sequence[int],
                 dtype: torch.dtype, device: torch.device) -> None:
        graph = device.type == "cuda" if cfg.graph is None else cfg.graph
        if graph and device.type != "cuda":
            raise ValueError(f"graph=True needs a CUDA model, this one is on {device}; leave graph=None")
        if cfg.compile and device.type != "cpu":
            raise ValueError(f"compile=True compiles the CPU's decode step, the model is on {device} "
                             "(CUDA records the step as a CUDA graph: leave compile off)")
        self.model, self.cfg, self.T = model, cfg, T
        self.cache = StaticKVCache(model.config, B, M, dtype=dtype, device=device)
        self.token = torch.zeros(B, dtype=torch.long, device=device)
        self.count = torch.zeros(B, dtype=torch.long, device=device)
        self.limit = torch.ones(B, dtype=torch.long, device=device)
        self.done = torch.ones(B, dtype=torch.bool, device=device)
        self.out = torch.zeros(B, T, dtype=torch.long, device=device)
        self.u = torch.zeros(B, T, dtype=torch.float64, device=device)
        self.eos = torch.tensor(list(eos), dtype=torch.long, device=device)
        step = self._step
        if cfg.compile:
            cache_kwarg(model)  # inspected here, eagerly: the traced step reads the cached answer
            step = _frozen(torch.compile(self._step, dynamic=False))
        self.step = Graphed(step, graph, device)
        self.bound = [0] * B  # host upper bound of each slot's n_b (eager windows)

    def _pick(self, logits_BV: torch.Tensor, u_B: torch.Tensor) -> torch.Tensor:
        return pick_tokens(logits_BV, u_B, self.cfg.temperature, self.cfg.top_p)

    def _ends(self, token_B: torch.Tensor) -> torch.Tensor:
        return torch.isin(token_B, self.eos) | (self.count >= self.limit)

    def _step(self) -> None:
        logits, _ = cached_forward(self.model, self.cache, self.token[:, None], keep=1, attn=self.cfg.attention)
        at = self.count.clamp_max(self.T - 1)[:, None]
        token = self._pick(logits[:, -1], self.u.gather(1, at)[:, 0])
        live = ~self.done
        self.out.scatter_(1, at, torch.where(live, token, self.out.gather(1, at)[:, 0])[:, None])
        self.cache.advance(live.long())
        self.count.add_(live.long())
        self.token.copy_(torch.where(live, token, self.token))
        self.done.logical_or_(live & self._ends(token))

    def set_window(self, steps: int) -> None:
        """Eager mode: attend only the columns any slot can hold in the next ``steps``
        steps (rounded up to ``WINDOW_STEP``); graph and compiled modes keep all M."""
        if self.step.graph or self.cfg.compile:
            return
        need = max(self.bound) + steps
        self.cache.window = min(self.cache.max_len, -(-need // WINDOW_STEP) * WINDOW_STEP)
        self.bound = [n + steps for n in self.bound]

    def record(self) -> None:
        """Record the step's CUDA graph if due; the warm-up run's effects on the slot
        state are undone (its cache writes repeat what the next step writes)."""
        if not self.step.due:
            return
        saved = [x.clone() for x in (self.token, self.count, self.done, self.out, self.cache.lengths)]
        self.step.prepare()
        for x, y in zip((self.token, self.count, self.done, self.out, self.cache.lengths), saved):
            x.copy_(y)

    def admit(self, slots: list[int], prompts: list[Sequence[int]], limits: list[int],
              uniforms: list[torch.Tensor]) -> None:
        """Prefill ``prompts`` into ``slots`` and pick their first tokens."""
        device = self.token.device
        tmp, logits, _, start, lengths = prefill(self.model, prompts, dtype=self.cache.dtype, device=device,
                                                 attn=self.cfg.attention)
        rows = torch.tensor(slots, dtype=torch.long, device=device)
        self.cache.load_rows(rows, tmp, start, lengths)
        u = torch.zeros(len(slots), self.T, dtype=torch.float64)
        for r, x in enumerate(uniforms):
            u[r, :x.numel()] = x
        u = u.to(device)
        token = self._pick(logits, u[:, 0])
        limit = torch.tensor(limits, dtype=torch.long, device=device)
        out = torch.zeros(len(slots), self.T, dtype=torch.long, device=device)
        out[:, 0] = token
        for buffer, x in ((self.token, token), (self.count, torch.ones_like(token)), (self.limit, limit),
                          (self.out, out), (self.u, u)):
            buffer.index_copy_(0, rows, x)
        self.done.index_copy_(0, rows, torch.isin(token, self.eos) | (limit <= 1))
        for b, p in zip(slots, prompts):
            self.bound[b] = len(p)


def _check(prompts: Sequence[Sequence[int]], limits: list[int], cfg: GenerateConfig, vocab: int,
           pool: GraphPool | None = None) -> int:
    """ValueError for bad requests before any work; returns M (longest prompt + largest
    limit, rounded up to ``COLUMN_ALIGN``, or ``pool.COLUMN_ALIGN`` when pooled, within
    ``cfg.max_len``)."""
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; every request needs at least one token")
    bad = [i for i, n in enumerate(limits) if n < 1]
    if bad:
        raise ValueError(f"max_new_tokens of request {bad[0]} is {limits[bad[0]]}; it must be >= 1")
    out_of_vocab = [(i, t) for i, p in enumerate(prompts) for t in p if not 0 <= t < vocab][:1]
    if out_of_vocab:
        raise ValueError(f"prompt {out_of_vocab[0][0]} has token id {out_of_vocab[0][1]} outside the vocab [0, {vocab})")
    M = max(len(p) for p in prompts) + max(limits)
    if cfg.max_len is not None and M > cfg.max_len:
        raise ValueError(f"the longest prompt plus max_new_tokens needs {M} cache columns but max_len={cfg.max_len}; "
                         "raise max_len or shorten the prompts")
    align = COMPILED_COLUMN_ALIGN if cfg.compile else COLUMN_ALIGN
    columns = aligned(M, pool, align)
    return columns if cfg.max_len is None or columns <= cfg.max_len else M


@torch.no_grad()
def generate(model: nn.Module, prompts: Sequence[Sequence[int]], cfg: GenerateConfig, *, tokenizer=None,
             max_new_tokens: Sequence[int] | None = None, seeds: Sequence[int] | None = None,
             counters: Counters | None = None, pool: GraphPool | None = None) -> Iterator[Finished]:
    """Decode every prompt; yield each request's ``Finished`` as soon as it ends (in
    finishing order, not prompt order).

    Greedy output equals ``model.generate(ids, do_sample=False, max_new_tokens=n)`` of
    each prompt alone. Sampling: request i's token t is ``pick_tokens`` of its logits
    with uniform t of ``request_uniforms(seeds[i] if seeds else cfg.seed + i, limit_i)``.

    Args:
        model: a HF causal LM (eval mode; its parameters' dtype and device are the
            cache's), whose attention layers use the ``Cache`` API, full attention only.
        prompts: N lists of token ids (no padding).
        cfg: ``GenerateConfig``.
        tokenizer: only read for ``eos_token_id`` (beside ``model.generation_config``).
        max_new_tokens: N per-request limits (None: ``cfg.max_new_tokens`` for all).
        seeds: N per-request seeds (None: ``cfg.seed + i``).
        counters: a ``Counters`` to fill as decoding goes.
        pool: a ``decoding.GraphPool``: the slot state and its recorded step are taken
            from it when an earlier call left one of this shape (columns rounded up to
            ``pool.COLUMN_ALIGN`` when the step is a CUDA graph) and put back when every
            request has been yielded.
    """
    N = len(prompts)
    limits = [cfg.max_new_tokens] * N if max_new_tokens is None else [int(n) for n in max_new_tokens]
    if len(limits) != N or (seeds is not None and len(seeds) != N):
        raise ValueError(f"max_new_tokens and seeds need one entry per prompt ({N})")
    if N == 0:
        return
    weight = model.get_output_embeddings().weight
    graph = weight.device.type == "cuda" if cfg.graph is None else cfg.graph
    # Columns rounded up for the pool only where steps are recorded: an eager step gains
    # nothing from a shared shape and would attend the extra columns.
    M = _check(prompts, limits, cfg, weight.shape[0], pool if graph else None)
    T = max(limits)
    eos = cfg.eos_token_ids if cfg.eos_token_ids is not None else eos_token_ids(model, tokenizer)
    counters = Counters() if counters is None else counters
    t0 = time.perf_counter()
    B = min(cfg.batch_size, N)
    key = ("decode", id(model), B, T, cfg.temperature, cfg.top_p, cfg.attention, cfg.compile, cfg.graph,
           tuple(eos), weight.dtype, str(weight.device))
    # A pooled state is handed back only after every request ended: all its slots are
    # done and free (``admit`` sets every field of a slot it fills); one with at least M
    # columns serves (the columns past a slot's length are never read).
    slots = pool.take(key, lambda s: s.cache.max_len >= M) if pool is not None else None
    if slots is None:
        slots = _Slots(model, B, M, T, cfg, eos, weight.dtype, weight.device)
    owner: list[int | None] = [None] * slots.token.shape[0]  # request decoded in each slot
    pending = deque(range(N))
    while True:
        free = [b for b, r in enumerate(owner) if r is None]
        _admit(slots, free, pending, owner, prompts, limits, seeds, cfg, counters)
        if all(r is None for r in owner):
            if pool is not None:
                pool.put(key, slots)
            break
        slots.record()
        slots.set_window(cfg.check_every)
        for _ in range(cfg.check_every):
            slots.step()
        counters.decode_steps += cfg.check_every
        done = slots.done.tolist()  # the loop's one host read
        ended = [b for b, r in enumerate(owner) if r is not None and done[b]]
        if not ended:
            continue
        rows = torch.tensor(ended, device=slots.token.device)
        host = torch.cat((slots.count[rows, None], slots.out[rows]), 1).tolist()
        eos_set = set(eos)
        for b, (count, *tokens) in zip(ended, host):
            tokens = tokens[:count]
            result = Finished(owner[b], tokens, tokens[-1] in eos_set)
            owner[b] = None
            slots.bound[b] = 0  # a free slot's column n_b may fall outside the window: never read
            counters.answers += 1
            counters.generated_tokens += count
            counters.seconds = time.perf_counter() - t0
            yield result


def _admit(slots: _Slots, free: list[int], pending: deque, owner: list, prompts, limits, seeds,
           cfg: GenerateConfig, counters: Counters) -> None:
    """Fill the free slots from ``pending`` (in order), in prefill forwards of at most
    ``cfg.prefill_tokens`` padded tokens."""
    while free and pending:
        take: list[int] = []
        width = 0
        while pending and len(take) < len(free):
            w = max(width, len(prompts[pending[0]]))
            if take and w * (len(take) + 1) > cfg.prefill_tokens:
                break
            take.append(pending.popleft())
            width = w
        chunk, free = free[:len(take)], free[len(take):]
        for b, i in zip(chunk, take):
            owner[b] = i
        uniforms = [request_uniforms(seeds[i] if seeds is not None else cfg.seed + i, limits[i])
                    if cfg.temperature > 0 else torch.zeros(0) for i in take]
        slots.admit(chunk, [prompts[i] for i in take], [limits[i] for i in take], uniforms)
        counters.prefills += 1
        counters.prefill_tokens += width * len(take)
