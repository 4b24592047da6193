"""gradlens with a Hugging Face Trainer and gradient accumulation (CPU, generated tokens).

The model computes its own token-mean cross-entropy, as Hugging Face models do.

    pip install -e ".[integrations]"; python examples/hf_trainer_accumulate.py
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Trainer, TrainingArguments

from gradlens.instruments import BatchL2, GradHist1d, GradNorm, NoiseScale
from gradlens.integrations.transformers import LensTrainerCallback


class TinyLM(nn.Module):
    def __init__(self, vocab=50, dim=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.hidden(self.emb(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


if __name__ == "__main__":
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (384, 16))
    data = [{"input_ids": i, "labels": (i * 7 + 3) % 50} for i in ids]
    args = TrainingArguments(output_dir="hf-gradlens", per_device_train_batch_size=16,
                             gradient_accumulation_steps=3, num_train_epochs=2, learning_rate=3e-3,
                             logging_steps=2, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=TinyLM(), args=args, train_dataset=data)
    lens_cb = LensTrainerCallback(trainer, [BatchL2(), GradNorm(), NoiseScale(),
                                            GradHist1d(bins=64, range=(-0.5, 0.5))])
    trainer.train()
    for e in trainer.state.log_history[:: max(1, len(trainer.state.log_history) // 6)]:
        if "gradlens/grad_norm" in e:
            print(f"step {e['step']:3d}: |G|={e['gradlens/grad_norm']:.3f} noise_scale={e['gradlens/noise_scale']:.1f}")
