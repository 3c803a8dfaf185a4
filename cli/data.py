"""Data subcommands: ``vocab``, ``prepare``, ``regenerate`` (typed configs + library calls)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from eagle3fn.io.regenerate import GenerationConfig


@dataclass(kw_only=True)
class ModelSource:
    """A local HF model (or tokenizer) directory."""

    path: str
    """Directory with config.json / tokenizer files (no hub downloads)."""
    gguf_file: str | None = None
    """A GGUF file inside ``path`` to load from (e.g. SmolLM2-135M-Instruct.Q4_1.gguf)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights dtype of the target."""
    device: str = "cpu"
    """Device to run the target on."""

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


@dataclass(kw_only=True)
class DataSource:
    """Chat data in JSONL (ShareGPT ``conversations`` or OpenAI ``messages`` lines)."""

    path: str
    """The JSONL file."""
    max_length: int = 2048
    """Tokens per conversation after the chat template (longer ones are cut)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad lines: stop with file:line, or skip them and print the count."""


def _tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, **source.kwargs())


@dataclass(kw_only=True)
class VocabArgs:
    """Build the draft vocab map (d2t / t2d, SPEC 2) from the supervised tokens of chat data."""

    model: ModelSource
    """Tokenizer (and config, for the target vocab size) directory."""
    data: DataSource
    """Chat data."""
    draft_vocab_size: int = 32000
    """Vd, the draft head's vocab."""
    vocab_size: int | None = None
    """V, the target's lm_head rows (default: the model config's vocab_size)."""
    out: str = "vocab.safetensors"
    """Where to write d2t / t2d."""


def vocab(args: VocabArgs) -> None:
    from transformers import AutoConfig

    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.vocab_io import save_vocab_map, vocab_map_from_examples

    tok = _tokenizer(args.model)
    V = args.vocab_size or AutoConfig.from_pretrained(args.model.path, **args.model.kwargs()).vocab_size
    examples = tokenize_file(args.data.path, tok, max_length=args.data.max_length,
                             on_error=args.data.on_error)
    d2t, t2d = vocab_map_from_examples(examples, V, args.draft_vocab_size)
    save_vocab_map(args.out, d2t, t2d)
    print(f"wrote {args.out}: {args.draft_vocab_size} of {V} target ids from {len(examples)} conversations")


@dataclass(kw_only=True)
class PrepareArgs:
    """Run the target once over chat data and write the offline feature cache
    (resumable: rerun the same command to finish an interrupted run)."""

    model: ModelSource
    """The target."""
    data: DataSource
    """Chat data."""
    out: str
    """Cache directory."""
    batch_size: int = 4
    """Conversations per shard."""
    aux_layer_ids: tuple[int, int, int] | None = None
    """Output-of-layer ids captured (default [1, N//2-1, N-4])."""
    storage: Literal["bfloat16", "float32"] = "bfloat16"
    """dtype of the cached aux features and final hidden."""


def prepare(args: PrepareArgs) -> None:
    from eagle3fn.io.cache import prepare as write
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.target import load_target

    tok = _tokenizer(args.model)
    target = load_target(args.model.path, aux_layer_ids=args.aux_layer_ids,
                         dtype=getattr(torch, args.model.dtype), device=args.model.device,
                         **args.model.kwargs())
    examples = tokenize_file(args.data.path, tok, max_length=args.data.max_length,
                             on_error=args.data.on_error)
    meta = {"model": asdict(args.model) | {"device": None}, "data": asdict(args.data),
            "batch_size": args.batch_size, "aux_layer_ids": list(target.aux_layer_ids)}
    write(target, examples, args.out, batch_size=args.batch_size, pad_token_id=tok.pad_token_id or 0,
          meta=meta, dtype=getattr(torch, args.storage))


@dataclass(kw_only=True)
class RegenerateArgs:
    """Rewrite every assistant turn of chat data with the target (prompts kept), JSONL out."""

    model: ModelSource
    """The target."""
    data: DataSource
    """Chat data."""
    out: str
    """Output JSONL (OpenAI ``messages`` form)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Decoding settings."""


def regenerate(args: RegenerateArgs) -> None:
    from transformers import AutoModelForCausalLM

    from eagle3fn.io.data import read_conversations
    from eagle3fn.io.regenerate import regenerate as run, write_jsonl

    tok = _tokenizer(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model.path, dtype=getattr(torch, args.model.dtype),
                                                 **args.model.kwargs()).to(args.model.device).eval()
    conversations, skipped = read_conversations(args.data.path, on_error=args.data.on_error)
    new = run(conversations, model, tok, args.generation)
    n = write_jsonl(args.out, new, [c.tools for c in conversations])
    print(f"wrote {n} conversations to {args.out} ({skipped} bad lines skipped)")
