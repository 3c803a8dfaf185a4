"""The planner (plan.py) against the code it models, on CPU: the saved-activation model
equals what ``ttt`` keeps for backward (``saved_tensors_hooks``, unique storages), its
FLOPs equal ``FlopCounterMode``'s, its FlexAttention blocks equal ``eagle_block_mask``'s,
its row counts equal ``build_rowmap``'s and its auto choice ``choose_trim``'s. Each
comparison has a negative control the same check must catch."""

import ast
import dataclasses
import pathlib

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module
from torch.utils.flop_counter import FlopCounterMode

import eagle3fn.loss as loss_module
import eagle3fn.plan as plan_module
import eagle3fn.ttt as ttt_module
from eagle3fn.draft import DraftConfig, init_params
from eagle3fn.plan import (ALLOCATOR_OVERHEAD_BYTES, GiB, PlanArgs, estimate, format_plan, plan,
                           plan_rows, synthetic_mask)
from eagle3fn.rowmap import build_rowmap
from eagle3fn.shapes import Features
from eagle3fn.ttt import FLEX_BLOCK, TTTConfig, choose_trim, computed_rows, eagle_block_mask
from eagle3fn.vocab import build_vocab_map

# Small shapes with distinct sizes (H != h*d != g*d != I) and C = 300 (not a multiple
# of the flex block); Vd large enough that the unfused head dominates trim="none".
SMALL = dict(seq_len=300, hidden=48, intermediate=80, heads=4, kv_heads=2, head_dim=16,
             vocab=1024, draft_vocab=500, ttt_length=4, target_hidden=40)
DTYPES = {2: torch.bfloat16, 4: torch.float32}


def small(**kwargs) -> PlanArgs:
    return PlanArgs(**{**SMALL, "dtype_bytes": 4, "attention": "eager", **kwargs})


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


def measure_saved(args: PlanArgs, monkeypatch, **config_overrides):
    """Run the real ``ttt`` forward and count the unique storage bytes it keeps for
    backward: ``saved_tensors_hooks`` (the fused head's checkpoint keeps its inputs
    by reference, so those are added too), parameters, features, row map and teacher
    table excluded (the plan counts them elsewhere). FlexAttention's autograd op runs
    its CPU reference forward (torch refuses CPU flex only for the backward).

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
    checkpoint, teacher = loss_module.checkpoint, ttt_module._teacher

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

    monkeypatch.setattr(loss_module, "checkpoint", keeping_inputs)
    monkeypatch.setattr(ttt_module, "_teacher", spy_teacher)
    monkeypatch.setattr(ttt_module, "flex_attention_step", in_attention(ttt_module.flex_attention_step))
    monkeypatch.setattr(ttt_module, "eager_attention", in_attention(ttt_module.eager_attention))
    monkeypatch.setattr(flex_module, "_validate_device", lambda *a, **kw: None)
    attention = "eager" if args.attention == "eager" else "flex"
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=args.trim,
                       attention=attention, loss_impl=args.loss_impl, **config_overrides)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ttt_module.ttt(params, features, rm, config, d2t=d2t, t2d=t2d)
    monkeypatch.undo()
    table_tensors = [x for t in tables for x in (t.probs, t.probs_on_draft, t.gate, t.target_token)]
    known = [*params.values(), features.aux, features.final_hidden, features.target_head,
             features.input_ids, features.attention_mask, d2t, t2d, *rm.rows, *rm.table_rows,
             *rm.backbone_rows, rm.teacher_positions, *table_tensors]
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


@pytest.mark.parametrize("trim,impl,attention,nbytes,B,pattern", CASES,
                         ids=["-".join(map(str, c)) for c in CASES])
def test_saved_activations_match_ttt(trim, impl, attention, nbytes, B, pattern, monkeypatch):
    """The model's saved tensors (backbone + attention + head) == the storages the real
    ``ttt`` keeps for backward, within 10% (it matches to the byte but for a few
    scalars); the attention's share and the teacher table too."""
    args = small(trim=trim, loss_impl=impl, attention=attention, dtype_bytes=nbytes, batch=B,
                 pattern=pattern)
    measured, measured_attention, measured_table = measure_saved(args, monkeypatch)
    memory = estimate(args).memory
    assert rel(memory.saved_total, measured) < 0.10, (memory.saved_total, measured)
    assert rel(sum(memory.attention_saved), measured_attention) < 0.10
    assert rel(memory.teacher_table, measured_table) < 0.01
    assert sum(memory.saved_per_step) + sum(memory.head_saved_per_step) == memory.saved_total


def test_negative_control_none_model_vs_loss_run(monkeypatch):
    """The trim="none" model against a measured trim="loss" run must NOT match."""
    measured, _, _ = measure_saved(small(trim="loss", loss_impl="torch"), monkeypatch)
    assert rel(estimate(small(trim="none")).memory.saved_total, measured) > 0.15
    assert rel(estimate(small(trim="loss")).memory.saved_total, measured) < 0.10


def test_negative_control_code_change_is_caught(monkeypatch):
    """A change in what the code keeps (the trimmed head unfused: logits kept) breaks the
    comparison with the unchanged model."""
    args = small(trim="loss", attention="flex", density=1.0, loss_impl="torch")
    assert rel(estimate(args).memory.saved_total, measure_saved(args, monkeypatch)[0]) < 0.10
    measured, _, _ = measure_saved(args, monkeypatch, fused_head=False)
    assert rel(estimate(args).memory.saved_total, measured) > 0.15


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

    attention = SequenceParallelAttention(layout)

    def attend(*a):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return attention(*a)

    features, rm, params, d2t, t2d = batch(args)
    collectives = ttt_module.Collectives(attend=attend, reduce_terms=list, denominator=rm.denominator)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim=trim, loss_impl="torch")
    ttt_module.ttt(params, features, rm, config, d2t=d2t, t2d=t2d, collectives=collectives)
    exclude = {p.untyped_storage().data_ptr() for p in params.values()}
    measured = sum(n for p, n in bucket.items() if p not in exclude)
    model = sum(plan_module._attention_saved(args, j, kind="ring", hops=0) for j in range(args.ttt_length))
    assert rel(model, measured) < 0.10, (model, measured)
    eager = sum(plan_module._attention_saved(args, j, kind="eager") for j in range(args.ttt_length))
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
        ttt_module.ttt(params, features, rm, config, d2t=d2t, t2d=t2d).objective.backward()
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


@pytest.mark.parametrize("trim,pattern,B", [("none", "tail", 1), ("backbone", "tail", 2),
                                            ("backbone", "scattered", 1)])
def test_flex_blocks_match_block_mask(trim, pattern, B):
    """FlexAttention's computed blocks per step == the block counts of the real
    ``eagle_block_mask`` (with the trimmed path's active query blocks)."""
    args = PlanArgs(**{**SMALL, "seq_len": 1000, "density": 0.2}, trim=trim, pattern=pattern, batch=B)
    rows = plan_rows(args)
    rm = build_rowmap(synthetic_mask(args), args.ttt_length)
    C, k = args.own_rows, args.ttt_length
    Cp = -(-C // FLEX_BLOCK) * FLEX_BLOCK
    lengths = torch.full((B,), C)
    for j in range(k):
        active = None
        if trim == "backbone":
            flags = torch.zeros(B * C, dtype=torch.bool)
            flags[computed_rows(rm)[j]] = True
            flags = torch.nn.functional.pad(flags.view(B, C), (0, Cp - C))
            active = flags.view(B, Cp // FLEX_BLOCK, FLEX_BLOCK).any(-1)
        mask = eagle_block_mask(lengths, Cp, k, j, lambda b, h, q, kv: q >= kv, active)
        blocks = int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())
        assert rows.attention_blocks[j] == blocks, j
    if (trim, pattern) == ("backbone", "tail"):  # negative control: untrimmed is larger
        assert plan_rows(dataclasses.replace(args, trim="loss")).attention_blocks[0] > rows.attention_blocks[0]


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
        monkeypatch.setattr(plan_module, "ROWMAP_MAX_POSITIONS", 0)
        from_counts = plan_rows(args, rank)
        monkeypatch.undo()
        assert from_rowmap == dataclasses.replace(from_counts, exact=True), rank


def test_scattered_expected_counts_close_to_rowmap(monkeypatch):
    """Scattered: expected counts within 3% of a sampled row map's; a wrong union
    formula (rows_j alone instead of the union of later steps) is caught."""
    args = PlanArgs(**{**SMALL, "seq_len": 40000, "density": 0.3}, pattern="scattered", trim="backbone")
    sampled = plan_rows(args)
    monkeypatch.setattr(plan_module, "ROWMAP_MAX_POSITIONS", 0)
    expected = plan_rows(args)
    for field_ in ("loss_rows", "layer_rows", "attention_blocks"):
        for a, b in zip(getattr(expected, field_), getattr(sampled, field_)):
            assert rel(a, b) < 0.03, field_
    assert rel(expected.teacher_positions, sampled.teacher_positions) < 0.03
    assert rel(expected.loss_rows[1], sampled.layer_rows[1]) > 0.3  # n_j is not the union


@pytest.mark.parametrize("S,density,pattern", [(400, 0.3, "tail"), (400, 0.95, "tail"),
                                               (400, 0.1, "scattered"), (400, 0.5, "scattered"),
                                               (400, 0.0, "tail")])
def test_auto_matches_choose_trim(S, density, pattern, monkeypatch):
    """trim="auto" resolves as ``choose_trim`` on the row map, and the closed-form
    path (no row map) agrees."""
    args = PlanArgs(**{**SMALL, "seq_len": S, "density": density}, pattern=pattern, trim="auto")
    rm = build_rowmap(synthetic_mask(args), args.ttt_length)
    config = TTTConfig(draft=draft_config(args), ttt_length=args.ttt_length, trim="auto")
    assert plan_rows(args).trim == choose_trim(rm, config)
    if pattern == "tail":
        monkeypatch.setattr(plan_module, "ROWMAP_MAX_POSITIONS", 0)
        assert plan_rows(args).trim == choose_trim(rm, config)


def test_parameter_counts_equal_init_params():
    args = small(target_hidden=40)
    params = init_params(draft_config(args))
    total, trainable = plan_module._param_counts(args)
    assert total == sum(p.numel() for p in params.values())
    assert trainable == sum(p.numel() for p in params.values() if p.requires_grad)


# ---- the GPU figures ------------------------------------------------------------------

MEASURED = [  # one H200, 8B shapes, 30% tail, benchmarks/step.py's protocol (GiB)
    (8192, "none", 23.57), (8192, "loss", 17.69), (8192, "backbone", 10.83), (16384, "loss", 32.22),
    (32768, "none", 85.87), (32768, "loss", 61.66), (32768, "backbone", 33.16)]


@pytest.mark.parametrize("S,trim,measured_gib", MEASURED)
def test_bench_peaks_match_measured(S, trim, measured_gib):
    """The calibrated peak within 3% of the measured ``max_memory_allocated``
    (docs/benchmarks.md; docs/tutorials/plan.md's validation table)."""
    peak = estimate(PlanArgs(trim=trim, seq_len=S)).memory.peak / GiB
    assert abs(peak - measured_gib) / measured_gib < 0.03, peak


def test_bench_peak_negative_control():
    """Without the live-beside-saved terms (saved tensors + resident only) the 8192
    trim="loss" peak is off by more than the tolerance."""
    m = estimate(PlanArgs(trim="loss")).memory
    floor = (m.parameters + m.inputs + m.teacher_table + m.saved_total) / GiB
    assert abs(floor - 17.69) / 17.69 > 0.03


def test_optimizer_state_and_sharding():
    base = estimate(PlanArgs()).memory
    opt = estimate(PlanArgs(optimizer=True)).memory
    sharded = estimate(PlanArgs(optimizer=True, world=8)).memory
    _, trainable = plan_module._param_counts(PlanArgs())
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
        "auto_backbone_fraction", "dtype_bytes", "optimizer", "world", "gpu_memory_gib",
        "head_chunk_rows", "teacher_chunk_size", "attention", "loss_impl"]
    assert PlanArgs().teacher_chunk_size == ttt_module.DEFAULT_CHUNK_SIZE
    assert PlanArgs().auto_backbone_fraction == TTTConfig.__dataclass_fields__[
        "auto_backbone_fraction"].default


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
    tree = ast.parse(pathlib.Path(plan_module.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if "distributed" in n or "parallel" in n]
    assert pathlib.Path(plan_module.__file__).read_text().isascii()
