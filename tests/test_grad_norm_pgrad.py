"""GradNorm(source="p.grad") (issue 35, memory): the window gradient's norm read from p.grad
as the captured backwards leave it, with no window sum of its own, equals the float64 oracle
when every micro-step has the same per-sample scale and nothing else touched p.grad; a window
where that does not hold gets None and a meta note naming why, never a number."""

import math

import pytest
import torch
from torch import nn

import gradlens
from gradlens import GradientAccumulateOptimizer, Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

from oracle import MODELS, flat, make_problem, per_sample_grads
from windows import micro_batches, run_windows


def _oracle_norm(model, x, y, reduction: str) -> float:
    G = flat(per_sample_grads(model, x, y))
    g = G.mean(0) if reduction == "mean" else G.sum(0)
    return float(g.norm())


@pytest.mark.parametrize("name", ["mlp", "cnn", "seq"])
@pytest.mark.parametrize("reduction,sizes", [("mean", [4, 4, 4]), ("sum", [5, 1, 6]), ("mean", [12])])
def test_pgrad_source_equals_oracle_without_a_window_sum(name, reduction, sizes):
    model, x, y = make_problem(MODELS[name])
    want = _oracle_norm(model, x, y, reduction)
    pools = []
    run = run_windows(model, [micro_batches(x, y, sizes)] * 2,
                      [BatchL2(), SumGradSquared(), GradNorm(source="p.grad")],
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), reduction=reduction,
                      on_micro=lambda run, w, k, loss: pools.append(
                          (dict(run.lens._window.stats.grad_sum), dict(run.lens._pools.get("grad_sum", {})))),
                      keep_records=True)
    for rec in run.records:
        assert "grad_norm" not in rec.meta, rec.meta
        assert abs(rec["grad_norm"] - want) <= 1e-9 * want
    # the path taken: no window sum sum_n g_n, in the window or in the reused buffers
    assert "grad_sum" not in run.lens._meter.plan.needs  # no capture path adds one
    assert pools and all(not sums and not pool for sums, pool in pools)


def test_pgrad_source_per_group_adds_up():
    model, x, y = make_problem(MODELS["mlp"])
    gs = per_sample_grads(model, x, y)
    run = run_windows(model, [micro_batches(x, y, [6, 6])], [GradNorm(source="p.grad")],
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), groups="module")
    rec = run.record
    for group, values in rec.groups.items():
        names = [q for q in gs if q.rpartition(".")[0] == group]
        want = float(torch.cat([gs[q].mean(0).reshape(-1) for q in names]).norm())
        assert abs(values["grad_norm"] - want) <= 1e-9 * want
    total = math.sqrt(sum(v["grad_norm"] ** 2 for v in rec.groups.values()))
    assert abs(total - rec["grad_norm"]) <= 1e-9 * total


def test_pgrad_source_zeroed_grads_at_start_are_fine_and_a_scaled_loss_is_divided_out():
    model, x, y = make_problem(MODELS["mlp"])
    want = _oracle_norm(model, x, y, "mean")
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    lens = Lens(m, [GradNorm(source="p.grad")], optimizer=opt)
    for _ in range(2):
        for xb, yb in micro_batches(x, y, [6, 6]):
            loss = loss_fn(m(xb), yb)
            with lens.capture():
                (loss / 2).backward()  # c = 1/2, the same in every micro-step
        opt.step()
        opt.zero_grad(set_to_none=False)  # zeros, not None, at the next window's start
    for rec in lens.records:
        assert "grad_norm" not in rec.meta
        assert abs(rec["grad_norm"] - want) <= 1e-9 * want


def _loop(touch=None, sizes=(6, 6), windows=2, instruments=None):
    model, x, y = make_problem(MODELS["mlp"])
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    lens = Lens(m, instruments or [BatchL2(), GradNorm(source="p.grad")], optimizer=opt)
    for w in range(windows):
        for k, (xb, yb) in enumerate(micro_batches(x, y, list(sizes))):
            if touch is not None:
                touch(m, w, k, lambda xb=xb, yb=yb: loss_fn(m(xb), yb))
            loss = loss_fn(m(xb), yb)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
    return lens.records, _oracle_norm(model, x, y, "mean")


def test_pgrad_source_unequal_scales_are_not_measured_then_the_next_window_is():
    records, _ = _loop(sizes=(5, 7))  # a mean loss over 5 then 7 samples: scales 5 and 7
    for rec in records:
        assert rec["grad_norm"] is None
        assert "different per-sample scales" in rec.meta["grad_norm"]
    assert records[0]["batch_l2"].shape == (12,)  # the other instruments are measured


def _touch_second_window(m, w, k, loss):
    if w == 0 and k == 1:
        for p in m.parameters():
            p.grad.mul_(0.5)  # clipping per micro-step, say


def test_pgrad_source_grad_touched_between_backwards_is_named_and_the_next_window_exact():
    records, want = _loop(touch=_touch_second_window)
    assert records[0]["grad_norm"] is None
    assert "p.grad changed between two captured backwards" in records[0].meta["grad_norm"]
    assert abs(records[1]["grad_norm"] - want) <= 1e-9 * want


def test_pgrad_source_backward_outside_capture_between_backwards_is_named():
    def extra_backward(m, w, k, loss):
        if k == 1:  # a weight penalty's own backward, not captured: it adds to p.grad
            (1e-3 * sum(p.square().sum() for p in m.parameters())).backward()
    records, _ = _loop(touch=extra_backward, windows=1)
    assert records[0]["grad_norm"] is None
    assert "p.grad changed" in records[0].meta["grad_norm"]


def test_pgrad_source_grad_left_from_before_the_window_is_named():
    model, x, y = make_problem(MODELS["mlp"])
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    sum(p.square().sum() for p in m.parameters()).backward()  # p.grad holds it at the window's start
    lens = Lens(m, [GradNorm(source="p.grad")], optimizer=opt)
    for xb, yb in micro_batches(x, y, [6, 6]):
        loss = loss_fn(m(xb), yb)
        with lens.capture():
            loss.backward()
    opt.step()
    rec = lens.records[-1]
    assert rec["grad_norm"] is None and "zero_grad" in rec.meta["grad_norm"]


def test_pgrad_source_refusals():
    with pytest.raises(ValueError, match="must be 'sums' or 'p.grad'"):
        GradNorm(source="grad")
    model = gradlens.extend(nn.Linear(3, 2))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="GradientAccumulateOptimizer replaces"):
        Lens(model, [GradNorm(source="p.grad")], optimizer=opt)
    assert repr(GradNorm(source="p.grad")) == "GradNorm(source='p.grad')"
