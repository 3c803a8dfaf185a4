"""Shared by tests/test_loop_grads.py and its spawned ranks: the training loop's first
optimizer step's gradients (``train(on_grads=...)``) and their one-process oracle.

The oracle never calls the loop: it rebuilds the first step's conversations from the
data order (``randperm`` seeded ``seed*1000 + epoch``), the draft's initial weights as
``init_params`` does (the vocab map read from the run's ``vocab.safetensors``) and
differentiates ``ttt`` on one process in fp64. ``parts`` say which conversations form
one one-process batch, its ``local_mean`` divisor and its weight in the sum.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle3fn.align import supervised_mask
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from ranks import COLLECTIVE_TIMEOUT


def first_grads(cfg) -> dict[str, torch.Tensor]:
    """The loop's step-1 gradients (before clipping and the optimizer) of ``cfg``'s run."""
    from eagle3fn.train.loop import train

    got = {}

    def keep(step, grads):
        if step == 1:
            got.update({n: g.detach().cpu().clone() for n, g in grads.items()})
    train(dataclasses.replace(cfg, max_steps=1), log=lambda s: None, on_grads=keep)
    return got


def eval_run(cfg) -> dict:
    """A one-step run with held-out conversations: its ``"split": "eval"`` metrics rows
    and the sequence length of every batch ``ttt`` evaluated (on this rank)."""
    import eagle3fn.train.evaluate as evaluate_module
    from eagle3fn.train.loop import train
    from eagle3fn.train.metrics import read_metrics

    real, lengths = evaluate_module.ttt, []

    def spy(params, features, *args, **kwargs):
        lengths.append(features.input_ids.shape[1])
        return real(params, features, *args, **kwargs)
    evaluate_module.ttt = spy
    try:
        train(dataclasses.replace(cfg, max_steps=1), log=lambda s: None)
    finally:
        evaluate_module.ttt = real
    rows = [r for r in read_metrics(Path(cfg.out_dir) / "metrics.jsonl") if r.get("split") == "eval"]
    return {"eval": rows, "lengths": lengths}


def rank_main(rank: int, world: int, init_file: str, runs: dict, result_file: str) -> None:
    """One spawned rank: every run of ``runs`` ({name: TrainConfig}) in turn under one
    process group (gloo, the loop's ``WORLD_SIZE`` path); rank 0 saves {name: grads}."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    results = {}
    for name, cfg in runs.items():
        results[name] = eval_run(cfg) if name.endswith("-eval") else first_grads(cfg)
    if rank == 0:
        torch.save(results, result_file)
    dist.barrier()
    dist.destroy_process_group()


def data_order(n_items: int, seed: int, epoch: int = 0) -> list[int]:
    """The items of an epoch in training order (a permutation seeded ``seed*1000 + epoch``)."""
    return torch.randperm(n_items, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


def first_step_items(n_items: int, *, dp: int, grad_accum: int, seed: int) -> list[list[int]]:
    """Item indices of optimizer step 1, ``[micro-batch][dp rank]``: item ``order[m*dp + r]``."""
    order = data_order(n_items, seed)
    return [[order[m * dp + r] for r in range(dp)] for m in range(grad_accum)]


def concat(batches: list[tuple[Features, torch.Tensor]]) -> tuple[Features, torch.Tensor]:
    """Several right-padded batches as one, right-padded to the longest."""
    T = max(f.input_ids.shape[1] for f, _ in batches)

    def cat(name):
        parts = [getattr(f, name) for f, _ in batches]
        return torch.cat([F.pad(p, [0, 0] * (p.dim() - 2) + [0, T - p.shape[1]]) for p in parts])
    head = batches[0][0].target_head
    features = Features(input_ids=cat("input_ids"), aux=cat("aux"), attention_mask=cat("attention_mask"),
                        final_hidden=cat("final_hidden"), target_head=head)
    loss_mask = torch.cat([F.pad(m, [0, T - m.shape[1]]) for _, m in batches])
    return features, loss_mask


@dataclasses.dataclass
class Oracle:
    """The first step of a run, one process: initial draft weights, map and TTT config."""

    params: dict[str, torch.Tensor]
    d2t: torch.Tensor
    t2d: torch.Tensor
    config: object

    @classmethod
    def of_run(cls, cfg, target) -> "Oracle":
        """``cfg``'s initial weights, as the loop builds them, on ``target`` (fp64); the
        TTT config of the run with trim "none" (the reference path, whatever the run trims)."""
        from transformers import AutoConfig

        from eagle3fn.draft import init_params
        from eagle3fn.io.vocab_io import load_vocab_map
        from eagle3fn.train.build import draft_config_for
        from eagle3fn.unrolled import TTTConfig

        head = target.lm_head.weight.detach().double()
        draft = draft_config_for(AutoConfig.from_pretrained(cfg.model), cfg.draft_vocab_size, head.shape[0])
        d2t, t2d = load_vocab_map(Path(cfg.out_dir) / "vocab.safetensors")
        params = init_params(draft, embed_tokens=target.embed_tokens.double(), target_lm_head=head, t2d=t2d,
                             seed=cfg.seed, dtype=torch.float64)
        config = TTTConfig(draft=draft, ttt_length=cfg.ttt_length, trim="none", loss=cfg.loss)
        return cls(params, d2t, t2d, config)

    def grads(self, parts) -> dict[str, torch.Tensor]:
        """``sum_p weight_p * d ttt(batch_p, denominator_p) / d params`` over ``parts``, each
        ``(features, loss_mask, local_mean denominator or None for B*T, weight)``."""
        from eagle3fn.unrolled import ttt

        trainable = {n: p for n, p in self.params.items() if p.requires_grad}
        total = {n: torch.zeros_like(p) for n, p in trainable.items()}
        for features, loss_mask, denominator, weight in parts:
            rowmap = build_rowmap(supervised_mask(loss_mask, features.attention_mask), self.config.ttt_length)
            if denominator is not None:
                rowmap = dataclasses.replace(rowmap, denominator=denominator)
            obj = ttt(self.params, features, rowmap, self.config, d2t=self.d2t, t2d=self.t2d)
            for (n, t), g in zip(total.items(), torch.autograd.grad(obj.objective, list(trainable.values()))):
                t.add_(g, alpha=weight)
        return total
