"""A Lens on a pipeline stage (``torch.distributed.pipelining``; the merge across stages:
:mod:`gradlens.distributed.pipeline`).

Each rank builds its Lens on its schedule (``Lens(schedule, [...], optimizer=opt)``, the stage's
module is tracked) and wraps the step: ``with lens.capture(): schedule.step(...)``. The window is
the optimizer update (one ``schedule.step()``, or several before ``opt.step()``); its micro-steps
are the pipeline's micro-batches, each stage's ``backward_one_chunk`` one micro-step.

**Units on stages without the loss.** Only the last stage computes the loss; the output gradient
that reaches an earlier stage is dL_k/d(output) of micro-batch k's loss as the schedule
backpropagates it (``loss_fn(output, target)``, nothing multiplied: torch's ``scale_grads``
divides ``p.grad`` by the number of micro-batches after the step, which per-sample units never
see). So g_n = B_k * dL_{k,n} for a mean loss and dL_{k,n} for a sum, with B_k the micro-batch's
samples as the stage's own input shows them: what a stage needs from the loss is its reduction
alone. It comes from the schedule's ``loss_fn`` (its ``reduction`` attribute, as every torch loss
module has; every rank builds its schedule with the loss), or from ``lens.capture(reduction=...)``
(a Lens built on the stage, or a loss function without the attribute). The last stage reads its
units from the extended loss as on one process; the merge checks that every stage used the same
reduction and measured the same N and K.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator, Sequence

from torch import Tensor

from gradlens.capture.losses import put_back_loss_calls, take_loss_calls
from gradlens.distributed.merge import MergeContext, check_ranks_agree, lens_fingerprint, resolve_group
from gradlens.distributed.pipeline import PipelineInfo, merge_stages, placeholders, stage_backwards, stage_layout
from gradlens.core.window import Window
from gradlens.instruments.base import Instrument
from gradlens.lens.rank_merge import RankMerge

__all__ = ["PipelineRankMerge", "SUPPORTED", "pipeline_capture", "rank_merge"]

#: the instruments a Lens on a pipeline stage merges across the stages (their window states add
#: over the stages' parameters, or are the stages' parameters' own)
SUPPORTED = ("BatchL2", "SumGradSquared", "GradNorm", "NormTest", "NoiseScale", "MeanGSNR",
             "NoiseScaleTwoBatch", "GradHist1d", "GradHist2d")


def _check_instruments(instruments: Sequence[Instrument], groups: Any, merge: str) -> None:
    from gradlens import instruments as known

    refused = [type(i).__name__ for i in instruments
               if not any(type(i) is getattr(known, name) for name in SUPPORTED)]
    refused += [f"{type(i).__name__}(adapt={i.adapt!r})" for i in instruments
                if type(i) is known.GradHist2d and i.adapt is not None]
    refused += [f"{type(i).__name__}(per_sample=True)" for i in instruments if getattr(i, "per_sample", False)]
    if refused:
        raise ValueError(
            f"Lens on a pipeline stage: {refused} are not merged across pipeline stages (their "
            "state pairs samples across layers: per-sample factors, sketches, parameter values, "
            f"or curvature); supported: {', '.join(SUPPORTED)} (GradHist2d with a fixed range)"
        )
    if groups is not None:
        raise ValueError("Lens on a pipeline stage: Lens(groups=...) is not merged across stages; drop groups")
    if merge != "sync":
        raise ValueError("Lens on a pipeline stage: merge must be 'sync' (the default)")


class PipelineRankMerge(RankMerge):
    """:class:`~gradlens.lens.rank_merge.RankMerge` for a pipeline stage: the window's merge
    is across the stages (:func:`gradlens.distributed.pipeline.merge_stages`), never deferred,
    and no DDP route."""

    def __init__(self, info: PipelineInfo, merge: str, timeout: Any, instruments: Sequence[Instrument], plan: Any,
                 groups: Any):
        _check_instruments(instruments, groups, merge)
        super().__init__(info.group, merge, timeout, instruments, plan)
        self.route = None
        self.info = info
        self.own: dict[str, Tensor] = {}
        self.params: dict[str, Tensor] = {}

    def check_agree(self, instruments, every, step, params, groups) -> None:
        """The stages' instruments and schedules agree (their parameters differ by design); every
        stage learns every stage's parameters (:func:`gradlens.distributed.pipeline.stage_layout`)."""
        fingerprint = lens_fingerprint(instruments, every, step, self.mode, {})
        del fingerprint["parameters"]
        check_ranks_agree(self.group, fingerprint, self.timeout)
        stage_layout(self.info, params)
        self.own = dict(params)
        self.params = placeholders(self.info, self.own)

    def context(self, params, sites, needs, route, step, groups) -> MergeContext:
        self.own = dict(params)
        self.params = placeholders(self.info, self.own)
        return MergeContext(self.params, sites, needs, memo=None, timeout=self.timeout, step=step, groups=())

    def merge(self, window: Window, instruments, ctx: MergeContext, defer: bool, first) -> Window:
        window = merge_stages(window, instruments, self.info, ctx, self.own)
        self.done = True
        return window


def rank_merge(pipe: PipelineInfo | None, process_group: Any, merge: str, timeout: Any,
               instruments: Sequence[Instrument], plan: Any, groups: Any) -> tuple[Any, RankMerge]:
    """The Lens's process group and :class:`~gradlens.lens.rank_merge.RankMerge`: on a pipeline
    stage the pipeline's group and :class:`PipelineRankMerge` (``process_group=False``: each
    stage's own records, nothing merged), else the group of ``Lens(process_group=...)``."""
    if pipe is not None and process_group is not False:
        if process_group is not None:
            raise ValueError(
                "Lens(schedule, process_group=...): a pipeline stage's Lens merges over the "
                "pipeline's own group (the stage's); drop process_group, or pass False to keep "
                "each stage's own records"
            )
        return pipe.group, PipelineRankMerge(pipe, merge, timeout, instruments, plan, groups)
    group = resolve_group(process_group)
    return group, RankMerge(group, merge, timeout, instruments, plan)


def pipeline_capture(lens: Any, info: PipelineInfo, reduction: str | None, losses: Any, multiplier: Any,
                     loss: Any) -> Iterator[None]:
    """``with lens.capture(): schedule.step(...)`` on a pipeline stage: each backward of a
    micro-batch is one capture of the Lens (module docstring). A generator that yields once
    (``Lens.capture`` delegates to it)."""
    if losses is not None or multiplier is not None or loss is not None:
        raise ValueError(
            "lens.capture() around schedule.step() takes reduction= only (the schedule computes "
            "each micro-batch's loss): drop losses=, multiplier= and loss="
        )
    stated = reduction if reduction is not None else info.reduction
    if not info.is_last and stated is None:
        raise ValueError(
            f"pipeline stage {info.index} computes no loss, so it needs the loss's reduction for "
            "per-sample units: build the schedule with a loss module that has one "
            "(Schedule1F1B(stage, n, loss_fn=gradlens.extend(nn.CrossEntropyLoss()))) and the Lens "
            "on the schedule, or say it: with lens.capture(reduction='mean'): schedule.step(...)"
        )
    if lens._window is None:  # untracked window: nothing to do, nothing to pay
        try:
            yield
        finally:
            take_loss_calls()  # (the step's losses: none is measured)
        return
    stash: list = []  # losses the schedule computed whose micro-batch's backward is still to run

    @contextmanager
    def micro(chunk_loss: Tensor | None) -> Iterator[None]:
        if not info.is_last:
            inner = lens.capture(stated, multiplier=1.0)
        elif reduction is not None:
            inner = lens.capture(reduction, loss=chunk_loss)
        else:  # the extended loss of this micro-batch, as on one process
            stash.extend(take_loss_calls())
            mine = [c for c in stash if c.output is chunk_loss]
            stash[:] = [c for c in stash if c.output is not chunk_loss]
            if not mine:
                raise RuntimeError(
                    "lens.capture(): the last pipeline stage's loss for this micro-batch did not "
                    "come from a loss passed through gradlens.extend(); build the schedule with "
                    "loss_fn=gradlens.extend(nn.CrossEntropyLoss()) (or any torch loss module), or "
                    "state the reduction: with lens.capture(reduction='mean'): schedule.step(...)"
                )
            put_back_loss_calls(mine)
            inner = lens.capture()
        with ExitStack() as stack:
            info.inside = True
            try:
                stack.enter_context(inner)
            finally:
                info.inside = False
            yield

    @contextmanager
    def paused() -> Iterator[None]:
        meter = lens._meter
        meter.remove()
        try:
            yield
        finally:
            meter.install()

    with stage_backwards(info, micro, paused, lens._meter.tap):
        yield
