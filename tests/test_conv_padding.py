"""Conv layers BackPACK got wrong or crashed on (issue 12): string padding ("same"/"valid",
also with dilation, asymmetric "same", groups, 1d/2d/3d) and ConvTranspose with output_padding,
against the float64 oracle; eval BatchNorm(track_running_stats=False) refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, SumGradSquared
from windows import micro_batches, run_windows


def oracle(model, x, y, loss="mse_sum"):
    """name -> [N, *param] float64 per-sample gradients of each sample's own loss."""
    model = copy.deepcopy(model).double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.mse_loss(out, yi.unsqueeze(0), reduction="sum")

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def check(model, x, split=(2, 3)):
    torch.manual_seed(1)
    model = model.double()
    with torch.no_grad():
        y = torch.randn_like(model(x))
    gs = oracle(model, x, y)
    G = torch.cat([g.flatten(1) for g in gs.values()], 1)
    lo, hi = -1.0, 1.0
    (rec,) = run_windows(model, [micro_batches(x, y, split)],
                         [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=7, range=(lo, hi))],
                         loss="mse", reduction="sum").flushed
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    for name, g in gs.items():
        torch.testing.assert_close(rec["sum_grad_squared"][name], g.square().sum(0), rtol=1e-10, atol=1e-12)
    assert rec["grad_norm"] == pytest.approx(float(G.sum(0).norm()), rel=1e-10)
    idx = torch.floor((G.flatten() - lo) * 7 / (hi - lo)).clamp(0, 6).long()
    assert torch.equal(rec["grad_hist_1d"].counts, torch.bincount(idx, minlength=7))


def test_issue_reproduction_conv1d_same_is_exact():
    """Conv1d(1,1,1,padding='same'), x = randn(2,1,3), MSELoss(sum): was [7.86, 8.79]."""
    torch.manual_seed(0)
    check(nn.Conv1d(1, 1, 1, padding="same"), torch.randn(2, 1, 3, dtype=torch.float64), (1, 1))


CONVS = {
    "conv1d-same-even-k": lambda: nn.Conv1d(2, 3, 4, padding="same"),
    "conv1d-same-dil": lambda: nn.Conv1d(2, 4, 3, padding="same", dilation=2, groups=2),
    "conv1d-valid": lambda: nn.Conv1d(2, 3, 3, padding="valid", stride=2),
    "conv2d-same": lambda: nn.Conv2d(2, 3, 3, padding="same"),
    "conv2d-same-even-k-dil": lambda: nn.Conv2d(2, 3, (2, 3), padding="same", dilation=(1, 2)),
    "conv2d-valid": lambda: nn.Conv2d(2, 3, 3, padding="valid", dilation=2),
    "conv2d-grouped-same": lambda: nn.Conv2d(4, 6, 3, padding="same", groups=2, bias=False),
    "conv3d-same": lambda: nn.Conv3d(2, 2, (2, 3, 1), padding="same"),
    "convT1d-outpad": lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, output_padding=1),
    "convT2d-outpad": lambda: nn.ConvTranspose2d(2, 2, 3, stride=(2, 3), output_padding=(1, 2), padding=1),
    "convT2d-outpad-grouped-dil": lambda: nn.ConvTranspose2d(
        4, 2, 2, stride=3, output_padding=1, groups=2, dilation=2
    ),
    "convT3d-outpad": lambda: nn.ConvTranspose3d(1, 2, 2, stride=2, output_padding=1),
}
SHAPES = {"1d": (5, 2, 9), "2d": (5, 2, 6, 7), "3d": (5, 2, 4, 5, 3)}


@pytest.mark.parametrize("name", sorted(CONVS))
def test_conv_configuration_matches_the_oracle(name):
    torch.manual_seed(0)
    layer = CONVS[name]()
    dims = "1d" if "1d" in name else "3d" if "3d" in name else "2d"
    shape = list(SHAPES[dims])
    shape[1] = layer.in_channels
    check(nn.Sequential(layer, nn.Tanh()), torch.randn(*shape, dtype=torch.float64))


def test_eval_batchnorm_without_running_stats_mixes_samples():
    """BatchNorm(track_running_stats=False) uses batch statistics in eval mode too: the layers
    before it are undefined (named at once), the layer itself and the ones after stay exact."""
    from gradlens import Lens
    from gradlens.instruments import BatchL2

    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False), nn.Linear(4, 2))
    model = gradlens.extend(model.eval())
    lens = Lens(model, [BatchL2()])
    loss_fn = gradlens.extend(nn.MSELoss())
    x, y = torch.randn(5, 3), torch.randn(5, 2)
    with pytest.raises(RuntimeError, match=r"reaches '1' \(BatchNorm1d with batch statistics\).*\['0.bias', '0.weight'\]"):
        loss = loss_fn(model(x), y)
        with lens.capture():
            loss.backward()
    lens.close()
    lens = Lens(model, [BatchL2()], undefined="exclude")
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (5,)
    assert lens.tracked == ["1.weight", "1.bias", "2.weight", "2.bias"]
