"""FLOPs of one step, counted as the code executes them: every GEMM (forward, and
backward as two GEMMs per weight, one where the input needs no gradient),
FlexAttention per computed 128x128 block of the packed mask
(``unrolled.packed_block_mask``: per active query block, the key blocks from its
first row's sample start to its last row; the diagonal keys are merged elementwise
and not counted), the fused head's recomputation, and the streamed teacher (forward
only).

Legend: B batch, C own rows per sample, R = B*C, k TTT length, H draft hidden, Ht
target hidden, I MLP width, h heads, g kv heads, d head dim, V target vocab, Vd draft
vocab, m_j layer rows of step j.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3fn.plan.args import PlanArgs, attention_kind
from eagle3fn.plan.rows import Rows
from eagle3fn.unrolled import FLEX_BLOCK


@dataclass(frozen=True)
class Flops:
    """Forward + backward FLOPs of one step on the planned rank, by component.

    Fields:
        backbone_gemm: fc, q/k/v/o and the SwiGLU GEMMs.
        attention: attention matmuls as executed (flex: computed blocks; eager: dense).
        head: draft norm + lm_head GEMMs (the fused head recomputes its forward).
        teacher: the streamed target head ``[U, Ht] x [Ht, V]`` (forward only).
        total: the sum.
    """

    backbone_gemm: float
    attention: float
    head: float
    teacher: float
    total: float


def plan_flops(args: PlanArgs, rows: Rows) -> Flops:
    """Forward + backward FLOPs of one step on ``rows``' rank (module docstring)."""
    B, C, k = args.batch, args.own_rows, args.ttt_length
    H, I, Vd, h, g, d = (args.hidden, args.intermediate, args.draft_vocab, args.heads,
                         args.kv_heads, args.d)
    R = rows.kv_rows
    q_f, kv_f, o_f, mlp_f = 2 * 2 * H * h * d, 2 * 2 * 2 * H * g * d, 2 * h * d * H, 2 * 3 * H * I
    fc = 2 * 3 * args.ht * H * R * 2  # forward + weight gradient (aux has none)
    gemm = fc
    for j in range(k):
        m = rows.layer_rows[j]
        if rows.trim == "backbone" and j == 0:
            gemm += 3 * (R * kv_f + m * (q_f + o_f + mlp_f))
        else:
            gemm += 3 * m * (q_f + kv_f + o_f + mlp_f)
    kind = attention_kind(args)
    attn = 0.0
    for j in range(k):
        if kind == "flex":
            attn += 3.5 * 4 * h * d * FLEX_BLOCK * FLEX_BLOCK * rows.attention_blocks[j]
        else:
            keys = C * (args.sp if kind == "ring" else 1)
            attn += 3 * 4 * B * h * C * keys * d
    if rows.trim == "none":
        head = 3 * 2 * H * Vd * R * k
    else:
        head = 4 * 2 * H * Vd * sum(rows.loss_rows)  # forward, recompute, two gradients
    teacher = 2 * args.ht * args.vocab * rows.teacher_positions
    return Flops(backbone_gemm=gemm, attention=attn, head=head, teacher=teacher,
                 total=gemm + attn + head + teacher)
