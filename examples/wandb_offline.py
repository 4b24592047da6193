"""gradlens records to Weights & Biases (offline: no account, no network; sync later with
`wandb sync wandb/offline-run-*`).

    pip install wandb; WANDB_MODE=offline python examples/wandb_offline.py
"""

import os

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, NormTest
from gradlens.integrations.wandb import WandbSink

if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insts = [BatchL2(), GradNorm(), NormTest(), GradHist1d(bins=64, range=(-0.5, 0.5))]
    with Lens(model, insts, optimizer=opt, sinks=[WandbSink(project="gradlens-example")]) as lens:
        for step in range(30):
            for _ in range(3):  # 3 micro-batches per update
                x = torch.randn(32, 20)
                y = x[:, :4].argmax(1)
                loss = loss_fn(model(x), y)
                with lens.capture():
                    loss.backward()
            opt.step()
            opt.zero_grad()
    print(f"{len(lens.records)} records written to the W&B run (see ./wandb/)")
