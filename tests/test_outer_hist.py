"""The sorted-factor histogram equals binning the materialised products, element for element."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlens.instruments.binning import bin_of
from gradlens.instruments.outer_hist import outer_hist1d


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 4),
    o=st.integers(12, 20),
    i=st.integers(1, 17),
    bins=st.integers(1, 12),
    lo=st.floats(-2.0, 0.0),
    width=st.floats(0.01, 3.0),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.float64]),
    ties=st.booleans(),
)
def test_outer_hist_matches_materialised(b, o, i, bins, lo, width, seed, dtype, ties):
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(b, o, generator=gen, dtype=dtype) * (torch.rand(b, o, generator=gen) > 0.3)
    a = torch.randn(b, i, generator=gen, dtype=dtype)
    if ties:  # many equal values, exact zeros, products landing exactly on edges
        a, delta = a.round(), (delta * 4).round() / 4
    hi = lo + width
    out = outer_hist1d(delta, a, lo, hi, bins, max_cost=1e9)
    assert out is not None
    counts, low, high = out
    g = torch.einsum("no,ni->noi", delta, a).flatten()
    assert torch.equal(counts, torch.bincount(bin_of(g, lo, hi, bins), minlength=bins))
    assert int(low) == int((g < lo).sum())
    assert int(high) == int((g > hi).sum())


def test_gives_up_when_rows_span_many_bins_or_are_few():
    delta, a = torch.randn(4, 64), torch.randn(4, 100)
    assert outer_hist1d(delta, a, -1e-4, 1e-4, 1000) is None
    assert outer_hist1d(torch.randn(4, 3), a, -1.0, 1.0, 10) is None  # 3 rows: not worth a sort


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    o=st.integers(1, 6),
    i=st.integers(1, 9),
    seed=st.integers(0, 10_000),
    grad_width=st.floats(0.05, 4.0),
    ties=st.booleans(),
)
def test_hist2d_factor_path_equals_materialised(b, o, i, seed, grad_width, ties):
    from gradlens.instruments import GradHist2d

    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(o, i, generator=gen, dtype=torch.float64)
    delta = torch.randn(b, o, generator=gen, dtype=torch.float64) * (torch.rand(b, o, generator=gen) > 0.4)
    a = torch.randn(b, i, generator=gen, dtype=torch.float64)
    if ties:
        a, delta = a.round(), (delta * 4).round() / 4
    rng = ((-1.0, 1.0), (-grad_width / 2, grad_width))
    fast, slow = GradHist2d(bins=(5, 7), range=rng), GradHist2d(bins=(5, 7), range=rng)
    fast.max_rows_one_by_one = 1.0  # always the factor path, however many rows go one by one
    s_fast, s_slow = fast.start_window(), slow.start_window()
    assert fast.update_outer(s_fast, "w", param, delta, a)
    slow.update(s_slow, "w", param, torch.einsum("no,ni->noi", delta, a))
    assert torch.equal(s_fast.counts, s_slow.counts)
    assert int(s_fast.clamped_grad) == int(s_slow.clamped_grad)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 400), bins=st.integers(1, 12), lo=st.sampled_from([-3.0, -2.0, -1.25, -0.5, 0.0]),
    width=st.sampled_from([0.5, 1.0, 2.5, 4.0, 6.0]),
    seed=st.integers(0, 2**16), spread=st.sampled_from([0.05, 1.0, 5.0]), nan=st.booleans(),
    dense=st.booleans(),
)
def test_dense_histograms_equal_oracle_inside_and_outside_the_range(n, bins, lo, width, seed, spread, nan, dense):
    """GradHist1d / GradHist2d's dense update: a chunk with every element inside [lo, hi] takes
    the short path (no per-element clamp checks), others the full one; both give the oracle's
    counts by exact edges and the exact clamped counts (edge values and NaN included)."""
    from gradlens.instruments import GradHist1d, GradHist2d
    from oracle import hist_oracle

    hi = lo + width
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * spread).float()
    if dense:  # values exactly on the range's ends and on the zero edge
        x[: min(n, 3)] = torch.tensor([lo, hi, 0.0])[: min(n, 3)]
    if nan:
        x[-1] = float("nan")
    param = torch.zeros(n)
    h1 = GradHist1d(bins=bins, range=(lo, hi))
    s1 = h1.start_window()
    for chunk in x.split(97):
        h1.update(s1, "p", param[: len(chunk)], chunk.view(1, -1))
    want, low, high = hist_oracle(x, lo, hi, bins)  # NaN: in the last bin and clamped high
    assert torch.equal(s1.counts.to(torch.int64), want)
    assert (int(s1.low), int(s1.high)) == (low, high)
    h2 = GradHist2d(bins=(1, bins), range=((-1.0, 1.0), (lo, hi)))
    s2 = h2.start_window()
    h2.update(s2, "p", param, x.view(1, -1))
    assert torch.equal(s2.counts.reshape(-1).to(torch.int64), want)
    assert int(s2.clamped_grad) == low + high


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 3), i=st.integers(1, 60), bins=st.integers(2, 40),
    lo=st.sampled_from([-1.0, -0.1, -0.37, 0.0, 0.2]), width=st.sampled_from([0.05, 0.3, 1.0, 2.5]),
    seed=st.integers(0, 10_000), guess=st.sampled_from(["zero", "all", "random"]),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_outer_hist_exact_whatever_the_search_guesses(b, i, bins, lo, width, seed, guess, dtype):
    """The positions read by searchsorted are only a first guess: with a wrong guess (every
    position 0, every position I, random) the checks and the binary search still give the
    materialised counts element for element."""
    import math
    import gradlens.instruments.outer_hist as oh

    o = 2 * max(1, math.ceil(math.log2(i + 1))) + 3
    gen = torch.Generator().manual_seed(seed)
    delta = torch.randn(b, o, generator=gen, dtype=dtype) * (torch.rand(b, o, generator=gen) > 0.2) * 0.3
    a = torch.randn(b, i, generator=gen, dtype=dtype)
    if seed % 2:
        a = a.round()  # runs of equal inputs
    hi = lo + width

    def wrong(tab, t, x):
        w = tab.shape[1]
        if guess == "zero":
            return torch.zeros_like(t)
        if guess == "all":
            return torch.full_like(t, w)
        return torch.randint(0, w + 1, t.shape, generator=torch.Generator().manual_seed(seed))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(oh, "_below", wrong)
        counts, low, high = oh.outer_hist1d(delta, a, lo, hi, bins, max_cost=1e9)
    g = torch.einsum("no,ni->noi", delta, a).flatten()
    assert torch.equal(counts, torch.bincount(bin_of(g, lo, hi, bins), minlength=bins))
    assert int(low) == int((g < lo).sum())
    assert int(high) == int((g > hi).sum())


@settings(max_examples=40, deadline=None)
@given(
    bins=st.integers(1, 300), lo=st.floats(-3.0, 1.0), width=st.floats(1e-3, 10.0),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_bin_thresholds_are_the_first_value_of_each_bin(bins, lo, width, dtype):
    """``x < T[k]`` exactly when ``bin_of(x) < k``: at T[k] itself and at the value just below."""
    from gradlens.instruments.outer_hist import bin_thresholds

    hi = lo + width
    t = bin_thresholds(lo, hi, bins, dtype, torch.device("cpu"))
    assert t is not None and t.dtype == dtype
    k = torch.arange(1, bins)
    inner = t[1:bins]
    below = inner.nextafter(torch.tensor(-float("inf"), dtype=dtype))
    assert (bin_of(inner, lo, hi, bins) >= k).all()
    assert (bin_of(below, lo, hi, bins) < k).all()
    assert t[0] == -float("inf") and t[bins] == float("inf")


def test_edges_below_the_dtype_resolution_fall_back_to_materialising(monkeypatch):
    """A range whose bins are narrower than float32 can resolve there has no exact thresholds:
    the sorted-factor path declines (None) and the histogram materialises, still exact (with
    torch's counting; the compiled loop counts the products from the factors instead, the same)."""
    from gradlens.instruments import GradHist1d, native_bins
    from gradlens.instruments.outer_hist import bin_thresholds

    monkeypatch.setattr(native_bins, "_lib", False)  # torch's counting (as without a C compiler)

    lo, hi = 1000.0, 1000.0 + 1e-4  # float32 spacing near 1000 is 6e-5
    assert bin_thresholds(lo, hi, 64, torch.float32, torch.device("cpu")) is None
    assert bin_thresholds(lo, hi, 64, torch.float64, torch.device("cpu")) is not None
    gen = torch.Generator().manual_seed(0)
    delta = torch.full((3, 40), 1000.0) + 6.1e-5 * torch.randint(0, 3, (3, 40), generator=gen)
    a = 1.0 + 1.2e-7 * torch.randint(0, 2, (3, 30), generator=gen)  # rows span two float32 steps
    assert outer_hist1d(delta, a, lo, hi, 64, max_cost=1e9) is None
    h = GradHist1d(bins=64, range=(lo, hi))
    s = h.start_window()
    assert not h.update_outer(s, "w", torch.zeros(40, 30), delta, a)
    g = torch.einsum("no,ni->noi", delta, a)
    h.update(s, "w", torch.zeros(40, 30), g)
    assert torch.equal(s.counts, torch.bincount(bin_of(g.flatten(), lo, hi, 64), minlength=64))
    assert int(s.low) == int((g < lo).sum()) and int(s.high) == int((g > hi).sum())
    monkeypatch.undo()
    assert native_bins.available()
    s2 = h.start_window()
    assert h.update_outer(s2, "w", torch.zeros(40, 30), delta, a)  # the loop, from the factors
    assert torch.equal(s2.counts, s.counts) and (int(s2.low), int(s2.high)) == (int(s.low), int(s.high))
