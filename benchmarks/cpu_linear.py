"""``F.linear`` against ``W @ X^T`` (``eagle3fn.decoding.cpu_linear``) on a CPU, for the
linear layers of a target, at the row counts of decoding (1) and of verifying forwards
(batch x (k + 1)):

    python benchmarks/cpu_linear.py --out cpu-linear.json

Each cell is ``cpu_linear.time_forms``' median of ``--repeats`` calls on random fp32
weights of the shape (``--shapes``: ``N,K`` pairs, default SmolLM2-135M's head, MLP and
attention projections) with ``torch.get_num_threads()`` threads. A small weight stays in
the CPU's cache across repeats, which a decoding step (every layer's weights in turn)
does not give it; the head weight (113 MB in fp32) does not fit, so its row is the one
``few_rows`` decides by.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass

import torch
import tyro

from eagle3fn.decoding.cpu_linear import time_forms
from meta import run_metadata


@dataclass(kw_only=True)
class Args:
    shapes: tuple[str, ...] = ("49152,576", "1536,576", "576,1536", "576,576", "192,576")
    """Weights ``N,K`` (out, in features)."""
    rows: tuple[int, ...] = (1, 2, 3, 4, 8, 16, 32, 64, 128)
    """Input rows."""
    repeats: int = 7
    """Timed calls per form and cell (the median counts)."""
    seed: int = 0
    out: str | None = None
    """Write the JSON here."""


def cpu() -> dict:
    """The CPU's model name and whether it has AMX and AVX-512 (Linux's /proc/cpuinfo)."""
    try:
        info = open("/proc/cpuinfo").read()
    except OSError:
        return {"name": platform.processor() or platform.machine()}
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return {"name": name, "amx": "amx_tile" in flags, "avx512": "avx512f" in flags,
            "cores": info.count("processor\t:")}


def main(args: Args) -> dict:
    torch.manual_seed(args.seed)
    cells = []
    for shape in args.shapes:
        n, k = map(int, shape.split(","))
        weight = torch.randn(n, k)
        for rows in args.rows:
            lin, wx = time_forms(weight, rows, args.repeats)
            cells.append({"N": n, "K": k, "rows": rows, "linear_ms": lin * 1e3, "w_xt_ms": wx * 1e3,
                          "linear_over_w_xt": lin / wx})
            print(f"{n:>6} x {k:<5} rows {rows:>4}: F.linear {lin * 1e3:8.3f} ms, W @ X^T {wx * 1e3:8.3f} ms "
                  f"({lin / wx:.2f})", flush=True)
    out = dict(run_metadata({**{k: v for k, v in asdict(args).items() if k != "out"},
                             "threads": torch.get_num_threads()}),
               cpu=cpu(), results=cells)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
