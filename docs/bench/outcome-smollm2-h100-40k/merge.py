"""Merge three synthesized files into one training file whose last 64 are held out.

The held-out prompts are the same as the 20k runs': syn20k's last 64 first user turns.
syn10k, then the new file (synthesized with seed 2), each minus its conversations whose
first user turn nearly repeats a held-out prompt (MinHash near-duplicates, threshold 0.7,
the filter `eagle3fn synthesize` uses), then syn20k's 10,000 last, so the held-out rows
stay last and unseen. Usage: python merge.py NEW.jsonl[.gz] OUT.jsonl
"""
import gzip
import json
import sys
from pathlib import Path

from eagle3fn.synth.filters import NearDuplicates


def rows(path):
    with (gzip.open(path, "rt") if str(path).endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f]


here = Path(__file__).resolve().parent.parent
first = rows(here / "outcome-smollm2-h100-10k/syn10k.jsonl.gz")
new = rows(sys.argv[1])
last = rows(here / "outcome-smollm2-h100-20k/syn20k.jsonl.gz")
held = NearDuplicates(0.7)
for row in last[-64:]:
    held.add(row["messages"][0]["content"])
kept = []
for name, part in (("syn10k", first), ("new", new)):
    keep = [row for row in part if not held.seen(row["messages"][0]["content"])]
    print(f"{name}: {len(keep)} of {len(part)} kept ({len(part) - len(keep)} near the held-out prompts dropped)")
    kept += keep
with open(sys.argv[2], "w") as f:
    for row in kept + last:
        f.write(json.dumps(row) + "\n")
print(f"merged: {len(kept)} + syn20k's {len(last)} -> {sys.argv[2]} ({len(kept) + len(last)} conversations, the last 64 held out)")
