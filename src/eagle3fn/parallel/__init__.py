"""Data and sequence parallelism: the only package that imports ``torch.distributed``.

- ``mesh``: ``ParallelConfig``, the ``(dp, ring, ulysses)`` mesh from a torchrun launch.
- ``seqpar``: the split (own chunk + k tail), cross-rank step-0 attention (ring P2P
  with log-sum-exp merge, Ulysses all-to-all, both), reduction of the step sums.
- ``params``: draft parameters as DTensor shards, gathered for compute.

One batch on one rank of any layout::

    local, sup, C = shard_sequence(features, supervised, layout.sp, layout.sp_rank, k)
    rowmap = build_rowmap(sup, k, num_rows=C)
    whole = gather(sharded)
    obj = ttt(whole, local, rowmap, config, d2t=d2t, t2d=t2d,
              collectives=collectives(layout, rowmap.denominator, device, config.attention,
                                      compile_elementwise=config.compile_elementwise))
    obj.objective.backward()
    reduce_grads(sharded, whole)   # sharded grads = the one-rank gradient
"""

from eagle3fn.parallel.mesh import (Layout, ParallelConfig, all_reduce, build_layout, init_distributed, is_main,
                                    leave_distributed)
from eagle3fn.parallel.params import (distribute_like, full, full_optimizer_state, gather, load_optimizer_state,
                                      reduce_grads, shard)
from eagle3fn.parallel.seqpar import (
    SequenceParallelAttention,
    chunk_window,
    collectives,
    pad_for_sp,
    reduce_terms,
    ring_pass,
    shard_sequence,
)

__all__ = ["Layout", "ParallelConfig", "SequenceParallelAttention", "all_reduce", "build_layout", "chunk_window",
           "collectives", "distribute_like", "full", "full_optimizer_state", "gather", "init_distributed", "is_main",
           "leave_distributed", "load_optimizer_state", "pad_for_sp", "reduce_grads", "reduce_terms", "ring_pass", "shard",
           "shard_sequence"]
