"""Reading chat data (``io.data``): JSONL lines -> ``Conversation`` (OpenAI roles), each
with its ``file:line``; a bad line raises ``DataError`` naming it and the fix, or is
skipped and counted.

Accepted lines (one JSON object per line; blank lines are ignored):

- OpenAI: ``{"messages": [{"role": "user", "content": "..."}, ...], "tools": [...]}``;
  roles ``system``/``user``/``assistant``/``tool``; other message keys (``tool_calls``,
  ``tool_call_id``, ``name``, ...) are passed to the chat template unchanged.
- ShareGPT: ``{"conversations": [{"from": "human", "value": "..."}, ...],
  "system": "...", "tools": "[...]"}``; ``human`` -> user, ``gpt`` -> assistant,
  ``function_call`` -> assistant (the model writes the call), ``observation`` -> tool.
  ``conversations`` with ``role``/``content`` turns (SpecForge's prepared form) works too.

Both forms take an optional top-level ``system`` string (prepended as the first
message) and ``tools`` (a list of JSON schemas, or that list as a JSON string).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from eagle3fn.errors import UsageError

OnError = Literal["raise", "skip"]

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "function_call": "assistant",
    "tool": "tool",
    "observation": "tool",
}
# The flag a user types (train's, and the --data group's of vocab / prepare / regenerate);
# the library's keyword is on_error="skip".
SKIP_FLAG = "--on-error skip (--data.on-error skip in vocab, prepare and regenerate)"
_SKIP_HINT = f"fix or remove the line, or pass {SKIP_FLAG} to skip bad lines"
_UTF8_HINT = ("re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass "
              f"{SKIP_FLAG} to skip bad lines")


class DataError(ValueError):
    """A conversation that cannot be used; ``source`` is ``"file:line"``."""

    def __init__(self, source: str, problem: str, fix: str = _SKIP_HINT):
        super().__init__(f"{source}: {problem}; {fix}")
        self.source = source


@dataclass(frozen=True)
class Conversation:
    """One chat as the chat template sees it.

    Fields:
        messages: dicts with ``role`` in ``ROLES`` and ``content`` a str, in order; at
            least one assistant turn.
        tools: JSON-schema tool definitions, or None.
        source: ``"file:line"`` of the JSONL line it came from.
    """

    messages: tuple[dict, ...]
    tools: tuple | None
    source: str


def _parse_line(obj: Any, source: str) -> Conversation:
    """The ``Conversation`` of one JSONL line's object ``obj`` (OpenAI or ShareGPT form,
    roles mapped by ``ROLE_ALIASES``); DataError naming ``source`` and what is wrong."""
    if not isinstance(obj, dict):
        hint = (
            "convert a JSON array file to JSONL, one conversation object per line"
            if isinstance(obj, list)
            else _SKIP_HINT
        )
        raise DataError(source, f"expected a JSON object, got {type(obj).__name__}", hint)
    keys = [k for k in ("messages", "conversations") if k in obj]
    if len(keys) != 1:
        raise DataError(
            source,
            "a line needs exactly one of 'messages' (OpenAI: role/content) or "
            f"'conversations' (ShareGPT: from/value), got keys {sorted(obj)}",
        )
    turns = obj[keys[0]]
    if not isinstance(turns, list) or not turns:
        raise DataError(source, f"'{keys[0]}' must be a non-empty list of turns")

    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(source, f"turn {i} is a {type(turn).__name__}, not an object")
        if "from" in turn or "value" in turn:
            rest = {}
            role_key, content_key = "from", "value"
        else:
            rest = {k: v for k, v in turn.items() if k not in ("role", "content")}
            role_key, content_key = "role", "content"
        if role_key not in turn:
            raise DataError(source, f"turn {i} has no '{role_key}' key (keys {sorted(turn)})")
        raw_role = turn[role_key]
        role = ROLE_ALIASES.get(raw_role) if isinstance(raw_role, str) else None
        if role is None:
            raise DataError(
                source,
                f"turn {i} has unknown role {raw_role!r}; known roles are "
                f"{sorted(ROLE_ALIASES)} (OpenAI and ShareGPT names)",
                f"rename the role in the data, or pass {SKIP_FLAG} to skip such lines",
            )
        content = turn.get(content_key)
        if content is None and rest.get("tool_calls"):
            content = ""
        if isinstance(content, list):  # OpenAI content parts
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise DataError(source, f"turn {i} has non-text content parts; only text works")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise DataError(
                source, f"turn {i} ('{raw_role}') content must be a string, got {content!r:.60}"
            )
        messages.append({"role": role, "content": content, **rest})

    system = obj.get("system")
    if system:
        if not isinstance(system, str):
            raise DataError(source, f"'system' must be a string, got {type(system).__name__}")
        if messages[0]["role"] == "system":
            raise DataError(source, "both a top-level 'system' and a system message; keep one")
        messages.insert(0, {"role": "system", "content": system})

    tools = obj.get("tools")
    if isinstance(tools, str) and tools.strip():
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(source, f"'tools' is a string but not valid JSON ({e})") from None
    if tools and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise DataError(source, "'tools' must be a list of JSON-schema objects")

    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(source, "no assistant turn, so nothing would be trained")
    return Conversation(tuple(messages), tuple(tools) if tools else None, source)


def check_data_file(path: str | os.PathLike) -> Path:
    """``path`` as a Path after checking it is a readable file, so a wrong ``--data``
    stops before any model is loaded. Raises FileNotFoundError when it does not exist,
    UsageError when it is a directory or cannot be read."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"chat data file {str(path)!r} not found; pass a JSONL file "
                                "(one conversation per line)")
    if path.is_dir():
        raise UsageError(f"chat data file {str(path)!r} is a directory; pass the JSONL file "
                         "inside it (one conversation per line)")
    if not path.is_file():  # a device or a pipe: read more than once (fingerprint, then lines)
        from eagle3fn.io.paths import path_kind

        raise UsageError(f"chat data file {str(path)!r} is {path_kind(path)}, not a file; pass a JSONL file "
                         "(one conversation per line; a pipe cannot be read twice: save it to a file)")
    try:
        with path.open("rb"):
            pass
    except OSError as e:
        raise UsageError(f"chat data file {str(path)!r} cannot be read ({e.strerror}); fix its "
                         "permissions or pass a readable JSONL file") from None
    return path


def _decode_error(line: str) -> str | None:
    """Why ``line`` (read with ``errors="surrogateescape"``) is not UTF-8, or None."""
    try:
        line.encode("utf-8")
    except UnicodeEncodeError as e:
        # surrogateescape keeps each undecodable byte b as the code point U+DC00 + b
        return f"byte 0x{ord(line[e.start]) - 0xDC00:02x} at character {e.start + 1}"
    return None


def read_with_errors(path: str | os.PathLike,
                     on_error: OnError) -> tuple[list[Conversation], list[DataError]]:
    """``(conversations, errors)`` of a JSONL chat file: with ``on_error="raise"`` the
    first bad line raises its ``DataError``; with ``"skip"`` each bad line's error is
    collected instead. ValueError when the file has no line or no good line;
    ``check_data_file``'s errors for a missing or unreadable file."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = check_data_file(path)
    conversations, errors, lines = [], [], 0
    # Undecodable bytes become lone surrogates, so a bad line is reported (or skipped)
    # with its number like any other bad line instead of stopping the whole read.
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            lines += 1
            source = f"{path}:{lineno}"
            try:
                bad = _decode_error(line)
                if bad is not None:
                    raise DataError(source, f"not UTF-8 ({bad})", _UTF8_HINT)
                try:
                    obj = json.loads(line.strip())
                except json.JSONDecodeError as e:
                    raise DataError(source, f"malformed JSON ({e})") from None
                conversations.append(_parse_line(obj, source))
            except DataError as e:
                if on_error == "raise":
                    raise
                errors.append(e)
    if lines == 0:
        raise ValueError(f"{path}: no conversations (the file is empty); pass a JSONL file")
    if not conversations:
        raise ValueError(
            f"{path}: all {lines} lines were skipped, nothing to train on; first error: {errors[0]}"
        )
    return conversations, errors


def read_conversations(
    path: str | os.PathLike, *, on_error: OnError = "raise"
) -> tuple[list[Conversation], int]:
    """Read a JSONL chat file (OpenAI ``messages`` or ShareGPT ``conversations`` lines).

    Returns ``(conversations, skipped)``. A bad line (malformed JSON, unknown role, no
    assistant turn, ...) raises ``DataError`` (a ValueError) naming ``file:line`` and the
    fix, or with ``on_error="skip"`` is skipped and counted; so is a line that is not
    UTF-8. An empty file, or one whose every line is bad, raises ValueError in both
    modes. A missing file raises FileNotFoundError, a directory or unreadable file
    UsageError (``check_data_file``).
    """
    conversations, errors = read_with_errors(path, on_error)
    return conversations, len(errors)
