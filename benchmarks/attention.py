"""The EAGLE-3 TTT attention alone (FlexAttention with eagle3fn's hand-built block
mask), forward + backward at one step j, in effective TFLOP/s (BENCH.md goal: >= 450
at S = 32768, 8B shapes: 32 heads, 8 kv heads, head dim 128, bf16).

Effective FLOPs count the causal step-0 part only: forward ``2 * 2 * B*h*d * S^2 / 2``,
backward 2.5x forward (the FlashAttention convention); the diagonal keys are O(S).

    python benchmarks/attention.py --seq-lens 8192 32768 --steps 0 6
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import tyro

from eagle3fn.ttt import flex_attention_step


@dataclass(kw_only=True)
class AttnArgs:
    """Attention benchmark settings."""

    seq_lens: tuple[int, ...] = (8192, 32768)
    """Sequence lengths."""
    steps: tuple[int, ...] = (0, 6)
    """TTT steps j to time (j diagonal key segments)."""
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ttt_length: int = 7
    iters: int = 10
    """Timed repetitions (median)."""


def main(args: AttnArgs) -> None:
    rows = []
    for S in args.seq_lens:
        g = torch.Generator(device="cuda").manual_seed(0)
        bf = dict(device="cuda", dtype=torch.bfloat16)
        q = torch.randn(1, args.heads, S, args.head_dim, generator=g, **bf).requires_grad_()
        keys = [(torch.randn(1, args.kv_heads, S, args.head_dim, generator=g, **bf).requires_grad_(),
                 torch.randn(1, args.kv_heads, S, args.head_dim, generator=g, **bf).requires_grad_())
                for _ in range(max(args.steps) + 1)]
        valid = torch.ones(1, S, dtype=torch.bool, device="cuda")
        for j in args.steps:
            def step():
                out = flex_attention_step(q, keys[: j + 1], valid, ttt_length=args.ttt_length)
                out.backward(torch.ones_like(out))
            for _ in range(3):
                step()
            times = []
            for _ in range(args.iters):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
            ms = statistics.median(times)
            flops = 3.5 * 2 * 2 * args.heads * args.head_dim * S * S / 2
            rows.append((S, j, ms, flops / ms / 1e9))
            print(rows[-1], flush=True)
    print(f"\n{'S':>7} {'step':>5} {'fwd+bwd ms':>11} {'eff. TFLOP/s':>13}")
    for S, j, ms, tf in rows:
        print(f"{S:>7} {j:>5} {ms:>11.2f} {tf:>13.0f}")


if __name__ == "__main__":
    main(tyro.cli(AttnArgs))
