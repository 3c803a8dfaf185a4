"""The TTT step of two source trees in ONE process, interleaved: does a refactor keep the
step's time? (BENCH.md protocol: 8B shapes, bf16, CUDA events, medians.)

The other tree is a copy of ``src/eagle3fn`` at another commit, renamed so both import
side by side:

    git archive <commit> src/eagle3fn | tar -x -C .old && mv .old/src/eagle3fn .old/eagle3fn_old
    grep -rl eagle3fn .old/eagle3fn_old --include=*.py | xargs sed -i -E \\
        's/\\bfrom eagle3fn([. ])/from eagle3fn_old\\1/g; s/\\bimport eagle3fn\\b/import eagle3fn_old/g'
    PYTHONPATH=.old python benchmarks/compare_trees.py --old-commit <commit> --json out.json

Each mode runs old, new, old, new, ... (``--rounds`` rounds of ``--iters`` timed steps
after ``--warmup``), on the same inputs and weights; the table gives each tree's median
and new/old. The old tree's ``TTTConfig`` may lack newer fields: only the fields both
share are passed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import statistics
from dataclasses import dataclass, field

import torch
import tyro

from eagle3fn.align import supervised_mask
from eagle3fn.draft import init_params
from eagle3fn.rowmap import build_rowmap
from meta import run_metadata
from step import BenchArgs, draft_config, make_inputs
from timing import cuda_timed


@dataclass(kw_only=True)
class CompareArgs:
    """Which steps to compare."""

    old_package: str = "eagle3fn_old"
    """The other tree's package name (on PYTHONPATH)."""
    old_commit: str = "unknown"
    """The commit the other tree was taken from (recorded in the JSON)."""
    seq_len: int = 8192
    density: float = 0.3
    pattern: str = "tail"
    modes: tuple[str, ...] = ("backbone", "none")
    warmup: int = 3
    iters: int = 6
    rounds: int = 3
    json: str | None = None
    bench: BenchArgs = field(default_factory=BenchArgs)
    """The 8B shapes (BENCH.md)."""


def _step(unrolled, params, features, loss_mask, d2t, t2d, cfg, trim, k):
    names = {f.name for f in dataclasses.fields(unrolled.TTTConfig)}
    config = unrolled.TTTConfig(**{n: v for n, v in dict(draft=cfg, ttt_length=k, trim=trim,
                                                           attention="flex").items() if n in names})

    def step():
        rm = build_rowmap(supervised_mask(loss_mask, features.attention_mask), k)
        out = unrolled.ttt(params, features, rm, config, d2t=d2t, t2d=t2d)
        out.objective.backward()
        for p in params.values():
            p.grad = None
    return step


def main(args: CompareArgs) -> None:
    old = importlib.import_module(f"{args.old_package}.ttt")
    new = importlib.import_module("eagle3fn.unrolled")
    cfg = draft_config(args.bench)
    params = {n: p.detach().to("cuda", torch.bfloat16).requires_grad_(p.requires_grad)
              for n, p in init_params(cfg, seed=0).items()}
    features, loss_mask, d2t, t2d = make_inputs(args.bench, args.seq_len, args.density, args.pattern)
    rows = []
    for mode in args.modes:
        steps = {tree: _step(module, params, features, loss_mask, d2t, t2d, cfg, mode, args.bench.ttt_length)
                 for tree, module in (("old", old), ("new", new))}
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            for tree in ("old", "new"):
                ms, _, _ = cuda_timed(steps[tree], args.warmup, args.iters)
                times[tree].append(ms)
        med = {tree: statistics.median(v) for tree, v in times.items()}
        rows.append(dict(mode=mode, old_ms=round(med["old"], 2), new_ms=round(med["new"], 2),
                         ratio=round(med["new"] / med["old"], 3), old_rounds=times["old"],
                         new_rounds=times["new"]))
        print(rows[-1], flush=True)
    if args.json:
        meta = run_metadata({k: v for k, v in dataclasses.asdict(args).items() if k != "json"})
        with open(args.json, "w") as f:
            json.dump({**meta, "rows": rows}, f, indent=1)
    print(f"\n{'mode':<10} {'old ms':>9} {'new ms':>9} {'new/old':>8}   (S={args.seq_len}, "
          f"{args.density:.0%} {args.pattern}, one process, {args.rounds} interleaved rounds)")
    for r in rows:
        print(f"{r['mode']:<10} {r['old_ms']:>9.2f} {r['new_ms']:>9.2f} {r['ratio']:>8.3f}")


if __name__ == "__main__":
    main(tyro.cli(CompareArgs))
