"""Writing a feature cache: atomic shards, resume, non-finite features refused.

Layout of a cache directory (format 3; one shard's tensors in ``layout``, the manifest's
fields in ``manifest``)::

    manifest.json                  format, fingerprint, dtypes, sizes, per file bytes + sha256
    head.safetensors               target_head [V, Ht]
    shard-000000.safetensors       one batch of conversations, ragged (no padding): ids,
    shard-000001.safetensors       masks, aux at every real token, final hidden at the
    ...                            teacher positions only (``layout``)

The manifest's ``fingerprint`` says what the cache was made from, by content (``io.
fingerprint``: target files, data file, aux layer ids, max length, storage dtypes, ...),
never by how a path was spelled. Every file is written to a temporary name, checksummed
and renamed into place, so a killed run leaves only whole shards. ``write_cache`` with
the same fingerprint resumes: it checks each shard already written (size and sha256),
rewrites the broken ones and only then marks the cache complete; another fingerprint is
refused, listing each difference (a cache is never mixed from two configurations).
A cache of another format is refused with the command that rebuilds it.

Non-finite features are refused when written and when read (``nonfinite_row``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import save_file

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.cache import layout
from eagle3fn.io.cache.manifest import (AUX_DTYPES, DTYPES, EDITED, FORMAT_VERSION, HEAD, MANIFEST, file_problem,
                                        load_manifest, manifest_digest, sample_digest, shard_name, unlisted_shards)
from eagle3fn.io.fingerprint import diff, file_fingerprint
from eagle3fn.shapes import Features


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path) -> dict:
    """Write, checksum, rename; returns ``{"bytes", "sha256"}`` of the file."""
    tmp = path.with_name(path.name + ".tmp")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, str(tmp))
    fingerprint = {**file_fingerprint(tmp), "sample": sample_digest(tmp)}
    os.replace(tmp, path)
    return fingerprint


def _atomic_json(obj: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _write_manifest(manifest: dict, out: Path) -> dict:
    """``manifest`` with its ``digest`` (``manifest_digest``), written atomically."""
    manifest["digest"] = manifest_digest(manifest)
    _atomic_json(manifest, out / MANIFEST)
    return manifest


#: per float dtype: the same-size integer dtype and the exponent bits, all ones exactly
#: in NaN and inf
_NONFINITE_BITS = {torch.bfloat16: (torch.int16, 0x7F80), torch.float16: (torch.int16, 0x7C00),
                   torch.float32: (torch.int32, 0x7F800000)}


def _all_finite(x: torch.Tensor, rows: int = 512) -> bool | None:
    """Whether a CPU float tensor ``x [N, ...]`` holds no NaN or inf, from its bits:
    ``bits & E == E`` only for non-finite values, so ``max(bits & E) < E`` proves all
    finite (an integer max instead of ``torch.isfinite``'s per-element float tests,
    chunked through one buffer). None where this test does not apply (other dtypes or devices)."""
    if x.dtype not in _NONFINITE_BITS or x.device.type != "cpu" or x.dim() == 0 or not x.numel():
        return None
    int_dtype, exponent = _NONFINITE_BITS[x.dtype]
    v = x.contiguous().view(int_dtype).reshape(len(x), -1)
    buf = torch.empty((min(rows, len(v)), v.shape[1]), dtype=int_dtype)
    for i in range(0, len(v), rows):
        part = buf[:min(rows, len(v) - i)]
        torch.bitwise_and(v[i:i + len(part)], exponent, out=part)
        if int(part.amax()) == exponent:
            return False
    return True


def nonfinite_row(x: torch.Tensor) -> int | None:
    """The first row b of ``x [B, ...]`` holding a NaN or inf, else None."""
    if _all_finite(x):
        return None
    bad = ~torch.isfinite(x).flatten(1).all(1)
    return int(bad.nonzero()[0, 0]) if bool(bad.any()) else None


def _parse_manifest(path: Path) -> dict | None:
    """The manifest a resumed ``prepare`` may trust: None when unreadable, malformed or
    edited (every shard is then rewritten); one without a digest (an older eagle3fn's)
    is trusted as before, its shards checked by sha256. UsageError for another format."""
    try:
        manifest, problem = load_manifest(path)
    except RunError:
        return None
    return None if problem == EDITED else manifest


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
    aux_dtype: str = "storage",
    log: Callable[[str], None] = print,
) -> dict:
    """Write one ragged shard per batch (``layout``); resume where an earlier run stopped.

    Args:
        out_dir: cache directory (created).
        batches: dicts with ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, S]``
            (right-padded as ``io.batching.collate`` gives them, ``S`` the longest
            conversation) and optionally ``sources`` (B names, e.g. ``file:line``, for
            messages), in a deterministic order (a resumed run must see the same batches).
        features_fn: runs the target on a batch, returning ``Features`` with ``aux``
            ``[B, S, 3*Ht]``, ``final_hidden`` ``[B, S, Ht]`` and ``target_head`` ``[V, Ht]``.
        fingerprint: JSON-able content identity of the target, data and settings (no
            spelled paths); ``dtype``, ``aux_dtype`` and ``format`` are added. A resumed
            run must pass the same, else UsageError listing each difference.
        dtype: storage dtype of final hidden, head and (``aux_dtype="storage"``) aux.
        aux_dtype: ``"storage"`` or ``"float8_e4m3"`` (aux as e4m3 with one fp32 scale
            per position and aux layer: lossy, about half the bytes of bf16).

    Returns:
        The manifest (also written to ``manifest.json``, ``complete`` set at the end,
        after every shard was written or checked against its size and sha256).

    Raises:
        UsageError: ``out_dir`` holds a cache with another fingerprint or format.
        RunError: the target gave a non-finite feature (names the row and conversation).
    """
    if aux_dtype not in AUX_DTYPES:
        raise UsageError(f"aux_dtype {aux_dtype!r}: pick one of {', '.join(AUX_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = next(k for k, v in DTYPES.items() if v == dtype)
    fingerprint = {**fingerprint, "dtype": name, "aux_dtype": aux_dtype, "format": FORMAT_VERSION}
    manifest = {"format": FORMAT_VERSION, "dtype": name, "aux_dtype": aux_dtype, "fingerprint": fingerprint,
                "shards": [], "head": None, "complete": False}
    done = _resume(out, manifest, log)
    _write_manifest(manifest, out)  # incomplete, listing only whole files, until the end
    for i, batch in enumerate(batches):
        shard = shard_name(i)
        if shard in done and manifest["head"] is not None:
            continue
        feats = features_fn(batch)
        tensors = _finite_shard(feats, batch, shard, dtype, aux_dtype)
        if manifest["head"] is None:
            head = feats.target_head.to(dtype).cpu()
            if nonfinite_row(head) is not None:
                raise RunError(f"the target's lm_head holds non-finite weights (row "
                               f"{nonfinite_row(head)}); check the model files")
            manifest["head"] = _atomic_save({"target_head": head}, out / HEAD)
        if shard in done:
            continue
        written = _atomic_save(tensors, out / shard)
        B, S = batch["input_ids"].shape
        shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
        manifest["shards"].append({"name": shard, "batch": B, "seq_len": S, "pad_id": layout.pad_id(batch),
                                   "tokens": len(tensors["input_ids"]),
                                   "teacher_rows": len(tensors["teacher_positions"]),
                                   "supervised": int(tensors["loss_mask"].sum()),
                                   "components": layout.component_bytes(shapes), **written})
        manifest["shards"].sort(key=lambda s: s["name"])
        manifest.update(hidden_size=feats.final_hidden.shape[-1], vocab_size=feats.target_head.shape[0])
        _write_manifest(manifest, out)
        log(f"wrote {shard} ({B} conversations, {len(tensors['input_ids'])} tokens)")
    manifest["complete"] = True
    extra = unlisted_shards(out, manifest)
    if extra:
        log(f"note: {out} also holds {len(extra)} shard files this cache does not list ({', '.join(extra[:3])}); "
            "training refuses a cache with unlisted shards: move them out")
    return _write_manifest(manifest, out)


def _resume(out: Path, manifest: dict, log: Callable[[str], None]) -> set[str]:
    """The shards of an earlier run in ``out`` that pass their size and sha256 check
    (listed into ``manifest``, with a head that passes too); UsageError for another
    fingerprint. Broken files are named and left to be rewritten."""
    fingerprint = manifest["fingerprint"]
    done: set[str] = set()
    if (out / MANIFEST).exists():
        old = _parse_manifest(out)
        if old is None:
            log(f"{out / MANIFEST} is unreadable or was edited; rewriting every shard")
        else:
            _check_resume(out, old["fingerprint"], fingerprint)
            if old["shards"]:
                log(f"checking the {len(old['shards'])} shards already in {out}")
            for s in old["shards"]:
                problem = file_problem(out / s["name"], s)
                if problem:
                    log(f"{s['name']}: {problem}; rewriting it")
                else:
                    manifest["shards"].append({**s, "sample": sample_digest(out / s["name"])})
                    done.add(s["name"])
            head = old.get("head")
            problem = "missing" if head is None else file_problem(out / HEAD, head)
            if problem and done:
                log(f"{HEAD}: {problem}; rewriting it")
            if not problem and "sample" not in head:
                head = {**head, "sample": sample_digest(out / HEAD)}
            manifest.update({k: old[k] for k in ("hidden_size", "vocab_size") if k in old},
                            head=None if problem else head)
    return done


def _finite_shard(feats: Features, batch: dict, shard: str, dtype: torch.dtype,
                  aux_dtype: str) -> dict[str, torch.Tensor]:
    """The shard's tensors (``layout.to_ragged``); RunError naming the conversation and
    row where the target gave a non-finite value at a position the cache keeps."""
    tensors = layout.to_ragged(batch, feats.aux, feats.final_hidden, dtype=dtype,
                               aux_fp8=aux_dtype == "float8_e4m3")
    real = batch["attention_mask"].bool().to(feats.aux.device)
    stored = {"aux": (feats.aux.detach()[real], tensors["offsets"]),
              "final_hidden": (tensors["final_hidden"], tensors["teacher_offsets"])}
    for field, (x, offsets) in stored.items():
        flat = nonfinite_row(x.to(dtype) if field == "aux" else x)
        if flat is not None:
            row = int(torch.searchsorted(offsets, flat, right=True)) - 1
            source = batch.get("sources", [None] * (row + 1))[row]
            what = f"conversation {source} (row {row} of {shard})" if source else f"row {row} of {shard}"
            raise RunError(
                f"the target gave non-finite {field} features for {what}; nothing was written "
                "for it: run the target in float32 (--model.dtype float32) or drop that "
                "conversation from the data")
    return tensors
