"""Hugging Face Accelerate: a Lens on the prepared optimizer, ``accelerator.accumulate(model)``,
one record per real update == the float64 oracle of the same windows.

The recipe is the README's (and ``examples/accelerate_accumulate.py``'s): an extended model and
loss module, ``accelerator.prepare``, ``Lens(..., optimizer=prepared_optimizer)``, ``with
lens.capture(): accelerator.backward(loss)``. CPU, float64, ``gradient_accumulation_steps=3``
over 35 samples in micro-batches of 4: windows of 12, 12 and 11 samples (the last one ends with
the data loader). The oracle: ``torch.func`` per-sample gradients at each window's starting
parameters, snapshotted by the test.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm

try:
    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    _IMPORT_ERROR = None
except ImportError as err:  # collected (and deselected) by the default run
    _IMPORT_ERROR = err

import oracle as O

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _frameworks_present():
    """A missing framework fails these tests when they run, never skips them."""
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR


K, B, N_TOTAL = 3, 4, 35


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TOTAL, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N_TOTAL,), generator=g)
    return x, y


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_accelerate_accumulate_records_equal_oracle(reduction):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model0 = copy.deepcopy(model)
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    # --- the README recipe, as printed
    accelerator = Accelerator(gradient_accumulation_steps=K, cpu=True)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    assert isinstance(optimizer, AcceleratedOptimizer)
    lens = Lens(model, [BatchL2(), GradNorm(), GradHist1d()], optimizer=optimizer)
    states, window_start, skipped = [], True, 0
    for xb, yb in loader:
        if window_start:  # the test's own snapshot of the window's starting parameters
            states.append(copy.deepcopy(model.state_dict()))
            window_start = False
        with accelerator.accumulate(model):
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            window_start = True
        else:
            skipped += 1
            assert lens.step == len(states) - 1  # a skipped step closes no window
    lens.close()

    recs = lens.records
    assert skipped == 6
    assert [r.num_samples for r in recs] == [12, 12, 11]
    assert [r.micro_steps for r in recs] == [3, 3, 3]
    assert [r.step for r in recs] == [0, 1, 2] and len(states) == 3
    assert not torch.equal(states[0]["0.weight"], states[1]["0.weight"])

    def own_loss(out, t):  # sample n's own loss (DESIGN.md units, mean or sum alike)
        return F.cross_entropy(out, t)

    n = K * B
    for t, rec in enumerate(recs):
        xs, ys = x[t * n:(t + 1) * n], y[t * n:(t + 1) * n]
        gs = O.per_sample(model0, states[t], own_loss, xs, ys)
        o = O.norm_set(gs)
        O.close(rec["batch_l2"], o["batch_l2"])
        mean_g = O.flat(gs).mean(0) if reduction == "mean" else O.flat(gs).sum(0)
        O.close(rec["grad_norm"], mean_g.norm())
        O.hist_matches(rec["grad_hist_1d"], O.flat(gs), -2.0, 2.0, 100)  # GradHist1d's default range
        with torch.no_grad():
            m0 = copy.deepcopy(model0)
            m0.load_state_dict(states[t])
            O.close(rec["loss"], F.cross_entropy(m0(xs), ys, reduction=reduction))


def test_lens_hooks_the_optimizer_inside_an_accelerated_optimizer():
    model = gradlens.extend(nn.Linear(3, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = AcceleratedOptimizer(inner, device_placement=False)
    lens = Lens(model, [GradNorm()], optimizer=wrapped)
    assert lens.optimizer is inner and lens.grad_scaler is None
    lens.close()
    # under mixed precision the prepared optimizer's GradScaler watches for skipped steps
    scaler = torch.amp.GradScaler("cpu")
    scaled = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    lens = Lens(model, [GradNorm()], optimizer=scaled)
    assert lens.optimizer is inner and lens.grad_scaler is scaler
    lens.close()
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, got str"):
        Lens(gradlens.extend(nn.Linear(3, 2)), [GradNorm()], optimizer="sgd")
