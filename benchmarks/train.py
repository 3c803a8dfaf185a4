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
  (online runs against online SpecForge; offline against offline, else online).

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
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
FIRST_WORD = 7
"""Ids below this are ``<|pad|>``, ``<|im_start|>``, ``<|im_end|>`` and the role names."""
SPECIAL_TOKENS = ("<|pad|>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "tool")
ZIPF_EXPONENT = 1.1
MESSAGE_OVERHEAD = 3
"""Tokens the ChatML template adds per message (``<|im_start|>``, the role, ``<|im_end|>``)."""


# ---------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Shape:
    """The text shape of a target (built with random weights) and of its draft vocab.

    ``rope``: the HF ``rope_parameters`` (per layer type for Gemma-3);
    ``sliding_window`` / ``global_every``: Gemma-3's local layers (every
    ``global_every``-th layer is global); ``max_length`` and ``length_scale``: the
    defaults of ``--max-length`` and ``--length-scale``.
    """

    arch: Literal["llama", "gemma3"]
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    draft_vocab: int
    rope: dict
    rms_norm_eps: float = 1e-5
    sliding_window: int | None = None
    global_every: int = 1
    tie_embeddings: bool = False
    max_length: int = 2048
    length_scale: float = 1.0

    def hf_config(self):
        """The transformers config of the target."""
        common = dict(hidden_size=self.hidden, intermediate_size=self.intermediate,
                      num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
                      max_position_embeddings=131072, rms_norm_eps=self.rms_norm_eps,
                      rope_parameters=dict(self.rope), tie_word_embeddings=self.tie_embeddings,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
        if self.arch == "llama":
            from transformers import LlamaConfig

            return LlamaConfig(**common)
        from transformers import Gemma3TextConfig

        layer_types = ["full_attention" if (i + 1) % self.global_every == 0 else "sliding_attention"
                       for i in range(self.layers)]
        return Gemma3TextConfig(**common, sliding_window=self.sliding_window, layer_types=layer_types,
                                query_pre_attn_scalar=self.head_dim)

    def model_class(self):
        import transformers

        return transformers.LlamaForCausalLM if self.arch == "llama" else transformers.Gemma3ForCausalLM

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's matmuls (q, k, v, o, gate, up, down)."""
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    def is_global(self, layer: int) -> bool:
        return self.sliding_window is None or (layer + 1) % self.global_every == 0


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
SHAPES = {
    # Llama-3.1-8B(-Instruct)'s config.json.
    "llama-3.1-8b": Shape(arch="llama", hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                          intermediate=14336, vocab=128256, draft_vocab=32000, rope=LLAMA3_ROPE),
    # Gemma-3-4B's text model with a 262144-entry vocab (the real one has 262208).
    "gemma-3-262k": Shape(arch="gemma3", hidden=2560, layers=34, heads=8, kv_heads=4, head_dim=256,
                          intermediate=10240, vocab=262144, draft_vocab=32000, rope=GEMMA3_ROPE,
                          rms_norm_eps=1e-6, sliding_window=1024, global_every=6, tie_embeddings=True),
    # CPU tests: Llama-3.1's layout and RoPE at toy sizes.
    "tiny": Shape(arch="llama", hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                  vocab=1024, draft_vocab=256, rope=LLAMA3_ROPE, max_length=128, length_scale=1 / 16),
    "tiny-gemma3": Shape(arch="gemma3", hidden=64, layers=8, heads=4, kv_heads=2, head_dim=16,
                         intermediate=128, vocab=2048, draft_vocab=256, rope=GEMMA3_ROPE, rms_norm_eps=1e-6,
                         sliding_window=32, global_every=6, tie_embeddings=True, max_length=128,
                         length_scale=1 / 16),
}


# ---------------------------------------------------------------------------- target


def word_tokenizer(vocab_size: int):
    """A fast word-level chat tokenizer with exactly ``vocab_size`` ids: the
    ``SPECIAL_TOKENS`` then ``w{i}`` for ``FIRST_WORD <= i < vocab_size``; whitespace
    splits words, so ``"w12 w7"`` is two tokens. eagle3fn's ChatML template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from eagle3fn.testing.tiny_tokenizer import CHATML_TEMPLATE

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update((f"w{i}", i) for i in range(FIRST_WORD, vocab_size))
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|pad|>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<|pad|>", eos_token="<|im_end|>",
                                   additional_special_tokens=["<|im_start|>"], chat_template=CHATML_TEMPLATE)


def build_target(shape: Shape, path: Path, device: str, seed: int) -> float:
    """Save a random-weight target of ``shape`` and its tokenizer to ``path``, built on
    ``device`` in the compute dtype (bf16 on CUDA, fp32 on the CPU); reuses what a
    previous call with the same arguments left there. Returns the seconds spent
    (0 when reused)."""
    import torch

    marker = path / "bench-target.json"
    data_fields = ("draft_vocab", "max_length", "length_scale")
    model_fields = {k: v for k, v in asdict(shape).items() if k not in data_fields}
    identity = {"shape": model_fields, "seed": seed, "device_type": torch.device(device).type}
    if marker.exists() and json.loads(marker.read_text()) == identity:
        return 0.0
    t = time.perf_counter()
    shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    try:
        with torch.device(device):
            model = shape.model_class()(shape.hf_config())
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(path)
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    word_tokenizer(shape.vocab).save_pretrained(path)
    marker.write_text(json.dumps(identity))
    return time.perf_counter() - t


# ---------------------------------------------------------------------------- data


@dataclass(frozen=True)
class ChatProfile:
    """A chat length distribution: ``(mean, sd)`` of exchanges (a user turn and its
    answer) per conversation and of tokens per user / assistant turn; ``context``:
    ``(median, log-sd)`` tokens of one leading system message, or None."""

    source: str
    turns: tuple[float, float]
    user: tuple[float, float]
    assistant: tuple[float, float]
    context: tuple[float, float] | None = None


WILDCHAT = ("WildChat (Zhao et al., ICLR 2024), dataset comparison table: turns 2.52+-2.49, "
            "user tokens/turn 295.58+-1609.18, assistant tokens/turn 441.34+-410.91")
PROFILES = {
    "prompt-heavy": ChatProfile(
        source=WILDCHAT + "; plus one context message per conversation, log-normal median 800 tokens, "
               "log-sd 0.5 (assumed, calibrated to 30-40% assistant tokens at 2048)",
        turns=(2.52, 2.49), user=(295.58, 1609.18), assistant=(441.34, 410.91), context=(800.0, 0.5)),
    "wildchat": ChatProfile(source=WILDCHAT, turns=(2.52, 2.49), user=(295.58, 1609.18),
                            assistant=(441.34, 410.91)),
    "sharegpt": ChatProfile(
        source="ShareGPT row of the WildChat paper's dataset comparison table: turns 3.51+-2.31, "
               "user tokens/turn 94.46+-626.39, assistant tokens/turn 348.45+-269.93",
        turns=(3.51, 2.31), user=(94.46, 626.39), assistant=(348.45, 269.93)),
}


def _lognormal(rng, mean: float, sd: float, size: int):
    """Log-normal draws with the given mean and sd."""
    s2 = math.log1p((sd / mean) ** 2)
    return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), size)


def _exchanges(rng, mean: float, sd: float) -> int:
    """1 + a negative binomial with the given mean and sd (over-dispersed counts)."""
    m, var = mean - 1, sd * sd
    q = m / var
    return 1 + int(rng.negative_binomial(m * q / (1 - q), q))


def sample_conversations(n: int, profile: ChatProfile, *, vocab_size: int, max_length: int,
                         length_scale: float, seed: int) -> list[dict]:
    """``n`` chat JSONL rows ``{"messages": [...]}`` drawn from ``profile`` (module
    docstring): message contents are space-separated words ``w{id}`` of
    ``word_tokenizer(vocab_size)``, one token each, ids Zipf-distributed. Lengths are
    multiplied by ``length_scale``; a conversation whose first answer would start past
    ``0.9 * max_length`` is drawn again, and text past ``max_length`` is not written."""
    import numpy as np

    rng = np.random.default_rng(seed)
    ranks = np.arange(1, vocab_size - FIRST_WORD + 1, dtype=np.float64)
    weights = ranks ** -ZIPF_EXPONENT
    ids_by_rank = FIRST_WORD + rng.permutation(vocab_size - FIRST_WORD)

    def scaled(x) -> int:
        return max(1, round(float(x) * length_scale))

    plans = []
    while len(plans) < n:
        turns = _exchanges(rng, *profile.turns)
        user = [scaled(x) for x in _lognormal(rng, *profile.user, turns)]
        answer = [scaled(x) for x in _lognormal(rng, *profile.assistant, turns)]
        context = (scaled(rng.lognormal(math.log(profile.context[0]), profile.context[1]))
                   if profile.context else 0)
        first_answer = (MESSAGE_OVERHEAD + context if context else 0) + MESSAGE_OVERHEAD + user[0] + 2
        if first_answer >= 0.9 * max_length:
            continue
        roles = ([("system", context)] if context else []) + [
            (role, k) for u, a in zip(user, answer) for role, k in (("user", u), ("assistant", a))]
        plan, pos = [], 0
        for role, k in roles:  # nothing past where eagle3fn cuts (a few tokens' margin)
            if pos >= max_length:
                break
            plan.append((role, min(k, max_length + 8 - pos)))
            pos += MESSAGE_OVERHEAD + k
        plans.append(plan)
    total = sum(k for plan in plans for _, k in plan)
    words = ids_by_rank[rng.choice(len(weights), size=total, p=weights / weights.sum())]
    rows, at = [], 0
    for plan in plans:
        messages = []
        for role, k in plan:
            messages.append({"role": role, "content": " ".join(f"w{i}" for i in words[at:at + k])})
            at += k
        rows.append({"messages": messages})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


def padding_fraction(batch_lengths: list[list[int]]) -> float:
    """1 - real / padded tokens of right-padded batches: ``batch_lengths[b]`` holds the
    lengths of batch b's sequences, each batch padded to its longest."""
    real = sum(sum(b) for b in batch_lengths)
    padded = sum(len(b) * max(b) for b in batch_lengths)
    return 1 - real / padded


def step_batches(examples: list, batch_size: int, seed: int) -> list[list]:
    """The micro-batches of ``eagle3fn train``'s first epoch in step order: groups of
    ``batch_size`` consecutive examples (online; ``prepare`` cuts its shards the same
    way), ordered by ``Source.order(0, seed)``."""
    from eagle3fn.train.sources import Source

    groups = [examples[i:i + batch_size] for i in range(0, len(examples), batch_size)]
    return [groups[i] for i in Source(groups, load=lambda *a: None).order(0, seed)]


def data_summary(examples: list, batches: list[list], profile: str, n_written: int, max_length: int) -> dict:
    """Measured statistics of the tokenized data and of its step batches."""
    from eagle3fn.align import supervised_mask

    lengths = [len(e) for e in examples]
    tokens = sum(lengths)
    return {"profile": profile, "source": PROFILES[profile].source, "conversations": len(examples),
            "dropped": n_written - len(examples), "tokens": tokens,
            "assistant_share": round(sum(int(e.loss_mask.sum()) for e in examples) / tokens, 4),
            "supervised_share": round(sum(int(supervised_mask(e.loss_mask[None]).sum()) for e in examples)
                                      / tokens, 4),
            "mean_length": round(tokens / len(examples), 1), "median_length": statistics.median(lengths),
            "cut_at_max_length": round(sum(L >= max_length for L in lengths) / len(lengths), 3),
            "padding_frac": round(padding_fraction([[len(e) for e in b] for b in batches]), 4)}


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


class RecompileCounter:
    """Counts dynamo "Recompiling function" log events in this process (turns on the
    ``recompiles`` log artifact) and the times a function hit dynamo's recompile limit
    (after which it runs uncompiled), keeping the first few messages."""

    def __init__(self, keep: int = 5) -> None:
        import logging

        import torch._logging

        self.count, self.limit_hits, self.examples, self.keep = 0, 0, [], keep
        torch._logging.set_logs(recompiles=True)
        counter = self

        class Handler(logging.Handler):
            def emit(self, record):
                message = record.getMessage()
                if message.startswith("Recompiling function"):
                    counter.count += 1
                elif message.startswith("torch._dynamo hit config."):
                    counter.limit_hits += 1
                else:
                    return
                if len(counter.examples) < counter.keep:
                    counter.examples.append(" ".join(message.split())[:300])
        self.handler = Handler()
        logging.getLogger("torch._dynamo").addHandler(self.handler)

    def close(self) -> None:
        """Stop counting; torch's log settings back to their defaults."""
        import logging

        import torch._logging

        logging.getLogger("torch._dynamo").removeHandler(self.handler)
        torch._logging.set_logs()

    @staticmethod
    def graphs() -> int:
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])


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
    padded tokens of its micro-batches (``train.step.micro_batch``) and the seconds in
    ``FeatureCache.read``. Observes only: the loop's functions are wrapped, not changed."""
    import torch

    from eagle3fn.cli import main as cli
    from eagle3fn.io.cache import FeatureCache
    from eagle3fn.train import loop, step

    recompiles = RecompileCounter()
    record = {"steps": [], "t_probe": time.time()}
    acc = {"padded": 0, "load_s": 0.0}
    real_micro_batch, real_read, real_step = step.micro_batch, FeatureCache.read, loop.optimizer_step

    def micro_batch(*args, **kwargs):
        out = real_micro_batch(*args, **kwargs)
        acc["padded"] += out[1].attention_mask.numel()
        return out

    def read(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return real_read(self, *args, **kwargs)
        finally:
            acc["load_s"] += time.perf_counter() - t

    def optimizer_step(run, order, **kwargs):
        if not record["steps"] and torch.cuda.is_initialized():
            record["before_first_step"] = {"peak": torch.cuda.max_memory_allocated(),
                                           "reserved": torch.cuda.max_memory_reserved(),
                                           "recompiles": recompiles.count, "graphs": recompiles.graphs()}
            torch.cuda.reset_peak_memory_stats()
        acc.update(padded=0, load_s=0.0)
        t = time.time()
        result = real_step(run, order, **kwargs)
        record["steps"].append(_step_record(t, result.tokens, acc["padded"], recompiles, load_s=acc["load_s"]))
        return result

    step.micro_batch, FeatureCache.read, loop.optimizer_step = micro_batch, read, optimizer_step
    try:
        cli.main(argv)
    finally:
        record["recompile_examples"] = recompiles.examples
        Path(record_path).write_text(json.dumps(record))


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


# ---------------------------------------------------------------------------- eagle3fn


def _python(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in ["python", "-m", "eagle3fn.cli", *args])


def run_eagle3fn(argv: list[str], *, log: Path, record: Path, gpu: str | None, smi_ms: int,
                 env: dict[str, str]) -> tuple[dict, float, GpuSampler | None]:
    """One ``eagle3fn`` command in a subprocess under ``probe`` with ``env`` added to
    this process's environment: ``(record, launch time, sampler)``; raises
    RuntimeError naming the log when it fails."""
    code = "import sys; sys.path.insert(0, sys.argv[1]); import train; train.probe(sys.argv[2], sys.argv[3:])"
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


# ---------------------------------------------------------------------------- SpecForge


def _aux_layer_ids(layers: int) -> list[int]:
    from eagle3fn.io.target import default_aux_layer_ids

    return list(default_aux_layer_ids(layers))


def specforge_draft(shape: Shape, model_dir: Path, device: str, d2t, t2d, embed):
    """SpecForge's EAGLE-3 draft generated from the target's config as its
    ``_generate_draft_config`` does, on ``device`` in the compute dtype, with the vocab
    map and the frozen target embedding loaded."""
    import torch
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import (_TARGET_ARCHITECTURE_FIELDS, _draft_config_from_dict,
                                                  _serializable_config_value)
    from transformers import AutoConfig

    target = AutoConfig.from_pretrained(model_dir)
    payload = {f: _serializable_config_value(getattr(target, f)) for f in _TARGET_ARCHITECTURE_FIELDS
               if getattr(target, f, None) is not None}
    payload.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
                   tie_word_embeddings=False, use_cache=True, draft_vocab_size=shape.draft_vocab)
    cuda = torch.device(device).type == "cuda"
    draft = AutoDraftModel.from_config(_draft_config_from_dict(payload),
                                       attention_backend="flex_attention" if cuda else "sdpa",
                                       torch_dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    with torch.no_grad():
        draft.d2t.copy_(d2t)
        draft.t2d.copy_(t2d)
        draft.embed_tokens.weight.copy_(embed)
    draft.freeze_embedding()
    return draft


def _capture(model, decoder, layers: list[int], input_ids, attention_mask):
    """The HF backend's capture: forward hooks on the ``layers`` of ``decoder`` (the
    target's decoder layers), one forward of ``model`` (the causal LM, or its backbone)
    with ``use_cache=False``; ``(aux [B, S, 3H], outputs)``."""
    import torch

    captured, handles = {}, []
    for i in layers:
        def hook(module, inputs, output, i=i):
            captured[i] = output[0] if isinstance(output, tuple) else output
        handles.append(decoder[i].register_forward_hook(hook))
    try:
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in layers], dim=-1), out


class SpecForgeLoop:
    """SpecForge 0.2.0's training step on ``batches`` in order (module docstring): the
    target (online) or the captured features and the head (offline), its draft,
    ``OnlineEagle3Model`` and ``BF16Optimizer``. ``step(i)`` trains on batch i and
    returns its real tokens."""

    def __init__(self, shape: Shape, model_dir: Path, batches: list[list], *, offline: bool, device: str,
                 ttt_length: int, d2t, t2d, lr: float) -> None:
        import torch
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.optimizer import BF16Optimizer
        from transformers import AutoModelForCausalLM

        from eagle3fn.io.data import collate

        cuda = torch.device(device).type == "cuda"
        if cuda:  # the peak counts from here, not from this process's earlier work
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.device, self.offline = device, offline
        self.target = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if cuda else torch.float32).to(device).eval().requires_grad_(False)
        self.layers = _aux_layer_ids(shape.layers)
        self.draft = specforge_draft(shape, model_dir, device, d2t, t2d, self.target.get_input_embeddings().weight)
        self.model = OnlineEagle3Model(draft_model=self.draft, length=ttt_length,
                                       attention_backend="flex_attention" if cuda else "sdpa")
        self.model.train()
        self.opt = BF16Optimizer(self.draft, lr=lr, max_grad_norm=0.5, total_steps=len(batches), warmup_ratio=0.015)
        self.inputs = [collate(b, 0) for b in batches]
        self.stored = []
        if offline:  # capture once, keep on the host, drop the target but its head
            with torch.no_grad():
                for b in self.inputs:
                    aux, out = _capture(self.target.model, self.target.model.layers, self.layers,
                                        b["input_ids"].to(device), b["attention_mask"].to(device))
                    self.stored.append((aux.cpu(), out.last_hidden_state.cpu()))
            self.head = self.target.get_output_embeddings().weight.detach().clone()
            self.target = None
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

    def step(self, i: int) -> int:
        import torch
        import torch.nn.functional as F
        from specforge.utils import padding

        b = self.inputs[i]
        ids, am, lm = (b[k].to(self.device) for k in ("input_ids", "attention_mask", "loss_mask"))
        if self.offline:
            aux, final = (x.to(self.device) for x in self.stored[i])
            lm = lm.clone()
            lm[torch.arange(lm.shape[0], device=lm.device), am.sum(1) - 1] = False  # normalize_offline_sample
            logits = F.linear(padding(final, left=False), self.head)  # TargetHead.preprocess + forward
        else:
            with torch.no_grad():
                aux, out = _capture(self.target, self.target.model.layers, self.layers, ids, am)
                logits = padding(out.logits, left=False)
        plosses, *_ = self.model(input_ids=padding(ids, left=False), attention_mask=am, target=logits,
                                 loss_mask=lm[..., None].int(), hidden_states=aux)
        sum(0.8**j * p for j, p in enumerate(plosses)).backward()
        self.opt.step()
        return int(am.sum())


def specforge_loop(shape: Shape, model_dir: Path, batches: list[list], *, offline: bool, device: str,
                   ttt_length: int, d2t, t2d, recompiles: RecompileCounter, lr: float) -> list[dict]:
    """``SpecForgeLoop`` over every batch: per step records as ``_step_record``'s. On
    the CPU dynamo is off (a functional check; its compiled helpers would take longer
    to build than the steps)."""
    import torch

    cuda = torch.device(device).type == "cuda"
    loop = SpecForgeLoop(shape, model_dir, batches, offline=offline, device=device, ttt_length=ttt_length,
                         d2t=d2t, t2d=t2d, lr=lr)
    records, base = [], (recompiles.count, recompiles.limit_hits, recompiles.graphs())
    with torch._dynamo.config.patch(disable=not cuda):
        for i, b in enumerate(loop.inputs):
            t = time.time()
            tokens = loop.step(i)
            records.append(_step_record(t, tokens, b["input_ids"].numel(), recompiles))
    for r in records:  # counted from this loop's start
        r["recompiles"] -= base[0]
        r["limit_hits"] -= base[1]
        r["graphs"] -= base[2]
    del loop
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return records


# ---------------------------------------------------------------------------- driver


Mode = Literal["none", "loss", "backbone", "auto"]


@dataclass(kw_only=True)
class BenchArgs:
    """Time ``eagle3fn train`` end to end beside a SpecForge 0.2.0 loop (module docstring)."""

    shape: Literal["llama-3.1-8b", "gemma-3-262k", "tiny", "tiny-gemma3"] = "llama-3.1-8b"
    """Target shape (random weights)."""
    loops: tuple[Literal["online", "offline"], ...] = ("online", "offline")
    """online: the target runs in the loop; offline: ``prepare`` then ``train --cache``."""
    modes: tuple[Mode, ...] = ("none", "loss", "backbone", "auto")
    """``eagle3fn train --trim`` modes to run for each loop."""
    specforge: bool = True
    """Also run the SpecForge 0.2.0 loop for each loop kind (after the eagle3fn runs)."""
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
    train_args: str = ""
    """Extra ``eagle3fn train`` flags for every run, e.g. ``'--ttt.query-buckets 4'``."""
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
    out: str | None = None
    """Write the results here as JSON (rewritten after every run)."""


def resolved_args(args: BenchArgs, shape: Shape, work: Path) -> dict:
    """``args`` as the run used them (no None, for ``meta.run_metadata``)."""
    out = {k: v for k, v in asdict(args).items() if not (k == "out" and v is None)}
    out.update(work_dir=str(work), length_scale=shape.length_scale, max_length=shape.max_length,
               draft_vocab_size=shape.draft_vocab)
    return out


METHODS = {
    "tokens_per_s": "real tokens of the steps after warmup_steps / wall s from the end of the last warm-up "
                    "step to the end of the last step; each step ends after a device sync",
    "warmup_s": "wall s of the warm-up steps minus their real tokens at the steady rate",
    "startup_s": "process launch to the start of the first optimizer step",
    "padding_frac": "1 - real/padded tokens of every micro-batch computed on (padded = B*S)",
    "recompiles_after_warmup": "dynamo 'Recompiling function' log events during the steady window",
    "recompile_limit_hits": "dynamo 'hit config.recompile_limit' warnings in the run (that code then runs eager)",
    "graph_compiles_after_warmup": "new dynamo graphs (counters['stats']['unique_graphs']) in the steady window",
    "gpu_busy_pct": "mean nvidia-smi utilization.gpu over the steady window, sampled every smi_period_ms",
    "peak_gib": "torch.cuda.max_memory_allocated over the run, reset after every step (target weights included)",
    "floor_*": "FLOPs of the steady window's batches (step_flops) / the matmul rate measured in this process; "
               "frac = floor time / measured time",
    "input_wait_frac": "offline: s inside FeatureCache.read / steady window s",
    "vs_specforge": "tokens_per_s / the SpecForge loop's tokens_per_s in this process",
}


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

    def train_argv(self, loop: str, mode: str, out_dir: Path, cache: Path) -> list[str]:
        """The ``eagle3fn train`` arguments of one run."""
        a = self.args
        source = (["--cache", str(cache)] if loop == "offline"
                  else ["--data", str(self.data_path), "--batch-size", str(a.batch_size)])
        return ["train", "--model", str(self.model_dir), *source, "--out-dir", str(out_dir), "--trim", mode,
                "--max-length", str(a.max_length), "--max-steps", str(a.steps), "--epochs", "1",
                "--draft-vocab-size", str(self.shape.draft_vocab), "--ttt-length", str(a.ttt_length),
                "--lr", str(a.lr), "--seed", str(a.seed), "--device", self.device, "--save-every", str(10**9),
                "--log-every", "1", *shlex.split(a.train_args)]


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


def eagle3fn_row(bench: Bench, loop: str, mode: str, cache: Path) -> dict:
    """One ``eagle3fn train`` run under ``probe``, summarised (``error`` when it failed).
    Its metrics.jsonl and log stay in ``work/logs``; its out_dir (checkpoints) is removed."""
    name = f"{loop}-{mode}"
    out_dir = bench.work / "runs" / name
    shutil.rmtree(out_dir, ignore_errors=True)
    argv = bench.train_argv(loop, mode, out_dir, cache)
    row = {"loop": loop, "mode": mode, "command": _python(argv)}
    compile_dir = bench.work / "compile" / name
    shutil.rmtree(compile_dir, ignore_errors=True)
    try:
        record, launched, sampler = run_eagle3fn(argv, log=bench.work / "logs" / f"{name}.log",
                                                 record=bench.work / "logs" / f"{name}.json", gpu=bench.gpu,
                                                 smi_ms=bench.args.smi_period_ms, env=bench.compile_env(name))
        steps = record["steps"]
        expected = [sum(len(e) for e in b) for b in bench.batches]
        match = [s["tokens"] for s in steps] == expected[:len(steps)]
        row.update(summarise(steps, warmup=bench.args.warmup_steps, launched=launched,
                             ceiling_tflops=bench.ceiling, floors=bench.floors[loop][:len(steps)] if match else None,
                             before=record.get("before_first_step")),
                   batches_match=match, recompile_examples=record["recompile_examples"])
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


def specforge_row(bench: Bench, loop: str, counter: RecompileCounter, d2t, t2d) -> dict:
    """The SpecForge loop of this kind in this process, summarised (``error`` when it
    failed, e.g. out of memory)."""
    row = {"loop": loop, "mode": "specforge", "command": "in process (specforge_loop)"}
    sampler = GpuSampler(bench.gpu, bench.args.smi_period_ms) if bench.gpu is not None else None
    launched = time.time()
    try:
        steps = specforge_loop(bench.shape, bench.model_dir, bench.batches, offline=loop == "offline",
                               device=bench.device, ttt_length=bench.args.ttt_length, d2t=d2t, t2d=t2d,
                               recompiles=counter, lr=bench.args.lr)
        row.update(summarise(steps, warmup=bench.args.warmup_steps, launched=launched,
                             ceiling_tflops=bench.ceiling, floors=bench.floors[loop]),
                   batches_match=True, recompile_examples=list(counter.examples))
    except Exception as e:  # noqa: BLE001 -- a SpecForge failure (e.g. out of memory) is a result
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
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
            add(eagle3fn_row(bench, loop, mode, cache))
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
                add(specforge_row(bench, loop, counter, d2t.to(bench.device), t2d.to(bench.device)))
        finally:
            counter.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
            shutil.rmtree(bench.work / "compile", ignore_errors=True)
    base = {r["loop"]: r["tokens_per_s"] for r in report["results"] if r["mode"] == "specforge" and "error" not in r}
    for r in report["results"]:
        ref = base.get(r["loop"], base.get("online"))
        if "tokens_per_s" in r and ref:
            r["vs_specforge"] = round(r["tokens_per_s"] / ref, 3)
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
    """The results table, printed last."""
    d = report["data"]
    print(f"\n{report['shape']['name']}: {d['conversations']} conversations, {d['assistant_share']:.1%} assistant "
          f"tokens ({d['profile']}), mean {d['mean_length']:.0f} tokens; matmul {report['ceiling_tflops']:.3g} TFLOP/s")
    head = (f"{'loop':>8} {'mode':>10} {'tok/s':>9} {'vs SF':>6} {'ms/step':>8} {'warm-up s':>9} {'startup s':>9} "
            f"{'pad %':>6} {'recomp':>6} {'busy %':>6} {'peak GiB':>8} {'dense fl':>8} {'trim fl':>8} {'wait %':>6}")
    print(head)
    for r in report["results"]:
        if "error" in r:
            print(f"{r['loop']:>8} {r['mode']:>10} failed: {r['error'].splitlines()[0][:80]}")
            continue
        print(f"{r['loop']:>8} {r['mode']:>10} {r['tokens_per_s']:>9.0f} {_fmt(r.get('vs_specforge'), '.2f'):>6} "
              f"{_fmt(r['ms_per_step_median'], '.1f'):>8} {r['warmup_s']:>9.1f} {r['startup_s']:>9.1f} "
              f"{100 * r['padding_frac']:>6.1f} {r['recompiles_after_warmup']:>6} "
              f"{_fmt(r.get('gpu_busy_pct'), '.0f'):>6} {_fmt(r['peak_gib'], '.2f'):>8} "
              f"{_fmt(r.get('floor_dense_frac'), '.0%'):>8} {_fmt(r.get('floor_trim_frac'), '.0%'):>8} "
              f"{_fmt(r.get('input_wait_frac'), '.1%'):>6}")


if __name__ == "__main__":
    import tyro

    sys.path.insert(0, str(BENCH_DIR))
    main(tyro.cli(BenchArgs))
