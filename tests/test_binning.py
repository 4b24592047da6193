"""The histograms' one-pass counting (gradlens.instruments.binning) gives the counts of binning
each element by bin_of's rule and counting: pairs of elements per index, the shifted bins of
chunks inside the range, the joint 2D index."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlens.instruments import binning
from gradlens.instruments.binning import bin_of, count_1d, count_2d


def _values(n, lo, hi, seed, spread, dtype, edges, nonfinite):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * spread).to(dtype)
    if edges:  # the ends of the range in the dtype (lo rounded: maybe just below lo) and 0
        x[: min(n, 4)] = torch.tensor([lo, hi, 0.0, -0.0], dtype=dtype)[: min(n, 4)]
    if nonfinite and n > 3:
        x[-3:] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    return x


@settings(max_examples=80, deadline=None)
@given(
    n=st.integers(1, 300), bins=st.integers(1, 200), lo=st.sampled_from([-2.0, -1.0, -0.1, -0.37, 0.0, 0.3]),
    width=st.sampled_from([0.2, 1.0, 2.0, 3.3]), seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.01, 0.3, 3.0]), dtype=st.sampled_from([torch.float32, torch.float64]),
    edges=st.booleans(), nonfinite=st.booleans(),
)
def test_count_1d_equals_binning_each_element(n, bins, lo, width, seed, spread, dtype, edges, nonfinite):
    hi = lo + width
    x = _values(n, lo, hi, seed, spread, dtype, edges, nonfinite)
    inside = x[(x >= lo) & (x <= hi)]  # the comparisons of the caller's check, in the dtype
    direct = binning.DIRECT_COUNT
    try:
        for binning.DIRECT_COUNT in (0, direct):  # the pair bins, then one bincount (small x)
            want = torch.bincount(bin_of(x, lo, hi, bins), minlength=bins)
            assert torch.equal(count_1d(x, lo, hi, bins), want)
            if inside.numel():
                want = torch.bincount(bin_of(inside, lo, hi, bins), minlength=bins)
                assert torch.equal(count_1d(inside, lo, hi, bins, inside=True), want)
    finally:
        binning.DIRECT_COUNT = direct


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 4), o=st.integers(1, 7), i=st.integers(1, 9), pbins=st.integers(1, 9),
    gbins=st.integers(1, 30), lo=st.sampled_from([-1.0, -0.25, 0.0, -0.37]), width=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.float64]),
    edges=st.booleans(), nonfinite=st.booleans(),
)
def test_count_2d_equals_binning_each_element(b, o, i, pbins, gbins, lo, width, seed, dtype, edges, nonfinite):
    hi = lo + width
    x = _values(b * o * i, lo, hi, seed, 0.5, dtype, edges, nonfinite).view(b, o, i)
    pbin = torch.randint(0, pbins, (o, i), generator=torch.Generator().manual_seed(seed + 1))
    want = torch.bincount((pbin * gbins + bin_of(x, lo, hi, gbins)).flatten(), minlength=pbins * gbins)
    got = count_2d(x, (pbin * (gbins + 2)).to(dtype), lo, hi, gbins, pbins)
    assert torch.equal(got.flatten(), want)
    if bool(((x >= lo) & (x <= hi)).all()):
        assert torch.equal(count_2d(x, (pbin * (gbins + 2)).to(dtype), lo, hi, gbins, pbins, inside=True).flatten(), want)
