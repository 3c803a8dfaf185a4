"""The saved-tensor model: what ``unrolled.ttt`` keeps for backward, op by op, per
step (backbone, attention, head), and the teacher table and inputs beside it.

Legend: B batch, C own rows per sample, R = B*C rows of a rank, Lp = R rounded up to
the flex block, Qp packed query rows, k TTT length, H draft hidden, I MLP width, h
heads, g kv heads, d head dim, Vd draft vocab, b bytes per compute-dtype element,
n_j loss rows of step j, m_j layer rows of step j, U teacher positions.

Each RMSNorm keeps, fused, its input and rsqrt, or, eager, its fp32 input, rsqrt and
pre-weight output; SwiGLU three ``[m_j, I]`` fused, four eager; the packed
FlexAttention its query and output ``[1, h, Qp, d]``, log-sum-exp and block mask,
and once per batch the step-0 keys and values ``[1, g, Lp, d]``; the diagonal merge
its query and the stacked own keys and values ``[j, m_j, g, d]``, fused, or fp32
copies, eager; the fused head only its input rows; the unfused head its logits.
``fused``: ``TTTConfig.compile_elementwise`` (the CUDA path); ``query_buckets``:
``TTTConfig.query_buckets``.
"""

from __future__ import annotations

import math

from eagle3fn.plan.args import PlanArgs, attention_kind
from eagle3fn.plan.rows import Rows
from eagle3fn.unrolled import DEFAULT_QUERY_BUCKETS, FLEX_BLOCK, packed_query_len
from eagle3fn.unrolled.blocks import MIN_FLEX_BLOCKS

FLEX_SAVES_MAX_SCORES = True
"""FlexAttention keeps an fp32 ``[1, h, Qp]`` row maximum beside its log-sum-exp
(torch's eager autograd op does, as the CPU tests measure; whether the compiled
graph keeps it is not measured: 1 MiB per step at 8B shapes and 8192 tokens)."""


def packed_len(args: PlanArgs) -> int:
    """Lp, the packed FlexAttention length: ``B*C`` rounded up to the flex block."""
    return max(-(-args.batch * args.own_rows // FLEX_BLOCK), MIN_FLEX_BLOCKS) * FLEX_BLOCK


def query_len(args: PlanArgs, m: float, query_buckets: int) -> int:
    """Qp, the packed query length of ``m`` query rows (``unrolled.packed_query_len``)."""
    return packed_query_len(math.ceil(m), packed_len(args), query_buckets)


def _flex_mask_bytes(Qp: int, Lp: int) -> int:
    """One step's ``packed_block_mask``: int32 kv tables (``[Mq]`` counts and
    ``[Mq, M]`` indices, partial and full; Mq = Qp/128, M = Lp/128), their transposed q
    tables (``[M]``, ``[M, Mq]``), and the int64 query windows (start, last ``[Qp]``)
    its ``mask_mod`` captures."""
    Mq, M = Qp // FLEX_BLOCK, Lp // FLEX_BLOCK
    return 4 * (2 * Mq + 2 * M + 4 * Mq * M) + 2 * Qp * 8


def _merge_saved(args: PlanArgs, j: int, m: float, fused: bool, query_buckets: int) -> float:
    """What ``unrolled.merge_diagonal`` keeps at step ``j >= 1`` for ``m`` rows: always the
    natural-log log-sum-exp FlexAttention returns (fp32 ``[1, h, Qp]``, apart from
    the one it keeps itself); ``o`` is a view of the FlexAttention output, counted
    there.

    Fused (the Triton kernel of ``kernels.merge``; the tests run it in the Triton
    interpreter): q ``[m, h, d]``, the diagonal keys and values ``[j, m, g, d]`` and
    the merged fp32 log-sum-exp ``[m, h]``. Eager, all fp32: q and the keys and
    values (copies in bf16, the tensors themselves in fp32), o (a copy in bf16), the
    scores ``[j, m, h]``, their maximum and exponentials, the numerator ``[m, h, d]``
    and the denominator ``[m, h]``."""
    b, h, g, d = args.dtype_bytes, args.heads, args.kv_heads, args.d
    if j == 0:
        return 0.0
    P, G, sh = m * h * d, m * g * d, m * h
    lse = query_len(args, m, query_buckets) * h * 4
    if fused:
        return lse + P * b + 2 * j * G * b + sh * 4
    return lse + P * 4 * (2 if b == 4 else 3) + 2 * j * G * 4 + (2 * j + 3) * sh * 4


def _attention_saved(args: PlanArgs, j: int, m: float | None = None, kind: str | None = None,
                     hops: int | None = None, *, fused: bool, shared_mask: bool = False,
                     query_buckets: int = DEFAULT_QUERY_BUCKETS) -> float:
    """Bytes the attention call of step j keeps for backward, for ``m`` query rows
    (default every row, ``B*C``). ``kind`` and ``hops`` (earlier ring blocks seen)
    default to the planned rank's.

    flex (``unrolled.packed_flex_attention``): the packed query and output ``[1, h, Qp, d]``
    (Qp = ``m`` rounded up to a query bucket, ``unrolled.packed_query_len``), the fp32
    log-sum-exp and row maximum ``[1, h, Qp]``, the block mask, the merge of
    the diagonal keys (``_merge_saved``) and, at step 0 only, the packed step-0 keys
    and values ``[1, g, Lp, d]`` (shared by every step); ``shared_mask``: the steps
    share one every-row layout (``trim`` none / loss), whose block mask and windows
    are counted at step 0 only. eager / ring: the dense
    ``[B, h, C, d]`` queries (trimmed rows are zeros there) and explicit scores."""
    b, B, C = args.dtype_bytes, args.batch, args.own_rows
    h, g, d = args.heads, args.kv_heads, args.d
    kind = kind or attention_kind(args)
    m = B * C if m is None else m
    if kind == "flex":
        Lp, Qp = packed_len(args), query_len(args, m, query_buckets)
        lse = Qp * h * 4 * (2 if FLEX_SAVES_MAX_SCORES else 1)
        keys = 2 * Lp * g * d * b if j == 0 else 0
        mask = _flex_mask_bytes(Qp, Lp) if j == 0 or not shared_mask else 0
        return 2 * Qp * h * d * b + lse + mask + keys + _merge_saved(args, j, m, fused, query_buckets)
    vec = B * C * h * d * b
    # matmul folds [B, h, C, d] queries laid out as [B, C, h, d] without a copy only
    # when B = 1; the diagonal terms keep the queries themselves from step 1 on
    queries = vec if B == 1 else vec * (2 if j else 1)
    diag = 2 * j * vec  # the diagonal keys and values, expanded to h heads
    if kind == "eager":
        scores = B * h * C * (C + j) * (4 + (2 if b == 2 else 0))  # fp32 softmax, bf16 copy
        return B * C * C + scores + queries + 2 * vec + diag
    # ring (eagle3fn.parallel.seqpar._partial_attention); the last rank sees sp - 1
    # earlier blocks, each with its own query copy, keys, values, scores and merge
    per_score = 4 + 4 + (2 if b == 2 else 0)  # logsumexp input, exp output, bf16 probs
    own = B * C * C + B * h * C * (C + j) * per_score + B * h * C * 4 + queries + 2 * vec + diag
    hops = args.sp - 1 if hops is None else hops
    return own + hops * (B * C + B * h * C * C * per_score + 3 * B * h * C * 4 + 5 * vec)


def _o_proj_input(args: PlanArgs, m: float) -> float:
    """What ``o_proj`` keeps: its ``[m, h*d]`` input, a new tensor on every path (flex:
    step 0 copies the output out of the head-major ``[1, h, Lp, d]`` layout, later
    steps keep the merge's output; eager / ring: the ``[B, h, C, d]`` output
    flattened, or gathered at the trimmed rows)."""
    return m * args.heads * args.d * args.dtype_bytes


def _norm_saved(args: PlanArgs, rows: float, fused: bool, input_counted: bool = False,
                input_grad: bool = True) -> float:
    """What one RMSNorm of ``rows`` rows keeps (its output, the next GEMM's input, is
    counted there). Eager (``draft.rms_norm`` unfused): the fp32 input (a copy in bf16,
    the input itself in fp32), the fp32 rsqrt ``[rows, 1]`` and the pre-weight output;
    only the pre-weight output when the input needs no gradient (the frozen
    embedding's rows). Fused (inductor; the tests check this on CPU inductor): the
    input itself and the rsqrt, the fp32 intermediates stay in registers.
    ``input_counted``: the input's storage is already counted elsewhere."""
    H, b = args.hidden, args.dtype_bytes
    if fused:
        return rows * 4 + (0.0 if input_counted else rows * H * b)
    if not input_grad:
        return rows * H * b
    fp32_input = 0.0 if (b == 4 and input_counted) else rows * H * 4
    return fp32_input + rows * 4 + rows * H * b


def swiglu_saved(args: PlanArgs, rows: float, fused: bool) -> float:
    """The MLP's ``[rows, I]`` tensors: gate and up (and silu(gate) unfused), and
    silu(gate)*up, ``down_proj``'s input."""
    return rows * (3 if fused else 4) * args.intermediate * args.dtype_bytes


def backbone_saved(args: PlanArgs, rows: Rows, fused: bool,
                   query_buckets: int) -> tuple[list[float], list[float]]:
    """Per step: (everything the backbone keeps, the attention's share), following
    ``unrolled.unroll._unroll`` op by op.

    Step 0, every row: the embedding and hidden norms, the q/k/v input ``u``
    ``[R, 2H]``, RoPE cos and sin ``[R, 1, d]``; then for its m rows (all of them
    without backbone trimming; trimmed, ``u``, cos and sin gathered for them) the
    attention, o_proj's input, the post-attention norm, the MLP input and SwiGLU.
    Step ``j >= 1``: the same for its m rows (the hidden norm's input is the previous
    output, or its gathered rows), plus, trimmed, the int64 positions of its rows
    inside the previous step's (they gather the previous output and diagonal keys)."""
    b, k, d, H = args.dtype_bytes, args.ttt_length, args.d, args.hidden
    h, g = args.heads, args.kv_heads
    R = rows.kv_rows
    trimmed = rows.trim == "backbone"
    kind = attention_kind(args)
    saved, attn = [], []
    for j in range(k):
        m = rows.layer_rows[j]
        a = _attention_saved(args, j, m, fused=fused, shared_mask=not trimmed,
                             query_buckets=query_buckets)
        n = R if j == 0 else m  # rows whose norms and q/k/v input step j computes
        norms = _norm_saved(args, n, fused, input_grad=False) + _norm_saved(args, n, fused)
        s = norms + n * 2 * H * b + 2 * n * d * b
        if trimmed and j == 0:
            s += m * 2 * H * b + 2 * m * d * b  # u, cos, sin of rows[0]
        if trimmed and j > 0:
            s += m * 8  # positions inside the previous step's rows
        if trimmed and kind != "flex":  # index_copy into the dense tensors keeps its sources:
            s += m * h * d * b + 2 * j * m * g * d * b  # the queries and the diagonal keys
        s += (a + _o_proj_input(args, m) + _norm_saved(args, m, fused) + m * H * b
              + swiglu_saved(args, m, fused))
        saved.append(s)
        attn.append(a)
    return saved, attn


def head_saved(args: PlanArgs, rows: Rows, fused: bool) -> list[float]:
    """Per step: what the head and loss keep for backward."""
    b, H, Vd, k = args.dtype_bytes, args.hidden, args.draft_vocab, args.ttt_length
    out = []
    for j in range(k):
        if rows.trim == "none":
            R = rows.kv_rows
            # the norm's input is the step's own output, already kept by the next
            # step's hidden norm (all but the last step) when that keeps it itself
            # + lm_head's input and the bool row mask
            s = _norm_saved(args, R, fused, input_counted=j < k - 1) + R * H * b + R
            if args.loss_impl == "triton":  # bf16 logits, the table rows, two fp32 [R]
                s += R * Vd * b + R * 8 + 2 * R * 4
            else:  # fp32 log-probabilities and gathered teacher rows
                s += 2 * R * Vd * 4
            out.append(s)
        else:
            n = rows.loss_rows[j]
            index = n * 8 if rows.trim == "backbone" else 0.0  # searchsorted positions
            out.append(n * H * b + index)  # the checkpoint keeps its input rows
    return out


def teacher_bytes(args: PlanArgs, U: float) -> tuple[float, float]:
    """(table bytes, extra bytes while building it from the final hidden)."""
    Vd, V = args.draft_vocab, args.vocab
    b = args.dtype_bytes
    cs = min(args.teacher_chunk_size, V)
    table = U * (Vd * b + 4 + 4 + 8 + 1)  # logits, lse_draft, lse_full, token, gate
    # beside the table: the block's fp32 z, z - max and exp(z - max) (the draft-vocab
    # lse after the loop, in row blocks of U * cs entries, needs less); the gathered
    # hidden; int64 cumsum [V] and draft ids [Vd]
    per_row = 12 * cs + args.ht * b
    return table, U * per_row + (V + Vd) * 8


def inputs_bytes(args: PlanArgs, rows: Rows) -> float:
    """Features (int64 ids and attention mask, bool masks, aux, final hidden, target
    head), vocab maps and the row map's index tensors."""
    b, B, T = args.dtype_bytes, args.batch, args.buffer_len
    features = B * T * (8 + 8 + 1 + 1) + B * T * 4 * args.ht * b + args.vocab * args.ht * b
    vocab = args.draft_vocab * 8 + args.vocab
    # rows, table rows, teacher positions, backbone rows (entry 0: every row), step-0 rows
    rowmap = 8 * (2 * sum(rows.loss_rows) + rows.teacher_positions + rows.kv_rows
                  + sum(rows.layer_rows))
    return features + vocab + rowmap
