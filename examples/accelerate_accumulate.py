"""gradlens with Hugging Face Accelerate's gradient accumulation (CPU, generated data).

One record per real update: the prepared optimizer's step() does nothing on Accelerate's
non-sync micro-steps, so only sync steps close a window.

    pip install -e ".[integrations]"; python examples/accelerate_accumulate.py
"""

import torch
from accelerate import Accelerator
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, NoiseScale

if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(960, 20)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    accelerator = Accelerator(gradient_accumulation_steps=3, cpu=True)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lens = Lens(model, [BatchL2(), GradNorm(), NoiseScale(), GradHist1d(bins=64, range=(-1, 1))],
                optimizer=optimizer)
    for epoch in range(2):
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = loss_fn(model(xb), yb)
                with lens.capture():
                    accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    lens.close()
    for r in lens.records[:: max(1, len(lens.records) // 5)]:
        print(f"update {r.step:3d}: N={r.num_samples} K={r.micro_steps} loss={float(r['loss']):.3f} "
              f"|G|={float(r['grad_norm']):.3f} noise_scale={float(r['noise_scale']):.1f}")
