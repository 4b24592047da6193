"""Long runs (issue 12): no leak, logs that survive a restart, a Lens that resumes."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    Alpha,
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    MeanGSNR,
    NoiseScale,
    NormTest,
    OrthoTest,
    SumGradSquared,
)


def all_instruments():
    return [
        BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=8), GradHist2d(bins=(4, 4)),
        NormTest(), MeanGSNR(), NoiseScale(), BatchDot(), Alpha(), InnerTest(), OrthoTest(),
    ]


def test_no_graph_or_layer_tensor_outlives_its_micro_step():
    """A few hundred tracked micro-steps (extended loss, functional loss, GradScaler, every
    instrument, keep_records=False): the input, every layer output and the loss of a finished
    micro-step are freed (weak references die), also through lens.close()."""
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    lens = Lens(model, all_instruments(), optimizer=opt, keep_records=False)
    refs = []
    for i in range(300):
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        hidden = model[0](x)
        out = model[2](model[1](hidden))
        functional = i % 3 == 2
        loss = nn.functional.mse_loss(out, torch.zeros_like(out)) if functional else loss_fn(out, y)
        losses = nn.functional.cross_entropy(out.detach(), y, reduction="none")
        with lens.capture(reduction="mean" if functional else None, losses=losses):
            scaler.scale(loss).backward()
        if i % 2 == 1:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        refs += [weakref.ref(t) for t in (x, hidden, out, loss)]
        del x, y, hidden, out, loss, losses
    gc.collect()
    alive = sum(r() is not None for r in refs[:-8])
    assert alive == 0, f"{alive} tensors of finished micro-steps are still alive"
    lens.close()
    gc.collect()
    assert sum(r() is not None for r in refs) <= 4  # at most the last loss call's tensors
