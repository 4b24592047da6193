"""Light capture: a Lens whose instruments need only the window gradient and the micro-step
gradient norms (GradNorm, NoiseScaleTwoBatch) hooks the parameters only (ParamTap), so it works
on any model, train-mode BatchNorm included. Checked against float64 autograd on a deep copy:
each micro-batch's gradient h_k of its own mean loss, G = sum_k B_k h_k (per-sample units)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.capture import ParamTap
from gradlens.instruments import BatchL2, GradNorm, NoiseScaleTwoBatch
from windows import micro_batches, run_windows

SIZES = [5, 1, 6]


class BNNet(nn.Module):
    """Train-mode BatchNorm mixes the samples: per-sample gradients are undefined before it,
    the micro-batch gradient is not."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))  # used directly, no module
        self.fc = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x, y=None):
        h = torch.relu(self.bn(self.conv(x))) * self.scale.view(1, -1, 1, 1)
        logits = self.fc(h.flatten(1))
        if y is None:
            return logits
        return F.cross_entropy(logits, y)  # a loss computed inside the model (as transformers do)


def _problem():
    torch.manual_seed(0)
    model = BNNet()
    x = torch.randn(sum(SIZES), 1, 8, 8)
    y = torch.randint(0, 3, (sum(SIZES),))
    return model, x, y


def _oracle(model0, x, y):
    """(||G/N||, S = sum_k B_k^2 ||h_k||^2, T = ||G||^2) in float64, BatchNorm in train mode."""
    model = copy.deepcopy(model0).double().train()
    params = [p for p in model.parameters() if p.requires_grad]
    G = [torch.zeros_like(p) for p in params]
    S = 0.0
    for xb, yb in zip(x.double().split(SIZES), y.split(SIZES)):
        h = torch.autograd.grad(F.cross_entropy(model(xb), yb), params)
        b = len(xb)
        S += b * b * sum(float(t.square().sum()) for t in h)
        for acc, t in zip(G, h):
            acc.add_(t, alpha=b)
    T = sum(float(t.square().sum()) for t in G)
    n = sum(SIZES)
    return math.sqrt(T) / n, S, T


def _expected_two_batch(S, T):
    n, q = sum(SIZES), sum(b * b for b in SIZES)
    g2 = (T - S) / (n * n - q)
    return g2, (S - q * g2) / n


@pytest.mark.parametrize("loss_inside", [False, True])
def test_light_mode_is_exact_on_a_train_mode_batchnorm_model(loss_inside):
    model0, x, y = _problem()
    norm, S, T = _oracle(model0, x, y)
    model = gradlens.extend(copy.deepcopy(model0))
    lens = Lens(model, [GradNorm(), NoiseScaleTwoBatch()])
    assert isinstance(lens._tap, ParamTap) and lens.coverage == 1.0
    (rec,) = run_windows(model, [micro_batches(x, y, SIZES)], lens=lens, fresh_copy=False,
                         forward=lambda m, mb: m(mb[0], mb[1]) if loss_inside else m(mb[0]),
                         loss=(lambda loss, y: loss) if loss_inside else "ce",
                         objective=lambda loss, run, w, k: loss / 3).flushed  # a multiplier: the same units
    assert rec.num_samples == 12 and rec.micro_steps == 3
    assert rec["grad_norm"] == pytest.approx(norm, rel=1e-5)
    g2, tr = _expected_two_batch(S, T)
    got = rec["noise_scale_two_batch"]
    assert got["grad_sq"] == pytest.approx(g2, rel=1e-4, abs=1e-9)
    assert got["trace_sigma"] == pytest.approx(tr, rel=1e-4)


def test_per_sample_instruments_still_refuse_the_same_model():
    """The distinction is real: BatchL2 needs per-sample gradients, undefined before the BN."""
    model0, x, y = _problem()
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(model, [BatchL2(), GradNorm()])
    assert not isinstance(lens._tap, ParamTap)
    with pytest.raises(RuntimeError, match="undefined"):
        loss = loss_fn(model(x[:4]), y[:4])
        with lens.capture():
            loss.backward()
    lens.close()


def test_explicit_functional_loss_and_sum_reduction():
    """capture(reduction=..., loss=...) with a functional loss outside the model."""
    model0, x, y = _problem()
    (rec,) = run_windows(model0, [micro_batches(x, y, SIZES)], [GradNorm()],
                         loss=lambda out, y: F.cross_entropy(out, y, reduction="sum"), capture={"reduction": "sum"},
                         pass_loss=True, objective=lambda loss, run, w, k: 0.5 * loss).flushed
    ref = copy.deepcopy(model0).double()
    params = list(ref.parameters())
    G = [torch.zeros_like(p) for p in params]
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        h = torch.autograd.grad(F.cross_entropy(ref(xb.double()), yb, reduction="sum"), params)
        for acc, t in zip(G, h):
            acc.add_(t)
    want = math.sqrt(sum(float(t.square().sum()) for t in G))  # sum objective: ||sum_n g_n||
    assert rec["grad_norm"] == pytest.approx(want, rel=1e-5)


def test_light_mode_errors():
    model0, x, y = _problem()
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(model, [NoiseScaleTwoBatch()])
    with pytest.raises(RuntimeError, match="outside lens.capture"):
        loss_fn(model(x[:4]), y[:4]).backward()
    lens.flush()
    a = loss_fn(model(x[:4]), y[:4])
    b = loss_fn(model(x[4:8]), y[4:8])
    with pytest.raises(RuntimeError, match="second backward"):
        with lens.capture():
            a.backward()
            b.backward()
    lens.close()


def test_light_mode_under_torch_compile():
    """A compiled model: the light Lens hooks no layer output (no graph break, no warning) and
    its window gradient norm is the plain autograd one."""
    import warnings

    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 3)))
    compiled = torch.compile(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    x, y = torch.randn(8, 10), torch.randint(0, 3, (8,))
    lens = Lens(compiled, [GradNorm()])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        (rec,) = run_windows(compiled, [micro_batches(x, y, [4, 4])], lens=lens, loss=loss_fn, fresh_copy=False).flushed
    model.zero_grad()
    for k in range(2):  # sum_n g_n of each micro-batch = 4 x the gradient of its mean loss
        (4 * F.cross_entropy(model(x[4 * k : 4 * k + 4]), y[4 * k : 4 * k + 4])).backward()
    want = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters())) / 8
    assert rec["grad_norm"] == pytest.approx(want, rel=1e-6)
