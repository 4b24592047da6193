"""Variances that cancel (issue 12): MeanGSNR, NormTest, NoiseScale exact for equal gradients,
independent of the micro-step split, stable in float32 (float64 oracle from torch.func)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradlens
from gradlens.instruments import MeanGSNR, NoiseScale, NormTest
from windows import micro_batches, run_windows


def _per_sample(model, loss_one, x, y):
    import copy

    model = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xi, yi):
        return loss_one(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    gs = vmap(grad(f), in_dims=(None, 0, 0))(params, x.double(), y.double())
    return torch.cat([g.flatten(1) for g in gs.values()], 1)  # [N, D]


def _gsnr_oracle(G):
    n = G.shape[0]
    mean = G.mean(0)
    var = ((G - mean) ** 2).sum(0) / (n - 1)
    ok = var > 0
    return float((mean[ok] ** 2 / var[ok]).mean())


def _run(model, loss_fn, x, y, split, instruments, reduction=None):
    """One window of ``(x, y)`` in micro-batches ``split`` on ``model`` itself; its record
    (``reduction``: a functional loss, stated to capture with the loss)."""
    return run_windows(model, [micro_batches(x, y, split)], instruments, loss=loss_fn, fresh_copy=False,
                       capture={"reduction": reduction} if reduction else None, pass_loss=bool(reduction)).flushed[0]


@pytest.mark.parametrize("split", [[12], [6, 6], [5, 1, 6]])
def test_gsnr_of_equal_bias_gradients_is_the_definition_at_every_split(split):
    """Linear(1, 7), L1Loss, targets -100: every sample's bias gradient is the same (sign / 7);
    those coordinates carry no noise. Was 1.2e15 at K=1, 0.261 at K=2, 3."""
    torch.manual_seed(0)
    model = nn.Linear(1, 7).double()
    x = torch.randn(12, 1, dtype=torch.float64)
    y = torch.full((12, 7), -100.0, dtype=torch.float64)
    G = _per_sample(model, nn.functional.l1_loss, x, y)
    assert torch.equal(G[:, 7:], G[:1, 7:].expand(12, 7))  # the bias gradients are equal
    want = _gsnr_oracle(G)
    assert want == pytest.approx(float(x.mean() ** 2 / x.var()), rel=1e-12)  # the definition
    rec = _run(model, gradlens.extend(nn.L1Loss()), x, y, split, [MeanGSNR()])
    assert rec["mean_gsnr"] == pytest.approx(want, rel=1e-12)


def test_equal_gradients_give_exactly_zero_variance():
    """Every sample the same: tr(Sigma) = 0, so norm_test and noise_scale are exactly 0, and
    no coordinate has a GSNR (NaN)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(1, 3).expand(9, 3).contiguous()
    y = torch.full((9, 2), -100.0)  # L1: dL/dout = sign = 1 exactly, so every g_n is the same
    for split in ([9], [4, 5], [2, 3, 4]):
        for per_sample in (False, True):
            rec = _run(
                model, gradlens.extend(nn.L1Loss()), x, y, split,
                [MeanGSNR(), NormTest(per_sample=per_sample), NoiseScale(per_sample=per_sample)],
            )
            assert rec["norm_test"] == 0.0 and rec["noise_scale"] == 0.0, (split, per_sample)
            assert math.isnan(rec["mean_gsnr"])


def test_float32_is_stable_against_the_float64_oracle():
    """High-GSNR coordinates (a small spread on a large mean) in float32: raw sums lose every
    digit of the variance; shifted sums keep the GSNR to ~1e-4 relative in 200 windows."""
    worst = 0.0
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        model = nn.Linear(4, 3)
        x = 5.0 + 0.01 * torch.randn(10, 4, generator=gen)  # nearly equal inputs
        y = torch.randn(10, 3, generator=gen) - 20.0
        G = _per_sample(model, nn.functional.mse_loss, x, y)
        want = _gsnr_oracle(G)
        rec = _run(model.float(), gradlens.extend(nn.MSELoss()), x.float(), y.float(), [3, 7],
                   [MeanGSNR()])
        worst = max(worst, abs(rec["mean_gsnr"] - want) / want)
    assert worst < 1e-3, worst


@pytest.mark.parametrize("per_sample", [False, True])
@pytest.mark.parametrize("split", [[12], [5, 1, 6]])
def test_trace_instruments_match_the_oracle(per_sample, split):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    G = _per_sample(model, lambda o, t: nn.functional.cross_entropy(o, t.long()), x, y)
    n, mean = G.shape[0], G.mean(0)
    trace = ((G - mean) ** 2).sum() / (n - 1)
    rec = _run(model, gradlens.extend(nn.CrossEntropyLoss()), x, y, split,
               [MeanGSNR(), NormTest(per_sample=per_sample), NoiseScale(per_sample=per_sample)])
    assert rec["noise_scale"] == pytest.approx(float(trace / mean.square().sum()), rel=1e-10)
    assert rec["norm_test"] == pytest.approx(float((trace / n).sqrt() / mean.norm()), rel=1e-10)
    assert rec["mean_gsnr"] == pytest.approx(_gsnr_oracle(G), rel=1e-10)
    with pytest.raises(TypeError, match="per_sample must be True or False"):
        NormTest(per_sample="yes")
