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
from gradlens.capture.registry import _KERNELS, kernel_for


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


class _NoMaths(Kernel):
    pass


class _BadKind(ScaleKernel):
    kind = "convolution"


class _LinearInName(ScaleKernel):
    kind = "linear"


class _FactoredInName(ScaleKernel):
    factored = True


class _FlagNotBool(ScaleKernel):
    mixes_samples = "yes"


class _RowsNotBool(ScaleKernel):
    rows_per_sample = 1


class _RowsLastAlone(ScaleKernel):
    rows_last = True  # without rows_per_sample


class _FusedByClass(ScaleKernel):
    fused_layers = {nn.Linear: False}  # the class itself, not its qualified name


class _FusedNotBool(ScaleKernel):
    fused_layers = {"torch.nn.modules.linear.Linear": "transposed"}


class _RoutesNotMethod(ScaleKernel):
    routes_param_grads = True


class _MatrixWithoutSketch(ScaleKernel):
    def matrix_dims(self, module):
        return module.weight.shape[0], 1


@pytest.mark.parametrize(
    "kernel, error, match",
    [
        (_NoMaths(), TypeError, r"_NoMaths does not define per_sample; every kernel needs per_sample\(self, module"),
        (_BadKind(), ValueError, r"_BadKind.kind must be one of \['bn', 'conv', 'linear', 'other'\], got 'convolution'; use kind = \"other\""),
        (_LinearInName(), TypeError, r"_LinearInName.kind = 'linear' but _LinearInName does not define \['matrix_dims', 'positions', 'seq_factors', 'use_tgram', 'directional', 'gram', 'sketch_factors'\]; define them, or set kind = \"other\""),
        (_FactoredInName(), TypeError, r"_FactoredInName.factored = True but _FactoredInName does not define \['batch_l2', 'sum_grad_squared', 'grad_sum'\].*or set factored = False"),
        (_FlagNotBool(), TypeError, r"_FlagNotBool.mixes_samples must be True or False, got 'yes'; set the class attribute mixes_samples = True"),
        (_RowsNotBool(), TypeError, r"_RowsNotBool.rows_per_sample must be True or False, got 1; set the class attribute rows_per_sample = True"),
        (_RowsLastAlone(), ValueError, r"_RowsLastAlone.rows_last = True but rows_per_sample is False; set rows_per_sample = True"),
        (_FusedByClass(), TypeError, r"_FusedByClass.fused_layers must map qualified layer class names to whether the weight is transposed, got .*Linear.*; e.g. fused_layers = \{\"torch.nn.modules.linear.Linear\": False\}"),
        (_FusedNotBool(), TypeError, r"_FusedNotBool.fused_layers must map .* got \{'torch.nn.modules.linear.Linear': 'transposed'\}"),
        (_RoutesNotMethod(), TypeError, r"_RoutesNotMethod.routes_param_grads must be a method, got True; define routes_param_grads\(self, module\) -> bool"),
        (_MatrixWithoutSketch(), TypeError, r"_MatrixWithoutSketch defines matrix_dims but not sketch_factors.*define sketch_factors\(self, module"),
        (ScaleKernel, TypeError, r"kernel ScaleKernel is a class; pass an instance, e.g. ScaleKernel\(\)"),
        (3, TypeError, r"kernel must be a gradlens.kernels.Kernel, got int \(3\); subclass gradlens.kernels.Kernel"),
    ],
    ids=["no-per-sample", "unknown-kind", "linear-without-factors", "factored-without-sums", "flag-not-bool",
         "rows-not-bool", "rows-last-alone", "fused-by-class", "fused-not-bool", "routes-not-method", "matrix-without-sketch",
         "class-not-instance", "not-a-kernel"],
)
def test_register_kernel_checks_what_the_kernel_declares(kernel, error, match):
    n = len(_KERNELS)
    with pytest.raises(error, match=match):
        gradlens.register_kernel(Scale, kernel)
    assert len(_KERNELS) == n  # nothing registered


def test_a_factorys_kernel_is_checked_when_the_lens_is_built():
    n = len(_KERNELS)
    gradlens.register_kernel(Scale, lambda m: _BadKind(), "closed form (test)")
    try:
        model = gradlens.extend(nn.Sequential(nn.Linear(3, 4), Scale(4)))
        with pytest.raises(ValueError, match=r"_BadKind.kind must be one of .* got 'convolution'"):
            Lens(model, [BatchL2()])
    finally:
        del _KERNELS[: len(_KERNELS) - n]


def test_a_kernels_kind_is_fixed_by_its_class():
    """The registry hands out a kernel class per kind; nothing sets ``kind`` on an instance."""
    got = {}
    for m in (nn.Conv1d(2, 2, 3), nn.Conv3d(1, 1, 2), nn.ConvTranspose1d(2, 2, 3), nn.Conv2d(2, 2, 3),
              nn.Conv2d(2, 2, 3, padding="same", groups=2), nn.Linear(2, 2), nn.BatchNorm1d(2).eval()):
        kernel = kernel_for(m)
        assert "kind" not in vars(kernel), type(kernel).__name__
        got[type(m).__name__ + ("-groups" if getattr(m, "groups", 1) > 1 else "")] = (type(kernel).__name__, kernel.kind)
    assert got == {
        "Conv1d": ("BackpackConvKernel", "conv"),
        "Conv3d": ("BackpackConvKernel", "conv"),
        "ConvTranspose1d": ("BackpackKernel", "other"),
        "Conv2d": ("Conv2dKernel", "conv"),
        "Conv2d-groups": ("VmapConvKernel", "other"),
        "Linear": ("LinearKernel", "linear"),
        "BatchNorm1d": ("BatchNormEvalKernel", "bn"),
    }


class _KindGiven(ScaleKernel):
    def __init__(self, kind):
        self.kind = kind


def test_a_kind_given_to_a_kernels_constructor_is_checked_for_every_kernel():
    n = len(_KERNELS)
    kinds = iter(["other", "linear"])
    gradlens.register_kernel(Scale, lambda m: _KindGiven(next(kinds)), "closed form (test)")
    try:
        assert kernel_for(Scale(2)).kind == "other"
        with pytest.raises(TypeError, match=r"_KindGiven.kind = 'linear' but _KindGiven does not define"):
            kernel_for(Scale(2))
    finally:
        del _KERNELS[: len(_KERNELS) - n]


def test_readme_table_is_the_generated_one():
    """The README's layer table is exactly what the registry generates (both ways: no layer
    missing, none listed that gradlens does not register)."""
    from gradlens.capture.registry import layer_table

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    start = readme.index("| layer | per-sample gradients |")
    table = readme[start: readme.index("\n\n", start)]
    assert table == layer_table(), "README's layer table is stale: paste gradlens.capture.registry.layer_table()"
    assert "`nn.Bilinear`" in table
