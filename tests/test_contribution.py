"""Issue 43, ``Lens(undefined="contribution")``: where samples mix through batch statistics
(train-mode BatchNorm) or an operation across the batch, each sample's per-sample values are its
contribution to its micro-step's gradient, g_m = B_k * dL_k/dtheta_m (mean objective; dL_k/dtheta_m
for a sum): the gradient of the micro-step's objective through sample m's own rows, the batch
statistics' paths included, so that (1/N) sum_m g_m is the window gradient.

Oracle (independent of gradlens, float64): the micro-batch's forward written with one copy of
every parameter per sample (a grouped convolution, per-sample Linear and BatchNorm affine
weights), the batch statistics computed by hand over the micro-batch; the contribution of sample m
is the gradient of the micro-step's loss wrt copy m, times B_k for a mean loss. Unequal
micro-batches; batch_l2, sum_grad_squared, grad_norm, GradHist1d and BatchDot against it, and
the mean of the contributions against plain autograd."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, SumGradSquared
from oracle import hist_matches
from test_mixing import MIXES, Mixer, PooledLoss, TwoTowers

EPS = 1e-5  # the BatchNorms' eps
R = 0.5  # the histogram's range (-R, R)
BINS = 16


def cnn() -> nn.Module:
    """Conv2d -> BatchNorm2d (train) -> ReLU -> Linear; inputs [B, 2, 4, 4]."""
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3, eps=EPS), nn.ReLU(), nn.Flatten(),
                         nn.Linear(48, 3))


def mlp() -> nn.Module:
    """Linear -> BatchNorm1d -> ReLU -> Linear -> BatchNorm1d -> Tanh -> Linear: the first
    BatchNorm's weight and bias come before the second (contributions too); inputs [B, 5]."""
    return nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, eps=EPS), nn.ReLU(), nn.Linear(8, 8),
                         nn.BatchNorm1d(8, eps=EPS), nn.Tanh(), nn.Linear(8, 3))


def _bn(h, w, b):
    """Batch statistics over the micro-batch (all but the channel dim), by hand; per-sample
    affine copies ``w``, ``b`` ``[B, C]``."""
    dims = (0,) + tuple(range(2, h.dim()))
    shape = (h.shape[0], h.shape[1]) + (1,) * (h.dim() - 2)
    mean = h.mean(dims, keepdim=True)
    var = (h - mean).square().mean(dims, keepdim=True)
    return w.view(shape) * (h - mean) / torch.sqrt(var + EPS) + b.view(shape)


def _linear(h, w, b):
    """Sample m's row through its own copy ``w[m]`` ``[out, in]``, ``b[m]``."""
    return torch.einsum("bi,boi->bo", h, w) + b


def _cnn_copies(P, x):
    b = x.shape[0]
    w = P["0.weight"]  # [b, 3, 2, 3, 3]: one group per sample
    h = F.conv2d(x.reshape(1, b * 2, 4, 4), w.reshape(b * 3, 2, 3, 3), padding=1, groups=b).reshape(b, 3, 4, 4)
    h = h + P["0.bias"][:, :, None, None]
    h = torch.relu(_bn(h, P["1.weight"], P["1.bias"]))
    return _linear(h.flatten(1), P["4.weight"], P["4.bias"])


def _mlp_copies(P, x):
    h = torch.relu(_bn(_linear(x, P["0.weight"], P["0.bias"]), P["1.weight"], P["1.bias"]))
    h = torch.tanh(_bn(_linear(h, P["3.weight"], P["3.bias"]), P["4.weight"], P["4.bias"]))
    return _linear(h, P["6.weight"], P["6.bias"])


def _mixer_copies(op):
    def forward(P, x):
        h = MIXES[op](torch.tanh(_linear(x, P["up.weight"], P["up.bias"])))
        return _linear(torch.tanh(_linear(h, P["down.weight"], P["down.bias"])), P["head.weight"], P["head.bias"])
    return forward


def contributions(model, forward, x, y, split, reduction="mean"):
    """name -> ``[N, *param]``: sample m's contribution to its micro-step's gradient, the
    gradient of the micro-step's loss wrt sample m's own copy of each parameter (times B_k for a
    mean loss), from ``forward(copies, x)`` over each micro-batch of ``split``."""
    names = [q for q, _ in model.named_parameters()]
    out, start = {q: [] for q in names}, 0
    for b in split:
        copies = {q: p.detach().expand(b, *p.shape).clone().requires_grad_(True)
                  for q, p in model.named_parameters()}
        loss = F.cross_entropy(forward(copies, x[start:start + b]), y[start:start + b], reduction=reduction)
        grads = torch.autograd.grad(loss, [copies[q] for q in names])
        for q, g in zip(names, grads):
            out[q].append(g * (b if reduction == "mean" else 1))
        start += b
    return {q: torch.cat(v) for q, v in out.items()}


def batch_gradient(model, x, y, split, reduction="mean"):
    """name -> the window gradient by plain autograd: sum_k (B_k / N) dL_k/dtheta (mean), or
    sum_k dL_k/dtheta (sum)."""
    n, start = sum(split), 0
    total = {q: torch.zeros_like(p) for q, p in model.named_parameters()}
    for b in split:
        loss = F.cross_entropy(model(x[start:start + b]), y[start:start + b], reduction=reduction)
        for (q, _), g in zip(model.named_parameters(), torch.autograd.grad(loss, list(model.parameters()))):
            total[q] += g * (b / n if reduction == "mean" else 1)
        start += b
    return total


def _run(model, lens, x, y, split, reduction="mean"):
    start = 0
    for b in split:
        loss = F.cross_entropy(model(x[start:start + b]), y[start:start + b], reduction=reduction)
        with lens.capture(reduction=reduction, loss=loss):
            loss.backward()
        start += b
    return lens.flush()


def _instruments():
    return [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=BINS, range=(-R, R)), BatchDot()]


def _data(shape, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


def _check(rec, G, names, reduction):
    """Every instrument on the contributions ``G`` (name -> [N, *param])."""
    flat = torch.cat([G[q].flatten(1) for q in names], 1)
    torch.testing.assert_close(rec["batch_l2"], flat.square().sum(1), rtol=1e-10, atol=1e-13)
    assert sorted(rec["sum_grad_squared"]) == sorted(names)
    for q in names:
        torch.testing.assert_close(rec["sum_grad_squared"][q], G[q].square().sum(0), rtol=1e-10, atol=1e-13)
    window = flat.mean(0) if reduction == "mean" else flat.sum(0)
    assert rec["grad_norm"] == pytest.approx(float(window.norm()), rel=1e-10)
    torch.testing.assert_close(rec["batch_dot"], flat @ flat.T, rtol=1e-10, atol=1e-12)
    hist_matches(rec["grad_hist_1d"], flat, -R, R, BINS)


CASES = {
    "cnn": (cnn, _cnn_copies, (2, 4, 4), [2, 3, 1], ["0.weight", "0.bias"]),
    "mlp": (mlp, _mlp_copies, (5,), [2, 4, 3], ["0.weight", "0.bias", "1.weight", "1.bias", "3.weight", "3.bias"]),
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_train_mode_batchnorm_contributions_match_the_per_sample_copies_oracle(case, reduction):
    make, forward, shape, split, before = CASES[case]
    torch.manual_seed(0)
    base = make().double()
    plain = copy.deepcopy(base)
    x, y = _data(shape, sum(split))
    G = contributions(base, forward, x, y, split, reduction)
    names = [q for q, _ in base.named_parameters()]
    # (1/N) sum_m g_m (mean; sum_m g_m for a sum) is the window gradient of plain autograd
    want = batch_gradient(plain, x, y, split, reduction)
    for q in names:
        got = G[q].mean(0) if reduction == "mean" else G[q].sum(0)
        torch.testing.assert_close(got, want[q], rtol=1e-10, atol=1e-13)
    # a contribution is not the sample's own gradient: the rows of G differ from those (and the
    # conv bias' contributions sum to zero through the batch mean, though each is not zero)
    if case == "cnn":
        assert G["0.bias"].abs().max() > 1e-3 and G["0.bias"].sum(0).abs().max() < 1e-12
    model = gradlens.extend(base)
    lens = Lens(model, _instruments(), undefined="contribution")
    assert lens.undefined == "contribution"
    rec = _run(model, lens, x, y, split, reduction)
    assert lens.tracked == names and lens.coverage == 1.0
    assert sorted(rec.meta["contribution"]) == sorted(before)
    assert all("BatchNorm" in why and "batch statistics" in why for why in rec.meta["contribution"].values())
    assert "contribution" in rec.meta["units"] and "not per-sample gradients" in rec.meta["units"]
    _check(rec, G, names, reduction)
    lens.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_default_still_refuses_and_names_the_contribution_option(case):
    make, _, shape, split, before = CASES[case]
    torch.manual_seed(0)
    model = gradlens.extend(make().double())
    x, y = _data(shape, sum(split))
    lens = Lens(model, [BatchL2()])
    assert lens.undefined == "error"
    with pytest.raises(RuntimeError, match=r"are undefined: .*undefined='exclude'.*undefined='contribution'") as err:
        _run(model, lens, x, y, split)
    assert all(repr(q) in str(err.value) for q in before)
    lens.close()


def test_a_window_without_a_mix_has_own_gradients_and_no_contribution_meta():
    """Eval mode (running statistics): nothing mixes, the per-sample values are each sample's own
    gradient and the record names no contribution."""
    torch.manual_seed(0)
    base = cnn().double().eval()
    x, y = _data((2, 4, 4), 6)
    model = gradlens.extend(copy.deepcopy(base))
    lens = Lens(model, [BatchL2()], undefined="contribution")
    rec = _run(model, lens, x, y, [2, 3, 1])
    assert "contribution" not in rec.meta and "contribution" not in rec.meta["units"]
    own = torch.stack([
        torch.cat([g.flatten() for g in torch.autograd.grad(
            F.cross_entropy(base(x[n:n + 1]), y[n:n + 1]), list(base.parameters()))])
        for n in range(6)])
    torch.testing.assert_close(rec["batch_l2"], own.square().sum(1), rtol=1e-10, atol=1e-13)
    lens.close()


@pytest.mark.parametrize("op", sorted(MIXES))
def test_operations_that_mix_samples_give_contributions_too(op):
    """The mixing operations of issue 36 (centring, softmax over the batch, mixup, attention
    across the batch, ...): the parameters before them get contributions, those after their
    own gradients (which are their contributions)."""
    torch.manual_seed(0)
    base = Mixer(op).double()
    split = [3, 1, 4]
    x, y = _data((5,), sum(split))
    G = contributions(base, _mixer_copies(op), x, y, split)
    names = [q for q, _ in base.named_parameters()]
    want = batch_gradient(copy.deepcopy(base), x, y, split)
    for q in names:
        torch.testing.assert_close(G[q].mean(0), want[q], rtol=1e-10, atol=1e-13)
    model = gradlens.extend(base)
    lens = Lens(model, _instruments(), undefined="contribution")
    rec = _run(model, lens, x, y, split)
    assert sorted(rec.meta["contribution"]) == ["up.bias", "up.weight"]
    _check(rec, G, names, "mean")
    lens.close()


def test_noise_scale_and_the_tests_read_the_contributions():
    """NormTest, NoiseScale, MeanGSNR and NoiseScaleTwoBatch are computed on the contributions
    (what they mean then: docs/instruments.md, "Contributions")."""
    from gradlens.instruments import MeanGSNR, NoiseScale, NoiseScaleTwoBatch, NormTest
    from oracle import trace_sigma, two_batch

    torch.manual_seed(0)
    base = cnn().double()
    split = [2, 3, 1]
    x, y = _data((2, 4, 4), sum(split))
    G = contributions(base, _cnn_copies, x, y, split)
    flat = torch.cat([G[q].flatten(1) for q, _ in base.named_parameters()], 1)
    model = gradlens.extend(base)
    lens = Lens(model, [NormTest(), NoiseScale(), MeanGSNR(), NoiseScaleTwoBatch()], undefined="contribution")
    rec = _run(model, lens, x, y, split)
    n, g = flat.shape[0], flat.mean(0)
    tr = trace_sigma(flat)
    assert rec["norm_test"] == pytest.approx((tr / n) ** 0.5 / float(g.norm()), rel=1e-9)
    assert rec["noise_scale"] == pytest.approx(tr / float(g.square().sum()), rel=1e-9)
    var = flat.var(0, unbiased=True)
    keep = var > torch.finfo(torch.float64).eps * var.max()
    assert rec["mean_gsnr"] == pytest.approx(float((g[keep].square() / var[keep]).mean()), rel=1e-8)
    g2, tr2 = two_batch(flat, split)
    assert rec["noise_scale_two_batch"]["grad_sq"] == pytest.approx(g2, rel=1e-9)
    assert rec["noise_scale_two_batch"]["trace_sigma"] == pytest.approx(tr2, rel=1e-9)
    assert sorted(rec.meta["contribution"]) == ["0.bias", "0.weight"]
    lens.close()


def test_accum_batchnorm_models_give_the_same_contributions():
    """convert_accum_batchnorm's AccumBatchNorm2d normalises with the micro-batch statistics,
    like nn.BatchNorm2d: the same kernel, the same contributions; its running statistics stay
    those of one BatchNorm over the whole window."""
    from gradlens import convert_accum_batchnorm

    torch.manual_seed(0)
    base = cnn().double()
    split = [2, 3, 1]
    x, y = _data((2, 4, 4), sum(split))
    G = contributions(base, _cnn_copies, x, y, split)
    whole = copy.deepcopy(base)
    whole(x)  # one BatchNorm over the window's N samples: its running statistics
    model = gradlens.extend(convert_accum_batchnorm(copy.deepcopy(base), accum_steps=len(split)))
    assert type(model[1]).__name__ == "AccumBatchNorm2d"
    lens = Lens(model, _instruments(), undefined="contribution")
    rec = _run(model, lens, x, y, split)
    assert sorted(rec.meta["contribution"]) == ["0.bias", "0.weight"]
    _check(rec, G, [q for q, _ in base.named_parameters()], "mean")
    torch.testing.assert_close(model[1].running_mean, whole[1].running_mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model[1].running_var, whole[1].running_var, rtol=1e-12, atol=1e-14)
    lens.close()


class Flip(nn.Module):
    """A centring over the batch that only some micro-steps run."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x, mix):
        h = torch.tanh(self.a(x))
        return self.b(h - h.mean(0) if mix else h)


def _flip_run(lens, model, x, y, flags, split, start=0):
    for f, b in zip(flags, split):
        loss = F.cross_entropy(model(x[start:start + b], f), y[start:start + b])
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()
        start += b


def test_a_mix_in_some_micro_steps_only_is_one_definition_for_the_window():
    """Where nothing mixes, a sample's contribution is its own gradient: a parameter measured
    in a micro-step without the mix and found mixing in a later one is kept (``"exclude"``
    refuses it), and the record names it."""
    torch.manual_seed(0)
    base = Flip().double()
    flags, split = [False, True, True], [2, 3, 1]
    x, y = _data((4,), sum(split))
    names = [q for q, _ in base.named_parameters()]
    rows, start = {q: [] for q in names}, 0
    for f, b in zip(flags, split):
        def forward(P, xb, f=f):
            h = torch.tanh(_linear(xb, P["a.weight"], P["a.bias"]))
            return _linear(h - h.mean(0) if f else h, P["b.weight"], P["b.bias"])
        got = contributions(base, forward, x[start:start + b], y[start:start + b], [b])
        for q in names:
            rows[q].append(got[q])
        start += b
    G = {q: torch.cat(v) for q, v in rows.items()}
    model = gradlens.extend(base)
    lens = Lens(model, _instruments(), undefined="contribution")
    _flip_run(lens, model, x, y, flags, split)
    rec = lens.flush()
    assert sorted(rec.meta["contribution"]) == ["a.bias", "a.weight"]
    _check(rec, G, names, "mean")
    lens.close()


def test_a_checkpoint_inside_the_window_keeps_what_was_measured_as_contributions():
    """Lens.state_dict() after the micro-step that mixed (the later ones do not): the resumed
    Lens' record names the same parameters and has the same values as the uninterrupted one; a
    state written before windows had ``contribution`` loads with none."""
    torch.manual_seed(0)
    base = Flip().double()
    flags, split = [True, False, False], [2, 3, 1]
    x, y = _data((4,), sum(split))
    insts = [BatchL2(), SumGradSquared()]
    model = gradlens.extend(copy.deepcopy(base))
    lens = Lens(model, insts, undefined="contribution")
    _flip_run(lens, model, x, y, flags, split)
    want = lens.flush()
    lens.close()
    assert sorted(want.meta["contribution"]) == ["a.bias", "a.weight"]
    model = gradlens.extend(copy.deepcopy(base))
    lens = Lens(model, [BatchL2(), SumGradSquared()], undefined="contribution")
    _flip_run(lens, model, x, y, flags[:1], split[:1])
    state = lens.state_dict()
    assert state["partial_window"]["contribution"] == want.meta["contribution"]
    lens.close()
    for saved, named in ((state, True), ({**state, "partial_window": {
            k: v for k, v in state["partial_window"].items() if k != "contribution"}}, False)):
        lens = Lens(model, [BatchL2(), SumGradSquared()], undefined="contribution")
        lens.load_state_dict(saved)
        _flip_run(lens, model, x, y, flags[1:], split[1:], start=split[0])
        got = lens.flush()
        torch.testing.assert_close(got["batch_l2"], want["batch_l2"], rtol=1e-12, atol=1e-14)
        if named:
            assert got.meta["contribution"] == want.meta["contribution"] and got.meta["units"] == want.meta["units"]
        else:
            assert "contribution" not in got.meta
        lens.close()


def _copies(base, b):
    return {q: p.detach().expand(b, *p.shape).clone().requires_grad_(True) for q, p in base.named_parameters()}


def test_a_contrastive_loss_and_a_loss_nonlinear_in_a_batch_mean_give_contributions():
    """A CLIP-style loss on ``a @ b.T`` (every parameter before the mix) and a loss term
    ``mean(h)^2`` (the parameters before the pooled value): contributions for those, summing to
    the micro-step's gradient."""
    torch.manual_seed(0)
    split = [3, 1, 4]
    x, y = _data((5,), sum(split))

    def clip(P, xb, yb):
        logits = _linear(xb, P["a.weight"], P["a.bias"]) @ _linear(xb.flip(1), P["b.weight"], P["b.bias"]).T
        return F.cross_entropy(logits, torch.arange(xb.shape[0]))

    def pooled(P, xb, yb):
        h = torch.tanh(_linear(xb, P["up.weight"], P["up.bias"]))
        ce = F.cross_entropy(_linear(h, P["head.weight"], P["head.bias"]), yb, reduction="sum")
        return ce + h.mean(0).square().sum()

    for base, loss_of, reduction, before in ((TwoTowers().double(), clip, None, ["a.bias", "a.weight", "b.bias", "b.weight"]),
                                             (PooledLoss(square=True).double(), pooled, "sum", ["up.bias", "up.weight"])):
        names = [q for q, _ in base.named_parameters()]
        rows, start = [], 0
        for b in split:
            P = _copies(base, b)
            g = torch.autograd.grad(loss_of(P, x[start:start + b], y[start:start + b]), [P[q] for q in names])
            rows.append(torch.cat([v.flatten(1) for v in g], 1) * (b if reduction is None else 1))
            start += b
        G = torch.cat(rows)
        model = gradlens.extend(copy.deepcopy(base))
        lens = Lens(model, [BatchL2(), GradNorm()], undefined="contribution")
        start = 0
        for b in split:
            loss = model(x[start:start + b]) if reduction is None else model(x[start:start + b], y[start:start + b])
            with lens.capture(**({} if reduction is None else {"reduction": reduction, "loss": loss})):
                loss.backward()
            start += b
        rec = lens.flush()
        assert sorted(rec.meta["contribution"]) == before
        torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-13)
        window = G.mean(0) if reduction is None else G.sum(0)
        assert rec["grad_norm"] == pytest.approx(float(window.norm()), rel=1e-10)
        lens.close()


def test_the_inner_product_and_orthogonality_tests_read_the_contributions():
    """InnerTest and OrthoTest (cross-micro-step projections onto the window gradient) on the
    contributions of the MLP with two BatchNorms."""
    from gradlens.instruments import InnerTest, OrthoTest

    make, forward, shape, split, _ = CASES["mlp"]
    torch.manual_seed(0)
    base = make().double()
    x, y = _data(shape, sum(split))
    G = contributions(base, forward, x, y, split)
    flat = torch.cat([G[q].flatten(1) for q, _ in base.named_parameters()], 1)
    model = gradlens.extend(base)
    lens = Lens(model, [InnerTest(), OrthoTest()], undefined="contribution")
    rec = _run(model, lens, x, y, split)
    n, mean = flat.shape[0], flat.mean(0)
    g2 = mean.square().sum()
    p = flat @ mean
    orth = flat - (p / g2)[:, None] * mean[None, :]
    assert rec["inner_test"] == pytest.approx(float((p.var() / n).sqrt() / g2), rel=1e-9)
    assert rec["ortho_test"] == pytest.approx(float((orth.square().sum() / (n - 1) / (n * g2)).sqrt()), rel=1e-9)
    lens.close()
