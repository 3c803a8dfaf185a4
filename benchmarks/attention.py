"""The EAGLE-3 TTT attention alone (``unrolled.packed_flex_attention``: FlexAttention over
packed query rows and the step-0 keys, diagonal keys merged by log-sum-exp), forward +
backward at one step j, in effective TFLOP/s (BENCH.md goal: >= 450 at S = 32768, 8B
shapes: 32 heads, 8 kv heads, head dim 128, bf16).

Effective FLOPs count the causal step-0 part of the query rows only: forward
``2 * 2 * h*d * sum_rows (p + 1)``, backward 2.5x forward (the FlashAttention
convention); the diagonal keys are O(rows). ``--densities 1`` is every row.

    python benchmarks/attention.py --seq-lens 8192 32768 --steps 0 6
    python benchmarks/attention.py --kernel-options '{}' '{"bwd_num_stages": 2}'
    python benchmarks/attention.py --seq-lens 32768 --steps 0 --iters 5 --json attention.json
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

import torch
import tyro

from eagle3fn.unrolled import packed_flex_attention, packed_keys
from meta import run_metadata
from timing import cuda_timed


@dataclass(kw_only=True)
class AttnArgs:
    """Attention benchmark settings."""

    seq_lens: tuple[int, ...] = (8192, 32768)
    """Sequence lengths."""
    steps: tuple[int, ...] = (0, 6)
    """TTT steps j to time (j diagonal keys per row)."""
    densities: tuple[float, ...] = (1.0,)
    """Fractions of query rows (a contiguous tail, or scattered)."""
    pattern: Literal["tail", "scattered"] = "tail"
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    warmup: int = 3
    """Untimed repetitions first."""
    iters: int = 10
    """Timed repetitions (median)."""
    kernel_options: tuple[str, ...] = ("null",)
    """FlexAttention ``kernel_options`` to time, each a JSON object (``null``: none,
    inductor's defaults, which is what the library passes unless
    ``TTTConfig.flex_kernel_options`` is set); every configuration runs with each. A
    setting the GPU cannot compile or run is reported and timed as NaN."""
    json: str | None = None
    """Write the results here as JSON (with ``meta.run_metadata``)."""


def main(args: AttnArgs) -> None:
    if args.json:  # fails before any GPU time without git or EAGLE3FN_COMMIT
        run_metadata(resolved_args(args))
    results = measure(args)
    print(f"\n{'S':>7} {'rows':>6} {'step':>5} {'fwd+bwd ms':>11} {'eff. TFLOP/s':>13}   "
          f"kernel options ({args.pattern})")
    for S, density, j, ms, tf, options in results:
        print(f"{S:>7} {density:>6.0%} {j:>5} {ms:>11.2f} {tf:>13.0f}   {options}")
    if args.json:
        rows = [dict(S=S, density=density, pattern=args.pattern, step=j, fwd_bwd_ms=round(ms, 3),
                     effective_tflops=round(tf, 1), kernel_options=json.loads(options) or {})
                for S, density, j, ms, tf, options in results]
        with open(args.json, "w") as f:
            json.dump(dict(run_metadata(resolved_args(args)), results=rows), f, indent=1)


def resolved_args(args: AttnArgs) -> dict:
    """``args`` as the run used them, for its JSON: ``kernel_options`` parsed (``{}``:
    none, inductor's defaults), ``json`` left out when not given."""
    resolved = {k: v for k, v in asdict(args).items() if not (k == "json" and v is None)}
    resolved["kernel_options"] = [json.loads(options) or {} for options in args.kernel_options]
    return resolved


def measure(args: AttnArgs) -> list[tuple]:
    """(S, density, step, ms, TFLOP/s, options) of every configuration."""
    results = []
    parsed = [json.loads(options) for options in args.kernel_options]  # bad JSON fails first
    for S in args.seq_lens:
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        rand = lambda *shape: torch.randn(*shape, generator=g, **bf).requires_grad_()  # noqa: E731
        k0, v0 = rand(S, args.kv_heads, args.head_dim), rand(S, args.kv_heads, args.head_dim)
        lengths = torch.tensor([S], device="cuda")
        for density in args.densities:
            n = max(1, round(density * S))
            if args.pattern == "tail":
                rows = torch.arange(S - n, S, device="cuda")
            else:
                rows = torch.randperm(S, generator=g, device="cuda")[:n].sort().values
            q = rand(n, args.heads, args.head_dim)
            j_max = max(args.steps)
            diag = (rand(j_max, n, args.kv_heads, args.head_dim), rand(j_max, n, args.kv_heads, args.head_dim))
            for options, as_dict in zip(args.kernel_options, parsed):
                kernel_options = tuple(as_dict.items()) if as_dict else None
                for j in args.steps:
                    def step():
                        own = None if j == 0 else (diag[0][:j], diag[1][:j])
                        out = packed_flex_attention(q, rows, packed_keys(k0, v0), own, lengths, S,
                                                    kernel_options=kernel_options, fused=True)
                        out.backward(torch.ones_like(out))
                    try:
                        ms, _, _ = cuda_timed(step, warmup=args.warmup, iters=args.iters)
                    except Exception as error:  # a configuration the GPU cannot run
                        print(f"{options}: {type(error).__name__}: {str(error)[:200]}", flush=True)
                        ms = float("nan")
                    flops = 3.5 * 2 * 2 * args.heads * args.head_dim * float((rows + 1).sum())
                    results.append((S, density, j, ms, flops / ms / 1e9, options))
                    print(results[-1], flush=True)
    return results


if __name__ == "__main__":
    main(tyro.cli(AttnArgs))
