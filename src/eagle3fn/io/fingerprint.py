"""Content fingerprints: what a file or a target directory holds, never how its path is spelled.

A fingerprint is a JSON-able dict. Two runs that name the same files by an absolute and
a relative path get equal fingerprints; new content at the same path gets another one.
``diff`` turns two fingerprints into the lines an error message lists.

Costs: ``file_fingerprint`` reads the whole file (use it for data files, not weights);
``target_fingerprint`` reads the config and tokenizer files whole and at most
``2 * SAMPLE_BYTES`` plus the header of each weight file, so it stays cheap on a
multi-GB model.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from eagle3fn.errors import UsageError

CHUNK = 1 << 20
SAMPLE_BYTES = 1 << 20
"""Bytes hashed at each end of a weight file's data."""
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "vocab.txt", "merges.txt",
    "tokenizer.model", "spiece.model", "sentencepiece.bpe.model",
)
# config.json keys that record who saved the file, not what the model is.
_CONFIG_NOISE = ("_name_or_path", "transformers_version")


def _sha256_stream(path: Path) -> tuple[int, str]:
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
            n += len(block)
    return n, h.hexdigest()


def file_fingerprint(path: str | os.PathLike) -> dict:
    """``{"bytes": int, "sha256": hex}`` of the file's content (read in 1 MiB chunks).

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a file; pass an existing file")
    n, digest = _sha256_stream(path)
    return {"bytes": n, "sha256": digest}


def _canonical_json(path: Path, drop: tuple[str, ...] = ()) -> bytes:
    obj = json.loads(path.read_text())
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in drop}
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def _weight_fingerprint(path: Path) -> dict:
    """Size, plus for a safetensors file the sha256 of its header (names, dtypes, shapes,
    offsets, metadata) and for every file the sha256 of the first and last
    ``SAMPLE_BYTES`` of its data (the bytes after the header)."""
    size = path.stat().st_size
    out = {"bytes": size}
    start = 0
    with open(path, "rb") as f:
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if 8 + header_len <= size:  # else not a valid safetensors file: sample it whole
                out["header"] = hashlib.sha256(f.read(header_len)).hexdigest()
                start = 8 + header_len
        h = hashlib.sha256()
        f.seek(start)
        h.update(f.read(min(SAMPLE_BYTES, size - start)))
        tail = max(start + SAMPLE_BYTES, size - SAMPLE_BYTES)
        if tail < size:
            f.seek(tail)
            h.update(f.read(size - tail))
        out["sample"] = h.hexdigest()
    return out


def target_fingerprint(model_dir: str | os.PathLike, gguf_file: str | None = None) -> dict:
    """Content fingerprint of a local HF target directory.

    Returns ``{"config": hex | None, "tokenizer": hex | None, "weights": {file name:
    {"bytes", "header" (safetensors only), "sample"}}}``:

    - ``config``: sha256 of ``config.json`` as canonical JSON (sorted keys, no
      whitespace), without ``_name_or_path`` and ``transformers_version``.
    - ``tokenizer``: sha256 over the ``TOKENIZER_FILES`` present (name and content; JSON
      files canonical).
    - ``weights``: the ``gguf_file`` alone when given (that is all ``from_pretrained``
      reads then), else every ``*.safetensors`` and ``pytorch_model*.bin``; per file its
      size, the sha256 of its safetensors header, and the sha256 of the first and last
      MiB of its data.

    Never the whole weights: a retrained model whose safetensors files keep identical
    sizes, header (dtypes, shapes, offsets, metadata) and first and last MiB of data gets
    the same fingerprint. Retraining changes every tensor, so in practice the sampled data
    catches it; a change confined to the middle of a large file is not caught.

    Raises:
        FileNotFoundError: ``model_dir`` is not a directory, ``gguf_file`` is not in it.
        UsageError: the directory holds no weight file.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"target model path {str(model_dir)!r} is not a directory; pass "
                                "a local HF model directory (config.json, tokenizer and weights)")
    config = model_dir / "config.json"
    tok = hashlib.sha256()
    present = [n for n in sorted(TOKENIZER_FILES) if (model_dir / n).is_file()]
    for name in present:
        p = model_dir / name
        tok.update(name.encode() + b"\0")
        tok.update(_canonical_json(p) if name.endswith(".json") else p.read_bytes())
        tok.update(b"\0")
    if gguf_file is not None:
        if not (model_dir / gguf_file).is_file():
            raise FileNotFoundError(f"gguf file {gguf_file!r} is not in {str(model_dir)!r}; pass the "
                                    "name of a .gguf file inside the model directory")
        files = [model_dir / gguf_file]
    else:
        files = sorted([*model_dir.glob("*.safetensors"), *model_dir.glob("pytorch_model*.bin")])
    if not files:
        raise UsageError(f"target model path {str(model_dir)!r} holds no *.safetensors or "
                         "pytorch_model*.bin weights; pass a HF model directory (or --model.gguf-file)")
    return {
        "config": (hashlib.sha256(_canonical_json(config, _CONFIG_NOISE)).hexdigest()
                   if config.is_file() else None),
        "tokenizer": tok.hexdigest() if present else None,
        "weights": {p.name: _weight_fingerprint(p) for p in files},
    }


def short(fingerprint: dict) -> str:
    """12 hex digits naming a whole fingerprint dict (for tables and logs)."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:12]


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _show(v) -> str:
    if v is None:
        return "<none>"
    if isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v):
        return v[:12]  # a sha256: its first 12 digits tell two apart
    return str(v)


def diff(old: dict, new: dict) -> list[str]:
    """Differences between two (nested) dicts as ``"key.sub: old -> new"`` lines, in key
    order; a key only one side has (or a None value) shows ``<none>``; sha256 values show
    their first 12 digits. Empty when equal."""
    a, b = _flatten(old), _flatten(new)
    lines = []
    for key in sorted(a.keys() | b.keys()):
        x, y = a.get(key), b.get(key)
        if x != y:
            lines.append(f"{key}: {_show(x)} -> {_show(y)}")
    return lines
