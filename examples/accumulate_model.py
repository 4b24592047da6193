"""Train a small classifier with GradientAccumulateModel on generated data (runs in seconds).

Each batch of 96 samples is split into 4 micro-batches (24 each): activation memory is that of
24 samples, the update is exactly that of one batch of 96. AccumBatchNorm updates its running
statistics once per batch, from all 96 samples; AGC clips the window gradient once.

    python examples/accumulate_model.py
"""

from __future__ import annotations

import torch
from torch import nn

from gradlens import GradientAccumulateModel, GradientAccumulateOptimizer, convert_accum_batchnorm
from gradlens.training.agc import adaptive_clip_grad_

ACCUM_STEPS = 4


def make_data(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Two Gaussian blobs in 20 dimensions, labels 0/1."""
    y = torch.randint(0, 2, (n,), generator=generator)
    x = torch.randn(n, 20, generator=generator) + (2 * y - 1).unsqueeze(1) * 0.5
    return x, y


def main() -> None:
    torch.set_num_threads(1)  # a model this small only pays for thread synchronisation
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 2))
    model = convert_accum_batchnorm(model, ACCUM_STEPS)  # running stats once per window
    optimizer = GradientAccumulateOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=1e-2),
        # the batch is accumulated by the model wrapper, so the optimizer updates every call;
        # it is used here for its once-per-window clip (AGC, classifier head excluded by name)
        accum_steps=1,
        clip=lambda _: adaptive_clip_grad_(model, clip_factor=0.05, exclude=("3.weight", "3.bias")),
    )
    trainer = GradientAccumulateModel(model, optimizer, nn.functional.cross_entropy, ACCUM_STEPS)

    for epoch in range(5):
        model.train()
        losses = [trainer.train_step(make_data(96, g)) for _ in range(20)]
        model.eval()
        x, y = make_data(1000, g)
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean()
        print(f"epoch {epoch}: train loss {torch.stack(losses).mean():.4f}  eval acc {accuracy:.3f}")


if __name__ == "__main__":
    main()
