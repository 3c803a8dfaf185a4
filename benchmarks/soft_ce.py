"""Microbenchmark of the indexed soft cross-entropy (forward + backward) on the GPU.

    python benchmarks/soft_ce.py --json soft_ce.json

Rows N of one step read a shared teacher table of U = N rows by index. Compared in
one process: eagle3fn ``impl="triton"`` (indexed kernels), ``impl="torch"`` (the
reference: gathers the table rows), SpecForge 0.2.0's fused ``LogSoftmaxLoss`` on a
pre-gathered dense teacher (its layout; it refuses Vd > 131072), and the fused head
(``loss.head_step_terms``: norm + lm_head + loss, logits recomputed in backward) vs
the unfused head at H = 4096. bf16 logits, compact bf16 table. Median of 10 after 3
warm-ups (CUDA events); peak = extra memory above the inputs. The JSON records the
run's commit, arguments and versions (``meta.run_metadata``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch
import tyro

from eagle3fn.draft import rms_norm
from eagle3fn.loss import head_step_terms, step_terms
from eagle3fn.shapes import TeacherTable
from meta import run_metadata
from timing import cuda_timed


@dataclass(kw_only=True)
class Args:
    rows: tuple[int, ...] = (2458, 8192)
    """N: 30% and 100% of 8192."""
    vocabs: tuple[int, ...] = (32000, 262144)
    """Vd."""
    hidden: int = 4096
    """H for the fused-head comparison."""
    chunk_rows: int = 2048
    """Rows per chunk of the fused head."""
    warmup: int = 3
    """Untimed calls first."""
    iters: int = 10
    """Timed calls (median)."""
    json: str | None = None
    """Write the results here as JSON."""


def resolved_args(args: Args) -> dict:
    """``args`` for the JSON (``json`` left out when not given)."""
    return {k: v for k, v in asdict(args).items() if not (k == "json" and v is None)}


def main(args: Args) -> None:
    if args.json:  # fails before any GPU time without git or EAGLE3FN_COMMIT
        run_metadata(resolved_args(args))

    def measure(fn):
        ms, peak, base = cuda_timed(fn, args.warmup, args.iters)
        return ms, (peak - base) / 2**30

    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for V in args.vocabs:
        for N in args.rows:
            teacher = (torch.randn(N, V, device="cuda", generator=g) * 3).bfloat16()
            lse = torch.logsumexp(teacher.float(), dim=-1)
            table = TeacherTable(logits=teacher, lse_draft=lse, lse_full=lse + 0.1,
                                 target_token=torch.randint(0, V, (N,), device="cuda", generator=g),
                                 gate=torch.rand(N, device="cuda", generator=g) < 0.9)
            table_rows = torch.randperm(N, device="cuda", generator=g)
            d2t = torch.zeros(V, dtype=torch.long, device="cuda")
            logits = (torch.randn(N, V, device="cuda", generator=g) * 2).bfloat16().requires_grad_()

            def ours(impl):
                def step():
                    t = step_terms(logits, table, table_rows, d2t, impl=impl)
                    t.loss_sum.backward()
                    logits.grad = None
                return step

            results = {"triton": measure(ours("triton")), "torch": measure(ours("torch"))}
            if V <= 131072:
                try:
                    from specforge.core.loss import LogSoftmaxLoss

                    mask = table.gate[table_rows][None, :, None].int()
                    probs = table.probs  # SpecForge's teacher: fp32 probabilities
                    x = logits.detach()[None].clone().requires_grad_()

                    def specforge():
                        dense = probs[table_rows][None]  # its layout: a gathered teacher
                        LogSoftmaxLoss.apply(x, dense, mask).backward()
                        x.grad = None
                    results["specforge"] = measure(specforge)
                    del probs
                except ImportError:
                    pass
            H = args.hidden
            hidden = (torch.randn(N, H, device="cuda", generator=g)).bfloat16().requires_grad_()
            norm_w = torch.ones(H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            head_w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
            head = lambda h, w, W: rms_norm(h, w, 1e-6) @ W.T  # noqa: E731

            def headed(fused):
                def step():
                    if fused:
                        t = head_step_terms(hidden, head, (norm_w, head_w), table, table_rows, d2t,
                                            impl="triton", chunk_rows=args.chunk_rows)
                    else:
                        t = step_terms(head(hidden, norm_w, head_w), table, table_rows, d2t, impl="triton")
                    t.loss_sum.backward()
                    hidden.grad = norm_w.grad = head_w.grad = None
                return step
            results["head+triton"] = measure(headed(False))
            results["fused head+triton"] = measure(headed(True))
            for name, (ms, gib) in results.items():
                rows.append(dict(Vd=V, N=N, impl=name, ms=round(ms, 3), extra_gib=round(gib, 3),
                                 ns_per_row_vocab=round(ms * 1e6 / (N * V), 4)))
                print(rows[-1], flush=True)
            del teacher, table, logits, hidden, head_w
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(run_metadata(resolved_args(args)), rows=rows), f, indent=1)
    print(f"\n{'Vd':>7} {'N':>5} {'impl':>18} {'fwd+bwd ms':>11} {'extra GiB':>10} {'ps/(row*vocab)':>15}")
    for r in rows:
        print(f"{r['Vd']:>7} {r['N']:>5} {r['impl']:>18} {r['ms']:>11.3f} {r['extra_gib']:>10.3f} "
              f"{r['ns_per_row_vocab'] * 1000:>15.1f}")


if __name__ == "__main__":
    main(tyro.cli(Args))
