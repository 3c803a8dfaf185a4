"""Where a run's micro-batches come from: the target run online on tokenized chat data,
or the offline feature cache. Each gives the conversations (for the vocab map and the
held-out prompts) and a ``Source`` of batches, for training and for the held-out tail.

With ``--pack`` (SPEC 9) a batch is ``batch_size`` rows of ``row_length`` positions
(``--pack-length``, default ``--max-length``), each holding several conversations
(``io.packing.plan_rows``: best fit, longest first, in windows of ``--pack-window``
consecutive conversations), planned once from the conversations' lengths: online the
target runs on the packed rows; offline the rows take conversations from any shard of
the cache (the training shards, and the held-out shards apart), each batch reading
only its conversations from the shards that hold them, their cached features moved
along (a packed target forward gives the same ones). Either way ``Features.positions``
restart in every conversation, and the two plans are the same for the same
conversations in the same order.

Legend: B batch, S padded length, N packed row length.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, NamedTuple

import torch

from eagle3fn.align import supervised_mask
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features, RowMap
from eagle3fn.train.config import TrainConfig
from eagle3fn.unrolled import rowmap_to_device


class HostMasks(NamedTuple):
    """A batch's masks on the host (CPU), as its source built them before any copy to
    the device: the step builds its row map from them on the host and sends it once
    (``unrolled.rowmap_to_device``), never waiting for the device to learn them.

    Fields:
        loss_mask: ``[B, S]``, 1 on tokens to learn (assistant tokens).
        attention_mask: ``[B, S]``, 1 on real tokens.
        positions: int64 ``[B, S]`` or None, ``Features.positions`` (a packed batch).
    """

    loss_mask: torch.Tensor
    attention_mask: torch.Tensor
    positions: torch.Tensor | None = None


def batch_rowmap(features: Features, masks: HostMasks | torch.Tensor, ttt_length: int, *,
                 empty: bool = False) -> RowMap:
    """A one-rank batch's row map (SPEC 6) from its source's masks: from ``HostMasks``
    built on the host and sent to the features' device in one non-blocking copy
    (``unrolled.rowmap_to_device``: the host never waits for the device); from a
    device loss mask ``[B, S]`` built on the device. ``empty``: a zero-weight batch (a
    data-parallel rank past the end of the epoch), no supervised rows."""
    host = isinstance(masks, HostMasks)
    loss_mask = masks.loss_mask if host else masks
    if empty:
        loss_mask = torch.zeros_like(loss_mask)
    attention_mask, positions = ((masks.attention_mask, masks.positions) if host
                                 else (features.attention_mask, features.positions))
    supervised = supervised_mask(loss_mask, attention_mask, positions=positions)
    rowmap = build_rowmap(supervised, ttt_length, positions=positions)
    if not host:
        return rowmap
    return rowmap_to_device(rowmap, features.input_ids.device, attention_mask, positions)


def device_supervised(features: Features, masks: HostMasks | torch.Tensor, *, empty: bool = False) -> torch.Tensor:
    """The batch's supervised mask bool ``[B, S]`` (``align.supervised_mask``) on the
    features' device, for paths that cut it with the features there (sequence
    parallelism: ``parallel.shard_sequence``); ``empty`` as in ``batch_rowmap``."""
    loss_mask = masks.loss_mask.to(features.input_ids.device) if isinstance(masks, HostMasks) else masks
    if empty:
        loss_mask = torch.zeros_like(loss_mask)
    return supervised_mask(loss_mask, features.attention_mask, positions=features.positions)


@dataclasses.dataclass
class Source:
    """Micro-batches: a list of items and how to turn one into ``(Features [B, S, ...],
    masks)``, where ``masks`` is the batch's ``HostMasks`` (or, from a hand-made
    source, its loss mask ``[B, S]`` on the features' device, from which the row map
    is built there); ``describe`` names an item in messages (its conversations'
    ``file:line``, or its cache shard)."""

    items: list
    load: Callable[..., tuple[Features, "HostMasks | torch.Tensor"]]
    describe: Callable[[object], str] = str

    def order(self, epoch: int, seed: int) -> list[int]:
        """The epoch's item order: a permutation seeded by ``(seed, epoch)``."""
        g = torch.Generator().manual_seed(seed * 1000 + epoch)
        return torch.randperm(len(self.items), generator=g).tolist()

    def take_wait(self) -> float:
        """Seconds the training thread waited on input since the last call (then reset);
        0 for a source that computes its batches in the training thread (online)."""
        return 0.0


@dataclasses.dataclass
class PrefetchSource(Source):
    """A ``Source`` whose ``load`` is served by an ``io.prefetch.Prefetcher``: the items
    after the one asked are read in a background thread, in the epoch's order."""

    prefetcher: object = None

    def order(self, epoch: int, seed: int) -> list[int]:
        order = super().order(epoch, seed)
        self.prefetcher.set_order([self.items[i] for i in order])
        return order

    def take_wait(self) -> float:
        return self.prefetcher.take_wait()


def send(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync: through pinned memory with a
    non-blocking copy to CUDA (a copy from pageable memory waits for it)."""
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def load_target_for(cfg: TrainConfig, device: torch.device):
    """The target (``io.target.TargetModel``) on ``device`` in the compute dtype, its
    decoder layers compiled on CUDA with ``--compile-target``."""
    from eagle3fn.io.target import compile_decoder_layers, load_target

    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    target = load_target(cfg.model, aux_layer_ids=cfg.aux_layer_ids, device=device,
                         dtype=cfg.compute_dtype(device), **kwargs)
    return compile_decoder_layers(target) if cfg.compile_target else target


def offline_target(cfg: TrainConfig, device: torch.device, log: Callable[[str], None]):
    """What an offline run needs of its target: its embedding (on ``device``) and head
    (on the host: it only starts the draft's head; the teacher's comes from the cache)
    only (``io.target.load_embedding_and_head``: two tensors read by name, never the
    model's layers, whose work the cache holds), or the whole target (``load_target_for``) when
    the held-out evaluation decodes with it (``--eval-holdout`` with
    ``--eval-accept-prompts``), when the target is a GGUF file, or when its checkpoint's
    names cannot be matched (logged, with the reason)."""
    from eagle3fn.io.target import load_embedding_and_head

    if cfg.eval_holdout and cfg.eval_accept_prompts:
        return load_target_for(cfg, device)
    light = ("a GGUF target" if cfg.gguf_file else
             load_embedding_and_head(cfg.model, aux_layer_ids=cfg.aux_layer_ids, device=device,
                                     dtype=cfg.compute_dtype(device), head_device="cpu"))
    if isinstance(light, str):
        log(f"offline: loading the whole target ({light}); only its embedding and head are used")
        return load_target_for(cfg, device)
    log(f"offline: the target's embedding and head only ({light.source}); the cache holds the rest")
    return light


def online_source(cfg: TrainConfig, device: torch.device):
    """The target, and ``(examples, Source)`` for training and for the held-out tail
    (the last ``eval_holdout`` conversations of the data). Each batch's inputs go to
    the device through pinned memory without a host sync, its masks stay on the host
    (``HostMasks``), and the target's logits are compared with its head on the first
    batch only (``target_features(check_head=)``: a property of the model)."""
    from transformers import AutoTokenizer

    from eagle3fn.io.batching import collate
    from eagle3fn.io.data import tokenize_file
    from eagle3fn.io.packing import collate_packed, pack_examples
    from eagle3fn.io.target import target_features

    packs, row_length = cfg.packs, cfg.row_length  # read once, not per batch
    kwargs = {"gguf_file": cfg.gguf_file} if cfg.gguf_file else {}
    tok = AutoTokenizer.from_pretrained(cfg.model, **kwargs)
    target = load_target_for(cfg, device)
    examples = tokenize_file(cfg.data, tok, max_length=cfg.max_length, on_error=cfg.on_error)
    if cfg.eval_holdout >= len(examples):
        raise ValueError(f"--eval-holdout {cfg.eval_holdout} leaves nothing to train on: {cfg.data} "
                         f"has {len(examples)} usable conversations; hold out fewer")
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    checked = [False]  # the model's head is compared with its logits on the first batch only

    def load(group):
        if packs:  # rows of conversations, one shape [batch_size, row_length]
            b = collate_packed(group, pad, row_length)
            packed = {"position_ids": send(b["position_ids"], device)}
        else:
            b, packed = collate(group, pad), {}
        f = target_features(target, send(b["input_ids"], device), send(b["attention_mask"], device),
                            check_head=not checked[0], **packed)
        checked[0] = True
        return f, HostMasks(b["loss_mask"], b["attention_mask"], b.get("position_ids"))

    def describe(group):
        return "conversations at " + ", ".join(e.source for item in group
                                                for e in (item if packs else [item]))

    def source(part):
        part = (pack_examples(part, cfg.max_length, length=row_length, window=cfg.pack_window)
                if packs else part)  # rows of conversations
        return Source([part[i:i + cfg.batch_size] for i in range(0, len(part), cfg.batch_size)], load,
                      describe=describe)
    cut = len(examples) - cfg.eval_holdout
    return target, (examples[:cut], source(examples[:cut])), (examples[cut:], source(examples[cut:]))


def packed_batches(lengths: list[list[int]], cfg: TrainConfig, rows_per_batch: int,
                   row_length: int) -> list[tuple[tuple[tuple[int, int], ...], ...]]:
    """The packed micro-batches of a cache's shards whose conversations have
    ``lengths[i]`` tokens (shard i, in order): ``io.packing.plan_rows`` over all of them
    in shard order (the plan online packing makes of the same conversations) into rows of
    ``row_length``, cut into batches of ``rows_per_batch`` rows (``TrainConfig.packed_rows``).
    Each batch is a tuple of rows, each row a tuple of ``(shard, conversation row in that
    shard)``."""
    from eagle3fn.io.packing import plan_rows

    refs = [(i, b) for i, shard in enumerate(lengths) for b in range(len(shard))]
    rows = plan_rows([L for shard in lengths for L in shard], cfg.max_length, row_length, cfg.pack_window)
    rows = [tuple(refs[j] for j in row) for row in rows]
    return [tuple(rows[i:i + rows_per_batch]) for i in range(0, len(rows), rows_per_batch)]


def offline_source(cfg: TrainConfig, device: torch.device, *, prefetch: int = 2):
    """``(examples, Source)`` for training and for the held-out trailing shards of the
    cache (shards are never split: ``eval_holdout`` must match a number of trailing
    shards' conversations). Unpacked, an item is a shard; with ``pack`` a batch of
    ``packed_batches`` (planned over the training shards, and over the held-out ones
    apart). Each source reads ``prefetch`` items ahead in a background thread
    (``io.prefetch``: the disk read, dequantization and, with ``pack``, reading the
    batch's conversations from their shards (``FeatureCache.read(i, conversations=)``)
    and gathering them into rows (``io.packing.gather_packed``), into pinned memory), the
    training thread only copies them to ``device`` (non-blocking) in the compute dtype
    (a bf16 cache trains in fp32 on a CPU without AMX) and records its wait
    (``Source.take_wait``). The target head moves to the device once."""
    from eagle3fn.io.cache import FeatureCache
    from eagle3fn.io.data import Example
    from eagle3fn.io.packing import gather_packed
    from eagle3fn.io.prefetch import Prefetcher

    packs, max_length, path = cfg.packs, cfg.max_length, cfg.cache  # read once
    rows_per_batch, row_length = cfg.packed_rows(device)
    cache = FeatureCache(path)  # host side: CPU tensors in the stored dtypes
    dtype = cfg.compute_dtype(device)
    head = cache.target_head.to(device=device, dtype=dtype)

    def load_host(item, window=None):
        if packs:  # rows of conversations, read alone from their shards (no window: one rank per sequence)
            wanted = {}  # shard -> its conversations this batch takes, in order
            for row in item:
                for i, b in row:
                    wanted.setdefault(i, []).append(b)
            parts = [cache.read(i, conversations=bs) for i, bs in wanted.items()]
            at = {(i, b): (p, k) for p, (i, bs) in enumerate(wanted.items()) for k, b in enumerate(bs)}
            features, loss_mask = gather_packed([(p.features, p.loss_mask) for p in parts],
                                                [[at[ref] for ref in row] for row in item],
                                                row_length, max_length)
        else:
            read = cache.read(item, window)
            features, loss_mask = read.features, read.loss_mask
        return dataclasses.replace(features, target_head=None), loss_mask  # the head is on the device once

    def to_device(host):
        features, loss_mask = host
        move = lambda x: None if x is None else x.to(device, non_blocking=True)  # noqa: E731
        cast = lambda x: None if x is None else move(x).to(dtype)  # noqa: E731
        return Features(input_ids=move(features.input_ids), aux=cast(features.aux),
                        attention_mask=move(features.attention_mask),
                        target_logits=cast(features.target_logits), final_hidden=cast(features.final_hidden),
                        target_head=head, positions=move(features.positions)), HostMasks(
                            loss_mask, features.attention_mask, features.positions)
    shards = []  # ids and masks only (no features read), for the vocab map and held-out prompts
    for i in range(len(cache)):
        item = cache.read(i, (0, 0))
        f = item.features
        lengths = f.attention_mask.sum(1).tolist()
        shards.append([Example(input_ids=f.input_ids[b, :L].cpu(), loss_mask=item.loss_mask[b, :L].cpu(),
                               source=f"shard {i}") for b, L in enumerate(lengths)])
    # held[n]: conversations in the last n shards.
    held = [0, *itertools.accumulate(len(s) for s in reversed(shards))]
    if cfg.eval_holdout not in held[:-1]:
        raise ValueError(f"--eval-holdout {cfg.eval_holdout}: the trailing shards of {path} hold "
                         f"{held[1:-1]} conversations; hold out one of those numbers (or 0)")
    cut = len(shards) - held.index(cfg.eval_holdout)
    flat = lambda part: [e for s in part for e in s]  # noqa: E731

    def describe(item):
        if not packs:
            return f"shard {cache.names[item]} of the cache {path}"
        return (f"conversations {', '.join(f'{cache.names[i]}:{b}' for row in item for i, b in row)} "
                f"of the cache {path}")

    def source(ids):
        if packs:  # batches of rows planned over these shards' conversations, in shard order
            batches = packed_batches([[len(e) for e in shards[i]] for i in ids], cfg, rows_per_batch, row_length)
            items = [tuple(tuple((ids[i], b) for i, b in row) for row in batch) for batch in batches]
        else:
            items = list(ids)
        fetch = Prefetcher(load_host, to_device, items, depth=prefetch)
        return PrefetchSource(items, fetch.get, describe, prefetcher=fetch)
    return ((flat(shards[:cut]), source(list(range(cut)))),
            (flat(shards[cut:]), source(list(range(cut, len(shards))))))


def prompt_of(example) -> list[int]:
    """The tokens before the first supervised one (the chat template's prompt)."""
    return example.input_ids[:int(example.loss_mask.nonzero()[0])].tolist()
