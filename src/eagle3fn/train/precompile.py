"""Compiling the draft step while a run loads (``--precompile``).

A run on a compiling device (CUDA) compiles its draft step's graphs (the fused
elementwise chains, FlexAttention, the teacher's vocab-chunk update; forward and
backward) during its first optimizer step, after the target has loaded: on a fresh
machine that first step took ~38 s at 8B shapes (docs/benchmarks.md). Those graphs
depend only on the draft's shape, the compute dtype, the trim path, whether batches are
packed and the ``--ttt.*`` options, all known from the flags and the target's
config.json before anything loads. So ``start_precompile`` runs the same step
(``unrolled.ttt`` forward and backward, through the same functions) on a synthetic
batch in a background thread while the main thread loads the target and the data, and
the run waits for it (``Precompile.join``) at the end of its build, before its first
step, which then finds every graph compiled (dynamo's cache lives on the code objects,
shared by the threads).

What it must not do, and the tests check: change anything the run computes (its
parameters, gradients, metrics, checkpoint, RNG state: the synthetic batch uses its own
generator and throwaway parameters, and nothing in the step draws random numbers), or
hide a failure (a precompile that fails is logged, and the first step compiles as
without it).

Two threads, one process. Dynamo's config is per thread since torch 2.12, so the
thread sets what the main thread sets (``compiled.configure_dynamo``). But dynamo saves
and restores process-wide state around every frame it compiles (the default dtype, the
RNG states, deterministic algorithms, fp32 matmul precision: ``preserve_global_state``),
and raises if another thread changed it meanwhile; the main thread's ``transformers``
sets the default dtype while it builds the target. So: everything the main thread
builds meanwhile names its dtypes (``draft.init_params``; ``io.target.load_target``
casts the whole model to the compute dtype after loading, whatever a restore did to a
part of it), the join sets the default dtype back if a restore left it changed, and
runs before a resumed run restores its RNG state; a pass that saw the default dtype
change, or that dynamo stopped for a change of global state, is run again
(``MAX_PASSES``).

Not used under torchrun or sequence parallelism (their collectives need every rank),
nor where nothing compiles (the CPU): ``start_precompile`` returns None there.

Legend: B batch rows, T row length, H draft hidden, Ht target hidden, V target vocab,
Vd draft vocab, k TTT length.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from eagle3fn.compiled import compile_backend, configure_dynamo
from eagle3fn.draft import DraftConfig
from eagle3fn.shapes import Features
from eagle3fn.train.config import TrainConfig
from eagle3fn.unrolled import TTTConfig

SYNTHETIC_LENGTH = 1024
"""The most positions per row of the synthetic batch (shorter rows: the run's own).
The graphs are shape-dynamic, so a shorter row compiles the same graphs in less memory."""


def trim_paths(trim: str) -> tuple[str, ...]:
    """The trim paths a run with ``--trim trim`` can take: ``auto`` takes ``backbone`` or
    ``none`` per batch (``unrolled.policy.choose_trim``), the others themselves."""
    return ("backbone", "none") if trim == "auto" else (trim,)


def synthetic_batch(*, batch_size: int, length: int, packed: bool, vocab_size: int, target_hidden: int,
                    ttt_length: int, dtype: torch.dtype, device: torch.device) -> tuple[Features, object]:
    """A batch shaped as the run's, for compiling only: ``(Features, HostMasks)``.

    Rows of ``length`` positions (at least ``2 * ttt_length + 8``); packed: each row
    holds three documents (positions restarting at 0, starts off FLEX_BLOCK
    boundaries), unpacked: one conversation per row, later rows right-padded. In each
    conversation the last third is supervised, so every step has rows. Token ids come
    from a generator of its own (the run's RNG is untouched); features are zeros.

    Returns:
        ``Features``: ``input_ids`` int64 ``[B, T]``, ``aux`` ``[B, T, 3*Ht]``,
        ``attention_mask`` int64 ``[B, T]``, ``final_hidden`` ``[B, T, Ht]``,
        ``target_head`` ``[V, Ht]`` (zeros), ``positions`` int64 ``[B, T]`` or None;
        and ``train.sources.HostMasks`` (loss mask bool ``[B, T]``, attention mask,
        positions) on the host.
    """
    from eagle3fn.train.sources import HostMasks, send

    B, T = batch_size, max(length, 2 * ttt_length + 8)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab_size, (B, T), generator=g)
    attention = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    positions = torch.zeros(B, T, dtype=torch.long) if packed else None
    for b in range(B):
        if packed:  # three documents filling the row
            cuts = [0, T * 5 // 12, T * 9 // 12, T]
        else:  # one conversation, shorter in later rows (right padding)
            cuts = [0, T - (b * T) // (4 * B)]
        for start, end in zip(cuts, cuts[1:]):
            attention[b, start:end] = 1
            loss[b, end - (end - start) // 3:end] = True
            if positions is not None:
                positions[b, start:end] = torch.arange(end - start)
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype, device=device)  # noqa: E731
    features = Features(input_ids=send(ids, device), aux=zeros(B, T, 3 * target_hidden),
                        attention_mask=send(attention, device), final_hidden=zeros(B, T, target_hidden),
                        target_head=zeros(vocab_size, target_hidden),
                        positions=None if positions is None else send(positions, device))
    return features, HostMasks(loss, attention, positions)


def synthetic_params(draft: DraftConfig, *, master: torch.dtype, dtype: torch.dtype,
                     device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Throwaway draft parameters as a run's step sees them: ``(masters, compute)``,
    the trainable masters zeros (norms ones) in ``master`` with grad, ``compute`` their
    casts to ``dtype`` (``train.build.Run.compute_params``) and the frozen embedding
    ``[V, H]`` in ``dtype``. Nothing random: the run's RNG is untouched."""
    from eagle3fn.draft import FROZEN, RMSNorm
    from eagle3fn.unrolled.unroll import skeleton

    module = skeleton(draft)
    norms = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, RMSNorm)}
    masters, compute = {}, {}
    for name, p in module.named_parameters():
        fill = torch.ones if name in norms else torch.zeros
        if name in FROZEN:
            compute[name] = fill(p.shape, dtype=dtype, device=device)
            continue
        masters[name] = fill(p.shape, dtype=master, device=device).requires_grad_(True)
        compute[name] = masters[name].to(dtype)
    return masters, compute


def synthetic_vocab_map(vocab_size: int, draft_vocab_size: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t [Vd], t2d bool [V])`` of ``Vd`` target ids spread evenly over the vocab
    (every vocab chunk of the teacher holds some), as ``vocab.build_vocab_map`` lays
    them out."""
    from eagle3fn.vocab import build_vocab_map

    counts = torch.zeros(vocab_size, dtype=torch.long)
    counts[torch.arange(draft_vocab_size) * (vocab_size - 1) // max(draft_vocab_size - 1, 1)] = 1
    d2t, t2d = build_vocab_map(counts, draft_vocab_size)
    return d2t.to(device), t2d.to(device)


def compile_step(draft: DraftConfig, ttt_cfg: TTTConfig, trims: tuple[str, ...], *, batch_size: int,
                 length: int, packed: bool, target_hidden: int, master: torch.dtype, dtype: torch.dtype,
                 device: torch.device) -> None:
    """One forward and backward of ``unrolled.ttt`` per trim path on a synthetic batch
    (``synthetic_batch``, ``synthetic_params``): what compiles the run's graphs. The
    row map is built as the run builds it (``train.sources.batch_rowmap`` from host
    masks)."""
    from eagle3fn.train.sources import batch_rowmap
    from eagle3fn.unrolled import ttt

    features, masks = synthetic_batch(batch_size=batch_size, length=length, packed=packed,
                                      vocab_size=draft.vocab_size, target_hidden=target_hidden,
                                      ttt_length=ttt_cfg.ttt_length, dtype=dtype, device=device)
    d2t, t2d = synthetic_vocab_map(draft.vocab_size, draft.draft_vocab_size, device)
    _masters, compute = synthetic_params(draft, master=master, dtype=dtype, device=device)  # grads land in _masters
    for trim in trims:
        rowmap = batch_rowmap(features, masks, ttt_cfg.ttt_length)
        obj = ttt(compute, features, rowmap, dataclasses.replace(ttt_cfg, trim=trim), d2t=d2t, t2d=t2d)
        obj.objective.backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


ERROR_FILE = "precompile-error.txt"
"""Where a failed precompile's traceback goes, in the run's out_dir."""

MAX_PASSES = 3
"""The most synthetic steps a precompile runs (``start_precompile``): another one follows
while the default dtype changed during the last."""


class DefaultDtypeWatch:
    """Counts the calls of ``torch.set_default_dtype`` (from any thread) that change it,
    while open.

    The default dtype is process-wide and dynamo guards it: a graph compiled while the
    main thread's ``transformers`` builds the target under its own default dtype
    (``from_pretrained`` sets it for the model's construction) fails that guard at the
    run's first step and compiles again there. A precompile pass during which the
    default dtype was set, or that did not run under the run's default dtype, is
    therefore run again (``MAX_PASSES``): the graphs that compiled under the run's
    default dtype are reused, the others compile anew."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = None

    def __enter__(self) -> "DefaultDtypeWatch":
        real = self._real = torch.set_default_dtype

        def counted(d):
            self.calls += d != torch.get_default_dtype()  # a change, not a set to the same dtype
            return real(d)
        torch.set_default_dtype = counted
        return self

    def __exit__(self, *exc) -> None:
        torch.set_default_dtype = self._real


@dataclasses.dataclass(eq=False)
class Precompile:
    """A draft step compiling in a background thread (``start_precompile``): its
    passes (``MAX_PASSES``), start and end times, and the error that stopped it."""

    thread: threading.Thread
    trims: tuple[str, ...]
    started: float
    default_dtype: torch.dtype
    finished: float | None = None
    error: BaseException | None = None
    passes: int = 0

    def join(self, log: Callable[[str], None], out: Path | None = None) -> None:
        """Wait for the thread and say what it did, one line: how long it compiled,
        how long the run waited for it, or why it failed (the first step then compiles
        what is missing, as without a precompile; with ``out``, the failure's whole
        traceback is written to ``out/precompile-error.txt`` and the line names it)."""
        t0 = time.perf_counter()
        self.thread.join()
        waited = time.perf_counter() - t0
        if torch.get_default_dtype() != self.default_dtype:  # dynamo's restore of another thread's setting
            torch.set_default_dtype(self.default_dtype)
            log(f"precompile: the default dtype was left at {torch.get_default_dtype()} by a compile that "
                f"overlapped the target's construction; set back to {self.default_dtype}")
        if self.error is not None:
            where = ""
            if out is not None:
                (out / ERROR_FILE).write_text("".join(traceback.format_exception(self.error)))
                where = f"; traceback in {out / ERROR_FILE}"
            first = (str(self.error).splitlines() or [""])[0][:200]
            log(f"precompile: failed ({type(self.error).__name__}: {first}); the first step compiles "
                f"instead (waited {waited:.1f} s{where})")
            return
        again = (f" ({self.passes} passes: the default dtype changed while one ran)" if self.passes > 1
                 else "")
        log(f"precompile: the draft step's graphs ({', '.join(self.trims)}) compiled in "
            f"{self.finished - self.started:.1f} s{again} while the run loaded; waited {waited:.1f} s for them")


def start_precompile(cfg: TrainConfig, device: torch.device, ttt_cfg: TTTConfig, *,
                     target_hidden: int, master: torch.dtype, dtype: torch.dtype) -> Precompile | None:
    """Start compiling the draft step of ``cfg``'s run in a background thread
    (``compile_step``; module docstring), or None: ``--precompile`` off, nothing
    compiles on ``device``, or a distributed run."""
    if (not cfg.precompile or compile_backend(device) is None or "WORLD_SIZE" in os.environ
            or cfg.parallel.sp > 1):
        return None
    trims = trim_paths(cfg.trim_mode)
    length = min(cfg.row_length if cfg.packs else cfg.max_length, SYNTHETIC_LENGTH)
    default_dtype = torch.get_default_dtype()  # the run's, which its graphs are guarded on
    job = Precompile(thread=None, trims=trims, started=time.perf_counter(),  # type: ignore[arg-type]
                     default_dtype=default_dtype)
    index = (device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else None  # a new thread starts on device 0

    def work() -> None:
        try:
            configure_dynamo()
            if index is not None:
                torch.cuda.set_device(index)
            for job.passes in range(1, MAX_PASSES + 1):
                with DefaultDtypeWatch() as watch:
                    before = torch.get_default_dtype()
                    try:
                        compile_step(ttt_cfg.draft, ttt_cfg, trims, batch_size=cfg.batch_size, length=length,
                                     packed=cfg.packs, target_hidden=target_hidden, master=master, dtype=dtype,
                                     device=device)
                    except AssertionError as e:  # dynamo: the main thread changed global state meanwhile
                        if "state changed while dynamo tracing" not in str(e) or job.passes == MAX_PASSES:
                            raise
                        continue
                if not watch.calls and before == torch.get_default_dtype() == default_dtype:
                    break
        except BaseException as e:  # noqa: BLE001 - reported by join, never lost
            job.error = e
        finally:
            job.finished = time.perf_counter()
    job.thread = threading.Thread(target=work, name="eagle3fn-precompile", daemon=True)
    job.thread.start()
    return job
