"""The host-side step layout: one batch's index maths for all k steps, planned on the
host from the row map and uploaded in a few copies (``plan_steps``), instead of a few
dozen tiny kernels per step.

Legend: B batch, C own rows per sample, k TTT length, n_j rows of step j, m_j the
rows step j computes (``computed_rows``), Lp = ``B*C`` rounded up to the flex block.

What is planned: per step, the flex path's ``PackedLayout`` (query windows, from each
query's document start in a packed batch, and block tables); under ``trim="backbone"``
the positions of step j's computed rows inside step j-1's (``within``) and of
``rows_j`` inside step j's (``at``). All k steps in one batched pass over their
concatenated rows (``blocks.packed_layouts``, ``_insides``), not k passes: the host
runs this before every step, on the training thread.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from eagle3fn.align import document_starts
from eagle3fn.shapes import Features, HostRows, RowMap
from eagle3fn.unrolled.blocks import PackedLayout, packed_layout, packed_layouts, padded_key_len
from eagle3fn.unrolled.config import DEFAULT_QUERY_BUCKETS
from eagle3fn.unrolled.policy import computed_rows
from eagle3fn.unrolled.runtime import one_thread


def _upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host, int32/int64, any shapes) on ``device`` in one copy per dtype:
    packed into one pinned buffer (one ``cat``), each segment starting at a 64-byte
    boundary (compiled kernels take them as inputs), sent with ``non_blocking``, and
    cut back into views of the device buffer (one ``split``) with the same shapes."""
    odd = {t.dtype for t in tensors} - {torch.int64, torch.int32}
    if odd:
        raise TypeError(f"_upload sends int32/int64 tensors only, got {sorted(map(str, odd))}")
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for dtype in (torch.int64, torch.int32):
        mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        if not mine:
            continue
        align = 64 // torch.empty((), dtype=dtype).element_size()
        zeros = torch.zeros(align, dtype=dtype)
        # Each tensor then the zeros that pad it to the alignment: one cat, one split.
        pieces, sizes, at = [], [], []
        for i in mine:
            n, pad = tensors[i].numel(), -tensors[i].numel() % align
            at.append(len(pieces))
            pieces.append(tensors[i] if tensors[i].dim() == 1 else tensors[i].reshape(-1))
            sizes.append(n)
            if pad:
                pieces.append(zeros[:pad])
                sizes.append(pad)
        host = torch.empty(sum(sizes), dtype=dtype, pin_memory=torch.cuda.is_available())
        torch.cat(pieces, out=host)
        dev = host.to(device, non_blocking=True).split(sizes)
        for i, a in zip(mine, at):
            out[i] = dev[a] if tensors[i].dim() == 1 else dev[a].view(tensors[i].shape)
    return out


def _to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` as int64 host tensors: copied in one download (one host sync when
    they live on a GPU); returned as they are when they are int64 host tensors already."""
    if all(t.device.type == "cpu" and t.dtype == torch.int64 for t in tensors):
        return list(tensors)
    sizes = [t.numel() for t in tensors]
    flat = torch.cat([t.to(torch.int64).flatten() for t in tensors]).cpu()
    return [x.view(t.shape) for x, t in zip(flat.split(sizes), tensors)]


def rowmap_to_device(rowmap: RowMap, device: torch.device, attention_mask_BT: torch.Tensor,
                     positions_BT: torch.Tensor | None = None) -> RowMap:
    """A row map built on the host (``rowmap.build_rowmap`` of host masks), on
    ``device`` in one non-blocking copy, keeping the host one and the batch's host masks
    as its ``host`` (``HostRows``): ``ttt`` then plans the steps and checks the
    teachers on the host, and the training thread never waits for the device to learn
    them (no host sync per batch).

    Args:
        rowmap: a ``RowMap`` whose tensors are on the host (CPU).
        device: where the step runs.
        attention_mask_BT: ``[B, T]`` the batch's attention mask, on the host.
        positions_BT: int64 ``[B, T]`` or None, ``Features.positions`` on the host.

    Returns:
        The ``RowMap`` with its tensors on ``device`` (the same values) and ``host`` set.
        On the CPU the tensors are the host ones.
    """
    if rowmap.teacher_positions.device.type != "cpu" or attention_mask_BT.device.type != "cpu":
        raise ValueError(f"rowmap_to_device sends a host row map with host masks; got them on "
                         f"{rowmap.teacher_positions.device} and {attention_mask_BT.device}")
    host = HostRows(rowmap=rowmap, lengths=attention_mask_BT[:, :rowmap.num_rows].sum(1).to(torch.int64),
                    positions=positions_BT)
    k = rowmap.ttt_length
    flat = [*rowmap.rows, rowmap.teacher_positions, *rowmap.table_rows, *rowmap.backbone_rows, rowmap.step0_rows]
    sent = iter(_upload(flat, device) if _sends_plan(device) else flat)
    take = lambda n: tuple(next(sent) for _ in range(n))  # noqa: E731
    rows, (teacher,), table, back, (step0,) = take(k), take(1), take(k), take(len(rowmap.backbone_rows)), take(1)
    return dataclasses.replace(rowmap, rows=rows, teacher_positions=teacher, table_rows=table,
                               backbone_rows=back, step0_rows=step0, host=host)


def _host_layouts(rows: Sequence[torch.Tensor | None], lengths_B: torch.Tensor, num_rows: int,
                  query_buckets: int, starts_BC: torch.Tensor | None = None) -> list[PackedLayout | None]:
    """``packed_layout`` of each step's rows (host tensors ``[n_j]``; ``None``: every
    row), None for a step without rows; ``starts_BC``: a packed batch's document starts
    (int64 ``[B, C]``). All the steps' layouts in one batched pass
    (``blocks.packed_layouts``), equal tensor for tensor to
    ``_host_layouts_per_step``. The every-row layout is built once and shared by the
    steps that use it (``trim`` none / loss: every step)."""
    B = lengths_B.numel()
    every = [torch.arange(B * num_rows)] if any(r is None for r in rows) else []
    own = [r for r in rows if r is not None and r.numel()]
    built = iter(packed_layouts(every + own, lengths_B, num_rows, padded_key_len(B * num_rows), query_buckets,
                                starts_BC))
    shared = next(built) if every else None
    return [shared if r is None else None if not r.numel() else next(built) for r in rows]


def _host_layouts_per_step(rows: Sequence[torch.Tensor | None], lengths_B: torch.Tensor, num_rows: int,
                           query_buckets: int, starts_BC: torch.Tensor | None = None) -> list[PackedLayout | None]:
    """``_host_layouts``' readable twin: one ``packed_layout`` call per step (the
    every-row one built once and shared); the oracle of the batched pass and the
    benchmark's baseline (``benchmarks/plan_host.py``)."""
    Lp = padded_key_len(lengths_B.numel() * num_rows)
    every = None if all(r is not None for r in rows) else packed_layout(
        torch.arange(lengths_B.numel() * num_rows), lengths_B, num_rows, Lp, query_buckets, starts_BC)
    return [every if r is None else None if not r.numel()
            else packed_layout(r, lengths_B, num_rows, Lp, query_buckets, starts_BC) for r in rows]


def _distinct(layouts: Sequence[PackedLayout | None]) -> list[PackedLayout]:
    """The layouts, each shared one once (by identity), in order of first use."""
    return list({id(lay): lay for lay in layouts if lay is not None}.values())


def _layout_tensors(layouts: Sequence[PackedLayout | None]) -> list[torch.Tensor]:
    """The tensors of the distinct layouts, in the order ``_rebuild_layouts`` takes them."""
    return [t for lay in _distinct(layouts) for t in (lay.start, lay.last, *lay.tables)]


def _owned(layouts: Sequence[PackedLayout | None]) -> list[PackedLayout | None]:
    """The layouts with every tensor in a storage of its own (a copy; a shared layout
    stays shared): the batched pass's tensors are views of a few buffers, and dynamo
    guards a view's base and storage offset, so compiled attention on the host's own
    device (the CPU, ``compile_on_cpu``) would recompile when they change. A sent plan
    is rebuilt from the device buffer instead (``_rebuild_layouts``)."""
    copies = {id(lay): PackedLayout(lay.num_queries, lay.start.clone(), lay.last.clone(),
                                    tuple(t.clone() for t in lay.tables))
              for lay in _distinct(layouts)}
    return [None if lay is None else copies[id(lay)] for lay in layouts]


def _own_storage(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (any device), each in a storage of its own at offset 0, made
    by one ``_foreach_copy_`` per dtype (a kernel launch each on CUDA). The uploaded plan's tensors
    are views of one device buffer, and dynamo makes a view's storage offset a symbol of
    the compiled FlexAttention graph: an offset of 0 or 1 specialises it, and an offset
    equal to another size at compile time becomes a guard (duck sizing) that a later
    batch of another layout breaks (tests/test_stable_shapes.py, with the upload forced
    on the CPU)."""
    fresh = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    for dtype in {t.dtype for t in tensors}:  # one launch per dtype (foreach's fast path)
        mine = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        torch._foreach_copy_([fresh[i] for i in mine], [tensors[i] for i in mine])
    return fresh


def _rebuild_layouts(layouts: Sequence[PackedLayout | None], sent) -> list[PackedLayout | None]:
    """The layouts with their tensors taken in order from the iterator ``sent``
    (``_layout_tensors``' order); a layout shared by steps stays shared."""
    rebuilt = {id(lay): PackedLayout(lay.num_queries, next(sent), next(sent),
                                     tuple(next(sent) for _ in lay.tables))
               for lay in _distinct(layouts)}
    return [None if lay is None else rebuilt[id(lay)] for lay in layouts]


@dataclass(frozen=True)
class StepPlan:
    """Index maths of one batch's unrolled steps, done on the host (``plan_steps``).

    Fields:
        layouts: the flex path's ``PackedLayout`` per step (None: another attention).
        computed: ``trim="backbone"``: the rows each step computes (``computed_rows``,
            as the row map holds them); else None.
        within: ``trim="backbone"``: per step ``j >= 1``, the positions of the computed
            rows of step j inside those of step ``j - 1`` (entry 0 None); else None.
        at: per step, the rows whose loss is taken, as positions in the step's output.
    """

    layouts: list | None
    computed: tuple | None
    within: list | None
    at: list


def rows_inside(outer: torch.Tensor, inner: torch.Tensor) -> torch.Tensor:
    """Positions of the sorted rows ``inner`` inside the sorted ``outer``. Clamped so a
    hand-made row map whose rows are not nested reads wrong rows (which the
    negative-control tests catch) instead of out of range."""
    return torch.searchsorted(outer, inner).clamp_max(max(outer.numel() - 1, 0))


def _insides(outer: Sequence[torch.Tensor], pairs: Sequence[tuple[int, torch.Tensor]],
             size: int) -> list[torch.Tensor]:
    """``[rows_inside(outer[i], inner) for i, inner in pairs]`` at once, for host int64 rows
    in ``[0, size)``, without a binary search: ``searchsorted(outer_i, x)`` is the count
    of ``outer_i``'s entries below x, a prefix sum of each outer list's counts shifted
    by one (``[len(outer), size + 1]``, one ``bincount`` each), read at the inner rows
    and clamped as ``rows_inside`` clamps. Returns int64 tensors ``[len(inner)]``, one per
    pair."""
    below = torch.stack([torch.bincount(o + 1, minlength=size + 1) for o in outer]).cumsum(1)
    return [below[i].index_select(0, inner).clamp_max_(max(outer[i].numel() - 1, 0)) for i, inner in pairs]


def _sends_plan(device: torch.device) -> bool:
    """Whether ``plan_steps`` uploads its host tensors (every device but the CPU; tests
    force it on the CPU to check the packing)."""
    return device.type != "cpu"


@one_thread
def plan_steps(rowmap: RowMap, trim: str, features: Features, flex: bool,
               query_buckets: int = DEFAULT_QUERY_BUCKETS, impl: str = "batched") -> StepPlan:
    """The ``StepPlan`` of a batch (``flex``: with the packed layouts of
    ``query_buckets``, ``TTTConfig.query_buckets``): on a GPU, the row lists it needs
    come down in one copy, and the layouts and positions go up in two, instead of a
    few dozen tiny kernels per step.

    ``impl``: ``"batched"`` plans the k steps in one pass over their concatenated rows
    (``_host_layouts``, ``_insides``); ``"per_step"`` is its readable twin, one
    ``packed_layout`` and two ``rows_inside`` per step, kept as the tests' oracle and the
    benchmark's baseline (benchmarks/plan_host.py: ~400 dispatched ops against ~1100 for
    k = 7 under ``trim="backbone"``). Both give the same tensors."""
    if impl not in ("batched", "per_step"):
        raise ValueError(f"impl must be 'batched' or 'per_step', got {impl!r}")
    B, C = rowmap.batch_size, rowmap.num_rows
    device = features.aux.device
    computed = computed_rows(rowmap) if trim == "backbone" else None
    packed = flex and features.positions is not None
    if rowmap.host is not None:  # built on the host: nothing to download
        twin = rowmap.host
        lengths, positions = twin.lengths, twin.positions
        rows = twin.rowmap.rows
        computed_h = computed_rows(twin.rowmap) if computed is not None else None
    else:
        lengths, positions = features.attention_mask[:, :C].sum(1), features.positions
        rows, computed_h = rowmap.rows, computed
    starts = [document_starts(positions[:, :C])] if packed else []
    wanted = ([lengths] if flex else []) + starts + (list(computed_h) + list(rows) if computed else [])
    host = iter(_to_host(wanted))
    lengths_h = next(host) if flex else None
    starts_h = next(host) if packed else None
    layouts = within = None
    at = list(rowmap.rows)
    if computed is not None:
        comp_h = [next(host) for _ in computed]
        rows_h = [next(host) for _ in rowmap.rows]
        if impl == "batched":  # within[j]: comp_j inside comp_{j-1}; at[j]: rows_j inside comp_j
            found = _insides(comp_h, list(enumerate(comp_h[1:])) + list(enumerate(rows_h)), B * C)
            within, at = [None] + found[:len(comp_h) - 1], found[len(comp_h) - 1:]
        else:
            within = [None] + [rows_inside(a, b) for a, b in zip(comp_h, comp_h[1:])]
            at = [rows_inside(c, r) for c, r in zip(comp_h, rows_h)]
    if flex:
        lay = _host_layouts if impl == "batched" else _host_layouts_per_step
        layouts = lay(comp_h if computed is not None else [None] * rowmap.ttt_length, lengths_h, C, query_buckets,
                      starts_h)
    if not _sends_plan(device):
        return StepPlan(_owned(layouts) if flex and impl == "batched" else layouts, computed, within, at)
    moved = (_layout_tensors(layouts) if flex else []) + (
        [w for w in within[1:]] + at if computed is not None else [])
    sent = _upload(moved, device)
    if flex:  # the attention's inputs in storages of their own (_own_storage), one launch
        n = len(_layout_tensors(layouts))
        sent = _own_storage(sent[:n]) + sent[n:]
    sent = iter(sent)
    if flex:
        layouts = _rebuild_layouts(layouts, sent)
    if computed is not None:
        within = [None] + [next(sent) for _ in within[1:]]
        at = [next(sent) for _ in at]
    return StepPlan(layouts, computed, within, at)
