"""SPEC section 1: supervised positions and shifted arrays, against brute force."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from eagle3fn.align import sequence_lengths, shift_left, supervised_mask
from eagle3fn.reference import reference_supervised_mask


@st.composite
def batches(draw):
    B = draw(st.integers(1, 4))
    S = draw(st.integers(1, 16))
    lengths = draw(st.lists(st.integers(0, S), min_size=B, max_size=B))
    bits = draw(st.lists(st.booleans(), min_size=B * S, max_size=B * S))
    attention = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
    loss = torch.tensor(bits).view(B, S) & attention
    return loss, attention, lengths


@given(batches(), st.sampled_from(["eagle", "target"]))
def test_supervised_mask_matches_brute_force(batch, alignment):
    loss, attention, lengths = batch
    got = supervised_mask(loss, attention, alignment=alignment)
    assert torch.equal(got, reference_supervised_mask(loss, lengths, alignment))


def test_last_position_never_supervised_and_alignments_differ():
    loss = torch.ones(1, 6, dtype=torch.bool)
    loss[0, :2] = False
    eagle = supervised_mask(loss)
    target = supervised_mask(loss, alignment="target")
    assert eagle.tolist() == [[False, False, True, True, True, False]]
    # gated by m_{t+2}: t=0 predicts x_2 (supervised), t=4 would predict x_6 (none).
    assert target.tolist() == [[True, True, True, True, False, False]]


def test_shift_left():
    x = torch.arange(10).view(2, 5)
    assert shift_left(x, 1).tolist() == [[1, 2, 3, 4, 0], [6, 7, 8, 9, 0]]
    assert shift_left(x, 7).abs().sum() == 0
    assert torch.equal(shift_left(x, 0), x)
    with pytest.raises(ValueError, match="n >= 0"):
        shift_left(x, -1)


def test_left_padding_is_a_clear_error():
    attention = torch.tensor([[0, 1, 1], [1, 1, 0]])
    with pytest.raises(ValueError, match=r"rows \[0\].*right"):
        sequence_lengths(attention)
    with pytest.raises(ValueError, match="alignment"):
        supervised_mask(torch.ones(1, 3), alignment="next")
    with pytest.raises(ValueError, match="shape"):
        supervised_mask(torch.ones(1, 3), torch.ones(1, 4))
