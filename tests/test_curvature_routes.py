"""Issue 36, curvature through derived parameter uses: a parameter that meets the batch through
a parameters-only computation (a sliced position table ``pos[:, :T]``, ``cls.expand(B, ...)``,
a tied transposed weight ``W.t()``) has its per-sample gradients formed by a batched VJP through
that computation while per-sample instruments run (gradlens.capture.ops.chain_to_params); the
parameter hooks that collect the micro-step's own gradient (the curvature instruments' window
graph, the noise scale's micro-step norms) must not count those. Oracle: the float64 Hessian of
the window objective (tests/test_curvature.py), K unequal micro-steps, with and without a
per-sample instrument beside the curvature ones."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, HessMaxEV, HessTrace, NoiseScaleTwoBatch, SumGradSquared, TICDiag, TICTrace
from gradlens.instruments.curvature import TIC_EPS

from test_curvature import oracle

SPLIT = [3, 1, 4]


class Derived(nn.Module):
    """Every parameter but ``lin`` meets the batch through a parameters-only computation."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, 6, 3) * 0.5)
        self.cls = nn.Parameter(torch.randn(1, 1, 3) * 0.5)
        self.lin = nn.Linear(3, 4)
        self.dec = nn.Linear(3, 4, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = torch.cat([self.cls.expand(b, -1, -1), x + self.pos[:, :t]], 1)
        h = torch.tanh(self.lin(h))
        return (h @ self.dec.weight).mean(1)  # the tied weight, transposed: [4] -> [3]


def _data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(8, 4, 3, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)


def _run(model0, x, y, instruments):
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    lens = Lens(model, instruments)
    try:
        for xb, yb in zip(x.split(SPLIT), y.split(SPLIT)):
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward(create_graph=lens.create_graph)
        return lens.flush()
    finally:
        lens.close()


@pytest.mark.parametrize("with_per_sample", [False, True])
def test_curvature_counts_only_the_window_gradient_whatever_forms_per_sample_gradients(with_per_sample):
    torch.manual_seed(0)
    model0 = Derived().double()
    x, y = _data()
    H, m = oracle(model0, x, y, "mean")
    diag = torch.diagonal(H)
    insts = [HessMaxEV(tol=1e-10), HessTrace(), TICDiag(), TICTrace()]
    if with_per_sample:  # per-sample gradients of pos, cls and dec through their derived uses
        insts += [BatchL2(), SumGradSquared()]
    rec = _run(model0, x, y, insts)
    torch.testing.assert_close(rec["hess_max_ev"], float(torch.linalg.eigvalsh(H)[-1]), rtol=1e-7, atol=0)
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=1e-8, atol=0)
    torch.testing.assert_close(rec["tic_trace"], float(m.sum() / (diag.sum() + TIC_EPS)), rtol=1e-8, atol=0)


def test_the_noise_scales_micro_step_norms_count_only_the_window_gradient():
    """NoiseScaleTwoBatch reads ||s_k||^2 of each micro-step from parameter hooks: the same with
    and without per-sample gradients formed through the derived uses (their batched VJP used to
    reach the hooks, and fail inside them)."""
    torch.manual_seed(0)
    model0 = Derived().double()
    x, y = _data()

    def run(insts):
        model = gradlens.extend(copy.deepcopy(model0))
        loss_fn = gradlens.extend(nn.MSELoss())
        lens = Lens(model, insts)
        for xb, yb in zip(x.split(SPLIT), y.split(SPLIT)):
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward()
        rec = lens.flush()
        lens.close()
        return rec["noise_scale_two_batch"]

    alone = run([NoiseScaleTwoBatch()])
    beside = run([NoiseScaleTwoBatch(), BatchL2()])
    assert alone.keys() == beside.keys()
    for k in alone:
        assert beside[k] == pytest.approx(alone[k], rel=1e-10, nan_ok=True), k
    assert alone["small_batches"] == len(SPLIT) and alone["batch_big"] == sum(SPLIT)
