"""Quickstart: per-sample gradient statistics of an accumulating training loop.

Four micro-batches of 32 make one update of N = 128 samples; every record reports exactly what
one batch of 128 would. Runs in a few seconds on a CPU: python examples/quickstart.py
"""

import torch

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, NoiseScale, SumGradSquared

torch.manual_seed(0)
K = 4  # micro-steps per optimizer update
data = torch.randn(16 * 32, 20)
labels = (data[:, :5].sum(1) > 0).long() + (data[:, 5:10].sum(1) > 0).long()
micro_batches = list(zip(data.split(32), labels.split(32)))

model = torch.nn.Sequential(
    torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3)
)
model = gradlens.extend(model)  # checks the model; hooks come only with tracked windows
loss_fn = gradlens.extend(torch.nn.CrossEntropyLoss())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
lens = Lens(
    model,
    [BatchL2(), SumGradSquared(), GradNorm(), NoiseScale(), GradHist1d(bins=64, range=(-1.0, 1.0))],
    optimizer=opt,
)

for i, (x, y) in enumerate(micro_batches):
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    if (i + 1) % K == 0:
        opt.step()  # the real update closes the window
        opt.zero_grad()

for record in lens.records:
    hist = record["grad_hist_1d"]
    print(
        f"update {record.step}: N={record.num_samples} K={record.micro_steps} "
        f"loss={record['loss']:.3f} |g|={record['grad_norm']:.4f} "
        f"noise scale={record['noise_scale']:.1f} "
        f"max ||g_n||^2={float(record['batch_l2'].max()):.3f} "
        f"clamped={hist.clamped_low + hist.clamped_high}/{hist.total}"
    )
lens.close()
