"""The training loop, as its stages: check the inputs, build the run (``build``), take
optimizer steps (``step``), evaluate the held-out conversations (``evaluate``), save
(``checkpoint``). ``train`` only orchestrates them.

SIGTERM or SIGINT (``io.stop``) finishes the optimizer step in flight, saves the
checkpoint and raises ``io.stop.Stopped`` (``stopped by SIGTERM at step N; rerun the
same command to resume``; the CLI exits 143 / 130); rerunning the command resumes
bitwise. Under torchrun the request rides the step's all-reduce of its finiteness
flags (a signal during the load: one all-reduce before the first step), so every rank
stops after the same step, saves and raises ``Stopped`` with the same signal, whether
every rank was signalled (torchrun passes a SIGTERM or SIGINT it receives on to every
rank) or only one. A second signal stops at once.

Writes ``metrics.jsonl`` (one row per logged step: loss, per-step kl/acc/accept, tau,
lr, grad norm, tokens/s, non-finite batches skipped; and a ``"split": "eval"`` row per
evaluation on the held-out conversations, ``metrics.py``), TensorBoard scalars with
``tensorboard``, and ``loss.png`` (``plot.plot_metrics``) in ``out_dir``.

``eval_holdout`` conversations at the end of the data never train; the training
objective runs on them with no grad every ``eval_every`` steps and at the end, the
first ``eval_accept_prompts`` of their prompts (the tokens before the first supervised
one) are decoded by speculative decoding for the acceptance length, whose best value
so far keeps ``checkpoint-best.pt`` beside the last checkpoint (its record survives a
resume), and the prompts are saved with the checkpoint for ``eagle3fn eval``. Checkpoints hold the masters, the optimizer, the
step, the data position, the RNG state and the run fingerprint; ``train`` resumes from
the one in ``out_dir`` and continues the same loss curve. Where the run compiles
(CUDA, or ``--compile-step``), ``compile-cache.bin`` keeps its compiled kernels beside the
checkpoint (written after a save or a stop that follows new compilations) and a resume
loads it first (``compile_cache``).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from eagle3fn.compiled import compile_backend
from eagle3fn.io.device import resolve_device
from eagle3fn.io.stop import Stopped, StopRequest, graceful_stop
from eagle3fn.parallel import all_reduce, is_main
from eagle3fn.train.build import Run, build_run, check_inputs, open_out_dir
from eagle3fn.train.checkpoint import BEST, CHECKPOINT, best_record
from eagle3fn.train.compile_cache import CompileCacheWriter, load_compile_cache
from eagle3fn.train.config import TrainConfig
from eagle3fn.train.evaluate import evaluate_holdout, holdout_acceptance
from eagle3fn.train.metrics import MetricsLog, read_metrics
from eagle3fn.train.plot import plot_metrics
from eagle3fn.train.progress import Progress
from eagle3fn.train.sources import prompt_of
from eagle3fn.train.step import StepResult, metrics_row, optimizer_step

METRICS = "metrics.jsonl"


def train(cfg: TrainConfig, *, log: Callable[[str], None] | None = None,
          on_step: Callable[[int], None] | None = None,
          on_grads: Callable[[int, dict[str, torch.Tensor]], None] | None = None) -> dict:
    """Run (or resume) training as configured; returns the last training metrics row.

    ``log`` receives every message, one line each, and a line every ``log_every``
    steps. Default: stdout, where a terminal gets a progress bar redrawn every step
    instead of the per-step lines (``progress.Progress``). ``on_step(step)`` is called
    after each optimizer step and its checkpoint (tests use it to interrupt a run);
    ``on_grads(step, grads)`` receives the whole (gathered) gradients of each optimizer
    step before clipping and the optimizer (tests compare them with a one-process
    oracle; under torchrun every rank must pass it).

    Inputs are checked before anything heavy loads (paths, the draft's shape and
    --max-length against the target's config, and with ``memory_check`` the step's
    estimated peak memory against the device's free memory: ``preflight``); a step whose loss or gradient norm
    is not finite stops the run (RunError) or, with ``on_nonfinite="skip"``, is dropped
    and counted; a resume with another run fingerprint stops, listing the differences.
    A run that fails before its first checkpoint leaves no out_dir it created behind.
    SIGTERM / SIGINT (handled while it runs, in the main thread) finish the step in
    flight, save, and raise ``io.stop.Stopped`` (module docstring).
    """
    live = log is None and sys.stdout.isatty()
    log = log or print
    if cfg.embedded_default:
        from eagle3fn.demo import demo_data_path
        from eagle3fn.io.smollm2 import smollm2_path

        cfg = dataclasses.replace(cfg, model=str(smollm2_path(log=log)), data=str(demo_data_path()))
        log(f"embedded default: target {cfg.model}, data {cfg.data}, preset {cfg.preset}")
    device, out = resolve_device(cfg.device), Path(cfg.out_dir)
    check_inputs(cfg, device, log)
    created = open_out_dir(out)
    try:
        with graceful_stop(unit="optimizer step") as stop:
            run = build_run(cfg, device, out, log)
            return _loop(run, log=log if is_main() else (lambda s: None), live=live and is_main(),
                         on_step=on_step, on_grads=on_grads, stop=stop)
    except BaseException:
        if created and not (out / CHECKPOINT).exists() and is_main():
            shutil.rmtree(out, ignore_errors=True)
        raise


class _Discard:
    """Metrics sink of the ranks other than 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def compile_notice() -> str:
    """The line a run on a compiling device logs before its first step: the first steps
    compile (so they are slow), and where the compiled kernels are cached for the next
    run."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return ("compiling: the first steps compile the draft's kernels with torch.compile (slowest on a "
            f"machine's first run; later runs reuse inductor's cache in {cache_dir()}, "
            "TORCHINDUCTOR_CACHE_DIR to move it, and a resume anywhere reuses the run's own copy, "
            "compile-cache.bin in its out_dir)")


def _loop(run: Run, *, log, live: bool, on_step, on_grads, stop: StopRequest) -> dict:
    """Optimizer steps to ``run.total``, with logging, held-out evaluation and saves;
    after a step that saw a stop request, a save and ``Stopped``. The loop's settings are
    read here, once; the steps, logs and evaluations below take them as values."""
    cfg = run.cfg
    epochs, seed, save_every, eval_every, log_every = (cfg.epochs, cfg.seed, cfg.save_every, cfg.eval_every,
                                                       cfg.log_every)
    accept = {"accept_prompts": cfg.eval_accept_prompts, "draft_tokens": cfg.ttt_length,
              "new_tokens": cfg.eval_accept_tokens}
    metrics = MetricsLog(run.out, resume_step=run.step, tensorboard=cfg.tensorboard) if is_main() else _Discard()
    progress = Progress(run.total, start=run.step, live=live, log=log)
    log = progress.message
    log(f"draft: H={run.draft_cfg.hidden_size} heads={run.draft_cfg.num_heads}/{run.draft_cfg.num_kv_heads} "
        f"Vd={run.draft_cfg.draft_vocab_size} k={cfg.ttt_length} trim={cfg.trim_mode}; "
        f"{len(run.examples)} conversations in {len(run.source.items)} batches/epoch, {len(run.held)} held "
        f"out; {run.total} optimizer steps on {run.device} ({str(run.precision).removeprefix('torch.')})")
    if compile_backend(run.device) is not None:
        log(compile_notice())
    load_compile_cache(run.out, log)  # nothing to do where nothing compiled (no file)
    writer = CompileCacheWriter(run.out, log) if is_main() else None  # writes only after compilations

    def save() -> None:  # the checkpoint, then the compile cache when graphs were compiled since
        run.save()
        if writer is not None:
            writer.update()

    last, tokens, t0 = {}, 0, time.perf_counter()
    best = best_record(run.out, run.step, run.fingerprint) if run.step else None
    if signum := _agreed_before_start(run, stop):  # during the load: nothing new to save
        progress.close()
        metrics.close()
        raise Stopped(signum, f"step {run.step}")
    while run.step < run.total and run.epoch < epochs:
        order = run.source.order(run.epoch, seed)
        while True:
            result = optimizer_step(run, order, log=log, on_grads=on_grads, stop_signal=lambda: stop.signal or 0)
            tokens += result.tokens
            last = _log_step(run, result, tokens, t0, metrics, progress, log, every=log_every) or last
            if run.holdout.items and (run.step == run.total
                                      or eval_every and run.step % eval_every == 0):
                best = _evaluate(run, metrics, log, best, **accept)
            if run.step % save_every == 0 or run.step == run.total:
                save()
            if on_step is not None:
                on_step(run.step)
            if signum := _agreed(run, result, stop):
                if not (run.step % save_every == 0 or run.step == run.total):  # not saved above
                    save()  # with the compile cache: a preempted run resumes warm on another machine
                progress.close()
                metrics.close()
                raise Stopped(signum, f"step {run.step}")
            if run.step >= run.total or run.pos == 0:
                break
    progress.close()
    save()
    metrics.close()
    if is_main() and read_metrics(run.out / METRICS):
        plot_metrics(run.out / METRICS, run.out / "loss.png", log=log)
    if last:
        skips = f"; {run.skipped} non-finite batches skipped" if run.skipped else ""
        log(f"done: {run.step} steps in {time.perf_counter() - t0:.0f} s; last loss {last['loss']:.4f}, "
            f"acc per step {[round(a, 2) for a in last['acc']]}, simulated tau {last['tau']:.2f}{skips}; "
            f"{run.checkpoint}, {run.out / METRICS}, {run.out / 'loss.png'}")
    return last


def _agreed(run: Run, result: StepResult, stop: StopRequest) -> int:
    """The signal to stop on after the step just taken, 0 to go on: one process reads
    its own request; several read the request all-reduced with the step's finiteness
    flags (``StepResult.stop``), the same on every rank whichever ranks were signalled
    (a rank that read its own flag alone would stop while its peers wait in the next
    step's collectives)."""
    return result.stop if run.layout else stop.signal or 0


def _agreed_before_start(run: Run, stop: StopRequest) -> int:
    """The signal of a stop requested while the run loaded, on any rank (one all-reduce
    under torchrun, before the first step's collectives), 0 for none."""
    if not run.layout:
        return stop.signal or 0
    flag = torch.full((), float(stop.signal or 0), device=run.device)
    return int(all_reduce(flag, "max"))


def _log_step(run: Run, result: StepResult, tokens: int, t0: float, metrics, progress, log, *,
              every: int) -> dict | None:
    """Write the step's metrics row every ``every`` steps (``log_every``; and the progress
    bar every step on a terminal); the row, when it is a finite one that was written."""
    wait = run.source.take_wait()  # this step's wait on input (reset every step)
    logged = run.step % every == 0 or run.step == run.total
    if not (logged or progress.live):
        return None
    counted = float(tokens)
    if run.layout and logged:  # tokens/s of the whole job (same steps on every rank)
        counted = float(all_reduce(torch.tensor(counted, device=run.device)))
    elapsed = time.perf_counter() - t0
    row = metrics_row(run.step, result.lr, result.grad_norm, result.objective, counted / elapsed, run.skipped)
    row["input_wait_s"] = round(wait, 6)  # offline: seconds the step waited for its batches
    # what tokens_per_s divides; both include the warm-up, which the difference of two rows cancels
    row["tokens"], row["elapsed_s"] = int(counted), round(elapsed, 6)
    if not result.nonfinite:
        progress.update(run.step, loss=row["loss"], acc0=row["acc"][0], tokens_per_s=row["tokens_per_s"])
    if not logged:
        return None
    metrics.write(row)
    if result.nonfinite:
        return None
    if not progress.live:
        log(f"step {run.step}/{run.total} loss {row['loss']:.4f} acc0 {row['acc'][0]:.3f} "
            f"tau {row['tau']:.2f} lr {result.lr:.2e} {row['tokens_per_s']:.0f} tok/s")
    return row


def _evaluate(run: Run, metrics, log, best: dict | None, *, accept_prompts: int, draft_tokens: int,
              new_tokens: int) -> dict | None:
    """The training objective on the held-out conversations and the acceptance length of
    speculative decoding of their first ``accept_prompts`` prompts (``eval_accept_prompts``;
    ``draft_tokens`` a round, ``new_tokens`` each), as a metrics row; a higher acceptance
    length than ``best`` writes checkpoint-best.pt. Returns the best record (``{"step",
    "acceptance_length"}``) after this evaluation."""
    params = run.compute_params()
    row = {"split": "eval", "step": run.step,
           **evaluate_holdout(params, run.holdout, run.ttt_cfg, d2t=run.d2t, t2d=run.t2d, layout=run.layout)}
    prompts = [prompt_of(e) for e in run.held[:accept_prompts]]
    if prompts:  # every rank decodes (the same greedy result), so none waits at a collective
        row.update(holdout_acceptance(run.target, params, run.draft_cfg, run.d2t, prompts,
                                      num_draft_tokens=draft_tokens, max_new_tokens=new_tokens))
    metrics.write(row)
    improved = bool(prompts) and (best is None or row["acceptance_length"] > best["acceptance_length"])
    if improved:
        best = {"step": run.step, "acceptance_length": row["acceptance_length"]}
        run.save(run.out / BEST, best=best)
    accept = (f", acceptance length {row['acceptance_length']:.2f} ({len(prompts)} prompts x "
              f"{new_tokens} tokens{'; best so far, saved ' + BEST if improved else ''})"
              if prompts else "")
    log(f"eval step {run.step}: held-out loss {row['loss']:.4f} acc0 {row['acc'][0]:.3f} "
        f"tau {row['tau']:.2f} ({len(run.held)} conversations){accept}")
    return best
