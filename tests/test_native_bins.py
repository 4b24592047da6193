"""The compiled histogram loop (gradlens.instruments.native_bins) gives the counts of binning
each element by bin_of's rule, and of the float64 oracle on bin edges; GradHist1d / GradHist2d
give the oracle's histograms with it and without it (torch's counting), alone and side by side,
over unequal micro-batches; without a C compiler the loop is off and the counts are the same."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradlens.instruments import GradHist1d, GradHist2d, native_bins
from gradlens.instruments.binning import bin_of
from oracle import MODELS, bins_oracle, flat, hist_oracle, make_problem, per_sample_grads
from windows import micro_batches, run_windows



def test_loop_builds_here():
    """The loop is built and loaded (a C compiler, ``cc``, is part of the test environment: a
    source or flag that does not compile fails here, not silently falls back)."""
    assert native_bins.available(), "the compiled histogram loop did not build: is there a C compiler (cc)?"


@pytest.fixture
def torch_counting(monkeypatch):
    """The histograms count with torch (as without a compiler) within the test."""
    monkeypatch.setattr(native_bins, "_lib", False)


def _values(n, lo, hi, seed, spread, dtype, edges, nonfinite):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * spread).to(dtype)
    if edges:  # the ends of the range in the dtype, 0 and -0, the bin edges
        w = (hi - lo) / 7
        special = torch.tensor([lo, hi, 0.0, -0.0, lo + w, lo + 2 * w, hi - w], dtype=dtype)
        x[: min(n, 7)] = special[: min(n, 7)]
    if nonfinite and n > 3:
        x[-3:] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    return x


def _want(x, lo, hi, bins, off=None):
    """Counts by bin_of and bincount, and (below lo, above hi or NaN) by torch's comparisons."""
    idx = bin_of(x, lo, hi, bins)
    if off is not None:
        idx = idx + off
    size = bins if off is None else int(off.max()) + bins
    low, high = int((x < lo).sum()), int(((x > hi) | x.isnan()).sum())
    return torch.bincount(idx.reshape(-1), minlength=size), (low, high)


@settings(max_examples=60, deadline=None)
@given(
    b=st.integers(1, 4), o=st.integers(1, 7), i=st.integers(1, 600), pbins=st.integers(1, 9),
    gbins=st.integers(1, 70), lo=st.sampled_from([-2.0, -1.0, -0.1, -0.37, 0.0, 0.3]),
    width=st.sampled_from([0.2, 1.0, 2.0, 3.3]), seed=st.integers(0, 2**16),
    spread=st.sampled_from([0.01, 0.3, 3.0]), dtype=st.sampled_from([torch.float32, torch.float64]),
    edges=st.booleans(), nonfinite=st.booleans(),
)
def test_loop_equals_binning_each_element(b, o, i, pbins, gbins, lo, width, seed, spread, dtype, edges, nonfinite):
    """1D and 2D, from a materialised ``x`` and from factors (all rows, and some rows), with
    and without the zero edge, inside and outside the range, NaN and infinities; rows longer
    than the loop's block of 256."""
    hi = lo + width
    a = _values(b * i, lo, hi, seed, spread, dtype, edges, nonfinite).view(b, i)
    delta = _values(b * o, -1.0, 1.0, seed + 1, 1.0, dtype, edges, False).view(b, o)
    delta[0, 0] = 1.0  # some row holds a's values themselves (the edges exactly)
    x = delta[:, :, None] * a[:, None, :]  # the products autograd's per-sample gradient holds
    pbin = torch.randint(0, pbins, (o, i), generator=torch.Generator().manual_seed(seed + 2))
    off = (pbin * gbins).to(torch.int32)
    for offsets in (None, off):
        want, clamped = _want(x, lo, hi, gbins, offsets)
        n = want.numel()
        got = torch.zeros(n, dtype=torch.int64)
        assert native_bins.count_dense(got, x, lo, hi, gbins, offsets) == clamped
        assert torch.equal(got, want)
        got = torch.zeros(n, dtype=torch.int64)
        assert native_bins.count_outer(got, delta, a, lo, hi, gbins, offsets) == clamped
        assert torch.equal(got, want)
        rows = torch.randperm(b * o, generator=torch.Generator().manual_seed(seed + 3))[: max(1, b * o // 2)]
        xr = x.reshape(b * o, i)[rows]
        want_r, clamped_r = _want(xr, lo, hi, gbins, None if offsets is None else offsets[rows % o])
        got = torch.zeros(n, dtype=torch.int64)
        assert native_bins.count_outer(got, delta, a, lo, hi, gbins, offsets, rows) == clamped_r
        assert torch.equal(got, torch.nn.functional.pad(want_r, (0, n - want_r.numel())))


def _oracle_bins(v, lo, hi, bins):
    """Float64 bins by the documented rule from the float64 edges (independent of bin_of)."""
    edges = torch.tensor([lo + (hi - lo) * k / bins for k in range(1, bins)], dtype=torch.float64)
    edges[edges.abs() < 1e-12 * (hi - lo)] = 0.0
    return torch.searchsorted(edges, v.double().nan_to_num(nan=float("inf")), right=True)


def test_loop_equals_float64_oracle_on_edges():
    """Values on every bin edge (dyadic ranges: the edges are exact in float32 too), either side
    of the zero edge (-0.0, the smallest normals and subnormals), out of range, NaN and
    infinities, parameter values on their own edges: the loop's 2D and 1D counts are the float64
    oracle's, in float32 and float64, from a materialised chunk and from factors."""
    tiny = torch.finfo(torch.float32).tiny
    for dtype in (torch.float32, torch.float64):
        for (plo, phi, pbins), (lo, hi, gbins) in [((-1.0, 1.0, 4), (-1.0, 1.0, 8)), ((-0.5, 1.5, 8), (-2.0, 2.0, 16)),
                                                   ((0.0, 1.0, 2), (-0.25, 0.75, 4)), ((-1.0, 1.0, 2), (0.5, 1.5, 4))]:
            gedges = [lo + (hi - lo) * k / gbins for k in range(gbins + 1)]
            special = gedges + [0.0, -0.0, tiny, -tiny, 1e-40, -1e-40, lo - 1.0, hi + 1.0, 2 * hi - lo,
                                float("nan"), float("inf"), -float("inf")]
            col = torch.tensor(special, dtype=dtype)  # [V]
            pedges = [plo + (phi - plo) * k / pbins for k in range(pbins + 1)]
            theta = torch.tensor(pedges + [0.0, -0.0, plo - 1.0, phi + 1.0], dtype=dtype)  # [P]
            p = _oracle_bins(theta, plo, phi, pbins)
            # factors: delta = +-1 (exact products), a = the special values, rolled per sample;
            # entry (o, i) of the parameter has theta[i] (each row the same parameter values)
            b = 3
            a = torch.stack([col.roll(k) for k in range(b)])  # [b, V]
            delta = torch.tensor([[1.0, -1.0]] * b, dtype=dtype)  # [b, 2]
            x = delta[:, :, None] * a[:, None, :]  # [b, 2, V]
            pv = p[torch.arange(col.numel()) % theta.numel()]  # a parameter bin per column
            offv = (pv * gbins).to(torch.int32).expand(2, -1).contiguous()
            g = _oracle_bins(x, lo, hi, gbins)
            want2 = torch.bincount((pv * gbins + g).flatten(), minlength=pbins * gbins)
            want1 = torch.bincount(g.flatten(), minlength=gbins)
            v = x.double()
            clamped = (int((v < lo).sum()), int(((v > hi) | v.isnan()).sum()))
            for offsets, want in ((offv, want2), (None, want1)):
                got = torch.zeros(want.numel(), dtype=torch.int64)
                assert native_bins.count_outer(got, delta, a, lo, hi, gbins, offsets) == clamped
                assert torch.equal(got, want)
                got = torch.zeros(want.numel(), dtype=torch.int64)
                assert native_bins.count_dense(got, x, lo, hi, gbins, offsets) == clamped
                assert torch.equal(got, want)


def _problem(name):
    model, x, y = make_problem(MODELS[name])
    G = flat(per_sample_grads(model, x, y))
    return model, x, y, G


@pytest.mark.parametrize("compiled", [True, False], ids=["loop", "torch"])
@pytest.mark.parametrize("beside", [True, False], ids=["with-1d", "alone"])
@pytest.mark.parametrize("narrow", [True, False], ids=["narrow", "wide"])
@pytest.mark.parametrize("name", ["mlp", "cnn", "seq"])
def test_histograms_match_oracle_with_and_without_the_loop(name, narrow, beside, compiled, request):
    """GradHist2d (and GradHist1d beside it, or not) over micro-batches 2, 3, 1 (and the rest
    of the batch) equal the float64 oracle's histograms: rank-one layers (the MLP: every product
    in the loop when most rows span several bins, else the rows of one bin by matmuls and the
    others in the loop), convolutions and sequence layers (materialised chunks in the loop);
    ``torch``: the same with torch's counting."""
    if not compiled:
        request.getfixturevalue("torch_counting")
    model, x, y, G = _problem(name)
    r = (0.05 if narrow else 0.5) * float(G.abs().max())
    pr = 0.5 * max(float(p.detach().abs().max()) for p in model.parameters())
    gb, pb = 10, 6
    insts = ([GradHist1d(bins=gb, range=(-r, r))] if beside else []) + [
        GradHist2d(bins=(pb, gb), range=((-pr, pr), (-r, r)))]
    sizes = [2, 3, 1, x.shape[0] - 6]
    rec = run_windows(model, [micro_batches(x, y, sizes)], insts,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0)).record
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    counts, low, high = hist_oracle(G, -r, r, gb)
    joint = torch.bincount((bins_oracle(theta, -pr, pr, pb) * gb + bins_oracle(G, -r, r, gb)).flatten(),
                           minlength=pb * gb).view(pb, gb)
    h2 = rec["grad_hist_2d"]
    assert torch.equal(h2.counts, joint)
    assert h2.clamped_grad == low + high
    assert low + high > 0
    if beside:
        h1 = rec["grad_hist_1d"]
        assert torch.equal(h1.counts, counts)
        assert (h1.clamped_low, h1.clamped_high) == (low, high)


@pytest.mark.parametrize("compiled", [True, False], ids=["loop", "torch"])
@settings(max_examples=25, deadline=None)
@given(b=st.integers(1, 4), o=st.integers(1, 6), i=st.integers(1, 300), seed=st.integers(0, 10_000),
       grad_width=st.floats(0.05, 4.0), many=st.booleans())
def test_hist2d_factor_paths_equal_materialised(compiled, b, o, i, seed, grad_width, many):
    """GradHist2d.update_outer (every row in the loop: ``many``; else the rows of one bin by
    matmuls, the rest in the loop) == its update on the materialised products, and GradHist1d's
    likewise, in float32 (where the loop's float operations must be torch's)."""
    lib = native_bins._lib
    if not compiled:
        native_bins._lib = False
    try:
        gen = torch.Generator().manual_seed(seed)
        param = torch.randn(o, i, generator=gen)
        delta = torch.randn(b, o, generator=gen) * (torch.rand(b, o, generator=gen) > 0.4)
        a = torch.randn(b, i, generator=gen)
        rng = ((-1.0, 1.0), (-grad_width / 2, grad_width))
        fast, slow = GradHist2d(bins=(5, 7), range=rng), GradHist2d(bins=(5, 7), range=rng)
        fast.max_rows_one_by_one = 0.0 if many else 1.0
        s_fast, s_slow = fast.start_window(), slow.start_window()
        done = fast.update_outer(s_fast, "w", param, delta, a)
        assert done or (many and not compiled)  # without the loop, many rows: materialise
        if done:
            slow.update(s_slow, "w", param, delta[:, :, None] * a[:, None, :])
            assert torch.equal(s_fast.counts, s_slow.counts)
            assert int(s_fast.clamped_grad) == int(s_slow.clamped_grad)
        h1f, h1s = GradHist1d(bins=7, range=rng[1]), GradHist1d(bins=7, range=rng[1])
        h1f.max_search_native = 0.0  # the loop whenever it serves
        t_fast, t_slow = h1f.start_window(), h1s.start_window()
        if h1f.update_outer(t_fast, "w", param, delta, a):
            h1s.update(t_slow, "w", param, delta[:, :, None] * a[:, None, :])
            assert torch.equal(t_fast.counts, t_slow.counts)
            assert (int(t_fast.low), int(t_fast.high)) == (int(t_slow.low), int(t_slow.high))
        else:
            assert not compiled
    finally:
        native_bins._lib = lib


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    """Without a working C compiler (or with ``GRADLENS_NATIVE=0``) the loop is off: the
    histograms count with torch, and give the same counts."""
    monkeypatch.setattr(native_bins, "_lib", None)
    monkeypatch.setenv("GRADLENS_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")  # a compiler that fails
    assert not native_bins.available()
    assert not native_bins.usable(torch.zeros(3))
    assert native_bins._lib is False  # tried once, remembered
    monkeypatch.setattr(native_bins, "_lib", None)
    monkeypatch.delenv("CC")
    monkeypatch.setenv("GRADLENS_NATIVE", "0")
    assert not native_bins.available()
    g = torch.Generator().manual_seed(0)
    param, x = torch.randn(4, 9, generator=g), torch.randn(3, 4, 9, generator=g)
    h = GradHist2d(bins=(3, 5), range=((-1.0, 1.0), (-1.0, 1.0)))
    s = h.start_window()
    h.update(s, "w", param, x)
    monkeypatch.delenv("GRADLENS_NATIVE")
    assert native_bins.available()  # built into the new cache from the source
    assert list(tmp_path.glob("hist2d_*.so"))
    s2 = h.start_window()
    h.update(s2, "w", param, x)
    assert torch.equal(s.counts, s2.counts) and int(s.clamped_grad) == int(s2.clamped_grad)


def test_a_cached_library_others_may_write_is_not_loaded(monkeypatch, tmp_path):
    """Loading a library runs its code: a cached one that others may write (or in a folder they
    may write) is never loaded; the loop is built afresh in a private folder instead. (Each
    cache below is a new path: the dynamic loader hands back a library already loaded from the
    same path without reading the file again.)"""
    monkeypatch.setattr(native_bins, "_lib", None)
    monkeypatch.setenv("GRADLENS_CACHE", str(tmp_path / "built"))
    assert native_bins.available()
    (built,) = (tmp_path / "built").glob("hist2d_*.so")

    def cache(name, mode_file, mode_dir):
        """A cache folder whose library is a file that no loader accepts."""
        folder = tmp_path / name
        folder.mkdir()
        lib = folder / built.name
        lib.write_bytes(b"not a library: loading this fails")  # (what a stranger could leave)
        lib.chmod(mode_file)
        folder.chmod(mode_dir)
        monkeypatch.setenv("GRADLENS_CACHE", str(folder))
        monkeypatch.setattr(native_bins, "_lib", None)

    for name, mode_file, mode_dir in (("file", 0o666, 0o700), ("folder", 0o700, 0o777)):
        cache(name, mode_file, mode_dir)
        assert native_bins.available()  # the fresh build, not the file
        counts = torch.zeros(4, dtype=torch.int64)
        native_bins.count_dense(counts, torch.tensor([[-0.9, -0.1, 0.2, 0.9]]), -1.0, 1.0, 4)
        assert counts.tolist() == [1, 1, 1, 1]
    cache("own", 0o700, 0o700)  # only our own file: loaded as it is (and it is no library)
    with pytest.raises(OSError):
        native_bins._build()
    monkeypatch.setattr(native_bins, "_lib", None)


def test_loop_refuses_what_it_cannot_count():
    """Wrong counts or offsets are refused by name, not written past the end."""
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="counts must be a contiguous int64"):
        native_bins.count_dense(torch.zeros(4, dtype=torch.int32), x, -1.0, 1.0, 4)
    with pytest.raises(ValueError, match="counts must have 4 entries"):
        native_bins.count_dense(torch.zeros(8, dtype=torch.int64), x, -1.0, 1.0, 4)
    with pytest.raises(ValueError, match="offsets must be int32"):
        native_bins.count_dense(torch.zeros(8, dtype=torch.int64), x, -1.0, 1.0, 4, torch.zeros(3))
    with pytest.raises(ValueError, match="shapes do not match"):
        native_bins.count_outer(torch.zeros(4, dtype=torch.int64), torch.zeros(2, 3), torch.zeros(3, 5), -1.0, 1.0, 4)
    assert not native_bins.usable(torch.zeros(2, dtype=torch.float16))
    assert not native_bins.usable(torch.zeros(2), torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("bins", [4095, 4096, 4097, 9000])
def test_loop_with_many_bins(bins):
    """1D counts of up to 4096 bins go through four interleaved copies, more bins straight into
    the counts: both equal bin_of's counts (and 2D with as many cells)."""
    g = torch.Generator().manual_seed(bins)
    delta, a = torch.randn(3, 5, generator=g), torch.randn(3, 701, generator=g)
    a[0, :3] = torch.tensor([float("nan"), -1.0, 1.0])
    x = delta[:, :, None] * a[:, None, :]
    want, clamped = _want(x, -1.0, 1.0, bins)
    got = torch.zeros(bins, dtype=torch.int64)
    assert native_bins.count_outer(got, delta, a, -1.0, 1.0, bins) == clamped
    assert torch.equal(got, want)
    got = torch.zeros(bins, dtype=torch.int64)
    assert native_bins.count_dense(got, x, -1.0, 1.0, bins) == clamped
    assert torch.equal(got, want)
    off = (torch.randint(0, 2, (5, 701), generator=g) * bins).to(torch.int32)
    want, clamped = _want(x, -1.0, 1.0, bins, off)
    got = torch.zeros(2 * bins, dtype=torch.int64)
    assert native_bins.count_outer(got, delta, a, -1.0, 1.0, bins, off) == clamped
    assert torch.equal(got, want)
