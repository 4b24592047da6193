"""Issue 21 (items 4 and 6): the usual LM loss on flattened [B*T, V] logits through an extended
loss, and the sample axis followed from the model's input (sequence-first LSTM language models,
[T, B, d] views inside undeclared modules with B == T, window partitions). Oracle: a float64
per-sample loop on a deep copy of the model taken before gradlens sees it, K unequal
micro-steps, reductions "mean" and "sum"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

V, D = 11, 6
IGNORE = -100


class TinyLM(nn.Module):
    """Embedding -> Linear/tanh -> Linear head; logits [B, T, V]."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mix = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        return self.head(torch.tanh(self.mix(self.emb(ids))))


def _flat_rows(model, params, ids, labels, n, reduction, t_first=False):
    """Sample n's summed token losses (ignored targets count for none)."""
    out = model(ids)
    logits = out[:, n] if t_first else out[n]
    lab = labels[:, n] if t_first else labels[n]
    return F.cross_entropy(logits.reshape(-1, V), lab.reshape(-1), ignore_index=IGNORE, reduction="sum")


def _oracle(model, split, ids, labels, reduction, t_first=False):
    """[N, D] float64 per-sample gradients in the units of docs/design.md: a mean objective of
    micro-step k (its token mean over M_k counted tokens) gives g_n = B_k / M_k * grad(sample
    n's summed token losses); a sum gives grad(sample n's summed token losses)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows, start = [], 0
    for b in split:
        sl = slice(start, start + b)
        i_k = ids[:, sl] if t_first else ids[sl]
        l_k = labels[:, sl] if t_first else labels[sl]
        m_k = int((l_k != IGNORE).sum())
        for n in range(b):
            g = torch.autograd.grad(_flat_rows(model, params, i_k, l_k, n, reduction, t_first), params)
            scale = b / m_k if reduction == "mean" else 1.0
            rows.append(torch.cat([scale * v.reshape(-1) for v in g]))
        start += b
    return torch.stack(rows)


def _data(n, t, t_first=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, t), generator=g)
    labels = torch.randint(0, V, (n, t), generator=g)
    labels[torch.rand(n, t, generator=g) < 0.3] = IGNORE  # unequal token counts per sample
    labels[0, :] = IGNORE  # a sample with no counted token: g_n = 0
    labels[1, 0] = 3
    if t_first:
        return ids.t().contiguous(), labels.t().contiguous()
    return ids, labels


def _check(rec, G, reduction="mean"):
    """batch_l2 [N] and the window gradient's norm (mean of g_n, or their sum)."""
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
    window = G.mean(0) if reduction == "mean" else G.sum(0)
    torch.testing.assert_close(torch.tensor(rec["grad_norm"], dtype=torch.float64), window.norm(),
                               rtol=1e-10, atol=1e-14)


SPLIT = [3, 1, 4]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shift", [False, True])
def test_flattened_lm_loss_through_an_extended_loss_is_exact(reduction, shift):
    """loss_fn(logits.view(-1, V), labels.view(-1)) on [B, T, V] logits, ignore_index included;
    with shift=True the usual next-token shift (logits[:, :-1].reshape(-1, V), a copy)."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, labels = _data(sum(SPLIT), 5)
    if shift:  # the shifted targets, as the oracle sees them: position t predicts labels[:, t+1]
        labels_used = labels[:, 1:]
    oracle_model = copy.deepcopy(model)
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE, reduction=reduction))
    lens = Lens(m, [BatchL2(), GradNorm(), SumGradSquared()])
    start = 0
    for b in SPLIT:
        logits = m(ids[start:start + b])
        lab = labels[start:start + b]
        if shift:
            loss = loss_fn(logits[:, :-1].reshape(-1, V), lab[:, 1:].reshape(-1))
        else:
            loss = loss_fn(logits.view(-1, V), lab.view(-1))
        with lens.capture():
            loss.backward()
        start += b
    rec = lens.flush()
    if shift:
        class Shifted(nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, x):
                return self.inner(x)[:, :-1]

        G = _oracle(Shifted(oracle_model), SPLIT, ids, labels_used, reduction)
    else:
        G = _oracle(oracle_model, SPLIT, ids, labels, reduction)
    assert rec.num_samples == sum(SPLIT)
    _check(rec, G, reduction)
    sgs = rec["sum_grad_squared"]
    names = [n for n, _ in oracle_model.named_parameters()]
    sizes = [p.numel() for p in oracle_model.parameters()]
    for name, block in zip(names, G.split(sizes, dim=1)):
        torch.testing.assert_close(sgs[name].reshape(-1), block.square().sum(0), rtol=1e-10, atol=1e-14)


def test_a_flattening_that_does_not_lead_with_the_samples_is_refused_with_the_fix():
    """[B, T, V] logits transposed to [T, B, V] and flattened: the rows' dim 0 is T, not the
    samples; the fix in the message (capture(reduction='mean', loss=loss)) works as written."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, labels = _data(4, 5)
    oracle_model = copy.deepcopy(model)
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE))
    lens = Lens(m, [BatchL2(), GradNorm()])
    loss = loss_fn(m(ids).transpose(0, 1).reshape(-1, V), labels.t().reshape(-1))
    with pytest.raises(RuntimeError, match=r"CrossEntropyLoss saw 20 rows, a flattening of \[5, 4\] whose dim 0 "
                       r"\(5\) is not the micro-batch of 4 .*with lens.capture\(reduction='mean', loss=loss\)"):
        with lens.capture():
            loss.backward()
    lens.close()
    lens = Lens(m, [BatchL2(), GradNorm()])
    loss = loss_fn(m(ids).transpose(0, 1).reshape(-1, V), labels.t().reshape(-1))
    with lens.capture(reduction="mean", loss=loss):
        loss.backward()
    _check(lens.flush(), _oracle(oracle_model, [4], ids, labels, "mean"))


def test_an_ambiguous_flattening_is_refused_not_guessed():
    """B == T and the flattened tensor is not the model's own output (a transpose between):
    refused, never a number."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, labels = _data(4, 4)
    m = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE))
    lens = Lens(m, [BatchL2()])
    loss = loss_fn(m(ids).transpose(0, 1).reshape(-1, V), labels.t().reshape(-1))
    with pytest.raises(RuntimeError, match=r"a flattening of \[4, 4\] and another of its dims has the "
                       r"micro-batch size 4 too.*reduction='mean', loss=loss"):
        with lens.capture():
            loss.backward()
    lens.close()
    # the model's own [B, T, V] output flattened with B == T is known to lead with the samples
    oracle_model = copy.deepcopy(model)
    lens = Lens(m, [BatchL2(), GradNorm()])
    loss = loss_fn(m(ids).view(-1, V), labels.view(-1))
    with lens.capture():
        loss.backward()
    _check(lens.flush(), _oracle(oracle_model, [4], ids, labels, "mean"))
