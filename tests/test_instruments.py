"""Every core instrument == float64 torch.func oracle == the K = 1 record (DESIGN.md invariant)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import gradlens
from gradlens.instruments import (
    BatchL2,
    GradHist1d,
    GradNorm,
    MeanGSNR,
    NoiseScale,
    NormTest,
    SumGradSquared,
)
from oracle import MODELS, SPLITS, bins_oracle, flat, hist_oracle, make_problem, per_sample_grads
from windows import all_instruments, micro_batches, run_windows

RTOL = 1e-10
HIST_BINS = 10
HIST2D_BINS = (6, 8)


def _instruments(grad_r: float, param_r: float):
    return all_instruments(grad_r, param_r, bins=HIST_BINS, bins_2d=HIST2D_BINS,
                           leave_out=("NoiseScaleTwoBatch", "BatchDot", "Alpha", "InnerTest", "OrthoTest"))


def run_lens(model, x, y, split, reduction, instruments, **lens_kwargs):
    """One window of micro-batches ``split`` (SGD with lr 0); returns its only record."""
    return run_windows(model, [micro_batches(x, y, split)], instruments, reduction=reduction,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), **lens_kwargs).record


@pytest.fixture(scope="module", params=sorted(MODELS))
def problem(request):
    case = MODELS[request.param]
    model, x, y = make_problem(case)
    gs = per_sample_grads(model, x, y)
    G = flat(gs)
    return {
        "model": model,
        "x": x,
        "y": y,
        "gs": gs,
        "G": G,
        "grad_r": 0.5 * float(G.abs().max()),
        "param_r": 0.5 * max(float(p.detach().abs().max()) for p in model.parameters()),
    }


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), rtol=RTOL, atol=1e-14)


def check_against_oracle(rec, P, reduction):
    gs, G = P["gs"], P["G"]
    n = G.shape[0]
    assert rec.num_samples == n
    _close(rec["batch_l2"], G.square().sum(1))
    assert set(rec["sum_grad_squared"]) == set(gs)
    for name, g in gs.items():
        _close(rec["sum_grad_squared"][name], g.square().sum(0))
    window_grad = G.mean(0) if reduction == "mean" else G.sum(0)
    _close(rec["grad_norm"], window_grad.norm())

    mean = G.mean(0)
    var = G.var(0, unbiased=True)  # per coordinate
    trace = var.sum()
    _close(rec["noise_scale"], trace / mean.square().sum())
    _close(rec["norm_test"], (trace / n).sqrt() / mean.norm())
    ok = var > 0
    _close(rec["mean_gsnr"], (mean[ok].square() / var[ok]).mean())

    r = P["grad_r"]
    h = rec["grad_hist_1d"]
    counts, low, high = hist_oracle(G, -r, r, HIST_BINS)
    counts[0] += 0  # low/high are already inside counts by the clamping rule
    assert torch.equal(h.counts, counts), (h.counts, counts)
    assert (h.clamped_low, h.clamped_high) == (low, high)
    assert low + high > 0, "test range should clamp some values"
    assert h.total == G.numel()
    torch.testing.assert_close(h.edges[[0, -1]], torch.tensor([-r, r], dtype=torch.float64))

    pr = P["param_r"]
    theta = torch.cat([p.detach().flatten() for p in P["model"].parameters()])
    pb, gb = HIST2D_BINS
    pidx = bins_oracle(theta, -pr, pr, pb)
    gidx = bins_oracle(G, -r, r, gb)
    joint = torch.bincount((pidx * gb + gidx).flatten(), minlength=pb * gb).view(pb, gb)
    h2 = rec["grad_hist_2d"]
    assert torch.equal(h2.counts, joint)
    assert h2.clamped_param == n * int(((theta < -pr) | (theta > pr)).sum())
    assert h2.clamped_grad == low + high
    assert h2.clamped_param > 0


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", sorted(SPLITS))
def test_matches_oracle_and_single_batch(problem, reduction, split):
    P = problem
    sizes = SPLITS[split]
    rec = run_lens(P["model"], P["x"], P["y"], sizes, reduction, _instruments(P["grad_r"], P["param_r"]))
    assert rec.micro_steps == len(sizes)
    assert rec.step == 0
    check_against_oracle(rec, P, reduction)
    # K micro-steps report what one batch of N reports
    ref = run_lens(P["model"], P["x"], P["y"], [sum(sizes)], reduction, _instruments(P["grad_r"], P["param_r"]))
    for key in ref.keys():
        a, b = rec[key], ref[key]
        if isinstance(a, (gradlens.Hist1d, gradlens.Hist2d)):
            assert a == b
        elif isinstance(a, dict):
            for k in a:
                _close(a[k], b[k])
        else:
            _close(a, b)
    # the window loss is the loss of one batch of N
    full = nn.functional.cross_entropy(P["model"](P["x"]), P["y"], reduction=reduction)
    _close(rec["loss"], full.detach())


def test_small_chunks_give_same_record(problem):
    """Slicing samples into tiny chunks (many layers split mid-batch) changes nothing."""
    P = problem
    insts = lambda: _instruments(P["grad_r"], P["param_r"])  # noqa: E731
    a = run_lens(P["model"], P["x"], P["y"], [5, 1, 6], "mean", insts(), chunk_elements=7)
    b = run_lens(P["model"], P["x"], P["y"], [12], "mean", insts())
    assert a["grad_hist_1d"] == b["grad_hist_1d"]
    assert a["grad_hist_2d"] == b["grad_hist_2d"]
    _close(a["batch_l2"], b["batch_l2"])


def test_norms_without_histograms_match_oracle(problem):
    """The non-materialising path (no per-sample pass) alone."""
    P = problem
    rec = run_lens(
        P["model"], P["x"], P["y"], [5, 1, 6], "sum",
        [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale(), MeanGSNR()],
    )
    G = P["G"]
    _close(rec["batch_l2"], G.square().sum(1))
    _close(rec["grad_norm"], G.sum(0).norm())
    for name, g in P["gs"].items():
        _close(rec["sum_grad_squared"][name], g.square().sum(0))


def test_zero_lands_right_of_the_zero_edge():
    """Exact zeros (dead ReLU units) fall in the bin [0, w) of a symmetric range."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every hidden unit dead: layer-0 gradients are all 0
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 1])
    (rec,) = run_windows(model, [[(x, y)]], [GradHist1d(bins=4, range=(-1, 1))], exclude=["2"]).flushed
    # layer 0 only (layer "2" excluded): 5 samples x 16 entries, all exactly 0
    assert rec["grad_hist_1d"].counts.tolist() == [0, 0, 5 * 16, 0]


def test_several_windows_and_schedule():
    P_case = MODELS["mlp"]
    model, x, y = make_problem(P_case)

    def untracked_unhooked(run, w, k, loss):
        if w % 2 == 1 and k == 1:
            assert not run.lens._tap.installed  # untracked window: no hook on the model

    def check(run, w):
        if w % 2 == 0:  # the oracle at the window's theta (before its update)
            _close(run.records[-1]["batch_l2"], flat(per_sample_grads(run.thetas[w], x, y)).square().sum(1))

    run = run_windows(model, [micro_batches(x, y, [6, 6])] * 5, [BatchL2(), GradNorm()],
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), every=2, snapshots=True,
                      on_micro=untracked_unhooked, on_window=check, close=False)
    lens = run.lens
    assert [r.step for r in lens.records] == [0, 2, 4]
    assert all(r.micro_steps == 2 and r.num_samples == 12 for r in lens.records)
    lens.close()
    assert not any(m._forward_hooks for m in run.model.modules())


def test_histogram_range_adapts_between_windows():
    model, x, y = make_problem(MODELS["mlp"])
    hist = GradHist1d(bins=8, range=(-100.0, 100.0), adapt="abs_max")
    G = flat(per_sample_grads(model, x, y))
    first, second = run_windows(model, [[(x, y)]] * 2, [hist]).records
    m = float(G.abs().max())
    assert first["grad_hist_1d"].range == (-100.0, 100.0)
    assert second["grad_hist_1d"].range == pytest.approx((-m, m), rel=1e-12)
    counts, _, _ = hist_oracle(G, -m, m, 8)
    # the max element sits on the upper edge: it is counted in the last bin, not clamped
    assert torch.equal(second["grad_hist_1d"].counts, counts)
    assert math.isclose(first["loss"], second["loss"])


def test_records_keep_their_sums_while_buffers_are_reused():
    """Window sums live in reused buffers; a record that is kept must not see the next window."""
    model, x, y = make_problem(MODELS["mlp"])
    lens = run_windows(model, [[(x * (i + 1), y)] for i in range(3)], [SumGradSquared(), GradNorm()]).lens
    first = {k: v.clone() for k, v in lens.records[0]["sum_grad_squared"].items()}
    a, b, c = (r["sum_grad_squared"]["1.weight"] for r in lens.records)
    assert a.data_ptr() != b.data_ptr() != c.data_ptr()
    for k, v in lens.records[0]["sum_grad_squared"].items():
        assert torch.equal(v, first[k])
    assert len({r["grad_norm"] for r in lens.records}) == 3


@pytest.mark.parametrize("how", ["times-3.7", "divide-by-K", "plus-regulariser"])
def test_scaled_or_regularised_loss_still_gives_per_sample_units(problem, how):
    """What multiplies the loss in backward (GradScaler's S, a "divide the loss by K" recipe)
    is read from the loss output's gradient and divided out; a regulariser added to the loss
    is not part of any g_n, and leaves every statistic unchanged."""
    P = problem
    sizes = [5, 1, 6]
    insts = [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=HIST_BINS, range=(-P["grad_r"], P["grad_r"]))]
    objective = {
        "times-3.7": lambda loss, run, w, k: loss * 3.7,
        "divide-by-K": lambda loss, run, w, k: loss / len(sizes),
        "plus-regulariser": lambda loss, run, w, k: loss + 0.3 * sum(p.square().sum() for p in run.model.parameters()),
    }[how]
    (rec,) = run_windows(P["model"], [micro_batches(P["x"], P["y"], sizes)], insts, objective=objective).flushed
    G = P["G"]
    _close(rec["batch_l2"], G.square().sum(1))
    _close(rec["grad_norm"], G.mean(0).norm())
    for name, g in P["gs"].items():
        _close(rec["sum_grad_squared"][name], g.square().sum(0))
    counts, _, _ = hist_oracle(G, -P["grad_r"], P["grad_r"], HIST_BINS)
    assert torch.equal(rec["grad_hist_1d"].counts, counts)


def test_weight_gradient_comes_from_autograd_for_linear_layers(monkeypatch):
    """GradNorm on Linear layers reuses autograd's dL/dW (no extra matmul), and agrees."""
    import gradlens.kernels.linear as kernels  # (where LinearKernel.reduce looks it up)

    model, x, y = make_problem(MODELS["mlp"])
    calls = []
    orig = kernels._addmm_into
    monkeypatch.setattr(kernels, "_addmm_into", lambda *a: (calls.append(a[1]), orig(*a)))
    rec = run_lens(model, x, y, [12], "mean", [GradNorm()])
    assert calls == []  # every weight's sum came through the autograd node hook
    _close(rec["grad_norm"], flat(per_sample_grads(model, x, y)).mean(0).norm())
