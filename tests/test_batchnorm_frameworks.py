"""Issue 43 with timm (marker ``frameworks``): a timm CNN whose BatchNorms are timm's
``BatchNormAct2d`` (BatchNorm with its activation fused), converted by
``convert_accum_batchnorm`` and trained with a ``GradientAccumulateOptimizer`` over micro-batches
of 2, 3 and 1, float64. Oracle (tests/oracle.py ``batchnorm_window``): each BatchNorm of an
unconverted copy run once on what it received over the window; the first one's statistics are
those of one batch of the window's 6 samples through the unconverted model.

Run: ``/work/main/.venv-fw/bin/python -m pytest -m frameworks tests/test_batchnorm_frameworks.py``.
"""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradlens import GradientAccumulateOptimizer, convert_accum_batchnorm
from gradlens.training.batchnorm import AccumBatchNormAct2d
from oracle import batchnorm_copies, batchnorm_window

pytestmark = pytest.mark.frameworks

SPLIT = (2, 3, 1)
TOL = dict(rtol=1e-10, atol=1e-12)


def _buffers(model, names) -> dict[str, torch.Tensor]:
    """``model``: a module, or the oracle's ``{name: BatchNorm}`` copies."""
    mods = model if isinstance(model, dict) else dict(model.named_modules())
    return {f"{n}.{k}": getattr(mods[n], k) for n in names for k in ("running_mean", "running_var", "num_batches_tracked")}


def test_gradlens_does_not_import_timm():
    code = "import sys, gradlens, gradlens.training.batchnorm; gradlens.convert_accum_batchnorm; " \
           "assert 'timm' not in sys.modules, sorted(m for m in sys.modules if m.startswith('timm'))"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_timm_batchnormact2d_converted_and_trained_with_accumulation():
    import timm
    from timm.layers.norm_act import BatchNormAct2d

    torch.manual_seed(0)
    model = timm.create_model("mobilenetv3_small_050", pretrained=False, num_classes=5).double()
    layers = {n: m for n, m in model.named_modules() if type(m) is BatchNormAct2d}
    fused = {n: (m.act, m.drop) for n, m in layers.items()}
    assert len(layers) > 10 and sum(not isinstance(a, nn.Identity) for a, _ in fused.values()) > 5
    first = next(iter(layers))
    copies = batchnorm_copies(model)
    assert set(copies) == set(layers)  # every BatchNorm of this model is a BatchNormAct2d
    plain, full, ref = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)

    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), accum_steps=len(SPLIT))
    model = convert_accum_batchnorm(model, optimizer=opt)
    mods = dict(model.named_modules())
    for n, (act, drop) in fused.items():
        assert type(mods[n]) is AccumBatchNormAct2d and mods[n].act is act and mods[n].drop is drop
        assert mods[n].follows_optimizer
    assert not any(isinstance(m, BatchNormAct2d) for m in model.modules())

    g = torch.Generator().manual_seed(1)
    for window in range(2):
        x = torch.randn(sum(SPLIT), 3, 64, 64, generator=g, dtype=torch.float64) + window
        y = torch.randint(0, 5, (sum(SPLIT),), generator=g)
        plain.load_state_dict(model.state_dict(), strict=False)  # this window's parameters
        full.load_state_dict(model.state_dict(), strict=False)
        with torch.no_grad():
            full(x)  # one batch of 6 through the unconverted model (its running statistics updated once)
        parts = x.split(list(SPLIT))
        wants = batchnorm_window(plain, copies, parts)
        for part, yk, want in zip(parts, y.split(list(SPLIT)), wants):
            out = model(part)
            torch.testing.assert_close(out, want, rtol=0, atol=0)  # the micro-batch's normalisation, act kept
            F.cross_entropy(out, yk).backward()
            opt.step(num_samples=len(part))
            opt.zero_grad()
            assert all(m.window_open for n, m in mods.items() if n in layers) == (part is not parts[-1])
        got, oracle = _buffers(model, layers), _buffers(copies, layers)
        for key, value in oracle.items():
            if key.endswith("num_batches_tracked"):
                assert int(got[key]) == int(value) == window + 1, key
            else:
                torch.testing.assert_close(got[key], value, **TOL, msg=key)
        for key, value in _buffers(full, [first]).items():  # the first layer: one batch of 6
            torch.testing.assert_close(got[key].double(), value.double(), **TOL, msg=key)
    # per-micro-batch updates (the unconverted layers) are not the same statistics
    assert not torch.allclose(plain.get_submodule(first).running_var, model.get_submodule(first).running_var, rtol=1e-3)

    ref.load_state_dict({**model.state_dict(), **_buffers(copies, layers)}, strict=False)
    model.eval(), ref.eval()
    x = torch.randn(3, 3, 64, 64, generator=g, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x), **TOL)
