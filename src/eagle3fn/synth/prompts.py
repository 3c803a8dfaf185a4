"""Given prompts (``--prompts FILE``): JSONL conversations whose assistant turns are rewritten.

A line is ``{"messages": [{"role", "content"}, ...], "tools": [...]}`` (OpenAI) or
``{"conversations": [{"from", "value"}, ...]}`` (ShareGPT, roles as ``io.data`` maps
them), optionally with a top-level ``"system"`` string. Unlike training data a line
needs no assistant turn: a conversation that ends with a user (or tool) turn gets one
answer appended; every assistant turn already there is rewritten in order. Bad lines
raise ``DataError`` naming ``file:line`` (or are skipped and counted with
``on_error="skip"``).
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3fn.io.data import ROLE_ALIASES, DataError, check_data_file
from eagle3fn.synth.pipeline import GivenPrompt


def _parse(obj, source: str) -> GivenPrompt:
    if not isinstance(obj, dict):
        raise DataError(source, f"expected a JSON object, got {type(obj).__name__}")
    key = "messages" if "messages" in obj else "conversations"
    turns = obj.get(key)
    if not isinstance(turns, list) or not turns:
        raise DataError(source, "a line needs a non-empty 'messages' (or ShareGPT 'conversations') list")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(source, f"turn {i} is a {type(turn).__name__}, not an object")
        sharegpt = "from" in turn
        role = ROLE_ALIASES.get(turn.get("from" if sharegpt else "role"))
        content = turn.get("value" if sharegpt else "content")
        if role is None or not isinstance(content, str):
            raise DataError(source, f"turn {i} needs a known role ({sorted(ROLE_ALIASES)}) and string "
                            f"content, got {turn!r:.80}")
        rest = {} if sharegpt else {k: v for k, v in turn.items() if k not in ("role", "content")}
        messages.append({"role": role, "content": content, **rest})
    if isinstance(obj.get("system"), str) and obj["system"] and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": obj["system"]})
    if not any(m["role"] == "user" for m in messages):
        raise DataError(source, "no user turn, so there is nothing to answer")
    tools = obj.get("tools")
    if isinstance(tools, str) and tools.strip():
        tools = json.loads(tools)
    return GivenPrompt(tuple(messages), tuple(tools) if tools else None)


def read_prompts(path: str, *, on_error: str = "raise") -> tuple[list[GivenPrompt], int]:
    """The conversations of a prompts file and the number of bad lines skipped."""
    path = Path(check_data_file(path))
    prompts, skipped = [], 0
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            source = f"{path}:{n}"
            try:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(source, f"malformed JSON ({e})") from None
                prompts.append(_parse(obj, source))
            except DataError:
                if on_error == "raise":
                    raise
                skipped += 1
    if not prompts:
        raise ValueError(f"{path}: no conversations to answer; pass a JSONL file of conversations")
    return prompts, skipped
