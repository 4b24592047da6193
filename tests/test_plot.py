"""gradlens.output.plot: the drawn data equal the recorded counts, labels are present, nothing overlaps."""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

matplotlib = pytest.importorskip("matplotlib")
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.collections import QuadMesh  # noqa: E402
from matplotlib.patches import Rectangle, StepPatch  # noqa: E402

from gradlens.output.plot import Hist2dAxes, dashboard, hist1d, hist2d  # noqa: E402
from gradlens.core.records import Hist1d, Hist2d, Record  # noqa: E402
from gradlens.output.sinks import JsonlSink  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- synthetic records


def _hist1d(x: torch.Tensor, bins: int, lo: float, hi: float) -> Hist1d:
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    idx = ((x - lo) * bins / (hi - lo)).floor().clamp(0, bins - 1).long()
    return Hist1d(torch.bincount(idx, minlength=bins), edges, int((x < lo).sum()), int((x >= hi).sum()))


def _hist2d(p: torch.Tensor, g: torch.Tensor, bins=(40, 50), pr=(-1.0, 1.0), gr=(-2.0, 2.0)) -> Hist2d:
    pe = torch.linspace(*pr, bins[0] + 1, dtype=torch.float64)
    ge = torch.linspace(*gr, bins[1] + 1, dtype=torch.float64)
    pi = ((p - pr[0]) * bins[0] / (pr[1] - pr[0])).floor().clamp(0, bins[0] - 1).long()
    gi = ((g - gr[0]) * bins[1] / (gr[1] - gr[0])).floor().clamp(0, bins[1] - 1).long()
    counts = torch.bincount(pi * bins[1] + gi, minlength=bins[0] * bins[1]).reshape(bins)
    outside_p = int(((p < pr[0]) | (p >= pr[1])).sum())
    outside_g = int(((g < gr[0]) | (g >= gr[1])).sum())
    return Hist2d(counts, pe, ge, outside_p, outside_g)


def make_records(n: int = 50, adapt: bool = False, alpha: bool = False, seed: int = 0) -> list[Record]:
    """``n`` windows whose gradient spread shrinks; ``adapt`` narrows the 1D range with it."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for s in range(n):
        scale = 0.6 * math.exp(-s / 25) + 0.05
        g = torch.randn(2000, generator=gen, dtype=torch.float64) * scale
        p = torch.randn(2000, generator=gen, dtype=torch.float64) * 0.4
        lo, hi = (-2.5 * scale, 2.5 * scale) if adapt else (-1.0, 1.0)
        values = {
            "loss": 2.3 * math.exp(-s / 20) + 0.1,
            "grad_norm": 3.0 * scale,
            "noise_scale": 50.0 + 5.0 * s,
            "norm_test": 1.0 + 0.1 * math.sin(s),
            "mean_gsnr": torch.tensor(0.1 + s / 100, dtype=torch.float64),
            "batch_l2": torch.rand(64, generator=gen, dtype=torch.float64),
            "grad_hist_1d": _hist1d(g, 64, lo, hi),
            "grad_hist_2d": _hist2d(p, 3.0 * g),
        }
        if alpha:
            values["alpha"] = 0.3 * math.cos(s / 5)
        records.append(Record(step=2 * s, num_samples=128, micro_steps=4, values=values))
    return records


# --------------------------------------------------------------------------- helpers


def _all_axes(fig) -> list[Axes]:
    out: list[Axes] = []

    def walk(ax):
        out.append(ax)
        for child in ax.child_axes:
            walk(child)

    for ax in fig.get_axes():
        walk(ax)
    return out


def _visible_texts(fig):
    """(text, window bbox) of every drawn title, axis label and in-view tick label."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    items = []
    for ax in _all_axes(fig):
        candidates = [ax.title, ax.xaxis.label, ax.yaxis.label]
        for axis, lim in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = sorted(lim)
            tol = 1e-9 * abs(hi - lo)
            for tick in axis.get_major_ticks():
                if lo - tol <= tick.get_loc() <= hi + tol:
                    candidates += [tick.label1, tick.label2]
        items += [t for t in candidates if t.get_visible() and t.get_text().strip()]
    if fig._suptitle is not None:
        items.append(fig._suptitle)
    unique = list({id(t): t for t in items}.values())
    return [(t.get_text(), t.get_window_extent(renderer)) for t in unique]


def _overlapping_texts(fig):
    texts = _visible_texts(fig)
    return [(a[0], b[0]) for a, b in itertools.combinations(texts, 2) if a[1].overlaps(b[1])]


def _steppatches(ax) -> list[StepPatch]:
    return [p for p in ax.patches if isinstance(p, StepPatch)]


def _meshes(ax) -> list[QuadMesh]:
    return [c for c in ax.collections if isinstance(c, QuadMesh)]


# --------------------------------------------------------------------------- hist1d


def test_hist1d_draws_counts_clamped_bars_and_range(tmp_path):
    record = make_records(50, adapt=True)[-1]  # narrow range: some elements fall outside
    h = record["grad_hist_1d"]
    assert h.clamped_low > 0 and h.clamped_high > 0
    ax = hist1d(record)
    assert isinstance(ax, Axes)
    (stairs,) = _steppatches(ax)
    values, edges, _ = stairs.get_data()
    np.testing.assert_array_equal(edges, h.edges.numpy())
    # in-range part drawn as stairs, the clamped part as the two red end bars: together = counts
    bars = [p for p in ax.patches if isinstance(p, Rectangle) and not isinstance(p, StepPatch)]
    assert [b.get_height() for b in bars] == [h.clamped_low, h.clamped_high]
    lo, hi = h.range
    assert bars[0].get_x() + bars[0].get_width() == pytest.approx(lo)  # just outside the range
    assert bars[1].get_x() == pytest.approx(hi)
    assert bars[0].get_facecolor() != stairs.get_facecolor()
    rebuilt = values.copy()
    rebuilt[0] += h.clamped_low
    rebuilt[-1] += h.clamped_high
    np.testing.assert_array_equal(rebuilt, h.counts.numpy())
    # range marked by the two dashed vertical lines; log counts; labels and legend
    vlines = [ln.get_xdata()[0] for ln in ax.get_lines() if ln.get_linestyle() == "--" and len(ln.get_xdata())]
    assert vlines == pytest.approx([lo, hi])
    assert ax.get_yscale() == "log"
    assert "per-sample gradient" in ax.get_xlabel() and "count" in ax.get_ylabel()
    assert f"step {record.step}" in ax.get_title()
    legend = " ".join(t.get_text() for t in ax.get_legend().get_texts())
    assert f"< lo {h.clamped_low:,}" in legend and f"> hi {h.clamped_high:,}" in legend
    assert "range [" in legend
    out = tmp_path / "h1.png"
    ax.figure.savefig(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert _overlapping_texts(ax.figure) == []


def test_hist1d_accepts_hist_and_axes():
    h = make_records(1)[0]["grad_hist_1d"]
    fig = hist1d(h).figure
    ax = fig.add_subplot(2, 1, 2)
    assert hist1d(h, ax=ax) is ax
    (stairs,) = _steppatches(ax)
    assert stairs.get_data().values.sum() + h.clamped_low + h.clamped_high == h.total


def test_hist1d_bad_input_names_the_fix():
    record = Record(step=3, num_samples=1, micro_steps=1, values={"loss": 1.0})
    with pytest.raises(ValueError, match=r"step 3 has no 'grad_hist_1d'.*GradHist1d\(\)"):
        hist1d(record)
    with pytest.raises(TypeError, match="needs a gradlens Record or a Hist1d, got list"):
        hist1d([1, 2, 3])
    with pytest.raises(TypeError, match="ax=.*matplotlib Axes"):
        hist1d(make_records(1)[0], ax="left")
    with pytest.raises(TypeError, match=r"record\['grad_hist_1d'\] of step 0 is a Hist2d"):
        hist1d(Record(0, 1, 1, values={"grad_hist_1d": make_records(1)[0]["grad_hist_2d"]}))


# --------------------------------------------------------------------------- hist2d


def test_hist2d_heatmap_equals_counts_with_marginals(tmp_path):
    record = make_records(2)[-1]
    h = record["grad_hist_2d"]
    result = hist2d(record)
    assert isinstance(result, Hist2dAxes)
    ax = result.main
    (mesh,) = _meshes(ax)
    # rows of the heatmap are gradient bins (y), columns parameter bins (x)
    np.testing.assert_array_equal(np.ma.filled(mesh.get_array(), 0), h.counts.numpy().T)
    assert np.ma.getmaskarray(mesh.get_array()).sum() == (h.counts == 0).sum()  # empty cells blank
    coords = mesh.get_coordinates()
    np.testing.assert_allclose(coords[0, :, 0], h.param_edges.numpy())
    np.testing.assert_allclose(coords[:, 0, 1], h.grad_edges.numpy())
    assert mesh.norm.__class__.__name__ == "LogNorm"
    # marginals
    (top,) = _steppatches(result.param_marginal)
    (right,) = _steppatches(result.grad_marginal)
    np.testing.assert_array_equal(top.get_data().values, h.counts.sum(1).numpy())
    np.testing.assert_array_equal(right.get_data().values, h.counts.sum(0).numpy())
    assert top.orientation == "vertical" and right.orientation == "horizontal"
    assert result.figure is ax.figure
    assert ax.figure.get_axes() == [ax, result.param_marginal, result.grad_marginal, result.colorbar.ax]
    # labels, zero lines, colorbar
    assert "parameter value" in ax.get_xlabel() and "per-sample gradient" in ax.get_ylabel()
    zero_v = [ln for ln in ax.get_lines() if list(ln.get_xdata()) == [0, 0]]
    zero_h = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [0, 0]]
    assert len(zero_v) == 1 and len(zero_h) == 1
    assert "count" in result.colorbar.ax.get_ylabel()
    title = result.param_marginal.get_title()
    assert f"step {record.step}" in title and f"theta {h.clamped_param:,}" in title
    out = tmp_path / "h2.png"
    result.figure.savefig(out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert _overlapping_texts(result.figure) == []


def test_hist2d_into_given_axes_uses_insets(tmp_path):
    h = make_records(1)[0]["grad_hist_2d"]
    fig = hist1d(make_records(1)[0]).figure  # any figure with a free cell
    fig.set_size_inches(12, 5)
    ax = fig.add_subplot(1, 2, 2)
    fig.axes[0].set_subplotspec(fig.axes[1].get_subplotspec().get_gridspec()[0, 0])
    result = hist2d(h, ax=ax)
    assert result.main is ax
    assert ax.child_axes == [result.param_marginal, result.grad_marginal, result.colorbar.ax]
    (mesh,) = _meshes(ax)
    np.testing.assert_array_equal(np.ma.filled(mesh.get_array(), 0), h.counts.numpy().T)
    assert result.param_marginal.get_title().startswith("2,000 (theta, g) pairs")
    fig.savefig(tmp_path / "both.png")
    assert _overlapping_texts(fig) == []


def test_hist2d_rejects_others():
    with pytest.raises(TypeError, match="Record or a Hist2d, got Hist1d"):
        hist2d(make_records(1)[0]["grad_hist_1d"])
    with pytest.raises(ValueError, match="GradHist2d"):
        hist2d(Record(0, 1, 1))


# --------------------------------------------------------------------------- dashboard


def _panel(fig, title_part: str) -> Axes:
    found = [ax for ax in _all_axes(fig) if title_part in ax.get_title()]
    assert len(found) == 1, [ax.get_title() for ax in _all_axes(fig)]
    return found[0]


def test_dashboard_content_and_legibility(tmp_path):
    records = make_records(50)
    out = tmp_path / "dash.png"
    fig = dashboard(records, path=out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert fig.get_layout_engine().__class__.__name__ == "ConstrainedLayoutEngine"
    # the 5 tracked scalar panels (no alpha) + hist1d + hist2d + evolution, and the colorbar
    # added with constrained layout (the evolution one); hist2d's marginals/colorbar are its
    # inset axes; nothing is drawn for alpha, which one line at the bottom names
    assert len(fig.get_axes()) == 9
    assert "50 windows" in fig._suptitle.get_text()
    steps = [r.step for r in records]
    for title, key in [("loss", "loss"), ("gradient norm", "grad_norm"), ("noise scale", "noise_scale"),
                       ("norm test", "norm_test"), ("GSNR", "mean_gsnr")]:
        ax = _panel(fig, title)
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == steps
        np.testing.assert_allclose(line.get_ydata(), [float(r[key]) for r in records])
        assert ax.get_xlabel().startswith("step")
    assert not [ax for ax in _all_axes(fig) if "alpha" in ax.get_title()]
    assert fig._supxlabel.get_text().startswith("not tracked: alpha, ")
    # latest histograms are the last record's
    h1 = _panel(fig, "latest window, step 98, N=128, K=4: 2,000 gradient elements")
    (stairs,) = _steppatches(h1)
    assert stairs.get_data().values.sum() + records[-1]["grad_hist_1d"].clamped_low + \
        records[-1]["grad_hist_1d"].clamped_high == records[-1]["grad_hist_1d"].total
    # evolution heatmap: x = step, y = gradient value, colour = the recorded counts
    evo = _panel(fig, "evolution")
    (mesh,) = _meshes(evo)
    expected = np.stack([r["grad_hist_1d"].counts.numpy() for r in records], axis=1)
    np.testing.assert_array_equal(np.ma.filled(mesh.get_array(), 0), expected)
    coords = mesh.get_coordinates()
    centres = 0.5 * (coords[0, 1:, 0] + coords[0, :-1, 0])
    np.testing.assert_allclose(centres, steps)
    np.testing.assert_allclose(coords[:, 0, 1], records[0]["grad_hist_1d"].edges.numpy())
    assert evo.get_xlabel().startswith("step")
    assert _overlapping_texts(fig) == []


def test_dashboard_adapted_ranges_keep_each_windows_bins(tmp_path):
    records = make_records(12, adapt=True, alpha=True)
    fig = dashboard(records)
    evo = _panel(fig, "evolution")
    assert "each column has its own bins" in evo.get_title()
    (mesh,) = _meshes(evo)
    data = mesh.get_array()
    hists = [r["grad_hist_1d"] for r in records]
    density = np.stack([h.counts.numpy() / np.diff(h.edges.numpy()) for h in hists], axis=1)
    np.testing.assert_allclose(np.ma.filled(data[:, ::2], 0), density)
    assert np.ma.getmaskarray(data[:, 1::2]).all()  # zero-width joints between windows
    coords = mesh.get_coordinates()
    for i, h in enumerate(hists):  # column i sits at its own window's edges
        np.testing.assert_allclose(coords[:, 2 * i, 1], h.edges.numpy())
    (line,) = _panel(fig, "alpha").get_lines()[:1]
    np.testing.assert_allclose(line.get_ydata(), [r["alpha"] for r in records])
    assert _overlapping_texts(fig) == []


def test_dashboard_from_log_and_pdf(tmp_path):
    records = make_records(4)
    log = tmp_path / "run.jsonl"
    with JsonlSink(log) as sink:
        for r in records:
            sink.write(r)
    out = tmp_path / "dash.PDF"
    fig = dashboard(log, path=out)
    assert out.read_bytes()[:5] == b"%PDF-"
    assert "run.jsonl" in fig._suptitle.get_text()


def test_dashboard_missing_quantities_say_not_tracked():
    records = [Record(step=s, num_samples=8, micro_steps=1, values={"loss": 1.0 / (s + 1)}) for s in range(3)]
    fig = dashboard(records)
    # everything but the loss is named in one line, and only the loss panel is drawn
    note = fig._supxlabel.get_text()
    missing = ["alpha", "noise_scale", "norm_test", "mean_gsnr", "grad_norm", "distance", "update_size",
               "cabs", "early_stopping", "grad_hist_1d", "grad_hist_2d", "groups"]
    assert note.startswith("not tracked: ") and all(m in note for m in missing), note
    assert "loss" not in note
    assert [ax.get_title() for ax in _all_axes(fig)] == ["loss (window mean)"]
    (line,) = _panel(fig, "loss").get_lines()
    assert list(line.get_ydata()) == [1.0, 0.5, 1.0 / 3]


def test_dashboard_bad_input(tmp_path):
    records = make_records(2)
    with pytest.raises(ValueError, match=r"dash\.svg'\): cannot save a \.svg file; use one of \.png, \.pdf"):
        dashboard(records, path=tmp_path / "dash.svg")
    with pytest.raises(ValueError, match="suffix-less.*\\.png"):
        dashboard(records, path=tmp_path / "dash")
    assert not (tmp_path / "dash.svg").exists()
    with pytest.raises(ValueError, match="no records"):
        dashboard([])
    with pytest.raises(TypeError, match="got a sequence holding dict"):
        dashboard([{"step": 0}])
    with pytest.raises(TypeError, match="list of gradlens Records or the path"):
        dashboard(3)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        dashboard(tmp_path / "missing.jsonl")


def test_import_gradlens_is_light():
    code = "import gradlens, sys; assert 'matplotlib' not in sys.modules and 'tqdm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
    # the sinks and the command line (for --help) do not need matplotlib either; they import
    # torch, whose torch.hub imports tqdm, so tqdm is not checked here
    code = "import gradlens.output.sinks, gradlens.cli, sys; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=60)
