"""Units of a loss the model composes inside its forward (issue 42; docs/design.md, "Units"):
a factor the model applies there (``(CE_a + CE_b) / 2``, ``CE / c``) is part of sample n's own
loss; only what multiplies the returned loss afterwards (the loop's 1/K, a GradScaler's scale) is
divided out. A composition with no per-sample split (a power of the loss) or one gradlens cannot
follow to the returned value is refused, never a silently rescaled number.

Oracle: a float64 per-sample loop on a copy of the model made before ``gradlens.extend``, each
sample's loss being the model's own composed loss on that one sample."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, SumGradSquared
from oracle import per_sample_loop
from windows import run_windows

SIZES = [2, 3, 1]
N = sum(SIZES)
K = len(SIZES)


class Composed(nn.Module):
    """Two heads on one body; ``forward(x, y)`` returns the loss composed as ``how`` says,
    with cross-entropies from an extended loss module inside the model and from
    ``F.cross_entropy``."""

    def __init__(self, how: str):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 5)
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)
        self.ce = gradlens.extend(nn.CrossEntropyLoss())
        self.how = how

    def forward(self, x, y):
        h = torch.tanh(self.body(x))
        ce_a = self.ce(self.a(h), y)
        ce_b = F.cross_entropy(self.b(h), y)
        if self.how == "mean-of-two":
            return (ce_a + ce_b) / 2
        if self.how == "divided-by-c":
            return ce_b / 2.5
        if self.how == "weighted":
            return 0.3 * ce_a - 0.1 * ce_b + ce_b
        if self.how == "stacked-mean":
            return torch.stack([ce_a, ce_b]).mean()
        if self.how == "sum-of-two":
            return ce_a + ce_b
        if self.how == "as-output":  # a Hugging Face-like output: (logits, loss)
            return self.a(h), (ce_a + ce_b) / 2
        if self.how == "squared":
            return ce_a ** 2
        if self.how == "times-parameter":
            return ce_a * self.a.bias.sum()
        raise ValueError(self.how)


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (N,), generator=g)


def _loss_of(out):
    return out[1] if isinstance(out, tuple) else out


def _per_sample(model, x, y):
    """name -> ``[N, *param]`` g_n = grad of the model's own composed loss of sample n alone."""
    return per_sample_loop(model, model.state_dict(), lambda m, i: _loss_of(m(x[i:i + 1], y[i:i + 1])), N)


def _oracle(model, x, y):
    """``[N, D]``: :func:`_per_sample` flattened."""
    return torch.cat([g.reshape(N, -1) for g in _per_sample(model, x, y).values()], 1)


def _run(model, x, y, instruments, sizes=SIZES, scale=None):
    """One window of ``sizes`` micro-batches; the loop divides the model's loss by K (and
    multiplies it by a GradScaler's scale where given): factors after the model."""
    w = [[(xb, yb) for xb, yb in zip(x.split(sizes), y.split(sizes))]]
    k = len(sizes)

    def objective(loss, run, wi, i):
        return loss / k if scale is None else scale.scale(loss / k)

    return run_windows(model, w, instruments, loss=lambda out, t: _loss_of(out),
                       forward=lambda m, mb: m(mb[0], mb[1]), objective=objective).record


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                               rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("sizes", [SIZES, [N]], ids=["K3-2-3-1", "K1"])
@pytest.mark.parametrize("how", ["mean-of-two", "divided-by-c", "weighted", "stacked-mean", "sum-of-two", "as-output"])
def test_a_factor_inside_the_forward_is_part_of_the_objective(how, sizes):
    """batch_l2, sum_grad_squared, grad_norm, the Gram and the record's loss == the oracle of the
    model's own composed loss, with the loop's 1/K divided out (before issue 42 ``/ 2`` inside the
    model gave grad_norm 2x and batch_l2 4x)."""
    model = Composed(how).double()
    x, y = _data()
    gs = _per_sample(model, x, y)
    G = torch.cat([g.reshape(N, -1) for g in gs.values()], 1)
    rec = _run(model, x, y, [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()], sizes)
    _close(rec["batch_l2"], G.square().sum(1))
    assert set(rec["sum_grad_squared"]) == set(gs)
    for q, g in gs.items():
        _close(rec["sum_grad_squared"][q], g.square().sum(0))
    _close(rec["grad_norm"], G.mean(0).norm())
    _close(rec["batch_dot"], G @ G.T)
    with torch.no_grad():
        losses = torch.stack([_loss_of(model(x[i:i + 1], y[i:i + 1])) for i in range(N)])
    _close(rec["loss"], losses.mean())


@pytest.mark.parametrize("how", ["mean-of-two", "divided-by-c"])
def test_light_capture_keeps_the_factor_inside_the_forward(how):
    """GradNorm alone (light capture: parameter hooks only) follows the losses too."""
    model = Composed(how).double()
    x, y = _data()
    G = _oracle(model, x, y)
    _close(_run(model, x, y, [GradNorm()])["grad_norm"], G.mean(0).norm())


def test_a_grad_scaler_and_the_loop_s_1_over_k_are_divided_out_of_a_composed_loss():
    """``scaler.scale(loss / K)`` with ``loss = (CE_a + CE_b) / 2`` from the model: the scale and
    1/K go, the 1/2 stays."""
    model = Composed("mean-of-two").double()
    x, y = _data()
    G = _oracle(model, x, y)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    rec = _run(model, x, y, [BatchL2(), GradNorm(), GradHist1d(bins=8, range=(-1.0, 1.0))], scale=scaler)
    _close(rec["batch_l2"], G.square().sum(1))
    _close(rec["grad_norm"], G.mean(0).norm())
    assert rec["grad_hist_1d"].total == G.numel()


@pytest.mark.filterwarnings("ignore:an exception inside lens.capture")
@pytest.mark.parametrize("how, what, per_sample", [
    ("squared", "pow", "are undefined: their output reaches pow of a value pooled over the samples"),
    ("times-parameter", "mul", "cannot tell the sample axis .* the output of mul"),
])
def test_a_composition_with_no_per_sample_split_is_refused(how, what, per_sample):
    """A power of the loss, or the loss times a parameter, has no per-sample split: refused by
    the units (light capture, which follows no layer) or before them by the mixing rule."""
    model = Composed(how).double()
    x, y = _data()
    with pytest.raises(RuntimeError, match=rf"reaches the value the model returns through {what}, which is "
                                           r"not a sum of the losses times constants.*lens.capture\(reduction="):
        _run(model, x, y, [GradNorm()])
    with pytest.raises(RuntimeError, match=per_sample):
        _run(model, x, y, [BatchL2(), GradNorm()])


class _Stored(nn.Module):
    """Keeps ``loss / 2`` as an attribute and returns the logits only: the loop backpropagates
    a value the forward did not return."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        out = self.lin(x)
        self.loss = F.cross_entropy(out, y) / 2
        return out


@pytest.mark.filterwarnings("ignore:an exception inside lens.capture")
@pytest.mark.parametrize("light", [False, True], ids=["per-sample", "light"])
def test_a_loss_taken_further_but_not_returned_is_refused(light):
    """The loss reached backward through ``/ 2`` inside the model, but the model returned no
    value computed from it: which factor belongs to the objective cannot be told."""
    model = gradlens.extend(_Stored().double())
    lens = Lens(model, [GradNorm()] if light else [BatchL2(), GradNorm()])
    x, y = _data()
    model(x, y)
    with pytest.raises(RuntimeError, match="lead to no value the model returns.*cannot be told apart"):
        with lens.capture():
            (model.loss / 3).backward()
    lens.close()


def test_a_loss_returned_as_is_and_scaled_outside_keeps_its_units():
    """The loss the model returns, divided by K and by a constant outside the model: both
    are divided out (what multiplies the returned loss is not the objective's)."""
    model = Composed("sum-of-two").double()
    x, y = _data()
    G = _oracle(model, x, y)
    m = gradlens.extend(copy.deepcopy(model))
    lens = Lens(m, [BatchL2(), GradNorm()])
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        loss = m(xb, yb)
        with lens.capture():
            (loss / K / 7.0).backward()
    rec = lens.flush()
    _close(rec["batch_l2"], G.square().sum(1))
    _close(rec["grad_norm"], G.mean(0).norm())
    lens.close()


class _StoredAsIs(nn.Module):
    """Keeps its loss as an attribute, untouched but for a detached copy for a log."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 4)

    def forward(self, x, y):
        out = self.lin(x)
        self.loss = F.cross_entropy(out, y)
        self.logged = self.loss.detach() * 1.0
        return out


def test_a_loss_kept_as_computed_keeps_its_units():
    """A loss the forward computed and did not take further (a detached copy for a log needs no
    gradient): everything between it and backward (here 1/K) is divided out, as for a loss
    computed outside the model."""
    model = _StoredAsIs().double()
    x, y = _data()
    gs = per_sample_loop(model, model.state_dict(), lambda m, i: F.cross_entropy(m(x[i:i + 1], y[i:i + 1]), y[i:i + 1]), N)
    G = torch.cat([g.reshape(N, -1) for g in gs.values()], 1)
    m = gradlens.extend(copy.deepcopy(model))
    lens = Lens(m, [BatchL2(), GradNorm()])
    for xb, yb in zip(x.split(SIZES), y.split(SIZES)):
        m(xb, yb)
        with lens.capture():
            (m.loss / K).backward()
    rec = lens.flush()
    _close(rec["batch_l2"], G.square().sum(1))
    _close(rec["grad_norm"], G.mean(0).norm())
    lens.close()
