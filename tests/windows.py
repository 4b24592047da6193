"""The tests' shared settings: every instrument (:func:`all_instruments`) and the window loop
(:func:`run_windows`), as BackPACK's tests share one settings file across its extensions.

A window is a list of micro-batches; a micro-batch is ``(x, y)`` or ``(x, y, forward_kwargs)``
(any other object with a ``forward=`` that knows it). :func:`run_windows` runs each micro-batch
the way a training loop does::

    out = model(x, **forward_kwargs); loss = loss_fn(out, y)
    with lens.capture(...): loss.backward()

and ends each window the way the optimizer given asks for: ``opt.step(); opt.zero_grad()``
(``accumulate="autograd"``: p.grad sums over the micro-steps, as a loop without
``GradientAccumulateOptimizer`` does), the exact window gradient set by hand before the step
(``accumulate="exact"``), a :class:`gradlens.GradientAccumulateOptimizer` stepped on every
micro-step, or ``lens.flush()`` without an optimizer. A loop that tests the loop itself (an
exception inside ``capture``, a GradScaler, DDP ranks) is written out in its test.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch.nn.functional as F
from torch import Tensor, nn

import gradlens
from gradlens import GradientAccumulateOptimizer, Lens
from gradlens.instruments import (
    Alpha,
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    MeanGSNR,
    NoiseScale,
    NoiseScaleTwoBatch,
    NormTest,
    OrthoTest,
    SumGradSquared,
)

# ------------------------------------------------------------------------------ every instrument
#: the first-order instruments, in the order :func:`all_instruments` returns them
ALL = (
    "BatchL2", "SumGradSquared", "GradNorm", "NormTest", "MeanGSNR", "NoiseScale", "NoiseScaleTwoBatch",
    "GradHist1d", "GradHist2d", "BatchDot", "Alpha", "InnerTest", "OrthoTest",
)
#: the instruments whose statistics cross the micro-steps (``mode="exact"`` / ``"sketch"``)
CROSS = ("BatchDot", "Alpha", "InnerTest", "OrthoTest")
_CLASSES = {
    "BatchL2": BatchL2, "SumGradSquared": SumGradSquared, "GradNorm": GradNorm, "NormTest": NormTest,
    "MeanGSNR": MeanGSNR, "NoiseScale": NoiseScale, "NoiseScaleTwoBatch": NoiseScaleTwoBatch,
    "GradHist1d": GradHist1d, "GradHist2d": GradHist2d, "BatchDot": BatchDot, "Alpha": Alpha,
    "InnerTest": InnerTest, "OrthoTest": OrthoTest,
}


def all_instruments(
    grad_r: float | None = None,
    param_r: float | None = None,
    *,
    bins: int | None = None,
    bins_2d: tuple[int, int] | None = None,
    leave_out: Sequence[str] = (),
    cross: dict | None = None,
    order: Sequence[str] = ALL,
    **options: dict,
) -> list:
    """Fresh instances of every first-order instrument (the names in :data:`ALL`).

    Args:
        grad_r: the histograms' gradient range ``(-grad_r, grad_r)``; None: the default range.
        param_r: GradHist2d's parameter range ``(-param_r, param_r)`` (with ``grad_r``).
        bins: GradHist1d's bins; ``bins_2d``: GradHist2d's ``(parameter, gradient)`` bins (None:
            the instrument's default).
        leave_out: class names left out (e.g. ``("NoiseScaleTwoBatch", "Alpha")``).
        cross: keyword arguments for each of :data:`CROSS` (e.g. ``{"mode": "sketch", "k": 64}``).
        order: the class names in the order wanted (a permutation of a subset of :data:`ALL`).
        options: class name -> further keyword arguments for that instrument, e.g.
            ``NoiseScale={"per_sample": True}``, ``GradHist1d={"adapt": "abs_max"}``.
    """
    unknown = set(leave_out) | set(options) | set(order)
    unknown -= set(ALL)
    if unknown:
        raise ValueError(f"all_instruments: unknown instrument names {sorted(unknown)}; the names are {ALL}")
    kw: dict[str, dict] = {name: {} for name in ALL}
    if bins is not None:
        kw["GradHist1d"]["bins"] = bins
    if bins_2d is not None:
        kw["GradHist2d"]["bins"] = bins_2d
    if grad_r is not None:
        kw["GradHist1d"]["range"] = (-grad_r, grad_r)
        if param_r is not None:
            kw["GradHist2d"]["range"] = ((-param_r, param_r), (-grad_r, grad_r))
    for name in CROSS:
        kw[name].update(cross or {})
    for name, extra in options.items():
        kw[name].update(extra)
    return [_CLASSES[name](**kw[name]) for name in order if name not in leave_out]


# ------------------------------------------------------------------------------ the window loop
def micro_batches(x: Tensor, y: Tensor, sizes: Sequence[int]) -> list[tuple[Tensor, Tensor]]:
    """One window: ``(x, y)`` split along dim 0 into micro-batches of ``sizes`` samples."""
    return list(zip(x.split(list(sizes)), y.split(list(sizes))))


def split_windows(batches, sizes: Sequence[int]) -> list[list[tuple[Tensor, Tensor]]]:
    """Windows from one ``(x, y)`` batch per window, each split into micro-batches of ``sizes``."""
    return [micro_batches(x, y, sizes) for x, y in batches]


@dataclass
class Run:
    """What :func:`run_windows` ran: the (extended) model, its optimizer and Lens (``records``),
    what each ``lens.flush()`` returned, and with ``snapshots=True`` copies of the model given at
    each window's start and after the last window (``thetas``)."""

    lens: Lens
    model: nn.Module
    optimizer: Any = None
    thetas: list = field(default_factory=list)
    flushed: list = field(default_factory=list)  # what each lens.flush() returned

    @property
    def records(self) -> list:
        return self.lens.records

    @property
    def record(self):
        """The only record (asserts there is one)."""
        assert len(self.lens.records) == 1, len(self.lens.records)
        return self.lens.records[0]


_LOSSES = {"ce": nn.CrossEntropyLoss, "mse": nn.MSELoss}


def _default_forward(model, mb):
    return model(mb[0], **(mb[2] if len(mb) > 2 else {}))


def run_windows(
    model: nn.Module,
    windows: Sequence[Sequence[Any]],
    instruments: Sequence[Any] | None = None,
    *,
    lens: Lens | None = None,
    loss: str | Callable = "ce",
    reduction: str = "mean",
    optimizer: Any = None,
    accumulate: str = "autograd",
    end: str | None = None,
    state: dict | None = None,
    objective: Callable | None = None,
    create_graph: bool = False,
    losses: bool | Callable = False,
    capture: dict | None = None,
    pass_loss: bool = False,
    forward: Callable = _default_forward,
    target: Callable = lambda mb: mb[1],
    size: Callable = lambda mb: len(mb[0]),
    on_micro: Callable | None = None,
    on_window: Callable | None = None,
    zero_grad: bool = False,
    snapshots: bool = False,
    fresh_copy: bool = True,
    close: bool = True,
    **lens_kwargs,
) -> Run:
    """Runs ``model`` through ``windows`` under a Lens; returns a :class:`Run`.

    Args:
        model: the model; ``fresh_copy=True`` runs ``gradlens.extend(copy.deepcopy(model))``,
            ``False`` extends and trains ``model`` itself.
        windows: a list of windows, each a list of micro-batches of any sizes.
        instruments: the Lens' instruments (not with ``lens``).
        lens: a Lens built by the test on ``model`` (then ``fresh_copy`` must be False and the
            optimizer is the test's too); else ``Lens(model, instruments, optimizer, **lens_kwargs)``.
        loss: ``"ce"`` / ``"mse"`` (that nn loss module with ``reduction``, extended), an
            ``nn.Module`` loss (extended), or a function ``loss(out, y)`` (a functional loss).
        reduction: the reduction of a loss module built from a name, and of ``accumulate="exact"``.
        optimizer: None (each window ends with ``lens.flush()``), a function ``params ->
            optimizer`` or an optimizer over ``model``'s parameters; a GradientAccumulateOptimizer
            steps on every micro-step with ``num_samples``.
        accumulate: for a torch optimizer: ``"autograd"`` (p.grad sums over the micro-steps) or
            ``"exact"`` (p.grad zeroed after each micro-step, the window's gradient set to the
            mean (``reduction="mean"``) or sum of the per-sample gradients before the step).
        end: how a window ends: ``"step"`` (``opt.step(); opt.zero_grad()``; the default with a
            torch optimizer; nothing with a GradientAccumulateOptimizer, which steps itself),
            ``"flush"`` (``lens.flush()``; the default without an optimizer; with one: a window
            whose update was skipped) or ``"none"`` (the test's ``on_window`` ends it, or nothing).
        state: ``lens.load_state_dict(state)`` before the first window.
        objective: backward of ``objective(loss, run, w, k)`` instead of the loss (a scaled loss,
            a regulariser, a division by the number of micro-steps, ...); it may return ``(tensor, capture kwargs)`` where
            what ``lens.capture`` gets depends on it (a framework's scaled loss: ``loss=scaled``).
        create_graph: ``loss.backward(create_graph=lens.create_graph)`` (curvature).
        losses: True: ``capture(losses=...)`` gets the detached per-sample cross-entropy losses
            ``[B]`` (a cross-entropy ``loss``); a function ``losses(out, mb)`` gives them.
        capture: further keyword arguments of ``lens.capture`` (e.g. ``{"reduction": "mean"}``);
            ``pass_loss``: ``capture(loss=loss)`` too.
        forward: ``forward(model, mb) -> output``; ``target(mb)``: what the loss compares with;
            ``size(mb)``: the micro-batch's samples (a GradientAccumulateOptimizer's
            ``num_samples``, the weight of ``accumulate="exact"``).
        on_micro: ``on_micro(run, w, k, loss)`` after micro-step k of window w (after the
            optimizer's micro-step, before the window ends); it may replace ``run.lens`` (a Lens
            restored from a state_dict mid-window: the next micro-steps use it).
        on_window: ``on_window(run, w)`` after window w ended.
        zero_grad: without an optimizer, ``model.zero_grad()`` after each ``lens.flush()``.
        snapshots: keep ``run.thetas``: copies of ``model`` at each window's start and after the
            last window.
        close: ``lens.close()`` at the end.
    """
    if lens is not None:
        if instruments is not None or lens_kwargs or fresh_copy:
            raise ValueError("run_windows(lens=...) runs the test's Lens on its own model: "
                             "pass fresh_copy=False and no instruments / Lens options")
        m = model
    else:
        m = gradlens.extend(copy.deepcopy(model) if fresh_copy else model)
    if isinstance(loss, str):
        loss_fn = gradlens.extend(_LOSSES[loss](reduction=reduction))
    elif isinstance(loss, nn.Module):
        loss_fn = gradlens.extend(loss)
    else:
        loss_fn = loss
    opt = optimizer(m.parameters()) if callable(optimizer) else optimizer
    if lens is None:
        lens = Lens(m, instruments, optimizer=opt, **lens_kwargs)
    if state is not None:
        lens.load_state_dict(state)
    wrapper = isinstance(opt, GradientAccumulateOptimizer)
    end = end or ("flush" if opt is None else "step")
    if end not in ("step", "flush", "none") or (end == "step" and opt is None):
        raise ValueError(f"run_windows(end={end!r}): use 'step' (with an optimizer), 'flush' or 'none'")
    run = Run(lens=lens, model=m, optimizer=opt)

    def snapshot():
        theta = copy.deepcopy(model)
        theta.load_state_dict(m.state_dict())
        run.thetas.append(theta)

    if snapshots:
        run.thetas.append(copy.deepcopy(model))
    if losses is True:
        if not (loss == "ce" or isinstance(loss, nn.CrossEntropyLoss)):
            raise ValueError(f"run_windows(losses=True) knows cross-entropy's per-sample losses, not {loss!r}: "
                             "pass losses=lambda out, mb: ...")
        losses = lambda out, mb: F.cross_entropy(out.detach(), target(mb), reduction="none")  # noqa: E731
    exact = opt is not None and not wrapper and accumulate == "exact"
    for w, window in enumerate(windows):
        acc = None
        for k, mb in enumerate(window):
            out = forward(m, mb)
            value = loss_fn(out, target(mb))
            kw = dict(capture or {})
            if losses:
                kw["losses"] = losses(out, mb)
            if pass_loss:
                kw["loss"] = value
            total = value
            if objective is not None:
                total = objective(value, run, w, k)
                if isinstance(total, tuple):
                    total, more = total
                    kw.update(more)
            with run.lens.capture(**kw):
                total.backward(create_graph=run.lens.create_graph) if create_graph else total.backward()
            if wrapper:
                opt.step(num_samples=size(mb))
                opt.zero_grad()
            elif exact:
                weight = size(mb) if reduction == "mean" else 1
                grads = [None if p.grad is None else p.grad * weight for p in m.parameters()]
                acc = grads if acc is None else [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
                opt.zero_grad()
            if on_micro is not None:
                on_micro(run, w, k, value)
        if end == "flush":
            run.flushed.append(run.lens.flush())
            if zero_grad:
                m.zero_grad()
        elif end == "step" and not wrapper:
            if exact:
                n = sum(size(mb) for mb in window) if reduction == "mean" else 1
                for p, a in zip(m.parameters(), acc):
                    p.grad = None if a is None else a / n
            opt.step()
            opt.zero_grad()
        if snapshots:
            snapshot()
        if on_window is not None:
            on_window(run, w)
    if close:
        run.lens.close()
    return run
