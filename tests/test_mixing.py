"""Issue 36, operations that mix samples: an operation whose output rows each depend on several
samples of the micro-batch (centring or normalising over the batch, softmax / logsumexp /
cumsum / sort / max over it, mixup or a roll in the middle, attention across the batch, a
running statistic kept in the graph, a loss on ``a @ b.T``) makes the per-sample gradients of
every parameter before it undefined, as a train-mode BatchNorm does: ``undefined="error"`` names
the operation and those parameters, ``"exclude"`` leaves them out (the record's meta says which
and why), and every parameter after it stays exact. Oracle: per-sample gradients of each row's
own loss through the micro-batch's forward (float64, a deep copy taken before
``gradlens.extend``), K unequal micro-batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, SumGradSquared

SPLIT = [3, 1, 4]
N = sum(SPLIT)
UP = ["up.weight", "up.bias"]
DOWN = ["down.weight", "down.bias", "head.weight", "head.bias"]


def _stable_std(h):
    return (h.var(0, unbiased=False) + 1e-3).sqrt()


#: operations along the samples of h [B, 6] (each mixes them)
MIXES = {
    "center": lambda h: h - h.mean(0),
    "standardize": lambda h: (h - h.mean(0)) / _stable_std(h),
    "softmax": lambda h: torch.softmax(h, 0),
    "log_softmax": lambda h: F.log_softmax(h, dim=0),
    "logsumexp": lambda h: h - torch.logsumexp(h, 0, keepdim=True),
    "cumsum": lambda h: h.cumsum(0),
    "cumprod": lambda h: torch.cumprod(h, dim=0),
    "sort": lambda h: h.sort(0).values,
    "max": lambda h: h - h.max(0, keepdim=True).values,
    "amin": lambda h: h * h.amin(0),
    "mixup": lambda h: 0.7 * h + 0.3 * h.flip(0),
    "roll": lambda h: h + 0.5 * torch.roll(h, 1, 0),
    "attention": lambda h: torch.softmax(h @ h.T / 2, -1) @ h,
    "einsum_attention": lambda h: torch.einsum(
        "nm,md->nd", torch.softmax(torch.einsum("nd,md->nm", h, h), -1), h),
    "cdist": lambda h: h - torch.cdist(h, h).mean(1, keepdim=True),
    "normalize": lambda h: F.normalize(h, dim=0),
    "gram": lambda h: h @ (h.T @ h) / 4,
    "norm_all": lambda h: h / (1 + h.norm()),
}

#: operations that keep each sample's row its own (controls: no parameter is undefined)
KEEPS = {
    "feature_softmax": lambda h: torch.softmax(h, -1),
    "feature_center": lambda h: h - h.mean(1, keepdim=True),
    "detached_center": lambda h: h - h.mean(0).detach(),
    "self_attention_per_sample": lambda h: (torch.softmax(h.unsqueeze(2) @ h.unsqueeze(1), -1) @ h.unsqueeze(2)).squeeze(2),
}


class Mixer(nn.Module):
    """up -> the operation -> down -> head; ``running``: a statistic of the batch kept in the
    graph (an exponential average with a buffer)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.up = nn.Linear(5, 6)
        self.down = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.register_buffer("avg", torch.zeros(6))

    def forward(self, x):
        h = torch.tanh(self.up(x))
        if self.op == "running":
            stat = 0.9 * self.avg + 0.1 * h.mean(0)
            h = h - stat
        else:
            h = (MIXES.get(self.op) or KEEPS[self.op])(h)
        return self.head(torch.tanh(self.down(h)))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def _oracle(model, x, y, names):
    """[N, D] per-sample gradients of each row's own cross-entropy through its micro-batch's
    forward, over the parameters ``names`` (g_n of a mean objective: B_k * d(l_n / B_k))."""
    params = dict(model.named_parameters())
    rows, start = [], 0
    for b in SPLIT:
        out = model(x[start:start + b])
        losses = F.cross_entropy(out, y[start:start + b], reduction="none")
        for i in range(b):
            g = torch.autograd.grad(losses[i], [params[q] for q in names], retain_graph=True)
            rows.append(torch.cat([v.reshape(-1) for v in g]))
        start += b
    return torch.stack(rows)


def _run(model, lens, x, y, reduction="mean"):
    start = 0
    for b in SPLIT:
        loss = F.cross_entropy(model(x[start:start + b]), y[start:start + b], reduction=reduction)
        with lens.capture(reduction=reduction, loss=loss):
            loss.backward()
        start += b
    return lens.flush()


@pytest.mark.parametrize("op", sorted(MIXES) + ["running"])
def test_an_operation_that_mixes_samples_names_itself_and_the_parameters_before_it(op):
    torch.manual_seed(0)
    model = gradlens.extend(Mixer(op).double())
    x, y = _data()
    lens = Lens(model, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"per-sample gradients of 2 parameters .* are undefined: their output "
                                           r"reaches .*mixes the samples of a micro-batch") as err:
        _run(model, lens, x, y)
    msg = str(err.value)
    assert all(repr(q) in msg for q in UP)
    assert not any(repr(q) in msg for q in DOWN)  # after the operation: exact
    assert "undefined='exclude'" in msg
    lens.close()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("op", sorted(MIXES) + ["running"])
def test_excluded_the_parameters_after_the_mix_are_exact_and_the_record_says_why(op, reduction):
    """The fix the error suggests, as written: Lens(..., undefined='exclude')."""
    torch.manual_seed(0)
    base = Mixer(op).double()
    oracle = copy.deepcopy(base)
    model = gradlens.extend(base)
    x, y = _data()
    lens = Lens(model, [BatchL2(), SumGradSquared()], undefined="exclude")
    rec = _run(model, lens, x, y, reduction)
    assert lens.tracked == DOWN
    assert sorted(rec.meta["undefined"]) == sorted(UP)
    assert all(isinstance(why, str) and why for why in rec.meta["undefined"].values())
    G = _oracle(oracle, x, y, DOWN)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-13)
    sizes = [oracle.get_parameter(q).numel() for q in DOWN]
    for q, block in zip(DOWN, G.split(sizes, dim=1)):
        want = block.square().sum(0).reshape(oracle.get_parameter(q).shape)
        torch.testing.assert_close(rec["sum_grad_squared"][q], want, rtol=1e-10, atol=1e-13)
    lens.close()


@pytest.mark.parametrize("op", sorted(KEEPS))
def test_operations_that_keep_each_sample_apart_leave_every_parameter_exact(op):
    torch.manual_seed(0)
    base = Mixer(op).double()
    oracle = copy.deepcopy(base)
    model = gradlens.extend(base)
    x, y = _data()
    lens = Lens(model, [BatchL2()])
    rec = _run(model, lens, x, y)
    G = _oracle(oracle, x, y, UP + DOWN)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-13)
    assert "undefined" not in rec.meta
    lens.close()


class TwoTowers(nn.Module):
    """A CLIP-style model: the loss on ``a @ b.T`` computed in its forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)

    def forward(self, x):
        logits = self.a(x) @ self.b(x.flip(1)).T
        return F.cross_entropy(logits, torch.arange(x.shape[0]))


def test_a_contrastive_loss_on_a_times_b_transposed_is_undefined_for_every_parameter():
    """Every parameter reaches ``a @ b.T``: the error names the product and all of them;
    ``undefined='exclude'`` would leave nothing, so it says so and names what works: the
    instruments of the window gradient alone, which it then measures (checked)."""
    torch.manual_seed(0)
    base = TwoTowers().double()
    model = gradlens.extend(copy.deepcopy(base))
    x, _ = _data()
    lens = Lens(model, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"matmul of tensors \[3, 4\], \[4, 3\], which takes the samples from "
                                           r"different places") as err:
        loss = model(x[:3])
        with lens.capture():
            loss.backward()
    assert all(repr(q) in str(err.value) for q in ("a.weight", "a.bias", "b.weight", "b.bias"))
    lens.close()
    lens = Lens(model, [BatchL2()], undefined="exclude")
    with pytest.raises(RuntimeError, match=r"nothing is left to track: use only instruments of the window "
                                           r"gradient \(e\.g\. GradNorm\)"):
        loss = model(x[:3])
        with lens.capture():
            loss.backward()
    lens.close()
    lens = Lens(model, [GradNorm()])  # the suggested fix, as written
    start, total = 0, None
    for b in SPLIT:
        loss = model(x[start:start + b])
        with lens.capture():
            loss.backward()
        start += b
    rec = lens.flush()
    for b, s in zip(SPLIT, [0, 3, 4]):  # the window gradient: mean over the window's samples
        g = torch.autograd.grad(base(x[s:s + b]) * b, list(base.parameters()))
        flat = torch.cat([v.reshape(-1) for v in g])
        total = flat if total is None else total + flat
    assert rec["grad_norm"] == pytest.approx(float((total / N).norm()), rel=1e-10)
    lens.close()


class ScaledTowers(nn.Module):
    """A SigLIP-style model: a learned temperature and bias applied to the pairwise logit matrix
    ``a @ b.T`` (after the mix), then a sigmoid loss over every pair."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 4)
        self.b = nn.Linear(5, 4)
        self.scale = nn.Parameter(torch.tensor(0.3))
        self.bias = nn.Parameter(torch.tensor([-0.2]))

    def forward(self, x):
        logits = (self.a(x) @ self.b(x.flip(1)).t()) * self.scale.exp() + self.bias
        signs = 2 * torch.eye(x.shape[0], dtype=x.dtype) - 1
        return -F.logsigmoid(signs * logits.t()).sum(-1).mean()


def test_a_parameter_applied_to_a_pairwise_product_of_the_samples_is_undefined():
    """The temperature and bias come after the mix, but an entry of ``a @ b.T`` pairs two
    samples: they are undefined too (named with the pairwise product), never measured as if a
    row were one sample's; with the towers left out by ``exclude=``, they alone are refused."""
    torch.manual_seed(0)
    model = gradlens.extend(ScaledTowers().double())
    x, _ = _data()
    for kwargs in ({}, {"exclude": ["a", "b"]}):
        lens = Lens(model, [BatchL2()], **kwargs)
        with pytest.raises(RuntimeError, match=r"undefined: their output reaches .*pairwise product of the samples "
                                               r"\(matmul of tensors \[3, 4\], \[4, 3\]\)") as err:
            loss = model(x[:3])
            with lens.capture(reduction="mean", loss=loss):
                loss.backward()
        assert "'scale'" in str(err.value) and "'bias'" in str(err.value)
        lens.close()


class PooledLoss(nn.Module):
    """A loss term of the batch's mean activation (no sum over samples) or of its sum (linear:
    one over samples)."""

    def __init__(self, square: bool):
        super().__init__()
        self.square = square
        self.up = nn.Linear(5, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x, y):
        h = torch.tanh(self.up(x))
        ce = F.cross_entropy(self.head(h), y, reduction="sum")
        pooled = h.mean(0)
        return ce + (pooled.square().sum() if self.square else 0.5 * pooled.sum() * x.shape[0])


def test_a_loss_term_nonlinear_in_a_batch_mean_is_undefined_a_linear_one_is_exact():
    torch.manual_seed(0)
    x, y = _data()
    model = gradlens.extend(PooledLoss(square=True).double())
    lens = Lens(model, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"square of a value pooled over the samples \(torch\.mean over the "
                                           r"samples \(dim 0 of a \[3, 6\] tensor\)\)") as err:
        loss = model(x[:3], y[:3])
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
    assert "'up.weight'" in str(err.value) and "'head.weight'" not in str(err.value)
    lens.close()
    base = PooledLoss(square=False).double()
    oracle = copy.deepcopy(base)
    model = gradlens.extend(base)
    lens = Lens(model, [BatchL2()])
    start = 0
    rows = []
    params = list(oracle.parameters())
    for b in SPLIT:
        xs, ys = x[start:start + b], y[start:start + b]
        loss = model(xs, ys)
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
        for i in range(b):  # sample i's share: its cross-entropy and its part of the sum
            h = torch.tanh(oracle.up(xs[i:i + 1]))
            li = F.cross_entropy(oracle.head(h), ys[i:i + 1], reduction="sum") + 0.5 * h.sum()
            rows.append(torch.cat([v.reshape(-1) for v in torch.autograd.grad(li, params)]))
        start += b
    rec = lens.flush()
    G = torch.stack(rows)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-13)
    lens.close()


class Branch(nn.Module):
    """A side branch that only some micro-steps run, and whose output is centred over the batch
    (undefined) when it runs."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.side = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x, use_side):
        h = self.a(x)
        if use_side:
            t = self.side(x)
            h = h + (t - t.mean(0))
        return self.b(torch.tanh(h))


def _branch_run(model, flags, **kw):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    lens = Lens(model, [GradHist1d(bins=8, range=(-1, 1)), SumGradSquared(), BatchL2()], **kw)
    try:
        start = 0
        for f, b in zip(flags, SPLIT):
            loss = F.cross_entropy(model(x[start:start + b], f), y[start:start + b])
            with lens.capture(reduction="mean", loss=loss):
                loss.backward()
            start += b
        return lens.flush()
    finally:
        lens.close()


def test_a_layer_skipped_then_found_undefined_is_left_out_of_every_statistic_of_the_window():
    """The first micro-step skips the side branch (its zeros are counted), the next ones find it
    undefined: the window's histogram and sum of squares are those of a Lens that never
    tracked it."""
    torch.manual_seed(0)
    base = Branch().double()
    got = _branch_run(gradlens.extend(copy.deepcopy(base)), [False, True, True], undefined="exclude")
    want = _branch_run(gradlens.extend(copy.deepcopy(base)), [False, True, True], exclude=["side"])
    assert sorted(got["sum_grad_squared"]) == sorted(want["sum_grad_squared"]) == ["a.bias", "a.weight", "b.bias",
                                                                                  "b.weight"]
    assert torch.equal(got["grad_hist_1d"].counts, want["grad_hist_1d"].counts)
    assert (got["grad_hist_1d"].clamped_low, got["grad_hist_1d"].clamped_high) == (
        want["grad_hist_1d"].clamped_low, want["grad_hist_1d"].clamped_high)
    torch.testing.assert_close(got["batch_l2"], want["batch_l2"], rtol=0, atol=0)
    for q in want["sum_grad_squared"]:
        torch.testing.assert_close(got["sum_grad_squared"][q], want["sum_grad_squared"][q], rtol=0, atol=0)
    assert sorted(got.meta["undefined"]) == ["side.bias", "side.weight"]


def test_a_parameter_measured_then_found_undefined_in_one_window_is_refused():
    """Measured values cannot be taken out of a window: refused, with the fix (what mixes the
    samples the same for every micro-step of a window)."""
    torch.manual_seed(0)

    class Flip(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 3)

        def forward(self, x, mix):
            h = torch.tanh(self.a(x))
            return self.b(h - h.mean(0) if mix else h)

    model = gradlens.extend(Flip().double())
    with pytest.raises(RuntimeError, match=r"the parameters \['a\.bias', 'a\.weight'\] were measured in an earlier "
                                           r"micro-step of this window and are undefined in this one"):
        _branch_run(model, [False, True, True], undefined="exclude")
    rec = _branch_run(model, [True, True, True], undefined="exclude")  # the fix: the same in every micro-step
    assert sorted(rec["sum_grad_squared"]) == ["b.bias", "b.weight"]


def test_a_mixing_op_costs_the_common_path_nothing_it_is_found_by_rule():
    """Two data arguments in the same place (a residual add, q @ k^T over heads) do not reach
    the alignment check: only their marks are compared."""
    from gradlens.capture import sample_flow as tap_mod

    tap_mod._SEVERAL.clear()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    model = gradlens.extend(nn.Sequential(layer, nn.Flatten(), nn.Linear(8 * 4, 3)).double())
    lens = Lens(model, [BatchL2()])
    x = torch.randn(5, 4, 8, dtype=torch.float64)
    loss = F.cross_entropy(model(x), torch.zeros(5, dtype=torch.long))
    with lens.capture(reduction="mean", loss=loss):
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (5,)
    # (matmul-like products of two data tensors are checked once per shape and kept)
    assert all(ok for ok, _ in tap_mod._SEVERAL.values())
    lens.close()
