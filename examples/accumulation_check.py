"""The accumulation check: what the optimizer got, against what one batch of the window gives.

A nanoGPT-style loop: the loss is computed inside the model's forward, each micro-step
backpropagates ``loss / K``, and the micro-batches are unequal (3, 1 and 4 sequences: the end of
an epoch, a bucketed sampler). ``loss / K`` then weighs a sequence of the 1-sequence micro-batch
three times as much as one of the 3-sequence micro-batch; the record says by how much the
optimizer's gradient is off, and why, and a RuntimeWarning says so once. The fix the check names
(``loss * B_k / N``) brings it to round-off. Runs in a second on a CPU:
python examples/accumulation_check.py
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import AccumulationCheck, GradNorm


class TinyLM(nn.Module):
    def __init__(self, vocab=32, d=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)  # measured for the masks drawn in each forward
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied

    def forward(self, idx, targets=None):
        logits = self.head(self.drop(self.mlp(self.wte(idx))))
        loss = None
        if targets is not None:  # the loss inside the model: a plain lens.capture() sees it
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def train(weigh_by_samples: bool):
    torch.manual_seed(0)
    model = gradlens.extend(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt)
    g = torch.Generator().manual_seed(1)
    sizes = [3, 1, 4]  # one window: K = 3 unequal micro-batches, N = 8 sequences
    n, k = sum(sizes), len(sizes)
    for b in sizes:
        idx, targets = torch.randint(0, 32, (b, 8), generator=g), torch.randint(0, 32, (b, 8), generator=g)
        _, loss = model(idx, targets)
        with lens.capture():  # the 1/K (or B_k / N) is measured and divided out
            (loss * b / n if weigh_by_samples else loss / k).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clipping is told apart
    opt.step()
    return lens.records[-1]["accumulation_check"]


if __name__ == "__main__":
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the check's warning, said once: shown below
        check = train(weigh_by_samples=False)
    print(f"loss / K:        rel_error {check['rel_error']:.3f}, ratio {check['ratio']:.3f}")
    print(f"  cause: {check['cause']}")
    check = train(weigh_by_samples=True)
    print(f"loss * B_k / N:  rel_error {check['rel_error']:.1e}, cause {check['cause']}")
