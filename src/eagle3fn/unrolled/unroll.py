"""Training-time test (SPEC section 3): the draft unrolled k steps, as a function of
stateless parameters, and the objective ``ttt`` built on it.

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
``trim="backbone"`` also runs the layer only on the rows a later loss needs
(``policy.computed_rows``).

A packed batch (``Features.positions`` restarting at 0 in each document, SPEC 9)
trains each document as a sample of its own: RoPE at the in-document positions,
attention inside the document (``attention``), no row taught across a boundary
(``rowmap.build_rowmap(..., positions=)``; the full path applies the same bound).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from eagle3fn.align import shift_left
from eagle3fn.draft import (Eagle3Draft, head, head_logits, head_weights, keys_values, layer_input,
                            layer_output, project, qkv, queries, rope_cos_sin)
from eagle3fn.loss import head_step_terms, objective, step_terms
from eagle3fn.shapes import Features, Objective, RowMap, TeacherTable
from eagle3fn.teacher import teacher_table_from_hidden, teacher_table_from_logits
from eagle3fn.unrolled.attention import is_flex_path, row_attention
from eagle3fn.unrolled.config import AttentionImpl, Collectives, TTTConfig
from eagle3fn.unrolled.layout import StepPlan, plan_steps, rows_inside
from eagle3fn.unrolled.policy import choose_trim

HEAD_CHUNK_LOGITS = 2**27
"""Most logits one fused-head chunk holds (256 MiB in bf16; its gradient as much in
backward)."""


def fused_head_chunk(head_chunk_rows: int, draft_vocab: int) -> int:
    """Rows per chunk of the fused head: ``head_chunk_rows``, fewer for large draft
    vocabularies so that a chunk holds at most ``HEAD_CHUNK_LOGITS`` logits (at least
    one row)."""
    return max(1, min(head_chunk_rows, HEAD_CHUNK_LOGITS // draft_vocab))


def _unroll(params: dict[str, torch.Tensor], features: Features, num_rows: int,
            rows: Sequence[torch.Tensor] | None, config: TTTConfig, attend,
            plan: StepPlan | None = None) -> list[torch.Tensor]:
    """The ``config.ttt_length`` unrolled steps of the draft layer (``eagle3fn.draft``'s
    functions of ``params``) on the rows ``rows[j]`` of each step (``None``: every row).

    Step 0 computes keys and values for every own row (everyone's context) and the
    query, attention, o_proj and MLP for ``rows[0]``; step ``j >= 1`` runs the whole
    layer on ``rows[j]`` only, whose queries attend causally to the full step-0 keys
    and to their own keys of steps ``1..j``. Each ``rows[j]`` must be inside
    ``rows[j-1]`` (``computed_rows``). Returns k tensors ``[n_j, H]`` (``[B*C, H]``)."""
    cfg, fused = config.draft, config.compile_elementwise
    C = num_rows
    B = features.input_ids.shape[0]
    ids_next = shift_left(features.input_ids)  # ids'[t] = x_{t+1}
    positions = features.positions
    if positions is None:
        positions = torch.arange(features.input_ids.shape[1], device=ids_next.device).expand(B, -1)
    # The compiled elementwise functions see no views at step 0 and none at later steps:
    # dynamo guards a view's base, so a view at one step and not at another would
    # compile each function twice (longer warm-up, same values).
    pos_flat = positions[:, :C].flatten().clone()
    valid = features.attention_mask[:, :C].bool()
    g_all = project(params, features.aux[:, :C].flatten(0, 1), cfg, fused)  # [B*C, H]

    def rope_at(positions):  # cos, sin [n, 1, d], shared by the queries and keys of a step
        return rope_cos_sin(positions[:, None], cfg.rope, cfg.d, g_all.dtype, fused)

    def take(x, idx):  # rows idx of x (None: all); index_select's backward is one
        return x if idx is None else x.index_select(0, idx)  # index_add, not a sort

    def within(j, outer, inner):  # positions of the sorted rows inner inside sorted outer
        if inner is None:
            return None
        return plan.within[j] if plan is not None and plan.within else rows_inside(outer, inner)

    u = layer_input(params, ids_next[:, :C].flatten(), g_all, cfg, fused)
    cos, sin = rope_at(pos_flat)
    k0, v0 = keys_values(params, u, cos, sin, cfg, fused)
    attend_rows = row_attention(config, attend, features, valid, k0, v0,
                                 None if plan is None else plan.layouts)
    prev = None if rows is None else rows[0]
    q = queries(params, take(u, prev), take(cos, prev), take(sin, prev), cfg, fused)
    g = take(g_all, prev)
    out = layer_output(params, attend_rows(q, prev, None, 0), g, cfg, fused)
    outs, diagonal = [out], None  # the rows' own keys/values of steps 1..j, [j, N, g, d]
    for j in range(1, config.ttt_length):
        rj = None if rows is None else rows[j]
        at = within(j, prev, rj)
        g = take(out, at)
        u = layer_input(params, take(shift_left(ids_next, j)[:, :C].reshape(-1), rj), g, cfg, fused)
        cos, sin = rope_at(take(pos_flat, rj) + j)
        q, k, v = qkv(params, u, cos, sin, cfg, fused)
        diagonal = (k[None], v[None]) if diagonal is None else tuple(
            torch.cat((x if at is None else x.index_select(1, at), y[None]))
            for x, y in zip(diagonal, (k, v)))
        out = layer_output(params, attend_rows(q, rj, diagonal, j), g, cfg, fused)
        outs.append(out)
        prev = rj
    return outs


def backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
             attention: AttentionImpl = "eager", attend=None,
             plan: StepPlan | None = None) -> list[torch.Tensor]:
    """The unrolled layer on every own row: k pre-norm outputs ``[B, C, H]``.

    ``draft`` holds the parameters (a materialized ``Eagle3Draft``: its named
    parameters are the params dict). ``attend`` (``Collectives.attend``) replaces the
    one-rank attention under sequence parallelism. The other ``TTTConfig`` settings
    (kernels, query buckets) are their defaults.
    """
    B = features.input_ids.shape[0]
    config = TTTConfig(draft=draft.cfg, ttt_length=ttt_length, attention=attention)
    outs = _unroll(dict(draft.named_parameters()), features, num_rows, None, config, attend, plan)
    return [out.view(B, num_rows, -1) for out in outs]


def trimmed_backbone(draft: Eagle3Draft, features: Features, num_rows: int, ttt_length: int,
                     rows: Sequence[torch.Tensor], attention: AttentionImpl = "eager",
                     attend=None, plan: StepPlan | None = None) -> list[torch.Tensor]:
    """``backbone`` computing only the rows a later loss needs (``computed_rows``).

    Step 0 computes keys and values for every own row (everyone's context) and the
    query, attention, o_proj and MLP for ``rows[0]``; step ``j >= 1`` runs the whole
    layer on ``rows[j]`` only, whose queries attend causally to the full step-0 keys
    and to their own diagonal keys of steps ``1..j``.

    Returns:
        k tensors ``[n_j, H]``: the pre-norm outputs of ``rows[j]``, in its order.
    """
    config = TTTConfig(draft=draft.cfg, ttt_length=ttt_length, attention=attention)
    return _unroll(dict(draft.named_parameters()), features, num_rows, rows, config, attend, plan)


def _step_terms(params: dict[str, torch.Tensor], features: Features, rowmap: RowMap, config: TTTConfig,
                table: TeacherTable, d2t: torch.Tensor, supervised_flat: torch.Tensor | None,
                collectives: Collectives | None, plan: StepPlan,
                row_masks: Sequence[torch.Tensor] | None = None) -> list:
    """The whole differentiable part: the unrolled steps, the head and each step's
    ``StepTerms`` (k of them). ``row_masks`` (trimmed paths): bool ``[n_j]`` per step,
    the rows that count (padding rows of a bucketed row map do not: ``StepTerms`` as
    without them); None: every row counts."""
    attend = collectives.attend if collectives is not None else None
    # trim="backbone": the rows computed_rows gives (the plan holds them), else all
    outs = _unroll(params, features, rowmap.num_rows, plan.computed, config, attend, plan)
    at = plan.at  # rows_j as positions in step j's output
    impl = config.loss_impl
    if impl == "auto":
        impl = "triton" if features.aux.is_cuda else "torch"
    kwargs = dict(impl=impl, accept_grad=config.loss.objective != "kl")
    fused = config.compile_elementwise
    terms = []
    for j, out in enumerate(outs):
        flat = out.flatten(0, -2)  # [B*C, H], or [n_j, H] computed rows
        if config.trim != "none" and config.fused_head:
            terms.append(head_step_terms(
                flat.index_select(0, at[j]), functools.partial(head_logits, cfg=config.draft, fused=fused),
                head_weights(params), table, rowmap.table_rows[j], d2t, **kwargs,
                row_mask_N=None if row_masks is None else row_masks[j],
                chunk_rows=fused_head_chunk(config.head_chunk_rows, config.draft.draft_vocab_size)))
            continue
        if config.trim != "none":
            logits = head(params, flat.index_select(0, at[j]), config.draft, fused)  # [n_j, Vd]
            table_rows, row_mask = rowmap.table_rows[j], None if row_masks is None else row_masks[j]
        else:
            logits = head(params, flat, config.draft, fused)  # [B*C, Vd]
            table_rows, row_mask = _dense_step(rowmap, j, supervised_flat, features.positions)
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


def _dense_step(rowmap: RowMap, j: int, supervised_flat: torch.Tensor,
                positions_BT: torch.Tensor | None = None):
    """Full-length path, step j: every row ``b*C + p`` reads teacher ``b*T + p + j``
    (``[B*C]``, clamped inside its sample) and counts iff ``p + j < T``, that
    position is supervised and (packed, ``positions_BT``) in row p's document:
    ``positions[p + j] >= j``."""
    B, C, T = rowmap.batch_size, rowmap.num_rows, rowmap.buffer_len
    s = torch.arange(C, device=supervised_flat.device) + j
    index = (torch.arange(B, device=s.device)[:, None] * T + s.clamp_max(T - 1)).flatten()
    counts = (s < T).repeat(B) & supervised_flat[index]
    if positions_BT is not None:
        counts = counts & (positions_BT.flatten()[index] >= j)
    return index, counts


def _teacher(features: Features, read_U: torch.Tensor, config: TTTConfig,
             t2d: torch.Tensor, bounds: list[int] | None = None) -> TeacherTable:
    """Teacher table from the target outputs at flat positions ``read_U`` of z
    (``bounds``: ``teacher.vocab_chunk_bounds`` of the streamed path, or None)."""
    if features.target_logits is not None:
        return teacher_table_from_logits(features.target_logits.flatten(0, 1)[read_U], t2d)
    if features.final_hidden is None or features.target_head is None:
        raise ValueError("Features need target_logits, or final_hidden and target_head")
    return teacher_table_from_hidden(features.final_hidden.flatten(0, 1)[read_U],
                                     features.target_head, t2d, chunk_size=config.teacher_chunk_size,
                                     compile_elementwise=config.compile_elementwise, bounds=bounds)


def ttt(params: dict[str, torch.Tensor], features: Features, rowmap: RowMap, config: TTTConfig,
        *, d2t: torch.Tensor, t2d: torch.Tensor,
        collectives: Collectives | None = None) -> Objective:
    """The TTT objective and per-step metrics of one batch (differentiable in params).

    Args:
        params: draft parameters (``draft.init_params``), any dtype/device.
        features: the batch (``Features``), ``[B, T, ...]``.
        rowmap: ``rowmap.build_rowmap(supervised_mask, k)`` of this batch (a packed
            batch: both given ``positions=features.positions``, SPEC 9).
        config: ``TTTConfig``; ``config.trim`` picks the full or the trimmed path.
        d2t, t2d: the vocab map.
        collectives: under data/sequence parallelism (``eagle3fn.parallel``): the
            cross-rank attention and the reduction of the per-step sums. ``features``
            and ``rowmap`` are then this rank's (``C`` own rows + a ``k`` tail).

    Returns:
        ``Objective`` (``objective`` 0-d, per-step ``[k]`` losses and metrics, tau).
    """
    config, plan, supervised_flat = prepare_batch(features, rowmap, config, collectives)
    table = batch_teacher(features, rowmap, config, supervised_flat, t2d=t2d)
    if collectives is None:
        return planned_objective(params, features, rowmap, config, plan, supervised_flat, table, d2t=d2t)
    terms = _step_terms(params, features, rowmap, config, table, d2t, supervised_flat, collectives, plan)
    if config.loss.normalization == "local_mean" and not _is_one(collectives.loss_scale):
        scale = torch.as_tensor(collectives.loss_scale).to(terms[0].loss_sum)
        terms = [dataclasses.replace(t, loss_sum=t.loss_sum * scale) for t in terms]
    terms = collectives.reduce_terms(terms)
    if collectives.gated is not None:
        terms = [dataclasses.replace(t, gated=g.to(t.gated)) for t, g in zip(terms, collectives.gated)]
    return objective(terms, collectives.denominator, config.loss)


def prepare_batch(features: Features, rowmap: RowMap, config: TTTConfig,
                  collectives: Collectives | None = None) -> tuple[TTTConfig, StepPlan, torch.Tensor | None]:
    """What ``ttt`` decides and plans before anything differentiable runs, on the host
    where the row map has a host twin: the batch checked against the row map and its
    teachers checked (``_check_teachers``), ``trim="auto"`` resolved (``choose_trim``),
    the steps' index maths (``layout.plan_steps``) and, on the full path, the supervised
    flat positions bool ``[B*T]`` (else None). Returns ``(config with the trim taken,
    plan, supervised_flat)``; ``planned_objective`` takes them."""
    B, T = features.input_ids.shape
    if (rowmap.batch_size, rowmap.buffer_len) != (B, T) or rowmap.ttt_length != config.ttt_length:
        raise ValueError(
            f"row map is for B={rowmap.batch_size}, T={rowmap.buffer_len}, k={rowmap.ttt_length} "
            f"but the batch has B={B}, T={T} and config.ttt_length={config.ttt_length}"
        )
    positions = rowmap.teacher_positions
    if positions.numel():  # on the host twin when there is one: no wait for the device
        twin = rowmap.host
        _check_teachers(*((positions, T, features.positions) if twin is None else
                          (twin.rowmap.teacher_positions, T, twin.positions)))
    if config.trim == "auto":
        config = dataclasses.replace(config, trim=choose_trim(rowmap, config))
    # The steps' index maths first, on the host: its one download waits for nothing but
    # the row map, not for the teacher.
    plan = plan_steps(rowmap, config.trim, features, is_flex_path(
        config.attention, collectives.attend if collectives is not None else None, features, config.draft.d),
        config.query_buckets)
    supervised_flat = None
    if config.trim == "none":
        supervised_flat = torch.zeros(B * T, dtype=torch.bool, device=positions.device)
        # index_fill_, not ``[positions] = True``: that copies the scalar from the host
        # (a sync at every full-path step, seen under CUDA's sync debug mode).
        supervised_flat.index_fill_(0, positions, True)
    return config, plan, supervised_flat


def batch_teacher(features: Features, rowmap: RowMap, config: TTTConfig, supervised_flat: torch.Tensor | None,
                  *, t2d: torch.Tensor, bounds: list[int] | None = None) -> TeacherTable:
    """The batch's teacher table (no grad): at the teacher positions ``s`` (``z'[s] =
    z[s+1]``, ``[U, Vd]``) on the trimmed paths; on the full path (``config.trim ==
    "none"``, ``supervised_flat`` given) at every position (``[B*T, Vd]``). ``bounds``:
    ``teacher.vocab_chunk_bounds(t2d, config.teacher_chunk_size)`` for a compiled
    region (None: read from ``t2d``)."""
    if config.trim != "none":
        return _teacher(features, rowmap.teacher_positions + 1, config, t2d, bounds)  # z'[s] = z[s+1]
    B, T = features.input_ids.shape
    s = torch.arange(B * T, device=supervised_flat.device)
    # A teacher at every position; the last one of each buffer has no z[s+1] and is
    # never supervised, so any row of z may stand in for it.
    return _teacher(features, torch.where(s % T == T - 1, s, s + 1), config, t2d, bounds)


def planned_objective(params: dict[str, torch.Tensor], features: Features, rowmap: RowMap, config: TTTConfig,
                      plan: StepPlan, supervised_flat: torch.Tensor | None, table: TeacherTable, *,
                      d2t: torch.Tensor, row_masks: Sequence[torch.Tensor] | None = None) -> Objective:
    """``ttt`` of one rank after its host part (``prepare_batch``) and teacher
    (``batch_teacher``): the unrolled steps, head, loss and objective, differentiable in
    ``params`` and free of host syncs (what a compiled training step traces).
    ``row_masks``: bool ``[n_j]`` per step, the rows of the row map that count (a
    bucketed row map's padding rows do not); None: all of them."""
    terms = _step_terms(params, features, rowmap, config, table, d2t, supervised_flat, None, plan, row_masks)
    return objective(terms, rowmap.denominator, config.loss)


def _check_teachers(positions_U: torch.Tensor, T: int, positions_BT: torch.Tensor | None) -> None:
    """ValueError when a teacher position ``s`` (flat ``b*T + s``) does not hold its
    teacher ``z[s+1]``: ``s`` is the last of its buffer, or (packed, ``positions_BT``)
    of its document. One host sync (none for host tensors: a ``RowMap.host`` twin)."""
    bad = [(positions_U % T == T - 1).any()]
    if positions_BT is not None:
        pos = positions_BT.flatten()
        bad.append((pos[(positions_U + 1).clamp_max(pos.numel() - 1)] != pos[positions_U] + 1).any())
    bad = torch.stack(bad).tolist()
    if bad[0]:
        raise ValueError(
            "a teacher position is the last of its buffer, where z'[s] = z[s+1] is not held; "
            "build the mask with align.supervised_mask (it never supervises t = L-1)"
        )
    if bad[-1]:
        raise ValueError(
            "a teacher position is the last of its packed document, where z'[s] = z[s+1] is the "
            "next document's; build the mask with align.supervised_mask(..., "
            "positions=features.positions)")


def _is_one(x: float | torch.Tensor) -> bool:
    """``x == 1`` for a number; a tensor scale is applied as it is (no host sync)."""
    return not isinstance(x, torch.Tensor) and x == 1


def gated_counts(features: Features, rowmap: RowMap, config: TTTConfig, t2d: torch.Tensor) -> torch.Tensor:
    """``[k]`` int64: the gated rows of each step of this batch (rows whose teacher's
    argmax is in the draft vocab), as ``ttt``'s step terms count them, without running
    the draft: the teacher at the teacher positions only (no grad). Summed over the
    micro-batches of a step (and ranks), it is ``Collectives.gated``."""
    with torch.no_grad():
        table = _teacher(features, rowmap.teacher_positions + 1, config, t2d)
        return torch.stack([table.gate[r].sum() for r in rowmap.table_rows]).to(torch.int64)
