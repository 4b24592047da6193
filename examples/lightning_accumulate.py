"""gradlens in a PyTorch Lightning run with gradient accumulation (CPU, generated data).

    pip install -e ".[integrations]"; python examples/lightning_accumulate.py
"""

import torch
import torch.nn.functional as F
from torch import nn

import lightning.pytorch as L

import gradlens
from gradlens.instruments import Alpha, BatchL2, GradHist1d, GradNorm, NormTest
from gradlens.integrations.lightning import LensCallback, report_losses


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
        self.loss_fn = gradlens.extend(nn.CrossEntropyLoss())

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        report_losses(self, F.cross_entropy(out.detach(), y, reduction="none"))  # for Alpha
        return self.loss_fn(out, y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


if __name__ == "__main__":
    torch.manual_seed(0)
    x = torch.randn(960, 20)
    y = (x[:, :4].argmax(1) + (x[:, 4] > 1).long()) % 4
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    lens_cb = LensCallback([BatchL2(), GradNorm(), NormTest(), GradHist1d(bins=64, range=(-1, 1)), Alpha()],
                           log="lightning-gradlens.jsonl")
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=3, callbacks=[lens_cb], accelerator="cpu",
                        logger=L.loggers.CSVLogger("lightning_logs"), enable_progress_bar=False)
    trainer.fit(Net(), loader)
    for r in lens_cb.records[:: max(1, len(lens_cb.records) // 5)]:
        print(f"update {r.step:3d}: N={r.num_samples} K={r.micro_steps} loss={float(r['loss']):.3f} "
              f"|G|={float(r['grad_norm']):.3f} norm_test={float(r['norm_test']):.2f} alpha={r['alpha']}")
