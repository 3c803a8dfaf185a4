"""Helpers for tests and tutorials that run offline: not part of the training API.

- ``tiny_tokenizer``: a byte-level BPE chat tokenizer with a ChatML template, trained in
  milliseconds, for examples that need a real tokenizer without a download.
"""

from eagle3fn.testing.tiny_tokenizer import tiny_chat_tokenizer

__all__ = ["tiny_chat_tokenizer"]
