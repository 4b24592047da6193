"""Small uses stacked at the end of a micro-step (gradlens.measure.deferred): a plan that asks only for
per-sample norms measures same-shaped Linear / LayerNorm / GroupNorm uses in one call on their
concatenated samples. Each window's records equal the float64 oracle, with K unequal
micro-steps, mean and sum losses, groups, a tied parameter, and a budget that stacks only some."""

import copy

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.measure import deferred
from gradlens.instruments import BatchL2, GradNorm, NormTest, SumGradSquared
from oracle import close, flat, per_sample
from windows import micro_batches, run_windows

N = 12
SPLIT = [5, 1, 6]


class Blocks(nn.Module):
    """Three same-shaped blocks on [B, T, 8] (Linear, LayerNorm, GroupNorm over channels), a
    2-D head of two same-shaped Linears, and a tied projection (a shared parameter)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 8)
        self.lin = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.ln = nn.ModuleList(nn.LayerNorm(8) for _ in range(3))
        self.gn = nn.ModuleList(nn.GroupNorm(2, 8) for _ in range(2))
        self.h1, self.h2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x):  # x [B, T, 5]
        h = self.inp(x)
        for lin, ln in zip(self.lin, self.ln):
            h = ln(torch.tanh(lin(h)) + h)
        for gn in self.gn:
            h = gn(h.transpose(1, 2)).transpose(1, 2)
        z = h.mean(1)
        z = torch.tanh(self.h1(z)) + torch.tanh(self.h2(z))
        z = z + torch.nn.functional.linear(z, self.h2.weight)  # h2.weight used twice: shared
        return self.out(z)


def _oracle(model, x, y, reduction):
    def loss_one(out, yi):
        return nn.functional.cross_entropy(out, yi)  # one sample: mean and sum agree
    gs = per_sample(model, model.state_dict(), loss_one, x, y)
    return gs


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("make", [lambda: [BatchL2()], lambda: [BatchL2(), GradNorm()], lambda: [NormTest()],
                                  lambda: [BatchL2(), SumGradSquared(), GradNorm()]],
                         ids=["BatchL2", "BatchL2+GradNorm", "NormTest", "BatchL2+SumGradSquared+GradNorm"])
@pytest.mark.parametrize("groups", [None, "param", "module"])
@pytest.mark.parametrize("budget", ["all", "some"])
def test_stacked_norms_equal_the_oracle(make, reduction, groups, budget, monkeypatch):
    torch.manual_seed(0)
    base = Blocks().double()
    x = torch.randn(N, 4, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    if budget == "some":  # room for about two uses: the others are measured at once
        monkeypatch.setattr(deferred, "STACK_BUDGET", 2 * 12 * 4 * 16)
    kept = []
    real = deferred.stack
    monkeypatch.setattr(deferred, "stack", lambda *a: kept.append(real(*a)) or kept[-1])

    lens = run_windows(base, [micro_batches(x, y, SPLIT)], make(), reduction=reduction, groups=groups,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), close=False).lens
    rec = lens.records[-1]
    assert any(kept) and (budget == "all" or not all(kept))  # stacked (some measured at once)
    assert len(kept) >= 3 * 9  # every micro-step offered its single uses (9 at least: GradNorm reads
    # GroupNorm's window gradient from its uses)

    gs = _oracle(base, x, y, reduction)
    G = flat(gs)
    l2 = G.square().sum(1)
    if "batch_l2" in rec:
        close(rec["batch_l2"], l2)
    if "grad_norm" in rec:
        g = G.mean(0) if reduction == "mean" else G.sum(0)
        close(rec["grad_norm"], g.norm())
    if "sum_grad_squared" in rec:
        assert sorted(rec["sum_grad_squared"]) == sorted(gs)
        for q, g in gs.items():
            close(rec["sum_grad_squared"][q], g.square().sum(0))  # per-sample units
    if "norm_test" in rec:
        mean = G.mean(0)
        tr = (l2.sum() - N * mean.square().sum()) / (N - 1)
        close(rec["norm_test"], (tr / N).sqrt() / mean.norm())
    if groups is not None and "batch_l2" in rec:
        names = lens.groups
        for group, params in names.items():
            want = sum(gs[q].flatten(1).square().sum(1) for q in params)
            close(rec.groups[group]["batch_l2"], want)


@pytest.mark.parametrize("small_sum", [0, 1 << 40], ids=["sums-from-autograd", "sums-stacked"])
@pytest.mark.parametrize("groups", [None, "module"])
def test_stacked_window_gradient_from_either_route(small_sum, groups, monkeypatch):
    """A stacked use's window gradient comes from autograd's node hook (its product is not
    small) or from the stacked block (small): both give the oracle's GradNorm, window after
    window (the second window adds onto new accumulators, not the first one's blocks)."""
    torch.manual_seed(1)
    base = Blocks().double()
    monkeypatch.setattr(deferred, "SMALL_SUM", small_sum)
    hooked = []
    from gradlens.capture import tap  # (where Tap looks it up)
    real_hook = tap._hook_param_grads
    monkeypatch.setattr(tap, "_hook_param_grads", lambda *a: hooked.append(1) or real_hook(*a))
    model, loss_fn, opt, lens = _tracked(base, groups)
    for window in range(2):
        xs = list(torch.randn(N, 4, 5, dtype=torch.float64).split(SPLIT))
        ys = list(torch.randint(0, 4, (N,)).split(SPLIT))
        _check_window(_window(lens, model, loss_fn, opt, xs, ys), base, xs, ys)
    # 9 single Linear / LayerNorm uses per forward are routed: hooked only when sums are not stacked
    assert (len(hooked) >= 2 * 3 * 9) if small_sum == 0 else not hooked


def _tracked(base, groups=None):
    """A copy of ``base`` extended, its loss, an SGD that does not move it, and a Lens with
    BatchL2 and GradNorm (whose small uses are stacked)."""
    model = gradlens.extend(copy.deepcopy(base))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return model, gradlens.extend(nn.CrossEntropyLoss()), opt, Lens(model, [BatchL2(), GradNorm()], optimizer=opt,
                                                                   groups=groups)


def _window(lens, model, loss_fn, opt, xs, ys, before=None):
    """One window of the micro-batches (xs, ys), closed by the optimizer; its record.
    ``before(i, x_i)``: the input micro-step i's forward gets, made just before it."""
    into = before or (lambda i, xb: xb)
    run = run_windows(model, [list(enumerate(zip(xs, ys)))], lens=lens, loss=loss_fn, optimizer=opt, fresh_copy=False,
                      forward=lambda m, mb: m(into(mb[0], mb[1][0])), target=lambda mb: mb[1][1], close=False)
    return run.records[-1]


def _check_window(rec, base, xs, ys):
    G = flat(_oracle(base, torch.cat(xs), torch.cat(ys), "mean"))
    close(rec["batch_l2"], G.square().sum(1))
    close(rec["grad_norm"], G.mean(0).norm())


def test_stacked_uses_are_measured_once_per_window(monkeypatch):
    """The stacked uses of all K micro-steps are measured together when the window closes (one
    settle per window, not one per micro-step), with each micro-step's samples scaled
    by its own per-sample scale (B_k under a mean loss) and the norms in sample order. The
    input is a buffer the loop overwrites in place before each micro-step: what the window
    keeps of it is a copy."""
    torch.manual_seed(2)
    base = Blocks().double()
    calls = []
    real = deferred.settle
    monkeypatch.setattr(deferred, "settle", lambda *a: calls.append(1) or real(*a))
    model, loss_fn, opt, lens = _tracked(base)
    x = torch.randn(N, 4, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    xs, ys = list(x.split(SPLIT)), list(y.split(SPLIT))
    store = torch.empty(max(SPLIT), 4, 5, dtype=torch.float64)

    def into_buffer(i, xb):  # every micro-step's input in the same memory
        buf = store[: xb.shape[0]]
        with torch.no_grad():
            buf.copy_(xb)
        return buf

    rec = _window(lens, model, loss_fn, opt, xs, ys, into_buffer)
    assert len(calls) == 1 and not lens._window.carried
    _check_window(rec, base, xs, ys)


def test_stacked_uses_with_other_lengths_and_a_checkpoint_mid_window():
    """Micro-steps of other sequence lengths stack apart (other shapes) and still add up to the
    window's sums; a state_dict taken mid-window includes the uses kept so far, and a new Lens
    resumed from it gives the oracle's record."""
    torch.manual_seed(3)
    base = Blocks().double()
    xs = [torch.randn(b, t, 5, dtype=torch.float64) for b, t in ((3, 4), (2, 6), (4, 4))]
    ys = [torch.randint(0, 4, (x.shape[0],)) for x in xs]

    def oracle_one(out, yi):
        return nn.functional.cross_entropy(out, yi)

    model, loss_fn, opt, lens = _tracked(base)
    run_windows(model, [list(zip(xs, ys))[:2]], lens=lens, loss=loss_fn, fresh_copy=False, end="none", close=False)
    assert lens._window.carried  # kept for the window's end
    state = lens.state_dict()
    assert not lens._window.carried  # settled into the saved partial window

    model2, _, opt2, lens2 = _tracked(base)
    lens2.load_state_dict(state)
    for lz, m, o in ((lens, model, opt), (lens2, model2, opt2)):
        run_windows(m, [[(xs[2], ys[2])]], lens=lz, loss=loss_fn, optimizer=o, fresh_copy=False, close=False)
        rec = lz.records[-1]
        g = [flat(per_sample(base, base.state_dict(), oracle_one, xb, yb)) for xb, yb in zip(xs, ys)]
        G = torch.cat(g)
        close(rec["batch_l2"], G.square().sum(1))
        close(rec["grad_norm"], G.mean(0).norm())


def test_an_interrupted_window_drops_its_stacked_uses():
    """An exception inside a capture drops the window, and with it the stacked uses its earlier
    micro-steps kept: the next window's record is its own."""
    torch.manual_seed(4)
    base = Blocks().double()
    model, loss_fn, opt, lens = _tracked(base)
    x = torch.randn(N, 4, 5, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    loss = loss_fn(model(x[:5]), y[:5])
    with lens.capture():
        loss.backward()
    assert lens._window.carried
    loss = loss_fn(model(x[5:]), y[5:])
    with pytest.warns(RuntimeWarning, match="interrupted"), pytest.raises(ValueError, match="boom"):
        with lens.capture():
            loss.backward()
            raise ValueError("boom")
    assert not lens._window.carried
    xs, ys = list(x.split(SPLIT)), list(y.split(SPLIT))
    rec = _window(lens, model, loss_fn, opt, xs, ys)
    _check_window(rec, base, xs, ys)
