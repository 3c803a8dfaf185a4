"""A synthesis run end to end: inputs checked, the backend built, settings fixed, the
loop run, the report written. The side-effect layer between the CLI and the pure parts."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Callable

import torch

from eagle3fn.synth.backends import EngineBackend, GenerateBackend
from eagle3fn.synth.config import SynthConfig, read_lines
from eagle3fn.synth.pipeline import Synthesizer
from eagle3fn.synth.report import format_report
from eagle3fn.synth.template import end_of_turn_ids, topic_system_prompt, user_turn_prefix


def default_batch_size(device: torch.device) -> int:
    """Slots decoded together when --batch-size is not given: 256 on CUDA, 16 on the CPU."""
    return 256 if device.type == "cuda" else 16


def load_local(path: str, tokenizer, *, gguf_file: str | None, dtype: torch.dtype, device: torch.device,
               batch_size: int, compile: bool = False):
    """``(backend, model)`` for the target in ``path``: ``EngineBackend`` (the static-cache
    generator; ``compile``: its CPU decode step compiled, ``GenerateConfig.compile``), or
    ``GenerateBackend`` for a model with sliding-window layers, which that generator does
    not serve."""
    from transformers import AutoModelForCausalLM

    from eagle3fn.decoding.static_cache import check_full_attention

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device).eval()
    try:
        check_full_attention(model.config)
    except ValueError:
        return GenerateBackend(model, tokenizer, batch_size=batch_size), model
    return EngineBackend(model, tokenizer, batch_size=batch_size, compile=compile), model


def model_eos(model) -> tuple[int, ...]:
    """The ids of ``model.generation_config.eos_token_id`` (what ``generate`` stops at)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return ()
    return (eos,) if isinstance(eos, int) else tuple(int(e) for e in eos)


def tokenizer_digest(tokenizer) -> str:
    """sha256 of what decides a tokenization and its rendering: the fast tokenizer's
    JSON (vocab, merges, special tokens) and the chat template."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = (backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items())))
    return hashlib.sha256((text + "\0" + str(tokenizer.chat_template)).encode()).hexdigest()


def _lines_digest(lines: list[str]) -> str:
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def synthesize(*, backend, tokenizer, cfg: SynthConfig, out: str, identity: dict, stop_ids,
               prompts: str | None = None, on_error: str = "raise", commit_every: int = 256,
               live: bool | None = None, log: Callable[[str], None] = print) -> dict:
    """Write (or resume) ``out`` with ``backend``; returns the report and prints it.

    ``identity``: what names the target and the backend in the settings (a target
    fingerprint, ``{"backend": "server", "model": name}``, ...); with ``cfg`` (but its
    ``num_conversations``) and the steering files' contents it makes the settings that a
    resume must repeat.
    """
    from eagle3fn.io.fingerprint import file_fingerprint
    from eagle3fn.synth.prompts import read_prompts

    # Conversation i does not depend on how many are asked for: a rerun with a larger
    # --num-conversations extends the output.
    settings = {**identity, **asdict(cfg), "stop_ids": list(stop_ids)}
    del settings["num_conversations"]
    systems: list[str] = []
    if cfg.system_prompts:
        systems = read_lines(cfg.system_prompts, "system-prompts")
        settings["system_prompts"] = _lines_digest(systems)
    if cfg.topics:
        topics = read_lines(cfg.topics, "topics")
        systems = [topic_system_prompt(t) for t in topics]
        settings["topics"] = _lines_digest(topics)
    given = None
    if prompts is not None:
        given, skipped = read_prompts(prompts, on_error=on_error)
        settings["prompts"] = file_fingerprint(prompts)
        if skipped:
            log(f"{prompts}: {skipped} bad lines skipped")
    else:
        user_turn_prefix(tokenizer, [])  # the template can be used (a clear error if not)
    synth = Synthesizer(backend, tokenizer, cfg, stop_ids=stop_ids, commit_every=commit_every, log=log)
    report = synth.run(out, settings, given=given, systems=systems, live=live)
    log(format_report(report))
    return report


def stop_ids_for(tokenizer, model=None) -> tuple[int, ...]:
    """The ids that end a turn: the template's end-of-turn token, the tokenizer's eos and
    the model's generation eos."""
    return end_of_turn_ids(tokenizer, model_eos(model) if model is not None else ())
