"""The checks of :class:`~gradlens.Lens`' arguments: each bad value is refused when the Lens is
built, with a ``TypeError`` / ``ValueError`` / ``RuntimeError`` that names the argument, what was
received and the fix (never at the first capture)."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import Tensor, nn

from gradlens.capture.tracked import is_extended, tracked_parameters
from gradlens.compat import compiled_original
from gradlens.distributed.merge import check_not_sharded
from gradlens.distributed.fsdp import ShardedView
from gradlens.distributed.deepspeed import ZeroView
from gradlens.distributed.tensor_parallel import TP_QUANTITIES, TPLayout
from gradlens.distributed.fsdp import check_instruments as check_sharded_instruments
from gradlens.instruments.base import Instrument, check_instrument
from gradlens.lens.record import RESERVED_KEYS
from gradlens.measure.undefined import MODES
from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["began_unseen", "capture_error", "check_instruments", "check_not_meta", "check_options", "check_sinks", "check_tp_instruments", "data_group", "meter_layout", "tensor_parallel", "tp_fold", "tp_writer", "tracked_at_build",
           "watched_model"]


def watched_model(model: nn.Module) -> nn.Module:
    """The module a Lens watches (``torch.compile(model)``: the module itself), checked: an
    extended model, with no DTensor parameter that FSDP2 does not manage, not watched by another
    open Lens."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"Lens(model=...) takes an nn.Module, got {type(model).__name__}")
    model = compiled_original(model)  # torch.compile(model): watch the module itself
    if not is_extended(model):
        raise RuntimeError(
            f"the model ({type(model).__name__}) was not extended; call "
            "model = gradlens.extend(model) before creating the Lens"
        )
    check_not_sharded(model)
    other = getattr(model, "_gradlens_lens", None)
    other = other() if other is not None else None
    if other is not None and not other._closed:
        raise RuntimeError(
            f"{type(model).__name__} is already watched by an open Lens ({other!r}); close it "
            "first (lens.close(), or use `with Lens(...) as lens:`), or give one Lens all the "
            "instruments"
        )
    return model


def tracked_at_build(model: nn.Module, exclude: tuple[str, ...], instruments: Sequence[Instrument],
                     zero: ZeroView | None = None) -> tuple[dict[str, Tensor], ShardedView | ZeroView | None]:
    """The parameters a new Lens tracks (qualified name -> parameter) and, on a ``fully_shard``-ed
    model, its :class:`~gradlens.distributed.fsdp.ShardedView` (the Lens then tracks the unsharded
    parameters), under DeepSpeed ZeRO ``zero`` (:class:`~gradlens.distributed.deepspeed.ZeroView`,
    from :func:`~gradlens.distributed.deepspeed.resolve`), None otherwise; checked: some are left
    after ``exclude``, the instruments are allowed under FSDP2 / the ZeRO stage, none is on the
    meta device."""
    params = tracked_parameters(model, exclude)
    if not params:
        raise ValueError("the model has no trainable parameters left to track after exclusions")
    if zero is not None:  # DeepSpeed ZeRO: gradlens/distributed/deepspeed.py
        zero.check_instruments(instruments)
        return params, zero
    sharded = ShardedView.of(model)  # FSDP2 (fully_shard): gradlens/distributed/fsdp.py
    if sharded is not None:
        check_sharded_instruments(instruments)
        params = sharded.unsharded(params)
    check_not_meta(params)
    return params, sharded


def tensor_parallel(model: nn.Module, params: dict[str, Tensor], instruments: Sequence[Instrument]) -> TPLayout | None:
    """The :class:`~gradlens.distributed.tensor_parallel.TPLayout` of the tracked ``params``
    (None without DTensor parameters), the instruments checked against it."""
    layout = TPLayout.of(model, params)
    if layout is not None:
        check_tp_instruments(instruments)
    return layout


def meter_layout(lens: Any, model: nn.Module, params: dict[str, Tensor], instruments: Sequence[Instrument]) -> dict:
    """Sets ``lens._tp`` (:func:`tensor_parallel`) and returns the Meter's ``partitioned`` and
    ``silent`` arguments for the Lens's sharding: no stacked uses under ZeRO-3 or tensor
    parallelism; the replicated parameters a TP rank leaves out."""
    sharded = lens._sharded
    tp = lens._tp = tensor_parallel(model, params, instruments)
    return {"partitioned": tp is not None or (sharded is not None and sharded.partitioned),
            "silent": tp.silent if tp is not None else frozenset()}


def data_group(process_group: Any, tp: TPLayout | None) -> Any:
    """``Lens(process_group=...)`` as :func:`~gradlens.distributed.merge.resolve_group` takes it:
    under tensor parallelism the default is the data ranks only (the FSDP2 mesh's data dim;
    False, no merge, for tensor parallelism alone)."""
    if tp is None or process_group is False:
        return process_group
    if process_group is None:
        return tp.data_group if tp.data_group is not None else False
    import torch.distributed as dist

    peers = set(dist.get_process_group_ranks(tp.group))
    if isinstance(process_group, dist.ProcessGroup) and len(
            peers & set(dist.get_process_group_ranks(process_group))) > 1:
        raise ValueError(
            "Lens(process_group=...) holds several ranks of one tensor-parallel group, which see "
            "the same samples: their windows would be counted as different data; pass the "
            "data-parallel group only (e.g. mesh_2d['dp'].get_group()), or leave process_group "
            "out (the default under tensor parallelism: the FSDP2 mesh's data dim)"
        )
    return process_group


def tp_writer(tp: TPLayout | None) -> bool:
    """Under tensor parallelism only TP rank 0 writes (every TP rank holds the same records)."""
    return tp is None or tp.rank == 0


def tp_fold(tp: TPLayout | None, window: Any, meter: Any, ranks: Any, instruments: Sequence[Instrument]) -> Any:
    """``window`` folded over the TP group (:meth:`TPLayout.fold`), once (not again after it was
    folded, or merged over the data ranks: ``ranks.done``); unchanged otherwise."""
    if tp is None or ranks.done or getattr(window, "tp_folded", False):
        return window
    folded = tp.fold(window, meter.plan.needs, dict(meter.tap.params), tuple(meter.groups), ranks.timeout,
                     instruments)
    folded.tp_folded = True
    return folded


def check_tp_instruments(instruments: Sequence[Any]) -> None:
    """Refuse, under tensor parallelism, the instruments that read more than the window's
    shared sums (per-sample vectors of their own, layer factors, histograms, parameter values,
    curvature graphs, the optimizer's gradients): their states would need their own TP rule."""
    bad = []
    for inst in instruments:
        if getattr(inst, "tp_merges_by_sums", False) and getattr(inst, "sample", None) is None:
            continue  # its rank merge (sums add, extremes shared) holds over TP blocks (GradHist1d)
        own_state = type(inst).to_buffers is not Instrument.to_buffers
        extra = set(inst.needs) - TP_QUANTITIES
        if (own_state or extra or inst.bins_param_values or inst.reads_update_values
                or inst.reads_optimizer_grads):
            bad.append(type(inst).__name__)
    if bad:
        raise ValueError(
            f"instruments {', '.join(bad)} are not supported under tensor parallelism (a model with "
            "ColwiseParallel / RowwiseParallel DTensor parameters): their per-sample or per-layer "
            "states have no exact rule across tensor-parallel ranks yet; drop them from the Lens's "
            "instruments (BatchL2, GradNorm, SumGradSquared, NormTest, NoiseScale, "
            "NoiseScaleTwoBatch and GradHist1d without sample= work under tensor parallelism), "
            "or measure them on a run without tensor parallelism"
        )


def check_instruments(instruments: Sequence[Instrument]) -> list[Instrument]:
    """``Lens(instruments=...)`` as a list of instrument instances that pass
    :func:`~gradlens.instruments.base.check_instrument`, with distinct record keys none of which
    the Lens writes itself."""
    if isinstance(instruments, Instrument) or (isinstance(instruments, type) and issubclass(instruments, Instrument)):
        name = instruments.__name__ if isinstance(instruments, type) else type(instruments).__name__
        raise TypeError(
            f"Lens(instruments=...) takes a list of instruments, got {instruments!r}; pass a "
            f"list: Lens(model, [{name}()])"
        )
    if isinstance(instruments, (str, bytes)) or not isinstance(instruments, Iterable):
        raise TypeError(
            f"Lens(instruments=...) takes a list of instruments, got {instruments!r}; pass a "
            "list, e.g. Lens(model, [BatchL2(), GradNorm()])"
        )
    instruments = list(instruments)
    for inst in instruments:
        if not isinstance(inst, Instrument):
            raise TypeError(
                f"instruments must be gradlens.instruments objects, got {inst!r}; "
                "did you pass the class instead of an instance, e.g. BatchL2 instead of BatchL2()?"
            )
    for inst in instruments:
        check_instrument(inst)  # what it declares: key, needs, flags, the methods they call
    keys = [i.key for i in instruments]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"two instruments write the same record key(s) {dupes}; keep one of each")
    taken = [f"{type(i).__name__}.key={i.key!r}" for i in instruments if i.key in RESERVED_KEYS]
    if taken:
        raise ValueError(
            f"{', '.join(taken)} is a record key the Lens writes itself (reserved: "
            f"{list(RESERVED_KEYS)}); give the instrument another key, e.g. key = 'my_loss'"
        )
    return instruments


def check_not_meta(params: dict[str, Tensor]) -> None:
    """A model on the meta device has shapes without values: refused, with the fix."""
    on_meta = [n for n, p in params.items() if p.is_meta]
    if on_meta:
        shown = ", ".join(on_meta[:3]) + (", ..." if len(on_meta) > 3 else "")
        raise RuntimeError(
            f"the model's parameters {shown} ({len(on_meta)} of {len(params)}) are on the meta "
            "device (shapes without values); materialise them before building the Lens: "
            "model.to_empty(device='cpu') then initialise them (e.g. each module's "
            "reset_parameters()) or model.load_state_dict(weights)"
        )


def check_options(every, optimizer, keep_records, log_mode, chunk_elements, grad_scaler, undefined) -> None:
    """The Lens' schedule, optimizer, record, GradScaler and ``undefined`` arguments."""
    if isinstance(every, bool) or not (callable(every) or (isinstance(every, int) and every >= 1)):
        raise ValueError(f"every must be an int >= 1 or a callable step -> bool, got {every!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not isinstance(keep_records, (bool, int)) or (
        not isinstance(keep_records, bool) and keep_records < 0
    ):
        raise ValueError(
            f"keep_records must be True, False or an int >= 0 (keep the last n), got {keep_records!r}"
        )
    if log_mode not in ("resume", "append", "overwrite"):
        raise ValueError(
            f"log_mode must be 'resume', 'append' or 'overwrite', got {log_mode!r}"
        )
    if not isinstance(chunk_elements, int) or chunk_elements < 1:
        raise ValueError(f"chunk_elements must be a positive int, got {chunk_elements!r}")
    if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
        raise TypeError(
            f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
        )
    if undefined not in MODES:
        raise ValueError(f"undefined must be 'error' or 'exclude' or 'contribution', got {undefined!r}")


def check_sinks(sinks: Iterable[Any]) -> list[Any]:
    """The ``sinks=`` argument of :class:`~gradlens.Lens` as a list; every entry must have
    callable ``write(record)`` and ``close()`` (the sink protocol)."""
    if sinks is None or isinstance(sinks, (str, bytes)) or not isinstance(sinks, Iterable):
        raise TypeError(
            f"Lens(sinks=...) takes a list of sinks (objects with write(record) and close()), "
            f"got {type(sinks).__name__} {sinks!r}"
        )
    out = list(sinks)
    for sink in out:
        missing = [m for m in ("write", "close") if not callable(getattr(sink, m, None))]
        if missing:
            raise TypeError(
                f"Lens(sinks=[...]): {type(sink).__name__} {sink!r} lacks {' and '.join(m + '()' for m in missing)}; "
                "a sink is any object with write(record) and close() (see gradlens.output.sinks), e.g. "
                "gradlens.output.sinks.JsonlSink(path) or gradlens.integrations.wandb.WandbSink()"
            )
    return out


def began_unseen(optimizer: Any, step: int) -> bool:
    """At the first capture of a tracked window: whether ``optimizer``, a
    :class:`~gradlens.GradientAccumulateOptimizer`, has folded micro-steps of its current window
    already (a Lens built, or its state loaded, mid-window: the rest of that window is not the
    whole update). If so a ``RuntimeWarning`` says that window ``step`` is not recorded."""
    if not isinstance(optimizer, GradientAccumulateOptimizer) or not optimizer.micro_step:
        return False
    import warnings

    warnings.warn(
        f"the GradientAccumulateOptimizer is inside a window ({optimizer.micro_step} of its "
        f"{optimizer.accum_steps} micro-steps folded, after {optimizer.iterations} updates) that this Lens "
        f"did not see from its start (a Lens built, or a checkpoint loaded without the Lens's state, "
        f"mid-window): window {step} covers only part of that update, so it is not recorded (no record, "
        f"no log line); the Lens records from window {step + 1}, the next whole one. To record every "
        "window, build the Lens between windows, or load the Lens's state_dict saved with the checkpoint",
        RuntimeWarning,
        stacklevel=4,
    )
    return True


def capture_error(micro: Any) -> tuple[RuntimeError | None, bool]:
    """A finished capture's micro-step that cannot be folded into the window: the error and
    whether the window's sums are spoiled (dropped), or ``(None, False)``."""
    if not micro.seen:
        return RuntimeError(
            "lens.capture() exited without a backward pass through the watched model; "
            "call loss.backward() inside the with-block"
        ), False
    if micro.explicit and micro.loss_calls and micro.loss_calls[0].multiplier is None:
        return RuntimeError(
            "lens.capture(loss=...): backward did not pass through the given loss tensor, "
            "so what multiplied it is unknown; pass the tensor that is backpropagated (or "
            "scaled and then backpropagated), or state multiplier= instead"
        ), True
    return None, False
