"""Full coverage on the models people train (issue 8): every instrument == float64 oracle ==
the K = 1 record, on transformers, RNNs, norms, tied weights, custom parameters, a train-mode
BatchNorm ResNet, and Hugging Face / timm models.

Models needing ``transformers`` / ``timm`` carry ``pytest.mark.frameworks`` and run with
``python -m pytest -m frameworks`` in an environment where torchvision imports (README, CI).
One model at a time: ``python -m pytest tests/test_models_oracle.py -k hf_gpt2 -m frameworks``.

The oracle (tests/oracle_models.py) never runs gradlens code; ``test_oracle_*`` check the oracle
itself (its summed per-sample gradients are autograd's batch gradient; vmap == per-sample loop).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, GradNorm, NoiseScaleTwoBatch, SumGradSquared
from oracle import alpha as oracle_alpha
from oracle import hist_oracle, near_edges
from oracle_models import (
    CASES,
    N,
    SPLITS,
    SmallResNet,
    batch_grad_sum,
    flat,
    losses_of_output,
    per_sample_grads,
    per_sample_losses,
    problem,
    slice_batch,
    split_batch,
    tracked_names,
    trainable_names,
)
from windows import all_instruments, run_windows

HIST_BINS = 9  # odd: 0 (and round-off values around it) sits inside a bin, not on an edge
HIST2D_BINS = (5, 7)
LR = 0.1
# The option of Lens that leaves out every parameter whose per-sample gradient is undefined
# (outputs reaching a training-mode BatchNorm). The core's name for it goes here.
BN_LEAVE_OUT = {"undefined": "exclude"}
# MeanGSNR averages G_j^2 / var_j over coordinates with a variance that is not round-off: in
# attention, the key bias's gradient is zero up to round-off (softmax is shift-invariant), and so
# are biases before an InstanceNorm. The oracle drops var_j <= GSNR_FLOOR * max var and asserts
# that no variance ratio falls in GSNR_GAP, so any relative floor in that band gives one value.
GSNR_FLOOR = 1e-23
GSNR_GAP = (1e-30, 1e-16)


def _params(filter_=lambda c: True):
    return [
        pytest.param(name, id=name, marks=[pytest.mark.frameworks] if case.frameworks else [])
        for name, case in CASES.items()
        if filter_(case)
    ]


def _close(a, b, rtol):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale + 1e-300)


def _instruments(grad_r, param_r):
    return all_instruments(grad_r, param_r, bins=HIST_BINS, bins_2d=HIST2D_BINS, leave_out=("NoiseScaleTwoBatch",))


# ------------------------------------------------------------------------------ the oracle itself
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("name", _params())
def test_oracle_sums_to_batch_gradient(name, split):
    """sum_n g_n (per-sample oracle) == autograd's gradient of the micro-batches' summed losses
    (B_k x the token-mean loss for a model's own loss): guards the oracle's units, tied weights
    (functional_call ties them), masks and the sample axis."""
    case, model, (batch, _) = problem(name)
    sizes = SPLITS[split]
    gs = per_sample_grads(case, model, batch, sizes)
    total = batch_grad_sum(case, model, batch, sizes)
    assert list(gs) == list(total) == tracked_names(case, model)
    scale = max(float(t.abs().max()) for t in total.values())
    assert scale > 0
    for k in total:
        assert gs[k].shape == (N, *total[k].shape)
        torch.testing.assert_close(gs[k].sum(0), total[k], rtol=0, atol=10 * case.rtol * scale, msg=k)
    # every tracked parameter gets a non-zero gradient from these data (nothing unused)
    assert all(float(g.abs().max()) > 0 for g in gs.values()), [k for k, g in gs.items() if not g.any()]


@pytest.mark.parametrize("name", _params(lambda c: c.oracle == "vmap"))
def test_oracle_vmap_equals_per_sample_loop(name):
    case, model, (batch, _) = problem(name)
    a = per_sample_grads(case, model, batch, method="vmap")
    b = per_sample_grads(case, model, batch, method="loop")
    A, B = flat(a), flat(b)
    torch.testing.assert_close(A, B, rtol=0, atol=1e-13 * float(B.abs().max()))


def test_oracle_units_of_a_token_mean_loss():
    """The scale B v_n / V of a token-mean loss, on a hand-checkable example: 2 samples with
    3 and 1 valid tokens -> factors 2*3/4 and 2*1/4."""
    from oracle_models import _scales

    case = CASES["hf_gpt2_padded"]
    labels = torch.tensor([[5, 6, 7, 8], [5, 6, -100, -100]])
    s = _scales(case, {"labels": labels}, [2])
    assert s.tolist() == [1.5, 0.5]


# ------------------------------------------------------------------------------ gradlens runs
def run_lens(case, model0, windows, sizes, reduction, instruments, lens_kwargs=None):
    """Windows of data through a Lens (SGD with the exact window gradient); returns
    (lens, [theta_0, theta_1, ...]) with the parameters at each window's start."""
    ce = case.kind == "ce"  # else the model's own loss (a token mean): the reduction is stated
    r = run_windows(
        model0, [split_batch(case, batch, sizes) for batch in windows], instruments,
        loss="ce" if ce else (lambda out, mb: out.loss), reduction=reduction,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), accumulate="exact", snapshots=True,
        forward=case.call, target=(lambda mb: mb["y"]) if ce else (lambda mb: mb),
        size=lambda mb: len(mb["y"] if ce else mb["labels"]),
        losses=lambda out, mb: losses_of_output(case, out, mb), capture=None if ce else {"reduction": "mean"},
        **(lens_kwargs or {}),
    )
    return r.lens, r.thetas


def oracle_values(case, thetas, windows, sizes, reduction):
    """Every record value of window 0 from the oracle (needs window 1 for Alpha's end point)."""
    names = tracked_names(case, thetas[0])
    gs = per_sample_grads(case, thetas[0], windows[0], sizes)
    G0 = flat(gs)
    G1 = flat(per_sample_grads(case, thetas[1], windows[1], sizes))
    p0, p1 = dict(thetas[0].named_parameters()), dict(thetas[1].named_parameters())
    d = torch.cat([(p1[k] - p0[k]).detach().flatten() for k in names])
    theta = torch.cat([p0[k].detach().flatten() for k in names])
    l0 = per_sample_losses(case, thetas[0], windows[0], sizes)
    l1 = per_sample_losses(case, thetas[1], windows[1], sizes)
    n = G0.shape[0]
    mean = G0.mean(0)
    var = G0.var(0)
    trace = var.sum()
    ratio = var / var.max()
    assert not ((ratio > GSNR_GAP[0]) & (ratio < GSNR_GAP[1])).any(), "no clear round-off gap"
    ok = ratio > GSNR_FLOOR
    g2 = mean.square().sum()
    p = G0 @ mean
    orth = G0 - (p / g2)[:, None] * mean[None, :]
    sq = d.dot(d)
    ps, pe = G0 @ d, G1 @ d
    return {
        "names": names, "gs": gs, "G": G0, "theta": theta,
        "loss": l0.mean() if reduction == "mean" else l0.sum(),
        "batch_l2": G0.square().sum(1),
        "grad_norm": (mean if reduction == "mean" else G0.sum(0)).norm(),
        "noise_scale": trace / g2,
        "norm_test": (trace / n).sqrt() / mean.norm(),
        "mean_gsnr": (mean[ok].square() / var[ok]).mean(),
        "batch_dot": G0 @ G0.T,
        "inner_test": (p.var() / n).sqrt() / g2,
        "ortho_test": (orth.square().sum() / (n - 1) / (n * g2)).sqrt(),
        "start": ps / sq, "end": pe / sq, "update_sq_norm": sq,
        "alpha": oracle_alpha(
            sq, (l0.mean(), l1.mean()), (ps.mean(), pe.mean()),
            (l0.var() / len(l0), l1.var() / len(l1)), (ps.var() / n, pe.var() / len(pe)),
        ),
    }


def check_hist_1d(h, G, r, rtol):
    counts, low, high = hist_oracle(G, -r, r, HIST_BINS)
    amb = near_edges(G, -r, r, HIST_BINS, rtol) if rtol > 1e-9 else 0
    assert h.total == G.numel()
    assert int((h.counts - counts).abs().sum()) <= 2 * amb, (h.counts, counts)
    assert abs(h.clamped_low - low) + abs(h.clamped_high - high) <= amb
    assert low + high > 0, "test range should clamp some values"


def check_hist_2d(h2, theta, G, pr, r, rtol):
    pb, gb = HIST2D_BINS
    pidx = torch.floor((theta + pr) * pb / (2 * pr)).clamp(0, pb - 1).long()
    gidx = torch.floor((G + r) * gb / (2 * r)).clamp(0, gb - 1).long()
    joint = torch.bincount((pidx * gb + gidx).flatten(), minlength=pb * gb).view(pb, gb)
    amb = near_edges(G, -r, r, gb, rtol) if rtol > 1e-9 else 0
    assert int((h2.counts - joint).abs().sum()) <= 2 * amb, (h2.counts, joint)
    assert h2.clamped_param == G.shape[0] * int(((theta < -pr) | (theta > pr)).sum())
    assert h2.clamped_param > 0


def check_record(rec, o, case, reduction, grad_r, param_r):
    rtol = case.rtol
    n = o["G"].shape[0]
    assert rec.num_samples == n
    _close(rec["batch_l2"], o["batch_l2"], rtol)
    assert set(rec["sum_grad_squared"]) == set(o["names"])  # one key per parameter, tied once
    # relative to the largest sum: a parameter whose exact gradient is 0 (a bias before a norm)
    # is 0 up to rounding in both computations
    scale = max(float(g.square().sum(0).abs().max()) for g in o["gs"].values())
    for name, g in o["gs"].items():
        torch.testing.assert_close(
            rec["sum_grad_squared"][name], g.square().sum(0), rtol=rtol, atol=rtol * scale
        )
    for key in ("grad_norm", "noise_scale", "norm_test", "mean_gsnr", "batch_dot", "inner_test", "ortho_test"):
        try:
            _close(rec[key], o[key], rtol)
        except AssertionError as e:
            raise AssertionError(f"{key}: {e}") from None
    if case.kind == "ce":
        _close(rec["loss"], o["loss"], rtol)
    check_hist_1d(rec["grad_hist_1d"], o["G"], grad_r, rtol)
    check_hist_2d(rec["grad_hist_2d"], o["theta"], o["G"], param_r, grad_r, rtol)
    for key in ("batch_dot", "inner_test", "ortho_test", "alpha"):
        assert rec.meta[key] == "exact", (key, rec.meta[key])
    sp = rec["search_dir_projections"]
    for key in ("start", "end", "update_sq_norm"):
        _close(sp[key], o[key], rtol)
    assert rec["alpha"] is not None and math.isfinite(rec["alpha"])
    _close(rec["alpha"], o["alpha"], max(1e-7, 100 * rtol))


def check_same_record(a, b, case, G, grad_r):
    """K micro-steps report what one batch of N reports."""
    rtol = case.rtol
    amb = near_edges(G, -grad_r, grad_r, max(HIST_BINS, *HIST2D_BINS), rtol) if rtol > 1e-9 else 0
    for key in b.keys():
        x, y = a[key], b[key]
        if isinstance(x, (gradlens.Hist1d, gradlens.Hist2d)):
            assert int((x.counts - y.counts).abs().sum()) <= 2 * amb, key
        elif isinstance(x, dict):
            assert set(x) == set(y)
            scale = max(float(torch.as_tensor(v).abs().max()) for v in y.values())
            for k in x:  # relative to the largest entry (exact zeros are 0 up to rounding)
                torch.testing.assert_close(torch.as_tensor(x[k]), torch.as_tensor(y[k]), rtol=rtol, atol=rtol * scale)
        elif x is None or y is None:
            assert x is y, key
        else:
            _close(x, y, max(1e-7, 100 * rtol) if key == "alpha" else rtol)


def _coverage_value(rec):
    return float(rec.meta["coverage"])


def check_coverage(lens, rec, case, model):
    trainable = trainable_names(model)
    tracked = tracked_names(case, model)
    assert len(lens.tracked) == len(set(lens.tracked))
    assert set(lens.tracked) == set(tracked)
    numel = dict((k, p.numel()) for k, p in model.named_parameters())
    frac = sum(numel[k] for k in tracked) / sum(numel[k] for k in trainable)
    assert lens.coverage == pytest.approx(frac, rel=1e-12)
    assert _coverage_value(rec) == pytest.approx(frac, rel=1e-12)
    if case.trackable is None:
        assert lens.coverage == 1.0


def _reductions(case):
    return ["mean"] if case.kind == "hf_lm" else ["mean", "sum"]


_PARAMS = [
    pytest.param(name, red, id=f"{name}-{red}", marks=[pytest.mark.frameworks] if case.frameworks else [])
    for name, case in CASES.items()
    for red in _reductions(case)
]


@pytest.mark.parametrize("name,reduction", _PARAMS)
def test_every_instrument_matches_oracle_and_single_batch(name, reduction):
    """Two windows (Alpha needs the second) with K = 3 unequal micro-steps [5, 1, 6] and with
    K = 1: each record == the oracle on the same micro-steps; where the model treats samples
    alike in both (no train-mode BatchNorm, no token-count normalisation) K = 3 == K = 1."""
    case, model, windows = problem(name)
    G = flat(per_sample_grads(case, model, windows[0]))
    grad_r = 0.4987 * float(G.abs().max())  # not a round number: no element sits on an edge
    names = tracked_names(case, model)
    params = dict(model.named_parameters())
    param_r = 0.4987 * max(float(params[k].detach().abs().max()) for k in names)
    kwargs = BN_LEAVE_OUT if case.trackable is not None else None
    recs = {}
    for split in ("K3-unequal", "K1"):
        sizes = SPLITS[split]
        lens, thetas = run_lens(case, model, windows, sizes, reduction, _instruments(grad_r, param_r), kwargs)
        rec = lens.records[0]
        assert rec.micro_steps == len(sizes) and len(lens.records) == 2
        check_coverage(lens, rec, case, model)
        check_record(rec, oracle_values(case, thetas, windows, sizes, reduction), case, reduction, grad_r, param_r)
        recs[split] = rec
    if case.split_invariant:
        check_same_record(recs["K3-unequal"], recs["K1"], case, G, grad_r)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_small_parameters_on_micro_batches_2_3_1(reduction):
    """Issue 42: 0-dim and [1]-shaped parameters (a temperature multiplying the logits, a bias
    added, a scale, a 0-dim gate used twice) through every instrument with micro-batches
    2, 3, 1 (6 samples of each window) == the oracle, and == one micro-batch of 6."""
    case, model, windows = problem("scalar_params")
    windows = [slice_batch(case, w, 0, 6) for w in windows]
    G = flat(per_sample_grads(case, model, windows[0], [6]))
    assert {p.dim() for p in model.parameters()} >= {0, 1}
    grad_r = 0.4987 * float(G.abs().max())
    names = tracked_names(case, model)
    params = dict(model.named_parameters())
    param_r = 0.4987 * max(float(params[k].detach().abs().max()) for k in names)
    recs = {}
    for sizes in ([2, 3, 1], [6]):
        lens, thetas = run_lens(case, model, windows, sizes, reduction, _instruments(grad_r, param_r))
        rec = lens.records[0]
        assert rec.micro_steps == len(sizes)
        check_coverage(lens, rec, case, model)
        check_record(rec, oracle_values(case, thetas, windows, sizes, reduction), case, reduction, grad_r, param_r)
        recs[len(sizes)] = rec
    check_same_record(recs[3], recs[1], case, G, grad_r)


@pytest.mark.parametrize("name,reduction", _PARAMS)
def test_batch_dot_alone_matches_oracle(name, reduction):
    """BatchDot as the only instrument keeps output gradients unscaled with their micro-step's
    scale (no per-use copy): K = 3 unequal micro-steps and K = 1 == the oracle's Gram."""
    case, model, windows = problem(name)
    kwargs = BN_LEAVE_OUT if case.trackable is not None else None
    for split in ("K3-unequal", "K1"):
        sizes = SPLITS[split]
        lens, thetas = run_lens(case, model, windows, sizes, reduction, [BatchDot()], kwargs)
        assert lens._meter.plan.carry_scale
        G = flat(per_sample_grads(case, thetas[0], windows[0], sizes))
        _close(lens.records[0]["batch_dot"], G @ G.T, case.rtol)


@pytest.mark.parametrize("name", _params(lambda c: c.trackable is None))
def test_full_coverage_without_exclusions(name):
    """Every trainable parameter tracked, none excluded: lens.tracked, lens.coverage == 1.0,
    the record's meta, and repr(lens) says so."""
    case, model, (batch, _) = problem(name)
    model = gradlens.extend(copy.deepcopy(model))
    lens = Lens(model, [BatchL2(), SumGradSquared()])
    assert set(lens.tracked) == set(trainable_names(model))
    assert lens.coverage == 1.0
    ce = case.kind == "ce"
    (rec,) = run_windows(model, [split_batch(case, batch, [4])[:1]], lens=lens, fresh_copy=False, close=False,
                         forward=case.call, loss="ce" if ce else (lambda out, mb: out.loss),
                         target=(lambda mb: mb["y"]) if ce else (lambda mb: mb),
                         capture=None if ce else {"reduction": "mean"}).flushed
    assert _coverage_value(rec) == 1.0
    assert set(rec["sum_grad_squared"]) == set(trainable_names(model))
    assert "100" in repr(lens) or "1.0" in repr(lens), repr(lens)
    lens.close()


# ------------------------------------------------------------------------------ train-mode BatchNorm
def test_train_mode_batchnorm_names_every_undefined_parameter_at_once():
    """A ResNet in training mode: one error (at Lens creation or, at the latest, the first
    tracked micro-step) names every parameter whose output reaches a training-mode BatchNorm,
    states the tracked fraction and offers the option that leaves them all out."""
    case, model, windows = problem("resnet_bn_train")
    undefined = [k for k in trainable_names(model) if k not in SmallResNet.TRACKABLE]
    assert len(undefined) == 16
    with pytest.raises((ValueError, RuntimeError)) as info:
        run_lens(case, model, windows[:1], [12], "mean", [BatchL2()])
    msg = str(info.value)
    assert [k for k in undefined if k not in msg] == []
    key = next(iter(BN_LEAVE_OUT))
    assert key in msg, msg
    assert "%" in msg, msg  # the tracked fraction


def test_train_mode_batchnorm_leave_out_option_tracks_last_batchnorm_and_head():
    case, model, windows = problem("resnet_bn_train")
    # which parameters reach a training-mode BatchNorm shows in the first tracked forward
    lens = run_windows(model, [split_batch(case, windows[0], [len(windows[0]["y"])])], [BatchL2()],
                       forward=case.call, target=lambda mb: mb["y"], loss=F.cross_entropy,
                       capture={"reduction": "mean"}, pass_loss=True, end="none", close=False,
                       **BN_LEAVE_OUT).lens
    assert set(lens.tracked) == set(SmallResNet.TRACKABLE)
    numel = {k: p.numel() for k, p in model.named_parameters()}
    assert lens.coverage == pytest.approx(
        sum(numel[k] for k in SmallResNet.TRACKABLE) / sum(numel.values()), rel=1e-12
    )
    assert 0 < lens.coverage < 0.1
    lens.close()


# ------------------------------------------------------------------------------ scaled functional loss
@pytest.mark.parametrize("how", ["divide-by-2", "times-3.7", "divide-by-K"])
def test_scaled_functional_loss_keeps_units_or_refuses(how):
    """A functional loss the user scales, under ``capture(reduction="mean")``: the record is in
    the units of DESIGN.md (the multiplier divided out) or the capture refuses with an error;
    never a silently rescaled number (before issue 8: grad_norm 50% off for ``/ 2``)."""
    case, model, (batch, _) = problem("custom_params")
    sizes = [5, 1, 6]
    G = flat(per_sample_grads(case, model, batch, sizes))
    objective = {"divide-by-2": lambda loss, run, w, k: loss / 2, "times-3.7": lambda loss, run, w, k: loss * 3.7,
                 "divide-by-K": lambda loss, run, w, k: loss / len(sizes)}[how]
    try:
        (rec,) = run_windows(model, [split_batch(case, batch, sizes)], [BatchL2(), GradNorm()], forward=case.call,
                             target=lambda mb: mb["y"], loss=F.cross_entropy, objective=objective,
                             capture={"reduction": "mean"}, close=False).flushed
    except (ValueError, RuntimeError) as e:
        assert "reduction" in str(e) or "scale" in str(e), str(e)
        return
    _close(rec["batch_l2"], G.square().sum(1), 1e-10)
    _close(rec["grad_norm"], G.mean(0).norm(), 1e-10)


@pytest.mark.parametrize("name", _params())
def test_light_capture_equals_autograd_micro_batch_gradients(name):
    """GradNorm + NoiseScaleTwoBatch alone hook the parameters only (light capture): every
    trainable parameter of every model, train-mode BatchNorm included, no exclusion. Oracle:
    float64 autograd on whole micro-batches, s_k = sum of the micro-batch's g_n (B_k x the
    gradient of a mean loss), G = sum_k s_k; grad_norm = ||G|| / N, and the two-batch estimates
    from S = sum_k ||s_k||^2 and T = ||G||^2 (unequal micro-batches [5, 1, 6])."""
    from gradlens.capture import ParamTap
    from oracle_models import _clean_copy, split_batch, trainable_names

    case, model, windows = problem(name)
    sizes = SPLITS["K3-unequal"]
    lens, thetas = run_lens(case, model, windows, sizes, "mean", [GradNorm(), NoiseScaleTwoBatch()])
    assert isinstance(lens._tap, ParamTap) and lens.coverage == 1.0
    rec = lens.records[0]
    ref = _clean_copy(thetas[0])
    params = dict(ref.named_parameters())
    names = trainable_names(ref)
    S, G = 0.0, None
    for mb in split_batch(case, windows[0], sizes):
        if case.kind == "hf_lm":
            loss = len(mb["labels"]) * case.call(ref, mb).loss
        else:
            loss = F.cross_entropy(case.call(ref, mb), mb["y"], reduction="sum")
        s_k = torch.cat([g.flatten() for g in torch.autograd.grad(loss, [params[k] for k in names])])
        S += float(s_k.square().sum())
        G = s_k if G is None else G + s_k
    n, q = sum(sizes), sum(b * b for b in sizes)
    T = float(G.square().sum())
    _close(rec["grad_norm"], math.sqrt(T) / n, case.rtol)
    g2 = (T - S) / (n * n - q)
    got = rec["noise_scale_two_batch"]
    _close(got["grad_sq"], g2, max(case.rtol, 1e-9) * T / abs(g2))  # a difference of sums
    _close(got["trace_sigma"], (S - q * g2) / n, max(case.rtol, 1e-9) * S / abs((S - q * g2) / n))
