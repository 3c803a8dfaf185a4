"""A tiny offline chat tokenizer for tests and tutorials (trained in milliseconds).

A byte-level BPE trained with ``tokenizers`` on a few sentences, wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template (``<|im_start|>role\\n...<|im_end|>\\n``)
that renders a system prompt, tools and assistant tool calls. ``CHATML_TEMPLATE`` marks each
assistant turn's content and its ``<|im_end|>`` with ``{% generation %}``;
``CHATML_TEMPLATE_NO_GENERATION`` is the same template without the tags, so the two masking
paths of ``eagle3fn.io.data`` can be compared on one tokenization. Byte-level, so any text
tokenizes; ids: ``<|pad|>`` 0, ``<|im_start|>`` 1, ``<|im_end|>`` 2.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>")

# Newlines are written as Jinja string escapes: transformers compiles templates with
# trim_blocks/lstrip_blocks, which would eat literal newlines after block tags.
CHATML_TEMPLATE = (
    "{%- if messages[0].role == 'system' or tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ messages[0].content }}{%- endif -%}"
    "{%- if tools -%}{{ '\\n\\n# Tools\\n' }}"
    "{%- for tool in tools -%}{{ tool | tojson }}{{ '\\n' }}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if loop.first and message.role == 'system' -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message.content }}"
    "{%- for call in message.tool_calls or [] -%}"
    "{{ '<tool_call>' }}{{ call | tojson }}{{ '</tool_call>' }}"
    "{%- endfor -%}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
CHATML_TEMPLATE_NO_GENERATION = CHATML_TEMPLATE.replace("{% generation %}", "").replace(
    "{% endgeneration %}", ""
)

_CORPUS = (
    "You are a helpful assistant.",
    "What is the capital of France? The capital of France is Paris.",
    "Please write a short poem about the sea and the sky.",
    "The weather today is sunny with a light breeze from the west.",
    "Speculative decoding drafts tokens with a small model and verifies them.",
    "Call the tool get_weather with the city name to read the forecast.",
    '{"type": "function", "function": {"name": "get_weather", "parameters": {}}}',
    "user assistant system tool <tool_call> </tool_call> 0123456789",
)


def tiny_chat_tokenizer(
    *, generation_tags: bool = True, vocab_size: int = 384
) -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE chat tokenizer (``len(tokenizer) <= vocab_size``).

    ``generation_tags=False`` installs ``CHATML_TEMPLATE_NO_GENERATION`` (the span-finder
    path); the tokenization is identical either way (training is deterministic).
    ``eos_token`` is ``<|im_end|>``, ``pad_token`` is ``<|pad|>`` (id 0).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        pad_token="<|pad|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHATML_TEMPLATE if generation_tags else CHATML_TEMPLATE_NO_GENERATION,
    )
