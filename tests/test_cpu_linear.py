"""``decoding.cpu_linear``: linear layers of a few rows as ``W @ X^T`` on a CPU.

Oracles: ``F.linear`` in fp64 (the form), transformers' own greedy decoding (a model whose
layers were switched decodes the same tokens). Controls: a weight off by one element
breaks the form's tolerance; a timer that finds ``F.linear`` faster switches nothing; the
layers switched are seen taking the other form (a counter on ``w_xt``) only for 2..MAX_ROWS
rows without gradients.
"""

import pytest
import torch
import torch.nn.functional as F

from eagle3fn.decoding import cpu_linear
from eagle3fn.decoding.cpu_linear import MAX_ROWS, few_rows, w_xt
from eagle3fn.evaluation import SpecConfig, evaluate, target_generate
from spec_setup import make_draft, make_target

pytestmark = pytest.mark.usefixtures("one_thread")

FASTER = lambda weight, rows: (1.0, 0.5)  # noqa: E731 - W @ X^T twice as fast
SLOWER = lambda weight, rows: (1.0, 0.9)  # noqa: E731 - within MIN_GAIN: not worth it


@pytest.mark.parametrize("shape", [(3, 37), (1, 5, 37), (2, 3, 37)])
def test_w_xt_is_f_linear(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(51, 37, generator=g, dtype=torch.float64)
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    got = w_xt(w, x)
    assert got.shape == (*shape[:-1], 51)
    torch.testing.assert_close(got, F.linear(x, w), rtol=0, atol=1e-12)
    off = w.clone()
    off[7, 3] += 1e-3  # control: one weight off breaks it
    assert not torch.allclose(w_xt(off, x), F.linear(x, w), rtol=0, atol=1e-12)


def _counting(monkeypatch):
    calls = []
    real = cpu_linear.w_xt

    def counted(weight, x):
        calls.append(x.numel() // x.shape[-1])
        return real(weight, x)

    monkeypatch.setattr(cpu_linear, "w_xt", counted)
    return calls


def test_switched_layers_take_the_form_only_for_a_few_rows_without_gradients(monkeypatch):
    calls = _counting(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8, bias=False))
    ref = {r: model(torch.ones(r, 16) * 0.1) for r in (1, 2, MAX_ROWS, MAX_ROWS + 1)}
    with few_rows(model, 4, timer=FASTER) as choice:
        assert choice.form == "w_xt" and choice.rows == (2, 4) and choice.layers == 2
        with torch.no_grad():
            for r, want in ref.items():
                torch.testing.assert_close(model(torch.ones(r, 16) * 0.1), want)
        assert calls == [2, 2, MAX_ROWS, MAX_ROWS]  # one and MAX_ROWS + 1 rows keep F.linear
        calls.clear()
        model(torch.ones(3, 16, requires_grad=True)).sum().backward()  # autograd keeps F.linear
        assert calls == [] and model[0].weight.grad is not None
    assert all("forward" not in vars(m) for m in model)  # their own forward back
    with torch.no_grad():
        model(torch.ones(2, 16))
    assert calls == []
    with few_rows(model, 4, timer=SLOWER) as choice:  # control: not faster enough, nothing switched
        assert choice.form == "linear" and choice.layers == 0
        with torch.no_grad():
            model(torch.ones(2, 16))
    assert calls == []


def test_nothing_is_timed_for_one_row_or_off_the_cpu():
    def never(weight, rows):
        raise AssertionError("timed")

    model = torch.nn.Linear(4, 4)
    with few_rows(model, 1, timer=never) as choice:
        assert choice == cpu_linear.Choice("linear")
    with few_rows(model.to("meta"), 8, timer=never) as choice:
        assert choice == cpu_linear.Choice("linear")


def test_time_forms_times_both_forms_with_the_clock():
    ticks = iter(range(100))
    lin, wx = cpu_linear.time_forms(torch.randn(8, 4), 3, repeats=3, clock=lambda: next(ticks))
    assert lin == 1 and wx == 1  # each timed call spans one tick of the fake clock


def test_evaluate_with_switched_layers_decodes_the_targets_tokens(monkeypatch):
    """Greedy speculative decoding through switched layers (verifies of 2 * (k + 1) rows)
    gives the target alone's tokens, and the report says what was chosen; the control
    timer leaves the form alone."""
    calls = _counting(monkeypatch)
    target = make_target()
    params, cfg, d2t = make_draft(target, dtype=torch.float64)
    prompts = [torch.tensor(p) for p in ([17, 3, 99, 42], [7, 7, 1, 64, 120], [44, 12])]
    spec = SpecConfig(num_draft_tokens=2, max_new_tokens=8)
    alone = target_generate(target, None, prompts, spec)
    monkeypatch.setattr(cpu_linear, "time_forms", FASTER)
    out = evaluate(target, params, cfg, d2t, prompts, spec, batch_size=2, impl="dynamic")
    assert out["cpu_linear"]["form"] == "w_xt" and out["cpu_linear"]["rows"] == [2, 6]
    assert calls and out["same_as_target"] == len(prompts) and out["near_ties"] == 0
    assert all("forward" not in vars(m) for m in target.model.modules())
    assert target_generate(target, None, prompts, spec) == alone
    calls.clear()
    monkeypatch.setattr(cpu_linear, "time_forms", SLOWER)
    out = evaluate(target, params, cfg, d2t, prompts, spec, batch_size=2, impl="dynamic")
    assert out["cpu_linear"]["form"] == "linear" and calls == []
