"""The planner's entry points: ``estimate`` (one TTT step's rows, memory and FLOPs on
the rank with the highest peak), ``format_plan`` and ``plan``, the ``eagle3fn plan``
command.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle3fn.plan.args import TTT_DEFAULTS, GiB, PlanArgs
from eagle3fn.plan.flops import Flops, plan_flops
from eagle3fn.plan.memory import Memory, plan_memory
from eagle3fn.plan.rows import Rows, plan_rows


@dataclass(frozen=True)
class Plan:
    """What one TTT step needs (``estimate``).

    Fields:
        args: the planned configuration.
        rows: the rows each step computes on the planned rank.
        memory: bytes by component and the peak.
        flops: FLOPs by component.
        fits: the peak is at most ``args.gpu_memory_gib``.
        headroom: ``gpu_memory_gib`` minus the peak, bytes (negative: short by that).
        compile_elementwise: whether the plan assumes the fused elementwise chains and
            merge kernel (``TTTConfig.compile_elementwise``; ``estimate``).
    """

    args: PlanArgs
    rows: Rows
    memory: Memory
    flops: Flops
    fits: bool
    headroom: int
    compile_elementwise: bool


def estimate(args: PlanArgs, *, compile_elementwise: bool = TTT_DEFAULTS["compile_elementwise"],
             query_buckets: int = TTT_DEFAULTS["query_buckets"]) -> Plan:
    """Plan one TTT step: rows per step, memory by component and the peak, FLOPs.

    Under sequence parallelism every rank is planned and the one with the highest
    peak is returned (with tail supervision the last ranks hold the supervised rows).
    ``compile_elementwise`` and ``query_buckets``: the ``TTTConfig`` settings the
    planned step runs with (default: ``TTTConfig``'s).
    """
    ranks = range(args.sp) if args.sp <= 64 else sorted({0, args.sp - 2, args.sp - 1})
    best = None
    for r in ranks:
        rows = plan_rows(args, r)
        memory = plan_memory(args, rows, compile_elementwise, query_buckets)
        if best is None or memory.peak > best[1].peak:
            best = (rows, memory)
    rows, memory = best
    capacity = int(args.gpu_memory_gib * GiB)
    return Plan(args=args, rows=rows, memory=memory, flops=plan_flops(args, rows),
                fits=memory.peak <= capacity, headroom=capacity - memory.peak,
                compile_elementwise=compile_elementwise)


def format_plan(plan: Plan) -> str:
    """A short table: component and GiB, the peak, whether it fits, TFLOPs per step."""
    a, m, f, r = plan.args, plan.memory, plan.flops, plan.rows
    g = lambda x: f"{x / GiB:8.2f}"  # noqa: E731
    lines = [
        f"S={a.seq_len} B={a.batch} sp={a.sp} {a.density:.0%} {a.pattern}, trim={r.trim}"
        + (" (auto)" if a.trim == "auto" else "") + (", optimizer" if a.optimizer else "")
        + ("" if plan.compile_elementwise else ", eager elementwise") + f", rank {r.rank}",
        f"rows per step (loss)  {[round(x) for x in r.loss_rows]}",
        f"rows per step (layer) {[round(x) for x in r.layer_rows]}",
        f"{'component':<28}{'GiB':>8}",
        f"{'parameters':<28}{g(m.parameters)}",
        f"{'gradients':<28}{g(m.gradients)}",
        f"{'optimizer state':<28}{g(m.optimizer_state)}",
        f"{'inputs / features':<28}{g(m.inputs)}",
        f"{'teacher table':<28}{g(m.teacher_table)}",
        f"{'saved activations':<28}{g(m.saved_total)}",
        f"{'  of which attention':<28}{g(sum(m.attention_saved))}",
        f"{'  of which head / loss':<28}{g(sum(m.head_saved_per_step))}",
        f"{'largest transient':<28}{g(m.largest_transient)}",
        f"{'peak (' + m.peak_phase + ')':<28}{g(m.peak)}",
        f"fits in {a.gpu_memory_gib:g} GiB: {'yes' if plan.fits else 'no'} "
        f"({'headroom' if plan.fits else 'short by'} {abs(plan.headroom) / GiB:.2f} GiB)",
        f"TFLOPs per step: {f.total / 1e12:.1f} (backbone {f.backbone_gemm / 1e12:.1f}, "
        f"attention {f.attention / 1e12:.1f}, head {f.head / 1e12:.1f}, "
        f"teacher {f.teacher / 1e12:.1f})",
    ]
    if a.sp > 1 and a.attention != "eager":
        lines.append(SP_FLEX_NOTE)
    return "\n".join(lines)


SP_FLEX_NOTE = ("note: sp > 1 is planned with the eager ring attention (explicit scores, "
                "memory ~C*S); on CUDA training runs the flex ring path "
                "(seqpar.ring_block_attention, memory linear in the rows), which this plan does "
                "not model yet: its attention figures are an upper bound there")
"""The line ``format_plan`` adds for a sequence-parallel plan of the GPU path."""


def plan(args: PlanArgs, *, compile_elementwise: bool = TTT_DEFAULTS["compile_elementwise"]) -> None:
    """Print the plan of one TTT step (the ``eagle3fn plan`` command; the CLI passes
    ``compile_elementwise`` off under ``EAGLE3FN_COMPILE=0``)."""
    print(format_plan(estimate(args, compile_elementwise=compile_elementwise)))
