"""Typed training configuration (the CLI only overrides it) and named presets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from eagle3fn.loss import LossConfig


@dataclass(kw_only=True)
class TrainConfig:
    """Train an EAGLE-3 draft for a target, online (target in-process) or offline (cache)."""

    model: str = ""
    """Local HF target directory (online mode, and for the tokenizer / draft shape).
    With neither --model nor --data nor --cache: the embedded default, SmolLM2-135M-
    Instruct on the bundled demo conversations (then --draft-vocab-size, --max-length,
    --lr and --epochs left at their defaults become 8192, 512, 1e-3 and 3: a CPU-sized
    demo, about 7 minutes on 2 cores, ending with a speculative-decoding check)."""
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
    """Tokens per conversation."""
    on_error: Literal["raise", "skip"] = "raise"
    """Bad data lines: stop, or skip and count."""
    ttt_length: int = 7
    """k, unrolled TTT steps."""
    trim: Literal["none", "loss"] | None = None
    """Which rows to compute: ``none`` (every row at every step), ``loss`` (teacher,
    head, loss and metrics only at supervised rows; exact). Default: none, or loss with
    --trim-loss-positions."""
    trim_loss_positions: bool = False
    """Shorthand for ``--trim loss`` (SpecForge's flag name)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Step weights, normalisation, objective."""
    lr: float = 1e-4
    """Peak learning rate (AdamW)."""
    warmup_ratio: float = 0.015
    """Linear warm-up over this fraction of the optimizer steps, then cosine to 0."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 0.5
    """Clip the global gradient norm to this."""
    batch_size: int = 4
    """Conversations per micro-batch (online); cache shards are used as they are."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    epochs: int = 1
    """Passes over the data."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (default: the epochs)."""
    seed: int = 0
    """Data order and draft initialisation."""
    save_every: int = 100
    """Checkpoint every N optimizer steps (and at the end)."""
    log_every: int = 1
    """Print and record metrics every N optimizer steps."""
    device: str = "auto"
    """``cuda`` when available, else ``cpu``."""

    def __post_init__(self) -> None:
        if self.trim is not None and self.trim_loss_positions and self.trim != "loss":
            raise ValueError(f"--trim {self.trim} contradicts --trim-loss-positions; pass one")
        if not self.embedded_default and not self.cache and not (self.model and self.data):
            raise ValueError("give --model and --data (online), --model and --cache (offline), "
                             "or none of them for the embedded default")
        if self.grad_accum < 1 or self.batch_size < 1:
            raise ValueError("batch_size and grad_accum must be >= 1")

    @property
    def embedded_default(self) -> bool:
        """No target or data given: train the bundled SmolLM2 demo."""
        return not (self.model or self.data or self.cache)

    @property
    def trim_mode(self) -> str:
        """The effective trimming mode."""
        return self.trim or ("loss" if self.trim_loss_positions else "none")
