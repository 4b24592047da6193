"""The cost of tracked windows under torch.compile (issue 21): a small CNN, torch.compile with
the default (inductor) backend, Lens(..., every=2) with BatchL2 + GradNorm.

Run:  python benchmarks/bench_compile.py [--batch 32] [--windows 6]

Prints, in seconds of wall time: the first window of the compiled model (compilation included),
an untracked compiled window, the first tracked window (eager: gradlens sets the compiler stance
"force_eager" while a tracked window's hooks are installed), a later tracked window, and the same
eager model's plain and tracked windows; plus the graph breaks counted by dynamo.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def windows(compiled: bool, batch: int, n: int) -> list[float]:
    model = gradlens.extend(cnn())
    run = torch.compile(model) if compiled else model
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lens = Lens(run, [BatchL2(), GradNorm()], optimizer=opt, every=lambda w: w % 2 == 1)
        for _ in range(n):
            t0 = time.perf_counter()
            loss = loss_fn(run(x), y)
            with lens.capture():
                loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        lens.close()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--windows", type=int, default=6)
    a = p.parse_args()
    from torch._dynamo.utils import counters

    eager = windows(False, a.batch, a.windows)
    torch._dynamo.reset()
    comp = windows(True, a.batch, a.windows)
    breaks = sum(counters["graph_break"].values())
    # windows 0, 2, 4 untracked; 1, 3, 5 tracked (schedule_offset=1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}")
    print(f"compiled: first window (compiles) {comp[0]:.2f} s, untracked {min(comp[2::2]):.3f} s, "
          f"first tracked {comp[1]:.3f} s, later tracked {min(comp[3::2]):.3f} s; graph breaks {breaks}")
    print(f"eager:    plain {min(eager[0::2]):.3f} s, tracked {min(eager[1::2]):.3f} s")


if __name__ == "__main__":
    main()
