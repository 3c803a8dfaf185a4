"""The unrolled TTT objective (SPEC section 3), one module per stage::

    config.py    TTTConfig (and Collectives): what the objective is configured by
    policy.py    which rows trim="backbone" computes; which path trim="auto" takes
    layout.py    the steps' index maths, planned on the host and uploaded once per batch;
                 a row map built on the host sent to the device (``rowmap_to_device``)
    attention.py one step's attention: eager, or packed FlexAttention, per step's rows
    flex.py      packed FlexAttention over the step-0 keys, diagonal merged after
    blocks.py    packed query windows and their FlexAttention block tables
    merges.py    log-sum-exp merges: the diagonal keys; two key blocks (the ring's)
    unroll.py    the k steps of the draft layer, the head and loss per step -> ``ttt``
                 (its host part ``prepare_batch``, its teacher ``batch_teacher`` and its
                 differentiable part ``planned_objective``, for a compiled step)
    runtime.py   the intra-op thread count around the host index maths (what is
                 compiled, and dynamo's recompile budget: ``eagle3fn.compiled``)

``ttt(params, features, rowmap, config, d2t=, t2d=)`` is the function; everything
else here is what other packages (``eagle3fn.parallel``, ``eagle3fn.plan``) and
tests build on.
"""

from eagle3fn.unrolled.attention import eager_attention
from eagle3fn.unrolled.blocks import (FLEX_BLOCK, PackedLayout, block_tables, packed_block_mask, packed_layout,
                                      packed_query_len)
from eagle3fn.unrolled.config import (COMPILE_ELEMENTWISE_DEFAULT, DEFAULT_QUERY_BUCKETS,
                                      AttentionImpl, Collectives, LossImpl, Trim, TTTConfig)
from eagle3fn.unrolled.flex import flex_kernel_options, pack_queries, packed_flex_attention, packed_keys
from eagle3fn.unrolled.layout import rowmap_to_device
from eagle3fn.unrolled.merges import merge_blocks, merge_diagonal, merge_diagonal_as, use_merge_kernel
from eagle3fn.unrolled.policy import auto_score, auto_trim, choose_trim, computed_rows
from eagle3fn.unrolled.unroll import (HEAD_CHUNK_LOGITS, backbone, batch_teacher, fused_head_chunk,
                                      gated_counts, planned_objective, prepare_batch, trimmed_backbone, ttt)

__all__ = [
    "AttentionImpl",
    "COMPILE_ELEMENTWISE_DEFAULT",
    "Collectives",
    "DEFAULT_QUERY_BUCKETS",
    "FLEX_BLOCK",
    "HEAD_CHUNK_LOGITS",
    "LossImpl",
    "PackedLayout",
    "TTTConfig",
    "Trim",
    "auto_score",
    "auto_trim",
    "backbone",
    "batch_teacher",
    "block_tables",
    "choose_trim",
    "computed_rows",
    "eager_attention",
    "flex_kernel_options",
    "fused_head_chunk",
    "gated_counts",
    "merge_blocks",
    "merge_diagonal",
    "merge_diagonal_as",
    "pack_queries",
    "rowmap_to_device",
    "packed_block_mask",
    "packed_flex_attention",
    "packed_keys",
    "packed_layout",
    "packed_query_len",
    "planned_objective",
    "prepare_batch",
    "trimmed_backbone",
    "ttt",
    "use_merge_kernel",
]
