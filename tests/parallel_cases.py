"""Shared by tests/test_parallel.py and its spawned ranks: the batches, the one-rank
reference and the per-rank run of one sequence/data-parallel case (fp64)."""

from __future__ import annotations

import dataclasses
import os

import torch

from eagle3fn.draft import DraftConfig, RopeConfig, init_params
from eagle3fn.loss import LossConfig
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, ttt
from eagle3fn.vocab import build_vocab_map
from ranks import COLLECTIVE_TIMEOUT

K, L, V, VD, H, HT, B_LOCAL = 3, 21, 53, 19, 32, 24, 2
CFG = DraftConfig(hidden_size=H, intermediate_size=40, num_heads=4, num_kv_heads=2, vocab_size=V,
                  draft_vocab_size=VD, target_hidden_size=HT,
                  rope=RopeConfig(rope_type="llama3", factor=8.0, original_max_position_embeddings=8))
FAMILIES = ["all", "random30", "straddle", "tail_only", "one_rank_empty"]
# (name, family, trim, loss, control); controls must be caught by the same comparison.
CASES = [(f, f, "loss", LossConfig(), None) for f in FAMILIES] + [
    ("random30-none", "random30", "none", LossConfig(), None),
    ("random30-token_mean", "random30", "loss", LossConfig(normalization="token_mean"), None),
    ("random30-lambda", "random30", "loss", LossConfig(objective="lambda"), None),
    ("random30-alpha", "random30", "loss", LossConfig(objective="alpha"), None),
    ("random30-backbone", "random30", "backbone", LossConfig(), None),
    ("straddle-backbone", "straddle", "backbone", LossConfig(), None),
    ("one_rank_empty-backbone", "one_rank_empty", "backbone", LossConfig(), None),
    ("control-tail-twice", "random30", "loss", LossConfig(), "tail_twice"),
    ("control-local-denominator", "random30", "loss", LossConfig(), "local_denominator"),
]
LAYOUTS = {  # name: (world, dp, ring, ulysses)
    "ulysses2": (2, 1, 1, 2),
    "ring2": (2, 1, 2, 1),
    "ulysses2xring2": (4, 1, 2, 2),
    "ring4": (4, 1, 4, 1),
    "dp2xring2": (4, 2, 2, 1),
}


def global_batch(family: str, B: int, sp: int, seed: int = 0):
    """A batch of global length L (right-padded samples) and its supervised mask,
    both already padded to ``sp*C``, plus the draft params and vocab map."""
    g = torch.Generator().manual_seed(seed)
    C = -(-L // sp)
    Lp = sp * C
    d2t, t2d = build_vocab_map(torch.randint(0, 100, (V,), generator=g), VD)
    lengths = torch.tensor([L, L - 5, L - 2, L - 9][:B])
    pos = torch.arange(Lp)[None, :]
    attention = (pos < lengths[:, None]).long()
    head = torch.randn(V, HT, generator=g, dtype=torch.float64)
    head[t2d] *= 1.5
    features = Features(
        input_ids=torch.randint(0, V, (B, Lp), generator=g) * attention,
        aux=torch.randn(B, Lp, 3 * HT, generator=g, dtype=torch.float64) * attention[..., None],
        attention_mask=attention,
        target_logits=(torch.randn(B, Lp, HT, generator=g, dtype=torch.float64) @ head.T)
        * attention[..., None],
    )
    boundaries = [r * C for r in range(1, sp)]
    chosen = {
        "all": torch.ones(B, Lp, dtype=torch.bool),
        "random30": torch.rand(B, Lp, generator=g) < 0.3,
        "straddle": sum((pos - b).abs() <= 1 for b in boundaries) > 0 if boundaries else pos == 3,
        "tail_only": (pos >= C) & (pos <= C + K - 2),
        # rank 1 owns [C, 2C) and its tail reaches 2C + K: nothing there is supervised.
        "one_rank_empty": (pos < C) | (pos >= 2 * C + K),
    }[family].expand(B, Lp)
    supervised = chosen & (pos < lengths[:, None] - 1)  # never the last token (SPEC 1)
    params = init_params(CFG, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        for name, p in params.items():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if "norm" in name else 0.15))
    return features, supervised, params, d2t, t2d


def result(obj, grads, stepped=None) -> dict:
    out = {f: getattr(obj, f).detach().clone() for f in ("objective", "step_loss", "kl_loss", "acc",
                                                          "accept", "tau")}
    out["grads"] = {n: g.detach().clone() for n, g in grads.items()}
    if stepped is not None:
        out["stepped"] = stepped
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def reference(family: str, trim_unused: str, loss: LossConfig, dp: int, sp: int) -> dict:
    """One rank, full length (trim="none"), the whole global batch padded to sp*C."""
    features, supervised, params, d2t, t2d = global_batch(family, B_LOCAL * dp, sp)
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    config = TTTConfig(draft=CFG, ttt_length=K, trim="none", attention="eager", loss=loss)
    obj = ttt(ps, features, build_rowmap(supervised, K), config, d2t=d2t, t2d=t2d)
    obj.objective.backward()
    trainable = {n: p for n, p in ps.items() if p.requires_grad}
    grads = {n: p.grad for n, p in trainable.items()}
    opt = adamw(trainable.values())
    opt.step()
    return result(obj, grads, {n: p.detach().clone() for n, p in trainable.items()})


def rank_main(rank: int, world: int, init_file: str, out_dir: str, layout_name: str) -> None:
    """One spawned rank: every case of CASES under one layout; rank 0 saves results."""
    import torch.distributed as dist

    from eagle3fn.parallel import (ParallelConfig, build_layout, collectives, full, gather,
                                   reduce_grads, shard, shard_sequence)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    _, dp, ring, ulysses = LAYOUTS[layout_name]
    layout = build_layout(ParallelConfig(ring=ring, ulysses=ulysses), torch.device("cpu"))
    results = {}
    for name, family, trim, loss, control in CASES:
        features, supervised, params, d2t, t2d = global_batch(family, B_LOCAL * dp, layout.sp)
        rows = slice(layout.dp_rank * B_LOCAL, (layout.dp_rank + 1) * B_LOCAL)
        features = Features(**{f.name: (getattr(features, f.name)[rows]
                                         if getattr(features, f.name) is not None else None)
                               for f in dataclasses.fields(Features)})
        local, sup, C = shard_sequence(features, supervised[rows], layout.sp, layout.sp_rank, K)
        num_rows = C
        if control == "tail_twice":  # the bug: the overlap tail treated as own rows
            num_rows = sup.shape[1]
            sup = sup.clone()
            sup[:, -1] = False
        rowmap = build_rowmap(sup, K, num_rows=num_rows)
        sharded = shard({n: p.detach().clone().requires_grad_(p.requires_grad)
                         for n, p in params.items()}, layout)
        coll = collectives(layout, rowmap.denominator, torch.device("cpu"), compile_elementwise=True)
        if control == "local_denominator":  # the bug: dividing by this rank's B*C
            coll = dataclasses.replace(coll, denominator=rowmap.denominator)
        config = TTTConfig(draft=CFG, ttt_length=K, trim=trim, attention="eager", loss=loss)
        whole = gather(sharded)
        obj = ttt(whole, local, rowmap, config, d2t=d2t, t2d=t2d, collectives=coll)
        obj.objective.backward()
        reduce_grads(sharded, whole)
        trainable = {n: p for n, p in sharded.items() if p.requires_grad}
        grads = full({n: p.grad for n, p in trainable.items()})
        opt = adamw(trainable.values())
        opt.step()
        results[name] = result(obj, grads, full(trainable))
    if rank == 0:
        torch.save(results, os.path.join(out_dir, f"{layout_name}.pt"))
    dist.barrier()
    dist.destroy_process_group()
