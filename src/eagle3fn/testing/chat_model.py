"""A tiny random Llama that ends its turns, for tests and docs of ``eagle3fn synthesize``.

A random model almost never emits its end-of-turn token, so every sampled user turn
would be cut by its limit. This one is random except for one wiring: after any token
``t`` with ``t % every == 1`` (outside the chat template's own tokens) the tokenizer's
eos (``<|im_end|>`` for ``tiny_chat_tokenizer``) is by far the most likely next token.
Turns therefore end after a few tokens, greedy or sampled, and what comes before the
end is the random model's own choice. The wiring: the residual stream's dimension 0
carries the embedding alone (the attention and MLP outputs write nothing there), the
embeddings of those tokens hold 20 in it, and the head's eos row reads it with weight 20.
"""

from __future__ import annotations

import torch


def tiny_chat_model(tokenizer, *, seed: int = 0, every: int = 5):
    """The model (eval mode, fp32, hidden 32, 2 layers) for ``tokenizer`` (a chat
    tokenizer with an eos token, e.g. ``tiny_chat_tokenizer()``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=1024,
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval()
    turns = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "user")]
    template = set(tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"])
    enders = [t for t in range(len(tokenizer)) if t % every == 1 and t not in template]
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 0
        model.model.embed_tokens.weight[enders, 0] = 20.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.lm_head.weight[:, 0] = 0
        model.lm_head.weight[tokenizer.eos_token_id, 0] = 20.0
    return model
