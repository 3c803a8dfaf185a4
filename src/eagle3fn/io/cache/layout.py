"""Format 3's on-disk layout as pure functions: a padded batch to ragged rows and back,
the teacher rows kept, fp8 storage of the aux features and the size of a shard.

Legend: B conversations of a shard, S padded length (the longest one), L_b length of
conversation b, N = sum L_b real tokens, M teacher rows, Ht target hidden, X = 3*Ht.

One shard (one batch of ``prepare``) holds, with no padding::

    offsets            int64 [B+1]   conversation b is flat rows offsets[b]:offsets[b+1]
    input_ids          int32 [N]     x_t, conversations one after another
    loss_mask          bool  [N]     m_t
    aux                [N, X]        a_t at every real position (the draft's step-0 keys
                                     and values need every one); storage dtype, or
                                     float8_e4m3fn with
    aux_scale          fp32  [N, 3]  one scale per position and aux layer (fp8 only)
    teacher_offsets    int64 [B+1]   conversation b's teacher rows
    teacher_positions  int32 [M]     p = t + 1 for every t in sup (SPEC 1: z'[t] = z_{t+1})
    final_hidden       [M, Ht]       the target's final hidden at those positions only

``sup = {t : m_t = 1, t <= L-2}`` is ``align.supervised_mask`` (the EAGLE alignment
training uses), so ``final_hidden`` holds exactly the rows a teacher table reads; the
reader puts zeros elsewhere (the full-length path's unsupervised rows read them and
are gated out). Reading rebuilds the padded batch with ``io.batching.collate``, so
ids and masks are the ones ``prepare`` collated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import torch

from eagle3fn.align import supervised_mask

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
AUX_LAYERS = 3
INDEX_KEYS = ("offsets", "input_ids", "loss_mask", "teacher_offsets", "teacher_positions")


def teacher_mask(loss_mask_BS: torch.Tensor, attention_mask_BS: torch.Tensor) -> torch.Tensor:
    """bool ``[B, S]``: the positions ``p = t + 1`` whose final hidden a teacher reads,
    ``t`` in ``sup`` (``align.supervised_mask``, EAGLE alignment)."""
    sup = supervised_mask(loss_mask_BS, attention_mask_BS)
    out = torch.zeros_like(sup)
    out[:, 1:] = sup[:, :-1]
    return out


def real_lengths(attention_mask_BS: torch.Tensor, loss_mask_BS: torch.Tensor) -> torch.Tensor:
    """int64 ``[B]`` conversation lengths of a right-padded batch; ValueError when the
    attention mask is not a prefix of ones, the loss mask reaches into the padding or
    the batch is wider than its longest conversation (``collate`` gives neither)."""
    lengths = attention_mask_BS.long().sum(1)
    S = attention_mask_BS.shape[1]
    prefix = torch.arange(S)[None, :] < lengths[:, None]
    if not torch.equal(attention_mask_BS.bool().cpu(), prefix):
        raise ValueError("the cache stores right-padded batches: attention_mask must be ones then zeros")
    if bool((loss_mask_BS.bool().cpu() & ~prefix).any()):
        raise ValueError("loss_mask is set on padding; collate the batch with io.batching.collate")
    if S and int(lengths.max()) != S:
        raise ValueError(f"batch width {S} > its longest conversation {int(lengths.max())}; "
                         "collate the batch with io.batching.collate")
    return lengths


def quantize_fp8(x_NX: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn [N, X], scale fp32 [N, 3])``: each position's three aux layers
    scaled by their own ``amax / 448`` (1 for an all-zero one), rounded to e4m3."""
    N, X = x_NX.shape
    g = x_NX.float().view(N, AUX_LAYERS, X // AUX_LAYERS)
    amax = g.abs().amax(-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (g / scale[..., None]).to(FP8).view(N, X), scale


def dequantize_fp8(q_NX: torch.Tensor, scale_N3: torch.Tensor) -> torch.Tensor:
    """fp32 ``[N, X]``: ``q * scale`` per position and aux layer."""
    N, X = q_NX.shape
    return (q_NX.float().view(N, AUX_LAYERS, X // AUX_LAYERS) * scale_N3[..., None]).view(N, X)


def to_ragged(batch: dict, aux_BSX: torch.Tensor, final_hidden_BSH: torch.Tensor, *,
              dtype: torch.dtype, aux_fp8: bool) -> dict[str, torch.Tensor]:
    """One shard's tensors (module docstring) from a padded batch (``input_ids``,
    ``attention_mask``, ``loss_mask`` ``[B, S]``) and its features ``[B, S, ...]``, on
    the CPU: aux in ``dtype`` (or fp8 + scale), final hidden in ``dtype``."""
    mask = batch["attention_mask"].cpu()
    loss = batch["loss_mask"].cpu().bool()
    lengths = real_lengths(mask, loss)
    real = mask.bool()
    teach = teacher_mask(loss, mask)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
    offsets[1:] = lengths.cumsum(0)
    t_offsets = torch.zeros_like(offsets)
    t_offsets[1:] = teach.sum(1).cumsum(0)
    # Rows picked where the target ran (a GPU copies only what is kept).
    aux = aux_BSX.detach()[real.to(aux_BSX.device)].cpu()
    final = final_hidden_BSH.detach()[teach.to(final_hidden_BSH.device)].cpu()
    out = {"offsets": offsets, "input_ids": batch["input_ids"].cpu()[real].to(torch.int32),
           "loss_mask": loss[real], "teacher_offsets": t_offsets,
           "teacher_positions": teach.nonzero()[:, 1].to(torch.int32), "final_hidden": final.to(dtype)}
    if aux_fp8:
        out["aux"], out["aux_scale"] = quantize_fp8(aux)
    else:
        out["aux"] = aux.to(dtype)
    return out


def pad_id(batch: dict) -> int:
    """The id on the padding of ``input_ids`` (one value; 0 when there is none)."""
    pads = batch["input_ids"].cpu()[~batch["attention_mask"].cpu().bool()].unique()
    if len(pads) > 1:
        raise ValueError(f"input_ids hold several padding ids {pads.tolist()[:5]}; pad with one id")
    return int(pads[0]) if len(pads) else 0


def conversation_rows(offsets: torch.Tensor, positions_M: torch.Tensor | None,
                      t_offsets: torch.Tensor | None, window: tuple[int, int]) -> list[tuple[int, int]]:
    """Per conversation, the flat rows ``[lo, hi)`` at positions in ``window = [a, c)``:
    of ``aux`` (``positions_M`` None: conversation b's rows are its positions 0..L_b-1)
    or of ``final_hidden`` (rows of ``teacher_positions``, sorted per conversation)."""
    a, c = window
    spans = []
    for b in range(len(offsets) - 1):
        if positions_M is None:
            L = int(offsets[b + 1] - offsets[b])
            lo, hi = min(a, L), min(c, L)
            spans.append((int(offsets[b]) + lo, int(offsets[b]) + max(lo, hi)))
        else:
            s, e = int(t_offsets[b]), int(t_offsets[b + 1])
            p = positions_M[s:e].long()
            spans.append((s + int(torch.searchsorted(p, a)), s + int(torch.searchsorted(p, c))))
    return spans


def scatter_rows(rows_RX: torch.Tensor, positions_R: torch.Tensor, conversation_R: torch.Tensor,
                 B: int, window: tuple[int, int]) -> torch.Tensor:
    """``[B, W, X]`` zeros with row r at ``[conversation_R[r], positions_R[r] - a]``,
    ``W = c - a`` for ``window = [a, c)``."""
    a, c = window
    out = rows_RX.new_zeros((B * (c - a), rows_RX.shape[-1]))
    out[conversation_R * (c - a) + positions_R.long() - a] = rows_RX
    return out.view(B, c - a, rows_RX.shape[-1])


# ---- sizes ------------------------------------------------------------------------

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", FP8: "F8_E4M3",
                       torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


def shard_shapes(lengths: Sequence[int], teacher_rows: Sequence[int], hidden_size: int, *,
                 dtype: torch.dtype, aux_fp8: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{key: (shape, dtype)}`` of one shard's tensors (module docstring)."""
    B, N, M, Ht = len(lengths), sum(lengths), sum(teacher_rows), hidden_size
    shapes = {"offsets": ((B + 1,), torch.int64), "input_ids": ((N,), torch.int32),
              "loss_mask": ((N,), torch.bool), "teacher_offsets": ((B + 1,), torch.int64),
              "teacher_positions": ((M,), torch.int32), "final_hidden": ((M, Ht), dtype),
              "aux": ((N, AUX_LAYERS * Ht), FP8 if aux_fp8 else dtype)}
    if aux_fp8:
        shapes["aux_scale"] = ((N, AUX_LAYERS), torch.float32)
    return shapes


def file_bytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of the safetensors file holding tensors of these shapes: the payload plus
    its JSON header (8-byte length, compact JSON padded to 8), offsets spelled at their
    largest (a few bytes above the file, never below the payload)."""
    sizes = {k: math.prod(s) * torch.finfo(d).bits // 8 if d.is_floating_point else
             math.prod(s) * (1 if d == torch.bool else torch.iinfo(d).bits // 8)
             for k, (s, d) in shapes.items()}
    total = sum(sizes.values())
    header = json.dumps({k: {"dtype": SAFETENSORS_DTYPES[d], "shape": list(s), "data_offsets": [total, total]}
                         for k, (s, d) in shapes.items()}, separators=(",", ":"))
    return 8 + -(-len(header) // 8) * 8 + total


def component_bytes(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, int]:
    """Payload bytes of a shard by component: ``aux`` (with its fp8 scales),
    ``final_hidden`` (with the teacher positions and offsets) and ``index`` (ids, loss
    mask, offsets)."""
    def size(k):
        s, d = shapes[k]
        return math.prod(s) * (torch.finfo(d).bits if d.is_floating_point else
                               8 if d == torch.bool else torch.iinfo(d).bits) // 8
    return {"aux": size("aux") + (size("aux_scale") if "aux_scale" in shapes else 0),
            "final_hidden": size("final_hidden") + size("teacher_positions") + size("teacher_offsets"),
            "index": size("offsets") + size("input_ids") + size("loss_mask")}


def padded_bytes(batch: int, seq_len: int, hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Payload bytes of one shard of format 2 (today's until format 3): ``[B, S]`` ids
    (int64) and two masks (bool), aux ``[B, S, 3*Ht]`` and final hidden ``[B, S, Ht]``."""
    return batch * seq_len * (4 * hidden_size * torch.finfo(dtype).bits // 8 + 8 + 1 + 1)
