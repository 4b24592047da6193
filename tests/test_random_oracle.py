"""Randomized oracle campaign (issue 12 acceptance): random models from every supported layer
(Linear, Conv1d/2d/3d with every padding mode, stride, dilation and groups, ConvTranspose with
output_padding, Embedding, eval BatchNorm), random losses (MSE / cross-entropy, mean / sum),
random micro-step splits and instruments, against the float64 oracle (torch.func vmap(grad) of
each sample's own loss on a copy of the model). A few dozen fixed seeds run by default; hundreds
with ``pytest -m slow``."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from gradlens.instruments import (
    BatchDot,
    BatchL2,
    GradHist1d,
    GradNorm,
    InnerTest,
    MeanGSNR,
    NoiseScale,
    NormTest,
    OrthoTest,
    SumGradSquared,
)
from windows import micro_batches, run_windows

DEFAULT_SEEDS = range(30)
SLOW_SEEDS = range(30, 330)


class _SeqNet(nn.Module):
    def __init__(self, rng: random.Random, out: int):
        super().__init__()
        d = rng.randint(2, 5)
        self.emb = nn.Embedding(9, d, padding_idx=rng.choice([None, 0]))
        self.proj = nn.Linear(d, rng.randint(2, 5))
        self.head = nn.Linear(self.proj.out_features, out)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.emb(tokens))).mean(1))


def _eval_bn(cls, c: int, gen: torch.Generator) -> nn.Module:
    bn = cls(c)
    with torch.no_grad():
        bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
        bn.running_var.uniform_(0.5, 2.0, generator=gen)
        bn.weight.uniform_(0.5, 1.5, generator=gen)
        bn.bias.uniform_(-0.2, 0.2, generator=gen)
    return bn.eval()


def _conv_layer(rng: random.Random, nd: int, cin: int, size: list[int]):
    """A random Conv{nd}d or ConvTranspose{nd}d and its output channels and spatial size."""
    groups = rng.choice([g for g in (1, 2) if cin % g == 0])
    cout = groups * rng.randint(1, 3)
    k = [rng.randint(1, 3) for _ in range(nd)]
    dil = [rng.randint(1, 2) for _ in range(nd)]
    if rng.random() < 0.3:  # transposed, with output_padding < max(stride, dilation)
        stride = [rng.randint(1, 3) for _ in range(nd)]
        pad = [rng.randint(0, (d * (kk - 1)) // 2) for d, kk in zip(dil, k)]
        outpad = [rng.randint(0, max(s, d) - 1) for s, d in zip(stride, dil)]
        cls = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)[nd - 1]
        layer = cls(cin, cout, k, stride=stride, padding=pad, output_padding=outpad,
                    groups=groups, dilation=dil, bias=rng.random() < 0.7)
        size = [(n - 1) * s - 2 * p + d * (kk - 1) + op + 1
                for n, s, p, d, kk, op in zip(size, stride, pad, dil, k, outpad)]
        return layer, cout, size
    mode = rng.choice(["int", "same", "valid"])
    stride = [1] * nd if mode == "same" else [rng.randint(1, 2) for _ in range(nd)]
    if mode == "int":
        padding = [rng.randint(0, 2) for _ in range(nd)]
    else:
        padding = mode
    cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[nd - 1]
    layer = cls(cin, cout, k, stride=stride, padding=padding, dilation=dil, groups=groups,
                bias=rng.random() < 0.7)
    pads = [0] * nd if mode == "valid" else (None if mode == "same" else padding)
    if pads is None:
        return layer, cout, list(size)
    size = [(n + 2 * p - d * (kk - 1) - 1) // s + 1
            for n, p, d, kk, s in zip(size, pads, dil, k, stride)]
    return layer, cout, size


def random_problem(seed: int):
    """(model float64 eval-safe, x [N, ...], targets, loss module kind, reduction, split)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n = rng.randint(4, 8)
    classes = rng.randint(2, 4)
    family = rng.choice(["mlp", "conv1d", "conv2d", "conv3d", "seq"])
    if family == "mlp":
        d_in = rng.randint(2, 6)
        layers, width = [], d_in
        for _ in range(rng.randint(1, 3)):
            nxt = rng.randint(2, 6)
            layers += [nn.Linear(width, nxt, bias=rng.random() < 0.8)]
            if rng.random() < 0.3:
                layers.append(_eval_bn(nn.BatchNorm1d, nxt, gen))
            layers.append(rng.choice([nn.ReLU(), nn.Tanh()]))
            width = nxt
        layers.append(nn.Linear(width, classes))
        model, x = nn.Sequential(*layers), torch.randn(n, d_in, generator=gen)
    elif family == "seq":
        model = _SeqNet(rng, classes)
        x = torch.randint(0, 9, (n, rng.randint(2, 5)), generator=gen)
    else:
        nd = int(family[4])
        size = [rng.randint(4, 6) for _ in range(nd)] if nd < 3 else [rng.randint(3, 4)] * 3
        cin = rng.randint(1, 4)
        x = torch.randn(n, cin, *size, generator=gen)
        layers, c = [], cin
        for _ in range(rng.randint(1, 2)):
            layer, c, size = _conv_layer(rng, nd, c, size)
            if min(size) < 1:
                break
            layers.append(layer)
            if rng.random() < 0.3:
                layers.append(_eval_bn((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[nd - 1], c, gen))
            layers.append(nn.Tanh())
        if not layers or min(size) < 1:
            return random_problem(seed + 10_000)
        with torch.no_grad():
            flat = nn.Sequential(*layers)(x[:1]).numel()
        model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(flat, classes))
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    loss_kind = rng.choice(["mse", "ce"])
    reduction = rng.choice(["mean", "sum"])
    if loss_kind == "ce":
        y = torch.randint(0, classes, (n,), generator=gen)
    else:
        y = torch.randn(n, classes, generator=gen, dtype=torch.float64)
    k = rng.randint(1, min(3, n))
    cuts = sorted(rng.sample(range(1, n), k - 1))
    split = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    return model, x, y, loss_kind, reduction, split


def _loss(kind: str, reduction: str) -> nn.Module:
    return nn.CrossEntropyLoss(reduction=reduction) if kind == "ce" else nn.MSELoss(reduction=reduction)


def oracle_grads(model, x, y, kind, reduction) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss_fn = _loss(kind, reduction)

    def one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def _check_hist(counts, values, lo, hi, bins):
    v = values.flatten()
    idx = torch.floor((v - lo) * bins / (hi - lo)).clamp(0, bins - 1).long()
    want = torch.bincount(idx, minlength=bins)
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    near = int(((v[:, None] - edges[None, :]).abs() < 1e-9).any(1).sum())  # rounding at an edge
    assert int((counts - want).abs().sum()) <= 2 * near, (counts, want)


def run_case(seed: int) -> None:
    model, x, y, kind, reduction, split = random_problem(seed)
    gs = oracle_grads(model, x, y, kind, reduction)
    G = torch.cat([g.flatten(1) for g in gs.values()], 1)  # [N, D]
    n = G.shape[0]
    r = float(G.abs().max()) * 0.6 + 1e-12
    rng = random.Random(seed)
    pool = [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=9, range=(-r, r)),
            NormTest(), NoiseScale(), MeanGSNR(), BatchDot()]
    instruments = [i for i in pool if rng.random() < 0.6] or [BatchL2()]
    (rec,) = run_windows(model, [micro_batches(x, y, split)], instruments, loss=_loss(kind, reduction)).flushed
    assert (rec.num_samples, rec.micro_steps) == (n, len(split))
    close = dict(rtol=1e-9, atol=1e-12)
    mean = G.mean(0)
    trace = ((G - mean) ** 2).sum() / (n - 1)
    for inst in instruments:
        key = inst.key
        if key == "batch_l2":
            torch.testing.assert_close(rec[key], G.square().sum(1), **close)
        elif key == "sum_grad_squared":
            for name, g in gs.items():
                torch.testing.assert_close(rec[key][name].double(), g.square().sum(0), **close)
        elif key == "grad_norm":
            want = G.mean(0).norm() if reduction == "mean" else G.sum(0).norm()
            assert rec[key] == pytest.approx(float(want), rel=1e-9, abs=1e-12)
        elif key == "grad_hist_1d":
            _check_hist(rec[key].counts, G, -r, r, 9)
        elif key == "noise_scale":
            assert rec[key] == pytest.approx(float(trace / mean.square().sum()), rel=1e-7, abs=1e-9)
        elif key == "norm_test":
            assert rec[key] == pytest.approx(float((trace / n).sqrt() / mean.norm()), rel=1e-7, abs=1e-9)
        elif key == "mean_gsnr":
            var = ((G - mean) ** 2).sum(0) / (n - 1)
            ok = var > 0
            assert rec[key] == pytest.approx(float((mean[ok] ** 2 / var[ok]).mean()), rel=1e-7)
        elif key == "batch_dot":
            torch.testing.assert_close(rec[key].double(), G @ G.T, **close)


@pytest.mark.parametrize("seed", DEFAULT_SEEDS)
def test_random_model_matches_the_oracle(seed):
    run_case(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_random_model_matches_the_oracle_slow(seed):
    run_case(seed)


# =============================================================================== issue 20, item 3
# Families where the uses differ between micro-steps: layers that some micro-batches skip,
# per-operation layers before and after a train-mode BatchNorm (undefined="exclude"), direct
# parameter uses that some micro-steps skip, convolutions of a transposed [B, L, C] input
# (L = 1 included), size-1 micro-batches. Oracle: each micro-batch forwarded together on a copy
# of the model (a train-mode BatchNorm uses its statistics) and, per sample, plain autograd of
# that sample's own loss; a parameter a micro-step does not reach gets zeros.

FAMILY_SEEDS = range(40)
FAMILY_SLOW_SEEDS = range(40, 440)


class _Branches(nn.Module):
    """An MLP whose middle block runs only for the micro-batches told so."""

    def __init__(self, rng: random.Random, d_in: int, out: int):
        super().__init__()
        w = rng.randint(2, 5)
        self.inp = nn.Linear(d_in, w)
        self.mid = nn.Linear(w, w, bias=rng.random() < 0.7)
        self.gate = nn.Parameter(torch.randn(w)) if rng.random() < 0.5 else None
        self.head = nn.Linear(w, out)

    def forward(self, x, branch=True):
        h = torch.tanh(self.inp(x))
        if branch:
            h = torch.tanh(self.mid(h))
            if self.gate is not None:
                h = h * self.gate
        return self.head(h)


class _Direct(nn.Module):
    """Elementwise uses of parameters: ``x * w1`` (skipped where ``first`` is False), then
    ``x * w2 + b``, then a Linear head."""

    def __init__(self, rng: random.Random, d_in: int, out: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(d_in))
        self.w2 = nn.Parameter(torch.randn(d_in))
        self.b = nn.Parameter(torch.randn(d_in)) if rng.random() < 0.5 else None
        self.head = nn.Linear(d_in, out)

    def forward(self, x, first=True):
        if first:
            x = torch.tanh(x * self.w1)
        h = x * self.w2
        if self.b is not None:
            h = h + self.b
        return self.head(torch.tanh(h))


class _AroundBN(nn.Module):
    """A per-operation prefix (circular / reflect conv, ``x * w``, a GRU, attention), a
    train-mode BatchNorm1d, a per-operation layer after it (``h * w``, a circular / reflect
    conv, or a Linear), a Linear head. ``[B, C, L]`` inside, L >= 2."""

    def __init__(self, rng: random.Random, c: int, length: int, out: int):
        super().__init__()
        self.pre_kind = rng.choice(["circular", "reflect", "mul", "gru", "attention"])
        h = rng.randint(2, 4)
        if self.pre_kind in ("circular", "reflect"):
            self.pre = nn.Conv1d(c, h, 3, padding=1, padding_mode=self.pre_kind)
        elif self.pre_kind == "mul":
            self.pre = nn.Linear(c, h)  # then x * w: two uses before the norm
            self.w = nn.Parameter(torch.randn(h, 1))
        elif self.pre_kind == "gru":
            self.pre = nn.GRU(c, h, batch_first=True)
        else:
            h = 2 * rng.randint(1, 2)
            self.proj = nn.Linear(c, h)
            self.pre = nn.MultiheadAttention(h, 2, batch_first=True)
        self.bn = nn.BatchNorm1d(h)
        self.post_kind = rng.choice(["mul", "circular", "reflect", "linear"])
        if self.post_kind == "mul":
            self.post = nn.Parameter(torch.randn(h, 1))
        elif self.post_kind == "linear":
            self.post = nn.Linear(h, h)
        else:
            self.post = nn.Conv1d(h, h, 3, padding=1, padding_mode=self.post_kind)
        self.head = nn.Linear(h * length, out)

    def forward(self, x):  # x [B, C, L]
        if self.pre_kind in ("circular", "reflect"):
            h = self.pre(x)
        elif self.pre_kind == "mul":
            h = self.pre(x.transpose(1, 2)).transpose(1, 2) * self.w
        elif self.pre_kind == "gru":
            h = self.pre(x.transpose(1, 2))[0].transpose(1, 2)
        else:
            s = self.proj(x.transpose(1, 2))
            h = self.pre(s, s, s, need_weights=False)[0].transpose(1, 2)
        h = torch.tanh(self.bn(h))
        if self.post_kind == "mul":
            h = h * self.post
        elif self.post_kind == "linear":
            h = self.post(h.transpose(1, 2)).transpose(1, 2)
        else:
            h = self.post(h)
        return self.head(torch.tanh(h).flatten(1))


class _TransposedConv(nn.Module):
    """A ``[B, L, C]`` sequence transposed for a Conv1d / ConvTranspose1d (L = 1 included)."""

    def __init__(self, rng: random.Random, c: int, length: int, out: int):
        super().__init__()
        cout = rng.randint(1, 3)
        if rng.random() < 0.5:
            k, d = rng.randint(1, 3), rng.randint(1, 2)
            self.conv = nn.Conv1d(c, cout, k, padding="same", dilation=d, bias=rng.random() < 0.7)
            lout = length
        else:
            k, s, d = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2)
            op = rng.randint(0, max(s, d) - 1)
            self.conv = nn.ConvTranspose1d(c, cout, k, stride=s, dilation=d, output_padding=op,
                                           bias=rng.random() < 0.7)
            lout = (length - 1) * s + d * (k - 1) + op + 1
        self.head = nn.Linear(cout * lout, out)

    def forward(self, x):  # x [B, L, C]
        return self.head(torch.tanh(self.conv(x.transpose(1, 2))).flatten(1))


def family_problem(seed: int):
    """(model float64, micro-batches [(x, y, forward kwargs)], loss kind, reduction, Lens kwargs)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    n = rng.randint(3, 8)
    classes = rng.randint(2, 4)
    family = ("branch", "direct", "around_bn", "transposed_conv")[seed % 4]
    k = rng.randint(2, min(4, n))
    if rng.random() < 0.5:  # size-1 micro-batches
        ones = rng.randint(1, k - 1)
        rest = n - ones
        sizes = [1] * ones + [rest // (k - ones) + (1 if i < rest % (k - ones) else 0) for i in range(k - ones)]
        rng.shuffle(sizes)
    else:
        cuts = sorted(rng.sample(range(1, n), k - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    lens_kw: dict = {}
    kws = [{} for _ in sizes]
    if family in ("branch", "direct"):
        d_in = rng.randint(2, 5)
        model = (_Branches if family == "branch" else _Direct)(rng, d_in, classes)
        x = torch.randn(n, d_in, generator=gen)
        key = "branch" if family == "branch" else "first"
        flags = [rng.random() < 0.5 for _ in sizes]
        if all(flags) or not any(flags):
            flags[rng.randrange(len(flags))] ^= True
        kws = [{key: f} for f in flags]
    elif family == "around_bn":
        c, length = rng.randint(1, 3), rng.randint(2, 4)
        model = _AroundBN(rng, c, length, classes).train()
        x = torch.randn(n, c, length, generator=gen)
        lens_kw = {"undefined": "exclude"}
    else:
        c, length = rng.randint(1, 3), rng.choice([1, 1, 2, 3])
        model = _TransposedConv(rng, c, length, classes)
        x = torch.randn(n, length, c, generator=gen)
    model = model.double()
    x = x.double()
    kind = rng.choice(["mse", "ce"])
    reduction = rng.choice(["mean", "sum"])
    if kind == "ce":
        y = torch.randint(0, classes, (n,), generator=gen)
    else:
        y = torch.randn(n, classes, generator=gen, dtype=torch.float64)
    batches = [(xb, yb, kw) for xb, yb, kw in zip(x.split(sizes), y.split(sizes), kws)]
    return model, batches, kind, reduction, lens_kw


def batch_oracle(model, batches, kind, reduction, names) -> dict[str, torch.Tensor]:
    """``{name: [N, *param]}``: per sample, the gradient of its own loss (``loss_fn`` of its row
    of the micro-batch's output) in the forward of its micro-batch; zeros where unused."""
    loss_fn = _loss(kind, reduction)
    rows: dict[str, list] = {q: [] for q in names}
    for xb, yb, kw in batches:
        ref = copy.deepcopy(model)
        ps = dict(ref.named_parameters())
        out = ref(xb, **kw)
        for i in range(len(xb)):
            gs = torch.autograd.grad(loss_fn(out[i : i + 1], yb[i : i + 1]), [ps[q] for q in names],
                                     retain_graph=True, allow_unused=True)
            for q, g in zip(names, gs):
                rows[q].append(torch.zeros_like(ps[q]) if g is None else g.detach())
    return {q: torch.stack(v) for q, v in rows.items()}


def run_family_case(seed: int) -> None:
    model, batches, kind, reduction, lens_kw = family_problem(seed)
    rng = random.Random(seed + 1)
    per_sample = rng.random() < 0.5
    pool = [BatchL2(), SumGradSquared(), GradNorm(), NormTest(per_sample=per_sample),
            NoiseScale(per_sample=per_sample), MeanGSNR(), BatchDot(), InnerTest(), OrthoTest()]
    instruments = [i for i in pool if rng.random() < 0.6] or [BatchDot()]
    run = run_windows(model, [batches], instruments, loss=_loss(kind, reduction), close=False, **lens_kw)
    (rec,), tracked = run.flushed, run.lens.tracked
    run.lens.close()
    n = sum(len(b[0]) for b in batches)
    assert (rec.num_samples, rec.micro_steps) == (n, len(batches))
    if lens_kw:  # what "exclude" keeps: the norm's own parameters and everything after it
        assert {q for q in tracked if q.startswith(("bn.", "post", "head."))} == set(tracked)
        assert {"bn.weight", "bn.bias", "head.weight"} <= set(tracked)
    else:
        assert sorted(tracked) == sorted(q for q, _ in model.named_parameters())
    gs = batch_oracle(model, batches, kind, reduction, tracked)
    G = torch.cat([g.flatten(1) for g in gs.values()], 1)  # [N, D]
    close = dict(rtol=1e-9, atol=1e-12)
    mean = G.mean(0)
    var = ((G - mean) ** 2).sum(0) / (n - 1)
    trace = var.sum()
    g2 = float(mean @ mean)
    for inst in instruments:
        key = inst.key
        if key == "batch_l2":
            torch.testing.assert_close(rec[key], G.square().sum(1), **close)
        elif key == "sum_grad_squared":
            assert sorted(rec[key]) == sorted(tracked)
            for name, g in gs.items():
                torch.testing.assert_close(rec[key][name].double(), g.square().sum(0), **close)
        elif key == "grad_norm":
            want = G.mean(0).norm() if reduction == "mean" else G.sum(0).norm()
            assert rec[key] == pytest.approx(float(want), rel=1e-9, abs=1e-12)
        elif key == "noise_scale":
            assert rec[key] == pytest.approx(float(trace) / g2, rel=1e-7, abs=1e-9)
        elif key == "norm_test":
            assert rec[key] == pytest.approx(float((trace / n).sqrt()) / g2 ** 0.5, rel=1e-7, abs=1e-9)
        elif key == "mean_gsnr":  # documented floor: variances below eps * the largest are 0
            ok = var > torch.finfo(torch.float64).eps * var.max()
            assert rec[key] == pytest.approx(float((mean[ok] ** 2 / var[ok]).mean()), rel=1e-7)
        elif key == "batch_dot":
            torch.testing.assert_close(rec[key].double(), G @ G.T, **close)
        elif key == "inner_test":
            p = G @ mean
            assert rec[key] == pytest.approx((float(p.var()) / n) ** 0.5 / g2, rel=1e-7)
        elif key == "ortho_test":  # V from the residuals themselves (no cancellation)
            resid = G - (G @ mean / g2)[:, None] * mean[None, :]
            v = float(resid.square().sum()) / (n - 1)
            # the record's one-pass V = (sum ||g_n||^2 - sum (g_n . G)^2 / ||G||^2) / (N - 1)
            # loses up to ~eps sum ||g_n||^2 to rounding: an absolute error of sqrt of that
            slack = (64 * torch.finfo(torch.float64).eps * float(G.square().sum()) / ((n - 1) * n * g2)) ** 0.5
            assert rec[key] == pytest.approx((v / (n * g2)) ** 0.5, rel=1e-7, abs=slack)


@pytest.mark.parametrize("seed", FAMILY_SEEDS)
def test_random_family_matches_the_oracle(seed):
    run_family_case(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", FAMILY_SLOW_SEEDS)
def test_random_family_matches_the_oracle_slow(seed):
    run_family_case(seed)
