"""``prepare``: run the target once over tokenized conversations and write the cache,
with its size estimated before the target runs (``estimate``) and measured after.

Legend: B conversations per shard, L tokens of one conversation, Ht target hidden,
V target vocab.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

import torch

from eagle3fn.io.cache import layout
from eagle3fn.io.cache.store import write_cache


def estimate(groups: Sequence[Sequence], hidden_size: int, vocab_size: int, *,
             dtype: torch.dtype = torch.bfloat16, aux_dtype: str = "storage") -> dict:
    """The cache's bytes, computed from the conversations alone (lengths and loss
    masks: the teacher rows are ``layout.teacher_mask``'s), before any target runs.

    Args:
        groups: the shards' conversations (``io.data.Example`` lists, ``[L]`` each).
        hidden_size, vocab_size: Ht and V of the target.
        dtype, aux_dtype: as ``write_cache``.

    Returns:
        ``{"bytes": shards + head, "tokens": real tokens, "padded_bytes": format 2's
        payload for the same batches}``.
    """
    total = padded = tokens = 0
    for g in groups:
        lengths = [len(e) for e in g]
        teach = [int(layout.teacher_mask(e.loss_mask[None].bool(), torch.ones(1, len(e))).sum()) for e in g]
        total += layout.file_bytes(layout.shard_shapes(lengths, teach, hidden_size, dtype=dtype,
                                                       aux_fp8=aux_dtype == "float8_e4m3"))
        padded += layout.padded_bytes(len(g), max(lengths), hidden_size, dtype)
        tokens += sum(lengths)
    head = layout.file_bytes({"target_head": ((vocab_size, hidden_size), dtype)})
    return {"bytes": total + head, "tokens": tokens, "padded_bytes": padded + head}


def measured_bytes(out_dir: str | os.PathLike, manifest: dict) -> int:
    """Bytes on disk of the files ``manifest`` lists (shards and head)."""
    names = [s["name"] for s in manifest["shards"]] + (["head.safetensors"] if manifest.get("head") else [])
    return sum((Path(out_dir) / n).stat().st_size for n in names)


def prepare(target, examples, out_dir: str | os.PathLike, *, batch_size: int, pad_token_id: int,
            fingerprint: dict, dtype: torch.dtype = torch.bfloat16, aux_dtype: str = "storage",
            log: Callable[[str], None] = print) -> dict:
    """Run ``target`` (an ``io.target.TargetModel``) over tokenized ``examples`` once and
    write the cache, printing its estimated size first and its measured size at the end.

    ``fingerprint`` identifies the target and data by content (see the CLI's
    ``prepare``); ``batch_size`` and ``target.aux_layer_ids`` are added to it. Batches
    are cut in file order (no shuffling: a resumed run must see the same batches);
    training shuffles shards. Returns the manifest.
    """
    from eagle3fn.io.batching import batches, collate
    from eagle3fn.io.target import target_features

    groups = list(batches(examples, batch_size=batch_size, seed=0, shuffle=False))
    size = estimate(groups, target.hidden_size, target.vocab_size, dtype=dtype, aux_dtype=aux_dtype)
    per = size["bytes"] / max(size["tokens"], 1)
    log(f"{len(examples)} examples -> {len(groups)} shards, {size['tokens']} tokens; estimated "
        f"{size['bytes'] / 2**30:.3f} GiB ({size['bytes']} bytes, {per:.0f} per token; padded format 2: "
        f"{size['padded_bytes'] / max(size['tokens'], 1):.0f}) in {out_dir}")
    device = next(target.model.parameters()).device

    def features_fn(batch):
        return target_features(target, batch["input_ids"].to(device),
                               batch["attention_mask"].to(device))

    fingerprint = {**fingerprint, "batch_size": batch_size, "aux_layer_ids": list(target.aux_layer_ids)}
    manifest = write_cache(out_dir, ({**collate(g, pad_token_id), "sources": [e.source for e in g]}
                                     for g in groups),
                           features_fn, fingerprint=fingerprint, dtype=dtype, aux_dtype=aux_dtype, log=log)
    got = measured_bytes(out_dir, manifest)
    log(f"measured {got / 2**30:.3f} GiB ({got} bytes, {got / max(size['tokens'], 1):.0f} per token; "
        f"estimate {size['bytes']}, {100 * (size['bytes'] - got) / max(got, 1):+.2f}%) in {out_dir}")
    return manifest
