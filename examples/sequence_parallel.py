"""Sequence parallelism in one page: split a batch over the ranks, run the trimmed TTT,
and check it against the one-rank full-length path (run on every rank, it is small).

    python -m torch.distributed.run --standalone --nproc-per-node 2 \
        examples/sequence_parallel.py --ring 2          # or --ulysses 2, or both with 4
"""

import torch
import tyro

from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.parallel import (ParallelConfig, build_layout, collectives, full, gather,
                               init_distributed, pad_for_sp, reduce_grads, shard, shard_sequence)
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.unrolled import TTTConfig, ttt
from eagle3fn.vocab import build_vocab_map


def main(parallel: ParallelConfig) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    init_distributed(device)
    layout = build_layout(parallel, device)
    k, L, V, Vd = 3, 30, 64, 32
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                      vocab_size=V, draft_vocab_size=Vd, target_hidden_size=16)
    g = torch.Generator().manual_seed(0)  # the same batch on every rank
    d2t, t2d = build_vocab_map(torch.randint(0, 50, (V,), generator=g), Vd)
    pad = lambda x: pad_for_sp(x, layout.sp)  # noqa: E731 - the one-rank reference's length
    features = Features(input_ids=pad(torch.randint(0, V, (1, L), generator=g)),
                        aux=pad(torch.randn(1, L, 48, generator=g, dtype=torch.float64)),
                        attention_mask=pad(torch.ones(1, L, dtype=torch.long)),
                        target_logits=pad(torch.randn(1, L, V, generator=g, dtype=torch.float64)))
    supervised = pad(torch.arange(L)[None] >= 20)  # the answer: the last third (not L-1)
    supervised[:, L - 1] = False
    params = init_params(cfg, dtype=torch.float64, seed=0)
    config = TTTConfig(draft=cfg, ttt_length=k, trim="loss", attention="eager")

    # One rank, full length: the reference.
    ref = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    want = ttt(ref, features, build_rowmap(supervised, k), config, d2t=d2t, t2d=t2d)
    want.objective.backward()

    # This rank's chunk: C own rows and a k-position tail that teaches but emits no rows.
    local, sup, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank, k)
    rowmap = build_rowmap(sup, k, num_rows=C)
    sharded = shard(params, layout)
    whole = gather(sharded)
    got = ttt(whole, local, rowmap, config, d2t=d2t, t2d=t2d,
              collectives=collectives(layout, rowmap.denominator, device, config.attention,
                                      compile_elementwise=config.compile_elementwise))
    got.objective.backward()
    reduce_grads(sharded, whole)
    grads = full({n: p.grad for n, p in sharded.items() if p.requires_grad})
    err = max(((grads[n] - ref[n].grad).abs().max() / ref[n].grad.abs().max()).item() for n in grads)
    rows = [r.numel() for r in rowmap.rows]
    print(f"rank {layout.sp_rank}: own positions [{layout.sp_rank * C}, {(layout.sp_rank + 1) * C}) "
          f"rows per step {rows}", flush=True)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"loss {got.objective.item():.12f} vs one rank {want.objective.item():.12f}; "
              f"max gradient rel err {err:.1e}")
        assert abs(got.objective.item() - want.objective.item()) < 1e-10 and err < 1e-10
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(tyro.cli(ParallelConfig))
