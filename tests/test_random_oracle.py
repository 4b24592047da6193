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

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    BatchDot,
    BatchL2,
    GradHist1d,
    GradNorm,
    MeanGSNR,
    NoiseScale,
    NormTest,
    SumGradSquared,
)

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
    m = gradlens.extend(copy.deepcopy(model))
    loss_fn = gradlens.extend(_loss(kind, reduction))
    lens = Lens(m, instruments)
    for xb, yb in zip(x.split(split), y.split(split)):
        loss = loss_fn(m(xb), yb)
        with lens.capture():
            loss.backward()
    rec = lens.flush()
    lens.close()
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
