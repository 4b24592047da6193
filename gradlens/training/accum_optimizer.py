"""The accumulating optimizer wrapper: :class:`GradientAccumulateOptimizer`.

The wrapper drives the window; the parts it is made of are their own modules:

- its window (counters, accumulators, the fold of a micro-step) is one
  :class:`~gradlens.training.accum_state.AccumulationState`;
- its ``state_dict`` section and the versions read: :mod:`gradlens.training.accum_section`;
- GradScaler scales and windows with inf/nan: :mod:`gradlens.training.accum_scaling`;
- the ``torch.optim.Optimizer`` interface over the inner optimizer (delegation, hook registries):
  :class:`~gradlens.training.wrapped_optimizer.WrappedOptimizer`.

The exact normalisation of the window gradient is stated in :mod:`gradlens.training.accumulate`
(where the class is imported from).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from gradlens import compat
from gradlens.distributed.fsdp import check_fold as check_fsdp_fold
from gradlens.training.accum_checks import check_accum_steps, check_num_samples, check_reduction
from gradlens.training.accum_scaling import check_route, grad_scale, grads_finite, warn_nonfinite
from gradlens.training.accum_section import STATE_KEY
from gradlens.training.accum_state import AccumulationState
from gradlens.training.wrapped_optimizer import WrappedOptimizer

__all__ = ["ClipFn", "GradientAccumulateOptimizer", "MicroStepHook", "WindowEndHook", "WindowGradHook"]

ClipFn = Callable[[list[Tensor]], Any]
"""``clip(params)``: called once per window with the parameters whose ``.grad`` holds the
unscaled window gradient; it modifies those ``.grad`` in place (its return value is ignored)."""

WindowEndHook = Callable[["GradientAccumulateOptimizer", bool], None]
MicroStepHook = Callable[["GradientAccumulateOptimizer", "float | None"], None]
WindowGradHook = Callable[["GradientAccumulateOptimizer"], None]


class GradientAccumulateOptimizer(WrappedOptimizer):
    """Wraps a ``torch.optim`` optimizer so that it updates once every ``accum_steps`` micro-steps.

    Each :meth:`step` folds the current ``p.grad`` (the gradient of one micro-batch's loss, as
    the user computed it) into the wrapper's own accumulators; the ``accum_steps``-th call writes
    the window gradient (its exact normalisation: :mod:`gradlens.training.accumulate`) into
    ``p.grad``, applies ``clip`` once, and calls the inner optimizer **once**, so momentum / Adam moments,
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

    The window lives in one state object, :class:`~gradlens.training.accum_state.AccumulationState`
    (``opt.accum_state``), as optax's ``MultiSteps`` keeps ``MultiStepsState``; the wrapper
    implements the ``torch.optim.Optimizer`` interface (``param_groups``, ``state``,
    ``state_dict``, step and state-dict hooks) itself instead of re-creating ``Optimizer``'s
    private internals (:class:`~gradlens.training.wrapped_optimizer.WrappedOptimizer`).

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
        skipped_windows: windows skipped because their gradient held inf/nan (under a GradScaler,
            or with ``skip_nonfinite=True``).
    """

    _step_supports_amp_scaling = True
    _HOOK_KINDS = (*WrappedOptimizer._HOOK_KINDS, "window_end")

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
        super().__init__(optimizer)  # the inner optimizer and the hook registries
        self._micro_step_hooks: OrderedDict[int, MicroStepHook] = OrderedDict()
        self._window_grad_hooks: OrderedDict[int, WindowGradHook] = OrderedDict()
        self.accum_steps = check_accum_steps(accum_steps)
        self.reduction = check_reduction(reduction)
        self.accum_dtype = accum_dtype
        self.clip = clip
        self.grad_scaler = grad_scaler
        self.accum_state = AccumulationState()

    # ----------------------------------------------------------------- the state, as attributes
    micro_step = property(lambda self: self.accum_state.micro_step)
    iterations = property(lambda self: self.accum_state.iterations)
    has_updated = property(lambda self: self.accum_state.has_updated)
    skipped_windows = property(lambda self: self.accum_state.skipped_windows)

    def note_micro_batch(self, num_samples: int) -> None:
        """Told by a :class:`~gradlens.Lens` after it captured a micro-step of ``num_samples``
        samples: the next :meth:`step`'s ``num_samples`` (if given) must equal it."""
        self.accum_state.noted_samples = int(num_samples)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``p.grad`` of every parameter; the window's accumulators are kept."""
        st = self.accum_state
        if not set_to_none:  # a p.grad kept as the accumulator is not zeroed: a fresh one is
            for p, acc in st.accumulators.items():
                if p.grad is acc:
                    p.grad = torch.zeros_like(acc)
        self.optimizer.zero_grad(set_to_none=set_to_none)
        st.folded = {}  # the next step sees fresh gradients

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(accum_steps={self.accum_steps}, reduction={self.reduction!r}, "
            f"micro_step={self.micro_step}, iterations={self.iterations},\n  {self.optimizer!r})"
        )

    # ------------------------------------------------------------------------------- the window
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
        if not via_scaler and not grads_finite(params):
            # stacklevel 4: the caller of step() / flush() (through torch.no_grad's wrapper)
            warn_nonfinite(st.iterations, st.skipped_windows, self.skip_nonfinite, stacklevel=4)
            if self.skip_nonfinite:
                st.skip()
                self._note_folded(params)
                self._fire_window_end(False)
                return False
        for hook in list(self._window_grad_hooks.values()):
            hook(self)  # window_grad(p): the window gradient, before clipping and the update
        st.reset_window()

        if self.clip is not None:
            self.clip(params)
        self._run_step_pre_hooks()
        self.optimizer.step()
        st.counter.close(updated=True)
        self._run_step_post_hooks()
        self._fire_window_end(True)
        # p.grad now holds the window gradient the wrapper wrote: not a micro-step's gradient
        self._note_folded(params)
        return True

    def _note_folded(self, params: list[Tensor]) -> None:
        """Mark the ``p.grad`` of ``params`` as folded (a second ``step()`` on them is an error)."""
        self.accum_state.folded = {
            p: (weakref.ref(p.grad), compat.tensor_version(p.grad)) for p in params if p.grad is not None
        }

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
        weight = check_num_samples(num_samples)
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

        scale = grad_scale(self, self.grad_scaler)  # None: not through a GradScaler
        via_scaler = scale is not None
        check_route(st.via_scaler, via_scaler)
        self._check_fresh()
        check_fsdp_fold(self._params())
        st.weighted = weighted
        st.via_scaler = via_scaler
        w = weight if weighted else 1.0
        for hook in list(self._micro_step_hooks.values()):
            hook(self, num_samples)  # p.grad: this micro-step's gradient, not yet folded
        self.accum_state.fold(self._params(), w, scale, mean=self.reduction == "mean",
                              accum_steps=self.accum_steps, accum_dtype=self.accum_dtype)
        st.counter.note_micro(w)
        if st.micro_step >= self.accum_steps:
            self._close_window()
        else:
            st.has_updated = False
        return loss

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

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # a wrapper pickled by gradlens 0.1 made these registries on its first registration
        self.__dict__.setdefault("_micro_step_hooks", OrderedDict())
        self.__dict__.setdefault("_window_grad_hooks", OrderedDict())

    def register_micro_step_hook(self, hook: MicroStepHook) -> RemovableHandle:
        """Register ``hook(optimizer, num_samples)``, called by every :meth:`step` right before
        the micro-step's ``p.grad`` is folded into the window (``p.grad`` is that micro-step's
        gradient, still scaled by a GradScaler's ``optimizer.grad_scale`` if one is used;
        :meth:`window_sum` is the window before it). Used by
        :class:`gradlens.instruments.noise.NoiseScaleMonitor`."""
        handle = RemovableHandle(self._micro_step_hooks)
        self._micro_step_hooks[handle.id] = hook
        return handle

    def register_window_grad_hook(self, hook: WindowGradHook) -> RemovableHandle:
        """Register ``hook(optimizer)``, called once per real update as soon as the window
        gradient is written into ``p.grad``, before clipping, the step pre-hooks and the update;
        :meth:`window_grad` gives it in the accumulation dtype. Not called for windows a
        GradScaler skips. Used by :class:`gradlens.instruments.noise.NoiseScaleMonitor`."""
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
    # ---------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The inner optimizer's state dict plus a versioned ``"gradlens_accumulate"`` section
        (:mod:`gradlens.training.accum_section`).

        The section holds the counters, the window's weight and its accumulators keyed by the
        parameter's flat index in ``param_groups`` order (copies: the wrapper writes later
        windows into the same buffers).
        """
        def build() -> dict[str, Any]:
            out = dict(self.optimizer.state_dict())
            out[STATE_KEY] = self.accum_state.section(self._params(), self.accum_steps, self.reduction)
            return out

        return self._state_dict_with_hooks(build)

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

        def load(state_dict: dict[str, Any]) -> None:
            inner = {k: v for k, v in state_dict.items() if k != STATE_KEY}
            section = state_dict.get(STATE_KEY)
            st = AccumulationState()
            if section is not None:  # checked before anything changes
                st = AccumulationState.from_section(section, self._params(), self.accum_steps, self.reduction,
                                                    self.accum_dtype)
            self.optimizer.load_state_dict(inner)
            self.accum_state = st

        self._load_state_dict_with_hooks(state_dict, load)
