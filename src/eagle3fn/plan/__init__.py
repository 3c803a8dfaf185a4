"""Memory and FLOP planner: what one TTT step needs on one GPU, from the shapes alone.

One module per stage of the plan::

    args.py    PlanArgs: the shapes and settings planned (the ``eagle3fn plan`` flags)
    rows.py    the row model: rows each step computes on a rank (Rows), from a real row
               map of a synthetic mask or in closed form; ``trim="auto"`` resolved by
               ``eagle3fn.unrolled.policy``, as training resolves it
    saved.py   the saved-tensor model: what ``unrolled.ttt`` keeps for backward, op by op
    memory.py  components and the bytes at each moment a step can peak (Memory)
    flops.py   FLOPs as the code executes them (Flops)
    report.py  ``estimate`` -> Plan, ``format_plan``, ``plan`` (the command)

The memory model is the list of tensors ``unrolled.ttt`` keeps for backward (each
linear its input, each norm, SwiGLU, the packed FlexAttention and the diagonal merge
what they keep, fused or eager: ``saved``), plus what lives beside them at each
moment a step can peak (``Memory.phases``).

"Fused" is the CUDA path: ``draft.fused_on_cuda`` compiles RMSNorm, RoPE and SwiGLU
with inductor, whose partitioner keeps only the inputs the backward needs (the fp32
intermediates are recomputed in registers), and ``unrolled.merge_diagonal`` runs its
Triton kernel (``kernels.merge``). The plan assumes it when ``estimate``'s
``compile_elementwise`` is on (``TTTConfig.compile_elementwise``, on by default; off
turns both off). The tests (tests/test_plan.py)
run the real ``ttt`` on CPU under ``saved_tensors_hooks``, eager and with those three
functions compiled by CPU inductor and the merge kernel in the Triton interpreter,
and compare with ``Memory.saved_total``; that the CUDA partitioner keeps the same
tensors as the CPU one, and the peak, rest on the GPU constants of ``memory`` and on
measurements (``benchmarks/step.py``).
"""

from eagle3fn.plan.args import GiB, PlanArgs
from eagle3fn.plan.flops import Flops
from eagle3fn.plan.memory import ALLOCATOR_OVERHEAD_BYTES, FLEX_BACKWARD_WORKSPACE, Memory
from eagle3fn.plan.report import SP_FLEX_NOTE, Plan, estimate, format_plan, plan
from eagle3fn.plan.rows import ROWMAP_MAX_POSITIONS, Rows, plan_rows, synthetic_mask
from eagle3fn.plan.saved import FLEX_SAVES_MAX_SCORES

__all__ = ["Flops", "Memory", "Plan", "PlanArgs", "Rows", "estimate", "format_plan", "plan",
           "plan_rows", "synthetic_mask", "ALLOCATOR_OVERHEAD_BYTES", "FLEX_BACKWARD_WORKSPACE",
           "FLEX_SAVES_MAX_SCORES", "GiB", "ROWMAP_MAX_POSITIONS", "SP_FLEX_NOTE"]
