"""The per-layer registry: a user's own kernel is used and exact; the README table is true."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, SumGradSquared
from gradlens.kernels import Kernel
from gradlens.registry import _KERNELS, kernel_for


class Scale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * self.weight


class ScaleKernel(Kernel):
    calls = 0

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        ScaleKernel.calls += 1
        return {"weight": (delta[start:stop] * a[start:stop]).reshape(stop - start, -1, a.shape[-1]).sum(1)}


@pytest.fixture
def registered():
    n = len(_KERNELS)
    gradlens.register_kernel(Scale, ScaleKernel(), "closed form (test)")
    yield
    del _KERNELS[: len(_KERNELS) - n]


def test_user_kernel_is_used_and_exact(registered):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), Scale(4), nn.Tanh(), nn.Linear(4, 2)).double()
    assert isinstance(kernel_for(model[1]), ScaleKernel)
    x, y = torch.randn(7, 3, dtype=torch.float64), torch.randn(7, 2, dtype=torch.float64)
    ref = copy.deepcopy(model)
    want = []
    for n in range(7):
        ref.zero_grad()
        nn.functional.mse_loss(ref(x[n : n + 1]), y[n : n + 1], reduction="sum").backward()
        want.append(ref[1].weight.grad.clone())
    want = torch.stack(want)
    model = gradlens.extend(model)
    lens = Lens(model, [SumGradSquared(), BatchL2()])
    loss = gradlens.extend(nn.MSELoss(reduction="sum"))(model(x), y)
    ScaleKernel.calls = 0
    with lens.capture():
        loss.backward()
    rec = lens.flush()
    assert ScaleKernel.calls > 0
    torch.testing.assert_close(rec["sum_grad_squared"]["1.weight"], want.square().sum(0), rtol=1e-10, atol=1e-12)


def test_register_kernel_checks_its_argument():
    with pytest.raises(TypeError, match="takes a class or a dotted name"):
        gradlens.register_kernel(3, ScaleKernel())


def test_readme_table_names_every_registered_layer():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    table = readme[readme.index("| layer | per-sample gradients |") :]
    table = table[: table.index("\n\n")]
    for layer, _ in gradlens.supported_layers():
        short = layer.replace("nn._BatchNorm", "nn.BatchNorm").replace("nn._InstanceNorm", "nn.InstanceNorm")
        short = short.split(".")[-1]
        assert short in table, f"{layer} is registered but missing from the README table"
