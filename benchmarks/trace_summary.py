"""Where a profiled step's device and host time went, from its Chrome trace (CPU, seconds).

``benchmarks/train.py --profile-steps K ... --trace-dir DIR`` writes step K of each run
as ``DIR/<loop>-<mode>-step<K>.trace.json.gz`` (``+`` in the mode written ``_``). This
reads one and reports, over the device's own events (kernels, copies, memsets):

- ``span_ms``: first event's start to last event's end; ``busy_ms``: the sum of their
  durations; ``idle_ms``: the gaps between them longer than ``--gap-us`` (host time the
  device waited through), and how many;
- ``by_kind``: ms and count per kind of kernel, by name: ``gemm`` (cuBLAS / CUTLASS),
  ``sdpa`` (cuDNN / flash attention), ``flex`` (FlexAttention's Triton templates),
  ``triton`` (inductor's other kernels), ``copy`` (copies and casts), ``other``
  (eager elementwise, reductions, memsets);
- ``top``: the kernels with the most device time;
- ``host``: the top-level CPU operators (ATen ops and autograd nodes not nested in
  another) per thread, count and ms, under the profiler (which slows them), and
  ``top``: that thread's top-level operators with the most time (name, count, ms);
- ``longest_host``: the longest single host events (CPU operators, annotations, CUDA
  runtime and driver calls, nested or not): name, thread, start (ms from the trace's
  first event) and ms: a one-off wait or a compilation stands out here;
- ``python`` (a trace of ``--profile-stacks``, torch.profiler's ``with_stack``): on
  the training thread (the one with the most Python calls), the Python
  functions (the ``name`` of the ``python_function`` events, ``file(line): function``)
  with the most inclusive time (``ms``: a recursive call is not counted twice inside
  itself), their self time (``self_ms``: minus the Python calls they made) and
  ``calls`` (the outer frames, the loop and the probe, lead the list: read on to the
  first that splits the time), ``top_self`` by self time, and per package
  (``torch/_dynamo``, ``torch/_inductor``, ``triton``, ``transformers``,
  ``eagle3fn``...; ``builtins``: C functions, ATen calls among them) ``by_package``
  (self ms, adding up to the thread's Python time) and ``by_package_inclusive`` (ms
  under the outermost call of the package: dynamo's whole share, what it called
  included). These answer where a compiling first step's seconds went.

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
import re
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
    """Kernels listed in ``top``; also the length of the host and longest-event lists."""
    python_top: int = 40
    """Python functions listed (``python``'s ``top`` and ``top_self``)."""
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


def _ms(us: float) -> float:
    return round(us / 1e3, 3)


def host_summary(events: list[dict], top: int = 12) -> list[dict]:
    """Top-level CPU operators per thread (not nested in another on that thread): how
    many, their ms, and ``top``: the names with the most ms (count, ms), most threads'
    ops first."""
    ops = sorted((e for e in events if e.get("cat") == "cpu_op" and e.get("ph") == "X"),
                 key=lambda e: (e["tid"], e["ts"]))
    threads, reach = collections.defaultdict(lambda: [0, 0.0]), {}
    names = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0.0]))
    for e in ops:
        if e["ts"] >= reach.get(e["tid"], float("-inf")):
            threads[e["tid"]][0] += 1
            threads[e["tid"]][1] += e["dur"]
            reach[e["tid"]] = e["ts"] + e["dur"]
            names[e["tid"]][e["name"][:100]][0] += 1
            names[e["tid"]][e["name"][:100]][1] += e["dur"]
    return [{"thread": t, "top_level_ops": n, "ms": round(us / 1e3, 2),
             "top": [{"name": k, "count": c, "ms": _ms(d)}
                     for k, (c, d) in sorted(names[t].items(), key=lambda kv: -kv[1][1])[:top]]}
            for t, (n, us) in sorted(threads.items(), key=lambda kv: -kv[1][0])]


HOST_EVENTS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
"""Trace categories of the host's own events (``longest_host``; Python calls apart)."""


def longest_host(events: list[dict], top: int = 12) -> list[dict]:
    """The ``top`` longest single host events (``HOST_EVENTS``, nested ones too): name,
    thread, start in ms from the trace's first event, ms."""
    t0 = min((e["ts"] for e in events if "ts" in e and e.get("ph") == "X"), default=0.0)
    host = [e for e in events if e.get("cat") in HOST_EVENTS and e.get("ph") == "X"]
    return [{"name": e["name"][:120], "thread": e["tid"], "start_ms": _ms(e["ts"] - t0), "ms": _ms(e["dur"])}
            for e in sorted(host, key=lambda e: -e["dur"])[:top]]


def host_self(events: list[dict]) -> dict[str, list]:
    """``{name: [count, self us]}`` of host ``events`` (``ph`` "X"): each event's
    duration minus those of the events nested directly in it on its thread."""
    out = collections.defaultdict(lambda: [0, 0.0])
    stack: list[list] = []  # [end, name, self us] of the open events of the thread
    thread = None

    def close(entry):
        out[entry[1]][1] += entry[2]

    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: (e["tid"], e["ts"], -e["dur"])):
        if e["tid"] != thread:
            while stack:
                close(stack.pop())
            thread = e["tid"]
        while stack and stack[-1][0] <= e["ts"]:
            close(stack.pop())
        if stack:
            stack[-1][2] -= e["dur"]
        out[e["name"]][0] += 1
        stack.append([e["ts"] + e["dur"], e["name"], e["dur"]])
    while stack:
        close(stack.pop())
    return dict(out)


PACKAGES = ("torch/_dynamo", "torch/_inductor", "torch/_functorch", "torch/fx", "torch/_subclasses",
            "torch/utils/_sympy", "torch/profiler", "torch/autograd", "torch", "triton", "transformers",
            "eagle3fn", "sympy", "importlib")
"""Packages ``python_summary`` adds up, most specific first (matched on the event name)."""


def package(name: str) -> str:
    """The package of a ``python_function`` event's name (``PACKAGES``; ``other``,
    or ``builtins`` for a C function such as ``<built-in method ...>``)."""
    if name.startswith("<built-in") or name.startswith("<method"):
        return "builtins"
    where = name.split("(", 1)[0]
    for p in PACKAGES:
        if f"/{p}/" in f"/{where}" or where.startswith(f"<frozen {p}"):
            return p
    return "other"


ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
"""An object's address in a C function's name (``<built-in method mm of ... at 0x7f...>``),
dropped so that calls on different objects add up."""


def python_summary(events: list[dict], top: int = 40) -> dict | None:
    """The Python calls of the training thread (the thread with the most
    ``python_function`` events: a reader or monitor thread makes few, long ones) of a
    ``with_stack`` trace, or None without any: ``calls``, ``ms`` (its top-level calls'
    time), the ``top`` functions by inclusive ms (with self ms and calls), ``top_self``
    by self ms, ``by_package`` (self ms per package: they add up to ``ms``) and
    ``by_package_inclusive`` (ms under the outermost call of each package)."""
    calls = sorted(({**e, "name": ADDRESS.sub("", e["name"])} for e in events
                    if e.get("cat") == "python_function" and e.get("ph") == "X"),
                   key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    if not calls:
        return None
    thread = collections.Counter(e["tid"] for e in calls).most_common(1)[0][0]
    outer, reach = 0.0, float("-inf")
    inclusive, own, count, by_package, package_self = (collections.Counter() for _ in range(5))
    stack: list[tuple[float, str, str, list]] = []  # (end, name, package, [self us]) of the open calls
    for e in (e for e in calls if e["tid"] == thread):
        if e["ts"] >= reach:
            outer, reach = outer + e["dur"], e["ts"] + e["dur"]
        while stack and stack[-1][0] <= e["ts"]:
            _, name, pkg, rest = stack.pop()
            own[name] += rest[0]
            package_self[pkg] += rest[0]
        if stack:
            stack[-1][3][0] -= e["dur"]
        open_names = {s[1] for s in stack}
        pkg = package(e["name"])
        if e["name"] not in open_names:
            inclusive[e["name"]] += e["dur"]
        if pkg not in {s[2] for s in stack}:
            by_package[pkg] += e["dur"]
        count[e["name"]] += 1
        stack.append((e["ts"] + e["dur"], e["name"], pkg, [e["dur"]]))
    for _, name, pkg, rest in stack:
        own[name] += rest[0]
        package_self[pkg] += rest[0]
    return {"thread": thread, "calls": sum(count.values()), "ms": _ms(outer),
            "top": [{"name": n[:160], "ms": _ms(v), "self_ms": _ms(own[n]), "calls": count[n]}
                    for n, v in inclusive.most_common(top)],
            "top_self": [{"name": n[:160], "self_ms": _ms(v), "calls": count[n]} for n, v in own.most_common(top)],
            "by_package": {p: _ms(v) for p, v in package_self.most_common()},
            "by_package_inclusive": {p: _ms(v) for p, v in by_package.most_common()}}


def summarise(trace: dict, *, split_ms: float = 0.0, gap_us: float = 50.0, top: int = 12,
              python_top: int = 40) -> dict:
    """The summary of a Chrome trace (``{"traceEvents": [...]}``; module docstring)."""
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_EVENTS), key=lambda e: e["ts"])
    out = {**device_summary(device, gap_us, top), "host": host_summary(events, top),
           "longest_host": longest_host(events, top)}
    python = python_summary(events, python_top)
    if python is not None:
        out["python"] = python
    if split_ms and device:
        cut = device[0]["ts"] + split_ms * 1e3
        out["before"] = device_summary([e for e in device if e["ts"] < cut], gap_us, top)
        out["after"] = device_summary([e for e in device if e["ts"] >= cut], gap_us, top)
    return out


def main(args: Args) -> dict:
    path = Path(args.trace)
    raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    summary = summarise(json.loads(raw), split_ms=args.split_ms, gap_us=args.gap_us, top=args.top,
                        python_top=args.python_top)
    source = json.loads(Path(args.bench_json).read_text()) if args.bench_json else {}
    report = {**run_metadata(asdict(args)), "source_commit": source.get("commit", ""),
              "source_dirty": source.get("dirty", ""), **summary}
    Path(args.out).write_text(json.dumps(report, indent=1))
    parts = [("step", summary)] + [(p, summary[p]) for p in ("before", "after") if p in summary]
    for name, part in parts:
        if not part["events"]:
            print(f"{name}: no device events (a CPU trace)")
            continue
        kinds = ", ".join(f"{k} {v['ms']}" for k, v in part["by_kind"].items())
        print(f"{name}: span {part['span_ms']} ms, busy {part['busy_ms']}, idle {part['idle_ms']} "
              f"({part['idle_gaps']} gaps), {part['events']} events; {kinds}")
    for t in summary["host"]:
        tops = "; ".join(f"{o['name']} {o['ms']} ms x{o['count']}" for o in t["top"][:5])
        print(f"host thread {t['thread']}: {t['top_level_ops']} top-level ops, {t['ms']} ms: {tops}")
    print("longest host events: " + "; ".join(f"{e['name']} {e['ms']} ms" for e in summary["longest_host"][:5]))
    if "python" in summary:
        py = summary["python"]
        print(f"python (thread {py['thread']}, {py['ms']} ms, {py['calls']} calls); self ms by package: "
              + ", ".join(f"{k} {v}" for k, v in list(py["by_package"].items())[:8]))
        for f in py["top_self"][:10]:
            print(f"  {f['self_ms']:>10} ms self x{f['calls']:<6} {f['name']}")
    return report


if __name__ == "__main__":
    main(tyro.cli(Args))
