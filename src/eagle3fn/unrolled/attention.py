"""The EAGLE-3 TTT attention of one step (SPEC section 3): eager, and FlexAttention
over packed query rows with block-sparse masks, partial results merged by
log-sum-exp.

Legend: B batch, C own rows per sample, N query rows of a step (sorted flat rows
``b*C + p``), h heads, g kv heads, d head dim, j the step, Lp = ``B*C`` flat keys
rounded up to FLEX_BLOCK, Qp packed query rows (``packed_query_len``), R rows of a
block table, W its width.

Step j's queries see the causal step-0 keys of their sample (``[B*C]`` flat, built
once per batch) plus each row's own keys of steps ``1..j`` (the diagonal). The flex
path runs FlexAttention over the step-0 keys only and merges the diagonal keys
afterwards (``merge_diagonal``), so no key is ever copied per step.

Packed sequences (SPEC 9): a query sees the step-0 keys of its own document only,
from the document's start (``starts_BC``, ``align.document_starts``) up to itself. A
document is a contiguous range, so "same document id and causal" is the key window
``[start, p]``: the eager path masks keys below the start, the flex path starts each
query's window there (its ``mask_mod`` and block tables are those windows). The
diagonal keys are the row's own, never another document's.

The pieces: the eager path and the per-step dispatch here; the packed FlexAttention
call in ``flex``, its query windows and block tables in ``blocks``, the log-sum-exp
merges in ``merges``.
"""

from __future__ import annotations

import functools
import math

import torch
from einops import repeat

from eagle3fn.align import document_starts
from eagle3fn.shapes import Features
from eagle3fn.unrolled.config import AttentionImpl, TTTConfig
from eagle3fn.unrolled.flex import packed_flex_attention, packed_keys


def eager_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                    valid_BC: torch.Tensor, starts_BC: torch.Tensor | None = None) -> torch.Tensor:
    """EAGLE-3 TTT attention at step ``j = len(keys) - 1``, exact.

    Args:
        q: ``[B, h, C, d]`` queries of step j (RoPE applied).
        keys: j + 1 pairs ``(k, v)`` of ``[B, g, C, d]``; pair 0 is step 0 (causal
            context), pair ``i >= 1`` the row's own keys of step i (diagonal).
        valid_BC: bool ``[B, C]``, real (non-padded) key positions.
        starts_BC: int64 ``[B, C]`` or None: a packed batch's document start of each
            query row (``align.document_starts``); its step-0 keys begin there.

    Returns:
        ``[B, h, C, d]``. Scores in the input dtype, softmax in fp32 (fp64 for fp64).
    """
    B, h, C, d = q.shape
    rep = h // keys[0][0].shape[1]
    expand = lambda x: repeat(x, "b g s d -> b (g r) s d", r=rep)  # noqa: E731 - GQA
    scale = 1.0 / math.sqrt(d)
    k0, v0 = expand(keys[0][0]), expand(keys[0][1])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid_BC[:, None, None, :]
    if starts_BC is not None:
        key = torch.arange(C, device=q.device)
        allowed = allowed & (key[None, None, None, :] >= starts_BC[:, None, :, None])
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    diag = [((q * expand(k)).sum(-1) * scale)[..., None] for k, _ in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1),
                          dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    out = probs[..., :C] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + probs[..., C + i, None] * expand(v)
    return out


FLEX_MIN_HEAD_DIM = 16
"""The smallest head dimension inductor's FlexAttention kernels take ("NYI: embedding
dimension of the query, key, and value must be at least 16"); ``auto`` attends eagerly
below it."""


def is_flex_path(attention: AttentionImpl, attend, features: Features, head_dim: int) -> bool:
    """Whether the steps' attention is the one-rank packed FlexAttention: ``flex``, or
    ``auto`` on CUDA with heads of at least ``FLEX_MIN_HEAD_DIM``."""
    return attend is None and (attention == "flex" or (attention == "auto" and features.aux.is_cuda
                                                       and head_dim >= FLEX_MIN_HEAD_DIM))


def row_attention(config: TTTConfig, attend, features: Features, valid_BC: torch.Tensor,
                  k0: torch.Tensor, v0: torch.Tensor, layouts=None):
    """``run(q [N, h, d], rows_N | None, diagonal, j) -> [N, h, d]``: step j's attention
    for the queries of some flat rows (``None``: every row, in order) over the step-0
    keys ``k0, v0`` ``[B*C, g, d]`` and each row's own keys of steps ``1..j``
    (``diagonal = (k, v)``, each ``[j, N, g, d]`` aligned with the rows; None at j = 0).

    The one-rank FlexAttention path (``config.attention="flex"``, or ``auto`` on CUDA,
    ``is_flex_path``)
    packs the queries (``packed_flex_attention`` with the config's kernel options,
    query buckets and merge; ``layouts[j]`` from ``layout.plan_steps`` when given,
    else built per step). Otherwise the queries are placed in zero
    ``[B, h, C, d]`` tensors for ``attend`` (``Collectives.attend`` under sequence
    parallelism, else ``eager_attention``), whose other rows' outputs are dropped.
    A packed batch (``features.positions``) keeps each query in its document on the
    one-rank paths (``align.document_starts``)."""
    B, C = valid_BC.shape
    packed = attend is None and features.positions is not None  # one rank: documents bound the keys
    starts = document_starts(features.positions[:, :C]) if packed else None
    if is_flex_path(config.attention, attend, features, config.draft.d):
        keys, lengths = packed_keys(k0, v0), valid_BC.sum(1)
        every = torch.arange(B * C, device=k0.device)
        options = dict(kernel_options=config.flex_kernel_options, query_buckets=config.query_buckets,
                       fused=config.compile_elementwise, starts_BC=starts)
        return lambda q, rows, diagonal, j: packed_flex_attention(  # noqa: E731
            q, every if rows is None else rows, keys, diagonal, lengths, C,
            None if layouts is None else layouts[j], **options)
    if attend is None:
        attend = eager_attention if starts is None else functools.partial(eager_attention, starts_BC=starts)
    as_B = lambda x: x.view(B, C, *x.shape[1:]).transpose(1, 2)  # noqa: E731 - [B, n, C, d]

    def dense(x, rows):
        return as_B(x if rows is None else x.new_zeros(B * C, *x.shape[1:]).index_copy(0, rows, x))

    def run(q, rows, diagonal, j):
        own = [] if diagonal is None else zip(*diagonal)
        keys = [(as_B(k0), as_B(v0))] + [(dense(k, rows), dense(v, rows)) for k, v in own]
        out = attend(dense(q, rows), keys, valid_BC).transpose(1, 2).flatten(0, 1)
        return out if rows is None else out[rows]
    return run
