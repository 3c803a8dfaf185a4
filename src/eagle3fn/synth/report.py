"""The filter report of a synthesis output, counted from its files (so a resumed run
reports the whole output), written beside it as ``<out>.report.json`` and printed.

Fields:
    conversations        kept (lines of ``out``); ``asked``: how many were asked for
    tried                kept + dropped
    dropped              {reason: count} for every reason of ``filters.REASONS``
    fractions            {reason: count / tried}
    near_duplicate_fraction   (exact + near duplicates) / first user turns that reached
                         the duplicate check (passed the empty, truncated and request
                         checks): the share of the target's prompts that repeat an earlier one
    empty_or_broken_fraction  (empty or truncated user turns + empty answers) / tried
    truncated_answer_fraction  conversations with an answer cut by --max-new-tokens / tried
                         (dropped, or kept with --keep-truncated: ``truncated_answers_kept``,
                         marked ``"truncated": true`` in ``out``)
    generated_tokens, seconds, tokens_per_s   of this process (a resumed run counts its own)
    settings             the run's settings (as in ``<out>.meta.json``)
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3fn.synth.filters import REASONS
from eagle3fn.synth.store import sidecar


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def build_report(out: str, *, target: int, tokens: int, seconds: float, settings: dict, given: bool) -> dict:
    """The report of ``out`` (module docstring), written to ``<out>.report.json``."""
    out = Path(out)
    rows = _rows(out)
    kept, truncated_kept = len(rows), sum(1 for r in rows if r.get("truncated"))
    rejected = _rows(sidecar(out, ".rejected.jsonl"))
    dropped = {r: 0 for r in REASONS}
    for row in rejected:
        dropped[row["reason"]] += 1
    tried = kept + len(rejected)
    checked = kept + sum(dropped[r] for r in ("exact_duplicate", "near_duplicate", "empty_answer",
                                                "truncated_answer"))
    frac = lambda n, d: round(n / d, 6) if d else 0.0  # noqa: E731
    report = {
        "out": str(out), "asked": target, "conversations": kept, "tried": tried,
        "source": "given prompts" if given else "synthesized (Magpie)",
        "dropped": dropped, "fractions": {r: frac(n, tried) for r, n in dropped.items()},
        "near_duplicate_fraction": frac(dropped["exact_duplicate"] + dropped["near_duplicate"], checked),
        "empty_or_broken_fraction": frac(dropped["empty_prompt"] + dropped["truncated_prompt"]
                                         + dropped["empty_answer"], tried),
        "truncated_answer_fraction": frac(dropped["truncated_answer"] + truncated_kept, tried),
        "truncated_answers_kept": truncated_kept,
        "generated_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        "settings": settings,
    }
    path = sidecar(out, ".report.json")
    path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def format_report(report: dict) -> str:
    """The report as a few lines of text."""
    lines = [f"wrote {report['conversations']} of {report['asked']} conversations to {report['out']} "
             f"({report['tried']} tried, {report['source']})"]
    dropped = {r: n for r, n in report["dropped"].items() if n}
    if dropped:
        lines.append("dropped: " + ", ".join(f"{r} {n} ({100 * report['fractions'][r]:.1f}%)"
                                             for r, n in dropped.items()))
    else:
        lines.append("dropped: none")
    lines.append(f"near-duplicate prompts {100 * report['near_duplicate_fraction']:.2f}%, empty or broken "
                 f"{100 * report['empty_or_broken_fraction']:.2f}%, truncated answers "
                 f"{100 * report['truncated_answer_fraction']:.2f}% ({report['truncated_answers_kept']} kept)")
    lines.append(f"{report['generated_tokens']} tokens generated in {report['seconds']:.1f} s "
                 f"({report['tokens_per_s']:.0f} tok/s this run); report: {report['out']}.report.json")
    if report["conversations"] < report["asked"]:
        lines.append(f"only {report['conversations']} of {report['asked']} conversations were kept: the "
                     "filters dropped the rest (see the counts above and the .rejected.jsonl file)")
    return "\n".join(lines)
