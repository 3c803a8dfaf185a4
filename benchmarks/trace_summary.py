"""Where a profiled step's device time went, from its Chrome trace (CPU, seconds).

``benchmarks/train.py --profile-step K --trace-dir DIR`` writes step K of each run as
``DIR/<loop>-<mode>.trace.json.gz``. This reads one and reports, over the device's own
events (kernels, copies, memsets):

- ``span_ms``: first event's start to last event's end; ``busy_ms``: the sum of their
  durations; ``idle_ms``: the gaps between them longer than ``--gap-us`` (host time the
  device waited through), and how many;
- ``by_kind``: ms and count per kind of kernel, by name: ``gemm`` (cuBLAS / CUTLASS),
  ``sdpa`` (cuDNN / flash attention), ``flex`` (FlexAttention's Triton templates),
  ``triton`` (inductor's other kernels), ``copy`` (copies and casts), ``other``
  (eager elementwise, reductions, memsets);
- ``top``: the kernels with the most device time;
- ``host``: the top-level CPU operators (ATen ops and autograd nodes not nested in
  another) per thread, count and ms, under the profiler (which slows them).

With ``--split-ms T`` the device part is also reported for the events starting before
and after ``T`` ms from the first one (``before`` / ``after``): e.g. the online step's
target forward and the draft step that follows it, whose boundary the trace shows as
the host's gap between them.

    python benchmarks/trace_summary.py online-auto_pack.trace.json.gz --split-ms 248.9 \\
        --bench-json train-8b-profile.json --out trace-online.json
"""

from __future__ import annotations

import collections
import gzip
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import tyro

sys.path.insert(0, str(Path(__file__).parent))
from meta import run_metadata  # noqa: E402

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(kw_only=True)
class Args:
    trace: str
    """A ``.trace.json.gz`` (or ``.json``) written by ``--trace-dir``."""
    split_ms: float = 0.0
    """Also report the device events before and after this offset (ms from the first
    one); 0: no split."""
    gap_us: float = 50.0
    """Gaps between device events longer than this count as idle."""
    bench_json: str = ""
    """The benchmark JSON of the run that wrote the trace: its commit and dirty flag are
    recorded as ``source_commit`` / ``source_dirty`` ("" for none)."""
    top: int = 12
    """Kernels listed in ``top``."""
    out: str = "trace-summary.json"


def kind(name: str) -> str:
    """The kind of a device event, by its name (module docstring)."""
    if name.startswith("nvjet") or "gemm" in name or "cutlass" in name:
        return "gemm"
    if "cudnn" in name or "flash" in name or "fmha" in name:
        return "sdpa"
    if "flex_attention" in name:
        return "flex"
    if name.startswith("triton"):
        return "triton"
    if "Memcpy" in name or "copy" in name:
        return "copy"
    return "other"


def device_summary(events: list[dict], gap_us: float, top: int) -> dict:
    """span, busy, idle and per-kind time of device ``events`` (trace events, sorted by
    start), in ms."""
    if not events:
        return {"events": 0}
    start, end = events[0]["ts"], max(e["ts"] + e["dur"] for e in events)
    idle, gaps, reach = 0.0, 0, start
    for e in events:
        if e["ts"] - reach > gap_us:
            idle, gaps = idle + e["ts"] - reach, gaps + 1
        reach = max(reach, e["ts"] + e["dur"])
    by_kind, count, by_name, calls = (collections.Counter() for _ in range(4))
    for e in events:
        by_kind[kind(e["name"])] += e["dur"]
        count[kind(e["name"])] += 1
        by_name[e["name"][:100]] += e["dur"]
        calls[e["name"][:100]] += 1
    ms = lambda us: round(us / 1e3, 2)  # noqa: E731
    return {"events": len(events), "span_ms": ms(end - start), "busy_ms": ms(sum(e["dur"] for e in events)),
            "idle_ms": ms(idle), "idle_gaps": gaps,
            "by_kind": {k: {"ms": ms(v), "count": count[k]} for k, v in by_kind.most_common()},
            "top": [{"name": n, "ms": ms(v), "calls": calls[n]} for n, v in by_name.most_common(top)]}


def host_summary(events: list[dict]) -> list[dict]:
    """Top-level CPU operators per thread (not nested in another on that thread)."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e["tid"], e["ts"]))
    threads, reach = collections.defaultdict(lambda: [0, 0.0]), {}
    for e in ops:
        if e["ts"] >= reach.get(e["tid"], float("-inf")):
            threads[e["tid"]][0] += 1
            threads[e["tid"]][1] += e["dur"]
            reach[e["tid"]] = e["ts"] + e["dur"]
    return [{"thread": t, "top_level_ops": n, "ms": round(us / 1e3, 2)}
            for t, (n, us) in sorted(threads.items(), key=lambda kv: -kv[1][0])]


def summarise(trace: dict, *, split_ms: float = 0.0, gap_us: float = 50.0, top: int = 12) -> dict:
    """The summary of a Chrome trace (``{"traceEvents": [...]}``; module docstring)."""
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_EVENTS), key=lambda e: e["ts"])
    out = {**device_summary(device, gap_us, top), "host": host_summary(events)}
    if split_ms and device:
        cut = device[0]["ts"] + split_ms * 1e3
        out["before"] = device_summary([e for e in device if e["ts"] < cut], gap_us, top)
        out["after"] = device_summary([e for e in device if e["ts"] >= cut], gap_us, top)
    return out


def main(args: Args) -> dict:
    path = Path(args.trace)
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    summary = summarise(json.loads(raw), split_ms=args.split_ms, gap_us=args.gap_us, top=args.top)
    source = json.loads(Path(args.bench_json).read_text()) if args.bench_json else {}
    report = {**run_metadata(asdict(args)), "source_commit": source.get("commit", ""),
              "source_dirty": source.get("dirty", ""), **summary}
    Path(args.out).write_text(json.dumps(report, indent=1))
    parts = [("step", summary)] + [(p, summary[p]) for p in ("before", "after") if p in summary]
    for name, part in parts:
        kinds = ", ".join(f"{k} {v['ms']}" for k, v in part["by_kind"].items())
        print(f"{name}: span {part['span_ms']} ms, busy {part['busy_ms']}, idle {part['idle_ms']} "
              f"({part['idle_gaps']} gaps), {part['events']} events; {kinds}")
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
