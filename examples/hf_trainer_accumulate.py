"""gradlens with a Hugging Face Trainer and gradient accumulation (CPU, generated tokens).

The model computes its own loss as Hugging Face models do: given ``num_items_in_batch`` (the
Trainer's count of the window's label tokens), the summed token losses over that count, so the
Trainer optimises the token mean over the whole window; gradlens' records describe that
objective (docs/integrations.md). Labels of -100 are ignored: sequences carry different numbers
of label tokens.

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

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        logits = self.head(torch.tanh(self.hidden(self.emb(input_ids))))
        out = {"logits": logits}
        if labels is not None:
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                 reduction="sum" if num_items_in_batch is not None else "mean")
            out["loss"] = ce / num_items_in_batch if num_items_in_batch is not None else ce
        return out


if __name__ == "__main__":
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (384, 16))
    keep = torch.randint(4, 17, (len(ids),))  # label tokens per sequence
    labels = ((ids * 7 + 3) % 50).masked_fill(torch.arange(16)[None, :] >= keep[:, None], -100)
    data = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]
    args = TrainingArguments(output_dir="hf-gradlens", per_device_train_batch_size=16,
                             gradient_accumulation_steps=3, num_train_epochs=2, learning_rate=3e-3,
                             logging_steps=2, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True)
    trainer = Trainer(model=TinyLM(), args=args, train_dataset=data)
    lens_cb = LensTrainerCallback(trainer, [BatchL2(), GradNorm(), NoiseScale(),
                                            GradHist1d(bins=64, range=(-0.5, 0.5))])
    trainer.train()
    own = {e["step"]: e for e in trainer.state.log_history if "grad_norm" in e}  # the Trainer's
    ours = [e for e in trainer.state.log_history if "gradlens/grad_norm" in e]
    for e in [e for e in ours if e["step"] in own][:: max(1, len(own) // 6)]:  # it logs every 2nd step
        print(f"step {e['step']:3d}: |G|={e['gradlens/grad_norm']:.3f} (the Trainer's: "
              f"{own[e['step']]['grad_norm']:.3f}) noise_scale={e['gradlens/noise_scale']:.1f}")
