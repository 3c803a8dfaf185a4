"""A feature cache's manifest and files, checked (``io.cache``): the format constants,
the digests (of the manifest's content, of each file's ends), every manifest field
checked for type and range, and the checks a training run makes before it reads a
cache (the manifest proves itself, every file has its recorded size and sample, no
unlisted shard, the same target and aux layer ids).

``manifest.json`` (format 3)::

    format, dtype, aux_dtype     FORMAT_VERSION; the storage dtypes (DTYPES, AUX_DTYPES)
    fingerprint                  what the cache was made from, by content (``io.fingerprint``)
    shards                       per shard: name, batch, seq_len, pad_id, tokens,
                                 teacher_rows, supervised, components, bytes, sha256, sample
    head                         head.safetensors' bytes, sha256, sample (None until written)
    hidden_size, vocab_size      Ht, V
    complete                     set once every shard was written or checked
    digest                       sha256 of the rest (``manifest_digest``)

Writing (``store``) and reading (``reader``) both build on this module.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Iterable

import torch

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.cache import layout
from eagle3fn.io.fingerprint import diff, file_fingerprint, target_fingerprint

MANIFEST = "manifest.json"
HEAD = "head.safetensors"
FORMAT_VERSION = 3
"""3: ragged shards, final hidden at teacher positions only, optional fp8 aux (2: padded
``[B, S]`` shards; 1: spelled paths in the manifest)."""
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
AUX_DTYPES = ("storage", "float8_e4m3")
"""``aux_dtype``: the storage dtype, or float8 e4m3 with a per-position, per-layer scale."""
SHARD_KEYS = set(layout.INDEX_KEYS) | {"aux", "final_hidden"}
SAMPLE_BYTES = 1 << 20
"""Bytes hashed at each end of a shard for its ``sample`` (the fast check)."""
SHARD_NAME = re.compile(r"shard-\d{6}\.safetensors")


def manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest's content without its ``digest`` (canonical JSON: sorted
    keys, no whitespace): any edit of a field changes it."""
    body = {k: v for k, v in manifest.items() if k != "digest"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sample_digest(path: Path) -> str:
    """sha256 of a file's first and last ``SAMPLE_BYTES`` (the whole file when it is at
    most twice that): the fast check run at every training start."""
    size = path.stat().st_size
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(min(SAMPLE_BYTES, size)))
        tail = max(SAMPLE_BYTES, size - SAMPLE_BYTES)
        if tail < size:
            f.seek(tail)
            h.update(f.read(size - tail))
    return h.hexdigest()


def repair_hint(out: Path) -> str:
    """What to run to repair the broken cache at ``out`` (the end of a RunError's message)."""
    return (f"run eagle3fn cache verify {out}, then rerun eagle3fn prepare with the same settings "
            "to rewrite the broken shards")



def shard_name(i: int) -> str:
    """The file name of shard ``i``: ``shard-NNNNNN.safetensors`` (six digits)."""
    return f"shard-{i:06d}.safetensors"


def file_problem(path: Path, entry: dict) -> str | None:
    """Why ``path`` is not the file the manifest ``entry`` recorded (None: it is)."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']}"
    if file_fingerprint(path)["sha256"] != entry["sha256"]:
        return "checksum differs from the manifest (corrupted or changed on disk)"
    return None


def _fast_problem(path: Path, entry: dict) -> str | None:
    """``file_problem`` from the size and the ``sample`` digest alone (first and last
    MiB), without reading the whole file; the sha256 where no sample was recorded."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"{size} bytes, the manifest says {entry['bytes']}"
    if "sample" not in entry:
        return file_problem(path, entry)
    if sample_digest(path) != entry["sample"]:
        return "its first or last MiB differs from the manifest (corrupted or changed on disk)"
    return None


def unlisted_shards(path: Path, manifest: dict) -> list[str]:
    """Shard files in ``path`` that the manifest does not list (another cache's, or
    listed once and dropped from the manifest)."""
    listed = {s["name"] for s in manifest["shards"]}
    return sorted(p.name for p in path.glob("shard-*.safetensors") if p.name not in listed)


def rebuild_command(path: Path, fingerprint: dict) -> str:
    """The ``eagle3fn prepare`` command that writes the cache ``fingerprint`` describes
    into ``path`` (target and data are fingerprinted by content: their paths are left
    for the user to fill in)."""
    flags = {"--batch-size": fingerprint.get("batch_size"), "--storage": fingerprint.get("dtype"),
             "--data.max-length": fingerprint.get("max_length"), "--data.on-error": fingerprint.get("on_error"),
             "--model.dtype": fingerprint.get("target_dtype"),
             "--aux-layer-ids": " ".join(map(str, fingerprint.get("aux_layer_ids") or [])) or None}
    given = "".join(f" {k} {v}" for k, v in flags.items() if v is not None)
    return f"eagle3fn prepare --model.path <target dir> --data.path <chat.jsonl> --out {path}{given}"


def _is_int(x, low: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_hex(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


def _entry_problem(e, shard: bool) -> str | None:
    """What is wrong with one file entry of a manifest (None: well formed)."""
    if not isinstance(e, dict):
        return f"is a {type(e).__name__}, not an object"
    ints = {"bytes": 8}
    if shard:
        ints.update(batch=1, seq_len=1, pad_id=0, tokens=1, teacher_rows=0, supervised=0)
        if not isinstance(e.get("name"), str) or not SHARD_NAME.fullmatch(e["name"]):
            return f"name {e.get('name')!r} is not shard-NNNNNN.safetensors"
    for key, low in ints.items():
        if not _is_int(e.get(key), low):
            return f"{key} {e.get(key)!r} is not an integer >= {low}"
    if not _is_hex(e.get("sha256")):
        return f"sha256 {e.get('sha256')!r} is not 64 hex digits"
    if "sample" in e and not _is_hex(e["sample"]):
        return f"sample {e['sample']!r} is not 64 hex digits"
    if shard:
        if not e["seq_len"] <= e["tokens"] <= e["batch"] * e["seq_len"]:
            return (f"tokens {e['tokens']} cannot fill {e['batch']} conversations of at most seq_len "
                    f"{e['seq_len']} with one that long")
        if not e["teacher_rows"] <= e["supervised"] <= e["tokens"]:
            return (f"teacher_rows {e['teacher_rows']} <= supervised {e['supervised']} <= tokens "
                    f"{e['tokens']} does not hold")
        c = e.get("components")
        if not isinstance(c, dict) or not all(_is_int(c.get(k)) for k in ("aux", "final_hidden", "index")):
            return f"components {c!r} are not byte counts of aux, final_hidden and index"
    return None


def _manifest_problem(m: dict) -> str | None:
    """What is wrong with the fields of a current-format manifest (None: well formed)."""
    for key in ("fingerprint", "dtype", "aux_dtype", "shards", "complete", "head"):
        if key not in m:
            return f"has no {key!r}"
    if m["dtype"] not in DTYPES:
        return f"dtype {m['dtype']!r} is not one of {', '.join(DTYPES)}"
    if m["aux_dtype"] not in AUX_DTYPES:
        return f"aux_dtype {m['aux_dtype']!r} is not one of {', '.join(AUX_DTYPES)}"
    if not isinstance(m["complete"], bool):
        return f"complete {m['complete']!r} is not true or false"
    fp = m["fingerprint"]
    if not isinstance(fp, dict):
        return "fingerprint is not an object"
    ids = fp.get("aux_layer_ids")
    if ids is not None and not (isinstance(ids, list) and len(ids) == layout.AUX_LAYERS
                                and all(_is_int(i) for i in ids) and ids == sorted(set(ids))):
        return f"aux_layer_ids {ids!r} are not {layout.AUX_LAYERS} increasing layer ids"
    for key, want in (("dtype", m["dtype"]), ("aux_dtype", m["aux_dtype"]), ("format", m["format"])):
        if key in fp and fp[key] != want:
            return f"fingerprint {key} {fp[key]!r} differs from the manifest's {want!r}"
    for key in ("hidden_size", "vocab_size"):
        if key in m and not _is_int(m[key], 1):
            return f"{key} {m[key]!r} is not an integer >= 1"
    if not isinstance(m["shards"], list):
        return "shards is not a list"
    for i, e in enumerate(m["shards"]):
        problem = _entry_problem(e, shard=True)
        if problem:
            return f"shard entry {i}: {problem}"
    names = [e["name"] for e in m["shards"]]
    if names != sorted(set(names)):
        return "shard names are not sorted and distinct"
    if m["complete"]:
        if names != [shard_name(i) for i in range(len(names))]:
            return f"a complete cache lists shards {names[:3]}..., not shard-000000 onwards without gaps"
        if names and not all(_is_int(m.get(k), 1) for k in ("hidden_size", "vocab_size")):
            return "a complete cache has no hidden_size or vocab_size"
    if m["head"] is not None:
        problem = _entry_problem(m["head"], shard=False)
        if problem:
            return f"head entry {problem}"
    elif m["complete"] and names:
        return "a complete cache has no head entry"
    return None


UNSEALED = "has no digest (written by an eagle3fn before manifests carried one)"
EDITED = "was edited after eagle3fn prepare wrote it (its content no longer matches its digest)"


def load_manifest(path: Path) -> tuple[dict, str | None]:
    """The well-formed manifest of a current-format cache and whether it proves itself:
    ``(manifest, None)``, or ``(manifest, UNSEALED)`` when it has no digest, ``(manifest,
    EDITED)`` when its digest does not match its content (edited after ``prepare``).

    Raises:
        UsageError: a cache of another format (with the command that rebuilds it).
        RunError: not JSON, not a manifest, or a field of the wrong type or value.
    """
    fix = f"rerun eagle3fn prepare with the same settings and --out {path} to rewrite the cache"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not JSON"
        raise RunError(f"{path / MANIFEST} is unreadable ({why}; not a manifest written by eagle3fn prepare); "
                       f"{fix}") from None
    if not isinstance(manifest, dict) or "format" not in manifest:
        raise RunError(f"{path / MANIFEST} is unreadable (not a manifest written by eagle3fn prepare); {fix}")
    if manifest["format"] != FORMAT_VERSION:
        fp = manifest.get("fingerprint")
        raise UsageError(
            f"{path} holds a feature cache of format {manifest['format']!r}, this eagle3fn reads "
            f"format {FORMAT_VERSION}; rebuild it: delete {path} (or pick another --out) and run "
            f"{rebuild_command(path, fp if isinstance(fp, dict) else {})}")
    problem = _manifest_problem(manifest)
    if problem:
        raise RunError(f"{path / MANIFEST} is unreadable (not a manifest written by eagle3fn prepare: "
                       f"{problem}); {fix}")
    if "digest" not in manifest:
        return manifest, UNSEALED
    if manifest["digest"] != manifest_digest(manifest):
        return manifest, EDITED
    return manifest, None


def seal_fix(path: Path, fingerprint: dict) -> str:
    """How to give a cache whose manifest has no digest one: the ``prepare`` rerun."""
    return (f"rerun eagle3fn prepare with the settings it was written with "
            f"({rebuild_command(path, fingerprint)}): it checks every shard's sha256 and writes the digest "
            "(the target runs only for broken shards)")


def read_manifest(cache_dir: str | os.PathLike) -> dict:
    """The manifest of the cache in ``cache_dir``, checked to be readable, current, well
    formed and unedited (its ``digest``).

    Raises:
        FileNotFoundError: no manifest (not a feature cache).
        UsageError: a cache of another format (rebuild it).
        RunError: the manifest is unreadable, malformed, edited or has no digest.
    """
    path = Path(cache_dir)
    if not (path / MANIFEST).is_file():
        raise FileNotFoundError(
            f"no {MANIFEST} in {path}: not a feature cache (write one with eagle3fn prepare)")
    manifest, problem = load_manifest(path)
    if problem == UNSEALED:
        raise RunError(f"{path / MANIFEST} {problem}; {seal_fix(path, manifest['fingerprint'])}")
    if problem:
        raise RunError(f"{path / MANIFEST} {problem}: its shard list or fingerprint cannot be trusted; "
                       f"restore it, or delete it and rerun eagle3fn prepare with the settings it was written "
                       f"with and --out {path} ({rebuild_command(path, manifest['fingerprint'])})")
    return manifest


def check_cache_files(cache_dir: str | os.PathLike, manifest: dict | None = None) -> dict:
    """The fast check before training from a cache: the manifest proves itself
    (``read_manifest``), every shard and the head have their recorded size and
    ``sample`` digest (first and last MiB), and no shard file on disk is missing from
    the manifest. Returns the manifest. RunError naming the files and the fix."""
    path = Path(cache_dir)
    manifest = read_manifest(path) if manifest is None else manifest
    extra = unlisted_shards(path, manifest)
    if extra:
        raise RunError(
            f"feature cache {path} holds shard files its manifest does not list ({', '.join(extra[:3])}"
            f"{', ...' if len(extra) > 3 else ''}; {len(extra)} of {len(extra) + len(manifest['shards'])}): "
            f"training would skip them. Move them out if they belong to another cache, or rewrite the cache "
            f"with {rebuild_command(path, manifest['fingerprint'])} (eagle3fn cache verify {path} lists them)")
    entries = [*manifest["shards"], *([{**manifest["head"], "name": HEAD}] if manifest["head"] else [])]
    broken = [(e["name"], p) for e in entries if (p := _fast_problem(path / e["name"], e))]
    if broken:
        names = "; ".join(f"{n}: {p}" for n, p in broken[:3])
        raise RunError(f"feature cache {path}: {len(broken)} broken file(s) ({names}); {repair_hint(path)}")
    return manifest


def cache_fingerprint(cache_dir: str | os.PathLike) -> dict:
    """What the cache was made from, by content: the manifest's ``fingerprint`` (for a
    cache from ``prepare``: ``target``, ``data``, ``target_dtype``, ``max_length``,
    ``on_error``, ``batch_size``, ``aux_layer_ids``, ``dtype``, ``format``). No paths."""
    return read_manifest(cache_dir)["fingerprint"]


def check_cache_for_training(cache_dir: str | os.PathLike, *, model_dir: str | os.PathLike,
                             gguf_file: str | None = None,
                             aux_layer_ids: Iterable[int] | None = None) -> tuple[int, int, int]:
    """The cache's aux layer ids, after checking its files (``check_cache_files``: the
    manifest's digest, each file's size and sample, no unlisted shard) and that it was
    prepared from this target (by content, ``target_fingerprint(model_dir, gguf_file)``)
    and, when given, these ``aux_layer_ids``.

    Raises:
        UsageError: another target or other aux layer ids, listing each difference.
        FileNotFoundError, RunError: as ``check_cache_files``.
    """
    fp = check_cache_files(cache_dir)["fingerprint"]
    if fp.get("aux_layer_ids") is None:
        raise RunError(f"--cache {cache_dir}: its manifest records no aux_layer_ids (not written by eagle3fn "
                       f"prepare); rewrite it with {rebuild_command(Path(cache_dir), fp)}")
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

