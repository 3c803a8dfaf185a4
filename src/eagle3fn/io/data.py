"""Chat data: JSONL conversations -> tokens + assistant loss mask -> padded batches.

Legend: L tokens of one example (``L <= max_length``), B examples per batch, S the
batch's padded length (its longest example).

The stages, in order::

    check_data_file(path)             exists, is a file, can be read (before any model loads)
    read_conversations(path)          JSONL lines -> Conversation (OpenAI roles), file:line
    tokenize_conversation(conv, tok)  chat template -> Example(input_ids [L], loss_mask [L])
    tokenize_file(path, tok)          both, with bad lines raised or skipped and counted
    io.batching.batches(examples, seed=...)      deterministic shuffled groups of examples
    io.batching.collate(examples, pad_token_id)  input_ids / attention_mask / loss_mask [B, S]

or, packed (``--pack``, SPEC 9), several conversations per row of ``--pack-length``
tokens (default ``max_length``), best fit by windows of consecutive conversations:
``io.packing.pack_examples`` and ``collate_packed``
(which adds ``position_ids [B, S]``, restarting at 0 in each conversation).

``loss_mask`` is SPEC section 1's chat mask ``m_t``: 1 on every token of an assistant
turn's content and on its end-of-turn token, 0 on the template's headers, on the
other roles and on padding. It stays unshifted; ``eagle3fn.align.supervised_mask``
turns it into the supervised positions (``alignment="eagle"`` or ``"target"``).

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
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import jinja2
import torch

from eagle3fn.align import MaskAlignment, supervised_mask
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
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Stand-in contents for the span finder: first and last characters differ between the two.
_PROBES = ("<eagle3fn probe a>", "[eagle3fn probe b]")
# The flag a user types (train's, and the --data group's of vocab / prepare / regenerate);
# the library's keyword is on_error="skip".
_SKIP_FLAG = "--on-error skip (--data.on-error skip in vocab, prepare and regenerate)"
_SKIP_HINT = f"fix or remove the line, or pass {_SKIP_FLAG} to skip bad lines"
_UTF8_HINT = ("re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or pass "
              f"{_SKIP_FLAG} to skip bad lines")
_TAGS_HINT = (
    "add {% generation %}...{% endgeneration %} around assistant turns in "
    f"tokenizer.chat_template, or pass {_SKIP_FLAG}"
)


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


@dataclass(frozen=True)
class Example:
    """One tokenized conversation.

    Fields:
        input_ids: int64 ``[L]``, the rendered chat template's tokens, cut at ``max_length``.
        loss_mask: bool ``[L]``, ``m_t``: 1 on assistant tokens incl. their end-of-turn
            token (SPEC section 1), unshifted.
        source: ``"file:line"``.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    source: str

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def num_supervised(self, alignment: MaskAlignment = "eagle") -> int:
        """Teacher positions this example supervises under ``alignment`` (SPEC section 1)."""
        return int(supervised_mask(self.loss_mask[None], alignment=alignment).sum())


# ---------------------------------------------------------------------------- reading


def _parse_line(obj: Any, source: str) -> Conversation:
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
                f"rename the role in the data, or pass {_SKIP_FLAG} to skip such lines",
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


def _read(path: str | os.PathLike, on_error: OnError) -> tuple[list[Conversation], list[DataError]]:
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
    conversations, errors = _read(path, on_error)
    return conversations, len(errors)


# ---------------------------------------------------------------------------- tokenizing


def _template(tokenizer, tools) -> str:
    if tokenizer.chat_template is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; load the chat (instruct) model's "
            "tokenizer, or set one: tokenizer.chat_template = '<jinja template>' "
            "(wrap assistant turns in {% generation %}...{% endgeneration %} for exact masks)"
        )
    return tokenizer.get_chat_template(None, list(tools) if tools else None)


def _render(tokenizer, messages, tools) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False
    )


def _common_prefix_len(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # binary search: each comparison runs in C
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _content_region(tokenizer, msgs, tools, i: int, text: str, source: str) -> tuple[int, int]:
    """``[start, end)`` of the characters of ``text`` (``msgs`` rendered) that change
    when message ``i``'s content is replaced: the rendered content itself."""
    start, suffix = len(text), len(text)
    for probe in _PROBES:
        probe_msgs = (*msgs[:i], {**msgs[i], "content": probe}, *msgs[i + 1 :])
        probed = _render(tokenizer, probe_msgs, tools)
        if probed.count(probe) != 1:
            raise DataError(
                source,
                f"the chat template renders the content of assistant turn {i} "
                f"{probed.count(probe)} times, so its tokens cannot be located",
                _TAGS_HINT,
            )
        start = min(start, _common_prefix_len(text, probed))
        suffix = min(suffix, _common_prefix_len(text[::-1], probed[::-1]))
    return start, max(start, len(text) - suffix)


def assistant_char_spans(conv: Conversation, tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat text and each assistant turn's ``[start, end)`` characters in it.

    For templates without ``{% generation %}`` tags. The turn's content is where the
    whole rendered chat changes when that content is replaced by a probe string (two
    probes that differ in their first and last characters, so content resembling a
    probe cannot shift the edges); rendering the whole chat each time keeps templates
    that render a turn differently depending on what follows (e.g. an empty think
    block on the last turn only) exact. The span then extends over the turn's closing
    text (its end-of-turn token, tool calls rendered after the content, ...): what
    follows the content when the chat is rendered up to this turn, as far as the whole
    chat agrees with it, less trailing whitespace. Assumes the template renders each
    content once, verbatim, and a content changes the rendering only inside its turn;
    raises DataError when a probe is not rendered exactly once or spans overlap.
    """
    msgs, tools = conv.messages, conv.tools
    full = _render(tokenizer, msgs, tools)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(msgs):
        if message["role"] != "assistant":
            continue
        start, content_end = _content_region(tokenizer, msgs, tools, i, full, conv.source)
        through = _render(tokenizer, msgs[: i + 1], tools)
        _, through_end = _content_region(tokenizer, msgs[: i + 1], tools, i, through, conv.source)
        closing = through[through_end:].rstrip()
        agreed = closing[: _common_prefix_len(closing, full[content_end:])].rstrip()
        if closing and not agreed:
            raise DataError(
                conv.source,
                f"assistant turn {i} ends with {closing[:20]!r} when it is the last turn, but "
                f"with {full[content_end : content_end + 20]!r} in the whole chat",
                _TAGS_HINT,
            )
        end = content_end + len(agreed)
        if spans and start < spans[-1][1]:
            raise DataError(
                conv.source,
                f"assistant turn {i} overlaps the previous one in the rendered chat (the "
                "template renders other turns depending on this one's content)",
                _TAGS_HINT,
            )
        if end > start:
            spans.append((start, end))
    return full, spans


def mask_from_char_spans(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """bool ``[L]``: token ``t`` with characters ``offsets[t] = [s, e)`` is 1 when it
    overlaps a span (``s < end`` and ``e > start``), the rule transformers applies to
    ``{% generation %}`` spans, so both paths agree token for token. A token straddling
    a span edge (e.g. a BPE merge of the header's newline with leading spaces of the
    content) is masked."""
    offsets_L2 = torch.tensor(offsets, dtype=torch.long).reshape(-1, 2)
    mask = torch.zeros(offsets_L2.shape[0], dtype=torch.bool)
    for start, end in spans:
        mask |= (offsets_L2[:, 0] < end) & (offsets_L2[:, 1] > start)
    return mask


def tokenize_conversation(conv: Conversation, tokenizer, *, max_length: int) -> Example:
    """Render ``conv`` with the tokenizer's chat template and build its loss mask.

    With ``{% generation %}`` tags in the template, the mask is transformers'
    ``return_assistant_tokens_mask``; otherwise ``assistant_char_spans`` locates each
    assistant turn and ``mask_from_char_spans`` maps it onto the tokens (needs a fast
    tokenizer, for character offsets). Both cover the assistant content and its
    end-of-turn token. The result is cut to the first ``max_length`` tokens, so an
    example may end up with no masked token (``tokenize_file`` drops those).

    Returns ``Example(input_ids int64 [L], loss_mask bool [L])``, ``L <= max_length``.
    Raises ValueError when the tokenizer has no chat template (saying how to set one),
    DataError when the template rejects the conversation or a turn cannot be located.
    """
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2 (one input and one target), got {max_length}")
    template = _template(tokenizer, conv.tools)
    tools = list(conv.tools) if conv.tools else None
    try:
        if _GENERATION_TAG.search(template):
            out = tokenizer.apply_chat_template(
                list(conv.messages),
                tools=tools,
                tokenize=True,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            ids, mask = out["input_ids"], torch.tensor(out["assistant_masks"], dtype=torch.bool)
        else:
            if not getattr(tokenizer, "is_fast", False):
                raise ValueError(
                    f"{type(tokenizer).__name__} is not a fast tokenizer, so assistant turns "
                    "cannot be located by character offsets; load it with use_fast=True or "
                    "add {% generation %} tags to its chat template"
                )
            text, spans = assistant_char_spans(conv, tokenizer)
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, mask = enc["input_ids"], mask_from_char_spans(enc["offset_mapping"], spans)
    except jinja2.TemplateError as e:
        raise DataError(conv.source, f"the chat template rejected the conversation ({e})") from None
    if not mask.any():
        raise DataError(
            conv.source,
            "no token of the assistant turns was located (does the chat template render "
            "assistant contents?)",
            _TAGS_HINT,
        )
    input_ids = torch.tensor(ids, dtype=torch.long)[:max_length]
    return Example(input_ids, mask[:max_length].clone(), conv.source)


def tokenize_file(
    path: str | os.PathLike,
    tokenizer,
    *,
    max_length: int,
    on_error: OnError = "raise",
    alignment: MaskAlignment = "eagle",
) -> list[Example]:
    """``read_conversations`` + ``tokenize_conversation`` over a JSONL file.

    Bad lines and conversations the template rejects raise (naming ``file:line``) or,
    with ``on_error="skip"``, are skipped. Examples with no supervised position within
    ``max_length`` under ``alignment`` (``Example.num_supervised``) are dropped in both
    modes (they train nothing). Skipped and dropped counts are printed to stderr.
    Raises ValueError when nothing usable remains: never an empty data set.
    """
    _template(tokenizer, None)  # a missing template is a setup error, never skipped
    conversations, errors = _read(path, on_error)
    read_errors = len(errors)
    examples, dropped = [], 0
    for conv in conversations:
        try:
            example = tokenize_conversation(conv, tokenizer, max_length=max_length)
        except DataError as e:
            if on_error == "raise":
                raise
            errors.append(e)
            continue
        if example.num_supervised(alignment) == 0:
            dropped += 1
        else:
            examples.append(example)
    total = len(conversations) + read_errors
    if errors:
        print(
            f"eagle3fn: {path}: skipped {len(errors)} of {total} conversations; "
            f"first: {errors[0]}",
            file=sys.stderr,
        )
    if dropped:
        print(
            f"eagle3fn: {path}: dropped {dropped} conversations with no supervised token "
            f"within max_length={max_length}",
            file=sys.stderr,
        )
    if not examples:
        raise ValueError(
            f"{path}: no usable example ({len(errors)} skipped, {dropped} with no supervised "
            f"token within max_length={max_length}); raise max_length or fix the data"
        )
    return examples


# ---------------------------------------------------------------------------- batching
