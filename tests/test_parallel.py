"""Data and sequence parallelism on CPU (gloo, spawned ranks) equal one rank (SPEC 5-8).

Each layout runs every case of ``parallel_cases.CASES`` in one launch; rank 0 saves the
reduced per-step losses and metrics, the gradients after ``full_tensor()`` and the
parameters after one AdamW step, compared here with the one-rank full-length path on
the whole batch padded to ``sp*C`` (fp64, 1e-10; computed once per family, loss, dp
and sp: the cases and layouts share them). The negative controls (tail rows emitted
twice, denominator = local length) must fail the same comparison. A hang becomes a
failure: collectives time out after 60 s and the launch after 240 s.
"""

import functools

import pytest
import ranks
import torch
from parallel_cases import CASES, LAYOUTS, rank_main, reference

from eagle3fn.parallel import ParallelConfig, pad_for_sp, ring_pass, shard_sequence

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny fp64 references
FIELDS = ("objective", "step_loss", "kl_loss", "acc", "accept", "tau")
TOL = 1e-10


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def worst_error(got, want):
    errs = {f: rel(got[f], want[f]) for f in FIELDS}
    errs.update({f"grad {n}": rel(got["grads"][n], want["grads"][n]) for n in want["grads"]})
    errs.update({f"step {n}": rel(got["stepped"][n], want["stepped"][n]) for n in want["stepped"]})
    assert got["grads"].keys() == want["grads"].keys()
    return max(errs.items(), key=lambda kv: kv[1])


@functools.cache
def one_rank(family: str, loss, dp: int, sp: int) -> dict:
    """``reference``: the same for every trim (the one-rank path runs trim "none"), the
    controls and every layout of the same dp and sp."""
    return reference(family, "none", loss, dp, sp)


def launch(layout_name, tmp_path, timeout_s=240):
    world = LAYOUTS[layout_name][0]
    ranks.launch(rank_main, (world, str(tmp_path / "pg"), str(tmp_path), layout_name), world, layout_name,
                 timeout_s)
    return torch.load(tmp_path / f"{layout_name}.pt", weights_only=False)


@pytest.mark.parametrize("layout_name", list(LAYOUTS))
def test_layout_equals_one_rank(layout_name, tmp_path):
    world, dp, ring, ulysses = LAYOUTS[layout_name]
    got = launch(layout_name, tmp_path)
    sp = ring * ulysses
    for name, family, _, loss, control in CASES:
        want = one_rank(family, loss, dp, sp)
        field, err = worst_error(got[name], want)
        if control is None:
            assert err <= TOL, f"{layout_name} {name}: {field} differs by {err:.3g}"
        else:
            assert err > 1e-3, f"{layout_name} {name}: the negative control was not caught ({err:.3g})"


def test_shard_sequence_layout():
    """Own chunk + k tail, zero past the end, global positions; bad ranks are errors."""
    from eagle3fn.shapes import Features

    B, L, k, sp = 2, 10, 3, 3
    ids = torch.arange(B * L).view(B, L) + 1
    f = Features(input_ids=ids, aux=ids[..., None].double(), attention_mask=torch.ones(B, L))
    sup = ids % 2 == 0
    C = 4
    for r in range(sp):
        local, s, c = shard_sequence(f, sup, sp, r, k)
        assert c == C and local.input_ids.shape == (B, C + k)
        want = torch.cat([ids, torch.zeros(B, sp * C + k - L, dtype=ids.dtype)], 1)[:, r * C:r * C + C + k]
        assert torch.equal(local.input_ids, want)
        assert torch.equal(local.positions, torch.arange(r * C, r * C + C + k).expand(B, -1))
        assert torch.equal(s, (want % 2 == 0) & (want > 0))  # nothing supervised past L
    with pytest.raises(ValueError, match="sp_rank"):
        shard_sequence(f, sup, sp, sp, k)
    assert pad_for_sp(ids, 4).shape == (B, 12) and pad_for_sp(ids, 5).shape == (B, 10)


def test_config_errors():
    with pytest.raises(ValueError, match="must be >= 1"):
        ParallelConfig(ring=0)
    assert ParallelConfig(ring=2, ulysses=2).sp == 4
    assert callable(ring_pass)


def test_one_process_mesh_path_equals_plain_path():
    """The single-process path with the mesh code active (what one GPU runs under
    torchrun --nproc-per-node 1) gives the plain path's numbers bitwise."""
    import torch.distributed as dist
    from parallel_cases import CFG, K, global_batch

    from eagle3fn.parallel import build_layout, collectives, full, gather, init_distributed, reduce_grads, shard
    from eagle3fn.rowmap import build_rowmap
    from eagle3fn.unrolled import TTTConfig, ttt

    features, supervised, params, d2t, t2d = global_batch("random30", 2, 1)
    rowmap = build_rowmap(supervised, K)
    config = TTTConfig(draft=CFG, ttt_length=K, trim="loss", attention="eager")
    plain = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    want = ttt(plain, features, rowmap, config, d2t=d2t, t2d=t2d)
    want.objective.backward()
    init_distributed(torch.device("cpu"))
    try:
        layout = build_layout(ParallelConfig(), torch.device("cpu"))
        sharded = shard({n: p.detach().clone().requires_grad_(p.requires_grad)
                         for n, p in params.items()}, layout)
        whole = gather(sharded)
        got = ttt(whole, features, rowmap, config, d2t=d2t, t2d=t2d,
                  collectives=collectives(layout, rowmap.denominator, torch.device("cpu"), compile_elementwise=True))
        got.objective.backward()
        reduce_grads(sharded, whole)
        assert torch.equal(got.objective, want.objective) and torch.equal(got.acc, want.acc)
        grads = full({n: p.grad for n, p in sharded.items() if p.requires_grad})
        assert all(torch.equal(grads[n], plain[n].grad) for n in grads)
        with pytest.raises(ValueError, match="not divisible"):
            build_layout(ParallelConfig(ring=2), torch.device("cpu"))
    finally:
        dist.destroy_process_group()
