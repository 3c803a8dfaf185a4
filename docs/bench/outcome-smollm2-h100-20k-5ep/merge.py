"""Merge the two synthesized files into one training file whose last 64 are held out.

syn10k first, minus its conversations whose first user turn nearly repeats one of
syn20k's last 64 (the held-out prompts; MinHash near-duplicates, threshold 0.7, the
filter `eagle3fn synthesize` uses), then syn20k's 10,000: the held-out prompts stay
unseen. Usage: python merge.py OUT.jsonl
"""
import gzip
import json
import sys
from pathlib import Path

from eagle3fn.synth.filters import NearDuplicates

here = Path(__file__).resolve().parent.parent
first = [json.loads(l) for l in gzip.open(here / "outcome-smollm2-h100-10k/syn10k.jsonl.gz", "rt")]
second = [json.loads(l) for l in gzip.open(here / "outcome-smollm2-h100-20k/syn20k.jsonl.gz", "rt")]
held = NearDuplicates(0.7)
for row in second[-64:]:
    held.add(row["messages"][0]["content"])
kept = [row for row in first if not held.seen(row["messages"][0]["content"])]
with open(sys.argv[1], "w") as f:
    for row in kept + second:
        f.write(json.dumps(row) + "\n")
print(f"merged: {len(kept)} of syn10k ({len(first) - len(kept)} near the held-out prompts dropped)"
      f" + {len(second)} new -> {sys.argv[1]} ({len(kept) + len(second)} conversations)")
