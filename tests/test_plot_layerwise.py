"""gradlens.output.plot.layerwise and the dashboard's layout: one heatmap row per group holding the
documented summary of each record's group value, readable with 150 groups, from records or a
log; the dashboard draws only what was tracked and no legend covers the tallest bars."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from matplotlib.collections import QuadMesh  # a gradlens dependency: no skip
from matplotlib.colors import LogNorm, Normalize

from gradlens.output.plot import dashboard, hist1d, layerwise  # noqa: E402
from gradlens.core.records import Hist1d, Record  # noqa: E402
from gradlens.output.sinks import JsonlSink  # noqa: E402
from test_plot import PNG_MAGIC, _all_axes, _overlapping_texts, make_records  # noqa: E402


def _grouped(steps: int, groups: int, n: int = 16, seed: int = 0) -> list[Record]:
    """Records whose groups' per-sample norms span three decades, with a few clamped counts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        g = {}
        for i in range(groups):
            scale = 10 ** (3 * i / max(groups - 1, 1)) * (1 + 0.2 * math.sin(s + i))
            counts = torch.randint(0, 40, (8,), generator=gen)
            g[f"block{i}.mlp"] = {
                "batch_l2": (torch.rand(n, generator=gen, dtype=torch.float64) * scale) ** 2,
                "grad_norm": scale,
                "early_stopping": -0.5 + 0.1 * i - 0.01 * s,
                "grad_hist_1d": Hist1d(counts, torch.linspace(-1, 1, 9, dtype=torch.float64),
                                       int(counts[0]) // 2, int(counts[-1]) // 3),
                "sum_grad_squared": {f"block{i}.w": torch.rand(3, 4, generator=gen),
                                     f"block{i}.b": torch.rand(3, generator=gen)},
            }
        out.append(Record(3 * s, n, 2, {"loss": 1.0 / (s + 1)}, {}, g))
    return out


def _mesh(fig) -> QuadMesh:
    (mesh,) = [c for c in fig.axes[0].collections if isinstance(c, QuadMesh)]
    return mesh


def _expected(records, key, cell):
    names = list(records[0].groups)
    return names, np.array([[cell(r.groups[g][key]) for r in records] for g in names])


def test_one_row_per_group_holds_the_median_per_sample_norm(tmp_path):
    records = _grouped(7, 5)
    out = tmp_path / "layers.png"
    fig = layerwise(records, "batch_l2", path=out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    names, want = _expected(records, "batch_l2", lambda v: float(np.sqrt(np.median(v.numpy()))))
    mesh = _mesh(fig)
    got = np.ma.filled(mesh.get_array(), np.nan).reshape(5, 7)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == names  # first group on top
    assert ax.get_ylim() == (5.0, 0.0)
    coords = mesh.get_coordinates()
    np.testing.assert_allclose(0.5 * (coords[0, 1:, 0] + coords[0, :-1, 0]), [r.step for r in records])
    # values span two decades: a log colour scale, with the units on the colour bar
    assert isinstance(mesh.norm, LogNorm)
    cbar = fig.axes[1]
    assert cbar.get_ylabel() == r"$\|g_n\|$ (loss per parameter unit) (log)"
    assert "median per-sample norm" in ax.get_title()
    assert _overlapping_texts(fig) == []


@pytest.mark.parametrize(
    "key, cell, log",
    [
        ("grad_norm", float, True),
        ("early_stopping", float, False),  # negative values: a linear scale
        ("grad_hist_1d", lambda h: (h.clamped_low + h.clamped_high) / float(h.counts.sum()), None),
        ("sum_grad_squared", lambda d: float(sum(t.double().sum() for t in d.values())), None),
    ],
)
def test_cells_are_the_documented_summary(key, cell, log):
    records = _grouped(4, 6)
    fig = layerwise(records, key)
    _, want = _expected(records, key, cell)
    got = np.ma.filled(_mesh(fig).get_array(), np.nan).reshape(want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    if log is not None:
        assert isinstance(_mesh(fig).norm, LogNorm) is log
        assert isinstance(_mesh(fig).norm, Normalize)


def test_a_group_missing_at_a_step_is_a_grey_cell():
    records = _grouped(3, 3)
    del records[1].groups["block2.mlp"]
    records[2].groups["block0.mlp"]["grad_norm"] = None
    fig = layerwise(records, "grad_norm")
    data = _mesh(fig).get_array().reshape(3, 3)
    assert np.ma.getmaskarray(data).tolist() == [
        [False, False, True], [False, False, False], [False, True, False]
    ]
    assert "grey: no value (2 cells)" in fig.axes[0].get_title()


def test_150_groups_stay_readable(tmp_path):
    records = _grouped(20, 150, n=8)
    out = tmp_path / "l150.png"
    fig = layerwise(records, "batch_l2", path=out)
    assert _mesh(fig).get_array().shape == (150, 20)
    ax = fig.axes[0]
    labels = ax.get_yticklabels()
    assert all(t.get_fontsize() >= 5 for t in labels)
    assert 75 <= len(labels) <= 150  # thinned at most to every second group
    named = [t.get_text() for t in labels]
    assert named[0] == "block0.mlp" and set(named) <= set(records[0].groups)
    assert ax.get_ylabel().startswith("group (150")
    assert fig.get_size_inches()[1] <= 18.0
    assert _overlapping_texts(fig) == []


def test_from_a_log_with_summaries_and_in_full(tmp_path):
    records = _grouped(5, 4, n=16)
    full, small = tmp_path / "full.jsonl", tmp_path / "small.jsonl"
    with JsonlSink(full) as a, JsonlSink(small, max_elements=8) as b:
        for r in records:
            a.write(r)
            b.write(r)
    fig = layerwise(full, "batch_l2")
    _, want = _expected(records, "batch_l2", lambda v: float(np.sqrt(np.median(v.numpy()))))
    np.testing.assert_allclose(np.ma.filled(_mesh(fig).get_array(), np.nan).reshape(want.shape), want)
    assert fig._suptitle.get_text() == "full.jsonl"
    # batch_l2 [16] over max_elements=8 is a summary in the log: the RMS norm, said in the title
    fig = layerwise(small, "batch_l2")
    _, rms = _expected(records, "batch_l2", lambda v: float(np.sqrt(v.numpy().mean())))
    np.testing.assert_allclose(np.ma.filled(_mesh(fig).get_array(), np.nan).reshape(rms.shape), rms, rtol=1e-12)
    assert "RMS per-sample norm" in fig.axes[0].get_title()


def test_layerwise_bad_input(tmp_path):
    plain = make_records(3)
    with pytest.raises(ValueError, match=r"no record has groups .* Lens\(model, instruments, groups='module'\)"):
        layerwise(plain)
    records = _grouped(2, 2)
    with pytest.raises(ValueError, match=r"key='alpha'\): no group of any record has 'alpha'; .* key='batch_l2'"):
        layerwise(records, "alpha")
    with pytest.raises(TypeError, match=r"layerwise\(key=...\) must be a record key"):
        layerwise(records, 3)
    with pytest.raises(ValueError, match=r"layerwise\(path='.*l\.svg'\): cannot save a \.svg file"):
        layerwise(records, path=tmp_path / "l.svg")
    with pytest.raises(ValueError, match=r"log_scale=True\): the 'early_stopping' summaries include values <= 0"):
        layerwise(records, "early_stopping", log_scale=True)
    with pytest.raises(TypeError, match=r"layerwise\(log_scale=...\) must be None, True or False"):
        layerwise(records, log_scale="yes")
    with pytest.raises(ValueError, match="layerwise: no records"):
        layerwise([])
    with pytest.raises(TypeError, match=r"layerwise\(records_or_log_path=...\) needs a list"):
        layerwise(3)
    fig = layerwise(records, "grad_norm", log_scale=False)
    assert not isinstance(_mesh(fig).norm, LogNorm)


# --------------------------------------------------------------------------- dashboard


def _quickstart(records):
    """What the README quickstart's instruments record: BatchL2, SumGradSquared, GradNorm,
    GradHist1d (and the loss)."""
    keep = ("loss", "grad_norm", "batch_l2", "grad_hist_1d")
    return [Record(r.step, r.num_samples, r.micro_steps, {k: r[k] for k in keep}) for r in records]


def test_dashboard_of_the_quickstart_draws_only_what_was_tracked(tmp_path):
    fig = dashboard(_quickstart(make_records(20)), path=tmp_path / "q.png")
    titles = [ax.get_title() for ax in _all_axes(fig)]
    assert not [ax for ax in _all_axes(fig) if any("not tracked" in t.get_text() for t in ax.texts)]
    assert titles[:2] == ["loss (window mean)", r"gradient norm $\|g\|$ (window gradient)"]
    assert sum("latest window" in t for t in titles) == 1 and sum("evolution" in t for t in titles) == 1
    assert len(fig.get_axes()) == 5  # loss, grad norm, hist1d, evolution + its colour bar
    note = fig._supxlabel.get_text()
    for key in ("alpha", "noise_scale", "norm_test", "mean_gsnr", "grad_hist_2d"):
        assert key in note
    assert _overlapping_texts(fig) == []


def test_dashboard_gains_a_layerwise_panel_with_groups(tmp_path):
    records = _grouped(6, 12)
    for r, q in zip(records, _quickstart(make_records(6))):
        r.values.update(q.values)
    fig = dashboard(records, path=tmp_path / "d.png")
    (panel,) = [ax for ax in fig.get_axes() if "per group" in ax.get_title()]
    (mesh,) = [c for c in panel.collections if isinstance(c, QuadMesh)]
    _, want = _expected(records, "batch_l2", lambda v: float(np.sqrt(np.median(v.numpy()))))
    np.testing.assert_allclose(np.ma.filled(mesh.get_array(), np.nan).reshape(want.shape), want)
    assert "groups" not in fig._supxlabel.get_text()
    fig = dashboard(records, layerwise_key="grad_norm")
    (panel,) = [ax for ax in fig.get_axes() if "per group" in ax.get_title()]
    assert "'grad_norm'" in panel.get_title()
    assert _overlapping_texts(fig) == []


def _legend_clear_of_bars(ax) -> None:
    fig = ax.figure
    fig.canvas.draw()
    box = ax.get_legend().get_window_extent(fig.canvas.get_renderer())
    for patch in ax.patches:
        bar = patch.get_window_extent(fig.canvas.get_renderer())
        if bar.x1 > box.x0 and bar.x0 < box.x1:  # under the legend's columns
            assert bar.y1 < box.y0, (bar, box)


def test_no_legend_covers_the_tallest_bars():
    # the tallest bins on the right, under the legend's corner, and many clamped high
    x = torch.cat([torch.full((5000,), 0.9, dtype=torch.float64), torch.full((800,), 1.5, dtype=torch.float64),
                   torch.linspace(-1, 1, 300, dtype=torch.float64)])
    edges = torch.linspace(-1, 1, 33, dtype=torch.float64)
    idx = ((x + 1) * 16).floor().clamp(0, 31).long()
    h = Hist1d(torch.bincount(idx, minlength=32), edges, 0, int((x >= 1).sum()))
    _legend_clear_of_bars(hist1d(h))
    records = _quickstart(make_records(3))
    records[-1].values["grad_hist_1d"] = h
    fig = dashboard(records)
    (ax,) = [a for a in fig.get_axes() if "latest window" in a.get_title()]
    _legend_clear_of_bars(ax)
