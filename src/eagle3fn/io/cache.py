"""Offline feature cache: run the target once, train many times.

Legend: B batch, S padded length, Ht target hidden, V target vocab.

Layout of a cache directory::

    manifest.json                  sizes, dtype, aux layer ids, caller metadata, shards
    head.safetensors               target_head [V, Ht]
    shard-000000.safetensors       input_ids [B, S], attention_mask [B, S], loss_mask [B, S],
    shard-000001.safetensors       aux [B, S, 3*Ht], final_hidden [B, S, Ht]
    ...

Every file is written to a temporary name and renamed into place, so a killed run
leaves only whole shards; ``write_cache`` with the same inputs skips the shards that
exist and loses at most the one in flight.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors.torch import load_file, save_file

from eagle3fn.shapes import Features

MANIFEST = "manifest.json"
HEAD = "head.safetensors"
FORMAT_VERSION = 1
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def bytes_per_token(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Cache bytes per padded token: aux (3*Ht) + final hidden (Ht) + ids and masks."""
    return 4 * hidden_size * torch.finfo(dtype).bits // 8 + 8 + 1 + 1


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    os.replace(tmp, path)


def _atomic_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _shard_name(i: int) -> str:
    return f"shard-{i:06d}.safetensors"


def write_cache(
    out_dir: str | os.PathLike,
    batches: Iterable[dict[str, torch.Tensor]],
    features_fn: Callable[[dict[str, torch.Tensor]], Features],
    *,
    meta: dict,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> dict:
    """Write one shard per batch; resume where an earlier run stopped.

    Args:
        out_dir: cache directory (created).
        batches: dicts with ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, S]``,
            in a deterministic order (a resumed run must see the same batches).
        features_fn: runs the target on a batch, returning ``Features`` with ``aux``,
            ``final_hidden`` and ``target_head``.
        meta: JSON-able description of the target and data (model path, aux layer ids,
            data file, max length, ...); a resumed run must pass the same, else
            ValueError (a cache is never silently mixed from two configurations).
        dtype: storage dtype of aux and final hidden.

    Returns:
        The manifest (also written to ``manifest.json``, ``complete`` set at the end).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = next(k for k, v in _DTYPES.items() if v == dtype)
    manifest = {"format": FORMAT_VERSION, "dtype": name, "meta": meta, "shards": [],
                "complete": False}
    if (out / MANIFEST).exists():
        old = json.loads((out / MANIFEST).read_text())
        if old.get("meta") != meta or old.get("dtype") != name:
            raise ValueError(
                f"{out} holds a cache written with other settings ({old.get('meta')}, "
                f"{old.get('dtype')}); use another directory or delete it"
            )
        manifest["shards"] = old["shards"]
    done = {s["name"] for s in manifest["shards"] if (out / s["name"]).exists()}
    manifest["shards"] = [s for s in manifest["shards"] if s["name"] in done]
    for i, batch in enumerate(batches):
        shard = _shard_name(i)
        if shard in done:
            continue
        feats = features_fn(batch)
        if not (out / HEAD).exists():
            _atomic_save({"target_head": feats.target_head.to(dtype)}, out / HEAD)
        _atomic_save({
            "input_ids": batch["input_ids"].long(),
            "attention_mask": batch["attention_mask"].bool(),
            "loss_mask": batch["loss_mask"].bool(),
            "aux": feats.aux.to(dtype),
            "final_hidden": feats.final_hidden.to(dtype),
        }, out / shard)
        B, S = batch["input_ids"].shape
        manifest["shards"].append({"name": shard, "batch": B, "seq_len": S,
                                   "tokens": int(batch["attention_mask"].sum())})
        manifest["shards"].sort(key=lambda s: s["name"])
        manifest.update(hidden_size=feats.final_hidden.shape[-1], vocab_size=feats.target_head.shape[0])
        _atomic_json(manifest, out / MANIFEST)
        log(f"wrote {shard} ({B} x {S})")
    manifest["complete"] = True
    _atomic_json(manifest, out / MANIFEST)
    return manifest


@dataclass(frozen=True)
class CachedBatch:
    """One cached batch: ``features`` (as the online path builds them) and ``loss_mask [B, S]``."""

    features: Features
    loss_mask: torch.Tensor


class FeatureCache:
    """Read a cache written by ``write_cache``; ``cache[i]`` is shard i as a CachedBatch.

    ``shards`` restricts reading to a subset (e.g. ``range(rank, len, world)`` per rank:
    each rank reads only its own files).
    """

    def __init__(self, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, shards: Iterable[int] | None = None) -> None:
        self.path = Path(path)
        if not (self.path / MANIFEST).exists():
            raise FileNotFoundError(
                f"no {MANIFEST} in {self.path}: not a feature cache (write one with eagle3fn prepare)"
            )
        self.manifest = json.loads((self.path / MANIFEST).read_text())
        if self.manifest.get("format") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: cache format {self.manifest.get('format')} is not "
                             f"{FORMAT_VERSION}; rewrite it with this version of eagle3fn prepare")
        if not self.manifest["complete"]:
            raise ValueError(f"{self.path} is an unfinished cache ({len(self.manifest['shards'])} "
                             "shards); rerun eagle3fn prepare with the same settings to finish it")
        names = [s["name"] for s in self.manifest["shards"]]
        self.names = names if shards is None else [names[i] for i in shards]
        self.device = torch.device(device)
        self.dtype = dtype
        self._head = None

    def __len__(self) -> int:
        return len(self.names)

    @property
    def target_head(self) -> torch.Tensor:
        """``[V, Ht]``, loaded once."""
        if self._head is None:
            self._head = self._cast(load_file(str(self.path / HEAD))["target_head"])
        return self._head

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x.to(self.dtype) if self.dtype is not None and x.is_floating_point() else x

    def __getitem__(self, i: int) -> CachedBatch:
        return self.read(i)

    def read(self, i: int, window=None) -> CachedBatch:
        """Shard i; with ``window=(start, stop)`` (or a function of the shard's length
        S returning it) the large per-position tensors (``aux``, ``final_hidden``) hold
        only positions ``[start, stop)``, read from disk as a slice (a sequence-parallel
        rank reads its own chunk and tail; ``(0, 0)`` reads ids and masks alone), while
        ids and masks stay whole ``[B, S]``."""
        path = str(self.path / self.names[i])
        if window is None:
            t = load_file(path)
        else:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                t = {name: f.get_tensor(name) for name in f.keys() if name not in ("aux", "final_hidden")}
                if callable(window):
                    window = window(t["input_ids"].shape[1])
                for name in ("aux", "final_hidden"):
                    t[name] = f.get_slice(name)[:, window[0]:window[1]]
        features = Features(
            input_ids=t["input_ids"].to(self.device),
            aux=self._cast(t["aux"]),
            attention_mask=t["attention_mask"].long().to(self.device),
            final_hidden=self._cast(t["final_hidden"]),
            target_head=self.target_head,
        )
        return CachedBatch(features, t["loss_mask"].to(self.device))

    def __iter__(self) -> Iterator[CachedBatch]:
        return (self[i] for i in range(len(self)))


def prepare(target, examples, out_dir: str | os.PathLike, *, batch_size: int, pad_token_id: int,
            meta: dict, dtype: torch.dtype = torch.bfloat16,
            log: Callable[[str], None] = print) -> dict:
    """Run ``target`` (an ``io.target.TargetModel``) over tokenized ``examples`` once and
    write the cache, printing its estimated size first.

    Batches are cut in file order (no shuffling: a resumed run must see the same
    batches); training shuffles shards. Returns the manifest.
    """
    from eagle3fn.io.data import batches, collate
    from eagle3fn.io.target import target_features

    groups = list(batches(examples, batch_size=batch_size, seed=0, shuffle=False))
    padded = sum(len(g) * max(len(e) for e in g) for g in groups)
    size = padded * bytes_per_token(target.hidden_size, dtype)
    log(f"{len(examples)} examples -> {len(groups)} shards, {padded} padded tokens, "
        f"about {size / 2**30:.2f} GiB in {out_dir}")
    device = next(target.model.parameters()).device

    def features_fn(batch):
        return target_features(target, batch["input_ids"].to(device),
                               batch["attention_mask"].to(device))

    return write_cache(out_dir, (collate(g, pad_token_id) for g in groups), features_fn,
                       meta=meta, dtype=dtype, log=log)
