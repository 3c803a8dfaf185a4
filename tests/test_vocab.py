"""SPEC section 2 vocab map: brute force, ties, padding, validation, SpecForge parity."""

import sys
import types
from collections import Counter

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3fn.vocab import build_vocab_map, count_tokens, validate_vocab_map


def brute_vocab_map(counts, Vd):
    ranked = sorted(range(len(counts)), key=lambda v: (-counts[v], v))
    used = sorted(ranked[:Vd])
    return [u - i for i, u in enumerate(used)], [v in used for v in range(len(counts))]


@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.data())
def test_matches_brute_force(counts, data):
    Vd = data.draw(st.integers(1, len(counts)))
    d2t, t2d = build_vocab_map(torch.tensor(counts), Vd)
    want_d2t, want_t2d = brute_vocab_map(counts, Vd)
    assert d2t.tolist() == want_d2t and t2d.tolist() == want_t2d
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    validate_vocab_map(d2t, t2d, vocab_size=len(counts), draft_vocab_size=Vd)


def test_ties_break_to_lower_id_and_padding_uses_lowest_ids():
    d2t, t2d = build_vocab_map(torch.tensor([0, 3, 0, 5, 3, 3]), 3)
    assert t2d.nonzero().flatten().tolist() == [1, 3, 4]
    # Only ids 7 and 9 occur; the lowest unused ids fill the draft vocab.
    counts = torch.zeros(12, dtype=torch.long)
    counts[[7, 9]] = 4
    d2t, t2d = build_vocab_map(counts, 5)
    assert t2d.nonzero().flatten().tolist() == [0, 1, 2, 7, 9]
    assert d2t.tolist() == [0, 0, 0, 4, 5]


def test_count_tokens_counts_only_masked_positions():
    ids = torch.tensor([[1, 2, 2, 3], [3, 3, 0, 1]])
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    assert count_tokens(ids, mask, 5).tolist() == [0, 0, 2, 2, 0]
    with pytest.raises(ValueError, match="token id 7 is outside the target vocab"):
        count_tokens(torch.tensor([7]), torch.tensor([1]), 5)


@pytest.mark.parametrize(
    "d2t,t2d,kwargs,match",
    [
        ([0, 1], [True, False, True, False], dict(vocab_size=5), "target vocab is 5"),
        ([0, 1], [True, False, True, False], dict(draft_vocab_size=3), "draft_vocab_size is 3"),
        ([0, 1, 1], [True, False, True, False], {}, "selects 2 target ids"),
        ([0, 2], [True, False, True, False], {}, "disagree at draft id 1"),
    ],
)
def test_inconsistent_maps_are_clear_errors(d2t, t2d, kwargs, match):
    with pytest.raises(ValueError, match=match):
        validate_vocab_map(torch.tensor(d2t), torch.tensor(t2d), **kwargs)


def test_wrong_dtypes_are_clear_errors():
    with pytest.raises(ValueError, match="t2d must be bool"):
        validate_vocab_map(torch.tensor([0]), torch.tensor([1, 0]))
    with pytest.raises(ValueError, match="d2t must be int64"):
        validate_vocab_map(torch.tensor([0.0]), torch.tensor([True]))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_map(torch.tensor([1, 2]), 3)


def _specforge_mappings():
    pytest.importorskip("specforge")
    # specforge.data imports `datasets` at module level only for type use; the
    # vocab-map function does not need it.
    sys.modules.setdefault("datasets", types.SimpleNamespace(Dataset=object))
    from specforge.data.preprocessing import process_token_dict_to_mappings

    return process_token_dict_to_mappings


def test_specforge_parity_on_untied_counts():
    mappings = _specforge_mappings()
    g = torch.Generator().manual_seed(1)
    V, Vd = 300, 64
    counts = torch.randperm(V, generator=g) + 1  # distinct counts: no ties to break
    d2t, t2d = build_vocab_map(counts, Vd)
    sf_d2t, sf_t2d = mappings(Counter(dict(enumerate(counts.tolist()))), Vd, V)
    assert torch.equal(d2t, sf_d2t.long()) and torch.equal(t2d, sf_t2d.bool())
    # Negative control: swapping the counts of the last kept and first dropped ids
    # changes our map, and the same comparison notices.
    ranked = torch.argsort(counts, descending=True)
    swapped = counts.clone()
    swapped[ranked[Vd - 1]], swapped[ranked[Vd]] = counts[ranked[Vd]], counts[ranked[Vd - 1]]
    d2t_bad, t2d_bad = build_vocab_map(swapped, Vd)
    assert not (torch.equal(d2t_bad, sf_d2t.long()) and torch.equal(t2d_bad, sf_t2d.bool()))
