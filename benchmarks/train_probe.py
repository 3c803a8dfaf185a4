"""benchmarks/train.py's measurements: the FLOP floor of a step (``step_flops``) and
the matmul ceiling, the recompile counter, the per-step observer that runs an
``eagle3fn`` command in a subprocess (``probe``, ``run_eagle3fn``) with what it can
run inside: the first steps' phase clock (``PhaseClock``) and Python stack sampler
(``StackSampler``), torch.profiler (``profiled``) and CUDA's sync debug mode
(``sync_sites``); the nvidia-smi sampler, the compile lines of a run's log
(``compile_log``), the summary of a run's step records (``summarise``) and what the
JSON says of each measure (``METHODS``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from train_target import Shape

from eagle3fn.compiled import RecompileCounter  # noqa: F401 - the probe's counter, also train.py's

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent


# ---------------------------------------------------------------------------- FLOP floor


def _pairs(length: int, window: int | None) -> int:
    """(query, key) pairs of causal attention over ``length`` tokens (with a window)."""
    if window is None or length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def step_flops(shape: Shape, batch: list, *, ttt_length: int, online: bool) -> tuple[float, float]:
    """``(dense, trimmed)`` FLOPs of one training step on ``batch`` (examples), counted
    on real tokens only (BENCH.md's per-token terms; attention fwd 4 * heads * head_dim
    per query-key pair, fwd+bwd 3x for matmuls, 3.5x for attention, the fc projection
    2x as its input needs no gradient). ``online`` adds the target forward without its
    head. Trimmed: teacher, head and loss at the supervised rows only, step 0's keys
    and values for every row, the rest of the layer at the supervised rows."""
    from eagle3fn.align import supervised_mask

    H, k = shape.hidden, ttt_length
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    kv_proj = 2 * 2 * (2 * H) * kv           # k and v of the draft layer (input 2H), per row
    layer = 2 * ((2 * H) * q + q * H + 3 * H * shape.intermediate) + kv_proj
    head = 2 * H * shape.draft_vocab
    teacher = 2 * H * shape.vocab
    fc = 2 * (3 * H) * H * 2
    attn = 4 * q * 3.5
    dense = trimmed = 0.0
    for e in batch:
        L = len(e)
        sup = supervised_mask(e.loss_mask[None])[0].nonzero().flatten()
        M, sup_pairs = int(sup.numel()), int((sup + 1).sum())
        if online:
            target = 2 * shape.layers * shape.layer_params * L + sum(
                4 * q * _pairs(L, None if shape.is_global(i) else shape.sliding_window)
                for i in range(shape.layers))
            dense += target
            trimmed += target
        dense += teacher * L + fc * L + k * 3 * (layer + head) * L + sum(
            attn * (_pairs(L, None) + j * L) for j in range(k))
        trimmed += (teacher * M + fc * L + 3 * kv_proj * L + k * 3 * (layer - kv_proj + head) * M
                    + (k - 1) * 3 * kv_proj * M + sum(attn * (sup_pairs + j * M) for j in range(k)))
    return dense, trimmed


def matmul_tflops(device: str) -> float:
    """The bf16 8192^3 matmul rate on CUDA (BENCH.md's ceiling); an fp32 1024^3 one on
    the CPU (only so that the floors exist there)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        a @ a
    sync()
    t = time.perf_counter()
    iters = 10 if cuda else 3
    for _ in range(iters):
        a @ a
    sync()
    return iters * 2 * n**3 / (time.perf_counter() - t) / 1e12


# ---------------------------------------------------------------------------- measuring


def _step_record(t_start: float, tokens: int, padded: int, recompiles: RecompileCounter, **extra) -> dict:
    """One step's record after a device sync: wall times (epoch s), tokens, compile
    counters and the allocator's peak since the last record (then reset)."""
    import torch

    row = {"t_start": t_start, "tokens": tokens, "padded": padded, "recompiles": recompiles.count,
           "limit_hits": recompiles.limit_hits, "graphs": recompiles.graphs(), **extra}
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        row.update(peak=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()
    row["t_end"] = time.time()
    return row


def probe(record_path: str, argv: list[str]) -> None:
    """Run ``eagle3fn.cli.main.main(argv)``, as ``python -m eagle3fn.cli`` does, and
    write to ``record_path`` per optimizer step what ``_step_record`` records, plus the
    padded tokens of its micro-batches (``train.step.micro_batch``) and the seconds the
    training thread waited on input (``load_s``: what the source's ``take_wait`` hands
    the loop right after the step, the offline prefetcher's wait; 0 online). Observes
    only: the loop's functions are wrapped, not changed.

    Its settings come from the environment (``probe_env`` / ``probe_settings``): the
    steps run under torch.profiler (``profiles``: one ``profiled`` summary each, with
    the ``sync_sites`` of the step before it, its logging included, when that one
    exists and is not profiled too), with Python stacks or not, where their traces go,
    and how many first steps are timed phase by phase (``first_steps``:
    ``PhaseClock``'s records), their Python stack sampled (``StackSampler``) every
    ``sample_ms``."""
    import torch

    from eagle3fn.cli import main as cli
    from eagle3fn.train import loop, sources, step

    settings = probe_settings(os.environ)
    recompiles = RecompileCounter()
    record = {"steps": [], "t_probe": time.time(), "profiles": [], "first_steps": []}
    acc = {"padded": 0}
    clock = PhaseClock()
    real_micro_batch, real_step, real_ttt = step.micro_batch, loop.optimizer_step, step.ttt
    real_backward = torch.Tensor.backward
    real_waits = {cls: cls.take_wait for cls in (sources.Source, sources.PrefetchSource)}
    timed_batch = clock.timed("batch_s", real_micro_batch)
    sites_before: dict[int, list] = {}

    def micro_batch(*args, **kwargs):
        out = timed_batch(*args, **kwargs)
        acc["padded"] += out[1].attention_mask.numel()
        return out

    def waited(real):
        def take_wait(self):
            seconds = real(self)
            if record["steps"]:  # the loop takes the wait right after the step it belongs to
                record["steps"][-1]["load_s"] += seconds
            return seconds
        return take_wait

    def optimizer_step(run, order, **kwargs):
        if not record["steps"]:
            clock.watch_optimizer(run.opt)
            if torch.cuda.is_initialized():
                record["before_first_step"] = {"peak": torch.cuda.max_memory_allocated(),
                                               "reserved": torch.cuda.max_memory_reserved(),
                                               "recompiles": recompiles.count, "graphs": recompiles.graphs()}
                torch.cuda.reset_peak_memory_stats()
        acc.update(padded=0)
        k = len(record["steps"]) + 1
        t = time.time()
        timed = k <= settings["first_steps"]
        sampler = (StackSampler(threading.get_ident(), settings["sample_ms"] / 1e3).start()
                   if timed and settings["sample_ms"] > 0 else None)
        clock.start(timed)
        if k in settings["profile_steps"]:
            trace = settings["trace"].format(step=k) if settings["trace"] else None
            result, summary = profiled(lambda: real_step(run, order, **kwargs), trace=trace,
                                       stacks=settings["stacks"])
            record["profiles"].append({"step": k, **summary, "stacks": settings["stacks"],
                                       "sync_sites": sites_before.pop(k - 1, None)})
        elif k + 1 in settings["profile_steps"]:  # the step before a profiled one: where the host waits
            result, sites_before[k] = sync_sites(lambda: real_step(run, order, **kwargs))
        else:
            result = real_step(run, order, **kwargs)
        phases = clock.stop()
        if sampler is not None:
            sampler.stop()
            phases["python"] = sampler.summary()
        record["steps"].append(_step_record(t, result.tokens, acc["padded"], recompiles, load_s=0.0))
        if phases is not None:
            record["first_steps"].append({"step": k, **phases})
        return result

    real_log_step = loop._log_step

    def log_step(*args, **kwargs):  # a sync-watched step's logging is watched too
        k = len(record["steps"])
        if k not in sites_before:
            return real_log_step(*args, **kwargs)
        out, sites = sync_sites(lambda: real_log_step(*args, **kwargs))
        sites_before[k] += [{**site, "site": f"(logging) {site['site']}"} for site in sites]
        return out

    step.micro_batch, loop.optimizer_step, loop._log_step = micro_batch, optimizer_step, log_step
    step.ttt = clock.timed("forward_s", real_ttt)
    torch.Tensor.backward = clock.timed("backward_s", real_backward)
    for cls, real in real_waits.items():
        cls.take_wait = waited(real)
    try:
        cli.main(argv)
    finally:
        torch.Tensor.backward = real_backward
        record["recompile_examples"] = recompiles.examples
        record["compile_profile"] = compile_profile()
        Path(record_path).write_text(json.dumps(record))


#: environment variable: the optimizer steps (1-based, comma-separated) ``probe`` runs under torch.profiler
PROFILE_STEP_ENV = "EAGLE3FN_PROBE_PROFILE_STEP"
#: environment variable: where ``probe`` writes each profiled step's Chrome trace (.json.gz), ``{step}``
#: standing for the step ("" for none)
TRACE_ENV = "EAGLE3FN_PROBE_TRACE"
#: environment variable: "1" records Python stacks in the profiled steps (torch.profiler's ``with_stack``)
STACKS_ENV = "EAGLE3FN_PROBE_STACKS"
#: environment variable: how many first optimizer steps ``probe`` times phase by phase (``PhaseClock``)
FIRST_STEPS_ENV = "EAGLE3FN_PROBE_FIRST_STEPS"
#: environment variable: ms between samples of the Python stack in those steps (``StackSampler``; 0: none)
SAMPLE_ENV = "EAGLE3FN_PROBE_SAMPLE_MS"
#: CPU-side calls that launch a device kernel (CUDA runtime and driver APIs)
LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                "cudaGraphLaunch", "cudaMemcpyAsync", "cudaMemsetAsync")


def probe_env(*, profile_steps=(), trace: str = "", stacks: bool = False, first_steps: int = 0,
              sample_ms: float = 0.0) -> dict[str, str]:
    """The environment variables that hand ``probe`` its settings (``probe_settings``
    reads them back): ``profile_steps`` (1-based steps), ``trace`` (a path holding
    ``{step}``, or "" for no traces), ``stacks``, ``first_steps``, ``sample_ms``."""
    if trace and "{step}" not in trace:
        raise ValueError(f"trace path {trace!r} has no '{{step}}': each profiled step needs its own file")
    return {PROFILE_STEP_ENV: ",".join(str(k) for k in sorted(set(profile_steps))), TRACE_ENV: trace,
            STACKS_ENV: "1" if stacks else "0", FIRST_STEPS_ENV: str(first_steps), SAMPLE_ENV: str(sample_ms)}


def probe_settings(env) -> dict:
    """``probe``'s settings from the environment ``env`` (``probe_env``'s variables;
    absent: nothing profiled, no phase timing): ``{"profile_steps": set of steps,
    "trace": str, "stacks": bool, "first_steps": int, "sample_ms": float}``."""
    steps = env.get(PROFILE_STEP_ENV, "").replace(" ", ",")
    return {"profile_steps": {int(k) for k in steps.split(",") if k.strip() and int(k) > 0},
            "trace": env.get(TRACE_ENV, ""), "stacks": env.get(STACKS_ENV, "0") == "1",
            "first_steps": int(env.get(FIRST_STEPS_ENV) or 0), "sample_ms": float(env.get(SAMPLE_ENV) or 0)}


def _sync() -> None:
    """Wait for the device (nothing to wait for without a CUDA context)."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


class PhaseClock:
    """Wall seconds of the phases of an optimizer step, each started and ended by a
    device sync, summed over the step's micro-batches: ``batch_s``
    (``train.step.micro_batch``: the source's load, online the target's forward, and
    the row map), ``forward_s`` (the draft's ``eagle3fn.unrolled.ttt``), ``backward_s``
    (``Tensor.backward``), ``optimizer_s`` (the optimizer's ``step``, between its step
    hooks). ``start(on)`` begins a step (timed only when ``on``); ``stop()`` ends it
    after a sync and returns ``{wall_s, micro_batches, batch_s, forward_s,
    backward_s, optimizer_s, rest_s}`` (``rest_s``: the step's wall time in none of
    the phases: gradient clipping, the finiteness read, zero_grad, a profiler's own
    work) or None for an untimed step. A phase entered inside another is part of the
    outer one, not timed again."""

    PHASES = ("batch_s", "forward_s", "backward_s", "optimizer_s")

    def __init__(self) -> None:
        self.current: dict | None = None
        self.inside = False
        self.t0 = 0.0
        self.batches = 0

    def start(self, on: bool) -> None:
        self.current = dict.fromkeys(self.PHASES, 0.0) if on else None
        self.batches, self.inside = 0, False
        self.t0 = time.perf_counter()

    def stop(self) -> dict | None:
        if self.current is None:
            return None
        _sync()
        wall = time.perf_counter() - self.t0
        phases, self.current = self.current, None
        return {"wall_s": wall, "micro_batches": self.batches, **phases, "rest_s": wall - sum(phases.values())}

    def enter(self) -> float | None:
        """The start of a phase (after a sync), or None when it is not timed."""
        if self.current is None or self.inside:
            return None
        _sync()
        self.inside = True
        return time.perf_counter()

    def leave(self, phase: str, t: float) -> None:
        """The end of ``phase`` started at ``t`` (``enter``), after a sync."""
        _sync()
        self.current[phase] += time.perf_counter() - t
        self.inside = False
        self.batches += phase == "batch_s"

    def timed(self, phase: str, fn):
        """``fn``, timed as ``phase`` while a timed step runs (as it was otherwise)."""
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t = self.enter()
            if t is None:
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave(phase, t)
        return wrapper

    def watch_optimizer(self, opt) -> None:
        """Time ``opt.step`` as ``optimizer_s`` (torch.optim's step pre- and post-hooks)."""
        started: list = [None]

        def pre(*_):
            started[0] = self.enter()

        def post(*_):
            if started[0] is not None:
                self.leave("optimizer_s", started[0])
                started[0] = None

        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)


def profiled(fn, top: int = 12, trace: str | None = None, stacks: bool = False) -> tuple[object, dict]:
    """``fn()`` under torch.profiler (CPU, and CUDA when available), synchronised at both
    ends: ``(its result, summary)``. The summary says where one step's wall time goes:
    ``wall_ms``; ``device_ms``, the sum of the device's self times (kernels and copies;
    0 on a CPU) and ``device_frac = device_ms / wall_ms``, the busy fraction nvidia-smi
    estimates; ``launches`` (kernel launches, graph launches, async copies and memsets
    from the host); ``aten_ops`` (ATen operator calls, nested ones included); and the
    ``top`` events by self device time and by self CPU time (name, calls, ms). With
    ``trace`` (a path ending in .json.gz), the step's timeline is also written there as
    a gzipped Chrome trace. With ``stacks``, torch.profiler's ``with_stack``: the trace
    also holds every Python call (``python_function`` events: which functions of
    dynamo, inductor, triton, transformers or eagle3fn the host time went to;
    ``trace_summary.python_summary``); this slows Python-heavy steps tens of times (a
    compiling first step: ``StackSampler`` is the cheap view) and makes their traces
    GBs."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    with _code_kept(stacks), profile(activities=activities, with_stack=stacks) as prof:
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall_ms = 1e3 * (time.perf_counter() - t)
    # the summary is read from the exported trace: prof.key_averages() parses the
    # same events in Python, seconds for a step's tens of thousands
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        events = json.loads(plain.read_bytes().decode(errors="replace"))["traceEvents"]
        if trace:
            with open(plain, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return result, {"wall_ms": round(wall_ms, 2), **trace_step_summary(events, wall_ms, top)}


def trace_step_summary(events: list[dict], wall_ms: float, top: int = 12) -> dict:
    """``profiled``'s summary of a step's Chrome trace ``events``: ``device_ms`` (the
    device's own events: kernels, copies, memsets) and ``device_frac`` (of
    ``wall_ms``), ``launches`` (``LAUNCH_CALLS``), ``aten_ops`` (every ``aten::`` CPU
    operator, nested ones included), ``top_self_device`` (device events by name) and
    ``top_self_cpu`` (host events by name, by self time: minus the host events nested
    in them; ``trace_summary.host_self``)."""
    from trace_summary import DEVICE_EVENTS, HOST_EVENTS, host_self

    device = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") in DEVICE_EVENTS:
            device[e["name"]][0] += 1
            device[e["name"]][1] += e["dur"]
    device_ms = sum(us for _, us in device.values()) / 1e3

    def rows(table):
        ranked = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
        return [{"name": k[:120], "calls": n, "ms": round(us / 1e3, 3)} for k, (n, us) in ranked if us > 0]
    host = [e for e in events if e.get("cat") in HOST_EVENTS]
    return {"device_ms": round(device_ms, 2), "device_frac": round(device_ms / wall_ms, 4) if wall_ms else None,
            "launches": sum(e["name"] in LAUNCH_CALLS for e in host),
            "aten_ops": sum(e.get("cat") == "cpu_op" and e["name"].startswith("aten::") for e in host),
            "top_self_device": rows(device), "top_self_cpu": rows(host_self(host))}


class StackSampler:
    """The Python stack of one thread, sampled every ``period_s`` by a background
    thread while ``running`` (``start`` / ``stop``), each sample weighted by the wall
    time since the previous one: where a step's host seconds go, at a cost of about
    one stack walk per period (torch.profiler's ``with_stack`` records every Python
    call instead: it slows a compiling step tens of times and its trace takes GBs).
    ``summary(top)``: ``{"s", "samples", "by_package": self s per package (the
    innermost frame's; ``trace_summary.package``), "by_package_inclusive": s with the
    package anywhere on the stack, "top": the functions with the most inclusive s
    (with ``self_s``), "top_self"}``, functions named ``file(first line): name`` as in
    torch.profiler's traces. A sample waits for the GIL: a stretch of C code that holds
    it delays the sample, whose weight then goes to the frame running when it is taken
    (PyTorch's ops and device syncs release it)."""

    def __init__(self, thread_id: int, period_s: float = 0.005) -> None:
        self.thread_id, self.period_s = thread_id, period_s
        self.names: dict = {}
        self.inclusive, self.own = collections.Counter(), collections.Counter()
        self.pkg_inclusive, self.pkg_own = collections.Counter(), collections.Counter()
        self.samples, self.seconds = 0, 0.0
        self.thread: threading.Thread | None = None
        self.done = threading.Event()

    def _name(self, code) -> tuple[str, str]:
        if code not in self.names:
            from trace_summary import package

            name = f"{_short(code.co_filename)}({code.co_firstlineno}): {code.co_name}"
            self.names[code] = (name, package(name))
        return self.names[code]

    def _sample(self, weight: float) -> None:
        frame = sys._current_frames().get(self.thread_id)
        stack = []
        while frame is not None:
            stack.append(self._name(frame.f_code))
            frame = frame.f_back
        if not stack:
            return
        self.samples += 1
        self.seconds += weight
        self.own[stack[0][0]] += weight
        self.pkg_own[stack[0][1]] += weight
        for name in {n for n, _ in stack}:
            self.inclusive[name] += weight
        for pkg in {k for _, k in stack}:
            self.pkg_inclusive[pkg] += weight

    def _run(self) -> None:
        last = time.perf_counter()
        while not self.done.wait(self.period_s):
            now = time.perf_counter()
            self._sample(now - last)
            last = now
        self._sample(time.perf_counter() - last)

    def start(self) -> "StackSampler":
        self.done.clear()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stack-sampler")
        self.thread.start()
        return self

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def summary(self, top: int = 50) -> dict:
        r = lambda x: round(x, 4)  # noqa: E731
        return {"s": r(self.seconds), "samples": self.samples, "period_s": self.period_s,
                "by_package": {k: r(v) for k, v in self.pkg_own.most_common()},
                "by_package_inclusive": {k: r(v) for k, v in self.pkg_inclusive.most_common()},
                "top": [{"name": n, "s": r(v), "self_s": r(self.own[n])} for n, v in self.inclusive.most_common(top)],
                "top_self": [{"name": n, "self_s": r(v)} for n, v in self.own.most_common(top)]}


_KEPT: list | None = None
"""The code objects ``exec``'d while ``_code_kept`` is on (None: off)."""


@contextlib.contextmanager
def _code_kept(on: bool):
    """With ``on``, keep alive every code object run through ``exec`` / ``eval``
    inside (an audit hook, installed once per process): modules imported, FX graphs
    and guards generated, inductor's compiled modules loaded. torch.profiler's Python
    tracer (``with_stack``) keys the functions it saw by their code object's address
    and keeps pointers to their names: a code object freed during the step (a
    module's top level after its import, a temporary FX graph) gives a later one at
    the same address its name, or a dangling name (wrong names in the trace, a
    UnicodeDecodeError in ``key_averages``; pytorch/pytorch#64345, #136040)."""
    global _KEPT
    if not on:
        yield
        return
    if not getattr(_code_kept, "installed", False):
        def hook(event, args):
            if _KEPT is not None and event == "exec" and args:
                _KEPT.append(args[0])
        sys.addaudithook(hook)
        _code_kept.installed = True
    _KEPT = []
    try:
        yield
    finally:
        _KEPT = None


SYNC_WARNING = "called a synchronizing CUDA operation"
"""The start of the warning ``torch.cuda.set_sync_debug_mode("warn")`` gives."""


def sync_sites(fn, depth: int = 4) -> tuple[object, list[dict]]:
    """``fn()`` with CUDA's synchronisation debug mode on ("warn"): ``(its result,
    sites)``, where each site is one distinct call stack (its innermost ``depth``
    frames, as ``file:line function``) that made the host wait for the device, with
    how many times it did (``count``), most frequent first. Those waits are the
    host-side syncs of a step: each drains the launch queue, leaving the GPU idle
    while the host launches again. Without CUDA, only warnings ``fn`` itself gives
    are counted."""
    import traceback
    import warnings

    import torch

    sites: dict[str, int] = {}
    real_show = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not str(message).startswith(SYNC_WARNING):
            return real_show(message, category, filename, lineno, file, line)
        frames = [f for f in traceback.extract_stack()[:-1] if "/warnings.py" not in f.filename][-depth:]
        key = " < ".join(f"{_short(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
        sites[key] = sites.get(key, 0) + 1

    cuda = torch.cuda.is_available()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    return result, [{"site": k, "count": v} for k, v in ranked]


def _short(filename: str) -> str:
    """A frame's file from its package on (``eagle3fn/...``, ``transformers/...``)."""
    parts = Path(filename).parts
    for anchor in ("site-packages", "src", "benchmarks"):
        if anchor in parts:
            return "/".join(parts[len(parts) - parts[::-1].index(anchor):])
    return "/".join(parts[-2:])


#: dynamo/inductor phases ``compile_profile`` reports (the rest are their parts)
COMPILE_PHASES = ("_compile.compile_inner", "bytecode_tracing", "create_aot_dispatcher_function",
                  "compile_fx.<locals>.fw_compiler_base", "compile_fx.<locals>.bw_compiler",
                  "async_compile.wait", "PyCodeCache.load_by_key_path", "build_guards")


COMPILE_LOG_PREFIXES = ("compiling:",)
"""The starts of the log lines about compilation that a run's record keeps."""


def compile_log(text: str) -> dict:
    """What a run's log ``text`` says about its compilation: ``compile_log``, its lines
    that start with ``COMPILE_LOG_PREFIXES`` (stripped)."""
    lines = [line.strip() for line in text.splitlines() if line.strip().startswith(COMPILE_LOG_PREFIXES)]
    return {"compile_log": lines}


def compile_profile() -> dict:
    """Seconds this process spent in the main compile phases, summed over every
    compilation (``torch._dynamo.utils.compile_times``): the warm-up's profile.
    ``_compile.compile_inner`` is dynamo's whole compile of a frame (tracing, AOT
    autograd, inductor's forward compile); backward graphs compile lazily, at the
    first backward (``bw_compiler``)."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = {n: sum(float(x) for x in str(v).split(",")) for n, v in zip(names, values)}
    return {n: round(seconds[n], 2) for n in COMPILE_PHASES if n in seconds}


class GpuSampler:
    """``nvidia-smi`` sampling utilization.gpu and memory.used of one GPU every
    ``period_ms`` in the background; ``window(t0, t1)`` summarises the samples taken
    in ``[t0, t1]`` (epoch seconds). Without nvidia-smi it holds no samples."""

    def __init__(self, gpu: str, period_ms: int) -> None:
        import datetime

        self.samples: list[tuple[float, float, float]] = []
        exe = shutil.which("nvidia-smi")
        self.proc = None
        if exe is None:
            return
        cmd = [exe, f"--id={gpu}", "--query-gpu=timestamp,utilization.gpu,memory.used",
               "--format=csv,noheader,nounits", f"--loop-ms={period_ms}"]
        if shutil.which("stdbuf"):  # line-buffered through the pipe
            cmd = ["stdbuf", "-oL", *cmd]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

        def read():
            for line in self.proc.stdout:
                parts = [p.strip() for p in line.split(",")]
                try:
                    when = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    self.samples.append((when, float(parts[1]), float(parts[2])))
                except (ValueError, IndexError):
                    continue
        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait()
            self.thread.join(timeout=5)

    def window(self, t0: float, t1: float) -> dict:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        return {"gpu_busy_pct": round(statistics.mean(s[1] for s in inside), 1) if inside else None,
                "smi_samples": len(inside),
                "smi_peak_used_gib": round(max(s[2] for s in self.samples) / 1024, 2) if self.samples else None}


def summarise(steps: list[dict], *, warmup: int, launched: float, ceiling_tflops: float,
              floors: list[tuple[float, float]] | None, before: dict | None = None) -> dict:
    """The reported numbers of one run from its per-step records (module docstring).
    ``floors[i]``: the (dense, trimmed) FLOPs of step i, or None when the batches
    could not be matched to the data."""
    n = len(steps)
    w = max(0, min(warmup, n - 2))
    t_first, t_window = steps[0]["t_start"], steps[w - 1]["t_end"] if w else steps[0]["t_start"]
    t_last = steps[-1]["t_end"]
    steady = steps[w:]
    tokens = sum(s["tokens"] for s in steady)
    seconds = t_last - t_window
    rate = tokens / seconds
    ends = [s["t_end"] for s in steps]
    durations = [ends[i] - (ends[i - 1] if i else steps[0]["t_start"]) for i in range(w, n)]
    out = {
        "steps": n, "warmup_steps": w, "tokens_per_s": round(rate, 1),
        "padded_tokens_per_s": round(sum(s["padded"] for s in steady) / seconds, 1),
        "ms_per_step_median": round(1e3 * statistics.median(durations), 2),
        "ms_per_step_quartiles": [round(1e3 * q, 2) for q in statistics.quantiles(durations, n=4)]
        if len(durations) > 1 else None,
        "step_ms": [round(1e3 * d, 1) for d in durations],
        "startup_s": round(t_first - launched, 2),
        "warmup_s": round((t_window - t_first) - sum(s["tokens"] for s in steps[:w]) / rate, 2),
        "to_steady_s": round(t_window - launched, 2),
        "padding_frac": round(1 - sum(s["tokens"] for s in steps) / sum(s["padded"] for s in steps), 4),
        "recompiles_after_warmup": steps[-1]["recompiles"] - (steps[w - 1]["recompiles"] if w else 0),
        "graph_compiles_after_warmup": steps[-1]["graphs"] - (steps[w - 1]["graphs"] if w else 0),
        "recompiles_total": steps[-1]["recompiles"], "graph_compiles_total": steps[-1]["graphs"],
        "recompile_limit_hits": steps[-1]["limit_hits"],
        "window": [t_window, t_last],
    }
    if "load_s" in steps[0]:
        out["input_wait_frac"] = round(sum(s["load_s"] for s in steady) / seconds, 4)
    if "peak" in steps[0]:
        gib = 2**30
        peaks = [s["peak"] for s in steps] + ([before["peak"]] if before else [])
        out.update(peak_gib=round(max(peaks) / gib, 2), steady_peak_gib=round(max(s["peak"] for s in steady) / gib, 2),
                   reserved_gib=round(max(s["reserved"] for s in steps) / gib, 2))
    else:
        out.update(peak_gib=None, steady_peak_gib=None, reserved_gib=None)
    if floors is not None:
        dense = sum(f[0] for f in floors[w:]) / (ceiling_tflops * 1e12)
        trimmed = sum(f[1] for f in floors[w:]) / (ceiling_tflops * 1e12)
        out.update(floor_dense_tokens_per_s=round(tokens / dense, 1),
                   floor_trim_tokens_per_s=round(tokens / trimmed, 1),
                   floor_dense_frac=round(dense / seconds, 4), floor_trim_frac=round(trimmed / seconds, 4))
    return out


METHODS = {
    "tokens_per_s": "real tokens of the steps after warmup_steps / wall s from the end of the last warm-up "
                    "step to the end of the last step; each step ends after a device sync",
    "warmup_s": "wall s of the warm-up steps minus their real tokens at the steady rate",
    "step_ms": "wall ms of each step of the steady window (end to end, device-synced); "
               "ms_per_step_quartiles: its quartiles (the spread that says what is noise)",
    "startup_s": "process launch to the start of the first optimizer step",
    "padding_frac": "1 - real/padded tokens of every micro-batch computed on (padded = B*S)",
    "recompiles_after_warmup": "dynamo 'Recompiling function' log events during the steady window",
    "recompile_limit_hits": "dynamo 'hit config.recompile_limit' warnings in the run (that code then runs eager)",
    "graph_compiles_after_warmup": "new dynamo graphs (counters['stats']['unique_graphs']) in the steady window",
    "gpu_busy_pct": "mean nvidia-smi utilization.gpu over the steady window, sampled every smi_period_ms",
    "peak_gib": "torch.cuda.max_memory_allocated over the run, reset after every step (target weights included)",
    "floor_*": "FLOPs of the steady window's batches (step_flops; a packed run: its real tokens x the data's "
               "mean FLOPs per real token) / the matmul rate measured in this process; "
               "frac = floor time / measured time",
    "input_wait_frac": "offline: s the training thread waited on the prefetching reader (the loop's "
                       "input_wait_s) / steady window s",
    "compile_profile": "s the eagle3fn process spent in dynamo/inductor compile phases, summed over every "
                       "compilation (torch._dynamo.utils.compile_times, aggregated)",
    "profiles": "with --profile-steps K ... (or --profile-step K): one record per step K, run under "
                "torch.profiler (train_probe.profiled): step, wall_ms, device_ms (sum of the device's own events' "
                "self times; device_frac = device_ms / wall_ms), launches (host-side kernel, graph, copy and "
                "memset launches), aten_ops, the top events by self device and self CPU time, stacks (Python "
                "stacks recorded: --profile-stacks), and sync_sites: step K-1 under CUDA's sync debug mode "
                "(train_probe.sync_sites), each call stack where the host waited for the device with its count "
                "(null for K = 1 or when step K-1 is profiled too); --trace-dir keeps each step's Chrome trace "
                "as <loop>-<mode>-step<K>.trace.json.gz (benchmarks/trace_summary.py)",
    "first_steps": "the first --first-steps steps timed phase by phase (train_probe.PhaseClock), each phase "
                   "started and ended by a device sync and summed over the step's micro-batches: batch_s "
                   "(train.step.micro_batch: the source's load -- online the target forward, offline the wait "
                   "for the prefetched shard and its copy -- and the row map), forward_s (the draft's "
                   "eagle3fn.unrolled.ttt, its compilation included), backward_s (Tensor.backward, the backward "
                   "graphs' compilation included), optimizer_s (the optimizer's step), rest_s (wall_s in none of "
                   "them: gradient clipping, the finiteness read, zero_grad, a profiler's own work), wall_s (the "
                   "step, device-synced at its end); the extra syncs cost little in a step of seconds, but keep "
                   "these steps in the warm-up. python (--sample-ms > 0): the training thread's Python stack "
                   "sampled every sample_ms (train_probe.StackSampler), each sample weighted by the wall s since "
                   "the last: s per package of the innermost frame (by_package, self), with the package anywhere "
                   "on the stack (by_package_inclusive), and the functions with the most inclusive and self s",
    "to_steady_s": "process launch to the start of the steady window (startup + warm-up, compilation "
                   "included)",
    "compile_log": "the lines the run logged that start with 'compiling:'",
    "warmup_step_s": "wall s of each warm-up step (device-synced), compilation included",
    "vs_specforge": "tokens_per_s / the SpecForge loop's tokens_per_s in this process",
}


# ---------------------------------------------------------------------------- eagle3fn


def _python(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "eagle3fn.cli", *args])


def run_eagle3fn(argv: list[str], *, log: Path, record: Path, gpu: str | None, smi_ms: int,
                 env: dict[str, str]) -> tuple[dict, float, GpuSampler | None]:
    """One ``eagle3fn`` command in a subprocess under ``probe`` with ``env`` added to
    this process's environment: ``(record, launch time, sampler)``; raises
    RuntimeError naming the log when it fails."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import train_probe; train_probe.probe(sys.argv[2], sys.argv[3:])"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **env)
    sampler = GpuSampler(gpu, smi_ms) if gpu is not None else None
    launched = time.time()
    try:
        with open(log, "w") as f:
            done = subprocess.run([sys.executable, "-c", code, str(BENCH_DIR), str(record), *argv],
                                  stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, check=False)
    finally:
        if sampler is not None:
            sampler.stop()
    if done.returncode or not record.exists():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{_python(argv)} exited {done.returncode} (log {log}):\n{tail}")
    return json.loads(record.read_text()), launched, sampler


def run_prepare(argv: list[str], log: Path) -> float:
    """``python -m eagle3fn.cli prepare ...``: its wall seconds (RuntimeError on failure)."""
    t = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run([sys.executable, "-m", "eagle3fn.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"), cwd=ROOT, check=False)
    if done.returncode:
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{_python(argv)} exited {done.returncode} (log {log}):\n{tail}")
    return time.perf_counter() - t
