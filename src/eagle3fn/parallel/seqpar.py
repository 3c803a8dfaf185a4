"""Sequence parallelism (SPEC section 7): the split, the cross-rank step-0 attention
(ring P2P with log-sum-exp merge, Ulysses all-to-all, and their product) and the
reduction of the per-step sums.

Legend: B batch, L global padded length, sp sequence-parallel degree, C = ceil(L/sp)
own rows per rank, k TTT length, T = C + k local buffer, h query heads, g kv heads,
d head dim, u Ulysses degree, R ring degree.

Rank ``r`` owns positions ``[r*C, (r+1)*C)`` and holds the next k (the overlap tail,
zero past L): tail positions teach its rows at deeper steps but never emit rows
(``build_rowmap(..., num_rows=C)``). The backbone runs on own rows; at every step the
queries attend to the step-0 keys of all earlier positions (other ranks' too, at
global RoPE positions) plus their own diagonal keys, which never leave the rank.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange, repeat

from eagle3fn.errors import UsageError
from eagle3fn.parallel.mesh import Layout
from eagle3fn.shapes import Features, StepTerms
from eagle3fn.unrolled import (Collectives, PackedLayout, block_tables,
                               merge_blocks, merge_diagonal_as, pack_queries, packed_flex_attention,
                               packed_keys, packed_layout)


def chunk_window(length: int, sp: int, sp_rank: int, ttt_length: int) -> tuple[int, int]:
    """Positions ``[r*C, r*C + C + k)`` rank r holds (own chunk + tail), ``C = ceil(L/sp)``;
    the stop may pass ``length`` (zeros there)."""
    C = -(-length // sp)
    return sp_rank * C, sp_rank * C + C + ttt_length


def shard_sequence(features: Features, supervised_BL: torch.Tensor, sp: int, sp_rank: int,
                   ttt_length: int, windowed: tuple[str, ...] = ()) -> tuple[Features, torch.Tensor, int]:
    """This rank's chunk of a batch: own positions ``[r*C, (r+1)*C)`` plus a k tail.

    Args:
        features: the whole batch, ``[B, L, ...]`` (``target_head`` is shared).
        supervised_BL: bool ``[B, L]``, ``align.supervised_mask`` of the whole batch
            (computed before the split: the last-token rule needs the global length).
        sp, sp_rank: sequence-parallel degree and this rank's chunk.
        ttt_length: k.
        windowed: names of ``features`` fields already cut to ``chunk_window`` (e.g.
            read so from an offline cache); they are only zero-padded.

    Returns:
        ``(features [B, T, ...], supervised [B, T], C)`` with ``T = C + k``; positions
        past L are zeros (ids, features, attention mask, supervision) and RoPE
        positions are global.
    """
    B, L = features.input_ids.shape
    if sp < 1 or not 0 <= sp_rank < sp:
        raise ValueError(f"sp_rank must be in [0, sp={sp}), got {sp_rank}")
    if ttt_length < 1:
        raise ValueError(f"ttt_length must be >= 1, got {ttt_length}")
    C = -(-L // sp)
    T = C + ttt_length
    start = sp_rank * C

    def take(x, cut=True):
        if x is None:
            return None
        x = x[:, start:start + T] if cut else x
        short = T - x.shape[1]
        if short:
            x = torch.cat([x, x.new_zeros((B, short) + tuple(x.shape[2:]))], dim=1)
        return x

    positions = features.positions
    if positions is None:
        positions = torch.arange(L, device=features.input_ids.device).expand(B, -1)
    elif sp > 1 and bool((positions[:, 1:] != positions[:, :-1] + 1).any()):
        # The cross-rank attention and the row maps of a chunk know no document bounds.
        raise UsageError("a packed batch (positions restarting per document) cannot be split by "
                         "sequence parallelism; train it with --parallel.ring 1 --parallel.ulysses 1 "
                         "or with --no-pack")
    last = positions[:, -1:]
    extended = torch.cat([positions, last + torch.arange(1, T + 1, device=last.device)], dim=1)
    local = Features(
        input_ids=take(features.input_ids),
        aux=take(features.aux, "aux" not in windowed),
        attention_mask=take(features.attention_mask),
        target_logits=take(features.target_logits, "target_logits" not in windowed),
        final_hidden=take(features.final_hidden, "final_hidden" not in windowed),
        target_head=features.target_head,
        positions=extended[:, start:start + T],
    )
    return local, take(supervised_BL), C


# ---- differentiable collectives -------------------------------------------------

def _global(group, index: int) -> int:
    return dist.get_global_rank(group, index)


def _shift(x: torch.Tensor, group, send_to: int, recv_from: int) -> torch.Tensor:
    """Send ``x`` to group rank ``send_to`` and receive a like tensor from ``recv_from``."""
    out = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x.contiguous(), _global(group, send_to), group),
           dist.P2POp(dist.irecv, out, _global(group, recv_from), group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return out


class _RingPass(torch.autograd.Function):
    """``blocks[t]`` = ``x`` of ring rank ``(r - t) mod R`` for ``t < R`` (one P2P hop
    per t). Backward sends each block's gradient back along the ring to its owner."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        R, r = dist.get_world_size(group), dist.get_rank(group)
        blocks, current = [x.view_as(x)], x
        for _ in range(1, R):
            current = _shift(current, group, (r + 1) % R, (r - 1) % R)
            blocks.append(current)
        return tuple(blocks)

    @staticmethod
    def backward(ctx, *grads):
        group = ctx.group
        R, r = dist.get_world_size(group), dist.get_rank(group)
        # After m hops acc holds the gradient, from ranks r..r+m, of the block owned by
        # rank r+m+1; after R-1 hops, of this rank's own block from every rank.
        acc = grads[R - 1].contiguous()
        for m in range(1, R):
            acc = _shift(acc, group, (r - 1) % R, (r + 1) % R) + grads[R - 1 - m]
        return acc, None


def ring_pass(x: torch.Tensor, group) -> tuple[torch.Tensor, ...]:
    """Every ring rank's ``x``: entry t is ring rank ``(r - t) mod R``'s (differentiable)."""
    return _RingPass.apply(x, group)


def _seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """``[B, n, C, d]`` (all heads, this rank's chunk) -> ``[B, n/u, u*C, d]`` (this
    rank's heads, the whole sequence): head group ``r`` goes to rank ``r``."""
    u = dist.get_world_size(group)
    send = rearrange(x, "b (u m) c d -> u b m c d", u=u).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's chunk
    return rearrange(recv, "u b m c d -> b m (u c) d")


def _heads_to_seq(y: torch.Tensor, group) -> torch.Tensor:
    """``[B, m, u*C, d]`` (this rank's heads, the whole sequence) -> ``[B, u*m, C, d]``
    (all heads, this rank's chunk): the inverse of ``_seq_to_heads``."""
    u = dist.get_world_size(group)
    send = rearrange(y, "b m (u c) d -> u b m c d", u=u).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[r]: rank r's head group
    return rearrange(recv, "u b m c d -> b (u m) c d")


class _UlyssesAllToAll(torch.autograd.Function):
    """Ulysses all-to-all: ``to_heads`` maps ``[B, n, C, d]`` (sequence-sharded) to
    ``[B, n/u, u*C, d]`` (head-sharded), else the inverse; the adjoint of either is
    the other."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.group), None, None


def _all_gather_seq(x_BC: torch.Tensor, group) -> torch.Tensor:
    """``[B, C]`` (no grad) -> ``[B, u*C]`` in group-rank order."""
    parts = [torch.empty_like(x_BC) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x_BC.contiguous(), group=group)
    return torch.cat(parts, dim=1)


# ---- attention ----------------------------------------------------------------------

def _partial_attention(q, k, v, allowed, diag=()):
    """Attention of ``q [B, h, S, d]`` over ``k, v [B, h, Sk, d]`` where ``allowed``
    (broadcast to ``[B, h, S, Sk]``), plus per-row diagonal keys ``diag`` (pairs of
    ``[B, h, S, d]``). Returns ``(out [B, h, S, d], lse [B, h, S])``; softmax in fp32
    (fp64 for fp64), as ``unrolled.eager_attention``."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    extra = [((q * kd).sum(-1) * scale)[..., None] for kd, _ in diag]
    scores = torch.cat([scores, *extra], dim=-1).to(acc)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).to(q.dtype)
    Sk = k.shape[2]
    out = probs[..., :Sk] @ v
    for i, (_, vd) in enumerate(diag):
        out = out + probs[..., Sk + i, None] * vd
    return out, lse


def _prefix_lengths(valid_BS: torch.Tensor) -> torch.Tensor:
    """Real rows per sample of a right-padded validity mask ``[B, S]`` (int64 ``[B]``);
    a mask that is not a prefix is refused (the flex path sees keys ``0..n-1``)."""
    n = valid_BS.sum(1)
    prefix = torch.arange(valid_BS.shape[1], device=valid_BS.device)[None] < n[:, None]
    if not torch.equal(prefix, valid_BS):
        raise ValueError("sequence-parallel FlexAttention needs right-padded attention masks "
                         "(real tokens first); left-pad or gaps found: pad on the right, or "
                         "run the eager attention (TTTConfig(attention='eager'))")
    return n


def ring_block_attention(q: torch.Tensor, own: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                         earlier: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = (),
                         diag: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), impl: str = "eager",
                         cache: dict | None = None, *,
                         kernel_options: tuple[tuple[str, object], ...] | None = None,
                         fused: bool) -> torch.Tensor:
    """The EAGLE-3 step attention of one (super-)chunk's queries over its own step-0 keys
    (causal), the step-0 keys of earlier chunks (in full) and each row's diagonal keys,
    merged by log-sum-exp: the local part of ``SequenceParallelAttention``, with no
    communication.

    Args:
        q: ``[B, hq, S, d]`` queries (RoPE applied) at their own positions.
        own: ``(k, v, valid)``: this chunk's step-0 keys/values ``[B, g, S, d]`` and key
            validity ``[B, S]`` bool; query ``i`` sees own keys ``<= i`` that are valid.
        earlier: ``(k, v, valid)`` of each earlier chunk (same shapes), seen wherever valid.
        diag: ``(k, v)`` ``[B, g, S, d]`` per step ``1..j``: each row's own keys.
        impl: ``eager`` (explicit ``[B, hq, S, S]`` scores, fp32 softmax, any device and
            dtype, autograd) or ``flex`` (FlexAttention per block with block-sparse
            tables, memory linear in S, the diagonal keys merged by
            ``unrolled.merge_diagonal``; needs right-padded validity; backward on CUDA
            only).
        cache: a dict kept across the steps of one batch (the flex path packs each
            block's keys and builds its layout once; they are the same at every step).
        kernel_options, fused: the flex path's ``TTTConfig.flex_kernel_options`` and
            ``TTTConfig.compile_elementwise`` (the diagonal merge's kernel).

    Returns:
        ``[B, hq, S, d]`` in ``q``'s dtype.
    """
    if impl == "flex":
        return _flex_blocks(q, own, earlier, diag, {} if cache is None else cache,
                            kernel_options, fused)
    if impl != "eager":
        raise ValueError(f"impl must be 'eager' or 'flex', got {impl!r}")
    hq, S = q.shape[1], q.shape[2]
    expand = lambda x: repeat(x, "b g s d -> b (g r) s d", r=hq // x.shape[1])  # noqa: E731 - GQA
    k0, v0, valid = own
    causal = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid[:, None, None, :]
    out, lse = _partial_attention(q, expand(k0), expand(v0), allowed,
                                  [(expand(k), expand(v)) for k, v in diag])
    # The eager merge keeps its own form (logaddexp, weights in out's dtype): its lse is
    # always finite, and the training tests' 1e-4 fp32 tolerance is set on its rounding.
    for k_t, v_t, valid_t in earlier:
        o_t, lse_t = _partial_attention(q, expand(k_t), expand(v_t), valid_t[:, None, None, :])
        total = torch.logaddexp(lse, lse_t)
        out = (torch.exp(lse - total)[..., None].to(out.dtype) * out
               + torch.exp(lse_t - total)[..., None].to(out.dtype) * o_t)
        lse = total
    return out


def _flex_blocks(q, own, earlier, diag, cache, kernel_options, fused):
    """``ring_block_attention``'s flex path: rows flattened to ``N = B*S`` packed
    queries (``unrolled.packed_flex_attention``), one BlockMask per block."""
    B, hq, S, d = q.shape
    N = B * S
    flat = lambda x: rearrange(x, "b h s d -> (b s) h d")  # noqa: E731
    q_N = flat(q)
    if "blocks" not in cache:  # once per batch: packed keys, lengths and layouts of every block
        rows = torch.arange(N, device=q.device)
        keys = packed_keys(flat(own[0]), flat(own[1]))
        Lp = keys[0].shape[2]
        lengths = _prefix_lengths(own[2])
        layout = packed_layout(rows, lengths, S, Lp)
        blocks = [(keys, lengths, layout)]
        for k_t, v_t, valid_t in earlier:
            n_t = _prefix_lengths(valid_t)
            last = layout.start + n_t[layout.start // S] - 1  # the whole real block
            blocks.append((packed_keys(flat(k_t), flat(v_t)), n_t,
                           PackedLayout(N, layout.start, last, block_tables(layout.start, last, N, Lp))))
        cache.update(rows=rows, blocks=blocks, num_packed=layout.start.shape[0])
    rows = cache["rows"]
    q_packed = pack_queries(q_N, cache["num_packed"])  # once for all blocks
    out = lse = None
    for keys, lengths, layout in cache["blocks"]:
        o_t, lse_t = packed_flex_attention(q_N, rows, keys, None, lengths, S, layout, return_lse=True,
                                           q_packed=q_packed, kernel_options=kernel_options, fused=fused)
        if out is None:
            out, lse = o_t, lse_t
        else:
            out, lse = merge_blocks(out, lse, o_t, lse_t)
    if diag:
        k_j = torch.stack([flat(k) for k, _ in diag])
        v_j = torch.stack([flat(v) for _, v in diag])
        out = merge_diagonal_as(fused)(out, lse, q_N, k_j, v_j, 1.0 / math.sqrt(d))
    return rearrange(out, "(b s) h d -> b h s d", b=B)


class SequenceParallelAttention:
    """``Collectives.attend`` for one batch: the EAGLE-3 step attention with the
    sequence split over ``layout.ulysses * layout.ring`` ranks.

    Ulysses: queries and keys go head-sharded over the Ulysses group's super-chunk of
    ``u*C`` rows (all-to-all), attend there, and come back. Ring: the step-0 keys and
    values of the super-chunk pass around the ring once per batch (they are the same
    at every step); each step's queries attend to the blocks of earlier ring ranks in
    full, to their own block causally plus their diagonal keys, and the partial
    results merge by log-sum-exp (``ring_block_attention``). Create one per ``ttt``
    call (it keeps the step-0 keys between steps).

    ``impl``: ``eager`` (explicit scores, any device: memory grows with ``C*S``),
    ``flex`` (FlexAttention per block, memory linear in the rows; CUDA for training),
    ``auto`` (flex on CUDA, else eager). ``kernel_options``, ``compile_elementwise``:
    the flex path's ``TTTConfig`` settings of those names.
    """

    def __init__(self, layout: Layout, impl: str = "auto", *,
                 kernel_options: tuple[tuple[str, object], ...] | None = None,
                 compile_elementwise: bool) -> None:
        if impl not in ("auto", "eager", "flex"):
            raise ValueError(f"impl must be 'auto', 'eager' or 'flex', got {impl!r}")
        self.layout = layout
        self.impl = impl
        self.kernel_options = kernel_options
        self.compile_elementwise = compile_elementwise
        self._keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._valid = None
        self._ring = None
        self._cache: dict = {}

    def _to_heads(self, x):
        if self.layout.ulysses == 1:
            return x
        return _UlyssesAllToAll.apply(x, self.layout.group("ulysses"), True)

    def __call__(self, q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                 valid_BC: torch.Tensor) -> torch.Tensor:
        lay = self.layout
        B, h, C, d = q.shape
        g = keys[0][0].shape[1]
        u = lay.ulysses
        if h % u:
            raise ValueError(f"{h} query heads do not divide by --parallel.ulysses {u}; pick a "
                             "Ulysses degree that divides the draft's num_heads")
        # kv heads split with their query heads when they divide by u; else repeat them.
        rep = 1 if g % u == 0 else h // g
        for k, v in keys[len(self._keys):]:
            if rep > 1:
                k, v = (repeat(x, "b g c d -> b (g r) c d", r=rep) for x in (k, v))
            self._keys.append((self._to_heads(k), self._to_heads(v)))
        if self._valid is None:
            valid = valid_BC.bool()
            self._valid = valid if u == 1 else _all_gather_seq(valid, lay.group("ulysses"))
            if lay.ring > 1:
                k0, v0 = self._keys[0]
                blocks = ring_pass(torch.stack([k0, v0]), lay.group("ring"))
                # The own block is read from the pass's output 0, so every rank's graph
                # holds the pass and every rank joins its backward.
                self._keys[0] = (blocks[0][0], blocks[0][1])
                valids = ring_pass(self._valid.to(torch.uint8), lay.group("ring"))  # no gradient
                self._ring = [(kv, valid.bool()) for kv, valid in zip(blocks, valids)]
        qh = self._to_heads(q)
        k0, v0 = self._keys[0]
        # Ring rank r sees ranks r-1, ..., 0 in full (hops 1..r); later ranks are future.
        ring = self._ring[1:lay.ring_rank + 1] if self._ring else []
        earlier = [(kv[0], kv[1], valid) for kv, valid in ring]
        impl = self.impl if self.impl != "auto" else ("flex" if qh.is_cuda else "eager")
        out = ring_block_attention(qh, (k0, v0, self._valid), earlier, self._keys[1:], impl, self._cache,
                                   kernel_options=self.kernel_options, fused=self.compile_elementwise)
        if u == 1:
            return out
        return _UlyssesAllToAll.apply(out, lay.group("ulysses"), False)


# ---- reduction of the per-step sums ---------------------------------------------

_SUMS = ("loss_sum", "accept_sum", "log_accept_sum")
_COUNTS = ("correct", "rows", "gated")


def reduce_terms(terms: Sequence[StepTerms], group=None) -> list[StepTerms]:
    """Per-step sums with every field summed over ``group``'s ranks (default: all).

    Values are global; gradients reach only this rank's own sums (``local +
    (global - local).detach()``), so each rank's backward yields its share of the
    one-rank gradient and summing the ranks' parameter gradients gives all of it,
    for any objective (the LK ones are non-linear in the sums too).
    """
    sums = torch.stack([getattr(t, f).detach() for t in terms for f in _SUMS])
    counts = torch.stack([getattr(t, f).detach().to(torch.int64) for t in terms for f in _COUNTS])
    dist.all_reduce(sums, group=group)
    dist.all_reduce(counts, group=group)
    out = []
    for j, t in enumerate(terms):
        fields = {f: getattr(t, f) + (sums[j * 3 + i] - getattr(t, f)).detach()
                  for i, f in enumerate(_SUMS)}
        fields.update({f: counts[j * 3 + i].to(getattr(t, f).dtype) for i, f in enumerate(_COUNTS)})
        out.append(dataclasses.replace(t, **fields))
    return out


def collectives(layout: Layout, denominator: int, device: torch.device,
                attention: str = "auto", *, kernel_options: tuple[tuple[str, object], ...] | None = None,
                compile_elementwise: bool) -> Collectives:
    """The ``Collectives`` of one batch: cross-rank attention when the sequence is
    split, the sums reduced over every rank, and the ``local_mean`` divisor and scale.

    ``denominator`` is this rank's ``B*C`` (0 for a data-parallel rank past the end of
    the data). SPEC 5: a data-parallel group (the ``sp`` ranks of one sequence batch)
    divides its loss sum by its own ``D_g = sum of B*C`` over the group, and gradients
    are averaged over the groups holding data. With ``D`` the sum over every rank, the
    result's ``denominator`` is ``D`` and its ``loss_scale`` is ``D / (n * D_g)`` (``n``
    groups with data), so ``sum_r loss_scale_r * loss_sum_r / D`` is that mean of group
    means in value and in gradient. ``attention``: the local attention's
    implementation (``TTTConfig.attention``: auto, eager, flex;
    ``SequenceParallelAttention``); ``kernel_options``, ``compile_elementwise``: its
    flex path's ``TTTConfig.flex_kernel_options`` and ``compile_elementwise``."""
    groups = torch.zeros(layout.dp, dtype=torch.int64, device=device)
    groups[layout.dp_rank] = denominator
    dist.all_reduce(groups)  # D_g: the group's ranks each add their own B*C
    total = groups.sum()
    own, n = groups[layout.dp_rank], (groups > 0).sum()
    scale = total.double() / (n * own).clamp(min=1).double() if denominator else total.double() * 0
    attend = SequenceParallelAttention(layout, impl=attention, kernel_options=kernel_options,
                                       compile_elementwise=compile_elementwise) if layout.sp > 1 else None
    return Collectives(attend=attend, reduce_terms=reduce_terms, denominator=total, loss_scale=scale)


def pad_for_sp(x: torch.Tensor, sp: int, dim: int = 1) -> torch.Tensor:
    """Right-pad ``dim`` with zeros to a multiple of ``sp`` (the one-rank reference of a
    sequence-parallel run is the batch padded to ``sp*C``, SPEC section 5)."""
    L = x.shape[dim]
    extra = -(-L // sp) * sp - L
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - dim - 1) + [0, extra]
    return F.pad(x, pad)
