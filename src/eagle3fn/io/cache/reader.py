"""Reading a feature cache: ``FeatureCache`` rebuilds each shard as the padded batch
``prepare`` collated (``layout``), ``verify_cache`` checks every file, ``cache_info``
sums what a cache holds.

Legend: B conversations of a shard, S padded length, Ht target hidden, X = 3*Ht.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.cache import layout
from eagle3fn.io.cache.manifest import (DTYPES, EDITED, HEAD, MANIFEST, SHARD_KEYS, file_problem, load_manifest,
                                        read_manifest, rebuild_command, repair_hint, seal_fix, unlisted_shards)
from eagle3fn.io.cache.store import nonfinite_row
from eagle3fn.shapes import Features

_ST_DTYPES = {name: layout.SAFETENSORS_DTYPES[dtype] for name, dtype in DTYPES.items()}


def _layout_problem(f, manifest: dict, name: str) -> str | None:
    """What in an open shard's header (``safe_open`` handle ``f``) disagrees with the
    manifest: a tensor missing, aux or final hidden of another dtype or width than the
    manifest's dtypes and ``hidden_size`` give (3 aux layers of ``Ht`` each)."""
    keys = set(f.keys())
    if SHARD_KEYS - keys:
        return f"lacks {sorted(SHARD_KEYS - keys)}"
    Ht = manifest.get("hidden_size")
    fp8 = manifest["aux_dtype"] == "float8_e4m3"
    want = {"aux": ("F8_E4M3" if fp8 else _ST_DTYPES[manifest["dtype"]], layout.AUX_LAYERS * Ht if Ht else None),
            "final_hidden": (_ST_DTYPES[manifest["dtype"]], Ht)}
    if fp8:
        want["aux_scale"] = ("F32", layout.AUX_LAYERS)
    for key, (dtype, width) in want.items():
        if key not in keys:
            return f"lacks {key!r} (its manifest's aux_dtype is {manifest['aux_dtype']})"
        part = f.get_slice(key)
        shape = part.get_shape()
        if part.get_dtype() != dtype or len(shape) != 2 or (width is not None and shape[1] != width):
            return (f"holds {key} {part.get_dtype()} {list(shape)}, the manifest says {dtype} [N, {width}] "
                    f"({layout.AUX_LAYERS} aux layers of hidden size {Ht})")
    return None


@dataclass(frozen=True)
class CachedBatch:
    """One cached batch: ``features`` (as the online path builds them, ``[B, S, ...]``,
    zeros where the cache keeps nothing) and ``loss_mask`` bool ``[B, S]``."""

    features: Features
    loss_mask: torch.Tensor


class FeatureCache:
    """Read a cache written by ``write_cache``; ``cache[i]`` is shard i as a CachedBatch.

    Shard i comes back as the batch ``prepare`` ran the target on: ids and masks
    ``[B, S]`` as ``io.batching.collate`` pads them (the shard's pad id), ``aux [B, S,
    3*Ht]`` at every real token (fp8 dequantized), ``final_hidden [B, S, Ht]`` at the
    teacher positions (``layout``), zeros on padding and wherever nothing was kept.

    ``shards`` restricts reading to a subset (e.g. ``range(rank, len, world)`` per rank:
    each rank reads only its own files). Each read checks the shard's size against the
    manifest and, once per shard and window, that ``aux`` and ``final_hidden`` are finite
    (on the CPU, before the move to ``device``); a missing, truncated or unreadable shard
    or a non-finite value is a RunError naming the cache, the shard (and conversation
    row) and the fix. Checksums are checked by ``verify_cache`` and by a resumed
    ``write_cache``, not here.

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
        extra = unlisted_shards(self.path, self.manifest)
        if extra:
            raise RunError(f"feature cache {self.path} holds shard files its manifest does not list "
                           f"({', '.join(extra[:3])}); move them out, or rewrite the cache with "
                           f"{rebuild_command(self.path, self.manifest['fingerprint'])}")
        self._entries = {s["name"]: s for s in self.manifest["shards"]}
        names = [s["name"] for s in self.manifest["shards"]]
        self.names = names if shards is None else [names[i] for i in shards]
        self.device = torch.device(device)
        self.dtype = dtype
        self._head = None
        self._checked: set = set()
        self._laid_out: set = set()

    def __len__(self) -> int:
        return len(self.names)

    @property
    def target_head(self) -> torch.Tensor:
        """``[V, Ht]``, loaded once."""
        if self._head is None:
            self._head = self._cast(self._load_head())
        return self._head

    def _cast(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x.to(self.dtype) if self.dtype is not None and x.is_floating_point() else x

    def _broken(self, name: str, why: str) -> RunError:
        return RunError(f"feature cache {self.path}: {name} {why}; {repair_hint(self.path)}")

    def _open(self, name: str, entry: dict):
        path = self.path / name
        try:
            size = path.stat().st_size
        except FileNotFoundError as e:
            raise self._broken(name, "is missing") from e
        if size != entry["bytes"]:
            raise self._broken(name, f"has {size} bytes, the manifest says {entry['bytes']}")
        try:
            f = safe_open(str(path), framework="pt")
        except (OSError, SafetensorError) as e:
            raise self._broken(name, f"is unreadable ({e})") from e
        if name != HEAD and name not in self._laid_out:
            problem = _layout_problem(f, self.manifest, name)
            if problem:
                raise self._broken(name, problem)
            self._laid_out.add(name)
        return f

    def _load_head(self) -> torch.Tensor:
        try:
            with self._open(HEAD, self.manifest["head"]) as f:
                head = f.get_tensor("target_head") if "target_head" in f.keys() else None
        except SafetensorError as e:
            raise self._broken(HEAD, f"is unreadable ({e})") from e
        want = (self.manifest["vocab_size"], self.manifest["hidden_size"])
        if head is None or tuple(head.shape) != want:
            got = "no target_head" if head is None else f"target_head {list(head.shape)}"
            raise self._broken(HEAD, f"holds {got}, the manifest says [{want[0]}, {want[1]}]")
        return head

    def _load(self, name: str, entry: dict, window, conversations=None) -> dict[str, torch.Tensor]:
        """One shard's CPU tensors: the small ones whole, ``aux`` / ``final_hidden``
        (and ``aux_scale``) as the rows at positions in ``window`` (None: all) of the
        ``conversations`` (None: all; else ``_spans`` holds only theirs)."""
        try:
            with self._open(name, entry) as f:
                t = {k: f.get_tensor(k) for k in layout.INDEX_KEYS}
                if window is None and conversations is None:
                    t.update({k: f.get_tensor(k) for k in f.keys() if k not in t})
                    return t
                window = (0, entry["seq_len"]) if window is None else window
                spans = {"aux": layout.conversation_rows(t["offsets"], None, None, window),
                         "final_hidden": layout.conversation_rows(t["offsets"], t["teacher_positions"],
                                                                  t["teacher_offsets"], window)}
                if conversations is not None:
                    spans = {k: [v[b] for b in conversations] for k, v in spans.items()}
                keys = [k for k in ("aux", "aux_scale", "final_hidden") if k in f.keys()]
                for k in keys:
                    part = f.get_slice(k)
                    t[k] = torch.cat([part[lo:hi] for lo, hi in spans[k.removesuffix("_scale")]])
                t["_spans"] = spans
                return t
        except SafetensorError as e:
            raise self._broken(name, f"is unreadable ({e})") from e

    def __getitem__(self, i: int) -> CachedBatch:
        return self.read(i)

    def read(self, i: int, window=None, conversations=None) -> CachedBatch:
        """Shard i; with ``window=(start, stop)`` (or a function of the shard's length
        S returning it) the large per-position tensors (``aux``, ``final_hidden``) hold
        only positions ``[start, min(stop, S))``, read from disk as slices (a
        sequence-parallel rank reads its own chunk and tail; ``(0, 0)`` reads ids and
        masks alone), while ids and masks stay whole ``[B, S]``. With
        ``conversations`` (indices into the shard, e.g. the ones a packed batch takes)
        only those are read, in that order: ``[len(conversations), S', ...]`` with S'
        their longest (the window, if given, applies to them)."""
        from eagle3fn.io.batching import collate
        from eagle3fn.io.data import Example

        name = self.names[i]
        entry = self._entries[name]
        S = entry["seq_len"]
        if callable(window):
            window = window(S)
        t = self._load(name, entry, window, conversations)
        offsets, t_offsets = t["offsets"], t["teacher_offsets"]
        keep = list(range(len(offsets) - 1)) if conversations is None else list(conversations)
        examples = [Example(t["input_ids"][offsets[b]:offsets[b + 1]].long(),
                            t["loss_mask"][offsets[b]:offsets[b + 1]], f"{name}:{b}") for b in keep]
        batch = collate(examples, entry["pad_id"])
        S = batch["input_ids"].shape[1] if conversations is not None else S
        window = (0, S) if window is None else (min(window[0], S), max(min(window[1], S), min(window[0], S)))
        if "aux_scale" in t:
            t["aux"] = layout.dequantize_fp8(t["aux"], t["aux_scale"])
        spans = t.pop("_spans", None)
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        longest = max(lengths, default=0)
        if len(lengths) != entry["batch"] or longest != entry["seq_len"]:
            raise self._broken(name, f"holds {len(lengths)} conversations of up to {longest} tokens, the "
                                     f"manifest says batch {entry['batch']}, seq_len {entry['seq_len']}")
        self._check_finite(name, t, spans, (window, None if conversations is None else tuple(keep)))
        B = len(keep)
        if spans is None:
            spans = {"aux": [(int(offsets[b]), int(offsets[b + 1])) for b in range(B)],
                     "final_hidden": [(int(t_offsets[b]), int(t_offsets[b + 1])) for b in range(B)]}
        conv = {k: torch.cat([torch.full((hi - lo,), r, dtype=torch.long) for r, (lo, hi) in enumerate(v)])
                for k, v in spans.items()}
        aux_pos = torch.cat([torch.arange(lo, hi) - offsets[b] for b, (lo, hi) in zip(keep, spans["aux"])])
        fh_pos = torch.cat([t["teacher_positions"][lo:hi] for lo, hi in spans["final_hidden"]])
        features = Features(
            input_ids=batch["input_ids"].to(self.device),
            aux=self._cast(layout.scatter_rows(t["aux"], aux_pos, conv["aux"], B, window)),
            attention_mask=batch["attention_mask"].to(self.device),
            final_hidden=self._cast(layout.scatter_rows(t["final_hidden"], fh_pos, conv["final_hidden"], B,
                                                        window)),
            target_head=self.target_head,
        )
        return CachedBatch(features, batch["loss_mask"].to(self.device))

    def _check_finite(self, name: str, t: dict, spans, window) -> None:
        key = (name, window)
        if key in self._checked:
            return
        for field, offsets in (("aux", t["offsets"]), ("final_hidden", t["teacher_offsets"])):
            flat = nonfinite_row(t[field])
            if flat is not None:
                if spans is not None:  # rows of the window: their conversation from the spans
                    sizes = torch.tensor([hi - lo for lo, hi in spans[field]])
                    offsets = torch.cat([torch.zeros(1, dtype=torch.long), sizes.cumsum(0)])
                row = int(torch.searchsorted(offsets, flat, right=True)) - 1
                raise self._broken(name, f"holds non-finite {field} at row {row}")
        self._checked.add(key)

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


def _shard_problem(t: dict[str, torch.Tensor], entry: dict) -> str | None:
    """What is wrong inside a loaded shard (keys, index consistency, finiteness)."""
    if SHARD_KEYS - t.keys():
        return f"lacks {sorted(SHARD_KEYS - t.keys())}"
    offsets, t_offsets = t["offsets"], t["teacher_offsets"]
    n = len(t["input_ids"])
    if (len(offsets) != entry["batch"] + 1 or int(offsets[-1]) != n or n != entry["tokens"]
            or len(t["aux"]) != len(t["input_ids"]) or int(t_offsets[-1]) != len(t["final_hidden"])
            or len(t["teacher_positions"]) != len(t["final_hidden"])):
        return "index does not match its tensors (offsets, ids, aux, teacher rows)"
    aux = layout.dequantize_fp8(t["aux"], t["aux_scale"]) if "aux_scale" in t else t["aux"]
    rows = {"aux": (nonfinite_row(aux), offsets), "final_hidden": (nonfinite_row(t["final_hidden"]), t_offsets)}
    bad = [f"{k} at row {int(torch.searchsorted(o, r, right=True)) - 1}" for k, (r, o) in rows.items()
           if r is not None]
    return "non-finite " + ", ".join(bad) if bad else None


def verify_cache(cache_dir: str | os.PathLike) -> CacheReport:
    """Check every file of a cache: the manifest proves itself (its digest), every shard
    it lists exists, has the manifest's size and sha256, loads, holds the expected
    tensors (dtypes and widths as the manifest says) with a consistent index and only
    finite features; shard files on disk that it does not list are reported too. Reads
    the whole cache.

    Raises: as ``read_manifest`` for a manifest that cannot be read at all (an edited or
    digest-less one is reported as a broken ``manifest.json`` row, not raised).
    """
    path = Path(cache_dir)
    if not (path / MANIFEST).is_file():
        read_manifest(path)  # FileNotFoundError: not a feature cache
    manifest, seal = load_manifest(path)
    files = []
    if seal is not None:
        fix = (f"restore it, or rewrite the cache with {rebuild_command(path, manifest['fingerprint'])}"
               if seal == EDITED else seal_fix(path, manifest["fingerprint"]))
        files.append(FileStatus(MANIFEST, 0, 0, (path / MANIFEST).stat().st_size, f"{seal}; {fix}"))
    for s in manifest["shards"]:
        problem = file_problem(path / s["name"], s)
        if problem is None:
            try:
                with safe_open(str(path / s["name"]), framework="pt") as f:
                    problem = _layout_problem(f, manifest, s["name"])
                t = None if problem else load_file(str(path / s["name"]))
            except SafetensorError as e:
                problem = f"unreadable ({e})"
            else:
                problem = problem or _shard_problem(t, s)
        files.append(FileStatus(s["name"], s["batch"], s["tokens"], s["bytes"], problem))
    for name in unlisted_shards(path, manifest):
        files.append(FileStatus(name, 0, 0, (path / name).stat().st_size,
                                "on disk but not listed in the manifest (training would skip it)"))
    head = manifest.get("head")
    if head is not None or manifest["shards"]:
        problem = "missing from the manifest" if head is None else file_problem(path / HEAD, head)
        if problem is None:
            try:
                target_head = load_file(str(path / HEAD)).get("target_head")
            except SafetensorError as e:
                problem = f"unreadable ({e})"
            else:
                want = [manifest.get("vocab_size"), manifest.get("hidden_size")]
                if target_head is None or list(target_head.shape) != want:
                    problem = f"holds no target_head of shape {want}"
                elif nonfinite_row(target_head) is not None:
                    problem = "non-finite target_head"
        files.append(FileStatus(HEAD, 0, 0, 0 if head is None else head["bytes"], problem))
    return CacheReport(path, manifest, files)


def cache_info(cache_dir: str | os.PathLike) -> dict:
    """What a cache holds, from its manifest (no shard is read): ``conversations``,
    ``tokens`` (real), ``supervised`` (tokens with ``m_t = 1``), ``teacher_rows``
    (final hidden rows kept), ``padded_tokens`` (``sum B*S``, the padded layout's),
    ``bytes`` (shards + head on disk), ``per_token`` (bytes per real token: ``aux``,
    ``final_hidden``, ``index``, ``head`` and ``headers``, summing to ``bytes /
    tokens``), ``dtype``, ``aux_dtype``, ``hidden_size``, ``vocab_size`` and the
    ``fingerprint``.

    Raises: as ``read_manifest``.
    """
    m = read_manifest(cache_dir)
    shards = m["shards"]
    total = lambda key: sum(s[key] for s in shards)  # noqa: E731
    tokens = total("tokens")
    parts = {k: sum(s["components"][k] for s in shards) for k in ("aux", "final_hidden", "index")}
    head = m["head"]["bytes"] if m.get("head") else 0
    shard_bytes = total("bytes")
    parts.update(head=head, headers=shard_bytes - sum(parts.values()))
    return {"conversations": total("batch"), "tokens": tokens, "supervised": total("supervised"),
            "teacher_rows": total("teacher_rows"), "padded_tokens": sum(s["batch"] * s["seq_len"] for s in shards),
            "shards": len(shards), "bytes": shard_bytes + head,
            "per_token": {k: v / max(tokens, 1) for k, v in parts.items()},
            "dtype": m["dtype"], "aux_dtype": m["aux_dtype"], "hidden_size": m.get("hidden_size"),
            "vocab_size": m.get("vocab_size"), "complete": m["complete"], "fingerprint": m["fingerprint"]}
