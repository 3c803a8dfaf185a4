"""build_rowmap against a brute-force loop over (b, s, j) and SPEC's golden tables."""

import pytest
import torch
from recorders import OpRecorder
from hypothesis import given
from hypothesis import strategies as st

from eagle3fn.rowmap import build_rowmap


def brute_rowmap(mask, k, C):
    """SPEC section 6 literally, one (b, s, j) at a time."""
    B, T = mask.shape
    m = mask.tolist()
    rows = [[] for _ in range(k)]
    teachers = [[] for _ in range(k)]
    for b in range(B):
        for s in range(T):
            for j in range(k):
                if m[b][s] and j <= s and s - j < C:
                    rows[j].append(b * C + s - j)
                    teachers[j].append(b * T + s)
    U = sorted({t for ts in teachers for t in ts})
    order = [sorted(range(len(r)), key=r.__getitem__) for r in rows]
    rows_sorted = [[r[i] for i in o] for r, o in zip(rows, order)]
    table_rows = [[U.index(ts[i]) for i in o] for ts, o in zip(teachers, order)]
    backbone = [list(range(B * C))] + [
        sorted({r for jj in range(j, k) for r in rows[jj]}) for j in range(1, k)
    ]
    return rows_sorted, U, table_rows, backbone


def as_lists(rm):
    return (
        [r.tolist() for r in rm.rows],
        rm.teacher_positions.tolist(),
        [r.tolist() for r in rm.table_rows],
        [r.tolist() for r in rm.backbone_rows],
    )


@st.composite
def cases(draw):
    B = draw(st.integers(1, 4))
    T = draw(st.integers(1, 24))
    C = draw(st.integers(0, T))
    k = draw(st.integers(1, 9))
    kind = draw(st.sampled_from(["empty", "full", "tail", "scattered"]))
    if kind == "empty":
        mask = torch.zeros(B, T, dtype=torch.bool)
    elif kind == "full":
        mask = torch.ones(B, T, dtype=torch.bool)
    elif kind == "tail":
        starts = draw(st.lists(st.integers(0, T), min_size=B, max_size=B))
        mask = torch.arange(T)[None, :] >= torch.tensor(starts)[:, None]
    else:
        bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
        mask = torch.tensor(bits).view(B, T)
    return mask, k, C


@given(cases())
def test_matches_brute_force(case):
    mask, k, C = case
    rm = build_rowmap(mask, k, num_rows=C)
    rows, U, table_rows, backbone = brute_rowmap(mask, k, C)
    assert as_lists(rm) == (rows, U, table_rows, backbone)
    assert rm.denominator == mask.shape[0] * C
    assert rm.dead_steps == tuple(len(r) == 0 for r in rows)
    assert all(r.dtype == torch.int64 for r in rm.rows + rm.table_rows + rm.backbone_rows)
    assert rm.teacher_positions.dtype == torch.int64
    assert rm.step0_rows.tolist() == sorted({r for step in rows for r in step})
    assert rm.step0_rows.dtype == torch.int64


def test_brute_force_catches_unshifted_rows():
    """Negative control: rows that do not move down per step disagree with the oracle."""
    mask = torch.tensor([[False, True, True, False, True, False]])
    rows, *_ = brute_rowmap(mask, 3, 6)
    rm = build_rowmap(mask, 3)
    unshifted = [rm.rows[0].tolist()] * 3
    assert [r.tolist() for r in rm.rows] == rows
    assert unshifted != rows


def _mask(B, T, sups):
    m = torch.zeros(B, T, dtype=torch.bool)
    for b, sup in enumerate(sups):
        m[b, sup] = True
    return m


# SPEC section 6, copied literally: (B, T, C, k, sup per sample) -> rows, U, table_rows,
# backbone_rows[1:].
GOLDEN = [
    ((1, 9, 6, 2, [[4, 5, 6]]),
     ([[4, 5], [3, 4, 5]], [4, 5, 6], [[0, 1], [0, 1, 2]], [[3, 4, 5]])),
    ((1, 10, 10, 3, [[0, 3, 4, 8]]),
     ([[0, 3, 4, 8], [2, 3, 7], [1, 2, 6]], [0, 3, 4, 8], [[0, 1, 2, 3], [1, 2, 3], [1, 2, 3]],
      [[1, 2, 3, 6, 7], [1, 2, 6]])),
    ((2, 6, 6, 2, [[1, 5], [0, 2, 3]]),
     ([[1, 5, 6, 8, 9], [0, 4, 7, 8]], [1, 5, 6, 8, 9], [[0, 1, 2, 3, 4], [0, 1, 3, 4]],
      [[0, 4, 7, 8]])),
    ((1, 7, 4, 3, [[5, 6]]),
     ([[], [], [3]], [5], [[], [], [0]], [[3], [3]])),
]


@pytest.mark.parametrize("args,want", GOLDEN)
def test_golden_tables(args, want):
    B, T, C, k, sups = args
    rm = build_rowmap(_mask(B, T, sups), k, num_rows=C)
    rows, U, table_rows, backbone = as_lists(rm)
    assert (rows, U, table_rows, backbone[1:]) == want
    assert backbone[0] == list(range(B * C))


def test_tail_only_supervision_has_dead_steps():
    rm = build_rowmap(_mask(1, 7, [[5, 6]]), 3, num_rows=4)
    assert rm.dead_steps == (True, True, False)


@pytest.mark.parametrize("B,T", [(1, 1), (3, 17)])
def test_empty_and_full_masks(B, T):
    k = 4
    empty = build_rowmap(torch.zeros(B, T, dtype=torch.bool), k)
    assert all(r.numel() == 0 for r in empty.rows) and empty.teacher_positions.numel() == 0
    assert empty.dead_steps == (True,) * k
    full = build_rowmap(torch.ones(B, T, dtype=torch.bool), k)
    for j, r in enumerate(full.rows):
        want = [b * T + p for b in range(B) for p in range(T - j)]
        assert r.tolist() == want
    assert full.teacher_positions.tolist() == list(range(B * T))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(mask=torch.ones(2, 5, dtype=torch.bool), ttt_length=2, num_rows=6), "num_rows"),
        (dict(mask=torch.ones(2, 5, dtype=torch.bool), ttt_length=2, num_rows=-1), "num_rows"),
        (dict(mask=torch.ones(2, 5, dtype=torch.bool), ttt_length=0), "ttt_length"),
        (dict(mask=torch.ones(2, 5, dtype=torch.bool), ttt_length=1.5), "ttt_length"),
        (dict(mask=torch.ones(2, 5), ttt_length=2), "bool"),
        (dict(mask=torch.ones(2, 5, dtype=torch.long), ttt_length=2), "bool"),
        (dict(mask=torch.ones(5, dtype=torch.bool), ttt_length=2), "2-D"),
        (dict(mask=torch.ones(1, 2, 5, dtype=torch.bool), ttt_length=2), "2-D"),
        (dict(mask=[[True]], ttt_length=2), "bool"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_rowmap(**kwargs)




def test_vectorised_op_count_does_not_grow_with_length():
    """No Python loop over positions: the same number of tensor ops at T=50 and T=5000."""
    counts = []
    for T in (50, 5000):
        mask = torch.rand(2, T) < 0.3
        with OpRecorder() as ops:
            build_rowmap(mask, 7)
        counts.append(ops.n)
    assert counts[0] == counts[1]
