"""Host time of planning one batch's steps (CPU, milliseconds): what the training thread
spends per batch on index maths before the step runs, ``train.sources.batch_rowmap``
(the row map built from the batch's host masks and sent) plus ``unrolled.layout.plan_steps``
(the flex path's packed layouts of the k steps, and under ``trim="backbone"`` the
positions of each step's rows in the previous one's), with the features on the meta
device as a GPU host has them (nothing is read from the device; the uploads cost their
host side only).

``plan_steps`` is timed two ways in the same process on the same batches: ``new``, one
batched pass over the k steps (``impl="batched"``, the library's), and ``old``, its
per-step twin (``impl="per_step"``: ``packed_layout`` and a binary search per step, the
construction before it); the benchmark first checks that both give the same tensors.
``batch_rowmap`` is today's in both columns. The data are benchmarks/train.py's chat
set (``train_data.sample_conversations`` of ``--profile``, tokenized by
``train_target.word_tokenizer``, cut at the shape's max length), packed into rows of
T tokens (``io.packing.pack_examples``, ``collate_packed``) and cut into batches of B
rows. Medians over ``--reps`` passes over ``--batches`` batches, old and new
interleaved; ``ops`` counts the dispatched aten ops of one batch (views included).

    python benchmarks/plan_host.py --out docs/bench/plan-host.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import tyro
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402
from packing import chat_examples  # noqa: E402
from train_data import DataArgs  # noqa: E402


@dataclass(kw_only=True)
class Args(DataArgs):
    sizes: tuple[tuple[int, int], ...] = ((4, 2048), (1, 8192))
    """Batch shapes ``B T``: B packed rows of T tokens each."""
    trims: tuple[str, ...] = ("backbone", "loss")
    """``TTTConfig.trim`` modes planned (``none`` plans as ``loss``)."""
    ttt_length: int = 7
    """k, the TTT steps."""
    query_buckets: int = 4
    """``TTTConfig.query_buckets``."""
    batches: int = 8
    """Batches per shape (the first ones of the packed data)."""
    reps: int = 20
    """Timed passes over the batches."""
    threads: int = 1
    """torch's intra-op threads during the run (``plan_steps`` always runs on one,
    ``runtime.one_thread``; one keeps ``batch_rowmap``'s small ops off OpenMP's wake-ups)."""
    out: str = "plan-host.json"


class _OpCount(TorchDispatchMode):
    """Counts dispatched aten ops (``n``)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def packed_batches(args: Args, batch_size: int, length: int) -> list[tuple[object, object]]:
    """``(Features on the meta device, HostMasks)`` of the first ``args.batches`` batches of
    ``batch_size`` packed rows of ``length`` tokens from the benchmark's chat set."""
    from eagle3fn.io.packing import collate_packed, pack_examples
    from eagle3fn.shapes import Features
    from eagle3fn.train.sources import HostMasks

    examples, max_length = chat_examples(args)
    rows = pack_examples(examples, min(max_length, length), length=length)
    if len(rows) < args.batches * batch_size:
        raise ValueError(f"--conversations {args.conversations} fill {len(rows)} rows of {length} tokens, fewer "
                         f"than --batches {args.batches} x B {batch_size}: raise --conversations")
    out = []
    for i in range(args.batches):
        b = collate_packed(rows[i * batch_size:(i + 1) * batch_size], 0, length)
        meta = lambda x: x.to("meta")  # noqa: E731
        f = Features(input_ids=meta(b["input_ids"]), aux=torch.empty(batch_size, length, 1, device="meta"),
                     attention_mask=meta(b["attention_mask"]), positions=meta(b["position_ids"]))
        out.append((f, HostMasks(b["loss_mask"], b["attention_mask"], b["position_ids"])))
    return out


def plan_tensors(plan) -> list[torch.Tensor]:
    """Every host tensor of a ``StepPlan`` kept on the host (the layouts' and
    ``within`` / ``at``), in order."""
    lays = [t for lay in plan.layouts or [] if lay is not None for t in (lay.start, lay.last, *lay.tables)]
    return lays + [w for w in (plan.within or [])[1:]] + list(plan.at)


def check_same_plans(rowmap, trim: str, masks, query_buckets: int) -> None:
    """Raise unless the batched and per-step plans of the batch are the same tensors
    (planned on the host from the row map's host twin and the batch's host masks)."""
    from eagle3fn.shapes import Features
    from eagle3fn.unrolled.layout import plan_steps

    B, T = masks.attention_mask.shape
    host = Features(input_ids=masks.attention_mask, aux=torch.empty(B, T, 1), attention_mask=masks.attention_mask,
                    positions=masks.positions)
    got = [plan_tensors(plan_steps(rowmap.host.rowmap, trim, host, True, query_buckets, impl=impl))
           for impl in ("batched", "per_step")]
    if len(got[0]) != len(got[1]) or any(a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b)
                                         for a, b in zip(*got)):
        raise RuntimeError(f"the batched and per-step plans differ (trim {trim}): not timing them")


def measure(args: Args, batch_size: int, length: int, trim: str) -> dict:
    """One row of the report: medians (ms per batch) and op counts for ``trim`` over the
    shape's batches."""
    from eagle3fn.train.sources import batch_rowmap
    from eagle3fn.unrolled.layout import plan_steps

    batches = packed_batches(args, batch_size, length)
    k, qb = args.ttt_length, args.query_buckets
    rowmaps = [batch_rowmap(f, m, k) for f, m in batches]
    for (_, m), rm in zip(batches, rowmaps):
        check_same_plans(rm, trim, m, qb)
    times = {"rowmap": [], "per_step": [], "batched": []}
    for rep in range(args.reps):
        for (f, m), rm in zip(batches, rowmaps):
            t0 = time.perf_counter()
            batch_rowmap(f, m, k)
            times["rowmap"].append(time.perf_counter() - t0)
            for impl in ("batched", "per_step")[::1 if rep % 2 else -1]:
                t0 = time.perf_counter()
                plan_steps(rm, trim, f, True, qb, impl=impl)
                times[impl].append(time.perf_counter() - t0)
    ops = {}
    f, m = batches[0]
    with _OpCount() as count:
        batch_rowmap(f, m, k)
    ops["rowmap"] = count.n
    for impl in ("batched", "per_step"):
        with _OpCount() as count:
            plan_steps(rowmaps[0], trim, f, True, qb, impl=impl)
        ops[impl] = count.n
    ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    sup = [sum(r.numel() for r in rm.host.rowmap.rows) / (k * batch_size * length) for rm in rowmaps]
    old, new = ms["rowmap"] + ms["per_step"], ms["rowmap"] + ms["batched"]
    return {"batch_size": batch_size, "length": length, "trim": trim, "ttt_length": k, "query_buckets": qb,
            "batches": len(batches), "reps": args.reps, "supervised_frac": statistics.mean(sup),
            "rowmap_ms": ms["rowmap"], "plan_old_ms": ms["per_step"], "plan_new_ms": ms["batched"],
            "old_ms": old, "new_ms": new, "speedup": old / new,
            "ops": {"rowmap": ops["rowmap"], "plan_old": ops["per_step"], "plan_new": ops["batched"]}}


def main(args: Args) -> dict:
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = [measure(args, B, T, trim) for B, T in args.sizes for trim in args.trims]
    finally:
        torch.set_num_threads(before)
    report = {**run_metadata(asdict(args)), "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{'B x T':>10} {'trim':<9} {'rowmap':>7} {'plan old':>9} {'plan new':>9} {'old':>7} {'new':>7} "
          f"{'speedup':>7} {'ops old':>8} {'ops new':>8}")
    for r in rows:
        print(f"{r['batch_size']:>3} x {r['length']:<5} {r['trim']:<9} {r['rowmap_ms']:>7.2f} {r['plan_old_ms']:>9.2f} "
              f"{r['plan_new_ms']:>9.2f} {r['old_ms']:>7.2f} {r['new_ms']:>7.2f} {r['speedup']:>6.2f}x "
              f"{r['ops']['plan_old']:>8} {r['ops']['plan_new']:>8}")
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
