"""Typed training configuration (the CLI only overrides it) and named presets.

A preset is a function returning field values; ``TrainConfig(preset=...)`` gives them
to the fields still at their class defaults and not named by ``given_fields`` (the CLI
names the flags on its command line, so ``--preset demo --epochs 1`` trains one epoch;
in Python, ``TrainConfig.with_preset("demo", epochs=1)``). The embedded default applies
``demo``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib.util
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch

from eagle3fn.io.device import train_dtype
from eagle3fn.io.packing import PACK_WINDOW
from eagle3fn.loss import LossConfig
from eagle3fn.parallel.mesh import ParallelConfig

PresetName = Literal["demo", "smoke", "long-context"]
OFFLINE_ROW_TOKENS = 8192
"""Offline on CUDA with no --pack-length, a micro-batch of --batch-size rows of --max-length
becomes one row of batch_size x max_length tokens when that is at most this many (the same
positions per step, less padding; faster at the same peak memory where it was measured,
on the benchmark pages' offline rows). Online the target's attention over a packed row is
one dense masked SDPA, and eager draft attention (the CPU, --ttt.attention eager) is
O(row^2) likewise, so rows stay --max-length there."""

_PRECISIONS = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def _ttt_default(name: str):
    """``TTTConfig``'s default of a field (one source of truth for the values)."""
    from eagle3fn.unrolled.config import TTTConfig

    return {f.name: f.default for f in dataclasses.fields(TTTConfig)}[name]


@dataclass(kw_only=True)
class TTTOptions:
    """How the unrolled TTT step computes (``--ttt.*``): every ``TTTConfig`` field that
    the draft shape, ``--ttt-length``, ``--trim`` and ``--loss.*`` do not already set.
    All choices are exact; they trade speed and memory. Defaults are TTTConfig's."""

    attention: Literal["auto", "eager", "flex"] = _ttt_default("attention")
    """``eager`` (explicit scores, any device), ``flex`` (compiled FlexAttention, the GPU
    path), ``auto`` (flex on CUDA for heads of at least 16, else eager)."""
    loss_impl: Literal["auto", "torch", "triton"] = _ttt_default("loss_impl")
    """Soft cross-entropy and metrics: ``torch``, ``triton`` (indexed kernels), ``auto``
    (triton on CUDA)."""
    fused_head: bool = _ttt_default("fused_head")
    """Trimmed paths: norm + lm_head + loss in row chunks, logits recomputed in backward."""
    head_chunk_rows: int = _ttt_default("head_chunk_rows")
    """Most rows per chunk of the fused head."""
    teacher_chunk_size: int = _ttt_default("teacher_chunk_size")
    """Vocab entries per block of the teacher streamed from the final hidden."""
    auto_backbone_fraction: float = _ttt_default("auto_backbone_fraction")
    """``--trim auto``: the largest cost score at which the trimmed backbone is taken."""
    auto_loss_share: float = _ttt_default("auto_loss_share")
    """``--trim auto``: the share of the trimmed path's cost that goes with supervised rows."""
    auto_min_rows: int = _ttt_default("auto_min_rows")
    """``--trim auto``: batches with fewer own rows take the full path."""
    compile_elementwise: bool = _ttt_default("compile_elementwise")
    """On CUDA: fuse the draft's elementwise chains with torch.compile (off: eager)."""
    query_buckets: int = _ttt_default("query_buckets")
    """Flex path: at most this many compiled kernels per key length (packed query rows
    rounded up to ``Lp / query_buckets``)."""
    flex_kernel_options: str | None = None
    """FlexAttention ``kernel_options`` on CUDA as a JSON object, e.g.
    ``'{"BLOCK_M": 64, "num_warps": 4}'``; unset: inductor's defaults."""

    def __post_init__(self) -> None:
        if self.flex_kernel_options is not None:
            try:
                options = json.loads(self.flex_kernel_options)
            except json.JSONDecodeError as e:
                raise ValueError(f"--ttt.flex-kernel-options {self.flex_kernel_options!r} is not JSON ({e}); "
                                 "pass an object such as '{\"BLOCK_M\": 64}'") from e
            if not isinstance(options, dict):
                raise ValueError(f"--ttt.flex-kernel-options {self.flex_kernel_options!r} must be a JSON object")
        for flag in ("head_chunk_rows", "teacher_chunk_size", "auto_min_rows", "query_buckets"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--ttt.{flag.replace('_', '-')} {getattr(self, flag)}: must be >= 1")

    def config_fields(self) -> dict:
        """The ``TTTConfig`` keyword arguments these options set."""
        out = dataclasses.asdict(self)
        options = out.pop("flex_kernel_options")
        out["flex_kernel_options"] = None if options is None else tuple(sorted(json.loads(options).items()))
        return out


def demo_preset() -> dict:
    """The CPU-sized demo of the embedded default (SmolLM2-135M-Instruct, 96 bundled
    conversations): an 8192-token draft vocab, 512 tokens per conversation, lr 1e-3,
    3 epochs, the last 8 conversations held out and evaluated every 22 steps (once
    per epoch), one conversation per row (``pack`` off: packed into 512-token rows its
    88 short conversations, mean 165 tokens, would leave 8 optimizer steps per epoch
    instead of 22, too few for this CPU-sized schedule), and one training-time-test
    step (``ttt_length`` 1): the demo decodes with one draft token per round (the
    fastest k measured for a minutes-trained draft on the 2-core CPU), and on that CPU
    the 66 steps then take 126 s instead of 222 s in fp32 (64 s in bf16, ``--precision
    auto`` on a CPU with AMX) and reach a held-out first-token accuracy of 0.19 instead
    of 0.16 (docs/results.md, "The CPU demo")."""
    return {"draft_vocab_size": 8192, "max_length": 512, "lr": 1e-3, "epochs": 3,
            "eval_holdout": 8, "eval_every": 22, "pack": False, "ttt_length": 1}


def smoke_preset() -> dict:
    """A very short run to check a setup end to end: 4 optimizer steps, a checkpoint
    every 2."""
    return {"max_steps": 4, "save_every": 2}


def long_context_preset() -> dict:
    """Long conversations: one per micro-batch, up to 32768 tokens, loss trimming on."""
    return {"batch_size": 1, "max_length": 32768, "trim": "loss"}


PRESETS = {"demo": demo_preset, "smoke": smoke_preset, "long-context": long_context_preset}
_GIVEN: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("eagle3fn_given_fields",
                                                                        default=frozenset())


@contextlib.contextmanager
def given_fields(names: Iterable[str]) -> Iterator[None]:
    """Within it, a ``TrainConfig``'s preset leaves the fields ``names`` as given, even
    where the value given equals the class default (``--preset demo --epochs 1``)."""
    token = _GIVEN.set(frozenset(names))
    try:
        yield
    finally:
        _GIVEN.reset(token)


@dataclass(kw_only=True)
class TrainConfig:
    """Train an EAGLE-3 draft for a target, online (target in-process) or offline (cache)."""

    model: str = ""
    """Local HF target directory (online mode, and for the tokenizer / draft shape).
    With neither --model nor --data nor --cache: the embedded default,
    SmolLM2-135M-Instruct on the bundled demo conversations with ``--preset demo``
    (a CPU-sized demo, under 10 minutes on 2 cores, ending with the acceptance length
    of the untrained and the trained draft by speculative decoding)."""
    gguf_file: str | None = None
    """GGUF file inside ``model`` to load from."""
    data: str = ""
    """Chat JSONL (online mode)."""
    cache: str | None = None
    """Offline feature cache from ``eagle3fn prepare`` (replaces running the target)."""
    out_dir: str = "runs/eagle3fn"
    """Checkpoints, metrics.jsonl, loss.png, the exported draft."""
    vocab_map: str | None = None
    """d2t/t2d file from ``eagle3fn vocab``; default: built from the data and saved in out_dir."""
    draft_vocab_size: int = 32000
    """Vd (capped at the target vocab)."""
    aux_layer_ids: tuple[int, int, int] | None = None
    """Target layers captured (default [1, N//2-1, N-4])."""
    max_length: int = 2048
    """Tokens per conversation (longer ones are cut); with --pack also per packed row,
    unless --pack-length says otherwise. At most the target's positions
    (``max_position_embeddings``, or what its RoPE scaling extends them to) unless
    --allow-long."""
    allow_long: bool = False
    """Allow --max-length beyond the target's positions: its ``max_position_embeddings``,
    or for a ``linear``, ``yarn`` or ``llama3`` RoPE scaling the larger of that and
    ``factor x original_max_position_embeddings``. Past them the target's features come
    from positions it was never trained at. (A ``dynamic`` or ``longrope`` target past
    its fixed-frequency range is refused either way: the draft cannot follow it.)"""
    pack: bool = True
    """Pack several conversations per row of --pack-length tokens (best fit, longest
    first, inside windows of --pack-window consecutive conversations; never splitting
    one; offline across the cache's shards, the held-out ones packed apart): batches of
    one shape and little padding, every conversation trained exactly as if alone
    (positions restart, attention and rows stay inside it; SPEC section 9). On by
    default (less padding, so more real tokens per step); off under sequence
    parallelism (--parallel.ring/ulysses > 1),
    which splits one row across ranks, and with --no-pack. --batch-size then counts
    packed rows. ``token_mean`` is unchanged by packing; ``local_mean`` divides by the
    positions the batch holds, padding included (rows x --pack-length; unpacked:
    conversations x the longest), so the loss sums are the same and the means differ
    by exactly the ratio of those counts. --no-pack gives SpecForge's batches (one
    conversation per row, padded to the longest)."""
    pack_length: int | None = None
    """Tokens per packed row (>= --max-length; default --max-length, except offline on CUDA:
    one row of --batch-size x --max-length per micro-batch when that is at most 8192,
    ``OFFLINE_ROW_TOKENS``; pass --pack-length to choose). Conversations are
    still cut at --max-length, so e.g. --pack-length 8192 --batch-size 1 replaces 4 rows
    of 2048 with one of 8192 and fills it better: less padding where conversations are
    long next to --max-length (benchmarks/packing.py measures it on chat data).
    Offline this costs nothing more; online the target's attention over a packed row
    (SDPA with a materialized [N, N] block-diagonal mask) costs O(N^2) per row, up to
    N / max_length times an unpacked row's, and the draft's eager (CPU) attention
    likewise; the draft's FlexAttention on CUDA skips the blocks outside the documents."""
    pack_window: int = PACK_WINDOW
    """Conversations packed together (consecutive in the data, or in the cache's shard
    order), longest first, each into the fullest row it fits (best-fit decreasing); a
    window's rows stay open through the next window, so a row mixes conversations at
    most 2 x this apart. Larger fills rows better but mixes conversations from further
    apart; measured padding: the --pack-length docstring and benchmarks/packing.py."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad data lines: stop, or skip and count."""
    ttt_length: int = 7
    """k, unrolled TTT steps."""
    trim: Literal["none", "loss", "backbone", "auto"] | None = None
    """Which rows to compute (all exact): ``none`` (every row at every step),
    ``loss`` (teacher, head, loss and metrics only at supervised rows), ``backbone``
    (also the draft layer only on the rows a later loss needs), ``auto`` (per batch,
    backbone or none by measured cost). Default: auto (the fastest end to end on the
    GPU), or loss with --trim-loss-positions."""
    trim_loss_positions: bool = False
    """Shorthand for ``--trim loss`` (SpecForge's flag name)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Step weights, normalisation, objective."""
    ttt: TTTOptions = field(default_factory=TTTOptions)
    """How the TTT step computes (attention, loss kernels, head chunks, the auto rule,
    compilation); exact whatever the choice."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = 0.015
    """Linear warm-up over this fraction of the optimizer steps, then cosine to 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float | None = 0.5
    """Clip the global gradient norm to this (> 0); ``None`` turns clipping off
    explicitly (the norm is still measured, logged and checked)."""
    batch_size: int = 4
    """Conversations per micro-batch (online), or packed rows with --pack (online and
    offline); an unpacked cache's shards are used as they are."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (>= 1; default: the epochs)."""
    seed: int = 0
    """Data order and draft initialisation."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (and at the end)."""
    log_every: int = 1
    """Print and record metrics every N optimizer steps."""
    device: str = "auto"
    """``cuda`` when available, else ``cpu``."""
    precision: Literal["auto", "bfloat16", "float32", "float64"] = "auto"
    """Compute dtype of the target and the draft step (masters stay fp32, fp64 with
    float64): ``auto`` is bf16 on CUDA and on a CPU with AMX (bf16 matrix units: the
    target's forward is about 5x fp32's there), fp32 on other CPUs; float64 is for
    exactness checks."""
    compile_step: bool = False
    """Run each optimizer step (teacher, k TTT steps, loss, gradients, clip, AdamW) as
    one compiled graph (``train.onegraph``; one per batch shape, whatever the trimmed row
    counts): the same maths as the eager step, a few host operations per step instead of
    thousands. Needs packed rows, one process and --grad-accum 1; every --trim mode
    (auto: one graph for each path it takes); the first step compiles. Off by default:
    the eager step."""
    compile_target: bool = True
    """On CUDA: compile the target's decoder layers with torch.compile to fuse their
    elementwise work (one graph for all of them, one extra compilation at the first
    batch; fewer kernel launches per step). Results
    differ only by rounding, so a run may resume with either. The CPU runs eagerly."""
    memory_check: bool = True
    """Before anything loads, estimate the peak memory of a step (``eagle3fn plan``'s
    model of the draft step with its optimizer state, at --batch-size rows of
    --pack-length / --max-length tokens and 30% supervised, plus online the target's
    weights, hidden states and attention mask) and refuse a run that cannot fit in the
    device's free memory (CUDA: free GPU memory; CPU: available RAM and any cgroup
    limit), naming the numbers and the fix. --no-memory-check runs it anyway."""
    on_nonfinite: Literal["error", "skip"] = "error"
    """A step whose loss or gradient norm is NaN/Inf: ``error`` stops the run naming the
    step, the batch and the last good checkpoint (nothing non-finite is saved);
    ``skip`` drops that batch's update and counts it (``nonfinite_skipped`` in
    metrics.jsonl and the final summary)."""
    eval_holdout: int = 0
    """Conversations at the end of the data kept out of training and out of the vocab
    map (offline: the cache's trailing shards holding exactly this many). The training
    objective runs on them with no grad (--eval-every, and at the end; under sequence
    parallelism in the run's layout, each rank computing its chunk), and ``eagle3fn
    eval`` takes its prompts from them. A resumed run must hold out the same number."""
    eval_every: int = 0
    """Evaluate on the held-out conversations every N optimizer steps (0: only at the
    end); needs --eval-holdout."""
    eval_accept_prompts: int = 4
    """At each evaluation also decode the first min(N, --eval-holdout) held-out prompts
    by greedy speculative decoding (KV-cached, one batch, --ttt-length draft tokens per
    round) and record their acceptance length in metrics.jsonl; the best one so far
    keeps its checkpoint as checkpoint-best.pt (``eagle3fn export`` exports it with its
    best flag). 0: off."""
    eval_accept_tokens: int = 32
    """New tokens per prompt in that decoding (>= 1)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Sequence parallelism under ``torchrun`` (data parallelism takes the remaining
    ranks): see docs/tutorials/sequence-parallel.md."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to out_dir/tb (needs ``pip install
    tensorboard``)."""
    preset: PresetName | None = None
    """Named values for the fields not given: ``demo`` (the
    embedded default's CPU demo: --draft-vocab-size 8192 --max-length 512 --lr 1e-3
    --epochs 3 --eval-holdout 8 --eval-every 22 --no-pack --ttt-length 1; applied automatically to the
    embedded default), ``smoke`` (check a setup: --max-steps 4 --save-every 2),
    ``long-context`` (--batch-size 1 --max-length 32768 --trim loss). A flag given
    with a preset wins."""

    @classmethod
    def with_preset(cls, preset: PresetName, **values) -> TrainConfig:
        """``TrainConfig(preset=preset, **values)`` with every value given kept, even one
        equal to its class default (``with_preset("demo", epochs=1)``: one epoch)."""
        with given_fields(values):
            return cls(preset=preset, **values)

    def __post_init__(self) -> None:
        if self.preset is None and self.embedded_default:
            self.preset = "demo"
        if self.preset is not None:
            if self.preset not in PRESETS:
                raise ValueError(f"unknown preset {self.preset!r}; use one of {sorted(PRESETS)}")
            defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
            given = _GIVEN.get()
            for name, value in PRESETS[self.preset]().items():
                if name not in given and getattr(self, name) == defaults[name]:
                    setattr(self, name, value)
        if self.trim is not None and self.trim_loss_positions and self.trim != "loss":
            raise ValueError(f"--trim {self.trim} contradicts --trim-loss-positions; pass one")
        if not self.embedded_default and not self.cache and not (self.model and self.data):
            raise ValueError("give --model and --data (online), --model and --cache (offline), "
                             "or none of them for the embedded default")
        self._check_numbers()
        if self.loss.objective == "lambda" and self.grad_accum > 1:
            raise ValueError(f"--loss.objective lambda with --grad-accum {self.grad_accum}: its weight depends "
                             "on the whole step's acceptance, which one micro-batch cannot see; use "
                             "--grad-accum 1 (a larger --batch-size, or data parallelism) with lambda")
        self._check_compile_step()
        if self.eval_holdout < 0 or self.eval_every < 0:
            raise ValueError(f"--eval-holdout {self.eval_holdout} and --eval-every {self.eval_every} "
                             "must be >= 0")
        if self.eval_accept_prompts < 0 or self.eval_accept_tokens < 1:
            raise ValueError(f"--eval-accept-prompts {self.eval_accept_prompts} must be >= 0 (0: off) and "
                             f"--eval-accept-tokens {self.eval_accept_tokens} >= 1; e.g. "
                             "--eval-accept-prompts 4 --eval-accept-tokens 32")
        if self.eval_every and not self.eval_holdout:
            raise ValueError(f"--eval-every {self.eval_every} needs held-out conversations: "
                             "add --eval-holdout N (e.g. 8)")
        if self.tensorboard and importlib.util.find_spec("tensorboard") is None:
            raise ValueError("--tensorboard needs the tensorboard package: pip install tensorboard "
                             "(or pip install 'eagle3fn[tensorboard]'), or drop --tensorboard")

    def _check_numbers(self) -> None:
        """Every numeric flag in its range, each failure naming the flag, value and fix."""
        def need(ok: bool, flag: str, value, rule: str) -> None:
            if not ok:
                raise ValueError(f"--{flag} {value}: must be {rule}")

        finite = lambda x: isinstance(x, (int, float)) and math.isfinite(x)  # noqa: E731
        need(finite(self.lr) and self.lr > 0, "lr", self.lr, "a finite number > 0, e.g. 1e-4")
        need(finite(self.warmup_ratio) and 0 <= self.warmup_ratio < 1, "warmup-ratio",
             self.warmup_ratio, "in [0, 1), e.g. 0.015")
        need(finite(self.weight_decay) and self.weight_decay >= 0, "weight-decay", self.weight_decay,
             "a finite number >= 0")
        need(self.grad_clip is None or (finite(self.grad_clip) and self.grad_clip > 0), "grad-clip",
             self.grad_clip, "a finite number > 0 (e.g. 0.5), or None to turn clipping off")
        need(self.max_steps is None or self.max_steps >= 1, "max-steps", self.max_steps,
             ">= 1 (or left unset to train all --epochs)")
        for flag in ("epochs", "save_every", "log_every", "batch_size", "grad_accum", "ttt_length",
                     "draft_vocab_size"):
            need(getattr(self, flag) >= 1, flag.replace("_", "-"), getattr(self, flag), ">= 1")
        need(self.max_length >= 2, "max-length", self.max_length, ">= 2 (a prompt and an answer token)")
        need(self.seed >= 0, "seed", self.seed, ">= 0")
        need(self.pack_length is None or self.pack_length >= self.max_length, "pack-length", self.pack_length,
             f">= --max-length ({self.max_length}): a row holds at least one whole conversation "
             "(or leave it unset: rows of --max-length)")
        need(self.pack_window >= 1, "pack-window", self.pack_window, ">= 1, e.g. 256")

    def _check_compile_step(self) -> None:
        """--compile-step's refusals, each naming the flag and the fix (torchrun's is
        ``build``'s, which knows the world)."""
        if not self.compile_step:
            return
        if self.parallel.sp > 1:
            raise ValueError("--compile-step runs without sequence parallelism; drop --compile-step or "
                             "--parallel.ring/--parallel.ulysses")
        if self.grad_accum > 1:
            raise ValueError(f"--compile-step takes one micro-batch per optimizer step: pass --grad-accum 1 "
                             f"(not {self.grad_accum}) with a larger --batch-size, or drop --compile-step")
        if not self.pack:
            raise ValueError("--compile-step needs packed rows (one shape per batch): drop --no-pack, or drop "
                             "--compile-step")

    def refuse_ignored_flags(self) -> None:
        """What the command line refuses and the library only notes (``train`` logs it):
        ``--data`` beside ``--cache``, which offline training never reads. UsageError
        naming both and the fix."""
        if self.cache and self.data:
            from eagle3fn.errors import UsageError

            raise UsageError(f"--data {self.data} and --cache {self.cache} given together: offline training "
                             f"reads the conversations' features from the cache and never reads --data; drop "
                             f"--data to train offline, or --cache to train online on {self.data}")

    @property
    def embedded_default(self) -> bool:
        """No target or data given: train the bundled SmolLM2 demo."""
        return not (self.model or self.data or self.cache)

    @property
    def packs(self) -> bool:
        """Whether batches are packed: ``pack``, except under sequence parallelism (it
        splits one row across ranks and does not keep packed conversations apart)."""
        return self.pack and self.parallel.sp == 1

    @property
    def row_length(self) -> int:
        """Positions per packed row: ``pack_length``, default ``max_length``."""
        return self.max_length if self.pack_length is None else self.pack_length

    def packed_rows(self, device: torch.device) -> tuple[int, int]:
        """``(rows per micro-batch, tokens per row)`` of packed batches on ``device``:
        ``(batch_size, row_length)``, or offline on CUDA with FlexAttention and no
        --pack-length ``(1, batch_size * max_length)`` when that is at most
        ``OFFLINE_ROW_TOKENS`` (the measured faster default)."""
        long_rows = (self.cache is not None and self.pack_length is None and device.type == "cuda"
                     and self.ttt.attention != "eager" and self.batch_size > 1
                     and self.batch_size * self.max_length <= OFFLINE_ROW_TOKENS)
        return (1, self.batch_size * self.max_length) if long_rows else (self.batch_size, self.row_length)

    @property
    def trim_mode(self) -> str:
        """The effective trimming mode."""
        return self.trim or ("loss" if self.trim_loss_positions else "auto")

    def compute_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the target and the draft step run in on ``device``: ``precision``,
        where ``auto`` is bf16 on CUDA and on CPUs with AMX, fp32 on other CPUs
        (``io.device.train_dtype``)."""
        return train_dtype(device) if self.precision == "auto" else _PRECISIONS[self.precision]
