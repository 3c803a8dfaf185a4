"""Run subcommands: ``export`` (a draft SGLang/vLLM load) and ``eval`` (speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(kw_only=True)
class ExportArgs:
    """Export a trained draft as a directory SGLang and vLLM load as an EAGLE-3 draft."""

    run: str = "runs/eagle3fn"
    """The training run's out_dir (checkpoint.pt, vocab.safetensors)."""
    out: str = "runs/eagle3fn/draft"
    """Export directory (config.json, model.safetensors)."""
    dtype: str = "bfloat16"
    """Weights dtype in the export."""


def export(args: ExportArgs) -> None:
    from transformers import AutoConfig

    from eagle3fn.io.export import export_draft
    from eagle3fn.train.loop import load_run

    run = load_run(args.run)
    cfg = run["config"]
    kwargs = {"gguf_file": cfg["gguf_file"]} if cfg.get("gguf_file") else {}
    target_config = AutoConfig.from_pretrained(cfg["model"], **kwargs).to_dict() if cfg.get("model") else None
    path = export_draft(args.out, run["params"], run["draft"], d2t=run["d2t"], t2d=run["t2d"],
                        aux_layer_ids=run["aux_layer_ids"], target_config=target_config,
                        dtype=getattr(torch, args.dtype))
    print(f"exported step {run['step']} of {args.run} to {path}")


@dataclass(kw_only=True)
class EvalArgs:
    """Acceptance length of a trained draft by real (chain) speculative decoding with its
    target, beside the training-time simulated tau."""

    run: str = "runs/eagle3fn"
    """The training run's out_dir."""
    num_prompts: int = 8
    """Prompts taken from the end of the run's data (their user turns)."""
    num_draft_tokens: int = 6
    """Draft tokens proposed per round (k)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    temperature: float = 0.0
    """0 = greedy verification; else the standard rejection rule at this temperature."""


def evaluate(args: EvalArgs) -> None:
    from transformers import AutoTokenizer

    from eagle3fn.io.data import read_conversations
    from eagle3fn.io.target import load_target
    from eagle3fn.speculative import SpecConfig, evaluate as run_eval
    from eagle3fn.train.loop import load_run

    run = load_run(args.run)
    cfg = run["config"]
    kwargs = {"gguf_file": cfg["gguf_file"]} if cfg.get("gguf_file") else {}
    tok = AutoTokenizer.from_pretrained(cfg["model"], **kwargs)
    target = load_target(cfg["model"], aux_layer_ids=run["aux_layer_ids"], **kwargs)
    params = {**run["params"], "embed_tokens.weight": target.embed_tokens.float()}
    conversations, _ = read_conversations(cfg["data"])
    prompts = []
    for conv in conversations[-args.num_prompts:]:
        first_answer = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
        text = tok.apply_chat_template(list(conv.messages[:first_answer]), tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"])
    result = run_eval(target, params, run["draft"], run["d2t"], prompts,
                      SpecConfig(num_draft_tokens=args.num_draft_tokens,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature),
                      tokenizer=tok)
    per_pos = ", ".join(f"{a:.2f}" for a in result["per_position_acceptance"])
    print(f"{len(prompts)} prompts, {result['tokens']} tokens: acceptance length "
          f"{result['acceptance_length']:.2f} (k={args.num_draft_tokens}), per position [{per_pos}], "
          f"simulated tau {result['simulated_tau']:.2f}")
