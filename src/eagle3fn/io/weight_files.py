"""A target's weight files checked from their headers before any library opens them.

safetensors, transformers' GGUF reader and ``torch.load`` meet a truncated or foreign file
with their own exceptions (``SafetensorError: incomplete metadata``, numpy's ``cannot
reshape array of size ...``, ``PytorchStreamReader failed``), which name neither the file
nor the cause. ``check_weight_file`` reads only the header (and for a GGUF file its
tensor table) and checks that every tensor lies inside the file, raising one
``UsageError`` naming the file and what is wrong: truncated, not this format, or
written by a format version this reader does not know.

Costs: a safetensors header (a few KiB to MiB), a GGUF header and tensor table (its
vocabulary strings are skipped, not decoded), a
zip's central directory for ``pytorch_model*.bin``.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

from eagle3fn.errors import UsageError

_FIX = "copy or download it again (compare its size with the source's)"
_MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
"""GGUF format versions read here (and by gguf 0.10-0.19, which transformers uses)."""
_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _broken(path: Path, what: str, why: str, fix: str = _FIX) -> UsageError:
    return UsageError(f"{what} '{path}' {why}; {fix}")


def check_safetensors(path: str | Path, what: str = "weight file") -> dict:
    """The header of a safetensors file (``{name: {"dtype", "shape", "data_offsets"}}``
    and ``__metadata__``) after checking that it is one and that every tensor's bytes
    lie in the file, which ends where the last tensor does. UsageError otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _broken(path, what, f"is truncated ({size} bytes; a safetensors file starts with an "
                                      "8-byte header length)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_SAFETENSORS_HEADER:
            raise _broken(path, what, f"is not a safetensors file (its first 8 bytes give a header of {n} "
                                      f"bytes; the file has {size})")
        if 8 + n > size:
            raise _broken(path, what, f"is truncated ({size} bytes; its header alone needs {8 + n})")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _broken(path, what, "is not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise _broken(path, what, "is not a safetensors file (its header is not a JSON object)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) and o >= 0 for o in offsets) or offsets[0] > offsets[1]):
            raise _broken(path, what, f"is not a valid safetensors file (tensor {name!r} has no valid "
                                      "data_offsets in its header)")
        end = max(end, offsets[1])
    if 8 + n + end > size:
        raise _broken(path, what, f"is truncated ({size} bytes; its header places tensors up to byte "
                                  f"{8 + n + end})")
    if 8 + n + end < size:
        raise _broken(path, what, f"is not a valid safetensors file ({size} bytes, {size - 8 - n - end} more "
                                  "than its header's tensors cover)")
    return header


class _Reader:
    """Little-endian fields of a GGUF header, raising EOFError past the file's end."""

    def __init__(self, f, size: int) -> None:
        self.f, self.size = f, size

    def take(self, n: int) -> bytes:
        if self.f.tell() + n > self.size:
            raise EOFError
        return self.f.read(n)

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.take(8))[0]

    def skip(self, n: int) -> None:
        if self.f.tell() + n > self.size:
            raise EOFError
        self.f.seek(n, 1)

    def string(self) -> bytes:
        return self.take(self.u64())

    def skip_value(self, kind: int) -> None:
        if kind in _GGUF_SCALAR:
            self.skip(_GGUF_SCALAR[kind])
        elif kind == _GGUF_STRING:
            self.skip(self.u64())
        elif kind == _GGUF_ARRAY:
            item, count = self.u32(), self.u64()
            if item in _GGUF_SCALAR:
                self.skip(_GGUF_SCALAR[item] * count)
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def check_gguf(path: str | Path, what: str = "GGUF file", fix: str = _FIX) -> int:
    """The number of tensors of a GGUF file after checking its magic, its version (one
    of ``GGUF_VERSIONS``), that its metadata and tensor table end inside the file, and
    that every tensor's bytes (from its type's block size, ``gguf.GGML_QUANT_SIZES``)
    lie in the file. UsageError naming the file and what is wrong otherwise."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size)
        try:
            magic = r.take(4)
            if magic != GGUF_MAGIC:
                raise _broken(path, what, fix=fix,
                              why=f"is not a GGUF file (it starts with {magic!r}, not {GGUF_MAGIC!r})")
            version = r.u32()
            if version not in GGUF_VERSIONS:
                raise _broken(path, what, fix=fix,
                              why=f"is GGUF version {version}; this reader knows versions "
                                          f"{', '.join(map(str, GGUF_VERSIONS))} (written by another "
                                  "version of the format)")
            n_tensors, n_kv = r.u64(), r.u64()
            alignment = 32
            for _ in range(n_kv):
                key, kind = r.string(), r.u32()
                if key == b"general.alignment" and kind == 4:
                    alignment = r.u32()
                else:
                    r.skip_value(kind)
            tensors = []
            for _ in range(n_tensors):
                name = r.string().decode("utf-8", "replace")
                dims = [r.u64() for _ in range(r.u32())]
                tensors.append((name, dims, r.u32(), r.u64()))
            table_end = f.tell()
        except EOFError:
            raise _broken(path, what, fix=fix, why=f"is truncated ({size} bytes end inside its header)") \
                from None
        except ValueError as e:
            raise _broken(path, what, fix=fix, why=f"is not a valid GGUF file ({e})") from None
    if alignment < 1 or alignment & (alignment - 1):
        raise _broken(path, what, fix=fix, why=f"is not a valid GGUF file (alignment {alignment})")
    start = -(-table_end // alignment) * alignment
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:  # transformers asks for gguf itself; the header checks above still hold
        return n_tensors
    for name, dims, kind, offset in tensors:
        if kind not in GGML_QUANT_SIZES:
            raise _broken(path, what, fix=fix, why=f"is not a GGUF file this gguf package reads (tensor "
                                                   f"{name!r} has type {kind})")
        block, nbytes = GGML_QUANT_SIZES[kind]
        count = 1
        for d in dims:
            count *= d
        end = start + offset + count // block * nbytes
        if end > size:
            raise _broken(path, what, fix=fix,
                          why=f"is truncated ({size} bytes; its tensor {name!r} ends at byte {end})")
    return n_tensors


def check_torch_bin(path: str | Path, what: str = "weight file") -> None:
    """A ``pytorch_model*.bin`` file is a whole zip archive (what ``torch.save`` writes
    since torch 1.6): UsageError when it is truncated or not one."""
    path = Path(path)
    with open(path, "rb") as f:
        legacy = f.read(1) == b"\x80"  # a pickle (torch < 1.6): left to torch.load
    if not legacy and not zipfile.is_zipfile(path):
        raise _broken(path, what, f"is truncated or not a torch checkpoint ({path.stat().st_size} bytes; "
                                  "torch.save writes a zip archive, whose end is missing)")


def check_weight_files(model_dir: str | Path, gguf_file: str | None = None) -> None:
    """Every weight file transformers will read from ``model_dir``: the GGUF file when
    given, else ``model.safetensors.index.json`` (valid JSON, its files present) and
    every ``*.safetensors`` and ``pytorch_model*.bin``. UsageError naming the first
    broken file and why."""
    model_dir = Path(model_dir)
    if gguf_file is not None:
        check_gguf(model_dir / gguf_file)
        return
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = set(json.loads(index.read_text())["weight_map"].values())
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise _broken(index, "weight index", "is not a safetensors index (JSON with a weight_map)") from None
        missing = sorted(f for f in files if not (model_dir / str(f)).is_file())
        if missing:
            raise UsageError(f"weight index '{index}' names files that are not in {model_dir}: {missing[:3]}; "
                             f"{_FIX}")
    for p in sorted(model_dir.glob("*.safetensors")):
        check_safetensors(p)
    for p in sorted(model_dir.glob("pytorch_model*.bin")):
        check_torch_bin(p)
