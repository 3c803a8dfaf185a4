"""Bytes per real token of an offline feature cache on the end-to-end benchmark's
realistic chat set (``train_data.sample_conversations``, ``prompt-heavy`` by default:
30-40% supervised), for four layouts of the same conversations and shards:

- ``format2``: eagle3fn's padded layout before format 3 (``[B, S]`` shards, aux and
  final hidden at every padded position, bf16);
- ``format3_bf16``: format 3, exact (aux at real tokens, final hidden at teacher
  positions, bf16);
- ``format3_fp8``: format 3 with ``--aux-dtype float8_e4m3``;
- ``specforge``: SpecForge 0.2.0's offline hidden-state files (one ``torch.save`` per
  conversation, the keys its ``OfflineManifestReader`` reads: ``input_ids`` and
  ``loss_mask`` int64 ``[L]``, ``hidden_state [1, L, Ht]`` and ``aux_hidden_state [1, L,
  3*Ht]`` in the target's bf16, as its ``scripts/prepare_hidden_states.py`` saves them).

Format 2 and 3 sizes come from ``io.cache.estimate`` (the layout maths CI checks against
written caches); the run also writes the first ``--check-shards`` shards for real with
``write_cache`` at ``--check-hidden`` (random features) and records estimate vs file
bytes. SpecForge's per-file overhead (zip container, pickle) is measured by saving its
dicts for real at ``--check-hidden`` and added to the payload at the target's width.

    python benchmarks/cache_size.py --out cache-size.json
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import tyro

sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402
from train_data import PROFILES, DataArgs, sample_conversations, write_jsonl  # noqa: E402
from train_target import SHAPES, word_tokenizer  # noqa: E402


@dataclass(kw_only=True)
class Args(DataArgs):
    check_shards: int = 8
    """Shards written for real to check the estimate against files."""
    check_hidden: int = 64
    """Hidden size of those check writes."""
    out: str = "cache-size.json"


def specforge_file_bytes(lengths: list[int], hidden: int, tmp: Path) -> list[int]:
    """Sizes of SpecForge 0.2.0 offline files for conversations of ``lengths`` at ``hidden``,
    written with ``torch.save`` as its prepare script does."""
    sizes = []
    for i, L in enumerate(lengths):
        point = {"input_ids": torch.zeros(L, dtype=torch.long), "loss_mask": torch.zeros(L, dtype=torch.long),
                 "hidden_state": torch.zeros(1, L, hidden, dtype=torch.bfloat16),
                 "aux_hidden_state": torch.zeros(1, L, 3 * hidden, dtype=torch.bfloat16)}
        path = tmp / f"data_{i}.ckpt"
        torch.save(point, path)
        sizes.append(path.stat().st_size)
        path.unlink()
    return sizes


def specforge_payload(L: int, hidden: int) -> int:
    return L * (8 + 8) + L * 4 * hidden * 2


def check_estimate(groups, hidden: int, tmp: Path) -> dict:
    """Write ``groups`` with ``write_cache`` (random bf16 features at ``hidden``) and
    compare the files with ``estimate``."""
    from eagle3fn.io.batching import collate
    from eagle3fn.io.cache import estimate, measured_bytes, write_cache
    from eagle3fn.shapes import Features

    g = torch.Generator().manual_seed(0)
    head = torch.randn(1024, hidden, generator=g)

    def features(batch):
        B, S = batch["input_ids"].shape
        return Features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        aux=torch.randn(B, S, 3 * hidden, generator=g), final_hidden=torch.randn(B, S, hidden, generator=g),
                        target_head=head)
    out = {}
    for aux_dtype in ("storage", "float8_e4m3"):
        d = tmp / aux_dtype
        manifest = write_cache(d, (collate(x, 0) for x in groups), features, fingerprint={}, aux_dtype=aux_dtype,
                               log=lambda s: None)
        est = estimate(groups, hidden, 1024, aux_dtype=aux_dtype)["bytes"]
        got = measured_bytes(d, manifest)
        out[aux_dtype] = {"estimate": est, "files": got, "rel": (est - got) / got}
    return out


def main(args: Args) -> None:
    from eagle3fn.io.batching import batches
    from eagle3fn.io.cache import estimate
    from eagle3fn.io.data import tokenize_file

    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = sample_conversations(args.conversations, PROFILES[args.profile], vocab_size=shape.vocab,
                                    max_length=shape.max_length, length_scale=shape.length_scale, seed=args.seed)
        write_jsonl(tmp / "chat.jsonl", rows)
        examples = tokenize_file(tmp / "chat.jsonl", word_tokenizer(shape.vocab), max_length=shape.max_length)
        groups = list(batches(examples, batch_size=args.batch_size, seed=0, shuffle=False))
        checked = check_estimate(groups[:args.check_shards], args.check_hidden, tmp)
        lengths = [len(e) for e in examples]
        sf_small = specforge_file_bytes(lengths, args.check_hidden, tmp)
    tokens = sum(lengths)
    supervised = sum(int(e.loss_mask.sum()) for e in examples)
    bf16 = estimate(groups, shape.hidden, shape.vocab)
    fp8 = estimate(groups, shape.hidden, shape.vocab, aux_dtype="float8_e4m3")
    sf_overhead = sum(s - specforge_payload(L, args.check_hidden) for s, L in zip(sf_small, lengths))
    sf = sum(specforge_payload(L, shape.hidden) for L in lengths) + sf_overhead
    head = bf16["bytes"] - estimate(groups, shape.hidden, 0)["bytes"]  # eagle3fn's head.safetensors
    per = {"format2": bf16["padded_bytes"] / tokens, "format3_bf16": bf16["bytes"] / tokens,
           "format3_fp8": fp8["bytes"] / tokens, "specforge": sf / tokens}
    # SpecForge keeps no lm_head copy (its trainer loads the target's): compare without it too.
    no_head = {k: v - (0 if k == "specforge" else head / tokens) for k, v in per.items()}
    ratios = {k: v / per["format2"] for k, v in per.items()}
    result = {"tokens": tokens, "conversations": len(examples), "shards": len(groups),
              "supervised_share": supervised / tokens, "hidden": shape.hidden, "vocab": shape.vocab,
              "bytes_per_token": per, "vs_format2": ratios,
              "vs_specforge": {k: v / per["specforge"] for k, v in per.items()},
              "bytes_per_token_without_head": no_head,
              "vs_format2_without_head": {k: v / no_head["format2"] for k, v in no_head.items()},
              "vs_specforge_without_head": {k: v / no_head["specforge"] for k, v in no_head.items()},
              "head_bytes": head, "specforge_overhead_per_file": sf_overhead / len(lengths),
              "estimate_check": checked}
    Path(args.out).write_text(json.dumps({**run_metadata(asdict(args)), "results": result}, indent=1))
    print(f"{len(examples)} conversations, {tokens} tokens, {supervised / tokens:.1%} supervised, "
          f"Ht {shape.hidden}, shards of {args.batch_size}")
    for k, v in per.items():
        w = no_head[k]
        print(f"{k:<13} {v:10.1f} bytes/token  {ratios[k]:.3f}x format2  {v / per['specforge']:.3f}x specforge"
              f"  | without the head {w:10.1f}  {w / no_head['format2']:.3f}x  {w / no_head['specforge']:.3f}x")
    for k, c in checked.items():
        print(f"estimate check ({k}, Ht {args.check_hidden}): {c['estimate']} vs {c['files']} bytes "
              f"({c['rel']:+.3%})")


if __name__ == "__main__":
    main(tyro.cli(Args))
