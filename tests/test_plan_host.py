"""The host's planning of a batch's k steps in one batched pass (``layout.plan_steps``:
``_host_layouts`` -> ``attention.packed_layouts``, ``_insides``) against the per-step
construction it replaced: ``attention.packed_layout`` once per step and a binary search
(``torch.searchsorted``) per step for ``within`` / ``at``. Bitwise: every tensor of every
layout and of ``within`` / ``at``, dtype, shape and strides included, for trims
none / loss / backbone, packed and unpacked batches, row maps built on the host (the
twin) and on the device, and shapes with dead steps, a step confined to one document,
B = 1, lengths off the 128 grid, ``query_buckets`` 1 and 4. Negative controls: a step's
rows shifted by one, per-step windows or offsets not restarted at each step, and
``within`` / ``at`` read from the wrong step are each caught by the same comparison."""

import pytest
import torch

import eagle3fn.unrolled.blocks as blocks_module
import eagle3fn.unrolled.layout as layout_module
from eagle3fn.align import document_starts
from eagle3fn.shapes import Features
from eagle3fn.train.sources import HostMasks, batch_rowmap
from eagle3fn.unrolled import computed_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def make_batch(docs: list[list[int]], T: int, supervise, packed: bool = True, seed: int = 0):
    """A batch of ``len(docs)`` rows of T positions: row b holds documents of lengths
    ``docs[b]`` then right padding; ``supervise(position_in_doc, doc_length, rng)`` -> bool
    is the loss mask. Returns ``(Features, HostMasks)`` (positions None unpacked: then a
    row must hold one document)."""
    g = torch.Generator().manual_seed(seed)
    B = len(docs)
    pos = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.bool)
    att = torch.zeros(B, T, dtype=torch.long)
    for b, lengths in enumerate(docs):
        assert sum(lengths) <= T and (packed or len(lengths) <= 1)
        t = 0
        for L in lengths:
            pos[b, t:] = torch.arange(T - t)  # padding continues the last document
            loss[b, t:t + L] = torch.tensor([bool(supervise(p, L, g)) for p in range(L)], dtype=torch.bool)
            t += L
        att[b, :t] = 1
    positions = pos if packed else None
    f = Features(input_ids=torch.zeros(B, T, dtype=torch.long), aux=torch.zeros(B, T, 1), attention_mask=att,
                 positions=positions)
    return f, HostMasks(loss, att, positions)


def tail(share):
    return lambda p, L, g: p >= int(L * (1 - share))


def scattered(share):
    return lambda p, L, g: float(torch.rand((), generator=g)) < share


def realistic_docs(B, T, seed):
    """Rows packed with documents of 200-1400 tokens (the last cut to fit)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        row, t = [], 0
        while t < T - 50:
            L = min(int(torch.randint(200, 1400, (), generator=g)), T - t)
            row.append(L)
            t += L
        rows.append(row)
    return rows


CASES = {
    # name: (docs per row, T, supervision, packed, k, query_buckets)
    "realistic": (realistic_docs(4, 2048, 0), 2048, tail(0.35), True, 7, 4),
    "realistic-q1": (realistic_docs(2, 1024, 1), 1024, scattered(0.3), True, 7, 1),
    "b1-off-grid": ([[300, 450, 200]], 1000, scattered(0.3), True, 5, 1),
    "dead-steps": ([[3] * 60, [3] * 40 + [2] * 10], 260, scattered(0.9), True, 4, 4),
    "one-doc-deep": ([[3, 3, 250], [3, 3, 3]], 384, scattered(0.6), True, 7, 4),
    "unsupervised": ([[100, 200], [50]], 300, lambda p, L, g: False, True, 3, 4),
    "unpacked": ([[300], [217], [5]], 300, scattered(0.4), False, 3, 4),
    "unpacked-b1": ([[777]], 777, tail(0.5), False, 7, 1),
}


def oracle(rowmap, trim: str, features: Features, flex: bool, query_buckets: int):
    """The plan as each step built it alone: ``packed_layout`` of the step's computed
    rows (every row for none / loss, one layout shared), and the position of step j's
    computed rows in step j-1's and of rows_j in step j's by binary search (clamped,
    as ``rows_inside`` documents)."""
    twin = rowmap if rowmap.host is None else rowmap.host.rowmap
    B, C = rowmap.batch_size, rowmap.num_rows
    lengths = features.attention_mask[:, :C].sum(1)
    starts = document_starts(features.positions[:, :C]) if features.positions is not None else None
    Lp = blocks_module.padded_key_len(B * C)
    lay = lambda rows: blocks_module.packed_layout(rows, lengths, C, Lp, query_buckets, starts)  # noqa: E731
    inside = lambda a, b: torch.searchsorted(a, b).clamp_max(max(a.numel() - 1, 0))  # noqa: E731
    if trim != "backbone":
        every = lay(torch.arange(B * C)) if flex else None
        return None, [every] * rowmap.ttt_length if flex else None, None, list(rowmap.rows)
    comp = computed_rows(twin)
    layouts = [lay(c) if c.numel() else None for c in comp] if flex else None
    within = [None] + [inside(a, b) for a, b in zip(comp, comp[1:])]
    return computed_rows(rowmap), layouts, within, [inside(c, r) for c, r in zip(comp, twin.rows)]


def differences(plan, want) -> list[str]:
    """What differs between a ``StepPlan`` and ``oracle``'s plan (empty: bitwise equal)."""
    computed, layouts, within, at = want
    out = []

    def tensor(name, x, y):
        if x.dtype != y.dtype or x.shape != y.shape or x.stride() != y.stride():
            out.append(f"{name}: {x.dtype} {tuple(x.shape)} {x.stride()} != {y.dtype} {tuple(y.shape)} {y.stride()}")
        elif not torch.equal(x, y):
            out.append(f"{name}: values differ")

    def tensors(name, xs, ys):
        if (xs is None) != (ys is None) or (xs is not None and len(xs) != len(ys)):
            out.append(f"{name}: {xs!r:.60} != {ys!r:.60}")
            return
        for j, (x, y) in enumerate(zip(xs or [], ys or [])):
            if (x is None) != (y is None):
                out.append(f"{name}[{j}]: one is None")
            elif x is not None:
                tensor(f"{name}[{j}]", x, y)

    tensors("computed", plan.computed, computed)
    tensors("within", plan.within, within)
    tensors("at", plan.at, at)
    if (plan.layouts is None) != (layouts is None):
        return out + ["layouts: one is None"]
    for j, (got, ref) in enumerate(zip(plan.layouts or [], layouts or [])):
        if (got is None) != (ref is None):
            out.append(f"layout[{j}]: one is None")
        elif got is not None:
            if got.num_queries != ref.num_queries or len(got.tables) != len(ref.tables):
                out.append(f"layout[{j}]: {got.num_queries} queries, {len(got.tables)} tables != "
                           f"{ref.num_queries}, {len(ref.tables)}")
                continue
            for name, x, y in zip(("start", "last", *(f"table{i}" for i in range(len(ref.tables)))),
                                  (got.start, got.last, *got.tables), (ref.start, ref.last, *ref.tables)):
                tensor(f"layout[{j}].{name}", x, y)
    return out


def _rowmap(name: str, device_built: bool = False):
    docs, T, supervise, packed, k, qb = CASES[name]
    f, masks = make_batch(docs, T, supervise, packed)
    rm = batch_rowmap(f, masks.loss_mask if device_built else masks, k)
    assert (rm.host is None) == device_built
    return f, rm, qb


@pytest.mark.parametrize("trim", ["none", "loss", "backbone"])
@pytest.mark.parametrize("name", list(CASES))
def test_batched_plan_equals_the_per_step_one(name, trim):
    """``plan_steps`` (batched) and its ``per_step`` twin both equal the per-step oracle,
    bitwise, on the host twin's path; for none / loss every step shares one layout. The
    batched plan kept on the host owns its tensors (compiled attention on the CPU guards
    a view's base: tests/test_stable_shapes.py)."""
    f, rm, qb = _rowmap(name)
    want = oracle(rm, trim, f, True, qb)
    for impl in ("batched", "per_step"):
        plan = layout_module.plan_steps(rm, trim, f, True, qb, impl=impl)
        assert differences(plan, want) == [], (impl, differences(plan, want)[:5])
        if trim != "backbone":
            assert all(lay is plan.layouts[0] for lay in plan.layouts)
        if impl == "batched":  # kept on the host: own storages, not views of the pass's buffers
            owned = [t for lay in plan.layouts if lay is not None for t in (lay.start, lay.last, *lay.tables)]
            assert all(t._base is None and t.storage_offset() == 0 for t in owned)
    if name == "dead-steps" and trim == "backbone":  # the shape's point: some steps without rows
        assert any(lay is None for lay in want[1]) and any(lay is not None for lay in want[1])
    if name == "one-doc-deep" and trim == "backbone":  # the deep steps' rows all lie in one document
        doc_start = (torch.arange(f.positions.numel()) // 384) * 384 + document_starts(f.positions).flatten()
        deep = computed_rows(rm)[-1]
        assert deep.numel() and set(doc_start[deep].tolist()) == {6}


@pytest.mark.parametrize("trim", ["loss", "backbone"])
@pytest.mark.parametrize("name", ["realistic-q1", "dead-steps", "unpacked"])
def test_batched_plan_of_a_device_built_rowmap(name, trim):
    """The device path (row map built from the features' own loss mask, no host twin:
    the plan downloads what it needs) plans the same; also without flex layouts."""
    f, rm, qb = _rowmap(name, device_built=True)
    for flex in (True, False):
        plan = layout_module.plan_steps(rm, trim, f, flex, qb)
        assert differences(plan, oracle(rm, trim, f, flex, qb)) == []


def test_batched_plan_survives_its_upload(monkeypatch):
    """Sent as a GPU batch gets it (forced on the CPU): the same tensors as the oracle."""
    f, rm, qb = _rowmap("realistic")
    monkeypatch.setattr(layout_module, "_sends_plan", lambda device: True)
    plan = layout_module.plan_steps(rm, "backbone", f, True, qb)
    assert differences(plan, oracle(rm, "backbone", f, True, qb)) == []


@pytest.mark.parametrize("lengths", [[300, 300, 300], [0, 300, 7]])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("query_buckets", [1, 4])
@pytest.mark.parametrize("q_tables", [True, False], ids=["q-tables", "kv-only"])
def test_packed_layouts_equal_packed_layout(lengths, packed, query_buckets, q_tables, monkeypatch):
    """``attention.packed_layouts`` of lists of many sizes (one row, one block, every
    row, buckets of different widths, a sample without real rows) equals
    ``packed_layout`` of each list, bitwise; also for a torch whose ``BlockMask`` takes
    the query-major tables only."""
    if not q_tables:
        monkeypatch.setattr(blocks_module, "_block_mask_takes_q_tables", lambda: False)
    C, B = 300, len(lengths)
    g = torch.Generator().manual_seed(1)
    lists = [torch.randperm(B * C, generator=g)[:n].sort().values for n in (1, 5, 130, B * C // 3, B * C - 1)]
    lists.append(torch.arange(B * C))
    pos = (torch.arange(C) % 70).repeat(B, 1)
    starts = document_starts(pos) if packed else None
    Lp = blocks_module.padded_key_len(B * C)
    lengths = torch.tensor(lengths)
    for chosen in (lists, lists[-1:], lists[2:4]):
        got = blocks_module.packed_layouts(chosen, lengths, C, Lp, query_buckets, starts)
        for rows, lay in zip(chosen, got):
            want = blocks_module.packed_layout(rows, lengths, C, Lp, query_buckets, starts)
            assert len(want.tables) == (8 if q_tables else 4)
            assert differences(_one(lay), (None, [want], None, [])) == []


def _one(layout):
    return layout_module.StepPlan([layout], None, None, [])


@pytest.fixture
def realistic():
    f, rm, qb = _rowmap("realistic")
    want = oracle(rm, "backbone", f, True, qb)
    assert differences(layout_module.plan_steps(rm, "backbone", f, True, qb), want) == []
    return f, rm, qb, want


def test_a_step_shifted_by_one_row_is_caught(realistic, monkeypatch):
    """Negative control: step 2's rows shifted by one before the batched pass."""
    f, rm, qb, want = realistic
    real = layout_module.packed_layouts

    def shifted(rows, *args):
        rows = list(rows)
        rows[2] = (rows[2] + 1).clamp_max(rm.batch_size * rm.num_rows - 1)
        return real(rows, *args)
    monkeypatch.setattr(layout_module, "packed_layouts", shifted)
    assert differences(layout_module.plan_steps(rm, "backbone", f, True, qb), want)


def test_windows_not_restarted_per_step_are_caught(realistic, monkeypatch):
    """Negative control: every step given step 0's per-step constants (last query,
    active blocks, count bins), as if the windows ran on from step to step."""
    f, rm, qb, want = realistic
    real = blocks_module._per_segment
    monkeypatch.setattr(blocks_module, "_per_segment",
                        lambda values, counts, device: real([[v[0]] * len(v) for v in values], counts, device))
    assert differences(layout_module.plan_steps(rm, "backbone", f, True, qb), want)


def test_a_wrong_step_offset_is_caught(realistic, monkeypatch):
    """Negative control: the last step's offset into the concatenation one too far."""
    f, rm, qb, want = realistic
    real = blocks_module._offsets
    monkeypatch.setattr(blocks_module, "_offsets", lambda sizes: real(sizes)[:-1] + [real(sizes)[-1] + 1])
    assert differences(layout_module.plan_steps(rm, "backbone", f, True, qb), want)


def test_within_from_the_wrong_step_is_caught(realistic, monkeypatch):
    """Negative control: ``within`` / ``at`` all read from step 0's computed rows."""
    f, rm, qb, want = realistic
    real = layout_module._insides
    monkeypatch.setattr(layout_module, "_insides", lambda outer, pairs, size: real(
        outer, [(0, inner) for _, inner in pairs], size))
    found = differences(layout_module.plan_steps(rm, "backbone", f, True, qb), want)
    assert found and all(d.startswith(("within", "at")) for d in found)


def test_plan_impl_is_checked():
    f, rm, qb = _rowmap("b1-off-grid")
    with pytest.raises(ValueError, match="impl must be"):
        layout_module.plan_steps(rm, "loss", f, True, qb, impl="fast")
