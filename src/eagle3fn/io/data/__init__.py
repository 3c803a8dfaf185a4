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

Accepted lines (OpenAI ``messages`` or ShareGPT ``conversations``, optional top-level
``system`` and ``tools``): ``io.data.reading``'s docstring lists them.

The modules::

    reading.py     check_data_file, read_conversations: JSONL -> Conversation, DataError
    tokenizing.py  tokenize_conversation, tokenize_file: Conversation -> Example
"""

from eagle3fn.io.data.reading import (ROLE_ALIASES, ROLES, SKIP_FLAG, Conversation, DataError, OnError,
                                      check_data_file, read_conversations, read_with_errors)
from eagle3fn.io.data.tokenizing import (Example, assistant_char_spans, mask_from_char_spans,
                                         tokenize_conversation, tokenize_file)

__all__ = ["ROLES", "ROLE_ALIASES", "SKIP_FLAG", "Conversation", "DataError", "Example", "OnError",
           "assistant_char_spans", "check_data_file", "mask_from_char_spans", "read_conversations",
           "read_with_errors", "tokenize_conversation", "tokenize_file"]
