"""Run subcommands: ``export`` (a draft SGLang/vLLM load) and ``eval`` (speculative decoding)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from eagle3fn.errors import UsageError

# Draft tokens per round at most: drafts accept a few per round, and a mistyped large
# value would only make every round slower (for many minutes).
MAX_DRAFT_TOKENS = 64


@dataclass(kw_only=True)
class ExportArgs:
    """Export a trained draft as a directory SGLang and vLLM load as an EAGLE-3 draft
    (or, with --format speculators, in the vllm-project speculators layout)."""

    run: str = "runs/eagle3fn"
    """The training run's out_dir (checkpoint.pt, vocab.safetensors)."""
    out: str = "runs/eagle3fn/draft"
    """Export directory (config.json, model.safetensors)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Weights dtype in the export."""
    format: Literal["eagle3", "speculators"] = "eagle3"
    """eagle3: the LlamaForCausalLMEagle3 directory SGLang and vLLM load as a draft
    (their speculative draft model path). speculators: the
    vllm-project speculators layout (its Eagle3DraftModel.from_pretrained, vllm serve
    <out>); it ships the target's embedding (read from its weights by name) and names
    the target's path as its verifier. docs/reference/what-an-export-contains.md says which versions are tested."""
    best: bool = False
    """Export checkpoint-best.pt (the step with the highest held-out acceptance length,
    written when training measures it) instead of the last checkpoint."""
    overwrite: bool = False
    """Write into --out even when it holds files that no ``eagle3fn export`` wrote (it is
    refused otherwise); files of the same names are replaced, others are left."""


def _run_target(cfg: dict, *, weights: bool, tokenizer: bool) -> dict:
    """The ``from_pretrained`` kwargs of a run's target after ``check_model_dir`` found
    it where the run was trained from (a moved model is named with the run)."""
    from eagle3fn.io.model_dir import check_model_dir

    check_model_dir(cfg["model"], cfg.get("gguf_file"), weights=weights, tokenizer=tokenizer)
    return {"gguf_file": cfg["gguf_file"]} if cfg.get("gguf_file") else {}


def export(args: ExportArgs) -> None:
    from transformers import AutoConfig

    from eagle3fn.io.export import COMMAND, export_draft
    from eagle3fn.io.paths import claim_dir
    from eagle3fn.train.checkpoint import load_run

    claim_dir(args.out, COMMAND, overwrite=args.overwrite, create=False)  # before the work
    run = load_run(args.run, best=args.best)
    cfg = run["config"]
    target_config = None
    if cfg.get("model"):  # only the config is read: the target's weights may be elsewhere
        kwargs = _run_target(cfg, weights=False, tokenizer=False)
        target_config = AutoConfig.from_pretrained(cfg["model"], **kwargs).to_dict()
    common = dict(d2t=run["d2t"], t2d=run["t2d"], aux_layer_ids=run["aux_layer_ids"],
                  target_config=target_config, dtype=getattr(torch, args.dtype), overwrite=args.overwrite)
    if args.format == "speculators":
        path = _export_speculators(args, run, common)
    else:
        path = export_draft(args.out, run["params"], run["draft"], **common)
    best = (f" (best acceptance length {run['best']['acceptance_length']:.2f})"
            if args.best and run["best"] else "")
    print(f"exported step {run['step']} of {args.run}{best} to {path}")


def _export_speculators(args: ExportArgs, run: dict, common: dict):
    """``export_speculators`` of a run: the target's embedding (the speculators layout
    ships it) read from its weights by name (``io.target.load_embedding_and_head``; the
    whole target only where the names cannot be matched), and the target named by its
    absolute path as the verifier."""
    import os

    from eagle3fn.io.export import export_speculators
    from eagle3fn.io.target import load_embedding_and_head, load_target

    cfg = run["config"]
    if not cfg.get("model") or cfg.get("gguf_file"):
        what = f"a GGUF target ({cfg.get('gguf_file')})" if cfg.get("model") else "no target model"
        raise UsageError(
            f"--format speculators needs the target's safetensors directory (speculators "
            f"reads its verifier from there); this run has {what}: use --format eagle3")
    kwargs = _run_target(cfg, weights=True, tokenizer=False)
    target = load_embedding_and_head(cfg["model"], aux_layer_ids=run["aux_layer_ids"], dtype=torch.float32,
                                     device="cpu")
    if isinstance(target, str):  # names not matched: the whole target, for its embedding
        target = load_target(cfg["model"], aux_layer_ids=run["aux_layer_ids"], **kwargs)
    params = {**run["params"], "embed_tokens.weight": target.embed_tokens.float()}
    return export_speculators(args.out, params, run["draft"], target_path=os.path.abspath(cfg["model"]),
                              **common)


@dataclass(kw_only=True)
class EvalArgs:
    """Acceptance length and wall-clock speedup of a trained draft: KV-cached (chain)
    speculative decoding with its target, timed beside the target alone (same prompts,
    batches and settings, same process), with the training-time simulated tau."""

    run: str = "runs/eagle3fn"
    """The training run's out_dir."""
    draft: str | None = None
    """Evaluate this EAGLE-3 draft directory instead of a run: SpecForge's save_pretrained
    of LlamaForCausalLMEagle3, an EAGLE-3 release (pytorch_model.bin) or ``eagle3fn
    export`` output (``eagle3fn.io.import_draft``); needs --model and --prompts."""
    model: str | None = None
    """The target the --draft was trained for (a local HF model directory)."""
    aux_layer_ids: tuple[int, int, int] | None = None
    """With --draft: the target layers it was trained on (default: what its config.json
    records, else the target's default [1, N//2-1, N-4], SpecForge's)."""
    prompts: str | None = None
    """Chat JSONL to take the prompts from (the turns before each conversation's first
    assistant turn, rendered with the target's chat template); default: the run's
    held-out conversations (its eval_holdout), or, without any, the last ones of its
    data, which it trained on (then the result is optimistic, and says so)."""
    num_prompts: int | None = None
    """Prompts to evaluate (the first ones of --prompts, else of the held-out set);
    default: every conversation of --prompts, else 8. Asking for more than there are
    is an error, never a silently smaller set."""
    num_draft_tokens: tuple[int, ...] = (6,)
    """Draft tokens proposed per round (k); several (``--num-draft-tokens 1 2 3 4 5 6 7``)
    sweep them, each timed beside its own run of the target alone, and report the fastest k
    per batch size."""
    max_new_tokens: int = 64
    """Tokens generated per prompt."""
    temperature: float = 0.0
    """0 = greedy verification; else the standard rejection rule at this temperature."""
    batch_size: tuple[int, ...] = (8,)
    """Prompts decoded together (each row accepts on its own); several (``--batch-size 1 4
    16``) measure each (the target alone timed again beside each k, batch by batch in
    alternating order)."""
    baseline: bool = True
    """Also time the target alone on the same batches (the speedup's denominator)."""
    untrained: bool = False
    """Evaluate the draft the run started from (step 0: its initialisation with the
    run's seed) instead of the trained one: the baseline training is measured against."""
    json: str | None = None
    """Also write the results (every configuration, the best k per batch size, the
    arguments, the draft's step and the device) to this JSON file."""
    device: str = "auto"
    """Where the target and the draft run (auto: cuda when a GPU is visible, else cpu)."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The target's and the draft's dtype (auto: bfloat16 on CUDA, float32 on the CPU)."""
    impl: Literal["auto", "graph", "static", "dynamic"] = "auto"
    """The decoding path, the same for the draft and the target alone: ``graph`` (static
    caches, each round and the target alone's step replayed as CUDA graphs on the GPU),
    ``static`` (the draft on fixed buffers, the target on transformers' cache),
    ``dynamic`` (both grown per round); auto: graph on CUDA, dynamic on the CPU."""

    def __post_init__(self) -> None:
        if isinstance(self.num_draft_tokens, int):
            self.num_draft_tokens = (self.num_draft_tokens,)
        if isinstance(self.batch_size, int):
            self.batch_size = (self.batch_size,)
        for k in self.num_draft_tokens:
            if not 1 <= k <= MAX_DRAFT_TOKENS:
                raise ValueError(f"--num-draft-tokens {k} is outside 1..{MAX_DRAFT_TOKENS} "
                                 "(draft tokens per round); pass e.g. --num-draft-tokens 6")
        if not self.num_draft_tokens or not self.batch_size:
            raise ValueError("--num-draft-tokens and --batch-size need at least one value; "
                             "e.g. --num-draft-tokens 6 --batch-size 8")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--num-prompts {self.num_prompts} must be >= 1; pass e.g. --num-prompts 8")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be >= 1; pass e.g. "
                             "--max-new-tokens 64")
        for b in self.batch_size:
            if b < 1:
                raise ValueError(f"--batch-size {b} must be >= 1; pass e.g. --batch-size 8")
        if self.draft is not None and (self.model is None or self.prompts is None or self.untrained):
            raise ValueError(f"--draft {self.draft} needs --model (its target) and --prompts (a chat JSONL: "
                             "an imported draft has no held-out conversations), and takes no --untrained")
        if self.draft is None and (self.model is not None or self.aux_layer_ids is not None):
            raise ValueError("--model and --aux-layer-ids go with --draft DIR; a run (--run) records its own")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature {self.temperature} must be a finite number >= 0 "
                             "(0 = greedy); pass e.g. --temperature 0")


def _chat_prompts(path: str, tok, num_prompts: int | None, on_error: str = "raise") -> list[torch.Tensor]:
    """The first ``num_prompts`` (default all) prompts ``[1, L]`` of a chat JSONL: each
    conversation's turns before its first assistant turn, rendered with the chat template
    (generation prompt added). UsageError when the file holds fewer."""
    from eagle3fn.io.data import read_conversations

    conversations, _ = read_conversations(path, on_error=on_error)
    n = len(conversations) if num_prompts is None else num_prompts
    if n > len(conversations):
        raise UsageError(f"--num-prompts {n} but {path} has {len(conversations)} conversations; pass "
                         f"--num-prompts {len(conversations)} or less")
    return [_render_prompt(tok, conv) for conv in conversations[:n]]


def _render_prompt(tok, conv) -> torch.Tensor:
    first_answer = next(i for i, m in enumerate(conv.messages) if m["role"] == "assistant")
    text = tok.apply_chat_template(list(conv.messages[:first_answer]), tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def _prompts(run: dict, tok, num_prompts: int | None) -> tuple[list[torch.Tensor], bool]:
    """``num_prompts`` (default 8) prompts ``[1, L]`` of the run and whether they are
    held out. Raises UsageError when the run has fewer: never evaluates on fewer than
    asked."""
    from eagle3fn.io.data import read_conversations

    num_prompts = 8 if num_prompts is None else num_prompts
    held = run["holdout_prompts"]
    if held:
        if num_prompts > len(held):
            raise UsageError(f"--num-prompts {num_prompts} but the run holds out {len(held)} "
                             f"conversations; pass --num-prompts {len(held)} or less, or retrain "
                             f"with --eval-holdout {num_prompts}")
        return [torch.tensor(p)[None] for p in held[:num_prompts]], True
    cfg = run["config"]
    if not cfg["data"]:
        raise UsageError(f"--num-prompts {num_prompts} but the run has no held-out conversations "
                         "and no data file (offline); retrain with --eval-holdout N, or pass --prompts FILE")
    conversations, _ = read_conversations(cfg["data"], on_error=cfg.get("on_error", "raise"))
    if num_prompts > len(conversations):
        raise UsageError(f"--num-prompts {num_prompts} but the run's data {cfg['data']} has "
                         f"{len(conversations)} conversations; pass --num-prompts "
                         f"{len(conversations)} or less")
    return [_render_prompt(tok, conv) for conv in conversations[-num_prompts:]], False


def evaluate(args: EvalArgs) -> dict:
    """Run ``eagle3fn eval``: print two lines and return ``evaluation.evaluate``'s dict
    plus ``step`` (the draft's, 0 when untrained) and ``held_out`` (prompts kept out of
    training; True for ``--prompts``, which the run did not train on unless it is its
    data)."""
    from transformers import AutoTokenizer

    from eagle3fn.io.data import check_data_file
    from eagle3fn.io.device import default_dtype, resolve_device
    from eagle3fn.io.target import load_target
    from eagle3fn.train.checkpoint import initial_params, load_run

    if args.prompts is not None:
        check_data_file(args.prompts)
    if args.json is not None:
        source_state()  # a wrong EAGLE3FN_DIRTY stops here, not after the sweep
    if args.draft is not None:
        from eagle3fn.io.import_draft import as_run

        run = as_run(args.draft, args.model, aux_layer_ids=args.aux_layer_ids)
    else:
        run = load_run(args.run)
    cfg = run["config"]
    kwargs = _run_target(cfg, weights=True, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(cfg["model"], **kwargs)
    if args.prompts is not None:  # before the target loads
        prompts, held_out, source = _chat_prompts(args.prompts, tok, args.num_prompts), True, args.prompts
    else:
        prompts, held_out = _prompts(run, tok, args.num_prompts)
        source = "held-out" if held_out else "trained-on"
    device = resolve_device(args.device)
    dtype = default_dtype(device) if args.dtype == "auto" else getattr(torch, args.dtype)
    target = load_target(cfg["model"], aux_layer_ids=run["aux_layer_ids"], device=device, dtype=dtype,
                         **kwargs)
    trainable = initial_params(run, target) if args.untrained else run["params"]
    params = {name: t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
              for name, t in {**trainable, "embed_tokens.weight": target.embed_tokens}.items()}
    if not held_out:
        print(f"note: {args.run} has no held-out conversations (eval_holdout=0), so these prompts "
              "come from the end of its training data and the draft was trained on them; "
              "train with --eval-holdout N (or pass --prompts FILE) for an honest number")
    step = 0 if args.untrained else run["step"]
    where = f"prompts from {source}" if args.prompts is not None else f"{source} prompts"
    name = f"{'untrained' if args.untrained else 'trained'} draft (step {step})"
    if len(args.num_draft_tokens) > 1 or len(args.batch_size) > 1:
        out = _eval_sweep(args, target, tok, run, params, prompts, f"{name}, {len(prompts)} {where}")
    else:
        out = _eval_one(args, target, tok, run, params, prompts, f"{name}, {len(prompts)} {where}")
    out.update(step=step, held_out=held_out)
    if args.json is not None:
        _write_json(args, out, target)
    return out


def _eval_one(args: EvalArgs, target, tok, run: dict, params: dict, prompts: list, label: str) -> dict:
    """One (k, batch size): ``evaluation.evaluate``'s dict, printed as two lines."""
    from eagle3fn.evaluation import SpecConfig, evaluate as run_eval

    k, batch = args.num_draft_tokens[0], args.batch_size[0]
    spec_cfg = SpecConfig(num_draft_tokens=k, max_new_tokens=args.max_new_tokens,
                          temperature=args.temperature)
    result = run_eval(target, params, run["draft"], run["d2t"], prompts, spec_cfg, tokenizer=tok,
                      batch_size=batch, baseline=args.baseline, impl=None if args.impl == "auto" else args.impl)
    per_pos = ", ".join(f"{a:.2f}" for a in result["per_position_acceptance"])
    print(f"{label}, {result['tokens']} tokens: "
          f"acceptance length {result['acceptance_length']:.2f} (k={k}), "
          f"per position [{per_pos}], simulated tau {result['simulated_tau']:.2f}")
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    speed = f"speed ({mode}, batches of {batch}, {target.model.device}, {result['impl']} path): " \
            f"{result['tokens_per_s']:.1f} tokens/s with the draft"
    if args.baseline:
        speed += (f", {result['target_tokens_per_s']:.1f} tokens/s target alone: speedup "
                  f"{result['speedup']:.2f}x; "
                  + (result["identity"] if "identity" in result else
                     f"{result['same_as_target']}/{len(prompts)} outputs identical to the target's own"))
    print(speed)
    if (line := linear_line(result["cpu_linear"])) is not None:
        print(line)
    return result


def linear_line(record: dict) -> str | None:
    """One line when ``decoding.cpu_linear.few_rows`` switched the target's linear layers
    (``record``: its ``choice_record``), else None."""
    from eagle3fn.decoding.cpu_linear import MAX_ROWS

    if record.get("form") != "w_xt":
        return None
    gains = ", ".join(f"{r} rows {lin / wx:.1f}x" for r, lin, wx in
                      zip(record["rows"], record["linear_s"], record["w_xt_s"]))
    return (f"  linear layers of 2-{MAX_ROWS} rows ran as W @ X^T on this CPU, on both sides (timed on "
            f"the head weight against F.linear: {gains} faster; eagle3fn.decoding.cpu_linear)")


def _eval_sweep(args: EvalArgs, target, tok, run: dict, params: dict, prompts: list, label: str) -> dict:
    """Every (batch size, k): ``evaluation.sweep``, printed as a table with the best k per
    batch size, and the acceptance length the training-time per-step accuracy implies
    (``simulated_acc`` of the target's own greedy texts) beside the measured one."""
    from eagle3fn.evaluation import SpecConfig, implied_acceptance_length, simulated_tau, sweep, target_generate

    if not args.baseline:
        raise UsageError("--no-baseline with several --num-draft-tokens / --batch-size: a sweep "
                         "reports speedups, which need the target alone; drop --no-baseline")
    print(f"{label}: k in {list(args.num_draft_tokens)}, batch sizes {list(args.batch_size)}, "
          f"{args.max_new_tokens} new tokens each ({target.model.device})")
    result = sweep(target, params, run["draft"], run["d2t"], prompts, ks=args.num_draft_tokens,
                   batch_sizes=args.batch_size, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, tokenizer=tok, impl=None if args.impl == "auto" else args.impl,
                   on_row=None if args.json is None else
                   lambda rows: _write_json(args, {"rows": rows, "partial": True}, target))
    kmax = max(args.num_draft_tokens)
    alone = target_generate(target, tok, prompts, SpecConfig(max_new_tokens=args.max_new_tokens))
    device = target.lm_head.weight.device
    sequences = [torch.cat((p.reshape(-1).to(device), p.new_tensor(a).to(device))) for p, a in zip(prompts, alone)]
    sim = simulated_tau(target, params, run["draft"], run["d2t"], sequences, [p.numel() for p in prompts], kmax)
    acc = [float(a) for a in sim.acc]
    for row in result["rows"]:
        row["implied_acceptance_length"] = implied_acceptance_length(acc, row["k"])
    print(f"  {'batch':>5} {'k':>3} {'acceptance length':>18} {'implied':>8} {'tokens/s':>10} "
          f"{'target alone':>13} {'speedup':>8}")
    for row in result["rows"]:
        mark = " <- best k" if result["best"][row["batch_size"]] is row else ""
        print(f"  {row['batch_size']:>5} {row['k']:>3} {row['acceptance_length']:>18.2f} "
              f"{row['implied_acceptance_length']:>8.2f} {row['tokens_per_s']:>10.1f} "
              f"{row['target_tokens_per_s']:>13.1f} {row['speedup']:>7.2f}x{mark}")
    if args.temperature == 0:
        print("  " + identity_summary(result["rows"]))
    if (line := linear_line(result["cpu_linear"])) is not None:
        print(line)
    per_step = ", ".join(f"{a:.2f}" for a in acc)
    print(f"  training-time per-step accuracy on the target's own greedy texts: [{per_step}] "
          f"(implied = 1 + sum_j prod_(i<=j) acc_i)")
    return {**result, "best": {str(b): r for b, r in result["best"].items()}, "simulated_acc": acc}


def source_state() -> dict:
    """What code made a result: eagle3fn's version, torch's and transformers', and the
    ``commit`` and ``dirty`` state of the source tree: ``EAGLE3FN_COMMIT`` /
    ``EAGLE3FN_DIRTY`` when set (a copied tree), else git's view of the checkout the
    package was imported from (an editable install), else None (an installed wheel:
    its version names it)."""
    import os
    import subprocess
    from pathlib import Path

    import transformers

    import eagle3fn

    commit, dirty = os.environ.get("EAGLE3FN_COMMIT") or None, os.environ.get("EAGLE3FN_DIRTY")
    if dirty is not None and dirty not in ("0", "1"):
        raise ValueError(f"EAGLE3FN_DIRTY={dirty!r}: set it to 0 (the tree is the commit as it is) or 1 "
                         "(it has changes), as `python benchmarks/meta.py` prints it")
    dirty = None if dirty is None else dirty == "1"
    if commit is None:
        src = Path(eagle3fn.__file__).resolve().parent

        def git(*argv: str) -> str | None:
            try:
                run = subprocess.run(["git", "-C", str(src), *argv], capture_output=True, text=True, timeout=10)
            except (OSError, subprocess.SubprocessError):
                return None
            return run.stdout.strip() if run.returncode == 0 else None

        commit = git("rev-parse", "HEAD")
        status = git("status", "--porcelain") if commit else None
        dirty = None if status is None else bool(status)
    return {"eagle3fn": eagle3fn.__version__, "commit": commit, "dirty": dirty, "torch": torch.__version__,
            "transformers": transformers.__version__}


def _write_json(args: EvalArgs, out: dict, target) -> None:
    """``out`` with the arguments and the device, to ``args.json`` (atomically); a sweep
    writes it after every configuration too (``"partial": true`` until the end)."""
    import dataclasses
    import json
    import os

    device = target.lm_head.weight.device
    record = {**source_state(), "args": dataclasses.asdict(args), "device": str(device),
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "dtype": str(target.lm_head.weight.dtype), "result": out}
    tmp = f"{args.json}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, args.json)


def identity_summary(rows: list[dict]) -> str:
    """One line on the token identity of a sweep's outputs: ``every configuration: <its
    identity>`` where all agree, else each identity with the configurations that gave it
    (``16/16 outputs identical ... at batch 1, k = 1-6; 10/16 ... at batch 1, k = 7``)."""
    groups: dict[str, dict[int, list[int]]] = {}
    for r in rows:
        groups.setdefault(r["identity"], {}).setdefault(r["batch_size"], []).append(r["k"])
    if len(groups) == 1:
        return f"every configuration: {next(iter(groups))}"

    def ks(values: list[int]) -> str:
        values = sorted(set(values))
        if len(values) > 2 and values == list(range(values[0], values[-1] + 1)):
            return f"{values[0]}-{values[-1]}"
        return ", ".join(map(str, values))
    return "; ".join(f"{identity} at " + ", ".join(f"batch {b}, k = {ks(k)}" for b, k in sorted(where.items()))
                     for identity, where in groups.items())
