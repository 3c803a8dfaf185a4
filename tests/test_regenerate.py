"""Regeneration keeps the prompts and writes the target's own greedy answers."""

import json

import torch

from eagle3fn.io.data import Conversation
from eagle3fn.io.regenerate import GenerationConfig, regenerate, write_jsonl
from eagle3fn.testing import tiny_chat_tokenizer


def tiny_model(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


CONVS = [
    Conversation(messages=({"role": "system", "content": "be brief"},
                           {"role": "user", "content": "hello there"},
                           {"role": "assistant", "content": "old answer one"},
                           {"role": "user", "content": "and then"},
                           {"role": "assistant", "content": "old answer two"}),
                 tools=None, source="mem:1"),
    Conversation(messages=({"role": "user", "content": "a much longer question about the weather"},
                           {"role": "assistant", "content": "old"}),
                 tools=None, source="mem:2"),
]


def one_by_one(model, tok, messages, cfg):
    """Greedy generation for a single prompt, no padding: the oracle for batching."""
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    out = model.generate(ids, max_new_tokens=cfg.max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_batched_regeneration_equals_one_by_one(tmp_path):
    tok = tiny_chat_tokenizer()
    model = tiny_model(len(tok))
    cfg = GenerationConfig(max_new_tokens=6, batch_size=2)
    new = regenerate(CONVS, model, tok, cfg)
    for conv, messages in zip(CONVS, new):
        assert [m["role"] for m in messages] == [m["role"] for m in conv.messages]
        for old, m in zip(conv.messages, messages):
            if m["role"] != "assistant":
                assert m == old  # prompts untouched
    # Turn 2 of conversation 0 is conditioned on the regenerated turn 1.
    assert new[0][2]["content"] == one_by_one(model, tok, list(CONVS[0].messages[:2]), cfg)
    assert new[0][4]["content"] == one_by_one(model, tok, new[0][:4], cfg)
    assert new[1][1]["content"] == one_by_one(model, tok, list(CONVS[1].messages[:1]), cfg)
    n = write_jsonl(tmp_path / "out.jsonl", new)
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert n == 2 and rows[0]["messages"] == new[0]


def test_sampling_is_seeded():
    tok = tiny_chat_tokenizer()
    model = tiny_model(len(tok))
    cfg = GenerationConfig(max_new_tokens=8, temperature=1.5, top_p=0.95, seed=3)
    a = regenerate(CONVS, model, tok, cfg)
    b = regenerate(CONVS, model, tok, cfg)
    c = regenerate(CONVS, model, tok, GenerationConfig(max_new_tokens=8, temperature=1.5, seed=4))
    greedy = regenerate(CONVS, model, tok, GenerationConfig(max_new_tokens=8))
    assert a == b
    assert a != c or a != greedy  # sampling actually samples
