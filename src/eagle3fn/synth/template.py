"""Prompts from the chat template alone (Magpie, Xu et al. 2024): pure text functions.

An aligned chat model, given its template's text up to the start of a user turn, writes
a user message as its users would, and stops at the template's end-of-turn token. So
no prompt data is needed: render the conversation so far plus a sentinel user message,
cut the text before the sentinel, and let the target continue it.

    user_turn_prefix(tok, messages)     "<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n"
    answer_prompt(tok, messages)        the same conversation + the assistant header
    end_of_turn_ids(tok)                token ids that end a turn (the user turn's closer, eos)
    topic_system_prompt(topic)          the system prompt a topic seed becomes

Templates that add a default system prompt when none is given (SmolLM2's "You are a
helpful AI assistant named SmolLM ...") keep it: the prefix is exactly what the template
renders for a conversation without a system message, which is what a serving user sends.
"""

from __future__ import annotations

SENTINEL = "eagle3fn-user-turn-sentinel-31415"
"""Stand-in user message; the text before it is the user-turn prefix."""

TOPIC_SYSTEM_PROMPT = ("You are a helpful assistant. The user will ask you something about "
                       "the following topic: {topic}.")
"""The system prompt a ``--topics`` seed becomes (the topic goes into the system prompt,
so the user turn itself is still written freely by the target)."""


def _render(tokenizer, messages: list[dict], tools=None, *, generation_prompt: bool) -> str:
    if tokenizer.chat_template is None:
        raise ValueError("the tokenizer has no chat template, so no user turn can be sampled from it; "
                         "load the chat (instruct) model's tokenizer")
    return tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                         tokenize=False, add_generation_prompt=generation_prompt)


def user_turn_prefix(tokenizer, messages: list[dict], tools=None) -> str:
    """The template's text of ``messages`` followed by the opening of a user turn (its
    header, without content): the prompt from which the target writes the next user
    message. ``messages`` may be empty, a system message, or a whole conversation that
    ends with an assistant turn.

    Raises ValueError when the template drops or rewrites the user content (the sentinel
    is not found).
    """
    text = _render(tokenizer, [*messages, {"role": "user", "content": SENTINEL}], tools,
                   generation_prompt=False)
    at = text.find(SENTINEL)
    if at < 0:
        raise ValueError("the chat template does not render a user message's content verbatim; "
                         "Magpie prompts need a template that does (pass --prompts FILE instead)")
    return text[:at]


def answer_prompt(tokenizer, messages: list[dict], tools=None) -> str:
    """The template's text of ``messages`` (ending with a user turn) plus the assistant
    header: the prompt the target answers."""
    return _render(tokenizer, messages, tools, generation_prompt=True)


def end_of_turn_text(tokenizer) -> str:
    """The template's text right after a user message's content, e.g. ``"<|im_end|>\\n"``."""
    text = _render(tokenizer, [{"role": "user", "content": SENTINEL}], generation_prompt=False)
    return text[text.find(SENTINEL) + len(SENTINEL):]


def end_of_turn_ids(tokenizer, extra_eos: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Token ids that end a generated turn: the first token after a user message's
    content when it is a special (added) token, e.g. ``<|im_end|>``, plus the
    tokenizer's eos and ``extra_eos`` (a model's generation_config eos ids), sorted.

    Raises ValueError when there is none (a template whose turns end in plain text:
    generation could not tell where the user message stops).
    """
    ids = set(extra_eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    suffix = end_of_turn_text(tokenizer).lstrip(" ")
    first = tokenizer(suffix, add_special_tokens=False)["input_ids"][:1]
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    if first and first[0] in special:
        ids.add(first[0])
    if not ids:
        raise ValueError(f"the chat template ends a user turn with {suffix[:20]!r}, not a special "
                         "token, and the tokenizer has no eos token; Magpie sampling needs one")
    return tuple(sorted(ids))


def topic_system_prompt(topic: str) -> str:
    """The system prompt of a conversation seeded with ``topic``."""
    return TOPIC_SYSTEM_PROMPT.format(topic=topic.strip())
