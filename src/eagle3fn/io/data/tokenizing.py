"""Tokenizing chat data (``io.data``): a ``Conversation`` rendered with the tokenizer's
chat template -> ``Example(input_ids [L], loss_mask [L])``.

Legend: L tokens of one example (``L <= max_length``).

``loss_mask`` is SPEC section 1's chat mask ``m_t``: 1 on every token of an assistant
turn's content and on its end-of-turn token, 0 on the template's headers, on the
other roles and on padding. It comes from transformers' assistant mask where the
template has ``{% generation %}`` tags, else from the span finder
(``assistant_char_spans``) and the tokens' character offsets.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
import torch

from eagle3fn.align import MaskAlignment, supervised_mask
from eagle3fn.io.data.reading import SKIP_FLAG, Conversation, DataError, OnError, read_with_errors

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Stand-in contents for the span finder: first and last characters differ between the two.
_PROBES = ("<eagle3fn probe a>", "[eagle3fn probe b]")
_TAGS_HINT = (
    "add {% generation %}...{% endgeneration %} around assistant turns in "
    f"tokenizer.chat_template, or pass {SKIP_FLAG}"
)


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


def _template(tokenizer, tools) -> str:
    """The tokenizer's chat template for these tools; ValueError saying how to set one
    when it has none."""
    if tokenizer.chat_template is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no chat template; load the chat (instruct) model's "
            "tokenizer, or set one: tokenizer.chat_template = '<jinja template>' "
            "(wrap assistant turns in {% generation %}...{% endgeneration %} for exact masks)"
        )
    return tokenizer.get_chat_template(None, list(tools) if tools else None)


def _render(tokenizer, messages, tools) -> str:
    """``messages`` rendered by the chat template, as text."""
    return tokenizer.apply_chat_template(
        list(messages), tools=list(tools) if tools else None, tokenize=False
    )


def _common_prefix_len(a: str, b: str) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
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
    conversations, errors = read_with_errors(path, on_error)
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
