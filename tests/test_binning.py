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


def _oracle_bins(v, lo, hi, bins):
    """Float64 bins by the documented rule from the float64 edges (independent of bin_of)."""
    edges = torch.tensor([lo + (hi - lo) * k / bins for k in range(1, bins)], dtype=torch.float64)
    edges[edges.abs() < 1e-12 * (hi - lo)] = 0.0
    return torch.searchsorted(edges, v.double().nan_to_num(nan=float("inf")), right=True)


def test_count_2d_equals_float64_oracle_on_edges():
    """The 2D counts (count_2d, and GradHist2d's update on the CPU) equal a float64 oracle's on
    the cases where a rounding would show: values on the bin edges (dyadic ranges, so the edges
    are exact in float32 too), either side of the zero edge (-0.0, the smallest normals and
    subnormals), out of range and NaN, for parameter values on their own edges."""
    from gradlens.instruments import GradHist2d
    from gradlens.instruments.hist2d import _Hist2dState

    tiny = torch.finfo(torch.float32).tiny
    for dtype in (torch.float32, torch.float64):
        for (plo, phi, pbins), (lo, hi, gbins) in [((-1.0, 1.0, 4), (-1.0, 1.0, 8)), ((-0.5, 1.5, 8), (-2.0, 2.0, 16)),
                                                   ((0.0, 1.0, 2), (-0.25, 0.75, 4))]:
            gedges = [lo + (hi - lo) * k / gbins for k in range(gbins + 1)]
            special = gedges + [0.0, -0.0, tiny, -tiny, 1e-40, -1e-40, lo - 1.0, hi + 1.0, 2 * hi - lo,
                                float("nan"), float("inf"), -float("inf")]
            col = torch.tensor(special, dtype=dtype)
            pedges = [plo + (phi - plo) * k / pbins for k in range(pbins + 1)]
            theta = torch.tensor(pedges + [0.0, -0.0, plo - 1.0, phi + 1.0], dtype=dtype)
            b = 3  # samples: the special values, permuted, against every parameter entry
            x = torch.stack([col.roll(k)[:, None].expand(-1, theta.numel()) for k in range(b)]).contiguous()  # [b, V, P]
            p = _oracle_bins(theta, plo, phi, pbins)  # [P]
            g = _oracle_bins(x, lo, hi, gbins)  # [b, V, P]
            want = torch.bincount((p * gbins + g).flatten(), minlength=pbins * gbins)
            offsets = (_oracle_bins(theta, plo, phi, pbins) * (gbins + 2)).to(dtype).expand(col.numel(), -1)
            assert torch.equal(count_2d(x, offsets, lo, hi, gbins, pbins).flatten(), want)
            cin = col[col.isfinite() & (col >= lo) & (col <= hi)]  # only values within the range
            xin = torch.stack([cin.roll(k)[:, None].expand(-1, theta.numel()) for k in range(b)]).contiguous()
            want_in = torch.bincount((p * gbins + _oracle_bins(xin, lo, hi, gbins)).flatten(), minlength=pbins * gbins)
            got_in = count_2d(xin, offsets[: cin.numel()], lo, hi, gbins, pbins, inside=True)
            assert torch.equal(got_in.flatten(), want_in)
            inst = GradHist2d(bins=(pbins, gbins), range=((plo, phi), (lo, hi)))
            state = inst.start_window()
            param = theta.expand(col.numel(), -1).contiguous()  # [V, P]: the parameter, row by row
            inst.update(state, "w", param, x)
            assert torch.equal(state.counts, want)
            clamped = int(((x < lo) | (x > hi) | x.isnan()).sum())
            assert int(state.clamped_grad) == clamped
            assert isinstance(state, _Hist2dState)
