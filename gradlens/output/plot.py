"""Plots of gradlens records: 1D and 2D per-sample gradient histograms, and a training dashboard.

Everything here draws on matplotlib's object-oriented API (``matplotlib.figure.Figure`` with an
Agg canvas, never ``pyplot``), so it works headless and leaves no global figure state. Importing
this module imports matplotlib; ``import gradlens`` alone does not.

- :func:`hist1d` - the histogram of per-sample gradient elements ``g_{n,j}`` of one window.
- :func:`hist2d` - the joint histogram of (parameter value ``theta_j``, ``g_{n,j}``) with marginals.
- :func:`dashboard` - one figure over a run, of what was tracked: loss, gradient norm, noise
  scale, norm test, alpha, mean GSNR, distance, update size, CABS, EB, the latest window's
  histograms, the evolution of the 1D histogram, and a layerwise panel when records have groups.
- :func:`layerwise` - one heatmap row per parameter group (``record.groups``) over the steps.

Units: ``g_{n,j} = d loss_n / d theta_j`` is the gradient of sample n's own loss (not divided by
the batch size), in loss units per parameter unit; counts are numbers of (sample, parameter
entry) pairs in the window, so a window of N samples over D tracked entries holds N * D counts.
"""

from __future__ import annotations

import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colorbar import Colorbar
from matplotlib.collections import QuadMesh
from matplotlib.colors import LogNorm, Normalize
from matplotlib.figure import Figure

from gradlens.core.records import Hist1d, Hist2d, Record, TensorSummary

__all__ = ["hist1d", "hist2d", "dashboard", "layerwise", "Hist2dAxes", "SAVE_SUFFIXES", "LAYERWISE_SUMMARIES"]

#: File suffixes :func:`dashboard` can save to.
SAVE_SUFFIXES = (".png", ".pdf")

_CLAMP_COLOR = "#d62728"  # out-of-range counts
_RANGE_COLOR = "0.35"
_OUTSIDE_RANGE_COLOR = "0.88"  # evolution heatmap: outside a window's histogram range
_CMAP = "viridis"
_BAR_REACH = 0.6  # hist1d: the tallest bar's height, as a fraction of the (log) y axis


class Hist2dAxes(NamedTuple):
    """What :func:`hist2d` returns: the heatmap axes, its two marginals and the colorbar.

    ``param_marginal`` is above ``main`` (shared x), ``grad_marginal`` to its right (shared y).
    When :func:`hist2d` drew into a given axes they are inset axes of ``main``
    (``main.child_axes``), so they move with it.
    """

    main: Axes
    param_marginal: Axes
    grad_marginal: Axes
    colorbar: Colorbar

    @property
    def figure(self) -> Figure:
        return self.main.figure


# --------------------------------------------------------------------------- helpers


def _new_figure(figsize: tuple[float, float]) -> Figure:
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _axes_or_new(ax: Axes | None, figsize: tuple[float, float], fn: str) -> Axes:
    if ax is None:
        return _new_figure(figsize).add_subplot()
    if not isinstance(ax, Axes):
        raise TypeError(f"{fn}(ax=...) must be a matplotlib Axes or None, got {type(ax).__name__}")
    return ax


def _unpack(obj: Any, key: str, kind: type, fn: str, instrument: str) -> tuple[Any, Record | None]:
    if isinstance(obj, kind):
        return obj, None
    if isinstance(obj, Record):
        value = obj.get(key)
        if value is None:
            raise ValueError(
                f"{fn}: the record of step {obj.step} has no {key!r} entry (it has "
                f"{sorted(obj.keys())}); track it with gradlens.instruments.{instrument}()"
            )
        if not isinstance(value, kind):
            raise TypeError(
                f"{fn}: record[{key!r}] of step {obj.step} is a {type(value).__name__}, "
                f"expected a {kind.__name__}"
            )
        return value, obj
    raise TypeError(
        f"{fn}(record_or_hist=...) needs a gradlens Record or a {kind.__name__}, got "
        f"{type(obj).__name__}"
    )


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().to(torch.float64).numpy()


def _pct(part: float, total: float) -> str:
    return f"{100.0 * part / total:.2g}%" if total > 0 else "-"


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        return float(value)
    return None


def _log_norm(values: np.ndarray) -> LogNorm:
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size == 0:
        return LogNorm(vmin=1.0, vmax=10.0)
    vmin, vmax = float(positive.min()), float(positive.max())
    if vmax <= vmin:
        vmax = vmin * 10.0
    return LogNorm(vmin=vmin, vmax=vmax)


def _cmap_with_bad(color: str):
    from matplotlib import colormaps

    return colormaps[_CMAP].with_extremes(bad=color)


def _step_label(record: Record | None) -> str:
    if record is None:
        return ""
    return f"step {record.step}, N={record.num_samples}, K={record.micro_steps}: "


# --------------------------------------------------------------------------- hist1d


def hist1d(record_or_hist: Record | Hist1d, ax: Axes | None = None) -> Axes:
    """Plot the histogram of per-sample gradient elements of one window.

    Draws ``record["grad_hist_1d"]`` (or the given :class:`~gradlens.Hist1d`): x is the
    per-sample gradient element ``g_{n,j}`` (loss units per parameter unit), y the number of
    (sample, entry) pairs per bin on a log scale. The histogram range ``[lo, hi]`` is marked by
    dashed lines. Elements outside the range (counted in the end bins by the instrument) are
    taken out of those bins and drawn as red hatched bars just outside the range, labelled
    with their count and share, so clamping is never mistaken for mass at the range's ends.
    The y axis leaves headroom (the tallest bar reaches 60% of its log height), so the legend
    in the upper right corner never covers a bar.

    Args:
        record_or_hist: a record holding ``"grad_hist_1d"``, or a ``Hist1d``.
        ax: axes to draw into; a new figure (constrained layout, Agg canvas) when ``None``.

    Returns:
        The axes (its ``figure`` saves with ``ax.figure.savefig(path)``).
    """
    hist, record = _unpack(record_or_hist, "grad_hist_1d", Hist1d, "hist1d", "GradHist1d")
    ax = _axes_or_new(ax, (6.4, 4.0), "hist1d")
    counts = _np(hist.counts)
    edges = _np(hist.edges)
    lo, hi = float(edges[0]), float(edges[-1])
    total = float(counts.sum())
    low, high = float(hist.clamped_low), float(hist.clamped_high)
    inside = counts.copy()
    inside[0] = max(inside[0] - low, 0.0)
    inside[-1] = max(inside[-1] - high, 0.0)

    ax.stairs(inside, edges, fill=True, baseline=0.5, color="C0", alpha=0.85, label="in range")
    # Out-of-range bars: drawn outside [lo, hi], a little wider than a bin so they stay visible.
    width = max((hi - lo) / max(len(counts), 1), 0.03 * (hi - lo))
    ax.bar(
        [lo - width, hi], [low, high], width=width, align="edge", bottom=0.5,
        color=_CLAMP_COLOR, alpha=0.8, hatch="///", edgecolor=_CLAMP_COLOR,
        label=f"outside range: < lo {low:,.0f} ({_pct(low, total)}), "
        f"> hi {high:,.0f} ({_pct(high, total)})",
    )
    for x in (lo, hi):
        ax.axvline(x, color=_RANGE_COLOR, ls="--", lw=1.0)
    ax.plot([], [], color=_RANGE_COLOR, ls="--", lw=1.0, label=f"range [{lo:.3g}, {hi:.3g}]")
    if lo < 0.0 < hi:
        ax.axvline(0.0, color="k", lw=0.6, alpha=0.5)

    ax.set_yscale("log")
    top = max(float(counts.max()) if counts.size else 1.0, low, high, 1.0)
    # headroom for the legend: the tallest bar reaches _BAR_REACH of the log height
    ax.set_ylim(0.5, 0.5 * (top / 0.5) ** (1.0 / _BAR_REACH))
    ax.set_xlim(lo - 1.6 * width, hi + 1.6 * width)
    ax.set_xlabel(r"per-sample gradient element $g_{n,j}=\partial\ell_n/\partial\theta_j$")
    ax.set_ylabel("count (log scale)")
    ax.set_title(f"{_step_label(record)}{total:,.0f} gradient elements", fontsize="medium")
    ax.legend(loc="upper right", fontsize="small", framealpha=0.8)
    return ax


# --------------------------------------------------------------------------- hist2d


def _hist2d_axes(ax: Axes | None) -> tuple[Axes, Axes, Axes, Axes]:
    """(main, param marginal, grad marginal, colorbar) axes for :func:`hist2d`."""
    if ax is None:
        # A figure of its own: a grid, so constrained layout sizes every part exactly.
        fig = _new_figure((7.0, 6.0))
        grid = fig.add_gridspec(2, 3, width_ratios=[4.0, 1.0, 0.18], height_ratios=[1.0, 4.0])
        main = fig.add_subplot(grid[1, 0])
        top = fig.add_subplot(grid[0, 0], sharex=main)
        right = fig.add_subplot(grid[1, 1], sharey=main)
        cax = fig.add_subplot(grid[1, 2])
        return main, top, right, cax
    ax = _axes_or_new(ax, (7.0, 6.0), "hist2d")
    # Inside a given axes (e.g. a dashboard cell): marginals and colorbar are inset axes.
    top = ax.inset_axes((0.0, 1.03, 1.0, 0.24), sharex=ax)
    right = ax.inset_axes((1.03, 0.0, 0.24, 1.0), sharey=ax)
    cax = ax.inset_axes((1.31, 0.0, 0.04, 1.0))
    return ax, top, right, cax


def hist2d(record_or_hist: Record | Hist2d, ax: Axes | None = None) -> Hist2dAxes:
    """Plot the joint histogram of parameter values and per-sample gradient elements.

    Draws ``record["grad_hist_2d"]`` (or the given :class:`~gradlens.Hist2d`) as a heatmap:
    x is the parameter value ``theta_j`` (parameter units), y the per-sample gradient element
    ``g_{n,j}`` (loss units per parameter unit), colour the number of (sample, entry) pairs per
    cell on a log scale (empty cells are left blank). Above it, the parameter marginal; to its
    right, the gradient marginal (both log counts); dashed lines mark ``theta = 0`` and
    ``g = 0`` when inside the ranges. Elements outside a range are counted in the edge cells
    (as binned) and their numbers are given in the title.

    Args:
        record_or_hist: a record holding ``"grad_hist_2d"``, or a ``Hist2d``.
        ax: axes for the heatmap; the marginals and colorbar are then added as inset axes
            above and to the right of it (``ax.child_axes``), so leave room there. ``None``: a
            new figure (constrained layout, Agg canvas) with the four axes on a grid.

    Returns:
        :class:`Hist2dAxes` ``(main, param_marginal, grad_marginal, colorbar)``; ``.figure``
        is the figure.
    """
    hist, record = _unpack(record_or_hist, "grad_hist_2d", Hist2d, "hist2d", "GradHist2d")
    inset = ax is not None
    ax, top, right, cax = _hist2d_axes(ax)
    counts = _np(hist.counts)  # [param_bins, grad_bins]
    pe, ge = _np(hist.param_edges), _np(hist.grad_edges)
    total = float(counts.sum())

    heat = np.ma.masked_equal(counts.T, 0.0)  # [grad_bins, param_bins]: rows are y
    mesh = ax.pcolormesh(
        pe, ge, heat, norm=_log_norm(counts), cmap=_cmap_with_bad("none"), shading="flat",
        rasterized=True,
    )
    ax.set_xlim(pe[0], pe[-1])
    ax.set_ylim(ge[0], ge[-1])
    ax.set_xlabel(r"parameter value $\theta_j$")
    ax.set_ylabel(r"per-sample gradient $g_{n,j}$")

    top.stairs(counts.sum(axis=1), pe, fill=True, baseline=0.5, color="C0", alpha=0.85)
    right.stairs(
        counts.sum(axis=0), ge, fill=True, baseline=0.5, color="C0", alpha=0.85,
        orientation="horizontal",
    )
    top.set_yscale("log")
    right.set_xscale("log")
    top.set_ylim(bottom=0.5)
    right.set_xlim(left=0.5)
    top.tick_params(labelbottom=False, labelsize="x-small")
    right.tick_params(labelleft=False, labelsize="x-small")
    if inset:  # count axis on top, in the free corner, clear of the main axes' x tick labels
        right.tick_params(labelbottom=False, labeltop=True)
        right.xaxis.set_label_position("top")
    top.set_ylabel("count", fontsize="small")
    right.set_xlabel("count", fontsize="small")
    colorbar = ax.figure.colorbar(mesh, cax=cax)
    colorbar.set_label("count per cell (log)", fontsize="small")
    colorbar.ax.tick_params(labelsize="x-small")

    if pe[0] < 0.0 < pe[-1]:
        for a in (ax, top):
            a.axvline(0.0, color="k", lw=0.7, ls="--", alpha=0.6)
    if ge[0] < 0.0 < ge[-1]:
        for a in (ax, right):
            a.axhline(0.0, color="k", lw=0.7, ls="--", alpha=0.6)

    cp, cg = float(hist.clamped_param), float(hist.clamped_grad)
    top.set_title(
        f"{_step_label(record)}{total:,.0f} (theta, g) pairs\noutside range (in edge cells): "
        f"theta {cp:,.0f} ({_pct(cp, total)}), g {cg:,.0f} ({_pct(cg, total)})",
        fontsize="small",
    )
    return Hist2dAxes(ax, top, right, colorbar)


# --------------------------------------------------------------------------- layerwise

#: record key -> (what one cell shows, colour-bar label with units); see :func:`layerwise`
LAYERWISE_SUMMARIES: dict[str, tuple[str, str]] = {
    "batch_l2": (r"median per-sample norm $\mathrm{median}_n\,\|g_n\|$",
                 r"$\|g_n\|$ (loss per parameter unit)"),
    "sum_grad_squared": (r"$\sum_n \|g_n\|^2$ over the group's entries",
                         r"$\sum_n\|g_n\|^2$ (loss per parameter unit)$^2$"),
    "grad_norm": (r"window gradient norm $\|g\|$", r"$\|g\|$ (loss per parameter unit)"),
    "grad_hist_1d": ("fraction of gradient elements outside the histogram range",
                     "fraction outside the range"),
    "grad_hist_2d": ("fraction of gradient elements outside the gradient range",
                     "fraction outside the gradient range"),
    "norm_test": ("norm test", "norm test statistic"),
    "mean_gsnr": ("mean GSNR", r"GSNR $G_j^2/\mathrm{var}_j$"),
    "noise_scale": ("gradient noise scale", "B_simple (samples)"),
    "batch_dot": (r"Frobenius norm of the Gram matrix $[g_n\cdot g_m]$",
                  r"$\|[g_n\cdot g_m]\|_F$ (loss per parameter unit)$^2$"),
    "inner_test": ("inner product test", "inner test statistic"),
    "ortho_test": ("orthogonality test", "ortho test statistic"),
    "distance": (r"distance from the start $\|\theta_t-\theta_0\|$", "parameter units (L2)"),
    "update_size": (r"update size $\|\theta_{t+1}-\theta_t\|$", "parameter units (L2)"),
}
_RMS_BATCH_L2 = (r"RMS per-sample norm $\sqrt{\mathrm{mean}_n\|g_n\|^2}$ (the log kept summaries)",
                 r"$\|g_n\|$ (loss per parameter unit)")
_MISSING_COLOR = "0.82"  # a group without the value at that step


def _cell(key: str, value: Any, rms: bool) -> float:
    """The one number a layerwise cell shows for ``value`` (NaN when there is none)."""
    if value is None:
        return math.nan
    if isinstance(value, Hist1d):
        total = float(value.total)
        return (float(value.clamped_low) + float(value.clamped_high)) / total if total > 0 else math.nan
    if isinstance(value, Hist2d):
        total = float(value.total)
        return float(value.clamped_grad) / total if total > 0 else math.nan
    number = _as_float(value)
    if number is not None:
        return number
    if key == "batch_l2" and isinstance(value, (torch.Tensor, TensorSummary)):
        if isinstance(value, TensorSummary):
            return math.sqrt(max(value.sum, 0.0) / value.numel) if value.numel else math.nan
        sq = value.detach().double().reshape(-1)
        if sq.numel() == 0:
            return math.nan
        middle = float(sq.mean()) if rms else float(np.median(sq.cpu().numpy()))
        return math.sqrt(max(middle, 0.0))
    if isinstance(value, Mapping):  # per parameter: the sum over the group's entries
        total = 0.0
        for v in value.values():
            if isinstance(v, torch.Tensor):
                total += float(v.detach().double().sum())
            elif isinstance(v, TensorSummary):
                total += v.sum
            else:
                total += _cell("", v, rms)
        return total if value else math.nan
    if isinstance(value, torch.Tensor):
        return float(value.detach().double().norm())
    if isinstance(value, TensorSummary):
        return value.norm
    return math.nan


def _layerwise_data(records: Sequence[Record], key: str, fn: str):
    """(group names, steps [T], values [G, T], (what, unit)) for ``key``."""
    if not isinstance(key, str):
        raise TypeError(f"{fn}(key=...) must be a record key such as 'batch_l2', got {type(key).__name__}")
    with_groups = [r for r in records if r.groups]
    if not with_groups:
        raise ValueError(
            f"{fn}: no record has groups (record.groups is empty in all {len(records)}); build the "
            "Lens with groups, e.g. Lens(model, instruments, groups='module')"
        )
    used = [r for r in with_groups if any(key in v for v in r.groups.values())]
    if not used:
        keys = sorted({k for r in with_groups for v in r.groups.values() for k in v})
        raise ValueError(
            f"{fn}(key={key!r}): no group of any record has {key!r}; the groups hold {keys}: "
            f"pick one of them, e.g. key={keys[0]!r}" if keys else
            f"{fn}(key={key!r}): the records' groups hold no values"
        )
    names: dict[str, None] = {}
    for r in used:
        names.update(dict.fromkeys(r.groups))
    groups = list(names)
    rms = key == "batch_l2" and any(
        isinstance(v.get(key), TensorSummary) for r in used for v in r.groups.values()
    )
    data = np.full((len(groups), len(used)), np.nan)
    for t, r in enumerate(used):
        for i, g in enumerate(groups):
            if g in r.groups:
                data[i, t] = _cell(key, r.groups[g].get(key), rms)
    what = _RMS_BATCH_L2 if rms else LAYERWISE_SUMMARIES.get(key, (key, key))
    return groups, np.array([r.step for r in used], dtype=float), data, what


def _label_font(rows: int, height_in: float) -> tuple[float, int]:
    """(font size in points, label stride) so that group labels of ``rows`` rows in an axes
    ``height_in`` inches tall do not overlap."""
    pitch = 72.0 * height_in / max(rows, 1)  # points per row
    size = float(min(9.0, max(5.0, pitch / 1.35)))
    stride = max(1, math.ceil(size * 1.3 / pitch))
    return size, stride


def _layerwise_into(ax: Axes, records: Sequence[Record], key: str, log_scale: bool | None,
                    height_in: float, fn: str) -> tuple[QuadMesh, list[str]]:
    groups, steps, data, (what, unit) = _layerwise_data(records, key, fn)
    use_steps = bool(steps.size == 1 or np.all(np.diff(steps) > 0))
    x = steps if use_steps else np.arange(steps.size, dtype=float)
    finite = data[np.isfinite(data)]
    positive = finite.size > 0 and bool((finite > 0).all())
    if log_scale is None:
        log_scale = positive and float(finite.max()) / float(finite.min()) > 100.0
    elif log_scale and not positive:
        raise ValueError(
            f"{fn}(log_scale=True): the {key!r} summaries include values <= 0 (or none is "
            "finite), which a log colour scale cannot show; use log_scale=None or False"
        )
    if log_scale:
        norm = _log_norm(data)
    else:
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        norm = Normalize(vmin=lo, vmax=hi if hi > lo else lo + 1.0)
    mesh = ax.pcolormesh(
        _window_edges(x), np.arange(len(groups) + 1, dtype=float), np.ma.masked_invalid(data),
        norm=norm, cmap=_cmap_with_bad(_MISSING_COLOR), shading="flat", rasterized=True,
    )
    ax.set_ylim(len(groups), 0)  # the first group on top
    size, stride = _label_font(len(groups), height_in)
    rows = np.arange(0, len(groups), stride)
    ax.set_yticks(rows + 0.5, [groups[i] for i in rows], fontsize=size)
    ax.tick_params(axis="y", length=2)
    ax.set_xlabel("step (optimizer update)" if use_steps else "record index (steps not increasing)")
    shown = "" if stride == 1 else f", 1 in {stride} named"
    ax.set_ylabel(f"group ({len(groups)}{shown})")
    colorbar = ax.figure.colorbar(mesh, ax=ax, pad=0.01, aspect=max(20.0, 3.0 * height_in))
    colorbar.set_label(unit + (" (log)" if log_scale else ""), fontsize="small")
    colorbar.ax.tick_params(labelsize="x-small")
    missing = int(np.isnan(data).sum())
    note = f"; grey: no value ({missing} cells)" if missing else ""
    ax.set_title(f"{what} per group, {key!r}{note}", fontsize="medium")
    return mesh, groups


def layerwise(records_or_log: Sequence[Record] | str | os.PathLike, key: str = "batch_l2",
              path: str | os.PathLike | None = None, *, log_scale: bool | None = None) -> Figure:
    """One row per parameter group over the steps: a heatmap of ``record.groups[g][key]``.

    Each cell is one number per group and window (x = step, y = group in the order the Lens
    made them, the first on top), by key (:data:`LAYERWISE_SUMMARIES`):

    - ``batch_l2`` (``[N]`` of ||g_n||^2): the median per-sample norm median_n ||g_n|| (loss
      units per parameter unit); from a log that kept only a summary of ``batch_l2``, the RMS
      sqrt(mean_n ||g_n||^2) for every cell (the title says so);
    - numbers (``grad_norm``, ``mean_gsnr``, ``norm_test``, ``noise_scale``, ``distance``,
      ``update_size``, ``inner_test``, ``ortho_test``, ...): the value;
    - ``grad_hist_1d``: the fraction of elements outside the range (clamped low + high over all);
      ``grad_hist_2d``: the fraction outside the gradient range;
    - per-parameter dicts (``sum_grad_squared``): the sum over the group's entries,
      sum_n ||g_n||^2 of the group; other tensors (``batch_dot``): their L2 (Frobenius) norm.

    The colour scale is logarithmic when every value is positive and they span more than two
    decades (``log_scale`` forces it on or off); grey cells have no value (a group missing at
    a step, NaN, None). Readable with many groups: the figure grows with the number of groups
    (up to 18 inches), label fonts shrink to 5 pt and then every k-th group is named.

    Args:
        records_or_log: records (``lens.records``) or the path of a ``.jsonl`` log.
        key: the record key inside each group.
        path: when given, save the figure there (``.png`` at 100 dpi, or ``.pdf``).
        log_scale: ``None`` (automatic), True or False.

    Returns:
        The figure (its first axes holds the heatmap: a ``QuadMesh`` of ``[groups, steps]``).

    Raises:
        ValueError: no records, no record with groups, no group with ``key``, a bad ``path``
            suffix, or ``log_scale=True`` with values <= 0.
    """
    save_to = _check_save_path(path, "layerwise") if path is not None else None
    if log_scale is not None and not isinstance(log_scale, bool):
        raise TypeError(f"layerwise(log_scale=...) must be None, True or False, got {log_scale!r}")
    records, source = _load_records(records_or_log, "layerwise")
    if not records:
        where = f" in {source!r}" if source else ""
        raise ValueError(f"layerwise: no records{where}; nothing to plot")
    groups, _, _, _ = _layerwise_data(records, key, "layerwise")
    height = float(np.clip(1.6 + 0.11 * len(groups), 3.5, 18.0))
    width = 11.0 + min(3.0, max(len(g) for g in groups) * 0.06)
    fig = _new_figure((width, height))
    ax = fig.add_subplot()
    _layerwise_into(ax, records, key, log_scale, height - 1.2, "layerwise")
    if source:
        fig.suptitle(source, fontsize="small")
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save_to, dpi=100)
    return fig


# --------------------------------------------------------------------------- dashboard

# (record key, panel title, y label, draw a y=0 line)
_SCALAR_PANELS = (
    ("loss", "loss (window mean)", "loss", False),
    ("grad_norm", r"gradient norm $\|g\|$ (window gradient)", r"$\|g\|_2$", False),
    ("alpha", r"$\alpha$ (step size: <0 under-, >0 overshooting)", r"$\alpha$", True),
    ("noise_scale", "gradient noise scale", "samples", False),
    ("norm_test", "norm test", "statistic", False),
    ("mean_gsnr", "mean GSNR (gradient signal-to-noise)", "GSNR", False),
    ("distance", r"distance from the start $\|\theta_t-\theta_0\|$", "parameter units (L2)", False),
    ("update_size", r"update size $\|\theta_{t+1}-\theta_t\|$", "parameter units (L2)", False),
    ("cabs", "CABS batch size (plain SGD)", "samples", False),
    ("early_stopping", "EB early-stopping criterion (stop when > 0)", "EB", True),
)
#: the group key the dashboard's layerwise panel shows: the first of these the groups hold
_LAYERWISE_PREFERENCE = ("batch_l2", "grad_norm", "sum_grad_squared", "mean_gsnr", "norm_test",
                         "noise_scale", "grad_hist_1d", "update_size", "distance")


def _load_records(records_or_log_path: Any, fn: str = "dashboard") -> tuple[list[Record], str]:
    if isinstance(records_or_log_path, (str, os.PathLike)):
        from gradlens.output.log_reader import load_log

        return load_log(records_or_log_path), Path(records_or_log_path).name
    if isinstance(records_or_log_path, Record):
        return [records_or_log_path], ""
    try:
        records = list(records_or_log_path)
    except TypeError:
        raise TypeError(
            f"{fn}(records_or_log_path=...) needs a list of gradlens Records or the path "
            f"of a .jsonl log, got {type(records_or_log_path).__name__}"
        ) from None
    bad = [type(r).__name__ for r in records if not isinstance(r, Record)]
    if bad:
        raise TypeError(
            f"{fn}(records_or_log_path=...) got a sequence holding {bad[0]}, expected "
            "gradlens Records only"
        )
    return records, ""


def _check_save_path(path: str | os.PathLike, fn: str = "dashboard") -> Path:
    path = Path(path)
    if path.suffix.lower() not in SAVE_SUFFIXES:
        raise ValueError(
            f"{fn}(path={str(path)!r}): cannot save a {path.suffix or 'suffix-less'!s} "
            f"file; use one of {', '.join(SAVE_SUFFIXES)}"
        )
    return path


def _not_tracked(ax: Axes, title: str, what: str) -> None:
    ax.set_title(title, fontsize="medium")
    ax.text(
        0.5, 0.5, f"not tracked\n({what})", transform=ax.transAxes, ha="center",
        va="center", color="0.45", fontsize="medium",
    )
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_color("0.8")


def _scalar_panel(ax: Axes, records: Sequence[Record], key: str, title: str, ylabel: str,
                  zero_line: bool) -> None:
    steps, values = [], []
    for r in records:
        v = _as_float(r.get(key))
        if v is not None:
            steps.append(r.step)
            values.append(v)
    if not steps:
        _not_tracked(ax, title, f"no record has {key!r}")
        return
    y = np.asarray(values, dtype=float)
    ax.plot(steps, y, color="C0", lw=1.3, marker="." if len(steps) <= 80 else None, ms=4)
    finite = y[np.isfinite(y)]
    if finite.size and (finite > 0).all() and finite.max() / finite.min() > 100.0:
        ax.set_yscale("log")
    if zero_line:
        ax.axhline(0.0, color="k", lw=0.7, ls="--", alpha=0.6)
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel("step (optimizer update)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if finite.size < y.size:
        ax.text(
            0.99, 0.97, f"{y.size - finite.size} non-finite values not drawn",
            transform=ax.transAxes, ha="right", va="top", fontsize="x-small", color=_CLAMP_COLOR,
        )


def _window_edges(steps: np.ndarray) -> np.ndarray:
    """Column edges for windows at ``steps`` (sorted, distinct): midpoints, ends padded."""
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = 0.5 * (steps[1:] + steps[:-1])
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def _evolution_panel(ax: Axes, records: Sequence[Record]) -> None:
    pairs = [(r.step, r["grad_hist_1d"]) for r in records if isinstance(r.get("grad_hist_1d"), Hist1d)]
    title = "evolution of the gradient-element histogram"
    if not pairs:
        _not_tracked(ax, title, "no record has 'grad_hist_1d'")
        return
    steps = np.array([s for s, _ in pairs], dtype=float)
    use_steps = bool(np.all(np.diff(steps) > 0))
    if not use_steps:  # repeated or unsorted steps (e.g. appended runs): one column per record
        steps = np.arange(len(pairs), dtype=float)
    xe = _window_edges(steps)
    hists = [h for _, h in pairs]
    same_edges = all(torch.equal(h.edges, hists[0].edges) for h in hists)
    same_bins = all(h.counts.numel() == hists[0].counts.numel() for h in hists)
    ax.set_facecolor(_OUTSIDE_RANGE_COLOR)

    if same_edges:
        # One grid for every window: colour is the count per bin, exactly as recorded.
        counts = np.stack([_np(h.counts) for h in hists], axis=1)  # [bins, windows]
        mesh = ax.pcolormesh(
            xe, _np(hists[0].edges), np.ma.masked_equal(counts, 0.0), norm=_log_norm(counts),
            cmap=_cmap_with_bad("white"), shading="flat", rasterized=True,
        )
        label = "count per bin (log)"
        note = "white = empty bin; end bins include out-of-range elements"
    else:
        # Ranges adapted between windows: each column keeps its own bins (no resampling); the
        # colour is the count per unit gradient value so columns of different bin widths
        # compare; grey is outside that window's range.
        dens = [_np(h.counts) / np.diff(_np(h.edges)) for h in hists]
        norm = _log_norm(np.concatenate(dens))
        cmap = _cmap_with_bad("white")
        if same_bins:
            # A single mesh with two corner columns per window; the zero-width quads joining
            # neighbouring windows are masked.
            ys = np.stack([_np(h.edges) for h in hists], axis=1)  # [bins+1, windows]
            y_corners = np.repeat(ys, 2, axis=1)
            x_corners = np.broadcast_to(
                np.stack([xe[:-1], xe[1:]], axis=1).reshape(-1), y_corners.shape
            )
            data = np.zeros((ys.shape[0] - 1, 2 * len(hists) - 1))
            mask = np.ones_like(data, dtype=bool)
            data[:, ::2] = np.stack(dens, axis=1)
            mask[:, ::2] = data[:, ::2] == 0.0
            mesh = ax.pcolormesh(
                x_corners, y_corners, np.ma.array(data, mask=mask), norm=norm, cmap=cmap,
                shading="flat", rasterized=True,
            )
        else:
            for i, (h, d) in enumerate(zip(hists, dens)):
                mesh = ax.pcolormesh(
                    xe[i : i + 2], _np(h.edges), np.ma.masked_equal(d[:, None], 0.0), norm=norm,
                    cmap=cmap, shading="flat", rasterized=True,
                )
        lows = [h.range[0] for h in hists]
        highs = [h.range[1] for h in hists]
        ax.set_ylim(min(lows), max(highs))
        label = "count per unit gradient (log)"
        note = "ranges adapted: each column has its own bins; white = empty, grey = outside"
    colorbar = ax.figure.colorbar(mesh, ax=ax, pad=0.01)
    colorbar.set_label(label, fontsize="small")
    colorbar.ax.tick_params(labelsize="x-small")
    lo = min(h.range[0] for h in hists)
    hi = max(h.range[1] for h in hists)
    if lo < 0.0 < hi:
        ax.axhline(0.0, color="w", lw=0.7, ls="--", alpha=0.8)
    ax.set_xlim(xe[0], xe[-1])
    ax.set_xlabel("step (optimizer update)" if use_steps else "record index (steps not increasing)")
    ax.set_ylabel(r"per-sample gradient $g_{n,j}$")
    ax.set_title(f"{title}\n({note})", fontsize="medium")


def _has_scalar(records: Sequence[Record], key: str) -> bool:
    return any(_as_float(r.get(key)) is not None for r in records)


def _dashboard_layerwise_key(records: Sequence[Record]) -> str | None:
    keys = {k for r in records for v in r.groups.values() for k in v}
    return next((k for k in _LAYERWISE_PREFERENCE if k in keys), min(keys) if keys else None)


def dashboard(records_or_log_path: Sequence[Record] | str | os.PathLike,
              path: str | os.PathLike | None = None, *, layerwise_key: str | None = None) -> Figure:
    """One figure summarising a run, from records or a saved JSON-lines log.

    Only what was tracked is drawn (17 inches wide, constrained layout, rows stacked):

    - scalar panels, three per row, against the optimizer step, for each of ``"loss"`` (the
      window mean), ``"grad_norm"`` (L2 norm of the window gradient), ``"alpha"``,
      ``"noise_scale"`` (samples), ``"norm_test"``, ``"mean_gsnr"``, ``"distance"``,
      ``"update_size"``, ``"cabs"`` (samples) and ``"early_stopping"`` that some record holds;
      a y axis is logarithmic when all values are positive and span more than two decades;
    - a histogram row: the latest window's 1D histogram (:func:`hist1d`) and 2D histogram
      (:func:`hist2d`), and the 1D histograms over all windows as a heatmap (x = step,
      y = gradient element, colour = log count), those that exist. When every window has the
      same bins the heatmap shows the recorded counts unchanged. When range adaptation changed
      the bins between windows, nothing is resampled: each column is drawn at its own window's
      bins, the colour becomes count per unit gradient value (so bins of different width
      compare), and the area outside a window's range is grey;
    - when records have groups (``Lens(groups=...)``), a layerwise panel (:func:`layerwise`) of
      ``layerwise_key`` (default: the first of ``batch_l2``, ``grad_norm``,
      ``sum_grad_squared``, ``mean_gsnr``, ... that the groups hold).

    The quantities no record holds are named in one line at the bottom ("not tracked: ...").

    Args:
        records_or_log_path: the records (e.g. ``lens.records``) or a ``.jsonl`` log path
            (read with :func:`gradlens.output.log_reader.load_log`).
        path: when given, save the figure there; the suffix picks the format (``.png`` at
            100 dpi, or ``.pdf``).
        layerwise_key: the group key of the layerwise panel (see above).

    Returns:
        The figure.

    Raises:
        ValueError: no records, ``path`` has a suffix other than ``.png`` / ``.pdf``, or no
            group holds ``layerwise_key``.
    """
    save_to = _check_save_path(path) if path is not None else None
    records, source = _load_records(records_or_log_path)
    if not records:
        where = f" in {source!r}" if source else ""
        raise ValueError(f"dashboard: no records{where}; nothing to plot")

    scalars = [p for p in _SCALAR_PANELS if _has_scalar(records, p[0])]
    latest1 = next((r for r in reversed(records) if isinstance(r.get("grad_hist_1d"), Hist1d)), None)
    latest2 = next((r for r in reversed(records) if isinstance(r.get("grad_hist_2d"), Hist2d)), None)
    hists = [k for k, ok in (("hist1d", latest1), ("hist2d", latest2), ("evolution", latest1)) if ok is not None]
    lw_key = layerwise_key if layerwise_key is not None else _dashboard_layerwise_key(records)
    has_groups = lw_key is not None and any(r.groups for r in records)
    untracked = [p[0] for p in _SCALAR_PANELS if p not in scalars]
    untracked += [what for what, ok in (("grad_hist_1d", latest1), ("grad_hist_2d", latest2)) if ok is None]
    if not has_groups:
        untracked.append("groups (Lens(groups=...))")

    ncols = 3
    scalar_rows = [scalars[i : i + ncols] for i in range(0, len(scalars), ncols)]
    n_groups = len(_layerwise_data(records, lw_key, "dashboard")[0]) if has_groups else 0
    lw_height = float(np.clip(2.0 + 0.05 * n_groups, 4.0, 9.0))
    heights = [3.6] * len(scalar_rows) + ([5.6] if hists else []) + ([lw_height] if has_groups else [])
    if not heights:  # nothing at all: one empty note panel
        heights = [3.0]
    fig = _new_figure((17.0, sum(heights) + 0.9))
    subfigs = fig.subfigures(len(heights), 1, height_ratios=heights, squeeze=False)[:, 0]
    row = 0
    for panels in scalar_rows:
        keys = [p[0] for p in panels]
        if len(scalar_rows) > 1:  # a short last row keeps the column width of the others
            keys += ["."] * (ncols - len(panels))
        axes = subfigs[row].subplot_mosaic([keys], empty_sentinel=".")
        for key, title, ylabel, zero_line in panels:
            _scalar_panel(axes[key], records, key, title, ylabel, zero_line)
        row += 1
    if hists:
        ratios = [1.15 if k == "evolution" else 1.0 for k in hists]
        axes = subfigs[row].subplot_mosaic([hists], width_ratios=ratios)
        if latest1 is not None:
            ax1 = hist1d(latest1, ax=axes["hist1d"])
            ax1.set_title(f"latest window, {ax1.get_title()}", fontsize="medium")
            _evolution_panel(axes["evolution"], records)
        if latest2 is not None:
            top = hist2d(latest2, ax=axes["hist2d"]).param_marginal
            top.set_title(f"latest window, {top.get_title()}", fontsize="small")
        row += 1
    if has_groups:
        ax = subfigs[row].add_subplot()
        _layerwise_into(ax, records, lw_key, None, lw_height - 1.0, "dashboard")
        row += 1
    if row == 0:
        _not_tracked(subfigs[0].add_subplot(), "nothing to draw", "no record holds a quantity the dashboard shows")

    steps = [r.step for r in records]
    head = f"gradlens: {len(records)} windows, steps {min(steps)}-{max(steps)}"
    fig.suptitle(f"{head}  ({source})" if source else head, fontsize="large")
    if untracked:
        fig.supxlabel("not tracked: " + ", ".join(untracked), fontsize="small", color="0.4")
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(save_to, dpi=100)
    return fig
