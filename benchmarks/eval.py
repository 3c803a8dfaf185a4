"""Speculative-decoding evaluation speed: ``evaluation.evaluate``'s machinery (KV-cached
target and draft, batched rows, rollback) on a random-weight target of a real shape,
beside the target alone, in one process.

    python benchmarks/eval.py --shape llama-3.1-8b --prompts 80 --max-new-tokens 256 \\
        --batch-size 80 --out eval-8b.json

(off a git checkout put ``$(python benchmarks/meta.py)``'s output before the command).
``--shape tiny --device cpu`` runs the same code on a CPU in seconds
(tests/test_bench_eval.py).

What one run does:

1. Target: ``train_target.build_target`` (random weights, the shape's config), saved
   under ``--work-dir`` and reused, loaded with ``load_target`` in ``--dtype`` (default
   bf16 on CUDA, fp32 on the CPU; fp32 matrix products without TF32, torch's default); its ``generation_config.eos_token_id`` is cleared so every prompt
   generates exactly ``--max-new-tokens`` (random weights emit the EOS id at random).
2. Draft: ``init_params`` of the draft ``eagle3fn train`` would build for this target
   (``train.build.draft_config_for``), with the target's embedding and head rows and a
   vocab map of the ``--draft-vocab-size`` most frequent ids of random counts, in the
   target's dtype. Random weights: acceptance is near its floor (1 token per round),
   so the run measures the machinery, not a trained draft.
3. Prompts: ``--prompts`` lists of ``--prompt-length`` ids drawn uniformly (seeded).
4. One warm-up ``generate`` and ``target_generate`` of the first batch at full length
   (CUDA context, cuBLAS handles, and the caching allocator's blocks for every cache
   length: a cold first pass allocates as the caches grow; its seconds are reported as
   ``cold_seconds`` / ``cold_target_seconds``), then, each timed after a device sync:
   ``evaluate`` (speculative decoding of every prompt in batches of ``--batch-size``,
   then the target alone on the same batches, ``target_generate``), and the same two
   again instrumented: ``generate`` with an ``evaluation.StageTimes`` (every stage
   bracketed by device syncs), the target alone with every forward timed
   (``ForwardTimer``).

``--impl`` picks ``generate``'s implementation (default: ``static`` on CUDA, where each
round's draft work is two CUDA-graph replays, recorded anew for every batch and every
doubling of the draft's cache; ``dynamic`` elsewhere). The instrumented target alone
times ``evaluation.kv.target_forward`` (transformers' ``DynamicCache``), so this
benchmark names its impl to ``evaluate`` instead of taking ``evaluation.default_impl``
(``graph`` on CUDA: ``eagle3fn eval`` measures that path).

Reported (JSON ``result``):

- ``cold_seconds`` / ``cold_target_seconds``: the warm-up passes (first batch only);
- ``seconds`` / ``tokens_per_s`` (speculative), ``target_seconds`` /
  ``target_tokens_per_s`` (target alone), ``speedup`` (their tokens/s ratio),
  ``acceptance_length``, ``rounds``, ``same_as_target`` (prompts whose outputs are
  identical; greedy bf16 can differ at argmax near-ties between a k+1-token verifying
  forward and single-token forwards);
- ``verify_ms`` (mean target forward of a round, ``B x (k+1)`` tokens), ``decode_ms``
  (mean single-token forward of the target alone), ``prefill_ms`` (the speculative
  prefills, summed);
- ``overhead_ms_per_round``: (wall time of the instrumented speculative run - its
  target forwards - the graph recordings) / rounds: the draft chain, the draft's cache
  update, acceptance, rollback and bookkeeping of one round; ``overhead_frac`` = that /
  ``verify_ms`` (the issue's goal: <= 15%). The instrumented run's extra syncs make this
  an upper bound. Its parts, per round: ``draft_chain_ms`` (the k draft steps),
  ``draft_context_ms`` (the verified positions into the draft's cache, the prompts' too)
  and ``bookkeeping_ms`` (the rest: acceptance, rollback, compaction, the host's read of
  the accepted counts, Python);
- ``record_s``: seconds spent recording CUDA graphs in the instrumented run (each
  recording includes one eager run of what it records; 0 when none); ``cold_record_s``:
  the same in the warm-up pass (the process's first recordings). Both are inside the
  wall-clock ``seconds`` a user waits (the plain run records as the instrumented one);
- ``predicted_speedup_at``: ``tau * decode_ms / (verify_ms + overhead_ms_per_round)``
  for acceptance lengths tau = 2, 3, 4 (what a trained draft would buy at these costs).

Printed last: one table.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

from train_target import FIRST_WORD, SHAPES, build_target  # noqa: E402


@dataclass(kw_only=True)
class EvalBenchArgs:
    """Time speculative evaluation against the target alone (module docstring)."""

    shape: Literal["llama-3.1-8b", "gemma-3-262k", "tiny", "tiny-gemma3"] = "llama-3.1-8b"
    """Target shape (random weights)."""
    prompts: int = 80
    """Prompts evaluated."""
    prompt_length: int = 128
    """Tokens per prompt."""
    max_new_tokens: int = 256
    """New tokens per prompt (no EOS: exactly this many)."""
    batch_size: int = 80
    """Prompts decoded together."""
    num_draft_tokens: int = 6
    """k, draft tokens per round."""
    draft_vocab_size: int | None = None
    """Vd (default: the shape's)."""
    seed: int = 0
    """Target weights, draft, vocab map and prompts."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Target and draft dtype (auto: bfloat16 on CUDA, float32 on the CPU)."""
    impl: Literal["static", "dynamic"] | None = None
    """``evaluation.generate``'s implementation (default: its own for the device)."""
    device: str = "cuda"
    """``cuda``, ``cuda:N`` or ``cpu``."""
    work_dir: str | None = None
    """Where the target is saved and reused (default: /tmp/eagle3fn-bench-<shape>)."""
    out: str | None = None
    """Write the results here as JSON."""


def resolve_dtype(args: EvalBenchArgs):
    """The run's torch dtype: ``--dtype``, or bf16 on CUDA and fp32 on the CPU."""
    import torch

    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    return torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32


def build(args: EvalBenchArgs):
    """``(target, params, draft_cfg, d2t, prompts, build_s)``: the random target, the
    random draft in the target's dtype, and the prompts (int64 ``[prompt_length]`` each)."""
    import torch
    from transformers import AutoConfig

    from eagle3fn.draft import init_params
    from eagle3fn.io.target import load_target
    from eagle3fn.train.build import draft_config_for
    from eagle3fn.vocab import build_vocab_map

    shape = SHAPES[args.shape]
    work = Path(args.work_dir or f"/tmp/eagle3fn-bench-{args.shape}")
    t0 = time.perf_counter()
    build_target(shape, work / "target", args.device, args.seed)
    dtype = resolve_dtype(args)
    target = load_target(str(work / "target"), dtype=dtype, device=args.device)
    target.model.generation_config.eos_token_id = None
    vd = args.draft_vocab_size or shape.draft_vocab
    draft_cfg = draft_config_for(AutoConfig.from_pretrained(work / "target"), vd, shape.vocab,
                                 max_length=args.prompt_length + args.max_new_tokens)
    g = torch.Generator().manual_seed(args.seed)
    d2t, t2d = build_vocab_map(torch.randint(0, 1000, (shape.vocab,), generator=g), draft_cfg.draft_vocab_size)
    head = target.lm_head.weight.detach()
    params = init_params(draft_cfg, embed_tokens=target.embed_tokens, target_lm_head=head,
                         t2d=t2d.to(head.device), device=head.device, seed=args.seed, dtype=dtype)
    params = {n: p.detach() for n, p in params.items()}
    prompts = [torch.randint(FIRST_WORD, shape.vocab, (args.prompt_length,), generator=g)
               for _ in range(args.prompts)]
    return target, params, draft_cfg, d2t.to(head.device), prompts, time.perf_counter() - t0


class ForwardTimer:
    """Wraps ``evaluation.kv.target_forward``: every call bracketed by device syncs and
    timed; ``calls`` holds ``(tokens per row, ms)``."""

    def __init__(self, kv, device):
        import torch

        self.kv, self.real, self.calls = kv, kv.target_forward, []
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

        @functools.wraps(self.real)
        def timed(target, ids_BN, *a, **k):
            sync()
            t = time.perf_counter()
            out = self.real(target, ids_BN, *a, **k)
            sync()
            self.calls.append((ids_BN.shape[1], 1e3 * (time.perf_counter() - t)))
            return out
        self.timed = timed

    def __enter__(self):
        self.kv.target_forward = self.timed
        return self

    def __exit__(self, *exc):
        self.kv.target_forward = self.real


def main(args: EvalBenchArgs) -> dict:
    """Build, warm up, time (module docstring); returns the JSON written to ``--out``."""
    import torch

    import eagle3fn.evaluation as spec
    from eagle3fn.evaluation import kv
    from meta import run_metadata

    resolved = {k: v for k, v in asdict(args).items() if not (k == "out" and v is None)}
    resolved.update(work_dir=args.work_dir or f"/tmp/eagle3fn-bench-{args.shape}",
                    draft_vocab_size=args.draft_vocab_size or SHAPES[args.shape].draft_vocab,
                    dtype=str(resolve_dtype(args)).removeprefix("torch."),
                    impl=args.impl or ("static" if torch.device(args.device).type == "cuda" else "dynamic"))
    run_metadata(resolved)  # off git without EAGLE3FN_COMMIT: fails before any device time
    torch.manual_seed(args.seed)
    target, params, draft_cfg, d2t, prompts, build_s = build(args)
    device = target.lm_head.weight.device
    cfg = spec.SpecConfig(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens)
    print(f"{args.shape}: target built/loaded in {build_s:.1f} s; draft H={draft_cfg.hidden_size} "
          f"Vd={draft_cfg.draft_vocab_size}; {args.prompts} prompts x {args.prompt_length} tokens, "
          f"{args.max_new_tokens} new, batches of {args.batch_size}, k={args.num_draft_tokens}, {resolved['dtype']}, "
          f"impl {resolved['impl']}", flush=True)
    cold, cold_stages = {}, spec.StageTimes()
    for name, fn in (("cold_seconds", lambda b: spec.generate(target, None, params, draft_cfg, d2t, b, cfg,
                                                              impl=resolved["impl"], stages=cold_stages)),
                     ("cold_target_seconds", lambda b: spec.target_generate(target, None, b, cfg))):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn(prompts[:args.batch_size])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        cold[name] = time.perf_counter() - t
    result = spec.evaluate(target, params, draft_cfg, d2t, prompts, cfg, batch_size=args.batch_size,
                           impl=resolved["impl"])
    print(f"plain: {result['seconds']:.1f} s speculative ({result['tokens_per_s']:.0f} tok/s), "
          f"{result['target_seconds']:.1f} s target alone ({result['target_tokens_per_s']:.0f} tok/s), "
          f"acceptance length {result['acceptance_length']:.2f}", flush=True)
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]

    def instrumented(fn):
        with ForwardTimer(kv, device) as timer:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            for batch in batches:
                fn(batch)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return time.perf_counter() - t, timer.calls

    stages = spec.StageTimes()
    spec_s, _ = instrumented(lambda b: spec.generate(target, None, params, draft_cfg, d2t, b, cfg,
                                                     impl=resolved["impl"], stages=stages))
    _, alone_calls = instrumented(lambda b: spec.target_generate(target, None, b, cfg))
    decode = [ms for n, ms in alone_calls if n == 1]
    rounds = stages.rounds
    per_round = lambda s: 1e3 * s / rounds  # noqa: E731
    verify_ms, decode_ms = per_round(stages.verify_s), sum(decode) / len(decode)
    chain_ms, context_ms = per_round(stages.draft_chain_s), per_round(stages.draft_context_s)
    overhead = per_round(stages.total_s - stages.prefill_s - stages.verify_s - stages.record_s)
    result.update(**cold, cold_record_s=cold_stages.record_s, verify_ms=verify_ms, decode_ms=decode_ms,
                  prefill_ms=1e3 * stages.prefill_s, instrumented_seconds=spec_s,
                  overhead_ms_per_round=overhead, overhead_frac=overhead / verify_ms,
                  draft_chain_ms=chain_ms, draft_context_ms=context_ms,
                  bookkeeping_ms=overhead - chain_ms - context_ms, record_s=stages.record_s,
                  predicted_speedup_at={tau: tau * decode_ms / (verify_ms + overhead) for tau in (2, 3, 4)},
                  peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    report = dict(run_metadata(resolved), build_s=build_s, result=result)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    table(args, result)
    return report


def table(args: EvalBenchArgs, r: dict) -> None:
    """The results table, printed last."""
    print(f"\n{args.shape}, {args.prompts} prompts x {args.max_new_tokens} new tokens, batches of "
          f"{args.batch_size}, k={args.num_draft_tokens} (random draft: acceptance length "
          f"{r['acceptance_length']:.2f})")
    print(f"{'':>22} {'seconds':>8} {'tok/s':>9} {'ms/forward':>11}")
    print(f"{'speculative':>22} {r['seconds']:>8.1f} {r['tokens_per_s']:>9.0f} {r['verify_ms']:>11.2f}")
    print(f"{'target alone':>22} {r['target_seconds']:>8.1f} {r['target_tokens_per_s']:>9.0f} "
          f"{r['decode_ms']:>11.2f}")
    print(f"per round: verify {r['verify_ms']:.2f} ms, draft chain {r['draft_chain_ms']:.2f} ms, draft context "
          f"{r['draft_context_ms']:.2f} ms, bookkeeping {r['bookkeeping_ms']:.2f} ms; CUDA graphs recorded in "
          f"{r['record_s']:.2f} s (warm-up pass {r['cold_record_s']:.2f} s)")
    print(f"speedup {r['speedup']:.2f}x; overhead per round {r['overhead_ms_per_round']:.2f} ms = "
          f"{r['overhead_frac']:.1%} of a verifying forward; {r['same_as_target']}/{r['n_prompts']} outputs "
          "identical to the target alone; predicted speedup at acceptance length "
          + ", ".join(f"{tau}: {s:.2f}x" for tau, s in r["predicted_speedup_at"].items()))


if __name__ == "__main__":
    import tyro

    main(tyro.cli(EvalBenchArgs))
