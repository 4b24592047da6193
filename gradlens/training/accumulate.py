"""Exact gradient accumulation: :class:`GradientAccumulateOptimizer` and :class:`GradientAccumulateModel`.

A *window* is one real optimizer update made of K micro-steps; micro-step k has B_k samples and
N = sum_k B_k. Both classes produce, for every window, exactly the gradient one batch of N would:

* ``reduction="mean"`` (the user's loss is a mean over its micro-batch, so ``p.grad`` after
  micro-step k is ``grad_k = (1 / B_k) sum_{n in k} g_n``): the window gradient is

      g = sum_k B_k * grad_k / sum_k B_k  =  (1 / N) sum_n g_n,

  with B_k the ``num_samples`` of micro-step k (all B_k = 1 when ``num_samples`` is never given,
  i.e. a plain average of the micro-step gradients);
* ``reduction="sum"`` (the user's loss is a sum over its micro-batch): g = sum_k grad_k.

The normalisation uses the counts the window actually holds, never K, so unequal micro-batches
and a partial last window (:meth:`GradientAccumulateOptimizer.flush`) stay exact.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradlens import compat
from gradlens.distributed.fsdp import check_fold as check_fsdp_fold
from gradlens.core.counter import WindowCounter, counter_property

__all__ = ["GradientAccumulateOptimizer", "GradientAccumulateModel", "AccumulationState"]

_STATE_KEY = "gradlens_accumulate"
_STATE_VERSION = 2  # 2: accumulators as kept (running means) + last_weight; 1: sums
_READS_VERSIONS = (1, 2)
_REDUCTIONS = ("mean", "sum")
#: the section's keys of the window counters (:class:`~gradlens.core.counter.WindowCounter`), in order
_SECTION_COUNTERS = {"micro_steps": "micro_step", "updates": "iterations", "skipped": "skipped_windows",
                     "has_updated": "has_updated", "samples": "weight"}

ClipFn = Callable[[list[Tensor]], Any]
"""``clip(params)``: called once per window with the parameters whose ``.grad`` holds the
unscaled window gradient; it modifies those ``.grad`` in place (its return value is ignored)."""

WindowEndHook = Callable[["GradientAccumulateOptimizer", bool], None]
MicroStepHook = Callable[["GradientAccumulateOptimizer", "float | None"], None]
WindowGradHook = Callable[["GradientAccumulateOptimizer"], None]


def check_accum_steps(
    accum_steps: Any,
    meaning: str = "the number of micro-steps per update",
    fix: str = "use accum_steps=1 for no accumulation",
) -> int:
    """``accum_steps`` as an int >= 1, or a TypeError/ValueError that says what it means."""
    if isinstance(accum_steps, bool) or not isinstance(accum_steps, numbers.Integral):
        raise TypeError(
            f"accum_steps must be an int >= 1 ({meaning}), "
            f"got {accum_steps!r} of type {type(accum_steps).__name__}."
        )
    if accum_steps < 1:
        raise ValueError(f"accum_steps must be >= 1 ({meaning}), got {accum_steps}; {fix}.")
    return int(accum_steps)


def _check_reduction(reduction: Any) -> str:
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction must be 'mean' (the loss is a mean over its micro-batch) or 'sum' "
            f"(a sum), got {reduction!r}."
        )
    return reduction


def _grads_finite(params: Sequence[Tensor]) -> bool:
    """Whether every ``p.grad`` of ``params`` is finite: one reduction, one host read."""
    flags = [
        torch.isfinite(g._values() if g.is_sparse else g).all()
        for g in (p.grad for p in params) if g is not None
    ]
    return bool(torch.stack(flags).all()) if flags else True


@dataclass
class AccumulationState:
    """Everything a :class:`GradientAccumulateOptimizer` knows about its current window and
    its history (optax ``MultiStepsState`` in spirit).

    Attributes:
        counter: the window lifecycle (:class:`~gradlens.core.counter.WindowCounter`): micro-steps and
            their weight in the open window, real updates, skipped windows, ``has_updated``;
            the five attributes below are its counters under the wrapper's names.
        micro_step: micro-steps folded into the open window.
        iterations: real updates so far.
        skipped_windows: windows dropped (inf/nan under a GradScaler, or :meth:`reset`).
        has_updated: whether the last ``step()``/``flush()`` made a real update.
        weight: sum of the window's micro-step weights (``num_samples``, or 1 each).
        weighted: whether the window's micro-steps gave ``num_samples`` (None: none yet).
        via_scaler: whether they came through a GradScaler (None: none yet).
        accumulators: parameter -> the window so far ``[*param]`` (accumulation dtype): under
            ``reduction="mean"`` the running weighted mean ``sum_k w_k grad_k / W_p`` with W_p
            = ``last_weight[p]``, under "sum" the running sum ``sum_k grad_k`` (unscaled).
        last_weight: parameter -> the window's weight when its accumulator was last written.
        versions: parameter -> its accumulator's tensor version after the wrapper's last write
            (a change made elsewhere is an error, not a wrong window).
        fused: parameters whose window gradient the closing micro-step wrote straight into
            ``p.grad``.
        pool: parameter -> a buffer for its accumulator where the micro-step's ``p.grad``
            cannot be kept as it, reused from window to window (a fresh allocation per window
            costs more than the fold itself on CPU: first-touch page faults).
        folded: parameter -> (weak reference to the ``p.grad`` folded last, its version), to
            tell a second ``step()`` or a missing ``zero_grad()`` from a fresh gradient.
        noted_samples: the micro-batch size a Lens reported for the coming ``step()``.
    """

    counter: WindowCounter = field(default_factory=WindowCounter)
    weighted: bool | None = None
    via_scaler: bool | None = None
    accumulators: dict = field(default_factory=dict)
    last_weight: dict = field(default_factory=dict)
    versions: dict = field(default_factory=dict)
    fused: set = field(default_factory=set)
    pool: dict = field(default_factory=dict)
    folded: dict = field(default_factory=dict)
    noted_samples: int | None = None

    micro_step = counter_property("micro_steps", "micro-steps folded into the open window", "counter")
    iterations = counter_property("updates", "real updates so far", "counter")
    skipped_windows = counter_property("skipped", "windows dropped (inf/nan under a GradScaler, or reset())", "counter")
    has_updated = counter_property("has_updated", "whether the last step()/flush() made a real update", "counter")
    weight = counter_property("samples", "sum of the window's micro-step weights (num_samples, or 1 each)", "counter")

    def reset_window(self) -> None:
        self.counter.clear()
        self.weighted, self.via_scaler = None, None
        self.accumulators, self.last_weight, self.versions, self.fused = {}, {}, {}, set()

    def skip(self) -> None:
        """End the window without an update: its gradients are dropped and it is counted."""
        self.reset_window()
        self.counter.close(updated=False)

    def finite(self) -> bool:
        """Whether every accumulator is finite (one device sync per window, scaler only)."""
        accs = list(self.accumulators.values())
        if not accs:
            return True
        return bool(torch.stack([torch.isfinite(a).all() for a in accs]).all())

    def check_untouched(self, p: Tensor, acc: Tensor) -> None:
        """Raise if ``acc`` (``p``'s accumulator) was changed since the wrapper last wrote it."""
        if compat.tensor_version(acc) != self.versions.get(p):
            raise RuntimeError(
                "the window's accumulated gradient was changed outside the wrapper: "
                "GradientAccumulateOptimizer keeps the window's first p.grad as its accumulator, "
                "and something modified it in place (model.zero_grad(set_to_none=False) zeroes "
                "p.grad in place); clear gradients with opt.zero_grad() or "
                "model.zero_grad(set_to_none=True)"
            )

    def section(self, params: Sequence[Tensor], accum_steps: int, reduction: str) -> dict[str, Any]:
        """The wrapper's versioned ``state_dict`` section: the counters, the window's weight and
        its accumulators keyed by the parameter's flat index in ``params`` (copies: later windows
        are written into the same buffers)."""
        return {
            "version": _STATE_VERSION,
            "accum_steps": accum_steps,
            "reduction": reduction,
            **self.counter.state_dict(_SECTION_COUNTERS),
            "weighted": self.weighted,
            "via_scaler": self.via_scaler,
            "accumulators": {  # as kept (copies): running means under "mean", sums under "sum"
                i: self.accumulators[p].clone() for i, p in enumerate(params) if p in self.accumulators
            },
            "last_weight": {i: self.last_weight[p] for i, p in enumerate(params) if p in self.accumulators},
        }

    @classmethod
    def from_section(cls, section: dict[str, Any], params: Sequence[Tensor], accum_steps: int, reduction: str,
                     accum_dtype: torch.dtype) -> "AccumulationState":
        """The state saved by :meth:`section`, checked against the wrapper that loads it.

        Raises:
            ValueError: wrong section version, another ``reduction``, a saved mid-window micro-step
                count not below ``accum_steps``, or accumulators whose index or shape does not
                match ``params``.
        """
        accumulators: dict[Tensor, Tensor] = {}
        version = section.get("version")
        if version not in _READS_VERSIONS:
            raise ValueError(
                f"state_dict['{_STATE_KEY}']['version'] is {version!r}, this gradlens reads "
                f"version {' or '.join(map(str, _READS_VERSIONS))}; save it again with a "
                "matching gradlens version."
            )
        if section["reduction"] != reduction:
            raise ValueError(
                f"the state_dict was saved with reduction={section['reduction']!r}, this "
                f"optimizer has reduction={reduction!r}; construct it with the same "
                f"reduction."
            )
        st = cls()
        st.counter.load_state_dict(section, _SECTION_COUNTERS, where=f"state_dict['{_STATE_KEY}']",
                                   defaults={"skipped_windows": 0})  # checked, as the rest, before anything changes
        if section["micro_step"] >= accum_steps:
            raise ValueError(
                f"the state_dict was saved at micro_step={section['micro_step']} (accum_steps="
                f"{section['accum_steps']}), which does not fit accum_steps={accum_steps}; "
                f"construct the optimizer with accum_steps={section['accum_steps']}."
            )
        for index, acc in section["accumulators"].items():
            if not (0 <= index < len(params)) or acc.shape != params[index].shape:
                got = "no parameter" if not 0 <= index < len(params) else tuple(params[index].shape)
                raise ValueError(
                    f"the state_dict holds an accumulator of shape {tuple(acc.shape)} for "
                    f"parameter {index}, but this optimizer's parameter {index} has {got}; "
                    f"load it into an optimizer over the same model."
                )
            p = params[index]
            dtype = torch.promote_types(accum_dtype, p.dtype)
            accumulators[p] = acc.detach().to(device=p.device, dtype=dtype, copy=True)
        saved_weight = section.get("last_weight", {})
        index = {p: i for i, p in enumerate(params)}
        for p, acc in accumulators.items():
            if section["version"] == 1:  # sums: the running mean under "mean"
                if reduction == "mean":
                    acc.div_(st.weight)
                st.last_weight[p] = st.weight
            else:
                st.last_weight[p] = float(saved_weight[index[p]])
            st.versions[p] = compat.tensor_version(acc)
        st.accumulators = accumulators
        st.weighted = section["weighted"]
        st.via_scaler = section.get("via_scaler")
        return st

    def fold(self, params: Sequence[Tensor], weight: float, grad_scale: Tensor | float | None, *,
             mean: bool, accum_steps: int, accum_dtype: torch.dtype) -> None:
        """Fold this micro-step's ``p.grad`` (weight ``weight``) into the accumulators; on the
        window's closing micro-step (no GradScaler) the window gradient goes straight into
        ``p.grad`` instead (``fused``). The window's counters (``micro_step``, ``weight``) are the
        caller's to advance."""
        st = self
        w_prev = st.weight
        w_new = w_prev + weight
        closing = st.micro_step + 1 >= accum_steps and grad_scale is None
        share = weight / w_new if mean else 1.0  # this micro-step's share of the window so far
        factor: Tensor | float = share  # ... and of its unscaled gradient
        if isinstance(grad_scale, Tensor):
            factor = share / grad_scale.double()
        elif grad_scale is not None:
            factor = share / grad_scale
        for p in params:
            grad = p.grad
            if grad is None:
                continue
            st.folded[p] = (weakref.ref(grad), compat.tensor_version(grad))
            if grad.is_sparse:
                raise RuntimeError(
                    "GradientAccumulateOptimizer does not support sparse gradients; use a dense "
                    "embedding (sparse=False)."
                )
            dtype = torch.promote_types(accum_dtype, p.dtype)
            plain = grad_scale is None and grad.dtype == dtype and not grad.requires_grad
            f = factor.to(p.device, dtype) if isinstance(factor, Tensor) else factor
            acc = st.accumulators.get(p)
            if acc is None:
                if closing and plain:  # p's only gradient of the window: it is the window gradient
                    if share != 1.0:
                        grad.mul_(share)
                    st.fused.add(p)
                    continue
                if plain and share == 1.0 and not compat.is_view(grad):
                    acc = grad  # kept as the accumulator, no copy (zero_grad() hands p.grad back)
                else:
                    acc = st.pool.get(p)
                    if acc is None or acc.shape != p.shape or acc.dtype != dtype or acc.device != p.device:
                        acc = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format)
                        st.pool[p] = acc
                    torch.mul(grad.detach(), f, out=acc)
                st.accumulators[p] = acc
                st.last_weight[p] = w_new
                st.versions[p] = compat.tensor_version(acc)
                continue
            st.check_untouched(p, acc)
            grad = grad.detach()
            keep = st.last_weight[p] / w_new if mean else 1.0  # the accumulator's share
            in_step = st.last_weight[p] == w_prev  # p was folded at the last micro-step too
            if closing and plain:  # the window gradient straight into this micro-step's p.grad
                if mean and in_step:
                    torch.lerp(acc, grad, share, out=grad)
                elif mean:
                    grad.mul_(share).add_(acc, alpha=keep)
                else:
                    grad.add_(acc)
                st.fused.add(p)
                continue
            if mean and in_step and plain:
                acc.lerp_(grad, share)
            else:
                if keep != 1.0:
                    acc.mul_(keep)
                if isinstance(f, Tensor):
                    acc.addcmul_(grad, f)
                else:
                    acc.add_(grad, alpha=f)
            st.last_weight[p] = w_new
            st.versions[p] = compat.tensor_version(acc)



class GradientAccumulateOptimizer(Optimizer):
    """Wraps a ``torch.optim`` optimizer so that it updates once every ``accum_steps`` micro-steps.

    Each :meth:`step` folds the current ``p.grad`` (the gradient of one micro-batch's loss, as
    the user computed it) into the wrapper's own accumulators; the ``accum_steps``-th call writes
    the window gradient (see the module docstring for its exact normalisation) into ``p.grad``,
    applies ``clip`` once, and calls the inner optimizer **once**, so momentum / Adam moments,
    weight decay and the inner step count advance once per window. Call ``zero_grad()`` between
    micro-steps as usual: it clears ``p.grad`` only, never the accumulators.

    Cost: one pass over each gradient per micro-step, as autograd's own accumulation. Under
    ``reduction="mean"`` the accumulator is the running weighted mean (each fold one ``lerp``);
    the window's first ``p.grad`` is kept as the accumulator itself when it is a plain tensor
    of the accumulation dtype (no copy; ``zero_grad()`` then hands ``p.grad`` back cleared), and
    the closing micro-step folds straight into its ``p.grad``. So, as in plain PyTorch
    accumulation, a ``p.grad`` tensor kept across ``step()`` calls changes: clone what you keep.
    An accumulator changed in place by someone else (``model.zero_grad(set_to_none=False)``
    zeroes ``p.grad`` in place) is an error at the next ``step()``.

    Accumulators live in the wrapper (not in the inner optimizer's ``state``); their dtype is the
    wider of ``accum_dtype`` and the parameter's dtype (float32 for bf16/fp16 parameters, float64
    for float64 parameters). The window gradient is cast to the parameter's dtype once, when it is
    written into ``p.grad`` before the inner step.

    Step hooks registered on the wrapper (:meth:`register_step_pre_hook`,
    :meth:`register_step_post_hook`) fire on **real updates only**: the pre-hooks right before the
    inner optimizer's step (parameters still at theta_t, ``p.grad`` holding the clipped window
    gradient), the post-hooks right after it (parameters at theta_{t+1}). They are called as
    ``hook(optimizer, (optimizer,), {})``; values returned by pre-hooks are ignored. Global hooks
    (``torch.optim.optimizer.register_optimizer_step_pre_hook``) fire through the inner optimizer,
    once per real update. A window skipped by a GradScaler (inf/nan) fires no step hook; use
    :meth:`register_window_end_hook` to see every window end.

    AMP: use the standard ``torch.amp.GradScaler`` loop unchanged, calling ``scaler.step`` and
    ``scaler.update`` every micro-step, and give the scaler to the wrapper
    (``grad_scaler=scaler``). The wrapper declares ``_step_supports_amp_scaling``, so the scaler
    calls its ``step`` on *every* micro-step (also one with inf/nan) without unscaling ``p.grad``;
    the wrapper reads the scale (:func:`gradlens.compat.grad_scaler_scale`), folds
    ``grad_k * B_k / scale_k`` into its fp32 accumulators (the unscale is fused into the
    accumulation, so the window gradient is unscaled even if the scale changed between
    micro-steps), clips once per window on the unscaled gradient, and checks the accumulators
    for inf/nan itself, once per window: a window with one skips the whole window
    (``has_updated`` is False, the accumulators are dropped, the next window starts clean).
    Without ``grad_scaler=``, the scale GradScaler attaches to the optimizer for this protocol
    (``optimizer.grad_scale``) is used; that is read in one place only.

    Misuse is an error, not a mis-weighted window: ``step()`` twice for one backward, a
    backward on top of a gradient already folded (a forgotten ``zero_grad()``: clear the
    gradients with ``opt.zero_grad()`` or ``set_to_none=True``), and, when a
    :class:`~gradlens.Lens` reports the micro-batch it captured, a ``num_samples`` unlike it.

    The window lives in one state object, :class:`AccumulationState` (``opt.accum_state``),
    as optax's ``MultiSteps`` keeps ``MultiStepsState``; the wrapper implements the
    ``torch.optim.Optimizer`` interface (``param_groups``, ``state``, ``state_dict``, step and
    state-dict hooks) itself instead of re-creating ``Optimizer``'s private internals.

    Args:
        optimizer: the inner ``torch.optim.Optimizer``.
        accum_steps: micro-steps per real update, >= 1.
        reduction: ``"mean"`` or ``"sum"``, how the user's loss reduces over its micro-batch.
        accum_dtype: the minimum accumulator dtype (default float32).
        grad_scaler: the ``torch.amp.GradScaler`` whose ``scaler.step(opt)`` drives this
            wrapper (see AMP above).
        clip: ``clip(params) -> Any``, called once per window, before the inner step, with the list
            of parameters whose ``.grad`` holds the unscaled window gradient; it must modify those
            ``.grad`` in place. E.g. ``functools.partial(torch.nn.utils.clip_grad_norm_,
            max_norm=1.0)``, :func:`gradlens.training.agc.adaptive_clip_grad_`, or
            ``lambda _: adaptive_clip_grad_(model, exclude=("fc.weight",))``.
        skip_nonfinite: without a GradScaler, what a window whose gradient holds inf/nan does:
            ``False`` (default) updates with it and warns (``RuntimeWarning`` naming the
            window), ``True`` skips the update as a GradScaler would (``has_updated`` False,
            counted in ``skipped_windows``, with a warning). Either way the check is one
            ``torch.isfinite`` reduction over the window gradient and one host read, at the
            real update only (never on accumulating micro-steps). Windows through a GradScaler
            are always skipped (see AMP above).

    Attributes:
        optimizer: the inner optimizer.
        accum_steps: micro-steps per window.
        micro_step: micro-steps folded into the current window (0 right after an update).
        iterations: real updates done so far.
        has_updated: whether the last :meth:`step` (or :meth:`flush`) made a real update.
        skipped_windows: windows dropped because a GradScaler reported inf/nan.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: Optimizer,
        accum_steps: int = 1,
        reduction: str = "mean",
        accum_dtype: torch.dtype = torch.float32,
        clip: ClipFn | None = None,
        grad_scaler: Any = None,
        skip_nonfinite: bool = False,
    ) -> None:
        if isinstance(optimizer, GradientAccumulateOptimizer):
            raise TypeError(
                "optimizer is already a GradientAccumulateOptimizer; wrap the inner torch.optim "
                "optimizer once and set accum_steps to the total number of micro-steps."
            )
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                f"pass e.g. torch.optim.AdamW(model.parameters())."
            )
        if not isinstance(accum_dtype, torch.dtype) or not accum_dtype.is_floating_point:
            raise TypeError(
                f"accum_dtype must be a floating torch.dtype such as torch.float32, got {accum_dtype!r}."
            )
        if clip is not None and not callable(clip):
            raise TypeError(
                f"clip must be a callable clip(params) that modifies p.grad in place, or None, "
                f"got {type(clip).__name__}."
            )
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(
                f"grad_scaler must be a torch.amp.GradScaler, got {type(grad_scaler).__name__}"
            )
        if not isinstance(skip_nonfinite, bool):
            raise TypeError(
                f"skip_nonfinite must be True or False, got {skip_nonfinite!r}; e.g. "
                "GradientAccumulateOptimizer(opt, accum_steps=4, skip_nonfinite=True)"
            )
        self.skip_nonfinite = skip_nonfinite
        # Optimizer.__init__ is not called: param_groups and state are the inner optimizer's.
        # The hooks live in the wrapper's own registries (public RemovableHandle objects).
        self._hooks: dict[str, OrderedDict[int, Callable]] = {
            k: OrderedDict()
            for k in ("step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post", "window_end")
        }
        self.optimizer = optimizer
        self.accum_steps = check_accum_steps(accum_steps)
        self.reduction = _check_reduction(reduction)
        self.accum_dtype = accum_dtype
        self.clip = clip
        self.grad_scaler = grad_scaler
        self.accum_state = AccumulationState()

    # ----------------------------------------------------------------- the state, as attributes
    micro_step = property(lambda self: self.accum_state.micro_step)
    iterations = property(lambda self: self.accum_state.iterations)
    has_updated = property(lambda self: self.accum_state.has_updated)
    skipped_windows = property(lambda self: self.accum_state.skipped_windows)

    # ----------------------------------------------------------------- hooks (Optimizer's API)
    def _register(self, kind: str, hook: Callable, prepend: bool = False) -> RemovableHandle:
        table = self._hooks[kind]
        handle = RemovableHandle(table)
        table[handle.id] = hook
        if prepend:
            table.move_to_end(handle.id, last=False)
        return handle

    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:  # type: ignore[override]
        """``hook(optimizer, args, kwargs)`` right before each real update (see the class doc)."""
        return self._register("step_pre", hook)

    def register_step_post_hook(self, hook: Callable) -> RemovableHandle:  # type: ignore[override]
        """``hook(optimizer, args, kwargs)`` right after each real update."""
        return self._register("step_post", hook)

    def register_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:  # type: ignore[override]
        return self._register("sd_pre", hook, prepend)

    def register_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:  # type: ignore[override]
        return self._register("sd_post", hook, prepend)

    def register_load_state_dict_pre_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:  # type: ignore[override]
        return self._register("load_pre", hook, prepend)

    def register_load_state_dict_post_hook(self, hook: Callable, prepend: bool = False) -> RemovableHandle:  # type: ignore[override]
        return self._register("load_post", hook, prepend)

    def note_micro_batch(self, num_samples: int) -> None:
        """Told by a :class:`~gradlens.Lens` after it captured a micro-step of ``num_samples``
        samples: the next :meth:`step`'s ``num_samples`` (if given) must equal it."""
        self.accum_state.noted_samples = int(num_samples)

    # ----------------------------------------------------------------- delegation to the inner one
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The inner optimizer's ``param_groups`` (LR schedulers edit these)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner optimizer's ``state`` (it holds no accumulators)."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's ``defaults``."""
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the inner optimizer."""
        self.optimizer.add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` of every parameter; the window's accumulators are kept."""
        st = self.accum_state
        if not set_to_none:  # a p.grad kept as the accumulator is not zeroed: a fresh one is
            for p, acc in st.accumulators.items():
                if p.grad is acc:
                    p.grad = torch.zeros_like(acc)
        self.optimizer.zero_grad(set_to_none=set_to_none)
        st.folded = {}  # the next step sees fresh gradients

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(accum_steps={self.accum_steps}, reduction={self.reduction!r}, "
            f"micro_step={self.micro_step}, iterations={self.iterations},\n  {self.optimizer!r})"
        )

    # ------------------------------------------------------------------------------- the window
    def _params(self) -> list[Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def reset(self) -> None:
        """Drop the current window (accumulators and micro-step count) without updating."""
        st = self.accum_state
        had_window = st.counter.is_open
        st.reset_window()
        st.counter.reset()
        if had_window:
            self._fire_window_end(False)

    @property
    def gradients(self) -> list[Tensor | None]:
        """The window gradient accumulated so far, normalised as :meth:`flush` would.

        One entry per parameter, in ``param_groups`` order: a new tensor ``[*param]`` in the
        accumulator dtype (unscaled when a GradScaler is used), or None for a parameter that has
        received no gradient in this window. All None right after a real update.
        """
        st = self.accum_state
        out: list[Tensor | None] = []
        for p in self._params():
            acc = st.accumulators.get(p)
            if acc is None:
                out.append(None)
            elif self.reduction == "mean":
                out.append(acc * (st.last_weight[p] / st.weight))
            else:
                out.append(acc.clone())
        return out

    def _check_num_samples(self, num_samples: Any) -> float | None:
        if num_samples is None:
            return None
        if isinstance(num_samples, bool) or not isinstance(num_samples, numbers.Real):
            raise TypeError(
                f"num_samples must be a positive Python number (the micro-batch's sample or token "
                f"count, e.g. len(x)) or None, got {type(num_samples).__name__}; "
                f"pass int(...) for a tensor count."
            )
        value = float(num_samples)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(
                f"num_samples must be > 0 and finite (the micro-batch's sample count), got "
                f"{num_samples!r}; skip the step() call for an empty micro-batch."
            )
        return value

    def _check_fresh(self) -> None:
        """Raise if a ``p.grad`` was folded already (a second ``step()`` for one backward) or
        was added to after being folded (a backward without ``zero_grad()`` in between)."""
        folded = self.accum_state.folded
        for p in self._params():
            seen = folded.get(p)
            if seen is None or p.grad is None or seen[0]() is not p.grad:
                continue
            if compat.tensor_version(p.grad) == seen[1]:
                raise RuntimeError(
                    "step() was called twice for one backward pass: this micro-step's gradient "
                    "was folded into the window already; call step() once per loss.backward()"
                )
            dropped = any(acc is q.grad for q, acc in self.accum_state.accumulators.items())
            if dropped:  # that p.grad was kept as the window's accumulator: the window is lost
                self.reset()
            raise RuntimeError(
                "the gradient changed after it was folded into the window without zero_grad() "
                "in between (a second backward accumulated into p.grad, so a micro-step would "
                "count twice); call opt.zero_grad() after every opt.step() (clearing with "
                "model.zero_grad(set_to_none=False) hides that from the wrapper: use "
                "opt.zero_grad() or set_to_none=True)"
                + ("; this window is dropped (its first p.grad was kept as the accumulator)" if dropped else "")
            )

    def _fire_window_end(self, updated: bool) -> None:
        for hook in list(self._hooks["window_end"].values()):
            hook(self, updated)

    def _close_window(self) -> bool:
        """Write the window gradient into ``p.grad``, clip, and run the inner step once."""
        st = self.accum_state
        via_scaler = bool(st.via_scaler)
        if st.via_scaler and not st.finite():
            st.skip()
            self._fire_window_end(False)
            return False

        params = []
        mean = self.reduction == "mean"
        for p in self._params():
            if p in st.fused:  # the closing micro-step wrote it into p.grad already
                params.append(p)
                continue
            acc = st.accumulators.get(p)
            if acc is None:
                continue
            st.check_untouched(p, acc)
            c = st.last_weight[p] / st.weight if mean else 1.0  # the window gradient = c * acc
            if p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == p.dtype and not p.grad.is_sparse:
                # in place (keeps DDP bucket views valid), normalised on the way
                if p.grad is not acc or c != 1.0:
                    torch.mul(acc, c, out=p.grad)
            else:
                if c != 1.0:
                    acc.mul_(c)
                st.last_weight[p] = st.weight
                p.grad = acc.to(p.dtype)
                if p.grad is acc:  # p.grad is the buffer now: the next window takes a new one
                    st.pool.pop(p, None)
            params.append(p)
        if not via_scaler and not _grads_finite(params):
            window = st.iterations + st.skipped_windows
            fix = (
                "the update was skipped (skip_nonfinite=True)" if self.skip_nonfinite else
                "the update was applied with them; use a torch.amp.GradScaler "
                "(GradientAccumulateOptimizer(..., grad_scaler=scaler)) or "
                "GradientAccumulateOptimizer(..., skip_nonfinite=True) to skip such windows"
            )
            warnings.warn(
                f"GradientAccumulateOptimizer: window {window} (0-based; {st.iterations} real "
                f"updates so far) has an inf/nan gradient; {fix}",
                RuntimeWarning,
                stacklevel=4,  # the caller of step() / flush() (through torch.no_grad's wrapper)
            )
            if self.skip_nonfinite:
                st.skip()
                st.folded = {p: (weakref.ref(p.grad), compat.tensor_version(p.grad)) for p in params if p.grad is not None}
                self._fire_window_end(False)
                return False
        for hook in list(getattr(self, "_window_grad_hooks", {}).values()):
            hook(self)  # window_grad(p): the window gradient, before clipping and the update
        st.reset_window()

        if self.clip is not None:
            self.clip(params)
        for pre_hook in list(self._hooks["step_pre"].values()):
            pre_hook(self, (self,), {})
        self.optimizer.step()
        st.counter.close(updated=True)
        for post_hook in list(self._hooks["step_post"].values()):
            post_hook(self, (self,), {})
        self._fire_window_end(True)
        # p.grad now holds the window gradient the wrapper wrote: not a micro-step's gradient
        st.folded = {p: (weakref.ref(p.grad), compat.tensor_version(p.grad)) for p in params if p.grad is not None}
        return True

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], Any] | None = None, *, num_samples: float | None = None
    ) -> Any:
        """Fold one micro-step's gradient into the window; update on every ``accum_steps``-th call.

        Args:
            closure: optional, evaluated once (with grad enabled) before folding, like
                ``loss.backward()`` in the loop; the inner optimizer never receives it (closures
                that re-evaluate the loss, e.g. for LBFGS, are not supported).
            num_samples: B_k, the micro-batch's sample (or token) count, > 0. With
                ``reduction="mean"`` the window gradient weights micro-step k by B_k / sum B;
                give it on every micro-step of a window or on none (equal weights).

        Returns:
            The closure's return value, or None. ``has_updated`` says whether this call updated.
        """
        st = self.accum_state
        weight = self._check_num_samples(num_samples)
        noted, st.noted_samples = st.noted_samples, None
        if weight is not None and noted is not None and weight != noted:
            raise ValueError(
                f"step(num_samples={num_samples!r}) but the Lens captured a micro-batch of "
                f"{noted} samples for this micro-step; pass num_samples=len(x) of the micro-batch "
                "that was backpropagated (the window is weighted by it)"
            )
        weighted = weight is not None
        if st.weighted is not None and st.weighted != weighted:
            raise ValueError(
                f"num_samples={num_samples!r} but the earlier micro-steps of this window "
                f"{'gave' if st.weighted else 'did not give'} num_samples; give it on every "
                f"micro-step of a window or on none."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        grad_scale = self._current_scale()
        via_scaler = grad_scale is not None
        if st.via_scaler is not None and st.via_scaler != via_scaler:
            raise RuntimeError(
                "this micro-step came "
                + ("through scaler.step(opt)" if via_scaler else "through opt.step()")
                + " but the earlier micro-steps of the window did not; with a GradScaler call "
                "scaler.step(opt) and scaler.update() on every micro-step (the scaled gradients "
                "of every micro-step must be unscaled before they are summed)."
            )
        self._check_fresh()
        check_fsdp_fold(self._params())
        st.weighted = weighted
        st.via_scaler = via_scaler
        w = weight if weighted else 1.0
        for hook in list(getattr(self, "_micro_step_hooks", {}).values()):
            hook(self, num_samples)  # p.grad: this micro-step's gradient, not yet folded
        self.accum_state.fold(self._params(), w, grad_scale, mean=self.reduction == "mean",
                              accum_steps=self.accum_steps, accum_dtype=self.accum_dtype)
        st.counter.note_micro(w)
        if st.micro_step >= self.accum_steps:
            self._close_window()
        else:
            st.has_updated = False
        return loss

    def _current_scale(self) -> Tensor | float | None:
        """The GradScaler scale of this micro-step's gradients, or None outside a scaler.

        ``scaler.step(opt)`` calls this wrapper's ``step`` (``_step_supports_amp_scaling``)
        with ``p.grad`` still scaled. With ``grad_scaler=`` the scale comes from
        :func:`gradlens.compat.grad_scaler_scale` (one host read, as ``get_scale()``); otherwise
        from the ``grad_scale`` tensor GradScaler attaches to such optimizers during the call
        (its protocol for them; read here only). Inf/nan are detected by the wrapper itself
        (:meth:`AccumulationState.finite`), never read from the scaler."""
        if self.grad_scaler is not None:  # every micro-step goes through scaler.step(opt)
            scale = compat.grad_scaler_scale(self.grad_scaler)  # float(): get_scale(); None: unscaled
            return None if scale is None else float(scale)
        return compat.optimizer_grad_scale(self)

    @torch.no_grad()
    def flush(self) -> bool:
        """Apply a partial window now (e.g. at the end of an epoch).

        The window gradient is normalised by what the window holds (its own sum of
        ``num_samples``, or its own number of micro-steps). Does nothing on an empty window.

        Returns:
            Whether a real update happened (also in ``has_updated``).
        """
        if self.micro_step == 0:
            self.accum_state.has_updated = False
            return False
        return self._close_window()

    def register_window_end_hook(self, hook: WindowEndHook) -> RemovableHandle:
        """Register ``hook(optimizer, updated: bool)``, called at the end of every window.

        ``updated`` is True after a real update (after the step post-hooks), False when the
        window was skipped (GradScaler inf/nan) or dropped by :meth:`reset`.
        """
        return self._register("window_end", hook)

    def register_micro_step_hook(self, hook: MicroStepHook) -> RemovableHandle:
        """Register ``hook(optimizer, num_samples)``, called by every :meth:`step` right before
        the micro-step's ``p.grad`` is folded into the window (``p.grad`` is that micro-step's
        gradient, still scaled by a GradScaler's ``optimizer.grad_scale`` if one is used;
        :meth:`window_sum` is the window before it). Used by
        :class:`gradlens.instruments.noise.NoiseScaleMonitor`."""
        if not hasattr(self, "_micro_step_hooks"):
            self._micro_step_hooks: OrderedDict[int, MicroStepHook] = OrderedDict()
        handle = RemovableHandle(self._micro_step_hooks)
        self._micro_step_hooks[handle.id] = hook
        return handle

    def register_window_grad_hook(self, hook: WindowGradHook) -> RemovableHandle:
        """Register ``hook(optimizer)``, called once per real update as soon as the window
        gradient is written into ``p.grad``, before clipping, the step pre-hooks and the update;
        :meth:`window_grad` gives it in the accumulation dtype. Not called for windows a
        GradScaler skips. Used by :class:`gradlens.instruments.noise.NoiseScaleMonitor`."""
        if not hasattr(self, "_window_grad_hooks"):
            self._window_grad_hooks: OrderedDict[int, WindowGradHook] = OrderedDict()
        handle = RemovableHandle(self._window_grad_hooks)
        self._window_grad_hooks[handle.id] = hook
        return handle

    def window_grad(self, p: Tensor) -> Tensor | None:
        """Inside a window-grad hook: the window gradient of ``p`` (normalised as ``p.grad``,
        unscaled, before clipping) in the accumulation dtype (``p.grad`` itself, or the
        accumulator, or a new tensor), or None if ``p`` received no gradient in the window."""
        st = self.accum_state
        if p in st.fused:
            return p.grad
        acc = st.accumulators.get(p)
        if acc is None:
            return None
        c = st.last_weight[p] / st.weight if self.reduction == "mean" else 1.0
        return acc if c == 1.0 else acc * c

    def window_sum(self, p: Tensor) -> Tensor | None:
        """The window's running, unnormalised sum for parameter ``p`` (``sum_k w_k grad_k /
        scale_k``, w_k = num_samples under "mean", 1 under "sum"; read-only: under "mean" a new
        tensor, under "sum" the accumulator itself), or None before ``p`` received a gradient."""
        st = self.accum_state
        acc = st.accumulators.get(p)
        if acc is None or self.reduction != "mean":
            return acc
        return acc * st.last_weight[p]

    # ---------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus a versioned ``"gradlens_accumulate"`` section.

        The section holds the counters, the window's weight and its accumulators keyed by the
        parameter's flat index in ``param_groups`` order (copies: the wrapper writes later
        windows into the same buffers).
        """
        for pre_hook in list(self._hooks["sd_pre"].values()):
            pre_hook(self)
        out = dict(self.optimizer.state_dict())
        out[_STATE_KEY] = self.accum_state.section(self._params(), self.accum_steps, self.reduction)
        for post_hook in list(self._hooks["sd_post"].values()):
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict from :meth:`state_dict`, resuming mid-window if it was saved there.

        A plain ``torch.optim`` state dict (no ``"gradlens_accumulate"`` section) loads the inner
        optimizer and starts an empty window with the counters at 0.

        Raises:
            ValueError: wrong section version, another ``reduction``, a saved mid-window micro-step
                count not below this wrapper's ``accum_steps``, or accumulators whose index or
                shape does not match the parameters.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(
                f"state_dict must be a dict from GradientAccumulateOptimizer.state_dict(), got "
                f"{type(state_dict).__name__}."
            )
        for pre_hook in list(self._hooks["load_pre"].values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        inner = {k: v for k, v in state_dict.items() if k != _STATE_KEY}
        section = state_dict.get(_STATE_KEY)
        st = AccumulationState()
        if section is not None:  # checked before anything changes
            st = AccumulationState.from_section(section, self._params(), self.accum_steps, self.reduction,
                                                self.accum_dtype)
        self.optimizer.load_state_dict(inner)
        self.accum_state = st
        for post_hook in list(self._hooks["load_post"].values()):
            post_hook(self)


def _split_batch(batch: Any, accum_steps: int) -> tuple[list[tuple[Tensor, ...]], list[int]]:
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise TypeError(
            f"batch must be a tuple (inputs..., target) of tensors, e.g. (x, y), got "
            f"{type(batch).__name__}{'' if not isinstance(batch, (tuple, list)) else f' of length {len(batch)}'}."
        )
    for i, t in enumerate(batch):
        if not isinstance(t, Tensor) or t.dim() == 0:
            raise TypeError(
                f"batch[{i}] must be a tensor with a leading batch dimension, got "
                f"{type(t).__name__}{'' if not isinstance(t, Tensor) else ' with 0 dims'}."
            )
    n = batch[0].shape[0]
    sizes = [t.shape[0] for t in batch]
    if any(s != n for s in sizes):
        raise ValueError(
            f"every tensor of batch must have the same leading (batch) size, got {sizes}."
        )
    if n == 0:
        raise ValueError("batch is empty (leading size 0); skip the train_step call.")
    pieces = [torch.tensor_split(t, accum_steps) for t in batch]
    micro = [tuple(p[k] for p in pieces) for k in range(accum_steps) if pieces[0][k].shape[0] > 0]
    return micro, [m[0].shape[0] for m in micro]


class GradientAccumulateModel:
    """Trains on a large batch in ``accum_steps`` micro-batches with one optimizer update.

    :meth:`train_step` splits ``batch = (inputs..., target)`` along dim 0 into ``accum_steps``
    near-equal micro-batches (``torch.tensor_split``; sizes differ by at most one, and fewer
    micro-batches are used when the batch is smaller than ``accum_steps``), runs forward and
    backward on each in turn (peak activation memory is that of one micro-batch), and calls the
    optimizer once. Micro-step k computes ``loss_fn(model(*inputs_k), target_k)`` exactly as the
    user defines it (a mean over its B_k samples for ``reduction="mean"``, a sum for ``"sum"``);
    between backwards the accumulated ``p.grad`` is rescaled in place so that after the last one
    ``p.grad = sum_k B_k grad_k / N`` (mean) or ``sum_k grad_k`` (sum): exact for unequal splits.

    With a ``DistributedDataParallel`` model every micro-step but the last runs under
    ``model.no_sync()``, so gradients are all-reduced once per window. Every rank must pass
    batches of the same size (as DDP's gradient averaging itself assumes).

    Args:
        model: the module (or a ``DistributedDataParallel``) to train.
        optimizer: a ``torch.optim.Optimizer``; a :class:`GradientAccumulateOptimizer` with the
            same ``reduction`` is allowed (each ``train_step`` is then one of its micro-steps,
            reported with ``num_samples=N``).
        loss_fn: ``loss_fn(output, target) -> Tensor`` (a scalar).
        accum_steps: number of micro-batches per batch, >= 1.
        reduction: ``"mean"`` or ``"sum"``, how ``loss_fn`` reduces over a micro-batch.
        lens: optional gradlens ``Lens`` (anything with a ``capture()`` context manager); each
            micro-step's backward runs inside ``with lens.capture():``. During the capture the
            loss is the user's own micro-batch loss (never rescaled), but ``p.grad`` holds the
            running accumulation, not the micro-step's own gradient.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optimizer,
        loss_fn: Callable[..., Tensor],
        accum_steps: int,
        *,
        reduction: str = "mean",
        lens: Any | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                f"pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)."
            )
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable(output, target), got {type(loss_fn).__name__}.")
        self.accum_steps = check_accum_steps(accum_steps)
        self.reduction = _check_reduction(reduction)
        if isinstance(optimizer, GradientAccumulateOptimizer) and optimizer.reduction != reduction:
            raise ValueError(
                f"optimizer has reduction={optimizer.reduction!r} but reduction={reduction!r} was "
                f"given; use the same reduction for both."
            )
        if lens is not None and not callable(getattr(lens, "capture", None)):
            raise TypeError(
                f"lens must be a gradlens Lens (an object with a capture() context manager) or "
                f"None, got {type(lens).__name__}."
            )
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.lens = lens

    def _is_ddp(self) -> bool:
        return isinstance(self.model, nn.parallel.DistributedDataParallel)

    def train_step(self, batch: Sequence[Tensor]) -> Tensor:
        """One window: forward/backward on every micro-batch of ``batch``, then one update.

        Args:
            batch: ``(inputs..., target)``, tensors with the same leading size N; the model is
                called as ``model(*inputs)`` and the loss as ``loss_fn(output, target)``.

        Returns:
            The window's loss, detached (no device sync): ``sum_k B_k loss_k / N`` for
            ``reduction="mean"`` (the mean loss over the N samples), ``sum_k loss_k`` for "sum".
        """
        micro, sizes = _split_batch(batch, self.accum_steps)
        n_total = sum(sizes)
        mean = self.reduction == "mean"
        params = [p for p in self.model.parameters() if p.requires_grad]
        ddp = self._is_ddp()
        self.optimizer.zero_grad(set_to_none=True)
        window_loss: Tensor | None = None
        last = len(micro) - 1
        for k, (*inputs, target) in enumerate(micro):
            sync = contextlib.nullcontext() if (not ddp or k == last) else self.model.no_sync()
            with sync:
                loss = self.loss_fn(self.model(*inputs), target)
                if not isinstance(loss, Tensor) or loss.dim() != 0:
                    raise ValueError(
                        f"loss_fn must return a scalar tensor, got "
                        f"{'shape ' + str(tuple(loss.shape)) if isinstance(loss, Tensor) else type(loss).__name__}; "
                        f"reduce it with reduction={self.reduction!r}."
                    )
                capture = self.lens.capture() if self.lens is not None else contextlib.nullcontext()
                with capture:
                    loss.backward()
            contribution = loss.detach() * sizes[k] if mean else loss.detach()
            window_loss = contribution if window_loss is None else window_loss + contribution
            if mean:
                # Invariant: after backward k, p.grad = sum_{j<=k} (B_j / B_k) grad_j.
                factor = sizes[k] / (sizes[k + 1] if k < last else n_total)
                if factor != 1.0:
                    grads = [p.grad for p in params if p.grad is not None]
                    if grads:
                        compat.foreach_mul_(grads, factor)
        if isinstance(self.optimizer, GradientAccumulateOptimizer):
            self.optimizer.step(num_samples=n_total)
        else:
            self.optimizer.step()
        window_loss = cast(Tensor, window_loss)  # _split_batch yields at least one micro-batch
        return window_loss / n_total if mean else window_loss
