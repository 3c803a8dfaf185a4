"""Offline feature cache: run the target once, train many times.

Legend: B batch, S padded length, Ht target hidden, V target vocab.

Layout of a cache directory::

    manifest.json                  format, fingerprint, dtype, sizes, per file bytes + sha256
    head.safetensors               target_head [V, Ht]
    shard-000000.safetensors       input_ids [B, S], attention_mask [B, S], loss_mask [B, S],
    shard-000001.safetensors       aux [B, S, 3*Ht], final_hidden [B, S, Ht]
    ...

The manifest's ``fingerprint`` says what the cache was made from, by content (``io.
fingerprint``: target files, data file, aux layer ids, max length, storage dtype, ...),
never by how a path was spelled. Every file is written to a temporary name, checksummed
and renamed into place, so a killed run leaves only whole shards. ``write_cache`` with
the same fingerprint resumes: it checks each shard already written (size and sha256),
rewrites the broken ones and only then marks the cache complete; another fingerprint is
refused, listing each difference (a cache is never mixed from two configurations).

Non-finite features are refused when written and when read. ``verify_cache`` checks a
whole cache (``eagle3fn cache verify DIR``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.fingerprint import diff, file_fingerprint, target_fingerprint
from eagle3fn.shapes import Features

MANIFEST = "manifest.json"
HEAD = "head.safetensors"
FORMAT_VERSION = 2
"""2: content fingerprint and per-file sha256 in the manifest (1 held spelled paths)."""
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SHARD_KEYS = {"input_ids", "attention_mask", "loss_mask", "aux", "final_hidden"}


def bytes_per_token(hidden_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Cache bytes per padded token: aux (3*Ht) + final hidden (Ht) + ids and masks."""
    return 4 * hidden_size * torch.finfo(dtype).bits // 8 + 8 + 1 + 1


def _repair(out: Path) -> str:
    return (f"run eagle3fn cache verify {out}, then rerun eagle3fn prepare with the same settings "
            "to rewrite the broken shards")


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write, checksum, rename; returns ``{"bytes", "sha256"}`` of the file."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    fingerprint = file_fingerprint(tmp)
    os.replace(tmp, path)
    return fingerprint


def _atomic_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _shard_name(i: int) -> str:
    return f"shard-{i:06d}.safetensors"


def _nonfinite_row(x: torch.Tensor) -> int | None:
    """The first row b of ``x [B, ...]`` holding a NaN or inf, else None."""
    bad = ~torch.isfinite(x).flatten(1).all(1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def _file_problem(path: Path, entry: dict) -> str | None:
    """Why ``path`` is not the file the manifest ``entry`` recorded (None: it is)."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']}"
    if file_fingerprint(path)["sha256"] != entry["sha256"]:
        return "checksum differs from the manifest (corrupted or changed on disk)"
    return None


def _parse_manifest(path: Path) -> dict | None:
    """The manifest of a current-format cache; None when unreadable; UsageError when it
    is of another format."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(manifest, dict) or "format" not in manifest:
        return None
    if manifest["format"] != FORMAT_VERSION:
        raise UsageError(
            f"{path} holds a feature cache of format {manifest['format']}, this eagle3fn reads "
            f"format {FORMAT_VERSION}; rebuild it with eagle3fn prepare (delete {path} first, or "
            "prepare into another --out)")
    keys = {"fingerprint", "dtype", "shards", "complete"}
    if not keys <= manifest.keys() or not all({"name", "bytes", "sha256"} <= s.keys()
                                               for s in manifest["shards"]):
        return None
    return manifest


def read_manifest(cache_dir: str | os.PathLike) -> dict:
    """The manifest of the cache in ``cache_dir``, checked to be readable and current.

    Raises:
        FileNotFoundError: no manifest (not a feature cache).
        UsageError: a cache of another format (rebuild it).
        RunError: the manifest is unreadable.
    """
    path = Path(cache_dir)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(
            f"no {MANIFEST} in {path}: not a feature cache (write one with eagle3fn prepare)")
    manifest = _parse_manifest(path)
    if manifest is None:
        raise RunError(f"{path / MANIFEST} is unreadable (not a manifest written by eagle3fn "
                       f"prepare); rerun eagle3fn prepare with the same settings and --out {path} "
                       "to rewrite the cache")
    return manifest


def cache_fingerprint(cache_dir: str | os.PathLike) -> dict:
    """What the cache was made from, by content: the manifest's ``fingerprint`` (for a
    cache from ``prepare``: ``target``, ``data``, ``target_dtype``, ``max_length``,
    ``on_error``, ``batch_size``, ``aux_layer_ids``, ``dtype``, ``format``). No paths."""
    return read_manifest(cache_dir)["fingerprint"]


def check_cache_for_training(cache_dir: str | os.PathLike, *, model_dir: str | os.PathLike,
                             gguf_file: str | None = None,
                             aux_layer_ids: Iterable[int] | None = None) -> tuple[int, int, int]:
    """The cache's aux layer ids, after checking that it was prepared from this target
    (by content, ``target_fingerprint(model_dir, gguf_file)``) and, when given, these
    ``aux_layer_ids``.

    Raises:
        UsageError: another target or other aux layer ids, listing each difference.
        FileNotFoundError, RunError: as ``read_manifest``.
    """
    fp = cache_fingerprint(cache_dir)
    old = {"target": fp.get("target"), "aux_layer_ids": fp.get("aux_layer_ids")}
    new = {"target": target_fingerprint(model_dir, gguf_file),
           "aux_layer_ids": old["aux_layer_ids"] if aux_layer_ids is None else list(aux_layer_ids)}
    lines = diff(old, new)
    if lines:
        raise UsageError(
            f"--cache {cache_dir} was prepared from another target or other aux layer ids "
            f"(cache -> this run: {'; '.join(lines)}); train with the --model/--gguf-file it was "
            "prepared from and without --aux-layer-ids (the cache's are used), or prepare a cache "
            "for this target")
    return tuple(old["aux_layer_ids"])


def _check_resume(out: Path, old: dict, new: dict) -> None:
    lines = diff(old, new)
    if lines:
        raise UsageError(
            f"{out} holds a cache written with other settings (old -> new: {'; '.join(lines)}); "
            f"rerun with the settings it was written with to resume it, or use another --out "
            f"(or delete {out})")


def check_resumable(out_dir: str | os.PathLike, fingerprint: dict) -> None:
    """Before any heavy work: if ``out_dir`` holds a cache, its fingerprint agrees with
    ``fingerprint`` on every key ``fingerprint`` has (UsageError listing each difference
    otherwise; also UsageError for a cache of another format)."""
    out = Path(out_dir)
    old = _parse_manifest(out) if (out / MANIFEST).is_file() else None
    if old is not None:
        _check_resume(out, {k: old["fingerprint"].get(k) for k in fingerprint}, fingerprint)


def write_cache(
    out_dir: str | os.PathLike,
    batches: Iterable[dict],
    features_fn: Callable[[dict], Features],
    *,
    fingerprint: dict,
    dtype: torch.dtype = torch.bfloat16,
    log: Callable[[str], None] = print,
) -> dict:
    """Write one shard per batch; resume where an earlier run stopped.

    Args:
        out_dir: cache directory (created).
        batches: dicts with ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, S]``
            and optionally ``sources`` (B names, e.g. ``file:line``, for messages), in a
            deterministic order (a resumed run must see the same batches).
        features_fn: runs the target on a batch, returning ``Features`` with ``aux``,
            ``final_hidden`` and ``target_head``.
        fingerprint: JSON-able content identity of the target, data and settings (no
            spelled paths); ``dtype`` and ``format`` are added. A resumed run must pass
            the same, else UsageError listing each difference.
        dtype: storage dtype of aux, final hidden and head.

    Returns:
        The manifest (also written to ``manifest.json``, ``complete`` set at the end,
        after every shard was written or checked against its size and sha256).

    Raises:
        UsageError: ``out_dir`` holds a cache with another fingerprint or format.
        RunError: the target gave a non-finite feature (names the row and conversation).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = next(k for k, v in _DTYPES.items() if v == dtype)
    fingerprint = {**fingerprint, "dtype": name, "format": FORMAT_VERSION}
    manifest = {"format": FORMAT_VERSION, "dtype": name, "fingerprint": fingerprint, "shards": [],
                "head": None, "complete": False}
    done = _resume(out, manifest, log)
    _atomic_json(manifest, out / MANIFEST)  # incomplete, listing only whole files, until the end
    for i, batch in enumerate(batches):
        shard = _shard_name(i)
        if shard in done and manifest["head"] is not None:
            continue
        feats = features_fn(batch)
        tensors = _finite_features(feats, batch, shard, dtype)
        if manifest["head"] is None:
            head = feats.target_head.to(dtype).cpu()
            if _nonfinite_row(head) is not None:
                raise RunError(f"the target's lm_head holds non-finite weights (row "
                               f"{_nonfinite_row(head)}); check the model files")
            manifest["head"] = _atomic_save({"target_head": head}, out / HEAD)
        if shard in done:
            continue
        written = _atomic_save({
            "input_ids": batch["input_ids"].long(),
            "attention_mask": batch["attention_mask"].bool(),
            "loss_mask": batch["loss_mask"].bool(),
            **tensors,
        }, out / shard)
        B, S = batch["input_ids"].shape
        manifest["shards"].append({"name": shard, "batch": B, "seq_len": S,
                                   "tokens": int(batch["attention_mask"].sum()), **written})
        manifest["shards"].sort(key=lambda s: s["name"])
        manifest.update(hidden_size=feats.final_hidden.shape[-1], vocab_size=feats.target_head.shape[0])
        _atomic_json(manifest, out / MANIFEST)
        log(f"wrote {shard} ({B} x {S})")
    manifest["complete"] = True
    _atomic_json(manifest, out / MANIFEST)
    return manifest


def _resume(out: Path, manifest: dict, log: Callable[[str], None]) -> set[str]:
    """The shards of an earlier run in ``out`` that pass their size and sha256 check
    (listed into ``manifest``, with a head that passes too); UsageError for another
    fingerprint. Broken files are named and left to be rewritten."""
    fingerprint = manifest["fingerprint"]
    done: set[str] = set()
    if (out / MANIFEST).exists():
        old = _parse_manifest(out)
        if old is None:
            log(f"{out / MANIFEST} is unreadable; rewriting every shard")
        else:
            _check_resume(out, old["fingerprint"], fingerprint)
            if old["shards"]:
                log(f"checking the {len(old['shards'])} shards already in {out}")
            for s in old["shards"]:
                problem = _file_problem(out / s["name"], s)
                if problem:
                    log(f"{s['name']}: {problem}; rewriting it")
                else:
                    manifest["shards"].append(s)
                    done.add(s["name"])
            head = old.get("head")
            problem = "missing" if head is None else _file_problem(out / HEAD, head)
            if problem and done:
                log(f"{HEAD}: {problem}; rewriting it")
            manifest.update({k: old[k] for k in ("hidden_size", "vocab_size") if k in old},
                            head=None if problem else head)
    return done


def _finite_features(feats: Features, batch: dict, shard: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``aux`` and ``final_hidden`` in the storage dtype on the CPU; RunError naming the
    conversation and row where the target gave a non-finite value."""
    tensors = {"aux": feats.aux.to(dtype).cpu(), "final_hidden": feats.final_hidden.to(dtype).cpu()}
    for field, x in tensors.items():
        row = _nonfinite_row(x)
        if row is not None:
            source = batch.get("sources", [None] * (row + 1))[row]
            what = f"conversation {source} (row {row} of {shard})" if source else f"row {row} of {shard}"
            raise RunError(
                f"the target gave non-finite {field} features for {what}; nothing was written "
                "for it: run the target in float32 (--model.dtype float32) or drop that "
                "conversation from the data")
    return tensors


@dataclass(frozen=True)
class CachedBatch:
    """One cached batch: ``features`` (as the online path builds them) and ``loss_mask [B, S]``."""

    features: Features
    loss_mask: torch.Tensor


class FeatureCache:
    """Read a cache written by ``write_cache``; ``cache[i]`` is shard i as a CachedBatch.

    ``shards`` restricts reading to a subset (e.g. ``range(rank, len, world)`` per rank:
    each rank reads only its own files). Each read checks the shard's size against the
    manifest and, once per shard and window, that ``aux`` and ``final_hidden`` are finite
    (on the CPU, before the move to ``device``); a missing, truncated or unreadable shard
    or a non-finite value is a RunError naming the cache, the shard (and row) and the fix.
    Checksums are checked by ``verify_cache`` and by a resumed ``write_cache``, not here.

    Raises (at construction): FileNotFoundError (no manifest), UsageError (another
    format, an unfinished cache), RunError (unreadable manifest).
    """

    def __init__(self, path: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, shards: Iterable[int] | None = None) -> None:
        self.path = Path(path)
        self.manifest = read_manifest(self.path)
        if not self.manifest["complete"]:
            raise UsageError(f"{self.path} is an unfinished cache ({len(self.manifest['shards'])} "
                             "shards); rerun eagle3fn prepare with the same settings to finish it")
        self._entries = {s["name"]: s for s in self.manifest["shards"]}
        names = [s["name"] for s in self.manifest["shards"]]
        self.names = names if shards is None else [names[i] for i in shards]
        self.device = torch.device(device)
        self.dtype = dtype
        self._head = None
        self._checked: set = set()

    def __len__(self) -> int:
        return len(self.names)

    @property
    def target_head(self) -> torch.Tensor:
        """``[V, Ht]``, loaded once."""
        if self._head is None:
            self._head = self._cast(self._load(HEAD, self.manifest["head"], None)["target_head"])
        return self._head

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x.to(self.dtype) if self.dtype is not None and x.is_floating_point() else x

    def _broken(self, name: str, why: str) -> RunError:
        return RunError(f"feature cache {self.path}: {name} {why}; {_repair(self.path)}")

    def _load(self, name: str, entry: dict, window) -> dict[str, torch.Tensor]:
        """The CPU tensors of one file (``aux``/``final_hidden`` cut to ``window``)."""
        path = self.path / name
        try:
            size = path.stat().st_size
            if size != entry["bytes"]:
                raise self._broken(name, f"has {size} bytes, the manifest says {entry['bytes']}")
            if window is None:
                return load_file(str(path))
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as f:
                t = {k: f.get_tensor(k) for k in f.keys() if k not in ("aux", "final_hidden")}
                if callable(window):
                    window = window(t["input_ids"].shape[1])
                for k in ("aux", "final_hidden"):
                    t[k] = f.get_slice(k)[:, window[0]:window[1]]
                t["_window"] = window
                return t
        except FileNotFoundError as e:
            raise self._broken(name, "is missing") from e
        except (OSError, SafetensorError) as e:
            raise self._broken(name, f"is unreadable ({e})") from e

    def __getitem__(self, i: int) -> CachedBatch:
        return self.read(i)

    def read(self, i: int, window=None) -> CachedBatch:
        """Shard i; with ``window=(start, stop)`` (or a function of the shard's length
        S returning it) the large per-position tensors (``aux``, ``final_hidden``) hold
        only positions ``[start, stop)``, read from disk as a slice (a sequence-parallel
        rank reads its own chunk and tail; ``(0, 0)`` reads ids and masks alone), while
        ids and masks stay whole ``[B, S]``."""
        name = self.names[i]
        t = self._load(name, self._entries[name], window)
        key = (name, tuple(t.pop("_window", (None, None))))
        if key not in self._checked:
            for field in ("aux", "final_hidden"):
                row = _nonfinite_row(t[field])
                if row is not None:
                    raise self._broken(name, f"holds non-finite {field} at row {row}")
            self._checked.add(key)
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


@dataclass(frozen=True)
class FileStatus:
    """One checked file of a cache: ``problem`` is None when it is whole."""

    name: str
    conversations: int
    tokens: int
    bytes: int
    problem: str | None


@dataclass(frozen=True)
class CacheReport:
    """``verify_cache``'s answer: the manifest and one FileStatus per shard, then the head."""

    path: Path
    manifest: dict
    files: list[FileStatus]

    @property
    def broken(self) -> list[FileStatus]:
        return [f for f in self.files if f.problem]


def verify_cache(cache_dir: str | os.PathLike) -> CacheReport:
    """Check every file of a cache: it exists, has the manifest's size and sha256, loads,
    holds the expected tensors and only finite features. Reads the whole cache.

    Raises: as ``read_manifest`` (a broken file is reported, not raised).
    """
    path = Path(cache_dir)
    manifest = read_manifest(path)
    files = []
    for s in manifest["shards"]:
        problem = _file_problem(path / s["name"], s)
        if problem is None:
            try:
                t = load_file(str(path / s["name"]))
            except SafetensorError as e:
                problem = f"unreadable ({e})"
            else:
                rows = {k: _nonfinite_row(t[k]) for k in ("aux", "final_hidden") if k in t}
                bad = [f"{k} at row {r}" for k, r in rows.items() if r is not None]
                if _SHARD_KEYS - t.keys():
                    problem = f"lacks {sorted(_SHARD_KEYS - t.keys())}"
                elif bad:
                    problem = "non-finite " + ", ".join(bad)
        files.append(FileStatus(s["name"], s.get("batch", 0), s.get("tokens", 0), s["bytes"], problem))
    head = manifest.get("head")
    if head is not None or manifest["shards"]:
        problem = "missing from the manifest" if head is None else _file_problem(path / HEAD, head)
        if problem is None and _nonfinite_row(load_file(str(path / HEAD))["target_head"]) is not None:
            problem = "non-finite target_head"
        files.append(FileStatus(HEAD, 0, 0, 0 if head is None else head["bytes"], problem))
    return CacheReport(path, manifest, files)


def prepare(target, examples, out_dir: str | os.PathLike, *, batch_size: int, pad_token_id: int,
            fingerprint: dict, dtype: torch.dtype = torch.bfloat16,
            log: Callable[[str], None] = print) -> dict:
    """Run ``target`` (an ``io.target.TargetModel``) over tokenized ``examples`` once and
    write the cache, printing its estimated size first.

    ``fingerprint`` identifies the target and data by content (see the CLI's
    ``prepare``); ``batch_size`` and ``target.aux_layer_ids`` are added to it. Batches
    are cut in file order (no shuffling: a resumed run must see the same batches);
    training shuffles shards. Returns the manifest.
    """
    from eagle3fn.io.batching import batches, collate
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

    fingerprint = {**fingerprint, "batch_size": batch_size, "aux_layer_ids": list(target.aux_layer_ids)}
    return write_cache(out_dir, ({**collate(g, pad_token_id), "sources": [e.source for e in g]}
                                 for g in groups),
                       features_fn, fingerprint=fingerprint, dtype=dtype, log=log)
