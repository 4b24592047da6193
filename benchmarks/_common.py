"""Shared pieces of the benchmark scripts: the reference models and interleaved timing."""

from __future__ import annotations

import statistics
import time

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
