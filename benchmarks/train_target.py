"""benchmarks/train.py's target: the shapes (``SHAPES``), the word-level chat
tokenizer (``word_tokenizer``) and the random-weight model built and saved from a
shape (``build_target``)."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

FIRST_WORD = 7
"""Ids below this are ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>`` and the role names."""
SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool")


# ---------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """The text shape of a target (built with random weights) and of its draft vocab.

    ``rope``: the HF ``rope_parameters`` (per layer type for Gemma-3);
    ``sliding_window`` / ``global_every``: Gemma-3's local layers (every
    ``global_every``-th layer is global); ``max_length`` and ``length_scale``: the
    defaults of ``--max-length`` and ``--length-scale``.
    """

    arch: Literal["llama", "gemma3"]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope: dict
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None
    global_every: int = 1
    tie_embeddings: bool = False
    max_length: int = 2048
    length_scale: float = 1.0

    def hf_config(self):
        """The transformers config of the target."""
        common = dict(hidden_size=self.hidden, intermediate_size=self.intermediate,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                      max_position_embeddings=131072, rms_norm_eps=self.rms_norm_eps,
                      rope_parameters=dict(self.rope), tie_word_embeddings=self.tie_embeddings,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if self.arch == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(**common)
        from transformers import Gemma3TextConfig

        layer_types = ["full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
                       for i in range(self.layers)]
        return Gemma3TextConfig(**common, sliding_window=self.sliding_window, layer_types=layer_types,
                                query_pre_attn_scalar=self.head_dim)

    def model_class(self):
        import transformers

        return transformers.LlamaForCausalLM if self.arch == "llama" else transformers.Gemma3ForCausalLM

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    def is_global(self, layer: int) -> bool:
        return self.sliding_window is None or (layer + 1) % self.global_every == 0


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
SHAPES = {
    # Llama-3.1-8B(-Instruct)'s config.json.
    "llama-3.1-8b": Shape(arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                          intermediate=14336, vocab=128256, draft_vocab=32000, rope=LLAMA3_ROPE),
    # Gemma-3-4B's text model with a 262144-entry vocab (the real one has 262208).
    "gemma-3-262k": Shape(arch="gemma3", hidden=2560, layers=34, heads=8, kv_heads=4, head_dim=256,
                          intermediate=10240, vocab=262144, draft_vocab=32000, rope=GEMMA3_ROPE,
                          rms_norm_eps=1e-6, sliding_window=1024, global_every=6, tie_embeddings=True),
    # SmolLM2-135M-Instruct's config.json (the outcome runs' real target), for its loop timed at
    # random weights beside SpecForge's: no weights to carry, and timing does not depend on them.
    "smollm2-135m": Shape(arch="llama", hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                          intermediate=1536, vocab=49152, draft_vocab=32000,
                          rope={"rope_type": "default", "rope_theta": 100000.0}, tie_embeddings=True,
                          max_length=1024, length_scale=0.5),
    # CPU tests: Llama-3.1's layout and RoPE at toy sizes.
    "tiny": Shape(arch="llama", hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  vocab=1024, draft_vocab=256, rope=LLAMA3_ROPE, max_length=128, length_scale=1 / 16),
    "tiny-gemma3": Shape(arch="gemma3", hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16,
                         intermediate=128, vocab=2048, draft_vocab=256, rope=GEMMA3_ROPE, rms_norm_eps=1e-6,
                         sliding_window=32, global_every=6, tie_embeddings=True, max_length=128,
                         length_scale=1 / 16),
}


# ---------------------------------------------------------------------------- target


def word_tokenizer(vocab_size: int):
    """A fast word-level chat tokenizer with exactly ``vocab_size`` ids: the
    ``SPECIAL_TOKENS`` then ``w{i}`` for ``FIRST_WORD <= i < vocab_size``; whitespace
    splits words, so ``"w12 w7"`` is two tokens. eagle3fn's ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle3fn.testing.tiny_tokenizer import CHATML_TEMPLATE

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"w{i}", i) for i in range(FIRST_WORD, vocab_size))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE)


def build_target(shape: Shape, path: Path, device: str, seed: int) -> float:
    """Save a random-weight target of ``shape`` and its tokenizer to ``path``, built on
    ``device`` in the compute dtype (bf16 on CUDA and on a CPU with AMX, fp32 on other
    CPUs); reuses what a
    previous call with the same arguments left there. Returns the seconds spent
    (0 when reused)."""
    import torch

    marker = path / "bench-target.json"
    data_fields = ("draft_vocab", "max_length", "length_scale")
    model_fields = {k: v for k, v in asdict(shape).items() if k not in data_fields}
    identity = {"shape": model_fields, "seed": seed, "device_type": torch.device(device).type}
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return 0.0
    t = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = shape.model_class()(shape.hf_config())
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    word_tokenizer(shape.vocab).save_pretrained(path)
    marker.write_text(json.dumps(identity))
    return time.perf_counter() - t
