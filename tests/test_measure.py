"""The measurement layer (gradlens/measure.py): the Plan compiled from what the instruments
declare, the direction of calls (the Tap reports down to the Meter, never up to the Lens), the
Meter holding the Lens' window only while a micro-step is captured, and the fused Linear's
dL/dW handed back as the Meter's return value, checked against plain float64 autograd with K
unequal micro-steps, mean and sum losses, and a divided loss."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens, capture
from gradlens.capture import ParamTap
from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, SumGradSquared
from gradlens.measure.meter import Meter, Plan
from windows import micro_batches, run_windows

B, T = 7, 5
SPLITS = {"one": (slice(0, B),), "unequal": (slice(0, 2), slice(2, 3), slice(3, B))}


def test_plan_groups_the_instruments_by_what_they_declare():
    l2, sgs, norm = BatchL2(), SumGradSquared(), GradNorm()
    hist, drawn, dot = GradHist1d(), GradHist1d(sample=0.5), BatchDot()
    light = Plan.compile([norm])
    assert light.light and not light.per_sample and not light.fuse_weight_grad
    assert light.needs == frozenset({"grad_sum"})
    factors = Plan.compile([l2, norm])
    assert not factors.light and not factors.fuse_weight_grad and not factors.carry_scale
    # the sum of squares materialises sequence slices: nn.Linear and Conv1D take dL/dW from them
    assert Plan.compile([sgs]).fuse_weight_grad == {capture.LINEAR, capture.CONV1D}
    mixed = Plan.compile([l2, hist, drawn, dot])
    assert mixed.per_sample == (hist, drawn)
    assert mixed.exact == (hist,) and mixed.sampled == (drawn,)
    assert mixed.layer == (dot,) and mixed.micro == (hist, drawn, dot)
    assert mixed.fuse_weight_grad and not mixed.carry_scale and not mixed.light
    only_drawn = Plan.compile([drawn])
    assert not only_drawn.fuse_weight_grad  # sampled entries come from the factors
    alone = Plan.compile([dot])
    assert alone.carry_scale and alone.micro == (dot,)
    # BatchDot's backward Gram fills nn.Linear's dL/dW, not Conv1D's (it costs more than it saves)
    assert Plan.compile([BatchDot(mode="exact")]).fuse_weight_grad <= {capture.LINEAR}
    with pytest.raises(dataclasses.FrozenInstanceError):
        alone.light = True


def _mlp():
    torch.manual_seed(0)
    return gradlens.extend(nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double())


def test_capture_reports_down_to_the_meter_and_the_meter_lets_go_of_the_window():
    model = _mlp()
    lens = Lens(model, [BatchL2(), GradNorm()])
    meter = lens._meter
    tap = lens._tap
    assert tap is meter.tap
    for callback in (tap.on_use, tap.on_op_use, tap.on_weight_grad):
        assert callback.__self__ is meter  # the Meter's own events, not the Lens'
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    torch.manual_seed(1)
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    loss = loss_fn(model(x), y)
    assert meter.micro is None and meter.window is None
    with lens.capture():
        assert meter.micro is not None and meter.window is lens._window
        loss.backward()
    assert meter.micro is None and meter.window is None and not hasattr(meter, "sites")
    assert set(lens._window.sites) == {"0", "2"}  # the measured uses are the window's
    assert lens._window.micro_steps == 1 and lens._window.stats.num_samples == B
    lens.close()

    light = Lens(_mlp(), [GradNorm()])
    assert isinstance(light._tap, ParamTap) and light._tap.on_grad.__self__ is light._meter
    light.close()


class _Seq(nn.Module):
    """``inp``: a sequence Linear used once (fused: its dL/dW comes from the Meter); ``twice``:
    one Linear called twice (shared: the Meter returns None, autograd computes it)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.twice = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # [B, T, 4]
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.head(h.mean(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("divide", [None, 3.0])
def test_fused_weight_grad_is_what_the_meter_returns(split, reduction, divide, monkeypatch):
    torch.manual_seed(0)
    model = _Seq().double()
    ref = copy.deepcopy(model)
    torch.manual_seed(2)
    x, y = torch.randn(B, T, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
    returned: list[tuple[str, torch.Tensor | None]] = []
    real = Meter.on_use

    def spy(self, site, a, g, via, batch, forward, fused=False):
        out = real(self, site, a, g, via, batch, forward, fused=fused)
        if fused:
            returned.append((site.name, out))
        return out

    monkeypatch.setattr(Meter, "on_use", spy)
    run_windows(model, [[(x[sl], y[sl]) for sl in SPLITS[split]]], [SumGradSquared()], fresh_copy=False,
                loss=lambda out, t: F.cross_entropy(out, t, reduction=reduction), capture={"reduction": reduction},
                pass_loss=True, objective=lambda loss, run, w, k: loss if divide is None else loss / divide)
    want_inp = []
    for sl in SPLITS[split]:
        ref_loss = F.cross_entropy(ref(x[sl]), y[sl], reduction=reduction)
        ref_objective = ref_loss if divide is None else ref_loss / divide
        gi, = torch.autograd.grad(ref_objective, [ref.inp.weight])
        want_inp.append(gi)
    by_name: dict[str, list] = {}
    for name, out in returned:
        by_name.setdefault(name, []).append(out)
    assert len(by_name["inp"]) == len(SPLITS[split])  # one fused call per micro-step
    for got, want in zip(by_name["inp"], want_inp):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    # the shared Linear's two calls: not measured per call, so autograd forms their dL/dW
    assert by_name.get("twice", []) and all(out is None for out in by_name["twice"])


class _NormedSeq(nn.Module):
    """Embedding -> LayerNorm -> Linear on [B, T, d] -> mean over T -> Linear: every layer one
    torch call whose autograd node takes the parameters directly."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 5)
        self.norm = nn.LayerNorm(5)
        self.proj = nn.Linear(5, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.norm(self.emb(tokens)))).mean(1))


@pytest.mark.parametrize("route", ["autograd", "stacked"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_grad_sum_of_one_call_layers_comes_from_their_autograd_node_and_excludes_a_regulariser(
        reduction, route, monkeypatch):
    """grad_sum of single-use Embedding, LayerNorm and Linear calls is autograd's dL/dp of that
    call (node hooks; no kernel sum), or, for uses this small, formed with the stacked uses
    (gradlens.measure.deferred; only the Embedding, which does not stack, is hooked); either way a
    regulariser added to the loss stays out of it: the window gradient's norm equals the
    float64 oracle's over K = 3 unequal micro-steps."""
    from oracle import per_sample

    if route == "autograd":  # no use's product counts as small: every routed use is hooked
        monkeypatch.setattr(gradlens.measure.deferred, "SMALL_SUM", -1)

    torch.manual_seed(0)
    model = _NormedSeq().double()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    tokens, y = torch.randint(0, 10, (12, 7)), torch.randint(0, 4, (12,))
    gs = per_sample(model, model.state_dict(),
                    lambda out, yi: nn.functional.cross_entropy(out, yi), tokens, y)
    G = torch.cat([g.flatten(1) for g in gs.values()], 1)
    window = G.mean(0) if reduction == "mean" else G.sum(0)

    tracked = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    lens = Lens(tracked, [BatchL2(), GradNorm()])
    routed = []
    on_wg = lens._meter.on_weight_grad

    def on_weight_grad(site, g, attr="weight"):
        routed.append(site.params[attr])
        on_wg(site, g, attr)

    lens._meter.on_weight_grad = on_weight_grad
    lens._tap.on_weight_grad = lens._meter.on_weight_grad
    (rec,) = run_windows(tracked, [micro_batches(tokens, y, [5, 1, 6])], lens=lens, loss=loss_fn, fresh_copy=False,
                         objective=lambda loss, run, w, k: loss + 0.3 * sum(p.square().sum() for p in tracked.parameters()),
                         close=False).flushed
    if route == "autograd":
        assert sorted(set(routed)) == sorted(q for q, _ in model.named_parameters())
        assert len(routed) == 3 * len(gs)  # every parameter, every micro-step, once
    else:
        assert routed == ["emb.weight"] * 3
    torch.testing.assert_close(torch.as_tensor(rec["grad_norm"], dtype=torch.float64), window.norm(),
                               rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(torch.as_tensor(rec["batch_l2"], dtype=torch.float64), G.square().sum(1),
                               rtol=1e-10, atol=1e-14)
    lens.close()
