"""The planner (plan.py) against the code it models, on CPU: the saved-activation model
equals what ``ttt`` keeps for backward (``saved_tensors_hooks``, unique storages), with
the draft's elementwise chains eager and compiled by CPU inductor; its FLOPs equal
``FlopCounterMode``'s, its FlexAttention blocks equal those of the ``packed_block_mask``
the real ``ttt`` builds, its row counts equal ``build_rowmap``'s and its auto choice
``choose_trim``'s. Each comparison has a negative control the same check must catch."""

import ast
import dataclasses
import functools
import pathlib

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.utils.flop_counter import FlopCounterMode

import eagle3fn.draft as draft_module
import eagle3fn.kernels.merge as merge_kernel
import eagle3fn.loss as loss_module
import eagle3fn.plan as plan_module
import eagle3fn.plan.memory as plan_memory
import eagle3fn.plan.rows as plan_rows_module
import eagle3fn.plan.saved as plan_saved
import eagle3fn.unrolled as unrolled
import eagle3fn.unrolled.attention as attention_module
import eagle3fn.unrolled.blocks as blocks_module
import eagle3fn.unrolled.flex as unrolled_flex
import eagle3fn.unrolled.merges as merges_module
import eagle3fn.unrolled.unroll as unroll_module
from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.plan import (ALLOCATOR_OVERHEAD_BYTES, GiB, PlanArgs, estimate, format_plan, plan,
                           plan_rows, synthetic_mask)
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.teacher import DEFAULT_CHUNK_SIZE
from eagle3fn.unrolled import TTTConfig, choose_trim
from eagle3fn.vocab import build_vocab_map

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: 2 threads crawl on a busy CPU

# Small shapes with distinct sizes (H != h*d != g*d != I) and C = 300 (not a multiple
# of the flex block); Vd large enough that the unfused head dominates trim="none".
SMALL = dict(seq_len=300, hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=16,
             vocab=1024, draft_vocab=500, ttt_length=4, target_hidden=40)
DTYPES = {2: torch.bfloat16, 4: torch.float32}


def small(**kwargs) -> PlanArgs:
    return PlanArgs(**{**SMALL, "dtype_bytes": 4, "attention": "eager", **kwargs})


def estimate_as(args: PlanArgs, fused: bool, query_buckets: int = unrolled.DEFAULT_QUERY_BUCKETS):
    """``estimate`` with the elementwise chains fused (the CUDA path) or eager (CPU)
    (``TTTConfig.compile_elementwise``)."""
    return estimate(args, compile_elementwise=fused, query_buckets=query_buckets)


@functools.cache
def cpu_compiled() -> dict:
    """The functions ``draft.fused_on_cuda`` compiles on CUDA, compiled by inductor for
    CPU tensors (same partitioner, so the same tensors kept for backward)."""
    compile_ = functools.partial(torch.compile, dynamic=True)
    return {(draft_module, "rms_norm"): compile_(draft_module.rms_norm.eager),
            (draft_module, "swiglu"): compile_(draft_module.swiglu.eager),
            (draft_module, "apply_rope"): compile_(draft_module.apply_rope.eager),
            (draft_module, "apply_rope_pair"): compile_(draft_module.apply_rope_pair.eager),
            (draft_module, "norm_pair"): compile_(draft_module.norm_pair.eager),
            (merges_module, "merge_diagonal"): merge_kernel.merge_diagonal}


def draft_config(args: PlanArgs) -> DraftConfig:
    return DraftConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                       vocab_size=args.vocab, draft_vocab_size=args.draft_vocab,
                       target_hidden_size=args.target_hidden)


def batch(args: PlanArgs):
    """(features, row map, params, d2t, t2d) of the plan's synthetic mask on one rank."""
    dtype = DTYPES[args.dtype_bytes]
    B, S = args.batch, args.seq_len
    g = torch.Generator().manual_seed(0)
    d2t, t2d = build_vocab_map(torch.randint(0, 50, (args.vocab,), generator=g), args.draft_vocab)
    features = Features(
        input_ids=torch.randint(0, args.vocab, (B, S), generator=g),
        aux=torch.randn(B, S, 3 * args.ht, generator=g).to(dtype),
        attention_mask=torch.ones(B, S, dtype=torch.long),
        final_hidden=torch.randn(B, S, args.ht, generator=g).to(dtype),
        target_head=torch.randn(args.vocab, args.ht, generator=g).to(dtype),
    )
    rm = build_rowmap(synthetic_mask(args), args.ttt_length)
    params = {n: p.detach().to(dtype).requires_grad_(p.requires_grad)
              for n, p in init_params(draft_config(args)).items()}
    return features, rm, params, d2t, t2d


def measure_saved(args: PlanArgs, fused: bool = False, **config_overrides):
    """Run the real ``ttt`` forward and count the unique storage bytes it keeps for
    backward: ``saved_tensors_hooks`` (the fused head's checkpoint keeps its inputs
    by reference, so those are added too), parameters, features, row map and teacher
    table excluded (the plan counts them elsewhere). FlexAttention's autograd op runs
    its CPU reference forward (torch refuses CPU flex only for the backward).
    ``fused``: RMSNorm, RoPE, SwiGLU and the diagonal merge compiled (``cpu_compiled``).

    Returns (saved bytes, of which inside the attention call, teacher table bytes).
    """
    features, rm, params, d2t, t2d = batch(args)
    saved, inside_attention, tables = {}, {}, []

    def packer(bucket):
        def pack(t):
            storage = t.untyped_storage()
            bucket.setdefault(storage.data_ptr(), storage.nbytes())
            return t
        return pack

    pack = packer(saved)
    checkpoint, teacher = loss_module.checkpoint, unroll_module._teacher

    def keeping_inputs(fn, *inputs, **kwargs):
        for x in inputs:
            if isinstance(x, torch.Tensor):
                pack(x)
        return checkpoint(fn, *inputs, **kwargs)

    def spy_teacher(*a, **kw):
        tables.append(teacher(*a, **kw))
        return tables[-1]

    def in_attention(fn):
        def attend(*a, **kw):
            with torch.autograd.graph.saved_tensors_hooks(packer(inside_attention), lambda t: t):
                return fn(*a, **kw)
        return attend

    attention = "eager" if args.attention == "eager" else "flex"
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=args.trim,
                       attention=attention, loss_impl=args.loss_impl, **config_overrides)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loss_module, "checkpoint", keeping_inputs)
        mp.setattr(unroll_module, "_teacher", spy_teacher)
        mp.setattr(attention_module, "packed_flex_attention", in_attention(attention_module.packed_flex_attention))
        mp.setattr(attention_module, "eager_attention", in_attention(attention_module.eager_attention))
        mp.setattr(flex_module, "_validate_device", lambda *a, **kw: None)
        for (module, name), fn in (cpu_compiled() if fused else {}).items():
            mp.setattr(module, name, fn)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            unrolled.ttt(params, features, rm, config, d2t=d2t, t2d=t2d)
    table_tensors = [x for t in tables
                     for x in (t.logits, t.lse_draft, t.lse_full, t.gate, t.target_token)]
    known = [*params.values(), features.aux, features.final_hidden, features.target_head,
             features.input_ids, features.attention_mask, d2t, t2d, *rm.rows, *rm.table_rows,
             *rm.backbone_rows, rm.step0_rows, rm.teacher_positions, *table_tensors]
    exclude = {x.untyped_storage().data_ptr() for x in known}
    attention_bytes = sum(n for p, n in inside_attention.items() if p not in exclude)
    total = attention_bytes + sum(n for p, n in saved.items()
                                  if p not in exclude and p not in inside_attention)
    return total, attention_bytes, sum(x.untyped_storage().nbytes() for x in table_tensors)


def rel(model, measured):
    return abs(model - measured) / measured


# ---- saved activations ------------------------------------------------------------

CASES = [  # (trim, loss_impl, attention, dtype bytes, batch, pattern); the loss kernel
    # matters only to the unfused head of trim="none" (the Triton one runs interpreted)
    ("none", "triton", "flex", 4, 1, "tail"),
    ("none", "torch", "eager", 4, 2, "tail"),
    ("none", "torch", "flex", 2, 2, "tail"),
    ("loss", "torch", "flex", 4, 1, "tail"),
    ("loss", "torch", "eager", 4, 2, "scattered"),
    ("loss", "triton", "flex", 2, 1, "scattered"),
    ("backbone", "torch", "flex", 4, 1, "tail"),
    ("backbone", "torch", "eager", 4, 2, "tail"),
    ("backbone", "torch", "flex", 2, 2, "scattered"),
    ("backbone", "torch", "eager", 2, 1, "scattered"),
]


# Compiling with CPU inductor costs about a minute cold in CI, so one case: the GPU
# training configuration (bf16, flex, backbone, B = 2, scattered), where every fused
# function (RMSNorm, RoPE, SwiGLU, the diagonal merge) runs.
FUSED_CASES = [CASES[8]]


def check_saved(args: PlanArgs, fused: bool):
    """The model's saved tensors (backbone + attention + head) == the storages the real
    ``ttt`` keeps for backward within 1% (to the byte but for the objective's step
    weights), the attention's share and the teacher table too."""
    measured, measured_attention, measured_table = measure_saved(args, fused=fused)
    memory = estimate_as(args, fused).memory
    assert rel(memory.saved_total, measured) < 0.01, (memory.saved_total, measured)
    assert rel(sum(memory.attention_saved), measured_attention) < 0.01, (
        sum(memory.attention_saved), measured_attention)
    assert rel(memory.teacher_table, measured_table) < 0.01
    assert sum(memory.saved_per_step) + sum(memory.head_saved_per_step) == memory.saved_total
    return measured


@pytest.mark.parametrize("trim,impl,attention,nbytes,B,pattern", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_saved_activations_match_ttt(trim, impl, attention, nbytes, B, pattern):
    """Eager elementwise chains (the CPU path, or ``EAGLE3FN_COMPILE=0``): the model ==
    the real ``ttt`` (``check_saved``)."""
    check_saved(small(trim=trim, loss_impl=impl, attention=attention, dtype_bytes=nbytes,
                      batch=B, pattern=pattern), fused=False)


@pytest.mark.parametrize("trim,impl,attention,nbytes,B,pattern", FUSED_CASES,
                         ids=["-".join(map(str, c)) for c in FUSED_CASES])
def test_saved_activations_match_compiled_ttt(trim, impl, attention, nbytes, B, pattern):
    """RMSNorm, RoPE, SwiGLU and the diagonal merge compiled as on CUDA (here by CPU
    inductor): the fused model == the real ``ttt`` (``check_saved``), and the eager
    model, which keeps their fp32 intermediates, is caught (off by more than twice the
    1% tolerance: 3% where the eager attention's scores dominate, 25-62% elsewhere)."""
    args = small(trim=trim, loss_impl=impl, attention=attention, dtype_bytes=nbytes, batch=B,
                 pattern=pattern)
    measured = check_saved(args, fused=True)
    assert rel(estimate_as(args, False).memory.saved_total, measured) > 0.02


def test_negative_control_none_model_vs_loss_run():
    """The trim="none" model against a measured trim="loss" run must NOT match."""
    measured, _, _ = measure_saved(small(trim="loss", loss_impl="torch"))
    assert rel(estimate_as(small(trim="none"), False).memory.saved_total, measured) > 0.15
    assert rel(estimate_as(small(trim="loss"), False).memory.saved_total, measured) < 0.01


def test_negative_control_code_change_is_caught():
    """A change in what the code keeps (the trimmed head unfused: logits kept) breaks the
    comparison with the unchanged model."""
    args = small(trim="loss", attention="flex", density=1.0, loss_impl="torch")
    model = estimate_as(args, False).memory.saved_total
    assert rel(model, measure_saved(args)[0]) < 0.01
    assert rel(model, measure_saved(args, fused_head=False)[0]) > 0.15


@pytest.mark.parametrize("nbytes,B,trim", [(4, 1, "loss"), (2, 2, "backbone")])
def test_ring_attention_own_block_matches_seqpar(nbytes, B, trim, monkeypatch):
    """The sequence-parallel attention model (``seqpar._partial_attention``, own
    block) == what ``SequenceParallelAttention`` keeps on a one-rank layout; the
    earlier ring blocks need several processes and are not measured here."""
    from eagle3fn.parallel.mesh import Layout
    from eagle3fn.parallel.seqpar import SequenceParallelAttention

    args = small(trim=trim, dtype_bytes=nbytes, batch=B)
    layout = Layout(mesh=None, world_mesh=None, dp=1, ring=1, ulysses=1, dp_rank=0,
                    ring_rank=0, ulysses_rank=0)
    bucket = {}

    def pack(t):
        bucket.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    attention = SequenceParallelAttention(layout, compile_elementwise=True)

    def attend(*a):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return attention(*a)

    features, rm, params, d2t, t2d = batch(args)
    collectives = unrolled.Collectives(attend=attend, reduce_terms=list, denominator=rm.denominator)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=trim, loss_impl="torch")
    unrolled.ttt(params, features, rm, config, d2t=d2t, t2d=t2d, collectives=collectives)
    exclude = {p.untyped_storage().data_ptr() for p in params.values()}
    measured = sum(n for p, n in bucket.items() if p not in exclude)
    model = sum(plan_saved._attention_saved(args, j, kind="ring", hops=0, fused=True) for j in range(args.ttt_length))
    assert rel(model, measured) < 0.10, (model, measured)
    eager = sum(plan_saved._attention_saved(args, j, kind="eager", fused=True) for j in range(args.ttt_length))
    assert rel(eager, measured) > 0.10  # negative control: the one-rank eager path differs


def test_sequence_parallel_rank_layout(monkeypatch):
    """A rank's buffer (C own rows + k tail, teacher positions in the tail): the rows,
    table and the non-attention saved tensors follow C and T (eager attention on the
    rank's own rows stands in for the ring, which needs several processes)."""
    args = small(trim="loss", sp=2, seq_len=600)
    rank = args.sp - 1
    C, T = args.own_rows, args.buffer_len
    rows = plan_rows(args, rank)
    rm = build_rowmap(synthetic_mask(args, rank), args.ttt_length, num_rows=C)
    assert rows.loss_rows == tuple(float(r.numel()) for r in rm.rows)
    assert rows.teacher_positions == rm.teacher_positions.numel()
    assert (C, T) == (300, 304)


# ---- FLOPs ------------------------------------------------------------------------

def count_flops(args: PlanArgs) -> dict[str, int]:
    features, rm, params, d2t, t2d = batch(args)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=args.trim,
                       attention="eager", loss_impl="torch")
    with FlopCounterMode(display=False) as counter:
        unrolled.ttt(params, features, rm, config, d2t=d2t, t2d=t2d).objective.backward()
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


@pytest.mark.parametrize("trim,pattern", [("none", "tail"), ("loss", "scattered"),
                                          ("backbone", "tail"), ("backbone", "scattered")])
def test_flops_match_flop_counter(trim, pattern):
    """Forward + backward FLOPs (eager attention, fp32, CPU) == FlopCounterMode within
    10%: the GEMMs (fc, layer, head incl. the fused head's recomputation, teacher) and
    the attention matmuls separately."""
    args = small(trim=trim, pattern=pattern)
    counted = count_flops(args)
    flops = estimate(args).flops
    gemm = sum(n for op, n in counted.items() if op != "bmm")
    assert rel(flops.backbone_gemm + flops.head + flops.teacher, gemm) < 0.10
    assert rel(flops.attention, counted["bmm"]) < 0.10
    assert rel(flops.total, sum(counted.values())) < 0.10


def test_flops_negative_control():
    """The trim="none" FLOP model against a counted trim="backbone" run must NOT match."""
    counted = count_flops(small(trim="backbone"))
    gemm = sum(n for op, n in counted.items() if op != "bmm")
    f = estimate(small(trim="none")).flops
    assert rel(f.backbone_gemm + f.head + f.teacher, gemm) > 0.10


def real_mask_blocks(args: PlanArgs) -> tuple[list[int], list[int]]:
    """Per step, the partial + full blocks of the ``packed_block_mask`` the real ``ttt``
    builds (forward, FlexAttention's CPU reference) for the plan's synthetic batch, and
    those of the mask it would build with every query's window one key block too long
    (a code change the comparison must catch; built from the same call's arguments,
    which come from the row map alone, so one run gives both)."""
    real_mask = unrolled_flex.packed_block_mask
    counts, wrong = [], []

    def blocks(mask):
        return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())

    def spy(start, last, num_queries, key_len, mask_mod, tables=None):
        mask = real_mask(start, last, num_queries, key_len, mask_mod, tables)
        counts.append(blocks(mask))
        # the tables planned on the host are those of the real windows
        wrong.append(blocks(real_mask(start, last + blocks_module.FLEX_BLOCK, num_queries, key_len, mask_mod)))
        return mask

    features, rm, params, d2t, t2d = batch(args)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=args.trim,
                       attention="flex", loss_impl="torch")
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        mp.setattr(unrolled_flex, "packed_block_mask", spy)
        mp.setattr(flex_module, "_validate_device", lambda *a, **kw: None)
        unrolled.ttt(params, features, rm, config, d2t=d2t, t2d=t2d)
    return counts, wrong


@pytest.mark.parametrize("trim,pattern,B", [
    ("none", "tail", 1), ("none", "scattered", 2), ("backbone", "tail", 1), ("backbone", "tail", 2),
    ("backbone", "scattered", 1), ("backbone", "scattered", 2)])
def test_flex_blocks_match_packed_block_mask(trim, pattern, B):
    """FlexAttention's computed blocks per step == those of the ``packed_block_mask``
    the real ``ttt`` builds for the packed queries of each step (every row, or the
    computed rows of trim="backbone"), B*C = 1000 or 2000 (not a multiple of 128).
    Negative control: the same check against windows one key block too long fails."""
    args = dataclasses.replace(small(seq_len=1000, density=0.2, trim=trim, pattern=pattern,
                                     batch=B), attention="flex")
    planned = [int(x) for x in plan_rows(args).attention_blocks]
    real, wrong = real_mask_blocks(args)
    assert planned == real
    assert len(set(planned)) == 1 or trim == "backbone"  # the same every step untrimmed
    assert planned != wrong


def test_closed_form_blocks_equal_packed_block_mask():
    """The planner's closed-form block count (used beyond ``ROWMAP_MAX_POSITIONS``) ==
    the real ``packed_block_mask``'s on random sorted row sets: several samples, rows
    straddling sample and block boundaries, samples shorter than C (padding)."""
    g = torch.Generator().manual_seed(1)
    caught = 0
    for trial in range(40):
        B, C = 1 + trial % 3, int(torch.randint(1, 700, (1,), generator=g))
        real = C - int(torch.randint(0, C, (1,), generator=g)) * (trial % 2)
        density = float(torch.rand(1, generator=g))
        rows = (torch.rand(B * C, generator=g) < density).nonzero().flatten()
        real_blocks = plan_rows_module._mask_blocks(rows, B, C, real)
        assert plan_rows_module._packed_blocks(rows, C, real) == real_blocks, trial
        # negative control: one sample of length B*C (sample starts ignored) is caught
        caught += plan_rows_module._packed_blocks(rows, B * C, B * C) != real_blocks
    assert caught > 10


def test_bench_flops_per_token():
    """BENCH.md: per token per TTT step the draft layer + head is 748.7 MFLOP forward,
    the target head 1.05 GFLOP per token."""
    args = PlanArgs(trim="none", seq_len=8192)
    f = estimate(args).flops
    tokens = 8192 * args.ttt_length
    fc = 2 * 3 * args.ht * args.hidden * 8192 * 2
    assert abs((f.backbone_gemm - fc + f.head) / 3 / tokens / 1e6 - 748.7) < 0.1
    assert abs(f.teacher / 8192 / 1e9 - 1.05) < 0.01


# ---- rows and the auto choice ----------------------------------------------------------

@pytest.mark.parametrize("S,density,sp,B", [(1000, 0.3, 1, 1), (1000, 0.05, 1, 2),
                                            (999, 0.3, 3, 2), (1000, 1.0, 4, 1), (50, 0.9, 7, 1)])
def test_tail_counts_equal_rowmap(S, density, sp, B, monkeypatch):
    """Closed-form tail counts == a real row map on every rank (exact)."""
    args = PlanArgs(**{**SMALL, "seq_len": S, "density": density}, sp=sp, batch=B, trim="backbone")
    for rank in range(sp):
        from_rowmap = plan_rows(args, rank)
        monkeypatch.setattr(plan_rows_module, "ROWMAP_MAX_POSITIONS", 0)
        from_counts = plan_rows(args, rank)
        monkeypatch.undo()
        assert from_rowmap == dataclasses.replace(from_counts, exact=True), rank


def test_scattered_expected_counts_close_to_rowmap(monkeypatch):
    """Scattered: expected counts within 3% of a sampled row map's; a wrong union
    formula (rows_j alone instead of the union of later steps) is caught."""
    args = PlanArgs(**{**SMALL, "seq_len": 40000, "density": 0.3}, pattern="scattered", trim="backbone")
    sampled = plan_rows(args)
    monkeypatch.setattr(plan_rows_module, "ROWMAP_MAX_POSITIONS", 0)
    expected = plan_rows(args)
    for field_ in ("loss_rows", "layer_rows", "attention_blocks"):
        for a, b in zip(getattr(expected, field_), getattr(sampled, field_)):
            assert rel(a, b) < 0.03, field_
    assert rel(expected.teacher_positions, sampled.teacher_positions) < 0.03
    assert rel(expected.loss_rows[1], sampled.layer_rows[1]) > 0.3  # n_j is not the union


@pytest.mark.parametrize("S,density,pattern", [(400, 0.3, "tail"), (400, 0.95, "tail"),
                                               (400, 0.1, "scattered"), (400, 0.5, "scattered"),
                                               (400, 0.0, "tail")])
@pytest.mark.parametrize("min_rows", [0, 400, 401])
def test_auto_matches_choose_trim(S, density, pattern, min_rows, monkeypatch):
    """trim="auto" resolves as ``choose_trim`` on the row map, and the closed-form
    path (no row map) agrees, on both sides of ``auto_min_rows``."""
    args = PlanArgs(**{**SMALL, "seq_len": S, "density": density}, pattern=pattern, trim="auto",
                    auto_min_rows=min_rows)
    rm = build_rowmap(synthetic_mask(args), args.ttt_length)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim="auto",
                       auto_min_rows=min_rows)
    assert plan_rows(args).trim == choose_trim(rm, config)
    if pattern == "tail":
        monkeypatch.setattr(plan_rows_module, "ROWMAP_MAX_POSITIONS", 0)
        assert plan_rows(args).trim == choose_trim(rm, config)


@pytest.mark.parametrize("closed_form", [False, True])
def test_auto_weighs_supervised_rows(closed_form, monkeypatch):
    """Scattered 60% computes ~0.9 of the layer rows but supervises 0.6: with the
    default ``auto_loss_share`` the plan takes backbone (as measured: 0.93x none at
    8192 and 32768), on the computed rows alone (share 0) none, row map or closed form."""
    if closed_form:
        monkeypatch.setattr(plan_rows_module, "ROWMAP_MAX_POSITIONS", 0)
    default = PlanArgs().auto_loss_share
    took = {}
    for share in (0.0, default):
        args = PlanArgs(**{**SMALL, "seq_len": 2000, "density": 0.6, "ttt_length": 7},
                        pattern="scattered", trim="auto", auto_min_rows=0, auto_loss_share=share)
        took[share] = plan_rows(args).trim
    assert took == {0.0: "none", default: "backbone"}
    for bad in (2.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="auto_loss_share"):
            PlanArgs(auto_loss_share=bad)


def test_parameter_counts_equal_init_params():
    args = small(target_hidden=40)
    params = init_params(draft_config(args))
    total, trainable = plan_memory._param_counts(args)
    assert total == sum(p.numel() for p in params.values())
    assert trainable == sum(p.numel() for p in params.values() if p.requires_grad)


# ---- the GPU figures ------------------------------------------------------------------

BENCH_PEAKS = [  # (S, trim, GiB): 8B shapes, 30% tail, bf16, no optimizer
    # The H200's max_memory_allocated with benchmarks/step.py's protocol for the packed
    # FlexAttention path with fused elementwise chains, first mode in its process
    # (docs/bench/step-131072-fp32-table.json). The 8192 runs of this code
    # (docs/bench/step-8192-final.json, 20.37 / 10.09 GiB for none / backbone) came
    # after SpecForge in the same process and sit a constant ~1.75 GiB (SpecForge's
    # copy of the weights) above the planner's 18.60 / 8.35, so they are not used
    # here; measure each first in its process to add it. (The code these tests used to
    # be validated against, with k-segment keys and eager fp32 norms, peaked at 23.57 /
    # 17.69 / 10.83 GiB at 8192, 32.22 for loss at 16384, 85.87 / 61.66 / 33.16 at 32768.)
    (131072, "backbone", 80.80)]
TOLERANCE = 0.02


@pytest.fixture
def measured_code(monkeypatch):
    """The code BENCH_PEAKS was measured on differs from the current code in two ways
    whose memory is known exactly: packed queries at the full key length
    (``QUERY_BUCKETS = 1``; the current code rounds the query rows up to one of 8
    buckets) and the fp32 teacher table (``probs`` and ``probs_on_draft`` ``[U, Vd]``
    fp32 + token + gate, ``U*(8*Vd + 9)`` bytes, held to the end of the step; the current
    table is compact). Returns ``peak(args, fused)`` of that code, in GiB."""
    def peak(args, fused=True):
        m = estimate_as(args, fused, query_buckets=1).memory
        U = m.teacher_table / (args.draft_vocab * args.dtype_bytes + 17)  # compact: Vd*b + 17
        return (m.peak - m.teacher_table + U * (8 * args.draft_vocab + 9)) / GiB, m
    return peak


@pytest.mark.parametrize("S,trim,gib", BENCH_PEAKS)
def test_bench_peaks(S, trim, gib, measured_code):
    """The peak at BENCH.md's shapes (the CUDA path: fused elementwise chains) within
    2% of the H200 measurement (docs/tutorials/plan.md's validation section)."""
    peak, _ = measured_code(PlanArgs(trim=trim, seq_len=S))
    assert abs(peak - gib) / gib < TOLERANCE, peak


def test_bench_peak_negative_control(measured_code):
    """Without the live-beside-saved terms (saved tensors + resident only), with the
    elementwise chains modelled eagerly, or with the compact table taken for the
    measured code's fp32 one, the measured peak is missed by more than the tolerance."""
    S, trim, gib = BENCH_PEAKS[0]
    peak, m = measured_code(PlanArgs(trim=trim, seq_len=S))
    floor = peak - (m.peak - m.parameters - m.inputs - m.teacher_table - m.saved_total) / GiB
    assert abs(floor - gib) / gib > TOLERANCE, floor
    eager, _ = measured_code(PlanArgs(trim=trim, seq_len=S), fused=False)
    assert abs(eager - gib) / gib > TOLERANCE, eager
    assert abs(m.peak / GiB - gib) / gib > TOLERANCE, m.peak / GiB


CURRENT_PEAKS = [  # (S, trim, optimizer, GiB): 8B shapes, 30% tail, the current code
    # H200, benchmarks/step.py, each in a process where SpecForge had not run (the
    # first mode, or after another eagle3fn mode): docs/bench/
    # step-8192-diagnose-merge.json (8192, none after backbone), step-32768-tail-30-100.json
    # (32768, loss after backbone), step-262144-optimizer.json
    # (--optimizer: fp32 masters, bf16 copies, AdamW state; 133.26 GiB of 139); session 8:
    # step-131072-compact-table.json (first mode), step-32768-profile.json (none after backbone).
    (8192, "backbone", False, 7.34), (8192, "none", False, 17.60),
    (32768, "backbone", False, 18.55), (32768, "loss", False, 46.24),
    (32768, "none", False, 61.96), (131072, "backbone", False, 64.89),
    (262144, "backbone", True, 133.26)]


DENSITY_PEAKS = [  # (S, density, pattern, trim, GiB): 8B shapes, session 7's clean
    # processes (no SpecForge before them): docs/bench/step-short-1024-2048.json,
    # step-8192-none-density100.json, step-8192-calibrate-tail.json, step-calibrate-scattered.json;
    # session 8: step-8192-auto-share.json, step-32768-auto-share.json (after none).
    (1024, 0.1, "tail", "none", 5.20), (1024, 0.1, "tail", "backbone", 3.91),
    (1024, 1.0, "tail", "backbone", 4.92), (2048, 0.45, "scattered", "none", 6.86),
    (2048, 0.45, "scattered", "backbone", 5.77), (2048, 0.6, "scattered", "backbone", 5.96),
    (8192, 1.0, "tail", "none", 17.60), (8192, 0.8, "tail", "backbone", 12.62),
    (8192, 0.9, "tail", "backbone", 13.68), (8192, 0.45, "scattered", "backbone", 12.46),
    (8192, 0.6, "scattered", "backbone", 13.40), (8192, 0.7, "scattered", "backbone", 13.81),
    (32768, 0.7, "scattered", "backbone", 44.94)]


@pytest.mark.parametrize("S,density,pattern,trim,gib", DENSITY_PEAKS)
def test_peaks_across_densities_and_patterns(S, density, pattern, trim, gib):
    """The plan within 5% of H200 peaks from 1024 to 32768 tokens, 10-100% density, tail
    and scattered (issue 9 asks 10%). Negative control: at 8192 the backbone peaks
    planned at the default density (30% tail) instead of the measured one miss by more
    than 5% (the density and pattern must reach the plan; at 1024 and 2048 the peak
    hardly depends on them)."""
    m = estimate_as(PlanArgs(trim=trim, seq_len=S, density=density, pattern=pattern), True).memory
    assert abs(m.peak / GiB - gib) / gib < 0.05, m.peak / GiB
    if trim == "backbone" and S >= 8192:
        wrong = estimate_as(PlanArgs(trim=trim, seq_len=S), True).memory
        assert abs(wrong.peak / GiB - gib) / gib > 0.05, wrong.peak / GiB


@pytest.mark.parametrize("S,trim,optimizer,gib", CURRENT_PEAKS)
def test_current_peaks(S, trim, optimizer, gib):
    """The plan of the current code within 2% of its H200 peaks (no adjustment), and
    the saved-tensors-plus-resident floor misses them (negative control)."""
    m = estimate_as(PlanArgs(trim=trim, seq_len=S, optimizer=optimizer), True).memory
    assert abs(m.peak / GiB - gib) / gib < TOLERANCE, m.peak / GiB
    floor = (m.parameters + m.inputs + m.teacher_table + m.saved_total + m.optimizer_state) / GiB
    assert abs(floor - gib) / gib > TOLERANCE, floor


def test_optimizer_state_and_sharding():
    base = estimate(PlanArgs()).memory
    opt = estimate(PlanArgs(optimizer=True)).memory
    sharded = estimate(PlanArgs(optimizer=True, world=8)).memory
    _, trainable = plan_memory._param_counts(PlanArgs())
    assert base.optimizer_state == 0
    assert opt.optimizer_state == trainable * 12 and opt.gradients == trainable * 4
    assert sharded.optimizer_state == trainable * 12 // 8
    assert base.peak < sharded.peak < opt.peak
    assert opt.parameters - base.parameters == PlanArgs().vocab * PlanArgs().hidden * 4
    assert ALLOCATOR_OVERHEAD_BYTES == 64 * 2**20


# ---- interface ------------------------------------------------------------------------

def test_flags_are_frozen():
    """The CLI flag set (``eagle3fn plan --help``) changes only on purpose."""
    assert [f.name for f in dataclasses.fields(PlanArgs)] == [
        "seq_len", "density", "pattern", "hidden", "intermediate", "heads", "kv_heads", "head_dim",
        "target_hidden", "vocab", "draft_vocab", "ttt_length", "batch", "sp", "trim",
        "auto_backbone_fraction", "auto_loss_share", "auto_min_rows", "dtype_bytes", "optimizer", "world",
        "gpu_memory_gib", "head_chunk_rows", "teacher_chunk_size", "attention", "loss_impl"]
    assert PlanArgs().teacher_chunk_size == DEFAULT_CHUNK_SIZE
    for name in ("auto_backbone_fraction", "auto_loss_share", "auto_min_rows"):
        assert getattr(PlanArgs(), name) == TTTConfig.__dataclass_fields__[name].default


@pytest.mark.parametrize("kwargs,match", [
    (dict(density=1.5), "density must be a fraction"), (dict(pattern="middle"), "pattern"),
    (dict(trim="all"), "trim must be"), (dict(heads=32, kv_heads=5), "multiple of kv_heads"),
    (dict(draft_vocab=10**6), "exceeds vocab"), (dict(dtype_bytes=3), "dtype_bytes"),
    (dict(sp=10**5), "sp=100000 exceeds"), (dict(seq_len=0), "seq_len must be >= 1"),
])
def test_bad_args_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PlanArgs(**kwargs)


def test_format_and_print(capsys):
    text = format_plan(estimate(PlanArgs(trim="loss")))
    assert "fits in 139 GiB: yes" in text and "TFLOPs per step" in text and "peak" in text
    huge = estimate(PlanArgs(trim="none", seq_len=262144))
    assert not huge.fits and "fits in 139 GiB: no (short by" in format_plan(huge)
    plan(PlanArgs(seq_len=2048))
    assert "S=2048" in capsys.readouterr().out


def test_plan_module_imports_no_distributed():
    files = sorted(pathlib.Path(plan_module.__file__).parent.glob("*.py"))
    assert len(files) > 1  # every file of the package, not only its __init__
    for file in files:
        tree = ast.parse(file.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not [n for n in names if "distributed" in n or "parallel" in n], file
        assert file.read_text().isascii(), file


def test_sequence_parallel_plan_says_what_it_models():
    """A sequence-parallel plan of the GPU path says that its attention is the eager
    ring's upper bound (the flex ring path is not modelled); one-rank and eager plans
    do not carry the note."""
    for attention, sp, noted in (("auto", 2, True), ("flex", 2, True), ("eager", 2, False), ("auto", 1, False)):
        text = format_plan(estimate(small(sp=sp, seq_len=600, attention=attention)))
        assert (plan_module.SP_FLEX_NOTE in text) == noted, (attention, sp)
