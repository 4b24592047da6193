"""Sampled histograms (issue 10): ``GradHist1d(sample=...)`` / ``GradHist2d(sample=...)``.

Unbiasedness is checked statistically against the float64 oracle's exact counts: over many
windows (each drawing afresh) the mean of the estimates lies within a few standard errors of
the truth in every bin, and the recorded standard errors match the spread of the estimates.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens, kernels
from gradlens.instruments import GradHist1d, GradHist2d
from gradlens.core.records import record_from_json, record_to_json

from oracle import bins_oracle, flat, hist_oracle, per_sample_grads
from windows import micro_batches, run_windows


class Tokens(nn.Module):
    """Embedding, LayerNorm and a Linear over a sequence axis, then a classifier."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 6)
        self.ln = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 6)
        self.out = nn.Linear(6, 4)

    def forward(self, ids):
        return self.out(torch.tanh(self.mix(self.ln(self.emb(ids)))).mean(1))


def _cnn():
    return nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 3 * 3, 4))


def _mlp():
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 4))


PROBLEMS = {
    "mlp": (_mlp, lambda n: torch.randn(n, 5, dtype=torch.float64)),
    "cnn": (_cnn, lambda n: torch.randn(n, 2, 6, 6, dtype=torch.float64)),
    "tokens": (Tokens, lambda n: torch.randint(0, 9, (n, 5))),
}
SPLIT = (5, 7)
N = sum(SPLIT)
G_RANGE, G_BINS = (-0.3, 0.3), 6
P_RANGE, P_BINS = (-0.5, 0.5), 3


def _problem(name):
    make, data = PROBLEMS[name]
    torch.manual_seed(0)
    model = make().double()
    torch.manual_seed(1)
    return model, data(N), torch.randint(0, 4, (N,))


def _windows(model, x, y, instruments, windows):
    """``windows`` windows over the same data and parameters (each draws afresh)."""
    return run_windows(model, [micro_batches(x, y, SPLIT)] * windows, instruments, fresh_copy=False,
                       zero_grad=True).flushed


def _check_unbiased(est: torch.Tensor, se: torch.Tensor, exact: torch.Tensor):
    """est, se: [S, bins]; exact: [bins]."""
    s = est.shape[0]
    exact = exact.double()
    spread = se.square().mean(0).sqrt()  # typical standard error per bin
    tested = spread > 0
    assert bool(tested.any())
    # (a) no bias: the mean of S estimates is within 4.5 of its standard errors of the truth
    z_mean = (est.mean(0) - exact)[tested] / (spread[tested] / math.sqrt(s))
    assert z_mean.abs().max() < 4.5, (est.mean(0), exact, z_mean)
    # (b) the recorded standard errors describe the spread of the estimates
    ratio = (est - exact).square().mean(0)[tested].sum() / se.square().mean(0)[tested].sum()
    assert 0.75 < float(ratio) < 1.33, float(ratio)
    # bins that are empty in truth are estimated as exactly empty
    assert bool((est[:, exact == 0] == 0).all())


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_sampled_counts_are_unbiased_within_their_standard_error(name):
    model, x, y = _problem(name)
    G = flat(per_sample_grads(copy.deepcopy(model), x, y))  # [N, D] float64 oracle
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    exact1, _, _ = hist_oracle(G, *G_RANGE, G_BINS)
    pb, gb = bins_oracle(theta, *P_RANGE, P_BINS), bins_oracle(G, *G_RANGE, G_BINS)
    exact2 = torch.bincount((pb[None, :] * G_BINS + gb).reshape(-1), minlength=P_BINS * G_BINS)
    S = 300
    recs = _windows(model, x, y, [
        GradHist1d(bins=G_BINS, range=G_RANGE, sample=0.05, seed=11),
        GradHist2d(bins=(P_BINS, G_BINS), range=(P_RANGE, G_RANGE), sample=0.05, seed=12),
    ], S)
    h1 = [r["grad_hist_1d"] for r in recs]
    h2 = [r["grad_hist_2d"] for r in recs]
    assert all(h.sample == 0.05 and h.counts.dtype == torch.float64 for h in h1 + h2)
    assert all(h.total == pytest.approx(G.numel()) for h in h1)
    _check_unbiased(torch.stack([h.counts for h in h1]), torch.stack([h.stderr for h in h1]), exact1)
    _check_unbiased(torch.stack([h.counts.reshape(-1) for h in h2]),
                    torch.stack([h.stderr.reshape(-1) for h in h2]), exact2)
    assert len({tuple(h.counts.tolist()) for h in h1}) > S // 2  # every window draws afresh


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_sampled_mode_never_forms_per_sample_gradients_of_factored_layers(name, monkeypatch):
    """Linear, Conv2d and Embedding entries come from their factors: per_sample is not called
    for them (LayerNorm, a small layer, may materialise)."""
    for cls in (kernels.LinearKernel, kernels.Conv2dKernel, kernels.EmbeddingKernel):
        def refuse(self, *args, **kwargs):
            raise AssertionError(f"{type(self).__name__}.per_sample called in sampled mode")
        monkeypatch.setattr(cls, "per_sample", refuse)
    model, x, y = _problem(name)
    recs = _windows(model, x, y, [GradHist1d(sample=0.1), GradHist2d(sample=0.1)], 2)
    assert recs[-1]["grad_hist_1d"].stderr is not None


def test_sampling_leaves_the_global_random_state_alone_and_resumes_its_stream():
    model, x, y = _problem("mlp")
    make = lambda: [GradHist1d(bins=G_BINS, range=G_RANGE, sample=0.2, seed=5)]  # noqa: E731
    before = torch.get_rng_state()
    full = _windows(copy.deepcopy(model), x, y, make(), 3)
    assert torch.equal(before, torch.get_rng_state())
    assert full[0]["grad_hist_1d"] != full[1]["grad_hist_1d"]

    lens = run_windows(model, [micro_batches(x, y, SPLIT)] * 2, make(), close=False).lens
    saved = lens.state_dict()
    lens.close()
    (rec,) = run_windows(model, [micro_batches(x, y, SPLIT)], make(), state=saved, close=False).flushed
    assert rec["grad_hist_1d"] == full[2]["grad_hist_1d"]


def test_a_sampled_record_survives_the_log():
    model, x, y = _problem("cnn")
    rec = _windows(model, x, y, [GradHist1d(sample=0.3), GradHist2d(sample=0.3)], 1)[0]
    back = record_from_json(record_to_json(rec))
    assert back["grad_hist_1d"] == rec["grad_hist_1d"] and back["grad_hist_2d"] == rec["grad_hist_2d"]
    assert back["grad_hist_2d"].stderr.shape == back["grad_hist_2d"].counts.shape


@pytest.mark.parametrize("bad", [0, 1, 1.5, -0.1, True, "1%"])
def test_sample_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match=r"0 < sample < 1"):
        GradHist1d(sample=bad)
    with pytest.raises(ValueError, match=r"0 < sample < 1"):
        GradHist2d(sample=bad)


def test_seed_must_be_a_non_negative_int():
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        GradHist1d(sample=0.1, seed=-1)


def test_the_cost_falls_with_the_fraction():
    """Per stratum, fraction x D coordinates (rounded up to a multiple of 32) of every sample."""
    model, x, y = _problem("mlp")
    seen = []
    real = kernels.LinearKernel.entries

    def counting(self, module, a, delta, attr, j):
        out = real(self, module, a, delta, attr, j)
        seen.append(out.numel())
        return out

    kernels.LinearKernel.entries = counting
    try:
        _windows(model, x, y, [GradHist1d(sample=0.01)], 1)
    finally:
        kernels.LinearKernel.entries = real
    per_stratum = [b * 32 * math.ceil(0.01 * p.numel() / 32) for b in SPLIT for p in model.parameters()]
    assert sorted(seen) == sorted(per_stratum)


def test_exact_mode_is_unchanged_by_the_option():
    model, x, y = _problem("tokens")
    G = flat(per_sample_grads(copy.deepcopy(model), x, y))
    rec = _windows(model, x, y, [GradHist1d(bins=G_BINS, range=G_RANGE)], 1)[0]["grad_hist_1d"]
    counts, low, high = hist_oracle(G, *G_RANGE, G_BINS)
    assert rec.stderr is None and rec.sample is None
    assert torch.equal(rec.counts, counts) and (rec.clamped_low, rec.clamped_high) == (low, high)


def test_ranks_draw_independent_coordinates(monkeypatch):
    """Under torch.distributed each rank draws its own coordinates (same seed, other rank):
    the ranks' estimates are independent, as the summed variance assumes."""
    from gradlens.instruments import sampling

    draws = {}
    for rank in (0, 1):
        monkeypatch.setattr(sampling, "_rank", lambda rank=rank: rank)
        d = sampling.Draws(seed=3)
        draws[rank] = [d.coordinates(10_000, 0.01, "cpu") for _ in range(2)]
    assert not torch.equal(draws[0][0], draws[1][0])
    assert not torch.equal(draws[0][0], draws[0][1])  # and every draw afresh
    again = sampling.Draws(seed=3)
    assert torch.equal(again.coordinates(10_000, 0.01, "cpu"), draws[1][0])  # reproducible
