"""Issue rows on the capture: several loss terms, stale losses, graphs captured twice, a second
Lens, two backwards, parameters frozen later, empty micro-batches. Oracle: a float64 per-sample
loop on a copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

B = 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 4, (B,)), torch.randn(B, 4, dtype=torch.float64)


def _oracle(model, share):
    x, y, t = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for n in range(B):
        g = torch.autograd.grad(share(model(x), y, t, n), params)
        rows.append(torch.cat([v.reshape(-1) for v in g]))
    return torch.stack(rows)


@pytest.mark.parametrize("order", ["ce_first", "mse_first"])
def test_two_loss_terms_are_one_objective_in_either_order(order):
    """mean CE + 0.01 * MSE(sum): g_n = B * grad of sample n's share, whatever the order."""
    model = _model()
    G = _oracle(
        copy.deepcopy(model),
        lambda out, y, t, n: B * (F.cross_entropy(out, y, reduction="none")[n] / B
                                  + 0.01 * F.mse_loss(out, t, reduction="none")[n].sum()),
    )
    m = gradlens.extend(model)
    ce, mse = gradlens.extend(nn.CrossEntropyLoss()), gradlens.extend(nn.MSELoss(reduction="sum"))
    lens = Lens(m, [BatchL2(), GradNorm()])
    x, y, t = _data()
    out = m(x)
    if order == "ce_first":
        a = ce(out, y)
        b = mse(out, t)
    else:
        b = mse(out, t)
        a = ce(out, y)
    with lens.capture():
        (a + 0.01 * b).backward()
    rec = lens.flush()
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(rec["grad_norm"], dtype=torch.float64), G.mean(0).norm())
    assert rec["loss"] == pytest.approx(float(a + 0.01 * b), rel=1e-12)


def test_a_validation_loss_before_the_capture_does_not_count():
    model = _model()
    m = gradlens.extend(model)
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    validation = ce(m(x * 3), y)  # grad enabled, never backpropagated
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    rec = lens.flush()
    assert rec["loss"] == pytest.approx(float(loss), rel=1e-12)
    assert rec["loss"] != pytest.approx(float(validation), rel=1e-6)


def test_a_graph_captured_twice_is_an_error():
    m = gradlens.extend(_model())
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already measured.*would count twice"):
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()


def test_two_backwards_in_one_capture_is_an_error():
    m = gradlens.extend(_model())
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    l1, l2 = ce(m(x), y), ce(m(x[:3]), y[:3])
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="second backward.*own capture"):
        with lens.capture():
            l1.backward()
            l2.backward()


def test_a_second_open_lens_on_the_model_is_refused():
    m = gradlens.extend(_model())
    first = Lens(m, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"already watched by an open Lens.*lens.close\(\)"):
        Lens(m, [GradNorm()])
    first.close()
    Lens(m, [GradNorm()]).close()  # the fix, as the message says


def test_parameters_frozen_and_unfrozen_later_are_followed():
    model = _model()
    ref = copy.deepcopy(model)
    m = gradlens.extend(model)
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [SumGradSquared(), BatchL2()])
    x, y, _ = _data()
    for p in list(m[0].parameters()) + list(ref[0].parameters()):
        p.requires_grad_(False)
    G = _oracle(ref, lambda out, y, t, n: F.cross_entropy(out[n : n + 1], y[n : n + 1]))
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    for p in m[0].parameters():  # unfrozen: tracked from the next window on
        p.requires_grad_(True)
    rec = lens.flush()
    assert sorted(rec["sum_grad_squared"]) == ["2.bias", "2.weight"]
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    assert sorted(lens.flush()["sum_grad_squared"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_an_empty_micro_batch_adds_nothing():
    m = gradlens.extend(_model())
    ce = gradlens.extend(nn.CrossEntropyLoss(reduction="sum"))
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    for xb, yb in ((x, y), (x[:0], y[:0])):
        loss = ce(m(xb), yb)
        with lens.capture():
            loss.backward()
    rec = lens.flush()
    assert rec.num_samples == B and rec.micro_steps == 1 and rec["loss"] == pytest.approx(float(ce(m(x), y)))
    assert rec.meta["empty_micro_steps"] == 1
