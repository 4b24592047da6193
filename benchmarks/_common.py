"""Shared pieces of the benchmark scripts: the reference models and interleaved timing."""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn


def mlp() -> nn.Module:
    """784-512-512-10 ReLU MLP (input [B, 1, 28, 28])."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def cnn() -> nn.Module:
    """conv 3-32-64 3x3 + 2x2 max pools, linear 4096-10 (input [B, 3, 32, 32])."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )


def interleaved_ms(steps: dict, rounds: int, warmup: int = 3) -> dict:
    """Median ms per call of each step function, timed in interleaved rounds (one call of every
    configuration per round) so that drift and load from other processes hit all rows alike."""
    for st in steps.values():
        for _ in range(warmup):
            st()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, st in steps.items():
            t0 = time.perf_counter()
            st()
            times[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def has_cockpit() -> bool:
    """Whether cockpit-for-pytorch imports (``pip install -e .[bench]``)."""
    try:
        import cockpit  # noqa: F401
    except Exception:
        return False
    return True


def cockpit_step(what):
    """A builder ``(model, x, y) -> (step, close)`` of a training step with cockpit attached:
    ``what`` is ``"economy"`` or a list of cockpit quantity class names, tracked every step."""

    def build(model, x, y):
        import backpack
        from cockpit import Cockpit, quantities
        from cockpit.utils.configuration import configuration
        from cockpit.utils.schedules import linear

        model = backpack.extend(model)
        loss_fn = backpack.extend(nn.CrossEntropyLoss())
        loss_none = nn.CrossEntropyLoss(reduction="none")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if what == "economy":
            qs = configuration("economy", track_schedule=linear(1))
        else:
            qs = [getattr(quantities, name)(track_schedule=linear(1)) for name in what]
        cp = Cockpit(model.parameters(), quantities=qs)
        state = {"i": 0}

        def step():
            out = model(x)
            loss = loss_fn(out, y)
            info = {"batch_size": len(x), "individual_losses": loss_none(out, y), "loss": loss, "optimizer": opt}
            with cp(state["i"], info=info):
                loss.backward(create_graph=cp.create_graph(state["i"]))
            opt.step()
            opt.zero_grad()
            state["i"] += 1

        return step, lambda: None

    return build
