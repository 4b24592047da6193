"""Curvature of the window objective (HessMaxEV, HessTrace, TICDiag, TICTrace) against a float64
oracle: ``torch.func.hessian`` of the window objective (all N samples of all micro-steps and
ranks) on a copy of the model taken before ``gradlens.extend``, and ``vmap(grad)`` per-sample
gradients for the TIC's m_j. K unequal micro-steps, mean and sum losses, 2 gloo ranks; the
Hutchinson estimate's mean and standard error over 200 windows; cockpit's configurations."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    Alpha,
    GradHist1d,
    GradHist2d,
    GradNorm,
    HessMaxEV,
    HessTrace,
    InnerTest,
    NormTest,
    OrthoTest,
    SumGradSquared,
    TICDiag,
    TICTrace,
    configuration,
)
from gradlens.instruments.curvature import TIC_EPS

SPLIT = [5, 1, 6]  # K = 3 unequal micro-steps, N = 12
RTOL = 1e-8


# ---- models ---------------------------------------------------------------------------------
def tanh_mlp() -> nn.Module:
    """4-6-3 tanh MLP; with MSE on these targets its Hessian is indefinite, lambda_min close to
    -lambda_max (checked on the oracle below): a power iteration cannot tell them apart."""
    torch.manual_seed(37)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def tanh_data():
    """The probe's data (x [12, 4], targets [12, 3] of scale 3), drawn after tanh_mlp's weights."""
    torch.manual_seed(37)
    nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # the same draws as tanh_mlp
    return torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64) * 3


def small_cnn() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 2 * 2, 4),
    ).double()


class AttnBlock(nn.Module):
    """LayerNorm + self-attention (nn.MultiheadAttention) + a Linear head over the mean token."""

    def __init__(self, d: int = 6, heads: int = 2, out: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        h = self.norm(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head((x + a).mean(1))


def attn_block() -> nn.Module:
    torch.manual_seed(5)
    return AttnBlock().double()


# ---- oracle ---------------------------------------------------------------------------------
def _loss(out, y, reduction):
    """The loss gradlens sees: MSELoss / CrossEntropyLoss with ``reduction``."""
    if y.dtype.is_floating_point:
        return nn.functional.mse_loss(out, y, reduction=reduction)
    return nn.functional.cross_entropy(out, y, reduction=reduction)


def oracle(model0: nn.Module, x, y, reduction: str):
    """(H [D, D], m [D]) float64: the Hessian of the window objective over all N samples
    (``torch.func.hessian``) and m_j = (1/N) sum_n g_nj^2 from ``vmap(grad)``."""
    model = copy.deepcopy(model0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    theta = torch.cat([params[k].reshape(-1) for k in names])

    def unflat(t):
        return dict(zip(names, [c.reshape(s) for c, s in zip(t.split(sizes), shapes)]))

    def objective(t):
        return _loss(functional_call(model, unflat(t), (x,)), y, reduction)

    H = torch.func.hessian(objective)(theta)

    def one(t, xi, yi):
        return _loss(functional_call(model, unflat(t), (xi.unsqueeze(0),)), yi.unsqueeze(0), reduction)

    G = vmap(grad(one), in_dims=(None, 0, 0))(theta, x, y)  # [N, D]
    return H, G.square().mean(0)


# ---- gradlens -------------------------------------------------------------------------------
def _loss_module(y, reduction):
    return gradlens.extend(nn.MSELoss(reduction=reduction) if y.dtype.is_floating_point
                           else nn.CrossEntropyLoss(reduction=reduction))


def run_window(model0, x, y, reduction, instruments, split=SPLIT, optimizer=True, windows=1):
    """Records of ``windows`` windows of the same batch split into ``split`` micro-steps (the
    update has lr 0: the parameters stay, so every window has the same Hessian)."""
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = _loss_module(y, reduction)
    opt = torch.optim.SGD(model.parameters(), lr=0.0) if optimizer else None
    lens = Lens(model, instruments, optimizer=opt)
    for _ in range(windows):
        for xb, yb in zip(x.split(split), y.split(split)):
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward(create_graph=lens.create_graph)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        else:
            lens.flush()
            model.zero_grad()
    lens.close()
    return lens.records


def _flat_index(model0):
    return sum(p.numel() for p in model0.parameters())


# ---- exactness --------------------------------------------------------------------------------
def test_tanh_mlp_hessian_is_indefinite_with_close_extremes():
    H, _ = oracle(tanh_mlp(), *tanh_data(), "mean")
    ev = torch.linalg.eigvalsh(H)
    assert ev[0] < 0 < ev[-1]
    assert 0.95 < -float(ev[0]) / float(ev[-1]) < 1.05


@pytest.mark.parametrize("split", [[12], SPLIT])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_on_tanh_mlp(reduction, split):
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, m = oracle(model0, x, y, reduction)
    ev = torch.linalg.eigvalsh(H)
    diag = torch.diagonal(H)
    insts = [HessMaxEV(tol=1e-10), HessTrace(), TICDiag(), TICTrace()]
    (rec,) = run_window(model0, x, y, reduction, insts, split=split)
    # the largest algebraic eigenvalue, not lambda_min, whose magnitude is within 5% of it
    torch.testing.assert_close(rec["hess_max_ev"], float(ev[-1]), rtol=1e-8, atol=0)
    assert rec.meta["hess_max_ev"] == "converged"
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    assert rec.meta["hess_trace"] == "exact" and "hess_trace_stderr" not in rec
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    torch.testing.assert_close(rec["tic_trace"], float(m.sum() / (diag.sum() + TIC_EPS)), rtol=RTOL, atol=0)
    assert rec.meta["tic_diag"] == "exact" and rec.meta["tic_trace"] == "exact"
