"""Row maps built on the host from the batch's host masks and sent to the device in one
copy (``train.sources.batch_rowmap``, ``unrolled.rowmap_to_device``): the same training
as a row map built on the device, for every trim, and planning a step reads no device
tensor (the features on the meta device, where any read raises), so the training
thread never waits for the GPU to learn a batch's rows. Also the teacher's vocab-chunk
bounds, read once per vocab map (``teacher._chunk_bounds``)."""

import dataclasses

import pytest
import torch
from test_packing import K, TOKEN, batches, run  # noqa: F401 - batches is a fixture
from test_ttt import CFG, assert_same

import eagle3fn.unrolled.layout as layout_module
from eagle3fn.align import supervised_mask
from eagle3fn.rowmap import build_rowmap
from eagle3fn.teacher import _chunk_bounds
from eagle3fn.train.sources import HostMasks, batch_rowmap
from eagle3fn.unrolled import TTTConfig, ttt


def host_run(features, masks, params, d2t, t2d, trim, rowmap=None):
    """``(objective, grads)`` of one batch whose row map comes from ``masks``."""
    rm = batch_rowmap(features, masks, K) if rowmap is None else rowmap
    ps = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in params.items()}
    out = ttt(ps, features, rm, TTTConfig(draft=CFG, ttt_length=K, trim=trim, loss=TOKEN), d2t=d2t, t2d=t2d)
    out.objective.backward()
    return out, {n: p.grad for n, p in ps.items() if p.requires_grad}


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("trim", ["none", "loss", "backbone"])
def test_host_rowmap_trains_like_the_device_one(batches, trim, packed, monkeypatch):  # noqa: F811
    """The row map from host masks, sent as the GPU path sends it (forced on the CPU),
    trains bitwise like the one built from the features' own masks; its twin holds the
    host rows and lengths. Control: a twin from other host masks (what the plan reads)
    changes the result."""
    monkeypatch.setattr(layout_module, "_sends_plan", lambda device: True)
    f, m, params, d2t, t2d = batches[packed]
    masks = HostMasks(m.clone(), f.attention_mask.clone(),
                      None if f.positions is None else f.positions.clone())
    want, want_grads = run(f, m, params, d2t, t2d, trim)[:2]
    rm = batch_rowmap(f, masks, K)
    assert rm.host is not None and rm.host.rowmap.host is None
    assert torch.equal(rm.host.lengths, f.attention_mask[:, :rm.num_rows].sum(1))
    device_rm = build_rowmap(supervised_mask(m, f.attention_mask, positions=f.positions), K, positions=f.positions)
    for a, b in zip((*rm.rows, *rm.table_rows, rm.teacher_positions, rm.step0_rows),
                    (*device_rm.rows, *device_rm.table_rows, device_rm.teacher_positions, device_rm.step0_rows)):
        assert torch.equal(a, b)
    got, got_grads = host_run(f, masks, params, d2t, t2d, trim, rm)
    assert_same((got, got_grads), (want, want_grads), 0.0, 0.0)

    if trim == "backbone":  # control: the plan follows the twin's rows
        other = m.clone()
        other[:, ::2] = False
        twin = batch_rowmap(f, masks._replace(loss_mask=other), K).host
        try:  # other rows to gather: a wrong result, or rows that no longer line up
            wrong = host_run(f, masks, params, d2t, t2d, trim, dataclasses.replace(rm, host=twin))[0]
            caught = not torch.allclose(wrong.kl_loss, want.kl_loss, rtol=1e-6)
        except RuntimeError:
            caught = True
        assert caught


def test_twin_checks_packed_teachers(batches):  # noqa: F811
    """The teacher check runs on the host twin: a mask supervising a packed document's
    last token is refused from host masks too."""
    _, (pf, pm, params, d2t, t2d) = batches
    last = torch.zeros_like(pm)
    last[0, 8] = True  # the end of the first conversation (length 9)
    masks = HostMasks(last, pf.attention_mask, None)  # its positions dropped: that teacher is kept
    rm = batch_rowmap(pf, masks, K)
    rm = dataclasses.replace(rm, host=dataclasses.replace(rm.host, positions=pf.positions))
    with pytest.raises(ValueError, match="last of its packed document"):
        ttt(params, pf, rm, TTTConfig(draft=CFG, ttt_length=K), d2t=d2t, t2d=t2d)


def on_meta(features):
    """The features on the meta device: shapes only, any read of a value raises."""
    move = lambda x: None if x is None else x.to("meta")  # noqa: E731
    return dataclasses.replace(features, input_ids=move(features.input_ids), aux=move(features.aux),
                               attention_mask=move(features.attention_mask),
                               target_logits=move(features.target_logits), positions=move(features.positions))


@pytest.mark.parametrize("trim", ["none", "loss", "backbone"])
def test_planning_a_step_reads_no_device_tensor(batches, trim):  # noqa: F811
    """Row map and step plan (flex layouts, backbone rows) for features on the meta
    device from host masks: nothing is read from the device. Control: the same from a
    device-side loss mask (the row map built there) does read it, and fails."""
    f, m, *_ = batches[1]
    meta = on_meta(f)
    rm = batch_rowmap(meta, HostMasks(m, f.attention_mask, f.positions), K)
    assert rm.teacher_positions.device.type == "meta" and rm.host.rowmap.teacher_positions.device.type == "cpu"
    plan = layout_module.plan_steps(rm, trim, meta, flex=True)
    assert all(layout is not None for layout in plan.layouts[:1])
    with pytest.raises((NotImplementedError, RuntimeError)):
        batch_rowmap(meta, m.to("meta"), K)
    no_twin = dataclasses.replace(rm, host=None)  # flex layouts need the lengths: read on the device
    with pytest.raises((NotImplementedError, RuntimeError)):
            layout_module.plan_steps(no_twin, trim, meta, flex=True)


def test_chunk_bounds_are_read_once_per_vocab_map():
    """The second read for the same ``t2d`` uses the memo (a meta ``cum``, unreadable,
    is not touched); a new map, or the same one changed in place, is read again
    (control: the meta ``cum`` then raises)."""
    t2d = torch.zeros(50, dtype=torch.bool)
    t2d[::3] = True
    cum = torch.cumsum(t2d, 0)
    want = [0] + cum[torch.arange(15, 50 + 15, 16).clamp_max(49)].tolist()
    assert _chunk_bounds(t2d, cum, 16) == want
    assert _chunk_bounds(t2d, cum.to("meta"), 16) == want  # memo: no read
    with pytest.raises((NotImplementedError, RuntimeError)):
        _chunk_bounds(t2d.clone(), cum.to("meta"), 16)  # another map
    with pytest.raises((NotImplementedError, RuntimeError)):
        _chunk_bounds(t2d, cum.to("meta"), 8)  # another chunk size
    t2d[1] = True
    with pytest.raises((NotImplementedError, RuntimeError)):
        _chunk_bounds(t2d, cum.to("meta"), 16)  # changed in place
