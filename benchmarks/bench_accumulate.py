"""Step-time ratios of the training side: exact accumulation beside the loops people write.

Run:  python benchmarks/bench_accumulate.py [--steps 60] [--threads 2] [--device cpu]

One window = K micro-batches of B/K samples (forward, backward each), one SGD update and
zero_grad; the models and batch sizes of bench_instruments.py (MLP 784-512-512-10, B = 128;
CNN conv 3-32-64 + linear 4096-10, B = 64), K in {2, 4}. Rows, timed in interleaved rounds
(median), as ratios to the first one:

  plain torch: each micro-batch's mean loss weighted by B_k / B before backward (exact, but only
      because the window's total B is known in advance), autograd accumulates into p.grad;
  "divide the loss by K": the common recipe (exact here only because the micro-batches are equal);
  GradientAccumulateOptimizer: opt.step(num_samples=B_k) on every micro-batch (exact for any
      sizes and a partial last window, without knowing B in advance);
  + NoiseScaleMonitor: the same with the two-batch noise scale (micro-steps vs window).
"""

from __future__ import annotations

import argparse
import warnings

import torch
from torch import nn

from _common import cnn, device_sync, interleaved_ms, mlp

warnings.filterwarnings("ignore")


def _rows(model_fn, x, y, k: int) -> dict:
    from gradlens import GradientAccumulateOptimizer
    from gradlens.instruments import NoiseScaleMonitor

    parts = list(zip(x.chunk(k), y.chunk(k)))
    n = len(x)
    loss_fn = nn.CrossEntropyLoss()

    def torch_loop(factor):
        """Plain torch: each micro-batch's mean loss times ``factor(B_k)`` before backward."""
        torch.manual_seed(0)
        model = model_fn().to(x.device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            for xb, yb in parts:
                (loss_fn(model(xb), yb) * factor(len(xb))).backward()
            opt.step()
            opt.zero_grad()

        return step

    def wrapped(monitor: bool):
        torch.manual_seed(0)
        model = model_fn().to(x.device)
        opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), accum_steps=k)
        if monitor:
            NoiseScaleMonitor(opt)

        def step():
            for xb, yb in parts:
                loss_fn(model(xb), yb).backward()
                opt.step(num_samples=len(xb))
                opt.zero_grad()

        return step

    return {
        "weighted": torch_loop(lambda b: b / n),
        "divided": torch_loop(lambda b: 1.0 / k),
        "wrapper": wrapped(False),
        "monitor": wrapped(True),
        "weighted_again": torch_loop(lambda b: b / n),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = device_sync(device)
    torch.manual_seed(0)
    problems = {
        "MLP 784-512-512-10, B=128": (mlp, torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))),
        "CNN, B=64": (cnn, torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))),
    }
    print(f"torch {torch.__version__}, {args.threads} thread(s), device {device}; median of {args.steps} "
          "interleaved rounds; ratio to the plain-torch window (loss weighted by B_k / B)")
    print("| model | K | plain torch ms | divide loss by K | GradientAccumulateOptimizer | + NoiseScaleMonitor |")
    print("|---|---|---|---|---|---|")
    for name, (model_fn, x, y) in problems.items():
        x, y = x.to(device), y.to(device)
        for k in (2, 4):
            ms = interleaved_ms(_rows(model_fn, x, y, k), args.steps, warmup=5, sync=sync)
            base = 0.5 * (ms["weighted"] + ms["weighted_again"])
            print(f"| {name} | {k} | {base:.2f} | {ms['divided'] / base:.2f}x | {ms['wrapper'] / base:.2f}x "
                  f"| {ms['monitor'] / base:.2f}x |")


if __name__ == "__main__":
    main()
