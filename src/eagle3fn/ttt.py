"""Training-time test (SPEC section 3): the draft unrolled k steps, as a function of
stateless parameters.

Legend: B batch, T local buffer length, C own rows per sample, k TTT length, H draft
hidden, h heads, g kv heads, d head dim, V target vocab, Vd draft vocab, U teacher
positions, n_j rows of step j.

Step j, row p: input token ``ids'[p + j]``, input feature ``fc(a_p)`` at j = 0 and the
previous step's pre-norm output after; queries and keys at RoPE position
``pos[p] + j``; keys are the causal step-0 keys plus the row's own keys of steps
``1..j``; the teacher sits at ``s = p + j``.

``trim="none"`` is the full-length path (SpecForge/EAGLE semantics): a teacher at
every position, logits for every row, every row's loss masked. ``trim="loss"``
builds the teacher only at the U supervised positions and computes the draft norm,
lm_head, loss and metrics only at ``rows_j``; the backbone still runs every row.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from eagle3fn.align import shift_left
from eagle3fn.draft import DraftConfig, Eagle3Draft, apply_rope, head_logits, rope_cos_sin
from eagle3fn.loss import LossConfig, head_step_terms, objective, step_terms
from eagle3fn.shapes import Features, Objective, RowMap, StepTerms, TeacherTable
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE, teacher_table_from_hidden, teacher_table_from_logits

Trim = Literal["none", "loss", "backbone", "auto"]
LossImpl = Literal["auto", "torch", "triton"]
AttentionImpl = Literal["auto", "eager", "flex"]
FLEX_BLOCK = 128


@dataclass(kw_only=True, frozen=True)
class TTTConfig:
    """The unrolled objective: draft shape, TTT length, trimming, loss."""

    draft: DraftConfig
    """The draft's sizes and toggles."""
    ttt_length: int = 7
    """k, the number of unrolled steps."""
    trim: Trim = "loss"
    """``none``: every row at every step (reference semantics). ``loss``: teacher,
    head, loss and metrics only at the supervised rows of each step (exact).
    ``backbone``: also the layer itself only where a loss needs it: step 0 computes
    keys/values for every row and the rest for ``rows_0 | backbone_rows_1``, step
    ``j >= 1`` only ``backbone_rows_j`` (SPEC section 6; exact). ``auto``: per batch,
    ``backbone`` when the rows it computes are at most ``auto_backbone_fraction`` of
    all, else ``none`` (``choose_trim``)."""
    auto_backbone_fraction: float = 0.7
    """``trim="auto"``: the largest fraction of the ``k*B*C`` layer rows at which the
    trimmed backbone still beats the full path. Calibrated on an H200 at 8B shapes
    (docs/benchmarks.md): at S=2048 the two cross near 50-75% tail density, at 8192
    near 80%; above it the full path is faster than both trimmed ones."""
    attention: AttentionImpl = "auto"
    """``eager``: explicit scores, exact on any device (the CPU path). ``flex``:
    compiled FlexAttention over ``[step-0 keys ; diagonal keys]`` with a block-sparse
    EAGLE-3 mask (the GPU path; no backward on CPU). ``auto``: flex on CUDA, else eager."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Step weights, normalisation and objective kind."""
    loss_impl: LossImpl = "auto"
    """Soft cross-entropy and metrics: ``torch`` (reference), ``triton`` (indexed
    kernels, any Vd), ``auto`` (triton on CUDA, torch elsewhere)."""
    fused_head: bool = True
    """Trimmed paths: run norm + lm_head + loss in row chunks and recompute the
    logits in backward instead of keeping ``[n_j, Vd]`` (``loss.head_step_terms``)."""
    head_chunk_rows: int = 2048
    """Rows per chunk of the fused head (peak logits memory ``chunk * Vd``)."""
    teacher_chunk_size: int = DEFAULT_CHUNK_SIZE
    """Vocab entries per block when the teacher is streamed from the final hidden."""

    def __post_init__(self) -> None:
        if self.ttt_length < 1:
            raise ValueError(f"ttt_length must be >= 1, got {self.ttt_length}")
        if self.trim not in ("none", "loss", "backbone", "auto"):
            raise ValueError(f"trim must be 'none', 'loss', 'backbone' or 'auto', got {self.trim!r}")
        if self.loss_impl not in ("auto", "torch", "triton"):
            raise ValueError(f"loss_impl must be 'auto', 'torch' or 'triton', got {self.loss_impl!r}")
        if self.attention not in ("auto", "eager", "flex"):
            raise ValueError(f"attention must be 'auto', 'eager' or 'flex', got {self.attention!r}")


@dataclass(frozen=True)
class Collectives:
    """What a distributed run plugs into ``ttt`` (built by ``eagle3fn.parallel``; this
    module never imports ``torch.distributed``).

    Fields:
        attend: ``(q [B, h, C, d], keys, valid [B, C]) -> [B, h, C, d]``, the EAGLE-3
            attention of one step with the step-0 keys of every earlier rank of the
            sequence (``eager_attention``'s contract, keys spanning ranks).
        reduce_terms: per-step ``StepTerms`` -> the same with every field summed over all
            ranks in value, while gradients flow only to this rank's sums.
        denominator: the ``local_mean`` divisor ``sum over ranks of B*C``.
    """

    attend: Callable[[torch.Tensor, list, torch.Tensor], torch.Tensor] | None
    reduce_terms: Callable[[Sequence[StepTerms]], list[StepTerms]]
    denominator: int | torch.Tensor


@functools.lru_cache(maxsize=8)
def skeleton(cfg: DraftConfig) -> Eagle3Draft:
    """A parameter-free ``Eagle3Draft`` (on ``meta``) for ``functional_call``."""
    with torch.device("meta"):
        return Eagle3Draft(cfg)


def eager_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                    valid_BC: torch.Tensor) -> torch.Tensor:
    """EAGLE-3 TTT attention at step ``j = len(keys) - 1``, exact.

    Args:
        q: ``[B, h, C, d]`` queries of step j (RoPE applied).
        keys: j + 1 pairs ``(k, v)`` of ``[B, g, C, d]``; pair 0 is step 0 (causal
            context), pair ``i >= 1`` the row's own keys of step i (diagonal).
        valid_BC: bool ``[B, C]``, real (non-padded) key positions.

    Returns:
        ``[B, h, C, d]``. Scores in the input dtype, softmax in fp32 (fp64 for fp64).
    """
    B, h, C, d = q.shape
    rep = h // keys[0][0].shape[1]
    expand = lambda x: x.repeat_interleave(rep, dim=1)  # noqa: E731
    scale = 1.0 / math.sqrt(d)
    k0, v0 = expand(keys[0][0]), expand(keys[0][1])
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    allowed = causal[None, None] & valid_BC[:, None, None, :]
    scores = (q @ k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    diag = [((q * expand(k)).sum(-1) * scale)[..., None] for k, _ in keys[1:]]
    probs = torch.softmax(torch.cat([scores, *diag], dim=-1),
                          dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(q.dtype)
    out = probs[..., :C] @ v0
    for i, (_, v) in enumerate(keys[1:]):
        out = out + probs[..., C + i, None] * expand(v)
    return out


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Every torch.compile(flex_attention) in the process (other libraries' too) shares
    # one recompile budget; past it dynamo silently runs the unfused O(S^2)-memory
    # path. Each (length, dtype) needs its own kernel, so allow more than the default.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def eagle_block_mask(lengths_B: torch.Tensor, padded_rows: int, ttt_length: int, step: int,
                     mask_mod, active_Bn: torch.Tensor | None = None):
    """The EAGLE-3 TTT mask of step ``j = step`` as a hand-built FlexAttention BlockMask.

    Keys are k segments of ``padded_rows`` (a multiple of FLEX_BLOCK): segment 0 holds
    the step-0 keys, segment i the diagonal keys of step i (segments past j are
    never listed, so every step has the same key length and one compiled kernel).
    Per query block m: full blocks = segment-0 blocks below the diagonal whose keys are
    all real; partial blocks (``mask_mod`` applies) = the segment-0 block holding the
    diagonal or the end of the sequence, then block m of segments 1..j. No dense
    mask is ever evaluated. ``active_Bn`` (bool ``[B, n]``): query blocks holding a
    row that is needed; the others list no key block and are skipped.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = padded_rows // FLEX_BLOCK
    dev = lengths_B.device
    m = torch.arange(n, device=dev)[None, :]  # [1, n] query blocks
    L = lengths_B[:, None]
    full = torch.minimum(m, L // FLEX_BLOCK)  # [B, n]
    last_real = (L + FLEX_BLOCK - 1) // FLEX_BLOCK - 1
    has_edge = full <= torch.minimum(m, last_real)  # one partial segment-0 block?
    diag = m[..., None] + n * torch.arange(1, step + 1, device=dev)  # [1, n, j]
    diag = diag.expand(L.shape[0], n, step)
    edge = torch.cat([full[..., None], diag], dim=-1)  # edge block first
    partial = torch.where(has_edge[..., None], edge, F.pad(diag, (0, 1)))
    partial = F.pad(partial, (0, n * ttt_length - partial.shape[-1]))  # rows span all blocks
    full_idx = torch.arange(n * ttt_length, device=dev).expand(L.shape[0], n, -1)
    as_i32 = lambda x: x[:, None].to(torch.int32).contiguous()  # noqa: E731 - [B, 1, ...]
    num_partial = has_edge.int() + step
    if active_Bn is not None:
        num_partial, full = num_partial * active_Bn, full * active_Bn
    return BlockMask.from_kv_blocks(
        as_i32(num_partial), as_i32(partial), as_i32(full), as_i32(full_idx),
        BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod, seq_lengths=(padded_rows, padded_rows * ttt_length),
    )


def flex_attention_step(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]],
                        valid_BC: torch.Tensor, ttt_length: int | None = None,
                        active_BC: torch.Tensor | None = None) -> torch.Tensor:
    """``eager_attention`` computed by FlexAttention (same arguments and result).

    Keys are laid out as ``ttt_length`` segments padded to a multiple of the block
    size (unused segments are zeros and never read), so the key length is the same
    at every step and one compiled kernel serves the whole unroll; the block mask
    (``eagle_block_mask``) lists only the causal and diagonal blocks. Compiled on
    CUDA; uncompiled (forward only) elsewhere. Right padding assumed: ``valid_BC``
    is a prefix of ones per row. ``active_BC`` (bool ``[B, C]``): the query rows whose
    output is used; query blocks without one are skipped (their output is zero).
    """
    from torch.nn.attention.flex_attention import flex_attention

    B, h, C, d = q.shape
    k_total = ttt_length or len(keys)
    Cp = -(-C // FLEX_BLOCK) * FLEX_BLOCK
    pad = lambda x: F.pad(x, (0, 0, 0, Cp - C))  # noqa: E731
    zeros = torch.zeros_like(pad(keys[0][0]))
    k = torch.cat([pad(k) for k, _ in keys] + [zeros] * (k_total - len(keys)), dim=2)
    v = torch.cat([pad(v) for _, v in keys] + [zeros] * (k_total - len(keys)), dim=2)
    valid = F.pad(valid_BC, (0, Cp - C))
    # A tensor, not an int: the compiled kernel must not specialise on the step.
    # (torch.full: a fill kernel; torch.tensor would copy from the host and sync.)
    step = torch.full((), len(keys) - 1, device=q.device)

    def mask_mod(b, head, q_idx, kv_idx):
        segment, offset = kv_idx // Cp, kv_idx % Cp
        causal = (segment == 0) & (offset <= q_idx) & valid[b, offset]
        return causal | ((segment > 0) & (segment <= step) & (offset == q_idx))

    active = None
    if active_BC is not None:
        active = F.pad(active_BC, (0, Cp - C)).view(B, Cp // FLEX_BLOCK, FLEX_BLOCK).any(-1)
    block_mask = eagle_block_mask(valid_BC.sum(1), Cp, k_total, len(keys) - 1, mask_mod, active)
    attend = _compiled_flex() if q.is_cuda else flex_attention
    out = attend(pad(q), k, v, block_mask=block_mask, scale=1.0 / math.sqrt(d),
                 enable_gqa=h != keys[0][0].shape[1])
    return out[:, :, :C]


def _attention_fn(attention: AttentionImpl, attend, features: Features, ttt_length: int):
    """``(attend, is_flex)``: a given ``attend`` (``Collectives.attend``) as is, else the
    one-rank path ``attention`` names (``auto``: flex on CUDA, eager elsewhere)."""
    if attend is not None:
        return attend, False
    if attention == "auto":
        attention = "flex" if features.aux.is_cuda else "eager"
    if attention == "flex":
        return functools.partial(flex_attention_step, ttt_length=ttt_length), True
    return eager_attention, False


def backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
             attention: AttentionImpl = "eager", attend=None) -> list[torch.Tensor]:
    """The unrolled layer on every own row: k pre-norm outputs ``[B, C, H]``.

    Runs inside ``functional_call`` (``draft`` holds the parameters). ``attend``
    (``Collectives.attend``) replaces the one-rank attention under sequence parallelism.
    """
    attend, _ = _attention_fn(attention, attend, features, ttt_length)
    cfg, layer = draft.cfg, draft.midlayer
    attn = layer.self_attn
    C = num_rows
    B = features.input_ids.shape[0]
    ids_next = shift_left(features.input_ids)  # ids'[t] = x_{t+1}
    positions = features.positions
    if positions is None:
        positions = torch.arange(features.input_ids.shape[1], device=ids_next.device).expand(B, -1)
    positions = positions[:, :C]
    valid = features.attention_mask[:, :C].bool()
    g = draft.project(features.aux[:, :C])
    keys, outs = [], []
    for j in range(ttt_length):
        emb = draft.embed_tokens(shift_left(ids_next, j)[:, :C]).to(g.dtype)
        u = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g)), dim=-1)
        heads = lambda proj, n: proj(u).view(B, C, n, cfg.d).transpose(1, 2)  # noqa: E731
        q = heads(attn.q_proj, cfg.num_heads)
        k = heads(attn.k_proj, cfg.num_kv_heads)
        v = heads(attn.v_proj, cfg.num_kv_heads)
        cos, sin = rope_cos_sin(positions + j, cfg.rope, cfg.d, q.dtype)
        cos, sin = cos[:, None], sin[:, None]
        keys.append((apply_rope(k, cos, sin), v))
        a = attend(apply_rope(q, cos, sin), keys, valid)
        r = g + attn.o_proj(a.transpose(1, 2).reshape(B, C, cfg.num_heads * cfg.d))
        out = r + layer.mlp(layer.post_attention_layernorm(r))
        outs.append(out)
        g = out
    return outs


def computed_rows(rowmap: RowMap) -> tuple[torch.Tensor, ...]:
    """Rows whose layer output ``trim="backbone"`` computes at each step (sorted flat
    ``b*C + p``): ``rows_0 | backbone_rows_1`` at step 0, ``backbone_rows_j`` after.
    Each is contained in the previous one, so a row's input feature and diagonal
    keys are always there."""
    return (rowmap.step0_rows,) + tuple(rowmap.backbone_rows[1:])


def choose_trim(rowmap: RowMap, config: TTTConfig) -> str:
    """The path ``trim="auto"`` takes for this batch: ``backbone`` when the layer rows
    it computes (``sum_j |computed_rows_j|``, keys/values of step 0 aside) are at most
    ``config.auto_backbone_fraction`` of ``k*B*C``, else ``none`` (measured on the
    H200: near full density the untrimmed path beats both trimmed ones, whose
    gathers and chunked head then cost more than they save). Any other
    ``config.trim`` is returned as is."""
    if config.trim != "auto":
        return config.trim
    total = rowmap.ttt_length * rowmap.batch_size * rowmap.num_rows
    computed = sum(c.numel() for c in computed_rows(rowmap))
    return "backbone" if computed <= config.auto_backbone_fraction * total else "none"


def _attend_rows(attend, q_NhD: torch.Tensor, keys: list, valid_BC: torch.Tensor,
                 rows_N: torch.Tensor, skip_blocks: bool = False) -> torch.Tensor:
    """``attend`` for the queries of flat rows ``rows_N`` only: they are placed in a
    zero ``[B, h, C, d]`` query (other rows' outputs are dropped), so every attention
    path (eager, flex, sequence-parallel) serves the trimmed backbone unchanged.
    ``skip_blocks``: tell the flex path which rows are used, so query blocks without
    one are skipped (a contiguous run of rows costs only its own blocks)."""
    B, C = valid_BC.shape
    N, h, d = q_NhD.shape
    dense = q_NhD.new_zeros(B * C, h, d).index_copy(0, rows_N, q_NhD)
    kwargs = {}
    if skip_blocks:
        active = torch.zeros(B * C, dtype=torch.bool, device=rows_N.device)
        kwargs["active_BC"] = active.index_fill(0, rows_N, True).view(B, C)
    out = attend(dense.view(B, C, h, d).transpose(1, 2), keys, valid_BC, **kwargs)
    return out.transpose(1, 2).reshape(B * C, h * d)[rows_N]


def trimmed_backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
                     rows: Sequence[torch.Tensor], attention: AttentionImpl = "eager",
                     attend=None) -> list[torch.Tensor]:
    """``backbone`` computing only the rows a later loss needs (``computed_rows``).

    Step 0 computes keys and values for every own row (everyone's context) and the
    query, attention, o_proj and MLP for ``rows[0]``; step ``j >= 1`` runs the whole
    layer on ``rows[j]`` only, whose queries attend causally to the full step-0 keys
    and to their own diagonal keys of steps ``1..j`` (held in ``[B, g, C, d]`` with
    zeros elsewhere, never read by another row).

    Returns:
        k tensors ``[n_j, H]``: the pre-norm outputs of ``rows[j]``, in its order.
    """
    attend, skip_blocks = _attention_fn(attention, attend, features, ttt_length)
    cfg, layer = draft.cfg, draft.midlayer
    attn = layer.self_attn
    C = num_rows
    B = features.input_ids.shape[0]
    ids_next = shift_left(features.input_ids)
    positions = features.positions
    if positions is None:
        positions = torch.arange(features.input_ids.shape[1], device=ids_next.device).expand(B, -1)
    pos_flat = positions[:, :C].reshape(-1)
    valid = features.attention_mask[:, :C].bool()
    g_all = draft.project(features.aux[:, :C]).flatten(0, 1)  # [B*C, H]
    heads = lambda x, n: x.view(x.shape[0], n, cfg.d)  # noqa: E731
    as_BgCd = lambda x: x.view(B, C, -1, cfg.d).transpose(1, 2)  # noqa: E731

    def rope_at(positions):  # cos, sin [n, 1, d], shared by the queries and keys of a step
        cos, sin = rope_cos_sin(positions, cfg.rope, cfg.d, g_all.dtype)
        return cos[:, None], sin[:, None]

    # Step 0: keys/values of every row; the rest only for rows[0].
    emb = draft.embed_tokens(ids_next[:, :C]).flatten(0, 1).to(g_all.dtype)
    u = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(g_all)), dim=-1)
    cos, sin = rope_at(pos_flat)
    k0 = apply_rope(heads(attn.k_proj(u), cfg.num_kv_heads), cos, sin)
    keys = [(as_BgCd(k0), as_BgCd(heads(attn.v_proj(u), cfg.num_kv_heads)))]
    r0 = rows[0]
    q = apply_rope(heads(attn.q_proj(u[r0]), cfg.num_heads), cos[r0], sin[r0])
    r = g_all[r0] + attn.o_proj(_attend_rows(attend, q, keys, valid, r0, skip_blocks))
    out = r + layer.mlp(layer.post_attention_layernorm(r))
    outs, prev_rows = [out], r0
    for j in range(1, ttt_length):
        rj = rows[j]
        # Clamped so a hand-made row map whose rows are not nested reads wrong rows
        # (which the negative-control tests catch) instead of out of range.
        g = out[torch.searchsorted(prev_rows, rj).clamp_max(max(prev_rows.numel() - 1, 0))]
        ids_j = shift_left(ids_next, j)[:, :C].reshape(-1)[rj]
        u = torch.cat((layer.input_layernorm(draft.embed_tokens(ids_j).to(g.dtype)),
                       layer.hidden_norm(g)), dim=-1)
        cos, sin = rope_at(pos_flat[rj] + j)
        q = apply_rope(heads(attn.q_proj(u), cfg.num_heads), cos, sin)
        kv = [apply_rope(heads(attn.k_proj(u), cfg.num_kv_heads), cos, sin),
              heads(attn.v_proj(u), cfg.num_kv_heads)]
        dense = [x.new_zeros(B * C, cfg.num_kv_heads, cfg.d).index_copy(0, rj, x) for x in kv]
        keys.append((as_BgCd(dense[0]), as_BgCd(dense[1])))
        r = g + attn.o_proj(_attend_rows(attend, q, keys, valid, rj, skip_blocks))
        out = r + layer.mlp(layer.post_attention_layernorm(r))
        outs.append(out)
        prev_rows = rj
    return outs


class _Unrolled(torch.nn.Module):
    """``forward`` = backbone + head + per-step terms, so one ``functional_call`` runs
    the whole differentiable part."""

    def __init__(self, draft: Eagle3Draft) -> None:
        super().__init__()
        self.draft = draft

    def forward(self, features: Features, rowmap: RowMap, config: TTTConfig,
                table: TeacherTable, d2t: torch.Tensor, supervised_flat: torch.Tensor | None,
                collectives: Collectives | None = None):
        attend = collectives.attend if collectives is not None else None
        if config.trim == "backbone":
            computed = computed_rows(rowmap)
            outs = trimmed_backbone(self.draft, features, rowmap.num_rows, config.ttt_length,
                                    computed, config.attention, attend=attend)
            # rows_j inside the computed rows of step j (both sorted)
            at = [torch.searchsorted(c, r).clamp_max(max(c.numel() - 1, 0))
                  for c, r in zip(computed, rowmap.rows)]
        else:
            outs = backbone(self.draft, features, rowmap.num_rows, config.ttt_length,
                            config.attention, attend=attend)
            at = list(rowmap.rows)
        impl = config.loss_impl
        if impl == "auto":
            impl = "triton" if features.aux.is_cuda else "torch"
        kwargs = dict(impl=impl, accept_grad=config.loss.objective != "kl")
        terms = []
        for j, out in enumerate(outs):
            flat = out.flatten(0, -2)  # [B*C, H], or [n_j, H] computed rows
            if config.trim != "none" and config.fused_head:
                head = functools.partial(head_logits, cfg=self.draft.cfg)
                terms.append(head_step_terms(
                    flat[at[j]], head, self.draft.head_weights(), table,
                    rowmap.table_rows[j], d2t, chunk_rows=config.head_chunk_rows, **kwargs))
                continue
            if config.trim != "none":
                logits = self.draft.head(flat[at[j]])  # [n_j, Vd]
                table_rows, row_mask = rowmap.table_rows[j], None
            else:
                logits = self.draft.head(flat)  # [B*C, Vd]
                table_rows, row_mask = _dense_step(rowmap, j, supervised_flat)
            terms.append(step_terms(logits, table, table_rows, d2t, row_mask_N=row_mask, **kwargs))
        if collectives is not None:
            # One zero-weighted dummy row per step keeps every step's output in the graph
            # on every rank (a rank whose step is dead still joins that step's backward
            # collectives, so no rank waits forever).
            dummy = [0 * out.flatten()[:1].sum() for out in outs]
            terms = [dataclasses.replace(t, loss_sum=t.loss_sum + z, accept_sum=t.accept_sum + z,
                                         log_accept_sum=t.log_accept_sum + z)
                     for t, z in zip(terms, dummy)]
        return terms


def _dense_step(rowmap: RowMap, j: int, supervised_flat: torch.Tensor):
    """Full-length path, step j: every row ``b*C + p`` reads teacher ``b*T + p + j``
    (``[B*C]``, clamped inside its sample) and counts iff ``p + j < T`` and that
    position is supervised."""
    B, C, T = rowmap.batch_size, rowmap.num_rows, rowmap.buffer_len
    s = torch.arange(C, device=supervised_flat.device) + j
    index = (torch.arange(B, device=s.device)[:, None] * T + s.clamp_max(T - 1)).flatten()
    return index, (s < T).repeat(B) & supervised_flat[index]


def _teacher(features: Features, read_U: torch.Tensor, config: TTTConfig,
             t2d: torch.Tensor) -> TeacherTable:
    """Teacher table from the target outputs at flat positions ``read_U`` of z."""
    if features.target_logits is not None:
        return teacher_table_from_logits(features.target_logits.flatten(0, 1)[read_U], t2d)
    if features.final_hidden is None or features.target_head is None:
        raise ValueError("Features need target_logits, or final_hidden and target_head")
    return teacher_table_from_hidden(features.final_hidden.flatten(0, 1)[read_U],
                                     features.target_head, t2d, chunk_size=config.teacher_chunk_size)


def ttt(params: dict[str, torch.Tensor], features: Features, rowmap: RowMap, config: TTTConfig,
        *, d2t: torch.Tensor, t2d: torch.Tensor,
        collectives: Collectives | None = None) -> Objective:
    """The TTT objective and per-step metrics of one batch (differentiable in params).

    Args:
        params: draft parameters (``draft.init_params``), any dtype/device.
        features: the batch (``Features``), ``[B, T, ...]``.
        rowmap: ``rowmap.build_rowmap(supervised_mask, k)`` of this batch.
        config: ``TTTConfig``; ``config.trim`` picks the full or the trimmed path.
        d2t, t2d: the vocab map.
        collectives: under data/sequence parallelism (``eagle3fn.parallel``): the
            cross-rank attention and the reduction of the per-step sums. ``features``
            and ``rowmap`` are then this rank's (``C`` own rows + a ``k`` tail).

    Returns:
        ``Objective`` (``objective`` 0-d, per-step ``[k]`` losses and metrics, tau).
    """
    B, T = features.input_ids.shape
    if (rowmap.batch_size, rowmap.buffer_len) != (B, T) or rowmap.ttt_length != config.ttt_length:
        raise ValueError(
            f"row map is for B={rowmap.batch_size}, T={rowmap.buffer_len}, k={rowmap.ttt_length} "
            f"but the batch has B={B}, T={T} and config.ttt_length={config.ttt_length}"
        )
    positions = rowmap.teacher_positions
    if positions.numel() and bool((positions % T == T - 1).any()):
        raise ValueError(
            "a teacher position is the last of its buffer, where z'[s] = z[s+1] is not held; "
            "build the mask with align.supervised_mask (it never supervises t = L-1)"
        )
    if config.trim == "auto":
        config = dataclasses.replace(config, trim=choose_trim(rowmap, config))
    supervised_flat = None
    if config.trim != "none":
        table = _teacher(features, positions + 1, config, t2d)  # z'[s] = z[s+1]
    else:
        supervised_flat = torch.zeros(B * T, dtype=torch.bool, device=positions.device)
        supervised_flat[positions] = True
        s = torch.arange(B * T, device=positions.device)
        # A teacher at every position; the last one of each buffer has no z[s+1] and is
        # never supervised, so any row of z may stand in for it.
        table = _teacher(features, torch.where(s % T == T - 1, s, s + 1), config, t2d)
    module = _Unrolled(skeleton(config.draft))
    named = {f"draft.{k}": v for k, v in params.items()}
    terms = torch.func.functional_call(
        module, named, (features, rowmap, config, table, d2t, supervised_flat, collectives)
    )
    if collectives is None:
        return objective(terms, rowmap.denominator, config.loss)
    return objective(collectives.reduce_terms(terms), collectives.denominator, config.loss)
