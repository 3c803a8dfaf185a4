"""Before anything loads: will one training step fit in the device's memory?

``step_memory`` estimates the peak bytes of one step on one rank from the shapes
alone: ``eagle3fn plan``'s model of the draft step (``plan.estimate`` with the
optimizer state, at ``--batch-size`` rows of the longest a row can be, 30% of the
positions supervised as a tail), plus, online, the target's weights and what its
forward holds beside the draft's resident state (every layer's hidden states, which
the features are taken from, and the ``[B, 1, S, S]`` attention mask of packed or
padded rows). ``check_memory`` compares it with the device's free memory (CUDA:
``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of /proc/meminfo and any cgroup
limit) and refuses a run that cannot fit (UsageError with the numbers and the fix).

The estimate is a model, not a measurement: the draft step's constants are calibrated on
one GPU (docs/tutorials/plan.md), the target's count covers a Llama-shaped decoder
(attention, SwiGLU MLP, embedding and head; experts and vision towers are not
counted), and the data's real lengths may be shorter than the longest row. It is meant
to catch the runs that cannot fit at all (a row of 100000 tokens on a CPU), before a
raw out-of-memory error or the kernel's OOM killer; ``--no-memory-check`` skips it.

Legend: B rows per micro-batch, S tokens per row, L target layers, Ht target hidden,
I target MLP width, V vocab, h / g heads / kv heads, d head dim, b bytes per element.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3fn.errors import UsageError
from eagle3fn.plan import GiB, PlanArgs, estimate
from eagle3fn.train.config import TrainConfig

DENSITY = 0.3
"""Supervised fraction the draft step is planned at (the data is not read yet)."""


@dataclass(frozen=True)
class StepMemory:
    """Estimated bytes of one step on one rank: ``draft`` (the planned draft step's
    peak), ``draft_resident`` (its parameters, gradients and optimizer state),
    ``target_weights`` and ``target_forward`` (0 offline), ``peak`` (the target's
    weights plus the larger of the draft step and the target's forward beside the
    draft's resident state), and the rows planned (``rows`` x ``seq_len``)."""

    draft: int
    draft_resident: int
    target_weights: int
    target_forward: int
    peak: int
    rows: int
    seq_len: int


def _text(model_config):
    return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config


def _cache_rows(cache: str) -> tuple[int, int] | None:
    """(most conversations, longest padded length) of an unpacked cache's shards, from
    its manifest; None when it cannot be read (its own checks report why)."""
    try:
        shards = json.loads((Path(cache) / "manifest.json").read_text())["shards"]
        return max(s["batch"] for s in shards), max(s["seq_len"] for s in shards)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def target_parameter_count(text) -> int:
    """Parameters of a Llama-shaped decoder from its text config: embedding, head (unless
    tied) and L layers of attention (q, k, v, o) and SwiGLU MLP; norms are negligible."""
    H, heads = text.hidden_size, text.num_attention_heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    d = getattr(text, "head_dim", None) or H // heads
    V, I, L = text.vocab_size, text.intermediate_size, text.num_hidden_layers
    layer = H * heads * d * 2 + H * kv * d * 2 + 3 * H * I
    return V * H * (1 if getattr(text, "tie_word_embeddings", False) else 2) + L * layer


def step_memory(cfg: TrainConfig, model_config, device: torch.device, precision: torch.dtype) -> StepMemory:
    """Peak bytes of one step on one rank (module docstring)."""
    text = _text(model_config)
    b = 2 if precision in (torch.bfloat16, torch.float16) else 4  # fp64 planned as fp32: a lower bound
    B, S = cfg.packed_rows(device) if cfg.packs else (cfg.batch_size, cfg.max_length)
    if cfg.cache and not cfg.packs and (rows := _cache_rows(cfg.cache)) is not None:
        B, S = rows
    heads = text.num_attention_heads
    world = int(os.environ.get("WORLD_SIZE", "1"))
    attention = "eager" if device.type != "cuda" or cfg.ttt.attention == "eager" else "flex"
    args = PlanArgs(seq_len=S, batch=B, density=DENSITY, hidden=text.hidden_size,
                    intermediate=text.intermediate_size, heads=heads,
                    kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                    head_dim=getattr(text, "head_dim", None), target_hidden=text.hidden_size,
                    vocab=text.vocab_size, draft_vocab=min(cfg.draft_vocab_size, text.vocab_size),
                    ttt_length=cfg.ttt_length, sp=min(cfg.parallel.sp, S), trim=cfg.trim_mode, dtype_bytes=b,
                    optimizer=True, world=world, attention=attention,
                    loss_impl="triton" if device.type == "cuda" else "torch")
    plan = estimate(args, compile_elementwise=device.type == "cuda" and cfg.ttt.compile_elementwise)
    m = plan.memory
    resident = m.parameters + m.gradients + m.optimizer_state
    weights = forward = 0
    if not cfg.cache:
        weights = target_parameter_count(text) * b
        local = -(-S // max(cfg.parallel.sp, 1))  # each rank runs the target on its own rows
        forward = (text.num_hidden_layers + 1) * B * local * text.hidden_size * b + B * local * local
    return StepMemory(draft=m.peak, draft_resident=resident, target_weights=weights, target_forward=forward,
                      peak=weights + max(m.peak, resident + forward), rows=B, seq_len=S)


def free_memory(device: torch.device) -> tuple[int, str]:
    """Bytes free for this run on ``device`` and where the number comes from."""
    if device.type == "cuda":
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", "0"))
        free, _ = torch.cuda.mem_get_info(index)
        return free, f"free on cuda:{index}"
    available, where = _meminfo_available(), "available RAM (/proc/meminfo)"
    limit = _cgroup_room()
    if limit is not None and (available is None or limit < available):
        available, where = limit, "left under this process's cgroup memory limit"
    if available is None:  # no /proc: nothing to compare with
        return 2**62, "(unknown: no /proc/meminfo)"
    return available, where


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_room() -> int | None:
    """cgroup v2 ``memory.max`` minus ``memory.current`` of this process's group (None
    without a limit)."""
    try:
        group = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split("::", 1)[1]
        root = Path("/sys/fs/cgroup") / group.lstrip("/")
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, IndexError, ValueError):
        return None


def check_memory(cfg: TrainConfig, model_config, device: torch.device, precision: torch.dtype,
                 log=print) -> StepMemory:
    """``step_memory`` against ``free_memory``: UsageError naming both, the parts and the
    fixes when the step cannot fit; the estimate otherwise."""
    need = step_memory(cfg, model_config, device, precision)
    free, where = free_memory(device)
    if need.peak > free:
        g = lambda x: f"{x / GiB:.2f} GiB"  # noqa: E731
        length = "--pack-length" if cfg.packs and cfg.pack_length else "--max-length"
        lower = f"lower {length} (now {need.seq_len}) or --batch-size (now {need.rows})"
        if cfg.packs and (need.rows, need.seq_len) != (cfg.batch_size, cfg.row_length):  # offline long rows
            lower = (f"lower --batch-size (now {cfg.batch_size}: one row of {cfg.batch_size} x --max-length "
                     f"{cfg.max_length}) or --max-length")
        target = (f" + the target's weights {g(need.target_weights)}, its forward {g(need.target_forward)} "
                  "beside the draft's state" if not cfg.cache else "")
        raise UsageError(
            f"one step needs about {g(need.peak)} but {device.type} has {g(free)} {where}: the draft step "
            f"{g(need.draft)} at {need.rows} rows of {need.seq_len} tokens (eagle3fn plan's model, "
            f"{DENSITY:.0%} supervised){target}; {lower}, use --trim backbone, train offline from eagle3fn "
            "prepare's cache, or pass --no-memory-check to try anyway")
    return need
