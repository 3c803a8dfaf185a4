"""Triton diagonal-key merge (kernels/merge.py) vs its PyTorch twin and an fp64 oracle.

Runs in the Triton interpreter (conftest sets TRITON_INTERPRET=1). ``o`` and ``lse``
are strided views of a ``[1, h, Qp, d]`` tensor, as FlexAttention returns them; every
kernel output comes from a NaN-poisoned allocator.
"""

import math

import pytest
import torch

import eagle3fn.kernels.merge as merge_module
import eagle3fn.unrolled.merges as ttt_module
from eagle3fn.kernels.merge import merge_diagonal, merge_diagonal_naive


@pytest.fixture(autouse=True)
def poisoned_outputs(monkeypatch):
    monkeypatch.setattr(merge_module, "_alloc",
                        lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device))


def make_inputs(N, h, g, d, j, dtype, seed=0):
    """(o, lse, q, k, v, scale); o and lse as transposed views of padded flex outputs,
    lse spread so that neither the step-0 part nor the diagonal dominates."""
    gen = torch.Generator().manual_seed(seed)
    Qp = N + 3
    o = torch.randn(1, h, Qp, d, generator=gen)[0, :, :N].transpose(0, 1)
    lse = (torch.randn(1, h, Qp, generator=gen) * 2 + 1)[0, :, :N].transpose(0, 1)
    q = torch.randn(N, h, d, generator=gen) * 2
    k = torch.randn(j, N, g, d, generator=gen)
    v = torch.randn(j, N, g, d, generator=gen)
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(o), lse.float(), cast(q), cast(k), cast(v), 1 / math.sqrt(d)


def run(fn, inputs, grad_seed=1):
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs[:5]]
    out = fn(*leaves, inputs[5])
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out.dtype)
    out.backward(grad)
    return [out.detach()] + [x.grad for x in leaves]


def rel_err(x, y):
    return ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-30)).item()


SHAPES = [(1, 4, 2, 16, 1), (5, 4, 2, 16, 3), (7, 8, 8, 32, 2), (6, 6, 2, 24, 6), (9, 8, 1, 16, 4)]


@pytest.mark.parametrize("N, h, g, d, j", SHAPES)
def test_fp32_matches_fp64_oracle(N, h, g, d, j):
    """Output and the gradients of o, lse, q, k and v, fp32 kernel vs the twin in fp64
    (fp32 line of SPEC 8)."""
    inputs = make_inputs(N, h, g, d, j, torch.float32)
    oracle = run(merge_diagonal_naive, [x.double() if torch.is_tensor(x) else x for x in inputs])
    got = run(merge_diagonal, inputs)
    for name, x, y in zip(("out", "do", "dlse", "dq", "dk", "dv"), got, oracle):
        assert x.shape == y.shape and x.dtype != torch.float64, name
        assert rel_err(x, y) < 1e-5, (name, rel_err(x, y))


@pytest.mark.parametrize("N, h, g, d, j", SHAPES[1:3])
def test_bf16_three_way(N, h, g, d, j):
    """bf16 inputs: the kernel is no further from fp64 than the PyTorch twin in bf16."""
    inputs = make_inputs(N, h, g, d, j, torch.bfloat16)
    oracle = run(merge_diagonal_naive, [x.double() if torch.is_tensor(x) else x for x in inputs])
    got = run(merge_diagonal, inputs)
    twin = run(merge_diagonal_naive, inputs)
    for name, x, t, y in zip(("out", "do", "dlse", "dq", "dk", "dv"), got, twin, oracle):
        assert x.dtype == t.dtype, name
        assert rel_err(x, y) <= rel_err(t, y) + 1e-2 * 2**-7, (name, rel_err(x, y), rel_err(t, y))


def test_empty_rows():
    out = run(merge_diagonal, make_inputs(0, 4, 2, 16, 2, torch.float32))
    assert all(x.numel() == 0 for x in out)


@pytest.mark.parametrize("wrong", ["keys_of_next_row", "one_step_missing"])
def test_negative_control_is_caught(wrong):
    """The comparison above fails for a merge over the wrong diagonal keys."""
    o, lse, q, k, v, scale = make_inputs(5, 4, 2, 16, 3, torch.float32)
    oracle = run(merge_diagonal_naive, [x.double() if torch.is_tensor(x) else x for x in (o, lse, q, k, v, scale)])
    bad = (k.roll(1, dims=1), v) if wrong == "keys_of_next_row" else (k[:-1], v[:-1])
    got = merge_diagonal(o, lse, q, *bad, scale)
    assert rel_err(got, oracle[0]) > 1e-3


def test_dispatch_and_packed_flex_forward(monkeypatch):
    """packed_flex_attention with the kernel merging the diagonal (what CUDA runs) equals
    eager attention on CPU, and the dispatch picks the kernel only where it should."""
    from eagle3fn.unrolled import eager_attention, packed_flex_attention, packed_keys

    q_cpu = torch.zeros(2, 4, 8)
    assert not ttt_module.use_merge_kernel(q_cpu)
    calls = []
    monkeypatch.setattr(ttt_module, "use_merge_kernel", lambda q: calls.append(1) or True)
    g = torch.Generator().manual_seed(3)
    B, C, h, kv, d, j = 2, 150, 4, 2, 16, 3
    q = torch.randn(B, h, C, d, generator=g)
    keys = [(torch.randn(B, kv, C, d, generator=g), torch.randn(B, kv, C, d, generator=g)) for _ in range(j + 1)]
    lengths = torch.tensor([C, 97])
    valid = torch.arange(C)[None] < lengths[:, None]
    want = eager_attention(q, keys, valid).transpose(1, 2).flatten(0, 1)
    flat = lambda x: x.transpose(1, 2).flatten(0, 1)  # noqa: E731
    rows = torch.tensor([0, 5, 6, 7, 120, 149, 150, 151, 200, 246])
    packed = packed_keys(flat(keys[0][0]), flat(keys[0][1]))
    diagonal = tuple(torch.stack([flat(kv_[i])[rows] for kv_ in keys[1:]]) for i in (0, 1))
    got = packed_flex_attention(flat(q)[rows], rows, packed, diagonal, lengths, C, fused=True)
    assert calls, "the kernel path was not taken"
    assert rel_err(got, want[rows]) < 1e-5


def test_row_without_step0_keys():
    """A query with no step-0 key (FlexAttention: o = 0, lse = -inf) takes its output
    from the diagonal keys alone, with finite gradients, as the twin does."""
    o, lse, q, k, v, scale = make_inputs(4, 4, 2, 16, 2, torch.float32)
    o, lse = o.clone(), lse.clone()
    o[1], lse[1] = 0.0, float("-inf")
    oracle = run(merge_diagonal_naive, [x.double() if torch.is_tensor(x) else x for x in (o, lse, q, k, v, scale)])
    got = run(merge_diagonal, (o, lse, q, k, v, scale))
    for name, x, y in zip(("out", "do", "dlse", "dq", "dk", "dv"), got, oracle):
        assert torch.isfinite(x).all() and rel_err(x, y) < 1e-5, name
