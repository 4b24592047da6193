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
from windows import micro_batches, run_windows

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


def _flat_rows(model, ids, labels, n, t_first=False):
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
            g = torch.autograd.grad(_flat_rows(model, i_k, l_k, n, t_first), params)
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
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE, reduction=reduction))
    if shift:
        flattened = lambda logits, lab: loss_fn(logits[:, :-1].reshape(-1, V), lab[:, 1:].reshape(-1))  # noqa: E731
    else:
        flattened = lambda logits, lab: loss_fn(logits.view(-1, V), lab.view(-1))  # noqa: E731
    (rec,) = run_windows(model, [micro_batches(ids, labels, SPLIT)], [BatchL2(), GradNorm(), SumGradSquared()],
                         loss=flattened, close=False).flushed
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


# ---------------------------------------------------------------- the sample axis, followed


class SeqFirstLSTM(nn.Module):
    """PyTorch's word_language_model layout: ids [T, B] -> Embedding -> LSTM(batch_first=False)
    -> Linear decoder -> logits [T, B, V]."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Embedding(V, D)
        self.rnn = nn.LSTM(D, 5, num_layers=1)
        self.decoder = nn.Linear(5, V)

    def forward(self, ids):
        out, _ = self.rnn(self.encoder(ids))
        return self.decoder(out)


def _seq_first_oracle(model, split, ids, labels, reduction):
    """Per-sample float64 loop: sample n is column n of [T, B] ids, run on its own ([T, 1])."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows, start = [], 0
    for b in split:
        lab = labels[:, start:start + b]
        m_k = int((lab != IGNORE).sum())
        for n in range(start, start + b):
            out = model(ids[:, n:n + 1])
            loss = F.cross_entropy(out.reshape(-1, V), labels[:, n], ignore_index=IGNORE, reduction="sum")
            g = torch.autograd.grad(loss, params)
            scale = b / m_k if reduction == "mean" else 1.0
            rows.append(torch.cat([scale * v.reshape(-1) for v in g]))
        start += b
    return torch.stack(rows)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("t", [8, 5], ids=["T==B", "T!=B"])
def test_lstm_language_model_on_seq_first_input_declared_once(t, reduction):
    """gradlens.extend(model, batch_dim=1): [T, B] ids, exact with T == B and T != B; the loss
    is stated (capture(reduction=..., loss=loss)) since its rows lead with T."""
    torch.manual_seed(0)
    model = SeqFirstLSTM().double()
    ids, labels = _data(sum(SPLIT), t, t_first=True)
    oracle_model = copy.deepcopy(model)
    m = gradlens.extend(model, batch_dim=1)
    window = list(zip(ids.split(SPLIT, dim=1), labels.split(SPLIT, dim=1)))  # [T, b] micro-batches
    (rec,) = run_windows(m, [window], [BatchL2(), GradNorm(), SumGradSquared()], fresh_copy=False, close=False,
                         loss=lambda out, lab: F.cross_entropy(out.reshape(-1, V), lab.reshape(-1),
                                                               ignore_index=IGNORE, reduction=reduction),
                         capture={"reduction": reduction}, pass_loss=True).flushed
    G = _seq_first_oracle(oracle_model, SPLIT, ids, labels, reduction)
    _check(rec, G, reduction)
    sizes = [p.numel() for p in oracle_model.parameters()]
    for (name, _), block in zip(oracle_model.named_parameters(), G.split(sizes, dim=1)):
        torch.testing.assert_close(rec["sum_grad_squared"][name].reshape(-1), block.square().sum(0),
                                   rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("t", [8, 5], ids=["T==B", "T!=B"])
def test_lstm_language_model_undeclared_is_one_error_naming_the_fix(t):
    """Without batch_dim the model's input is read samples-first; the LSTM says
    batch_first=False: the disagreement is one error naming the LSTM and the fix, never a
    number (with T == B sizes cannot tell)."""
    torch.manual_seed(0)
    m = gradlens.extend(SeqFirstLSTM().double())
    ids, labels = _data(8, t, t_first=True)
    lens = Lens(m, [BatchL2()])
    out = m(ids)
    loss = F.cross_entropy(out.reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE)
    with pytest.raises(RuntimeError, match=r"cannot tell the sample axis at [23] place\(s\) of the forward "
                       r"\(micro-batch of \d\): 'rnn' \(LSTM, batch_first=False\) takes its samples on dim 1 of its "
                       r"input \(\d, 8, 6\), but the model's input put them on dim 0; .*the input of 'decoder' "
                       r"\(Linear.*gradlens.extend\(model, batch_dim=1\)"):
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()


class TimeMajorInside(nn.Module):
    """A block that works on a [T, B, d] view of its [B, T, d] input (no batch_first said)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.proj = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, ids):
        h = self.emb(ids).transpose(0, 1)  # [T, B, d]
        h = torch.tanh(self.proj(h))  # a Linear on the time-major view
        h = h + torch.roll(h, 1, dims=0)  # mixes positions of a sample, not samples
        return self.head(h.permute(1, 0, 2))  # back to [B, T, V]


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_time_major_view_inside_an_undeclared_module_with_b_equal_t(reduction):
    torch.manual_seed(0)
    model = TimeMajorInside().double()
    split = [4, 4]  # B == T == 4 in every micro-step
    ids, labels = _data(8, 4)
    oracle_model = copy.deepcopy(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE, reduction=reduction))
    (rec,) = run_windows(model, [micro_batches(ids, labels, split)], [BatchL2(), GradNorm()], close=False,
                         loss=lambda logits, lab: loss_fn(logits.view(-1, V), lab.view(-1))).flushed
    _check(rec, _oracle(oracle_model, split, ids, labels, reduction), reduction)


class WindowBlock(nn.Module):
    """Swin-like window attention in torch.nn: [B, H, W, C] -> windows [B * nW, w * w, C]
    (samples the leading factor), qkv Linear, a learned relative bias added to the scores, proj
    Linear, windows reversed, LayerNorm, mean-pooled head."""

    def __init__(self, c=4, w=2, heads=2, classes=3):
        super().__init__()
        self.w, self.heads = w, heads
        self.norm1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.bias_table = nn.Parameter(torch.randn(heads, w * w, w * w) * 0.1)
        self.proj = nn.Linear(c, c)
        self.norm2 = nn.LayerNorm(c)
        self.head = nn.Linear(c, classes)

    def forward(self, x):  # x [B, H, W, C]
        b, hh, ww, c = x.shape
        w = self.w
        h = self.norm1(x)
        win = h.view(b, hh // w, w, ww // w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, w * w, c)
        q, k, v = self.qkv(win).reshape(win.shape[0], w * w, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / (c // self.heads) ** 0.5
        scores = scores + self.bias_table.unsqueeze(0)
        att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(win.shape[0], w * w, c)
        out = self.proj(att)
        out = out.view(b, hh // w, ww // w, w, w, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hh, ww, c)
        h = self.norm2(x + out)
        return self.head(h.mean((1, 2)))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_window_partition_block_keeps_the_samples_as_the_leading_factor(reduction):
    torch.manual_seed(0)
    model = WindowBlock().double()
    split = [3, 1, 4]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(split), 4, 4, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (sum(split),), generator=g)
    oracle_model = copy.deepcopy(model)
    params = list(oracle_model.parameters())
    rows = []
    for i in range(sum(split)):
        gi = torch.autograd.grad(F.cross_entropy(oracle_model(x[i:i + 1]), y[i:i + 1]), params)
        rows.append(torch.cat([v.reshape(-1) for v in gi]))
    G = torch.stack(rows)  # the loss of one sample: g_n in either reduction's units
    (rec,) = run_windows(model, [micro_batches(x, y, split)], [BatchL2(), GradNorm(), SumGradSquared()],
                         reduction=reduction, close=False).flushed
    assert rec.meta["coverage"] == 1.0
    _check(rec, G, reduction)
    sizes = [p.numel() for p in params]
    for (name, _), block in zip(oracle_model.named_parameters(), G.split(sizes, dim=1)):
        torch.testing.assert_close(rec["sum_grad_squared"][name].reshape(-1), block.square().sum(0),
                                   rtol=1e-10, atol=1e-14)


def test_flattened_lm_loss_under_light_capture():
    """GradNorm alone (parameter hooks only, no layer looked at): the flattened loss covers
    the B samples there too, so the window gradient is in the right units."""
    torch.manual_seed(0)
    model = TinyLM().double()
    ids, labels = _data(sum(SPLIT), 5)
    oracle_model = copy.deepcopy(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(ignore_index=IGNORE))
    (rec,) = run_windows(model, [micro_batches(ids, labels, SPLIT)], [GradNorm()], close=False,
                         loss=lambda logits, lab: loss_fn(logits.view(-1, V), lab.view(-1))).flushed
    G = _oracle(oracle_model, SPLIT, ids, labels, "mean")
    assert rec.num_samples == sum(SPLIT)
    assert rec["grad_norm"] == pytest.approx(float(G.mean(0).norm()), rel=1e-10)


class LinearNorm(nn.Module):
    """LeViT's LinearNorm (timm levit.py): Linear, then an eval-mode BatchNorm1d over the
    ``[B * N, C]`` flattening of ``[B, N, C]`` (``flip``: its rows reversed before the norm and
    back after, so they reach it as rows of known samples rather than a leading factor)."""

    def __init__(self, flip: bool, c=4, classes=3):
        super().__init__()
        self.flip = flip
        self.lin = nn.Linear(c, c, bias=False)
        self.bn = nn.BatchNorm1d(c)
        self.head = nn.Linear(c, classes)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-1, 1)
            self.bn.running_var.uniform_(0.5, 2)
            self.bn.weight.uniform_(0.5, 1.5)
            self.bn.bias.uniform_(-0.5, 0.5)

    def forward(self, x):  # [B, N, C]
        h = self.lin(x)
        flat = h.flatten(0, 1)
        out = self.bn(flat.flip(0)).flip(0) if self.flip else self.bn(flat)
        return self.head(torch.tanh(out.reshape_as(h)).mean(1))


@pytest.mark.parametrize("flip", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eval_batchnorm_over_a_flattening_led_by_the_samples_is_measured(reduction, flip):
    """Issue 43: BatchNorm1d (eval) on [B * N, C] rows, the samples the leading factor (or rows
    of known samples): every parameter tracked, batch_l2 / grad_norm / sum_grad_squared == the
    float64 per-sample loop, micro-batches 2, 3, 1 (2, 3, 2 with ``flip``: rows of known samples
    reshaped back to [B, N, C] in a micro-batch of one sample lose their axis, also without a
    BatchNorm: a limit of the rows rule, not of this layer)."""
    torch.manual_seed(0)
    model = LinearNorm(flip).double().eval()
    split = [2, 3, 2] if flip else [2, 3, 1]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(sum(split), 5, 4, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (sum(split),), generator=g)
    oracle_model = copy.deepcopy(model)
    params = list(oracle_model.parameters())
    rows = []
    for i in range(sum(split)):
        gi = torch.autograd.grad(F.cross_entropy(oracle_model(x[i:i + 1]), y[i:i + 1]), params)
        rows.append(torch.cat([v.reshape(-1) for v in gi]))
    G = torch.stack(rows)
    (rec,) = run_windows(model, [micro_batches(x, y, split)], [BatchL2(), GradNorm(), SumGradSquared()],
                         reduction=reduction, close=False).flushed
    assert rec.meta["coverage"] == 1.0
    _check(rec, G, reduction)
    sizes = [p.numel() for p in params]
    for (name, _), block in zip(oracle_model.named_parameters(), G.split(sizes, dim=1)):
        torch.testing.assert_close(rec["sum_grad_squared"][name].reshape(-1), block.square().sum(0),
                                   rtol=1e-10, atol=1e-14)


class PositionEmbedded(nn.Module):
    """Token and position embeddings added (the position lookup made from a buffer only)."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.pos = nn.Embedding(5, 4)
        self.fc = nn.Linear(4, 2)
        self.register_buffer("positions", torch.arange(5)[None])

    def forward(self, x):
        return self.fc(self.tok(x) + self.pos(self.positions))


def test_an_excluded_layer_computed_from_no_data_is_a_constant_to_the_capture():
    """Leaving out the position embedding (``exclude=["pos"]``; or ``undefined="exclude"``
    leaving it out after a micro-step) makes its output a constant added to the batch, not data
    of an unknown sample axis: the rest stays exact against per-sample gradients."""
    torch.manual_seed(0)
    base = PositionEmbedded().double()
    model = gradlens.extend(copy.deepcopy(base))
    x = torch.randint(0, 10, (6, 5), generator=torch.Generator().manual_seed(2))
    lens = Lens(model, [BatchL2()], exclude=["pos"])
    s = 0
    for b in (2, 3, 1):
        loss = model(x[s:s + b]).square().sum()
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
        s += b
    rec = lens.flush()
    want = []
    for n in range(6):
        g = torch.autograd.grad(base(x[n:n + 1]).square().sum(), [base.tok.weight, base.fc.weight, base.fc.bias])
        want.append(sum(float(v.square().sum()) for v in g))
    torch.testing.assert_close(rec["batch_l2"], torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    lens.close()
