"""The product loop end to end: ``eagle3fn train`` as a user runs it (online, and
``prepare`` + ``train --cache`` offline), every ``--trim`` mode, beside a SpecForge 0.2.0
loop on the same batches in this process (../shared/BENCH.md, "End to end").

    python benchmarks/train.py --shape llama-3.1-8b --loops online --modes none auto \\
        --steps 80 --batch-size 4 --max-length 2048 --out train-8b-online-a.json

One H200 command stays under 10 minutes with two modes and its SpecForge loop; the
set (each command has its own SpecForge baseline in its process; the target and,
with ``--keep-cache``, the offline cache are reused from ``--work-dir`` while the
machine keeps its disk)::

    S="python benchmarks/train.py --steps 80 --batch-size 4 --max-length 2048"
    $S --shape llama-3.1-8b --loops online --modes none auto --out train-8b-online-a.json
    $S --shape llama-3.1-8b --loops online --modes loss backbone --out train-8b-online-b.json
    $S --shape llama-3.1-8b --loops offline --modes none auto --keep-cache --out train-8b-offline-a.json
    $S --shape llama-3.1-8b --loops offline --modes loss backbone --out train-8b-offline-b.json
    $S --shape gemma-3-262k --loops online --modes none auto --out train-gemma-online-a.json
    $S --shape gemma-3-262k --loops online --modes loss backbone --out train-gemma-online-b.json
    $S --shape gemma-3-262k --loops offline --modes none auto --keep-cache --out train-gemma-offline-a.json
    $S --shape gemma-3-262k --loops offline --modes loss backbone --out train-gemma-offline-b.json

(off a git checkout put ``$(python benchmarks/meta.py)``'s output, computed in the
checkout the tree came from, before each command). ``--shape tiny --device cpu`` runs
the same code on a CPU in seconds (tests/test_bench_train.py).

What one run does, in order:

1. Target: a random-weight HF model with a named real model's shape (``SHAPES``),
   built on the device in the compute dtype (``torch.device`` + default dtype while
   the model is constructed), saved with ``save_pretrained`` under ``--work-dir`` and
   reused by later runs with the same shape and seed. Its tokenizer is a word-level
   one whose ids cover the whole vocab (``word_tokenizer``: ``<|pad|>``,
   ``<|im_start|>``, ``<|im_end|>``, the role names, then ``w7 .. w{V-1}``, one token
   per word) with eagle3fn's ChatML template (``{% generation %}`` marks the assistant
   turns), so ``eagle3fn train`` reads chat JSONL through the model directory exactly
   as for a real model, the vocab is the target's, every id can occur, and the data's
   token counts are exact.
2. Data: ``--steps * --batch-size`` synthetic conversations (one epoch, every run sees
   every batch) written as chat JSONL (``sample_conversations``), token ids drawn from a
   Zipf law (s = 1.1) over the vocab.
3. eagle3fn: for each loop and ``--modes`` entry, a subprocess running
   ``eagle3fn.cli.main.main(argv)`` (what ``python -m eagle3fn.cli`` runs) with an
   observer (``probe``) that only records, per optimizer step: wall time after a
   device sync, real and padded tokens of its micro-batches, the allocator's peak,
   dynamo recompilations and graph compilations, and (offline) seconds spent reading
   the cache. ``prepare`` runs as a plain ``python -m eagle3fn.cli prepare``.
4. SpecForge 0.2.0 in this process, on the same batches in the same order, padded as
   its ``DataCollatorWithPadding`` pads (to the batch's longest, as eagle3fn):
   online, the target forward as SpecForge's HF backend ran it (``HFEagle3TargetModel.
   generate_eagle3_data`` in sgl-project/SpecForge ``specforge/modeling/target/
   eagle3_target_model.py`` before 0.2.0 made capture SGLang-server only: forward hooks
   on the aux layers, the model's own full-vocab logits, ``padding(..., left=False)``
   shifts, ``loss_mask[..., None]``); offline, features captured before timing and held
   in host memory (no disk read: this favours SpecForge), its ``TargetHead`` step
   (lm_head over the shifted final hidden) and the offline normalizer's zeroed last
   loss position. Then ``OnlineEagle3Model`` (flex_attention on CUDA, sdpa on the CPU,
   its draft config generated from the target's as SpecForge does), the 0.8-decayed
   sum of its step losses, backward, and its ``BF16Optimizer`` (AdamW over fp32
   masters, grad clip 0.5). Ratios against it are taken within this process.

Measured per run (JSON ``results`` rows; ``methods`` in the JSON says the same):

- ``tokens_per_s``: steady-state real (non-padding) tokens per second: real tokens of
  the steps after ``--warmup-steps`` over the wall time from the end of the last
  warm-up step to the end of the last step (each step ends after a device sync).
- ``warmup_s``: seconds the warm-up steps took beyond their tokens at the steady rate
  (compilation and autotuning included: every eagle3fn run starts with empty inductor
  and Triton caches unless ``--warm-compile-cache``; SpecForge's second loop in this
  process reuses the graphs its first compiled, so its warm-up is a lower bound);
  ``startup_s``: process launch to the first step (imports, target load,
  tokenization, build); ``to_steady_s``: launch to the start of the steady window.
- ``padding_frac``: 1 - real / padded tokens over all steps, padded = sum of ``B * S``
  of the micro-batches the loop computed on.
- ``recompiles_after_warmup``: dynamo "Recompiling function" events during the steady
  window (``torch._logging`` recompiles artifact, counted by a logging handler);
  ``graph_compiles_after_warmup``: new dynamo graphs (``counters["stats"]
  ["unique_graphs"]``) in that window; ``recompile_limit_hits``: functions that hit
  dynamo's recompile limit in the run (they run uncompiled from then on).
- ``gpu_busy_pct``: mean of ``nvidia-smi --query-gpu=utilization.gpu`` sampled every
  ``--smi-period-ms`` over the steady window (the driver's "percent of time one or more
  kernels was executing" over its own sample period of 1/6 s to 1 s; coarse, and null
  without nvidia-smi or on the CPU).
- ``peak_gib``: ``torch.cuda.max_memory_allocated`` over the run (reset per step; the
  target's weights included), ``steady_peak_gib`` over the steady window; also
  ``reserved_gib`` (the caching allocator) and ``smi_peak_used_gib`` (nvidia-smi
  ``memory.used`` of the whole GPU, this process's context included).
- ``floor_dense_frac`` / ``floor_trim_frac``: the FLOP floor of the steady window's
  work at the matmul rate measured in this process (``--device`` 8192^3 bf16 matmul)
  over the measured time (``step_flops``: BENCH.md's per-token terms, which give its
  194.0 / 64.0 ms floors at 8192; online adds the target forward,
  2 * decoder params * tokens + attention, without its head, which the teacher term
  counts). ``dense``: every row at every step; ``trim``: teacher, head, loss and the
  layer after step 0's keys/values only at supervised rows.
- ``input_wait_frac`` (offline): seconds inside ``FeatureCache.read`` over the steady
  window (the loop reads a shard while the device is idle after the previous step's
  sync, so this is the device's wait).
- ``vs_specforge``: ``tokens_per_s`` over the SpecForge loop's of the same loop kind
  (online runs against online SpecForge; offline against offline, else online) at its
  steady state (``--specforge-shapes steady``: every batch padded to ``--max-length``,
  so its compiled functions compile once and never again; the padding is masked, the
  maths unchanged); ``vs_specforge_shipped`` against SpecForge as shipped (batches
  padded to their longest: a recompilation per new length inside the window).

Where the warm-up and the host time go (these options run on the CPU too):

    python benchmarks/train.py --shape llama-3.1-8b --loops offline --modes auto --packs True \\
        --steps 12 --warmup-steps 9 --batch-size 4 --max-length 2048 --no-specforge \\
        --first-steps 2 --profile-steps 8 --profile-stacks --trace-dir traces --out train-8b-first.json
    python benchmarks/trace_summary.py --trace traces/offline-auto_pack-step8.trace.json.gz --out step8.json

- ``first_steps`` (``--first-steps N``, default 2; no profiler): each of the first N
  steps' wall time split into phases, each started and ended by a device sync:
  ``batch_s`` (the batch load: online the target forward; offline the wait for the
  prefetched shard and its copy; the row map), ``forward_s`` (the draft's
  ``eagle3fn.unrolled.ttt``, where dynamo traces and compiles the forward graphs),
  ``backward_s`` (where the backward graphs compile), ``optimizer_s``, ``rest_s``
  (the rest of ``wall_s``), and ``python`` (``--sample-ms``, default 5): the
  training thread's Python stack sampled through those steps, seconds per package
  (``torch/_dynamo``, ``torch/_inductor``, ``triton``, ``transformers``,
  ``eagle3fn``, ``builtins``...) and per function. ``train_probe.PhaseClock`` and
  ``StackSampler`` wrap and watch the loop in the eagle3fn process; src/eagle3fn is
  not changed. This is the cheap way to see where a first step's seconds go.
- ``profiles`` (``--profile-steps K ...``; ``--profile-step K`` is one of them): one
  record per profiled step, its trace ``<loop>-<mode>-step<K>.trace.json.gz``. Step
  1 works (its compilation included; no sync-sites step precedes it).
  ``--profile-stacks`` records every Python call in the trace (torch.profiler
  ``with_stack``; trace_summary's ``python`` block): fine for a steady step (host
  time by function), but on a compiling step it costs tens of times the step and
  GBs (on the CPU, an ``aot_eager`` compile of 1.4 s took 40 s under it, then 77 s
  to export: 2.3 M events, 660 MB of JSON, 41 MB gzipped), so profile step 1 with
  stacks only for a small compile, and read it from ``first_steps`` otherwise.
- ``compile_log``: the run's log lines starting with ``compiling:``.

Synthetic data (``PROFILES``; ``--data-profile``, default ``prompt-heavy``):

- Turns per conversation and tokens per user / assistant turn follow WildChat's
  published statistics (Zhao et al., "WildChat: 1M ChatGPT Interaction Logs in the
  Wild", ICLR 2024, the table comparing it with other chat sets): 2.52 +- 2.49 turns,
  295.58 +- 1609.18 user tokens and 441.34 +- 410.91 assistant tokens per turn (mean +-
  sd); ``sharegpt``: ShareGPT's row of the same table, 3.51 +- 2.31 turns, 94.46 +-
  626.39 user and 348.45 +- 269.93 assistant tokens. The papers give means and sds
  only: turns are drawn as 1 + a negative binomial and token counts from log-normals
  with those means and sds (our assumption for the shape; it puts 1.9% of
  conversations above 10 turns where a summary of the paper reports 3.7%, a tail the
  2048-token cut removes anyway). The turn mean was re-checked against that summary;
  the per-turn token figures are quoted from the paper's table as recalled and were
  not re-checked from a stored copy.
- These sets alone are answer-heavy: after the 2048-token cut their assistant share is
  about 69% (WildChat) and 81% (ShareGPT) in this generator. BENCH.md's prompt-heavy
  case (30% supervised) and this benchmark's 30-40% target need context the chat sets
  do not carry, so ``prompt-heavy`` adds one system message per conversation (a system
  prompt, retrieved documents or tool schemas) of log-normal length, median 800 tokens,
  log-sd 0.5: an assumption calibrated to give about 36% assistant tokens at
  ``--max-length 2048``, not a measured distribution.
- A conversation whose first answer would start past 90% of ``--max-length`` is drawn
  again (past ``--max-length`` it would train nothing: eagle3fn drops it); text past
  ``--max-length`` tokens is not written (eagle3fn cuts there). ``--length-scale``
  multiplies every length (the tiny CPU shape uses 1/16 with ``--max-length 128``, the
  same distribution scaled). The JSON's ``data`` block gives the measured assistant
  share, lengths and the padding of the step batches.

Printed last: a table per loop and mode.

Code: this file holds the arguments, the runs and the report; ``train_target.py`` the
shapes, the tokenizer and the target build; ``train_data.py`` the synthetic chats;
``train_probe.py`` the FLOP floor and the measuring (``probe`` runs in the eagle3fn
subprocess); ``train_specforge.py`` the SpecForge loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from train_data import (PROFILES, data_summary, padding_fraction, sample_conversations, step_batches,  # noqa: F401
                        write_jsonl)
from train_probe import (BENCH_DIR, METHODS, ROOT, GpuSampler, RecompileCounter, _python,  # noqa: F401
                         compile_log, matmul_tflops, probe, probe_env, run_eagle3fn, run_prepare, step_flops,
                         summarise)
from train_specforge import specforge_loop
from train_target import FIRST_WORD, SHAPES, Shape, build_target, word_tokenizer  # noqa: F401


# ---------------------------------------------------------------------------- driver


Mode = Literal["none", "loss", "backbone", "auto"]


@dataclass(kw_only=True)
class BenchArgs:
    """Time ``eagle3fn train`` end to end beside a SpecForge 0.2.0 loop (module docstring)."""

    shape: Literal["llama-3.1-8b", "gemma-3-262k", "smollm2-135m", "tiny", "tiny-gemma3"] = "llama-3.1-8b"
    """Target shape (random weights); ``smollm2-135m`` is the outcome runs' real target's
    (rows of 1024, lengths scaled by 0.5)."""
    loops: tuple[Literal["online", "offline"], ...] = ("online", "offline")
    """online: the target runs in the loop; offline: ``prepare`` then ``train --cache``."""
    modes: tuple[Mode, ...] = ("none", "loss", "backbone", "auto")
    """``eagle3fn train --trim`` modes to run for each loop."""
    packs: tuple[bool, ...] = (False,)
    """Run each mode unpacked (False: ``--no-pack``, SpecForge's batches) and/or packed
    (True: ``--pack``, eagle3fn's default; the run's mode is reported as
    ``<mode>+pack``)."""
    specforge: bool = True
    """Also run the SpecForge 0.2.0 loop for each loop kind (after the eagle3fn runs)."""
    specforge_shapes: tuple[Literal["steady", "shipped"], ...] = ("steady", "shipped")
    """How SpecForge's batches are shaped: ``steady`` every batch padded to
    ``--max-length`` (one shape: its compiled functions compile once; the ratios
    ``vs_specforge`` are against this one), ``shipped`` padded to each batch's longest as
    its collator does (a recompilation per new length; ``vs_specforge_shipped``)."""
    steps: int = 80
    """Optimizer steps per run; the data is ``steps * batch_size`` conversations, one epoch."""
    warmup_steps: int = 20
    """Steps before the steady window (capped at steps - 2)."""
    batch_size: int = 4
    """Conversations per micro-batch (and per cache shard)."""
    max_length: int | None = None
    """Tokens per conversation (default: the shape's, 2048; 128 for the tiny shapes)."""
    data_profile: Literal["prompt-heavy", "wildchat", "sharegpt"] = "prompt-heavy"
    """Length distribution of the synthetic chats (module docstring)."""
    length_scale: float | None = None
    """Multiply every drawn length (default: the shape's, 1 and 1/16 for the tiny shapes)."""
    draft_vocab_size: int | None = None
    """Vd (default: the shape's, 32000 for the real shapes)."""
    ttt_length: int = 7
    """k, unrolled TTT steps (both libraries)."""
    lr: float = 1e-4
    """Peak learning rate (both libraries)."""
    seed: int = 0
    """Target weights, data and data order."""
    device: str = "cuda"
    """``cuda``, ``cuda:N`` or ``cpu`` (a functional check: fp32, eager SpecForge)."""
    variants: tuple[str, ...] = ()
    """Also run each loop, mode and packing with these extra ``eagle3fn train`` flags,
    one run per variant right after the plain one (same target, data and batches): a
    variant is flags without their leading dashes joined by ``+``, a value after ``=``,
    e.g. ``no-compile-target`` or ``compile-target+pack-length=8192``. Its rows are reported as
    ``<mode>+<variant>`` with the flags in ``variant``."""
    train_args: str = ""
    """Extra ``eagle3fn train`` flags for every run, given with ``=`` since they start
    with ``--`` (tyro would read them as its own flags): e.g.
    ``"--train-args=--ttt.query-buckets 4"``."""
    work_dir: str | None = None
    """Target, data, caches, runs and logs (default: /tmp/eagle3fn-bench-<shape>); the
    target is reused across runs with the same shape and seed."""
    keep_cache: bool = False
    """Keep the offline cache (and reuse one left by an earlier run with the same data)."""
    smi_period_ms: int = 100
    """nvidia-smi sampling period."""
    warm_compile_cache: bool = False
    """Let runs share inductor's and Triton's on-disk caches (default: each run starts
    with empty ones, so its warm-up includes every compilation, as a user's first run)."""
    profile_steps: tuple[int, ...] = ()
    """Run these optimizer steps (1-based) of every eagle3fn run under torch.profiler and
    report where each one's wall time went (``profiles``, one record per step: device
    busy time, kernel launches, ATen calls, top events; ``train_probe.profiled``), and
    the step before each (when it exists and is not profiled too) with CUDA's
    synchronisation debug mode (the record's ``sync_sites``: the call stacks where the
    host waited for the device; ``train_probe.sync_sites``). Step 1 is the first step,
    its compilation included. Both slow their steps, so keep them in the warm-up
    window to keep the rates clean. Empty: none."""
    profile_step: int = 0
    """One step to profile, as one entry of ``--profile-steps`` (0: none)."""
    profile_stacks: bool = False
    """Record Python stacks in the profiled steps (torch.profiler ``with_stack``): their
    traces then hold every Python call, so ``benchmarks/trace_summary.py`` can tell
    which functions (dynamo, inductor, triton, transformers, eagle3fn) the host time
    went to. Needs ``--trace-dir``. A compiling step (step 1) runs tens of times slower
    under it, with a trace of GBs (module docstring): use ``--sample-ms`` there."""
    first_steps: int = 2
    """Time the first N steps of every eagle3fn run phase by phase, each phase ended by
    a device sync (``first_steps``: batch load, draft forward, backward, optimizer;
    ``train_probe.PhaseClock``). 0: none."""
    sample_ms: float = 5.0
    """During those first steps, sample the training thread's Python stack every this
    many ms (``first_steps[i].python``: seconds per package and per function,
    ``train_probe.StackSampler``; about one stack walk per sample). 0: none."""
    trace_dir: str | None = None
    """With ``--profile-steps``: also write each run's profiled steps as gzipped Chrome
    traces ``<trace-dir>/<loop>-<mode>-step<K>.trace.json.gz``, ``+`` written ``_`` (for
    chrome://tracing or Perfetto: the gaps between kernels are the host time; summarised
    by ``benchmarks/trace_summary.py``)."""
    out: str | None = None
    """Write the results here as JSON (rewritten after every run)."""


def resolved_args(args: BenchArgs, shape: Shape, work: Path) -> dict:
    """``args`` as the run used them (no None, for ``meta.run_metadata``)."""
    out = {k: v for k, v in asdict(args).items() if not (k in ("out", "trace_dir") and v is None)}
    out.update(work_dir=str(work), length_scale=shape.length_scale, max_length=shape.max_length,
               draft_vocab_size=shape.draft_vocab)
    return out


@dataclass
class Bench:
    """What the runs of one benchmark invocation share: the resolved settings, the
    saved target, the data and its step batches, their FLOPs, the matmul ceiling."""

    args: BenchArgs
    shape: Shape
    device: str
    gpu: str | None
    work: Path
    model_dir: Path
    data_path: Path
    examples: list
    batches: list[list]
    floors: dict[str, list[tuple[float, float]]]
    ceiling: float

    def compile_env(self, name: str) -> dict[str, str]:
        """Inductor's and Triton's cache directories for run ``name``: fresh ones (so
        its warm-up compiles everything, as a first run does, whatever ran before),
        or none with ``--warm-compile-cache``."""
        if self.args.warm_compile_cache:
            return {}
        root = self.work / "compile" / name
        return {"TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TRITON_CACHE_DIR": str(root / "triton")}

    def train_argv(self, loop: str, mode: str, out_dir: Path, cache: Path, pack: bool = False,
                   variant: str = "") -> list[str]:
        """The ``eagle3fn train`` arguments of one run."""
        a = self.args
        source = ["--cache", str(cache)] if loop == "offline" else ["--data", str(self.data_path)]
        source += ["--batch-size", str(a.batch_size)]  # rows per batch; an unpacked cache keeps its shards
        return ["train", "--model", str(self.model_dir), *source, "--out-dir", str(out_dir), "--trim", mode,
                "--max-length", str(a.max_length), "--max-steps", str(a.steps), "--epochs", "1",
                "--draft-vocab-size", str(self.shape.draft_vocab), "--ttt-length", str(a.ttt_length),
                "--lr", str(a.lr), "--seed", str(a.seed), "--device", self.device, "--save-every", str(10**9),
                "--log-every", "1", "--pack" if pack else "--no-pack", *shlex.split(a.train_args),
                *variant_flags(variant)]


def check_profiling(args: BenchArgs) -> None:
    """The profiling options make sense together (SystemExit naming the value and the
    fix), before anything is built."""
    steps = profile_steps(args)
    if any(not 1 <= k <= args.steps for k in steps):
        raise SystemExit(f"--profile-steps {' '.join(map(str, steps))}: each step must be in 1..{args.steps} "
                         "(--steps); pass steps of the run")
    if args.profile_stacks and not (steps and args.trace_dir):
        raise SystemExit("--profile-stacks: the stacks are only kept in the traces; also pass --profile-steps K "
                         "and --trace-dir DIR")
    if args.trace_dir and not steps:
        raise SystemExit(f"--trace-dir {args.trace_dir}: traces are written of profiled steps only; also pass "
                         "--profile-steps K")
    if args.first_steps < 0:
        raise SystemExit(f"--first-steps {args.first_steps}: pass 0 (none) or more")
    if args.sample_ms < 0:
        raise SystemExit(f"--sample-ms {args.sample_ms}: pass 0 (no sampling) or a period in ms")


def resolve(args: BenchArgs) -> tuple[BenchArgs, Shape, Path]:
    """The settings with the shape's defaults filled in, the shape, the work dir."""
    shape = SHAPES[args.shape]
    shape = dataclasses.replace(shape, draft_vocab=args.draft_vocab_size or shape.draft_vocab,
                                length_scale=args.length_scale or shape.length_scale,
                                max_length=args.max_length or shape.max_length)
    args = dataclasses.replace(args, max_length=shape.max_length)
    return args, shape, Path(args.work_dir or f"/tmp/eagle3fn-bench-{args.shape}").resolve()


def setup(args: BenchArgs, shape: Shape, work: Path) -> Bench:
    """Build (or reuse) the target, write and tokenize the data, count its FLOPs and
    measure the matmul ceiling."""
    import torch
    from transformers import AutoTokenizer

    from eagle3fn.io.data import tokenize_file

    gpu = None
    if torch.device(args.device).type == "cuda":  # nvidia-smi's name for it, whatever CUDA_VISIBLE_DEVICES says
        index = torch.device(args.device).index or 0
        uuid = re.search(r"[0-9a-fA-F]{8}(-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}",
                         str(torch.cuda.get_device_properties(index).uuid))
        gpu = f"GPU-{uuid.group(0)}" if uuid else str(index)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    model_dir = work / "target"
    built_s = build_target(shape, model_dir, args.device, args.seed)
    print(f"target {args.shape}: {model_dir} ({f'built in {built_s:.0f} s' if built_s else 'reused'})", flush=True)
    ceiling = matmul_tflops(args.device)
    if gpu is not None:
        torch.cuda.empty_cache()
    n = args.steps * args.batch_size
    data_path = work / "data.jsonl"
    write_jsonl(data_path, sample_conversations(n, PROFILES[args.data_profile], vocab_size=shape.vocab,
                                                max_length=shape.max_length, length_scale=shape.length_scale,
                                                seed=args.seed))
    examples = tokenize_file(data_path, AutoTokenizer.from_pretrained(model_dir), max_length=shape.max_length)
    batches = step_batches(examples, args.batch_size, args.seed)
    floors = {loop: [step_flops(shape, b, ttt_length=args.ttt_length, online=loop == "online") for b in batches]
              for loop in ("online", "offline")}
    return Bench(args=args, shape=shape, device=args.device, gpu=gpu, work=work, model_dir=model_dir,
                 data_path=data_path, examples=examples, batches=batches, floors=floors, ceiling=ceiling)


def offline_cache(bench: Bench) -> tuple[Path, dict]:
    """``eagle3fn prepare`` of the data into ``work/cache`` (or the cache a
    ``--keep-cache`` run left for the same target, data and batch size): ``(cache,
    what the JSON records of it)``."""
    a, cache = bench.args, bench.work / "cache"
    marker = cache / "bench-cache.json"
    identity = {"target": json.loads((bench.model_dir / "bench-target.json").read_text()),
                "data_sha256": hashlib.sha256(bench.data_path.read_bytes()).hexdigest(),
                "max_length": a.max_length, "batch_size": a.batch_size}
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return cache, {"reused": str(cache)}
    shutil.rmtree(cache, ignore_errors=True)
    argv = ["prepare", "--model.path", str(bench.model_dir), "--model.device", bench.device, "--data.path",
            str(bench.data_path), "--data.max-length", str(a.max_length), "--out", str(cache),
            "--batch-size", str(a.batch_size)]
    seconds = run_prepare(argv, bench.work / "logs" / "prepare.log")
    marker.write_text(json.dumps(identity))
    size = sum(f.stat().st_size for f in cache.iterdir())
    print(f"prepare: {seconds:.0f} s, {size / 2**30:.1f} GiB", flush=True)
    return cache, {"command": _python(argv), "seconds": round(seconds, 1),
                   "tokens_per_s": round(sum(len(e) for e in bench.examples) / seconds, 1),
                   "cache_gib": round(size / 2**30, 2)}


def per_token_floors(bench: Bench, loop: str, steps: list[dict]) -> list[tuple[float, float]]:
    """Each step's (dense, trimmed) FLOP floor as its real tokens times the data's mean
    FLOPs per real token: for a packed run, whose steps hold other groups of
    conversations than ``bench.batches`` (a conversation's FLOPs do not depend on its
    batch, so over the data the sum is the same)."""
    tokens = sum(len(e) for b in bench.batches for e in b)
    dense = sum(f[0] for f in bench.floors[loop]) / tokens
    trimmed = sum(f[1] for f in bench.floors[loop]) / tokens
    return [(dense * s["tokens"], trimmed * s["tokens"]) for s in steps]


def profile_steps(args: BenchArgs) -> list[int]:
    """The steps to profile: ``--profile-steps`` and ``--profile-step``, sorted."""
    return sorted(set(args.profile_steps) | ({args.profile_step} if args.profile_step else set()))


def _trace_path(bench: Bench, name: str) -> str:
    """Where a run's profiled steps go as Chrome traces, ``{step}`` standing for the
    step ("" for none: ``--trace-dir``)."""
    if not bench.args.trace_dir or not profile_steps(bench.args):
        return ""
    Path(bench.args.trace_dir).mkdir(parents=True, exist_ok=True)
    return str(Path(bench.args.trace_dir) / f"{name.replace('+', '_')}-step{{step}}.trace.json.gz")


def variant_flags(variant: str) -> list[str]:
    """``--variants``' spelling as ``eagle3fn train`` flags: ``"compile-target+pack-length=8192"``
    -> ``["--compile-target", "--pack-length", "8192"]``; ``""`` -> ``[]``."""
    out = []
    for part in filter(None, variant.split("+")):
        flag, _, value = part.partition("=")
        if not re.fullmatch(r"[a-z][a-z0-9.-]*", flag):
            raise SystemExit(f"--variants {variant!r}: {flag!r} is not a flag name; write flags without "
                             "their dashes, joined by '+', e.g. no-compile-target+pack-length=8192")
        out += [f"--{flag}", *([value] if value else [])]
    return out


def eagle3fn_row(bench: Bench, loop: str, mode: str, cache: Path, pack: bool = False, variant: str = "") -> dict:
    """One ``eagle3fn train`` run under ``probe`` (with ``variant_flags(variant)``),
    summarised (``error`` when it failed). Its metrics.jsonl and log stay in
    ``work/logs``; its out_dir (checkpoints) is removed."""
    label = "+".join(filter(None, (mode, "pack" if pack else "", variant.replace("=", "-"))))
    name = f"{loop}-{label}"
    out_dir = bench.work / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = bench.train_argv(loop, mode, out_dir, cache, pack, variant)
    row = {"loop": loop, "mode": label, "command": _python(argv), **({"variant": variant} if variant else {})}
    compile_dir = bench.work / "compile" / name
    shutil.rmtree(compile_dir, ignore_errors=True)
    try:
        record, launched, sampler = run_eagle3fn(argv, log=bench.work / "logs" / f"{name}.log",
                                                 record=bench.work / "logs" / f"{name}.json", gpu=bench.gpu,
                                                 smi_ms=bench.args.smi_period_ms,
                                                 env={**bench.compile_env(name),
                                                      **probe_env(profile_steps=profile_steps(bench.args),
                                                                  trace=_trace_path(bench, name),
                                                                  stacks=bench.args.profile_stacks,
                                                                  first_steps=bench.args.first_steps,
                                                                  sample_ms=bench.args.sample_ms)})
        steps = record["steps"]
        expected = [sum(len(e) for e in b) for b in bench.batches]
        match = [s["tokens"] for s in steps] == expected[:len(steps)]
        floors = (bench.floors[loop][:len(steps)] if match
                  else per_token_floors(bench, loop, steps) if pack else None)
        row.update(summarise(steps, warmup=bench.args.warmup_steps, launched=launched,
                             ceiling_tflops=bench.ceiling, floors=floors, before=record.get("before_first_step")),
                   batches_match=match, recompile_examples=record["recompile_examples"],
                   compile_profile=record.get("compile_profile"), profiles=record["profiles"],
                   first_steps=[{k: round(v, 4) if isinstance(v, float) else v for k, v in f.items()}
                                for f in record["first_steps"]],
                   warmup_step_s=[round(s["t_end"] - s["t_start"], 2) for s in steps[:bench.args.warmup_steps]],
                   **compile_log((bench.work / "logs" / f"{name}.log").read_text(errors="replace")))
        missing = sorted(set(profile_steps(bench.args)) - {p["step"] for p in record["profiles"]})
        if missing:  # a packed run may take fewer steps than --steps
            row["profile_note"] = f"steps {missing} not profiled: the run took {len(steps)} steps"
        if loop == "online":  # the loop reads no cache
            row.pop("input_wait_frac")
        if sampler is not None:
            row.update(sampler.window(*row["window"]))
    except RuntimeError as e:
        row["error"] = str(e)
    if (out_dir / "metrics.jsonl").exists():
        shutil.copy(out_dir / "metrics.jsonl", bench.work / "logs" / f"{name}.metrics.jsonl")
    shutil.rmtree(out_dir, ignore_errors=True)  # checkpoints: GiBs at real shapes
    shutil.rmtree(compile_dir, ignore_errors=True)
    return row


def specforge_row(bench: Bench, loop: str, counter: RecompileCounter, d2t, t2d, shapes: str) -> dict:
    """The SpecForge loop of this kind in this process with its batches shaped as
    ``shapes`` says (``BenchArgs.specforge_shapes``), summarised (``error`` when it
    failed, e.g. out of memory)."""
    row = {"loop": loop, "mode": "specforge" if shapes == "steady" else "specforge-shipped",
           "command": f"in process (specforge_loop, {shapes} shapes)"}
    sampler = GpuSampler(bench.gpu, bench.args.smi_period_ms) if bench.gpu is not None else None
    launched = time.time()
    try:
        steps = specforge_loop(bench.shape, bench.model_dir, bench.batches, offline=loop == "offline",
                               device=bench.device, ttt_length=bench.args.ttt_length, d2t=d2t, t2d=t2d,
                               recompiles=counter, lr=bench.args.lr,
                               pad_to=bench.args.max_length if shapes == "steady" else None)
        row.update(summarise(steps, warmup=bench.args.warmup_steps, launched=launched,
                             ceiling_tflops=bench.ceiling, floors=bench.floors[loop]),
                   batches_match=True, recompile_examples=list(counter.examples))
    except Exception as e:  # noqa: BLE001 -- a SpecForge failure (e.g. out of memory) is a result
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]  # where it failed, for the record
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None and "window" in row:
        row.update(sampler.window(*row["window"]))
    return row


def main(args: BenchArgs) -> dict:
    """Run every configured loop and mode (eagle3fn first, then SpecForge); returns the
    JSON written to ``--out`` (rewritten after every run, so a killed run keeps what
    it measured)."""
    if args.steps < 2 or not 0 <= args.warmup_steps < args.steps:
        raise SystemExit(f"--steps {args.steps} --warmup-steps {args.warmup_steps}: need steps >= 2 and "
                         "0 <= warmup-steps < steps")
    check_profiling(args)
    for variant in args.variants:
        variant_flags(variant)  # a bad spelling stops here, before any device time
    if args.device == "cpu":  # SpecForge's Triton loss kernel runs interpreted: set before triton loads
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    from meta import run_metadata

    args, shape, work = resolve(args)
    resolved = resolved_args(args, shape, work)
    run_metadata(resolved)  # off git without EAGLE3FN_COMMIT: fails before any device time
    bench = setup(args, shape, work)
    data = data_summary(bench.examples, bench.batches, args.data_profile, args.steps * args.batch_size,
                        args.max_length)
    print(f"data: {data['conversations']} conversations, {data['tokens']} tokens, "
          f"{data['assistant_share']:.1%} assistant, mean {data['mean_length']:.0f} tokens, "
          f"{data['padding_frac']:.1%} padding in batches of {args.batch_size}", flush=True)
    report = {"ceiling_tflops": round(bench.ceiling, 3), "shape": {"name": args.shape, **asdict(bench.shape)},
              "data": data, "prepare": None, "methods": METHODS, "results": []}

    def add(row: dict) -> None:
        report["results"].append(row)
        print(_line(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(run_metadata(resolved), **report), indent=1))

    for loop in args.loops:
        cache = bench.work / "cache"
        if loop == "offline":
            cache, report["prepare"] = offline_cache(bench)
        for mode in args.modes:
            for pack in args.packs:
                for variant in ("", *args.variants):
                    add(eagle3fn_row(bench, loop, mode, cache, pack, variant))
        if loop == "offline" and not args.keep_cache:
            shutil.rmtree(cache, ignore_errors=True)
    if args.specforge:
        from eagle3fn.io.vocab_io import vocab_map_from_examples

        compile_env = bench.compile_env("specforge")
        saved = {k: os.environ.get(k) for k in compile_env}
        os.environ.update(compile_env)  # read when this process first compiles
        counter = RecompileCounter()
        d2t, t2d = vocab_map_from_examples(bench.examples, bench.shape.vocab, bench.shape.draft_vocab)
        try:
            for loop in args.loops:
                for shapes in args.specforge_shapes:
                    add(specforge_row(bench, loop, counter, d2t.to(bench.device), t2d.to(bench.device), shapes))
        finally:
            counter.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
            shutil.rmtree(bench.work / "compile", ignore_errors=True)
    for mode, key in (("specforge", "vs_specforge"), ("specforge-shipped", "vs_specforge_shipped")):
        base = {r["loop"]: r["tokens_per_s"] for r in report["results"] if r["mode"] == mode and "error" not in r}
        for r in report["results"]:
            ref = base.get(r["loop"], base.get("online"))
            if "tokens_per_s" in r and ref:
                r[key] = round(r["tokens_per_s"] / ref, 3)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(run_metadata(resolved), **report), indent=1))
    table(report)
    return dict(run_metadata(resolved), **report)


def _line(r: dict) -> str:
    if "error" in r:
        return f"{r['loop']} {r['mode']}: FAILED {r['error'].splitlines()[0]}"
    return (f"{r['loop']} {r['mode']}: {r['tokens_per_s']:.0f} tok/s, warm-up {r['warmup_s']:.1f} s, "
            f"padding {r['padding_frac']:.1%}, {r['recompiles_after_warmup']} recompiles after warm-up")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(report: dict) -> None:
    """The results table, printed last (``vs SF``: against SpecForge at its steady state,
    ``vs SF*``: against SpecForge as shipped)."""
    d = report["data"]
    print(f"\n{report['shape']['name']}: {d['conversations']} conversations, {d['assistant_share']:.1%} assistant "
          f"tokens ({d['profile']}), mean {d['mean_length']:.0f} tokens; matmul {report['ceiling_tflops']:.3g} TFLOP/s")
    head = (f"{'loop':>8} {'mode':>17} {'tok/s':>9} {'vs SF':>6} {'vs SF*':>6} {'ms/step':>8} {'warm-up s':>9} {'startup s':>9} "
            f"{'pad %':>6} {'recomp':>6} {'busy %':>6} {'peak GiB':>8} {'dense fl':>8} {'trim fl':>8} {'wait %':>6}")
    print(head)
    for r in report["results"]:
        if "error" in r:
            print(f"{r['loop']:>8} {r['mode']:>17} failed: {r['error'].splitlines()[0][:80]}")
            continue
        print(f"{r['loop']:>8} {r['mode']:>17} {r['tokens_per_s']:>9.0f} {_fmt(r.get('vs_specforge'), '.2f'):>6} "
              f"{_fmt(r.get('vs_specforge_shipped'), '.2f'):>6} "
              f"{_fmt(r['ms_per_step_median'], '.1f'):>8} {r['warmup_s']:>9.1f} {r['startup_s']:>9.1f} "
              f"{100 * r['padding_frac']:>6.1f} {r['recompiles_after_warmup']:>6} "
              f"{_fmt(r.get('gpu_busy_pct'), '.0f'):>6} {_fmt(r['peak_gib'], '.2f'):>8} "
              f"{_fmt(r.get('floor_dense_frac'), '.0%'):>8} {_fmt(r.get('floor_trim_frac'), '.0%'):>8} "
              f"{_fmt(r.get('input_wait_frac'), '.1%'):>6}")


if __name__ == "__main__":
    import tyro

    sys.path.insert(0, str(BENCH_DIR))
    main(tyro.cli(BenchArgs))
