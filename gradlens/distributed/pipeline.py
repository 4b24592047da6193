"""Pipeline parallelism (``torch.distributed.pipelining``): one Lens per stage, one record of
the whole model.

A pipeline puts the model's layers on different ranks (stages); every stage sees every sample
of the step, one micro-batch at a time, and its own parameters only. So the merge of a window
across the stages is not the data-parallel one (:mod:`gradlens.distributed.merge`, where ranks
hold different samples of the same parameters) but its transpose:

- N, K, the loss and the micro-batch sizes are the same on every stage: they are checked to
  agree and taken once (the loss from the last stage, the only one that computes it);
- per-sample squared norms ``[N]`` add elementwise over the stages (||g_n||^2 of the whole
  model is the sum over the stages' parameters), and so do the micro-steps' ||s_k||^2 of the
  two-batch noise scale and histogram counts;
- per-parameter sums (``sum_grad_squared``, MeanGSNR's moments) are each stage's own
  parameters, gathered: every stage ends with the entries of every stage; the window
  gradient's squared norm ||sum_n g_n||^2 (GradNorm, NormTest, NoiseScale, the two-batch noise
  scale) adds over the stages, so each stage sends its own, one number (``WindowStats.grad_sum``
  keeps this stage's own vectors).

What travels per tracked window: one ``all_reduce`` (the ``[N]`` norms, the histogram counts, a
small per-stage row of counts) and, for ``sum_grad_squared`` or MeanGSNR, one ``all_gather`` of
each stage's per-parameter sums (D_s numbers each, padded to the largest stage), through
:func:`gradlens.distributed.merge.exchange`.

The stage's micro-batches: :func:`stage_backwards` makes each ``backward_one_chunk`` of the
stage one micro-step of the Lens (a capture of its own), so 1F1B, which runs the backward of one
micro-batch between the forwards of others, is measured per micro-batch: each use's output
gradient carries the batch of the forward it came from, and the micro-step's state belongs to
the backward that runs.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

import torch
from torch import Tensor, nn

from gradlens import compat
from gradlens.core.param_shapes import full_shape
from gradlens.core.stats import Accumulators, DistParts, WindowStats
from gradlens.core.window import Window
from gradlens.distributed.merge import exchange

__all__ = ["PipelineInfo", "resolve_pipeline", "stage_backwards", "stage_layout", "merge_stages"]

#: what a Lens on a pipeline stage merges (the rest is refused when the Lens is built)
SUPPORTED_SCHEDULES = "ScheduleGPipe or Schedule1F1B (one stage per rank)"


@dataclass
class PipelineInfo:
    """The stage a Lens measures.

    Attributes:
        stage: the ``PipelineStage``.
        loss_fn: the schedule's loss (None when the Lens was given the stage, or the schedule
            has none).
        group: the pipeline's process group (one rank per stage).
        layout: filled by :func:`stage_layout`: per stage, ``[(name, shape, dtype), ...]``.
        last_rank: the rank (in ``group``) of the last stage.
        inside: set while a micro-step's own capture is entered.
    """

    stage: Any
    loss_fn: Any
    group: Any
    layout: list = field(default_factory=list)
    last_rank: int = -1
    #: a micro-step's own capture is being entered (``Lens.capture`` then captures it as usual)
    inside: bool = False

    @property
    def index(self) -> int:
        return int(self.stage.stage_index)

    @property
    def is_last(self) -> bool:
        return bool(self.stage.is_last)

    @property
    def reduction(self) -> str | None:
        """The loss reduction the schedule's ``loss_fn`` states (``nn.CrossEntropyLoss()``'s
        ``reduction``), or None."""
        red = getattr(self.loss_fn, "reduction", None)
        return red if red in ("mean", "sum") else None


def resolve_pipeline(obj: Any) -> tuple[Any, PipelineInfo | None]:
    """``(module to track, PipelineInfo)`` for ``Lens(schedule)`` or ``Lens(stage)``;
    ``(obj, None)`` for anything else. Refused: schedules of several stages per rank, and
    pipelines whose process group has more ranks than stages (pipeline x data parallel)."""
    if isinstance(obj, nn.Module):
        return obj, None
    kind = compat.pipeline_kind(obj)
    if kind is None:
        return obj, None
    if kind == "multi":
        raise TypeError(
            f"Lens: {type(obj).__name__} runs several pipeline stages per rank (interleaved or "
            f"zero-bubble schedules), which gradlens does not measure; use {SUPPORTED_SCHEDULES} "
            "and build the Lens on it: Lens(schedule, [...], optimizer=opt)"
        )
    stage, loss_fn = compat.pipeline_schedule_parts(obj) if kind == "single" else (obj, None)
    import torch.distributed as dist

    group = stage.group if stage.group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world != int(stage.num_stages):
        raise RuntimeError(
            f"Lens: the pipeline's process group has {world} ranks for {stage.num_stages} stages "
            "(pipeline x data or tensor parallelism), which gradlens does not merge yet; "
            f"supported: {SUPPORTED_SCHEDULES} with one rank per stage"
        )
    return stage.submod, PipelineInfo(stage, loss_fn, group)


def stage_layout(info: PipelineInfo, params: dict[str, Tensor]) -> None:
    """Once, when the Lens is built: every stage learns every stage's tracked parameters
    (names, full shapes, dtypes) and which rank is the last stage (one ``all_gather_object``).
    A name tracked on two stages is refused: the record keys every parameter by its name."""
    import torch.distributed as dist

    mine = (info.index, info.is_last, [(q, tuple(full_shape(p)), str(p.dtype)) for q, p in params.items()])
    rows: list = [None] * dist.get_world_size(info.group)
    dist.all_gather_object(rows, mine, group=info.group)
    seen: dict[str, int] = {}
    clash = []
    for index, _, names in sorted(rows, key=lambda r: r[0]):
        for q, _, _ in names:
            if q in seen:
                clash.append(f"{q!r} (stages {seen[q]} and {index})")
            seen[q] = index
    if clash:
        raise RuntimeError(
            f"Lens: the pipeline's stages track parameters of the same name: {', '.join(clash[:3])}; "
            "the record keys every parameter by its name, so build each stage from the whole "
            "model with the other stages' layers removed (torchtitan's way: the names stay those "
            "of the whole model), or give the stages' modules distinct names"
        )
    info.layout = [names for _, _, names in rows]  # by rank in the group
    info.last_rank = [r for r, row in enumerate(rows) if row[1]][0]


def placeholders(info: PipelineInfo, params: dict[str, Tensor]) -> dict[str, Tensor]:
    """Every stage's tracked parameters in rank order: this stage's own, the others as ``meta``
    tensors of their shape and dtype (what a merge context needs to lay out their entries)."""
    out: dict[str, Tensor] = {}
    for names in info.layout:
        for q, shape, dtype in names:
            out[q] = params[q] if q in params else torch.empty(shape, dtype=getattr(torch, dtype.split(".")[-1]),
                                                               device="meta")
    return out


def _micro_state(tap: Any) -> dict:
    return {name: getattr(tap, name) for name in type(tap).MICRO_STATE}


def _set_micro_state(tap: Any, state: dict) -> None:
    for name, value in state.items():
        setattr(tap, name, value)


@contextmanager
def stage_backwards(info: PipelineInfo, micro: Callable[[Tensor | None], ContextManager],
                    paused: Callable[[], ContextManager], tap: Any) -> Iterator[None]:
    """While it is active, every ``backward_one_chunk(chunk, loss=...)`` of the stage runs
    inside ``micro(loss)`` (one micro-step of the Lens; ``loss`` the micro-batch's loss on the
    last stage, None elsewhere), and the shape inference of a schedule's first step
    (:data:`gradlens.compat.PIPELINE_SETUP`: a forward and an ``autograd.grad`` of the first
    micro-batch, not a training micro-step) inside ``paused()`` (the Lens's hooks off). The
    stage's methods are shadowed on the instance, and restored.

    What ``tap`` (the Lens's Tap) notes in a forward for the micro-step that backpropagates it
    (``Tap.MICRO_STATE``: how often each parameter was used, parameters whose samples mix,
    unknown sample axes, the model's outputs) is kept per micro-batch: 1F1B and GPipe run other
    forwards before a micro-batch's backward, whose notes must not count for it."""
    stage = info.stage
    original = stage.backward_one_chunk
    forward = stage.forward_one_chunk
    setups = [name for name in compat.PIPELINE_SETUP if hasattr(stage, name)]
    noted: dict[int, dict] = {}  # chunk -> what its forward noted

    def forward_one_chunk(fwd_chunk_id, *args, **kwargs):
        before = _micro_state(tap)
        tap.reset_micro()
        try:
            return forward(fwd_chunk_id, *args, **kwargs)
        finally:
            noted[fwd_chunk_id] = _micro_state(tap)
            _set_micro_state(tap, before)

    def unhooked(name):
        method = getattr(stage, name)

        def run(*args, **kwargs):
            with paused():
                return method(*args, **kwargs)

        return run

    for name in setups:
        setattr(stage, name, unhooked(name))

    def backward_one_chunk(bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
        if not stage.has_backward:
            return original(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)
        if not full_backward:
            raise RuntimeError(
                "lens.capture(): this schedule splits the backward into input and weight parts "
                f"(zero-bubble), which gradlens does not measure; use {SUPPORTED_SCHEDULES}"
            )
        if bwd_chunk_id in noted:  # (the backward itself adds what reaches parameters)
            _set_micro_state(tap, {**noted.pop(bwd_chunk_id), "received": set()})
        with micro(loss):
            return original(bwd_chunk_id, loss=loss, full_backward=full_backward, last_backward=last_backward)

    stage.backward_one_chunk = backward_one_chunk
    stage.forward_one_chunk = forward_one_chunk
    try:
        yield
    finally:
        for name in ("backward_one_chunk", "forward_one_chunk", *setups):
            del stage.__dict__[name]


_REDUCTIONS = {"mean": 1.0, "sum": 2.0}


def _flat(acc: dict[str, Tensor], params: dict[str, Tensor]) -> Tensor:
    """This stage's per-parameter sums, flattened in ``params``' order, float64 (zeros where a
    parameter has no entry)."""
    parts = [acc[q].detach().reshape(-1).double() if q in acc else
             torch.zeros(full_shape(p).numel(), dtype=torch.float64) for q, p in params.items()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def merge_stages(whole: Window, instruments, info: PipelineInfo, ctx: Any, own: dict[str, Tensor]) -> Window:
    """The window of the whole model (module docstring). ``ctx``: the merge context, its
    ``params`` every stage's parameters (:func:`placeholders`); ``own``: this stage's."""
    stats, states = whole.stats, whole.states
    device = next((t.device for t in stats.batch_l2), torch.device("cpu"))
    row = torch.tensor([stats.num_samples, stats.micro_steps, stats.micro_size_sq, stats.loss_unknown,
                        float(stats.loss_sum), _REDUCTIONS.get(stats.reduction, 0.0)], dtype=torch.float64)
    # ||sum_n g_n||^2 adds over the stages' parameters: each stage sends its own (the supported
    # instruments read the window gradient only through it), not the vector
    grad_sq = stats.grad_sum_sq_norm().double() if "grad_sum" in ctx.needs else torch.zeros((), dtype=torch.float64)
    sums = [stats.batch_l2_all().double().to(device) if "batch_l2" in ctx.needs else
            torch.zeros(0, dtype=torch.float64, device=device),
            stats.micro_grad_sq.double().reshape(()).to(device), grad_sq.reshape(()).to(device)]
    quantities = [(q, acc) for q, acc in (("sum_grad_squared", stats.sum_grad_squared),) if q in ctx.needs]
    pieces = [_flat(acc, own).to(device) for _, acc in quantities]
    parts = [DistParts(sums=sums, per_rank=[row], pieces=pieces)]
    for inst in instruments:
        parts.append(inst.to_buffers(states[id(inst)], ctx))
    what = "the merge of pipeline window " + (str(ctx.step) if ctx.step is not None else "(this one)")
    got = exchange(parts, info.group, timeout=ctx.timeout, what=what)
    summed, per_rank, gathered = got[0]
    rows = per_rank[0]
    _check_rows(rows, info)
    last = rows[info.last_rank]
    merged = WindowStats(
        reduction=stats.reduction,
        num_samples=int(last[0]),
        micro_steps=int(last[1]),
        loss_sum=last[4].clone(),
        micro_grad_sq=summed[1],
        micro_size_sq=float(last[2]),
        loss_unknown=int(last[3]),
        sum_grad_squared=Accumulators(getattr(stats.sum_grad_squared, "pool", None)),
        grad_sum=stats.grad_sum,  # this stage's own (their dtypes: NormTest's rounding bound)
        grad_sum_sq=summed[2] if "grad_sum" in ctx.needs else None,
    )
    if "batch_l2" in ctx.needs and summed[0].numel():
        merged.batch_l2 = [summed[0]]
    for (quantity, _), per_stage in zip(quantities, gathered):
        acc = getattr(merged, quantity)
        for names, flat in zip(info.layout, per_stage):
            at = 0
            for q, shape, _ in names:
                p = ctx.params[q]
                n = full_shape(p).numel()
                value = flat[at : at + n].reshape(shape)
                at += n
                acc[q] = value.to(dtype=torch.promote_types(p.dtype, torch.float32), device=device)
    new_states = dict(states)
    for inst, g in zip(instruments, got[1:]):
        new_states[id(inst)] = inst.from_buffers(states[id(inst)], ctx, *g)
    return whole.merged(merged, new_states)


def _check_rows(rows: Tensor, info: PipelineInfo) -> None:
    """Every stage measured the same samples (N, K) with the same loss reduction."""
    differ = [name for j, name in ((0, "samples N"), (1, "micro-steps K"), (2, "sum of B_k^2"), (5, "loss reduction"))
              if bool((rows[:, j] != rows[0, j]).any())]
    if differ:
        raise RuntimeError(
            f"the pipeline's stages measured different windows ({', '.join(differ)} differ: "
            f"{rows[:, [0, 1, 5]].tolist()} as [N, K, reduction 1=mean 2=sum] per rank); every "
            "stage must capture the same schedule.step() calls with the same loss reduction "
            "(with lens.capture(): schedule.step(...) on every rank, each Lens with the same every=)"
        )
