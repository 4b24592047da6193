"""Issue 20, numerical rows: each against the float64 per-sample oracle (torch.func vmap(grad)
of each sample's own loss on a copy of the model), K micro-steps of unequal sizes, both
reductions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    BatchDot,
    InnerTest,
    MeanGSNR,
    NoiseScale,
    NormTest,
    OrthoTest,
    SumGradSquared,
)

from windows import run_windows

SPLITS = [[3, 1, 4], [1, 7], [8]]


def _oracle(model, micro_batches, reduction, loop=False):
    """``{name: [N, *param]}`` float64 per-sample gradients; ``micro_batches``: (x, y, kwargs)
    per micro-step (kwargs passed to the forward, e.g. which branch runs). ``loop``: a loop of
    plain autograd over the samples instead of vmap(grad) (for layers vmap cannot go through)."""
    model = copy.deepcopy(model)
    params = {k: v.detach() for k, v in model.named_parameters()}
    rows: dict[str, list] = {k: [] for k in params}
    if loop:
        names, ps = zip(*model.named_parameters())
        for xb, yb, kw in micro_batches:
            for i in range(len(xb)):
                loss = F.cross_entropy(model(xb[i : i + 1], **kw), yb[i : i + 1], reduction=reduction)
                for k, g in zip(names, torch.autograd.grad(loss, ps, allow_unused=True)):
                    rows[k].append(torch.zeros_like(params[k])[None] if g is None else g[None])
        return {k: torch.cat(v) for k, v in rows.items()}
    for xb, yb, kw in micro_batches:
        def one(p, xi, yi):
            out = functional_call(model, p, (xi.unsqueeze(0),), kw)
            return F.cross_entropy(out, yi.unsqueeze(0), reduction=reduction)

        gs = vmap(grad(one), in_dims=(None, 0, 0))(params, xb, yb)
        for k, g in gs.items():
            rows[k].append(g)
    return {k: torch.cat(v) for k, v in rows.items()}


def _flat(gs):
    return torch.cat([g.flatten(1) for g in gs.values()], 1)


def _run(model, micro_batches, reduction, instruments, **lens_kw):
    """One window of ``micro_batches`` (x, y, forward kwargs); returns (record, lens.tracked)."""
    run = run_windows(model, [micro_batches], instruments, reduction=reduction, close=False, **lens_kw)
    tracked = run.lens.tracked
    run.lens.close()
    return run.flushed[0], tracked


class Branchy(nn.Module):
    """``b`` runs only when the forward is told so (a branch some micro-batches take)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x, branch=False):
        h = torch.tanh(self.a(x))
        if branch:
            h = torch.tanh(self.b(h))
        return self.head(h)


def _branch_batches(split, flags, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(split)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    return [(xb, yb, {"branch": f}) for xb, yb, f in zip(x.split(split), y.split(split), flags)]


# ------------------------------------------------------------------ row 1: skipped layers
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split,flags", [([3, 1, 4], [True, False, True]), ([1, 7], [True, False]),
                                         ([2, 5, 1], [False, False, True])])
def test_skipped_layer_counts_its_zeros_in_gsnr_norm_test_and_noise_scale(reduction, split, flags):
    """The samples of micro-steps that skip ``b`` have g_n = 0 there: one N for the window.
    Was: MeanGSNR over the samples that ran ``b`` only; NormTest / NoiseScale(per_sample) with
    N from one parameter's count (NaN when ``b`` ran for one sample)."""
    torch.manual_seed(0)
    model = Branchy().double()
    batches = _branch_batches(split, flags)
    G = _flat(_oracle(model, batches, reduction))
    n = G.shape[0]
    mean = G.mean(0)
    var = ((G - mean) ** 2).sum(0) / (n - 1)
    ok = var > 1e-300
    trace = var.sum()
    for per_sample in (True, False):
        insts = [MeanGSNR(), NormTest(per_sample=per_sample), NoiseScale(per_sample=per_sample)]
        rec, _ = _run(model, batches, reduction, insts)
        assert rec.num_samples == n
        assert rec["mean_gsnr"] == pytest.approx(float((mean[ok] ** 2 / var[ok]).mean()), rel=1e-9)
        assert rec["noise_scale"] == pytest.approx(float(trace / mean.square().sum()), rel=1e-9)
        assert rec["norm_test"] == pytest.approx(float((trace / n).sqrt() / mean.norm()), rel=1e-9)


# ------------------------------------------------------------------ row 5: Alpha's fit
def _alpha_rational(t, fs, dfs, var_fs, var_dfs):
    """alpha of the weighted least-squares quadratic in exact rational arithmetic (normal
    equations solved by fraction-exact elimination; zero variances -> 1e-10 as documented)."""
    from fractions import Fraction as Fr

    t = Fr(t)
    rows = [[Fr(1), Fr(0), Fr(0)], [Fr(1), t, t * t], [Fr(0), Fr(1), Fr(0)], [Fr(0), Fr(1), 2 * t]]
    y = [Fr(v) for v in (*fs, *dfs)]
    w = [1 / (Fr(v) if v != 0 else Fr(1e-10)) for v in (*var_fs, *var_dfs)]
    m = [[sum(w[k] * rows[k][i] * rows[k][j] for k in range(4)) for j in range(3)]
         + [sum(w[k] * rows[k][i] * y[k] for k in range(4))] for i in range(3)]
    for i in range(3):
        for j in range(i + 1, 3):
            f = m[j][i] / m[i][i]
            m[j] = [a - f * c for a, c in zip(m[j], m[i])]
    mu = [Fr(0)] * 3
    for i in reversed(range(3)):
        mu[i] = (m[i][3] - sum(m[i][j] * mu[j] for j in range(i + 1, 3))) / m[i][i]
    return float(2 * t * mu[2] / (-mu[1]) - 1)


@pytest.mark.parametrize("args,rtol", [
    # short step, losses known exactly (variance floor 1e-10), noisy slopes: weights 1e12 apart
    ((1e-3, (1.0, 0.9999995), (-1e-3, 1e-3), (0.0, 0.0), (1e2, 1e2)), 1e-8),
    ((1e-2, (2.0, 1.99), (-1.0, 0.5), (1e-8, 1e-8), (1e3, 1e-6)), 1e-13),
    ((1e-3, (0.3, 0.2997), (-0.5, 0.1), (0.01, 0.01), (0.02, 0.03)), 1e-13),
])
def test_alpha_fit_matches_the_rational_reference_on_ill_conditioned_fits(args, rtol):
    """The fit is a QR solve of the weighted system (was: normal equations, 1.4e-5 relative
    error on the first case, whose normal matrix has condition number ~1e27)."""
    from gradlens.instruments.alpha import alpha_fit

    alpha, note = alpha_fit(*args)
    assert note == ""
    assert alpha == pytest.approx(_alpha_rational(*args), rel=rtol)


def test_alpha_fit_of_a_zero_step_is_singular():
    from gradlens.instruments.alpha import alpha_fit

    assert alpha_fit(0.0, (1.0, 1.0), (0.5, 0.5), (1.0, 1.0), (1.0, 1.0)) == (None, "singular quadratic fit")


# ------------------------------------------------------------------ row 3: unreached parameter
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("flags", [[False, False, False], [False, True, False]])
def test_sum_grad_squared_has_an_entry_for_every_tracked_parameter(reduction, flags):
    """``b`` is tracked; a window where no (or one) micro-step runs it: its entry is the
    oracle's sum_n g_n^2 (zeros when unreached; was: no entry at all)."""
    torch.manual_seed(1)
    model = Branchy().double()
    batches = _branch_batches([3, 1, 4], flags, seed=1)
    gs = _oracle(model, batches, reduction)
    rec, tracked = _run(model, batches, reduction, [SumGradSquared()])
    assert sorted(rec["sum_grad_squared"]) == sorted(tracked) == sorted(gs)
    for name, g in gs.items():
        got = rec["sum_grad_squared"][name]
        assert got.shape == g.shape[1:] and got.dtype == torch.float64
        torch.testing.assert_close(got, g.square().sum(0), rtol=1e-12, atol=0)
    if not any(flags):
        assert torch.equal(rec["sum_grad_squared"]["b.weight"], torch.zeros(5, 5, dtype=torch.float64))


# ------------------------------------------------------------------ row 4: length-1 convs
class TransposedSeqConv(nn.Module):
    """``[B, 1, C]`` (a length-1 sequence, channels last) transposed for a conv: the conv's
    input has non-row-major strides on its length-1 axis."""

    def __init__(self, conv: nn.Module, length: int):
        super().__init__()
        self.conv = conv
        self.head = nn.Linear(conv.out_channels * length, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x.transpose(1, 2))).flatten(1))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("make,length", [
    (lambda: nn.Conv1d(4, 3, 3, padding="same"), 1),
    (lambda: nn.Conv1d(4, 3, 3, padding="same", bias=False), 1),
    (lambda: nn.ConvTranspose1d(4, 3, 2, stride=3, output_padding=1), 3),
    (lambda: nn.ConvTranspose1d(4, 3, 3, stride=2, dilation=2, output_padding=1), 6),
])
def test_length_one_transposed_input_to_a_conv_is_exact(make, length, reduction):
    """Was: "slow_conv2d: grad_weight must be contiguous" from the per-sample conv path."""
    torch.manual_seed(2)
    model = TransposedSeqConv(make(), length).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 1, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    batches = [(xb, yb, {}) for xb, yb in zip(x.split([3, 1, 4]), y.split([3, 1, 4]))]
    gs = _oracle(model, batches, reduction, loop=True)  # vmap(grad) itself refuses these strides
    G = _flat(gs)
    from gradlens.instruments import BatchL2

    rec, _ = _run(model, batches, reduction, [BatchL2(), SumGradSquared(), BatchDot(), MeanGSNR()])
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(rec["batch_dot"].double(), G @ G.T, rtol=1e-10, atol=1e-14)
    for name, gn in gs.items():
        torch.testing.assert_close(rec["sum_grad_squared"][name].double(), gn.square().sum(0), rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------ row 2: pairing of uses
class PrefixNet(nn.Module):
    """A circular-padded conv (a per-operation use) before a train-mode BatchNorm, ``h * scale``
    (another per-operation use) after it: with ``undefined="exclude"`` the conv is dropped at
    the first micro-step, so the later micro-steps count one operation fewer before ``scale``."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular")
        self.bn = nn.BatchNorm1d(3)
        self.scale = nn.Parameter(torch.randn(3, 1))
        self.head = nn.Linear(3 * 5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.conv(x)) * self.scale).flatten(1))


class DirectNet(nn.Module):
    """Directly used parameters: ``x * w1`` only when ``first`` (some micro-steps skip it)
    before ``x * w2``; ``twice`` uses ``w2`` a second time (one use in a micro-step, two in
    another, summed) and the Linear ``mix`` a second time (a module's factors in one micro-step,
    the summed uses' in another: a differently shaped measurement of the same parameters)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4))
        self.w2 = nn.Parameter(torch.randn(4))
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x, first=True, twice=False):
        if first:
            x = torch.tanh(x * self.w1)
        h = torch.tanh(self.mix(torch.tanh(x * self.w2)))
        if twice:
            h = torch.tanh(self.mix(torch.tanh(h * self.w2)))
        return self.head(h)


def _batch_oracle(model, batches, tracked, reduction):
    """``[N, D]`` per-sample gradients of the ``tracked`` parameters, each micro-batch forwarded
    together (a train-mode BatchNorm normalises with its statistics): per sample, the gradient of
    its own loss in that forward (plain autograd, float64; unused parameters give zeros)."""
    rows = []
    for xb, yb, kw in batches:
        ref = copy.deepcopy(model)
        ps = dict(ref.named_parameters())
        losses = F.cross_entropy(ref(xb, **kw), yb, reduction="none")
        for i in range(len(xb)):
            gs = torch.autograd.grad(losses[i], [ps[q] for q in tracked], retain_graph=True, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(ps[q]) if g is None else g).flatten()
                                   for q, g in zip(tracked, gs)]))
    return torch.stack(rows)


def _mean_tests(G):
    n = G.shape[0]
    mean = G.mean(0)
    g2 = float(mean @ mean)
    p = G @ mean
    inner = (float(p.var()) / n) ** 0.5 / g2
    v = (float(G.square().sum()) - float(p.square().sum()) / g2) / (n - 1)
    return inner, (max(v, 0.0) / (n * g2)) ** 0.5


def _pairing_case(kind, split, seed):
    g = torch.Generator().manual_seed(seed)
    n = sum(split)
    torch.manual_seed(seed)
    if kind == "prefix":
        model = PrefixNet().double().train()
        x = torch.randn(n, 2, 5, generator=g, dtype=torch.float64)
        kws = [{}] * len(split)
        lens_kw = {"undefined": "exclude"}
    else:
        model = DirectNet().double()
        x = torch.randn(n, 4, generator=g, dtype=torch.float64)
        flags = [(i % 2 == 0, kind == "twice" and i == 1) for i in range(len(split))]
        kws = [{"first": f, "twice": t} for f, t in flags]
        lens_kw = {}
    y = torch.randint(0, 3, (n,), generator=g)
    return model, [(xb, yb, kw) for xb, yb, kw in zip(x.split(split), y.split(split), kws)], lens_kw


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", [[3, 2, 4], [1, 5, 1]])
@pytest.mark.parametrize("kind", ["prefix", "direct", "twice"])
def test_cross_micro_step_blocks_pair_uses_by_their_parameters(kind, split, reduction):
    """BatchDot's off-diagonal blocks and InnerTest / OrthoTest when the per-operation uses
    differ between micro-steps (was: uses paired by position, 0.5% / 9% off)."""
    model, batches, lens_kw = _pairing_case(kind, split, seed=3)
    rec, tracked = _run(model, batches, reduction, [BatchDot(), InnerTest(), OrthoTest()], **lens_kw)
    if kind == "prefix":
        assert sorted(tracked) == ["bn.bias", "bn.weight", "head.bias", "head.weight", "scale"]
    G = _batch_oracle(model, batches, tracked, reduction)
    torch.testing.assert_close(rec["batch_dot"].double(), G @ G.T, rtol=1e-10, atol=1e-13)
    inner, ortho = _mean_tests(G)
    assert rec["inner_test"] == pytest.approx(inner, rel=1e-9)
    assert rec["ortho_test"] == pytest.approx(ortho, rel=1e-9)


# ------------------------------------------------------------------ row 6: freeze between windows
@pytest.mark.parametrize("light", [False, True])
@pytest.mark.parametrize("root", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_parameter_frozen_or_unfrozen_between_windows_counts_from_the_next_record(reduction, root, light):
    """The window opens in the optimizer's step post-hook, before the loop freezes (window 1)
    or unfreezes (window 2) ``0.weight``: each record measures exactly the parameters that
    were trainable during its window (was: the first record after the change still the old set,
    grad_norm +14% / -18%). ``root``: the model is the layer itself (its hooks are the ones
    the refresh reinstalls in that forward); ``light``: GradNorm alone (parameter hooks only)."""
    from gradlens.instruments import BatchL2, GradNorm

    torch.manual_seed(4)
    net = nn.Linear(4, 3) if root else nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    model = gradlens.extend(net.double())
    first = model if root else model[0]
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    insts = [GradNorm()] if light else [GradNorm(), BatchL2(), SumGradSquared()]
    lens = Lens(model, insts, optimizer=opt)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (8,), generator=g)
    split = [3, 1, 4]
    for step, trainable in enumerate([True, False, True, True]):
        first.weight.requires_grad_(trainable)
        batches = [(xb, yb, {}) for xb, yb in zip(x.split(split), y.split(split))]
        gs = _oracle(model, batches, reduction)  # every parameter, at this window's theta
        want = {q: gs[q] for q, p in model.named_parameters() if p.requires_grad}
        for xb, yb, _ in batches:
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
        rec = lens.records[-1]
        assert rec.step == step
        G = _flat(want)
        total = G.mean(0) if reduction == "mean" else G.sum(0)
        assert rec["grad_norm"] == pytest.approx(float(total.norm()), rel=1e-10)
        if light:
            continue
        assert sorted(rec["sum_grad_squared"]) == sorted(want), step
        torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
        for q, gq in want.items():
            torch.testing.assert_close(rec["sum_grad_squared"][q], gq.square().sum(0), rtol=1e-10, atol=1e-14)
        assert rec.meta["coverage"] == G.shape[1] / sum(p.numel() for p in model.parameters() if p.requires_grad)
    lens.close()


def test_sketch_mode_uses_one_map_per_parameter_in_every_micro_step():
    """Sketch mode: s_n = R g_n with the same R for a parameter in every micro-step, whatever
    the position of its use (was: R drawn per positional use name, so a micro-step that skips
    ``x * w1`` sketched ``w2`` with another R and the cross-micro-step blocks had expectation 0).
    Only ``w1``, ``w2`` are tracked, so the blocks between the micro-steps come from ``w2``
    alone; the mean over 48 sketch seeds is within 5 standard deviations (E s(x).s(y) = x.y,
    Var <= 8 ||x||^2 ||y||^2 / k, documented) of the exact block."""
    torch.manual_seed(5)
    model = DirectNet().double()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (7,), generator=g)
    split, flags = [3, 4], [True, False]
    batches = [(xb, yb, {"first": f}) for xb, yb, f in zip(x.split(split), y.split(split), flags)]
    tracked = ["w1", "w2"]
    G = _batch_oracle(model, batches, tracked, "mean")
    exact = (G @ G.T)[:3, 3:]
    k, seeds = 256, 48
    mean = torch.zeros_like(exact)
    for seed in range(seeds):
        rec, got = _run(model, batches, "mean", [BatchDot(mode="sketch", k=k, seed=seed)],
                        exclude=["mix", "head"])
        assert got == tracked
        mean += rec["batch_dot"].double()[:3, 3:] / seeds
    norms = G.norm(dim=1)
    sd = (8 / (k * seeds)) ** 0.5 * norms[:3, None] * norms[None, 3:]
    assert (exact.abs() > 10 * sd).any()  # the test tells the exact block from 0
    assert ((mean - exact).abs() <= 5 * sd).all()
