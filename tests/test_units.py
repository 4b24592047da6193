"""Units of objectives that are not a plain per-sample mean or sum (DESIGN.md, "Notation and
units"): ignored targets, losses computed inside the model, scaled functional losses. The
oracle is a per-sample loop in float64 on a copy of the model."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm

B = 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double()


def _oracle(model, x, y, per_sample_objective):
    """``[B, D]`` g_n = grad of sample n's share of the objective."""
    params = list(model.parameters())
    rows = []
    for n in range(len(x)):
        share = per_sample_objective(model(x), y, n)
        gs = torch.autograd.grad(share, params)
        rows.append(torch.cat([g.reshape(-1) for g in gs]))
    return torch.stack(rows)


def _check(rec, G, reduction="mean"):
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    g = G.mean(0) if reduction == "mean" else G.sum(0)
    torch.testing.assert_close(torch.tensor(rec["grad_norm"], dtype=torch.float64), g.norm(), rtol=1e-10, atol=1e-12)


def test_ignored_targets_follow_the_mean_objective_convention():
    """CrossEntropyLoss(mean) with ignore_index: L = sum of valid token losses / #valid, and
    g_n = B * grad L_n (an ignored sample has g_n = 0)."""
    model = _model()
    x = torch.randn(B, 5, dtype=torch.float64)
    y = torch.tensor([0, 1, 3, 3, 2, 1])  # two targets ignored
    valid = (y != 3).sum()

    def share(out, t, n):
        losses = F.cross_entropy(out, t, ignore_index=3, reduction="none")
        return B * losses[n] / valid

    G = _oracle(copy.deepcopy(model), x, y, share)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=3))
    lens = Lens(model, [BatchL2(), GradNorm()])
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    rec = lens.flush()
    _check(rec, G)
    assert G[2].abs().max() == 0 and rec["batch_l2"][2] == 0
    assert "mean objective" in rec.meta["units"]


class _WithLoss(nn.Module):
    """A model that returns its own loss (as transformers' models do with ``labels=``)."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x, labels=None):
        out = self.body(x)
        return out, (F.cross_entropy(out, labels) if labels is not None else None)


def test_loss_inside_the_model_and_its_multiplier():
    """``model(x, labels=y)`` computes F.cross_entropy inside: capture() needs no reduction, and
    a 1/3 applied to that loss (gradient accumulation recipes) is divided out."""
    body = _model()
    x = torch.randn(B, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (B,))
    G = _oracle(copy.deepcopy(body), x, y, lambda out, t, n: F.cross_entropy(out[n : n + 1], t[n : n + 1]))
    model = gradlens.extend(_WithLoss(body))
    lens = Lens(model, [BatchL2(), GradNorm()])
    _, loss = model(x, labels=y)
    with lens.capture():
        (loss / 3).backward()
    rec = lens.flush()
    _check(rec, G)
    assert abs(rec["loss"] - float(loss)) < 1e-12


def test_scaled_functional_loss_named_with_loss_argument():
    """A functional loss outside the model, backpropagated as loss / 2: naming it keeps the
    units (today's pitfall: without it, g_n would be halved)."""
    model = _model()
    x = torch.randn(B, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (B,))
    G = _oracle(copy.deepcopy(model), x, y, lambda out, t, n: F.cross_entropy(out[n : n + 1], t[n : n + 1]))
    model = gradlens.extend(model)
    lens = Lens(model, [BatchL2(), GradNorm()])
    loss = F.cross_entropy(model(x), y)
    with lens.capture(reduction="mean", loss=loss):
        (loss / 2).backward()
    _check(lens.flush(), G)
