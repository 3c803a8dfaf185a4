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
    """Prompts taken from the run's held-out conversations (the training run's
    eval_holdout); a run without any takes the last ones of its data, which it
    trained on (then the result is optimistic, and says so)."""
    num_draft_tokens: int = 6
    """Draft tokens proposed per round (k)."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    temperature: float = 0.0
    """0 = greedy verification; else the standard rejection rule at this temperature."""
    untrained: bool = False
    """Evaluate the draft the run started from (step 0: its initialisation with the
    run's seed) instead of the trained one: the baseline training is measured against."""


def _prompts(run: dict, tok, num_prompts: int) -> tuple[list[torch.Tensor], bool]:
    """Up to ``num_prompts`` prompts ``[1, L]`` and whether they are held out."""
    from eagle3fn.io.data import read_conversations

    if run["holdout_prompts"]:
        return [torch.tensor(p)[None] for p in run["holdout_prompts"][:num_prompts]], True
    if not run["config"]["data"]:
        raise ValueError(f"{num_prompts} prompts needed but the run has no held-out conversations "
                         "and no data file (offline); retrain with --eval-holdout N")
    conversations, _ = read_conversations(run["config"]["data"])
    prompts = []
    for conv in conversations[-num_prompts:]:
        first_answer = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
        text = tok.apply_chat_template(list(conv.messages[:first_answer]), tokenize=False,
                                       add_generation_prompt=True)
        prompts.append(tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"])
    return prompts, False


def evaluate(args: EvalArgs) -> dict:
    """Run ``eagle3fn eval``: print one line and return ``speculative.evaluate``'s dict
    plus ``step`` (the draft's, 0 when untrained) and ``held_out`` (prompts kept out of
    training)."""
    from transformers import AutoTokenizer

    from eagle3fn.io.target import load_target
    from eagle3fn.speculative import SpecConfig, evaluate as run_eval
    from eagle3fn.train.loop import initial_params, load_run

    run = load_run(args.run)
    cfg = run["config"]
    kwargs = {"gguf_file": cfg["gguf_file"]} if cfg.get("gguf_file") else {}
    tok = AutoTokenizer.from_pretrained(cfg["model"], **kwargs)
    target = load_target(cfg["model"], aux_layer_ids=run["aux_layer_ids"], **kwargs)
    trainable = initial_params(run, target) if args.untrained else run["params"]
    params = {**trainable, "embed_tokens.weight": target.embed_tokens.float()}
    prompts, held_out = _prompts(run, tok, args.num_prompts)
    if not held_out:
        print(f"note: {args.run} has no held-out conversations (eval_holdout=0), so these prompts "
              "come from the end of its training data and the draft was trained on them; "
              "train with --eval-holdout N for an honest number")
    result = run_eval(target, params, run["draft"], run["d2t"], prompts,
                      SpecConfig(num_draft_tokens=args.num_draft_tokens,
                                 max_new_tokens=args.max_new_tokens, temperature=args.temperature),
                      tokenizer=tok)
    step = 0 if args.untrained else run["step"]
    per_pos = ", ".join(f"{a:.2f}" for a in result["per_position_acceptance"])
    print(f"{'untrained' if args.untrained else 'trained'} draft (step {step}), "
          f"{len(prompts)} {'held-out' if held_out else 'trained-on'} prompts, {result['tokens']} tokens: "
          f"acceptance length {result['acceptance_length']:.2f} (k={args.num_draft_tokens}), "
          f"per position [{per_pos}], simulated tau {result['simulated_tau']:.2f}")
    return {**result, "step": step, "held_out": held_out}


def demo_report(out_dir: str, *, num_prompts: int, max_new_tokens: int,
                untrained_new_tokens: int) -> None:
    """The embedded default's closing table: acceptance length of the untrained and the
    trained draft on held-out prompts, the held-out training objective, where the run's
    files are, and the commands that reproduce the numbers and export the draft."""
    import shlex
    from pathlib import Path

    from eagle3fn.train.loop import CHECKPOINT, METRICS
    from eagle3fn.train.metrics import read_metrics

    out = Path(out_dir)
    q = shlex.quote(str(out))
    base = f"eagle3fn eval --run {q} --num-prompts {num_prompts}"
    rows = [("untrained (step 0)", f"{base} --max-new-tokens {untrained_new_tokens} --untrained",
             evaluate(EvalArgs(run=str(out), num_prompts=num_prompts,
                               max_new_tokens=untrained_new_tokens, untrained=True)))]
    trained = evaluate(EvalArgs(run=str(out), num_prompts=num_prompts, max_new_tokens=max_new_tokens))
    rows.append((f"trained (step {trained['step']})", f"{base} --max-new-tokens {max_new_tokens}", trained))
    kind = "held-out" if trained["held_out"] else "trained-on"
    print(f"\nspeculative decoding on {trained['n_prompts']} {kind} prompts (greedy, "
          f"k={EvalArgs.num_draft_tokens} draft tokens per round):")
    print(f"  {'draft':<20} {'new tokens':>12} {'acceptance length':>19} {'simulated tau':>15}   reproduce with")
    for name, command, r in rows:
        print(f"  {name:<20} {r['tokens']:>12} {r['acceptance_length']:>19.2f} {r['simulated_tau']:>15.2f}   "
              f"{command}")
    if untrained_new_tokens != max_new_tokens:
        print(f"  (the untrained draft generates {untrained_new_tokens} tokens per prompt, not {max_new_tokens}, "
              "to keep the demo short: acceptance length is a mean per round either way)")
    held = [r for r in read_metrics(out / METRICS) if r.get("split") == "eval"]
    if held:
        h = held[-1]
        print(f"held-out training objective at step {h['step']}: loss {h['loss']:.4f}, "
              f"acc per step {[round(a, 2) for a in h['acc']]}, simulated tau {h['tau']:.2f}")
    print(f"checkpoint  {out / CHECKPOINT}\nmetrics     {out / METRICS}\nplot        {out / 'loss.png'}")
    print(f"export      eagle3fn export --run {q} --out {shlex.quote(str(out / 'draft'))}")
