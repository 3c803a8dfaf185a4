"""Padding of packed batches on the end-to-end benchmark's chat data (CPU, seconds).

The data is benchmarks/train.py's: ``train_data.sample_conversations`` (``prompt-heavy``
by default, WildChat-like, mean ~1640 tokens, cut at the shape's max length, 2048)
tokenized by ``train_target.word_tokenizer`` (one token per word: exact counts) through
``io.data.tokenize_file``, as ``eagle3fn train`` reads it. For each row length N
(``--pack-length``; batches of ``batch_size * max_length / N`` rows, the same tokens
per batch) it reports the padding fraction of computed tokens, ``1 - real / (rows x
N)``, of:

- ``unpacked``: ``--no-pack``, batches of ``batch_size`` conversations padded to the
  longest (SpecForge's batches; at N = max length only);
- ``first-fit``: eagle3fn before --pack-window, online: first-fit in file order;
- ``first-fit/shard``: eagle3fn before --pack-window, offline: each cache shard
  (``prepare --batch-size`` conversations) packed alone;
- ``bfd/W``: eagle3fn now (``io.packing.plan_rows``: best fit, longest first, windows
  of W consecutive conversations), online; offline the plan
  ``train.sources.packed_batches`` makes over the cache's shards (the same rows, so
  the same padding; ``shards`` is how many cache shards a batch reads its
  conversations from, each read alone);
- ``bound``: a lower bound on the padding of any packing that does not split
  conversations (Martello and Toth's L2 bound on the number of rows, Discrete
  Applied Mathematics 28, 1990): where it exceeds 3%, no packer reaches 3% there.

    python benchmarks/packing.py --out packing.json
    python benchmarks/packing.py --conversations 4000 --out packing-4000.json

``--conversations 320`` is benchmarks/train.py's data (``--steps 80 --batch-size 4``);
with 104 and 120 (its H200 runs docs/bench/train-8b-online-vs-specforge-shipped.json and
train-8b-online-pack-vs-unpacked.json) first-fit gives the padding those runs measured,
10.29% and 9.48%.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402
from train_data import PROFILES, DataArgs, padding_fraction, sample_conversations, write_jsonl  # noqa: E402
from train_target import SHAPES, word_tokenizer  # noqa: E402


@dataclass(kw_only=True)
class Args(DataArgs):
    pack_lengths: tuple[int, ...] = (2048, 4096, 8192)
    """Row lengths N (each >= the max length; scaled with the shape: ``tiny`` uses
    rows of 128, 256, 512 when left at the default)."""
    windows: tuple[int, ...] = (32, 128, 512)
    """Packing windows W (``--pack-window``); the library default is always included."""
    out: str = "packing.json"


def lower_bound_rows(lengths: list[int], capacity: int) -> int:
    """Martello and Toth's L2: no packing of items of ``lengths`` into bins of
    ``capacity`` without splitting one uses fewer bins. For each threshold a <= C/2:
    items > C - a each need a bin of their own, items in (C/2, C - a] too (no two
    share one), and the items in [a, C/2] fill at most the room those bins leave."""
    w = sorted(lengths)
    prefix = [0, *itertools.accumulate(w)]
    C, n = capacity, len(w)

    def count_sum(lo: int, hi: int) -> tuple[int, int]:  # items with lo <= w <= hi
        i, j = bisect.bisect_left(w, lo), bisect.bisect_right(w, hi)
        return j - i, prefix[j] - prefix[i]
    best = 0
    for a in sorted({0, *(x for x in w if x <= C // 2)}):
        big = n - bisect.bisect_right(w, C - a)  # w > C - a
        mid, mid_sum = count_sum(C // 2 + 1, C - a)
        _, small_sum = count_sum(a, C // 2)
        best = max(best, big + mid + max(0, math.ceil((small_sum - (mid * C - mid_sum)) / C)))
    return best


def _padding(real: int, rows: int, length: int) -> float:
    return 1 - real / (rows * length)


def measure(lengths: list[int], *, max_length: int, batch_size: int, pack_lengths, windows) -> list[dict]:
    """The report's rows (module docstring) for conversations of ``lengths`` tokens
    (already cut at ``max_length``), in file order."""
    from eagle3fn.io.packing import PACK_WINDOW, first_fit, plan_rows
    from eagle3fn.train.config import TrainConfig
    from eagle3fn.train.sources import packed_batches

    real = sum(lengths)
    shards = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    out = [{"pack_length": max_length, "rows_per_batch": batch_size, "method": "unpacked", "loop": "both",
            "rows": len(lengths), "padding_frac": padding_fraction(shards)}]
    for N in pack_lengths:
        per_batch = max(1, batch_size * max_length // N)

        def row(method, loop, rows, N=N, per_batch=per_batch, **extra):
            out.append({"pack_length": N, "rows_per_batch": per_batch, "method": method, "loop": loop,
                        "rows": rows, "padding_frac": _padding(real, rows, N), **extra})
        row("first-fit", "online", len(first_fit(lengths, N)))
        row("first-fit/shard", "offline", sum(len(first_fit(s, N)) for s in shards))
        for W in sorted({*windows, PACK_WINDOW}):
            row(f"bfd/{W}", "online", len(plan_rows(lengths, max_length, N, W)), window=W)
            cfg = TrainConfig(model="m", cache="c", max_length=max_length, pack_length=N, pack_window=W,
                              batch_size=per_batch)
            batches = packed_batches(shards, cfg, per_batch, N)
            opened = sum(len({i for r in batch for i, _ in r}) for batch in batches)
            row(f"bfd/{W}", "offline", sum(len(b) for b in batches), window=W, shards=opened / len(batches))
        row("bound", "any", lower_bound_rows(lengths, N))
    return out


def chat_examples(args) -> tuple[list, int]:
    """The benchmark's conversations (``args``: ``shape``, ``conversations``,
    ``profile``, ``seed``) tokenized as ``eagle3fn train`` reads them (cut at the shape's
    max length), and that max length."""
    from eagle3fn.io.data import tokenize_file

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "chat.jsonl"
        write_jsonl(path, sample_conversations(args.conversations, PROFILES[args.profile], vocab_size=shape.vocab,
                                               max_length=shape.max_length, length_scale=shape.length_scale,
                                               seed=args.seed))
        examples = tokenize_file(path, word_tokenizer(shape.vocab), max_length=shape.max_length)
    return examples, shape.max_length


def conversation_lengths(args: Args) -> tuple[list[int], int]:
    """Token counts of the benchmark's conversations (``chat_examples``) and the max length."""
    examples, max_length = chat_examples(args)
    return [len(e) for e in examples], max_length


def main(args: Args) -> dict:
    lengths, max_length = conversation_lengths(args)
    if args.pack_lengths == Args.pack_lengths and max_length != 2048:
        args = Args(**{**asdict(args), "pack_lengths": tuple(max_length * k for k in (1, 2, 4))})
    rows = measure(lengths, max_length=max_length, batch_size=args.batch_size, pack_lengths=args.pack_lengths,
                   windows=args.windows)
    data = {"conversations": len(lengths), "tokens": sum(lengths), "max_length": max_length,
            "mean_length": sum(lengths) / len(lengths), "cut_at_max_length": sum(L >= max_length for L in lengths)
            / len(lengths), "over_half_max_length": sum(2 * L > max_length for L in lengths) / len(lengths)}
    report = {**run_metadata(asdict(args)), "data": data, "results": rows}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"{data['conversations']} conversations, {data['tokens']} tokens, mean {data['mean_length']:.0f}, "
          f"{data['cut_at_max_length']:.0%} cut at {max_length}, {data['over_half_max_length']:.0%} over "
          f"{max_length // 2}")
    print(f"{'N':>6} {'rows/b':>6} {'method':<16} {'loop':<8} {'rows':>6} {'padding':>8} {'shards':>6}")
    for r in rows:
        shards = f"{r['shards']:.2f}" if "shards" in r else ""
        print(f"{r['pack_length']:>6} {r['rows_per_batch']:>6} {r['method']:<16} {r['loop']:<8} {r['rows']:>6} "
              f"{r['padding_frac']:>8.2%} {shards:>6}")
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
