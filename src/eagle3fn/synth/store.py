"""The output of a synthesis run on disk: appended line by line, resumable, guarded.

Files beside ``out`` (OpenAI-form JSONL, one kept conversation per line:
``{"id": ..., "messages": [...], "tools": [...]}``):

    <out>.meta.json       the settings that define the content (written first; a rerun
                          with other settings is refused, naming the differences)
    <out>.rejected.jsonl  one line per dropped conversation: id, index, reason, messages
    <out>.report.json     the filter report (written at the end of every run)

Every line is written with one ``write`` and flushed. A killed run leaves at most a
partial last line in either JSONL, which ``open_store`` cuts off (its conversation is
made again). Ids are stable: ``conversation_id(settings, index)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from eagle3fn.errors import RunError, UsageError
from eagle3fn.io.fingerprint import diff

FORMAT = 1


def settings_key(settings: dict) -> str:
    """sha256 of the settings as canonical JSON."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()


def conversation_id(settings: dict, index: int) -> str:
    """The stable id of conversation ``index`` of a run with ``settings`` (16 hex digits)."""
    return hashlib.sha256(f"{settings_key(settings)}:{index}".encode()).hexdigest()[:16]


def sidecar(out: Path, suffix: str) -> Path:
    """``<out><suffix>``, e.g. ``data.jsonl.meta.json``."""
    return out.with_name(out.name + suffix)


def _read_lines(path: Path) -> list[dict]:
    """The complete lines of a JSONL file we append to; a partial last line (no newline:
    the run was killed while writing it) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    rows = []
    for n, line in enumerate(data[:end].decode("utf-8").splitlines(), start=1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise RunError(f"{path}:{n} is not JSON ({e}); this file is appended by eagle3fn synthesize "
                           "only: restore it, or delete it with its .meta.json to start over") from None
    return rows


@dataclass
class Store:
    """An output opened for appending. ``done`` maps the index of every conversation
    already decided (kept or rejected) to its record, as read at open."""

    out: Path
    settings: dict
    done: dict[int, dict] = field(default_factory=dict)

    def _append(self, path: Path, row: dict) -> None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()

    def keep(self, index: int, messages: list[dict], tools=None, *, truncated: bool = False) -> None:
        """Append a kept conversation to ``out`` (``"truncated": true`` when an answer
        was cut by its token limit and kept)."""
        row = {"id": conversation_id(self.settings, index), "messages": messages}
        if tools:
            row["tools"] = list(tools)
        if truncated:
            row["truncated"] = True
        self._append(self.out, row)

    def reject(self, index: int, reason: str, messages: list[dict]) -> None:
        """Append a dropped conversation (and why) to ``<out>.rejected.jsonl``."""
        self._append(sidecar(self.out, ".rejected.jsonl"),
                     {"id": conversation_id(self.settings, index), "index": index, "reason": reason,
                      "messages": messages})

    @property
    def kept(self) -> int:
        return sum(1 for r in self.done.values() if "reason" not in r)


def open_store(out: str | os.PathLike, settings: dict) -> Store:
    """Open ``out`` for a run with ``settings``: a new file, or the resume of an earlier
    run with equal settings (its decided conversations in ``done``). Conversations are
    decided in index order, so the n rows of both files are those of indices 0..n-1.

    Raises UsageError when ``out`` holds data without a meta file (not ours) or a meta
    file with other settings (the differences named), RunError when a line is corrupt.
    """
    out = Path(out)
    meta = sidecar(out, ".meta.json")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory; pass a .jsonl file path")
    if meta.exists():
        old = json.loads(meta.read_text())
        if old.get("format") != FORMAT or old.get("settings") != settings:
            changes = diff(old.get("settings", {}), settings)
            raise UsageError(f"{out} was written by another synthesize command ("
                             f"{'; '.join(changes[:4]) or 'format ' + str(old.get('format'))}"
                             f"{'; ...' if len(changes) > 4 else ''}); rerun with the same flags to "
                             "resume it, or pass another --out")
    elif out.exists() and out.stat().st_size > 0:
        raise UsageError(f"{out} already exists and was not written by eagle3fn synthesize (no {meta.name}); "
                         "pass another --out or delete it")
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = meta.with_name(meta.name + ".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "settings": settings}, indent=1, sort_keys=True) + "\n")
        tmp.replace(meta)
    rows = [(path, row) for path in (out, sidecar(out, ".rejected.jsonl")) for row in _read_lines(path)]
    ids = {conversation_id(settings, i): i for i in range(len(rows))}
    store = Store(out, settings)
    for path, row in rows:
        if row.get("id") not in ids or ids[row["id"]] in store.done:
            raise RunError(f"{path} holds a conversation id {row.get('id')!r} this run does not make "
                           "(or twice); delete the file with its .meta.json to start over")
        store.done[ids[row["id"]]] = row
    return store
