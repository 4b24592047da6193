"""The Meter: everything between "a watched use's output received its gradient" and "the
window's statistics and instrument states are updated".

Calls go down: the Tap (or the ParamTap of light capture, :mod:`gradlens.capture`) reports
plain events to the Meter: a use with its input and output gradient (:meth:`Meter.on_use`), an
operation use (:meth:`Meter.on_op_use`), autograd's own dL/dW of a Linear call
(:meth:`Meter.on_weight_grad`), a parameter's dL/dp (:meth:`Meter.on_param_grad`). The Meter
rescales each output gradient to per-sample units (:class:`gradlens.capture.units.MicroStep`) and
computes, once per use, what the :class:`Plan` asks for (the kernel's reductions, factor
products, materialised slices, sums), handing the same pieces to every instrument that needs
them. The Lens starts and ends micro-steps (:meth:`Meter.begin`, :meth:`Meter.finish`,
:meth:`Meter.end`, :meth:`Meter.fold`) and owns the window's state, one
:class:`~gradlens.core.window.Window`: the Meter takes it at :meth:`Meter.begin`, holds it for
that micro-step only, and gives it back folded (:meth:`Meter.fold`, :meth:`Meter.settle`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from gradlens import compat

from gradlens.measure import deferred, routed, slices
from gradlens.measure.undefined import UndefinedParams

from gradlens.capture import ops
from gradlens.capture import CONV1D, LINEAR, LossCall, OpUse, ParamTap, Site, Tap, WeightGrad
from gradlens.instruments.base import Instrument
from gradlens.core.stats import LIGHT_QUANTITIES, WindowStats
from gradlens.core.window import Window
from gradlens.core.param_shapes import full_shape
from gradlens.compat import queue_backward_callback
from gradlens.core.groups import group_params
from gradlens.measure.window_grad import WindowGradient
from gradlens.kernels import CHUNK_ELEMENTS, Materialised, MaterialisedKernel, SummedUsesKernel, add_into
from gradlens.capture.units import MicroStep, check_reduction, loss_calls_for, settle_flattened

__all__ = ["Plan", "Meter"]


@dataclass(frozen=True)
class Plan:
    """What the instruments declare, compiled once per Lens: which instruments receive which
    pieces of a use, and how capture runs. It depends on the instruments only (not on the
    tracked parameters), so a window whose parameters changed keeps the same plan.

    Attributes:
        needs: the union of the instruments' ``needs`` (quantities of gradlens.instruments.base).
        per_sample: instruments that see per-sample gradients g_n ([b, *param] slices, or
            their factors); ``sampled``: those of them that draw entries from the factors
            (``sample`` set); ``exact``: the others (offered the rank-one factor fast path).
        layer: instruments that read a use's factors (input a, output gradient delta) directly.
        micro: instruments with a micro-step state (per_sample, then the other layer ones).
        carry_scale: every use goes to instruments that keep delta unscaled with its scale
            (BatchDot): no per-use ``delta * scale`` copy.
        light: instruments of the window gradient only (GradNorm, NoiseScaleTwoBatch):
            parameter hooks (ParamTap), no per-sample capture.
        fuse_weight_grad: the layer classes (qualified names) whose sequence calls take dL/dW
            from the measurement instead of a second matmul (:func:`_fused_classes`).
        groups: the checked ``Lens(groups=...)`` spec (:mod:`gradlens.core.groups`), or None: each
            use's ``batch_l2`` contributions also go to its parameters' groups
            (:attr:`WindowStats.group_l2`); instruments with ``per_group`` finalize per group.
    """

    needs: frozenset
    per_sample: tuple
    sampled: tuple
    exact: tuple
    layer: tuple
    micro: tuple
    carry_scale: bool
    light: bool
    fuse_weight_grad: frozenset
    groups: Any = None

    @classmethod
    def compile(cls, instruments: list[Instrument], groups: Any = None) -> "Plan":
        """The plan of ``instruments`` (already checked by the Lens) and the checked ``groups``."""
        needs = frozenset().union(*(i.needs for i in instruments)) if instruments else frozenset()
        per_sample = tuple(i for i in instruments if "per_sample" in i.needs)
        layer = tuple(i for i in instruments if "layer" in i.needs)
        exact = tuple(i for i in per_sample if i.sample is None)
        return cls(
            needs=needs,
            per_sample=per_sample,
            sampled=tuple(i for i in per_sample if i.sample is not None),
            exact=exact,
            layer=layer,
            micro=per_sample + tuple(i for i in layer if i not in per_sample),
            carry_scale=bool(layer) and not (needs - {"layer"})
            and all(getattr(i, "carries_scale", False) for i in layer),
            light=not (needs - LIGHT_QUANTITIES),
            fuse_weight_grad=_fused_classes(needs, exact, layer),
            groups=groups,
        )


def _fused_classes(needs: frozenset, exact: tuple, layer: tuple) -> frozenset:
    """:attr:`Plan.fuse_weight_grad`: nn.Linear where the sum of squares, exact per-sample
    instruments or a layer instrument (BatchDot's backward Gram) form dL/dW; transformers'
    Conv1D where the first two do and no layer instrument would (BatchDot measures a use
    before its slices are formed: its backward Gram would fill the call, which costs a window
    of several micro-steps more than the product it saves, measured on GPT-2)."""
    slices = "sum_grad_squared" in needs or bool(exact)
    by_layer = any(getattr(i, "fills_weight_grad", False) for i in layer)
    return frozenset(([LINEAR] if slices or by_layer else []) + ([CONV1D] if slices and not by_layer else []))


class Meter(WindowGradient):
    """Measures each captured micro-step's uses for the instruments of a :class:`Plan`.

    Args:
        model: the extended model.
        params: qualified name -> tracked parameter.
        plan: the compiled :class:`Plan`.
        chunk_elements: upper bound on the elements of one materialised ``[b, *param]`` slice.
        undefined: ``"error"``, ``"exclude"`` or ``"contribution"`` (see :class:`gradlens.Lens`).
        partitioned: the parameters' data is an empty partition outside their module's forward
            (DeepSpeed ZeRO-3, :mod:`gradlens.distributed.deepspeed`): each use is measured in
            backward (small uses are not stacked to the window's end); sizes are read from the
            model's shapes (:mod:`gradlens.core.param_shapes`).

    Attributes:
        tap: the :class:`~gradlens.capture.tap.Tap` (or ``ParamTap``) whose events come here,
            installed (:meth:`install`) while the Lens' window is tracked.
        grad_sq_hooks: parameter hooks giving ||dL/dp||^2 ("micro_grad_sq"), or None.
        undefined_params: parameters left out as undefined: name -> the mixing layer.
        micro, window: the micro-step being captured and the Lens' :class:`~gradlens.core.window.Window`
            it folds into; set by :meth:`begin`, cleared by :meth:`end`.
    """

    def __init__(self, model: nn.Module, params: dict[str, nn.Parameter], plan: Plan, *,
                 chunk_elements: int = CHUNK_ELEMENTS, undefined: str = "error", partitioned: bool = False,
                 silent: frozenset = frozenset()):
        self.model = model
        #: tracked parameters this rank leaves out of every sum (tensor parallelism: the
        #: replicated ones on TP ranks other than 0, counted once by rank 0)
        self.silent = silent
        self.plan = plan
        self.chunk_elements = chunk_elements
        self.undefined = UndefinedParams(undefined)  # Lens(undefined=...) and what it left out
        self.undefined_params = self.undefined.params
        #: the window's curvature graph (:class:`gradlens.instruments.curvature.WindowGraph`), set
        #: by the Lens on tracked windows of a Lens with a curvature instrument, else None
        self.graph = None
        self.consumed: set[int] = set()  # forward passes measured by earlier captures
        self.micro: MicroStep | None = None
        self.window: Window | None = None
        #: the Lens' :class:`~gradlens.measure.compiled_route.CompiledRoute` (torch.compile), or None
        self.route = None
        if plan.light:
            self.tap = ParamTap(model, params, self.on_param_grad)
        else:
            self.tap = Tap(
                model,
                params,
                self.on_use,
                self.on_op_use,
                on_weight_grad=self.on_weight_grad if "grad_sum" in plan.needs else None,
            )
            self.tap.fuse_weight_grad = plan.fuse_weight_grad
        self.group_of: dict[str, str] = {}  # tracked parameter -> its group (Lens(groups=...))
        self.groups: dict[str, tuple[str, ...]] = {}  # group -> its parameters
        self._set_groups(self.tap.params)
        self.grad_sq_hooks = None
        if "micro_grad_sq" in plan.needs and not plan.light:
            from gradlens.instruments.noise import ParamGradSquares

            self.grad_sq_hooks = ParamGradSquares(
                [p for q, p in self.tap.params.items() if q not in silent], self.on_grad_sq)
        #: the sums the uses' measurement computes (decided once, not per use)
        self.use_sums = plan.needs & {"batch_l2", "sum_grad_squared", "grad_sum"}
        #: small uses may be stacked (gradlens.measure.deferred): the plan wants only their norms and
        #: sums (window gradient, sum of squares), nothing per sample or per layer; and the
        #: parameters stay whole to the window's end (not under DeepSpeed ZeRO-3)
        self._stacks = (not partitioned and not plan.per_sample and not plan.layer
                        and "batch_l2" in self.use_sums)
        if self._stacks:  # small uses' window gradients come with their stacked norms
            self.tap.sums_here = deferred.sums_here
            self.tap.stacks_if = deferred.fits

    # ------------------------------------------------------------------ hooks and parameters
    def install(self) -> None:
        """Install the Tap and the parameter hooks (a tracked window opens; idempotent)."""
        self.tap.install()
        if self.grad_sq_hooks is not None:
            self.grad_sq_hooks.install()

    def remove(self) -> None:
        """Remove every hook the Meter's capture added (idempotent)."""
        self.tap.remove()
        if self.grad_sq_hooks is not None:
            self.grad_sq_hooks.remove()

    def follow(self, params: dict[str, nn.Parameter]) -> None:
        """Track ``params`` (the model's trainable parameters after exclusions, at a window's
        opening) less those left out as undefined; the Tap's sites are rebuilt only if they
        changed (frozen, unfrozen or added parameters)."""
        for q in self.undefined_params:
            params.pop(q, None)
        if params.keys() != self.tap.params.keys() or any(
            p is not self.tap.params[q] for q, p in params.items()
        ):
            if not params:
                raise ValueError("the model has no trainable parameters left to track")
            self.tap.set_params(params)
            self._set_groups(params)
            if self.grad_sq_hooks is not None:
                self.grad_sq_hooks.remove()
                self.grad_sq_hooks.params = list(params.values())
                if self.tap.installed:  # refreshed inside a tracked window's first forward
                    self.grad_sq_hooks.install()

    def _set_groups(self, params: dict[str, nn.Parameter]) -> None:
        """The groups of the tracked ``params`` under the plan's spec (:func:`group_params`);
        the sites' stacking is worked out anew."""
        self._stacking: dict[int, tuple] = {}
        self.groups = group_params(self.plan.groups, list(params))
        self.group_of = {q: g for g, qs in self.groups.items() for q in qs}

    # ------------------------------------------------------------------ micro-step lifecycle
    def begin(self, reduction: str | None, loss: Tensor | None, multiplier: Any, losses: Tensor | None,
              calls: list[LossCall], window: Window) -> MicroStep:
        """A capture starts (arguments of :meth:`gradlens.Lens.capture`, checked; ``calls``: the
        extended losses computed since the last capture): the new micro-step, to which
        backward's events now go. ``window`` is the Lens' (its sums are accumulated in place,
        its measured uses noted in ``window.sites``; each instrument's micro-step state starts
        from its window state in ``window.states``), held until :meth:`end`."""
        calls, reduction, expected = loss_calls_for(reduction, loss, multiplier, calls)
        route = self.route  # the compiled route: the batch of its last forward
        batch = route.batch if route is not None and route.on else self.tap.batch
        settle_flattened(calls, batch, getattr(self.tap, "output_nodes", {}))
        states = window.states
        if expected is not None:
            check_reduction(window.stats, expected)
        micro = MicroStep(
            reduction=reduction,
            batch_size=calls[0].batch_size if len(calls) == 1 else None,
            stats=WindowStats(reduction=expected or "mean"),
            states={id(i): i.start_micro(states[id(i)]) for i in self.plan.micro},
            loss_calls=calls,
            explicit=reduction is not None,
            losses=losses,
        )
        for call in calls:
            call.watch_multiplier()
        micro.factor = multiplier
        if not window.micro_steps:  # a new window: what its micro-steps counted per parameter
            self.undefined.new_window()
        # undefined="contribution" measures the parameters before a mix: their uses' axes count
        self.tap.measures_tainted = self.undefined.mode == "contribution"
        if self.tap.tainted:
            self.check_undefined(window)
        self.micro, self.window = micro, window
        return micro

    def end(self, micro: MicroStep) -> None:
        """A capture ends (normally or not): forget it, reset the Tap's per-micro-step state and
        remember the forward passes it measured (bounded: forward ids only grow)."""
        self.micro, self.window = None, None
        self.tap.reset_micro()
        if micro.forwards:
            self.consumed.update(micro.forwards)
            newest = max(self.consumed)
            self.consumed = {f for f in self.consumed if f > newest - 64}

    def fold(self, micro: MicroStep, window: Window) -> Window:
        """After a measured micro-step: ``window`` with it folded in and returned: its
        statistics (loss sum, per-sample norms, ||s_k||^2 in per-sample units) merged into
        ``window.stats``, the instruments' micro-step states merged into ``window.states``, its
        stacked uses carried (measured by :meth:`settle`). A tracked parameter the backward
        never reached has g_n = 0 for this micro-step's samples."""
        micro.resolve()
        b = micro.batch_size
        s = micro.stats
        s.reduction = micro.reduction
        s.num_samples, s.micro_steps = b, 1
        if micro.loss_value is not None:
            v = micro.loss_value.double()
            s.loss_sum = v * b if micro.reduction == "mean" else v
        elif micro.losses is not None:
            s.loss_sum = micro.losses.detach().double().sum()
        else:
            s.loss_sum = torch.tensor(float("nan"), dtype=torch.float64)
            s.loss_unknown = 1  # the record says "unknown", not "non-finite"
        if micro.l2_parts:  # one sum per micro-step, not one add per use
            parts = micro.l2_parts
            if len({p.dtype for p in parts}) > 1:
                parts = [p.double() for p in parts]
            micro.batch_l2 = torch.stack(parts).sum(0, dtype=torch.float64)
            micro.l2_parts = []
        if micro.stacked and micro.batch_l2 is None:  # every use was stacked: settle adds their norms
            some = next(iter(micro.stacked.values()))[0][2]
            micro.batch_l2 = torch.zeros(b, dtype=torch.float64, device=some.device)
        if micro.batch_l2 is not None:
            s.batch_l2 = [micro.batch_l2]
            if self.groups:  # a group no use reached this micro-step: zeros for its samples
                got = micro.group_l2
                s.group_l2 = {g: [got[g] if g in got else torch.zeros_like(micro.batch_l2)] for g in self.groups}
        if micro.grad_sq is not None:  # ||s_k||^2 = (per-sample scale)^2 ||dL/dtheta||^2
            scale = micro.scale()
            s.micro_grad_sq = micro.grad_sq * (scale * scale)
            s.micro_size_sq = float(b) ** 2
        index = len(window.stats.batch_l2)  # this micro-step's place among the window's [B_k] vectors
        window.stats = stats = window.stats.merge(s)
        if micro.stacked:
            deferred.carry(window, micro, index)
            if window.carried_elements > deferred.STACK_BUDGET:
                deferred.settle(window, self.use_sums)
        skipped = [q for q in self.tap.params if q not in micro.seen and q not in self.silent]  # g_n = 0 for these
        self.undefined.count(micro.seen, skipped, b)
        if "sum_grad_squared" in self.plan.needs:  # every tracked parameter has an entry, zeros if unreached
            for q in skipped:
                if q not in stats.sum_grad_squared:
                    p = self.tap.params[q]
                    stats.sum_grad_squared[q] = torch.zeros(
                        full_shape(p), dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
        for inst in self.plan.per_sample:
            for q in skipped:
                inst.update_zeros(micro.states[id(inst)], q, self.tap.params[q], b)
        states = window.states
        for inst in self.plan.micro:
            key = id(inst)
            inst.micro_done(micro.states[key], b, micro.reduction, micro.losses)
            states[key] = inst.merge(states[key], micro.states[key])
        return window

    def settle(self, window: Window) -> Window:
        """``window`` with the stacked uses its micro-steps left for its end measured into its
        statistics (:func:`gradlens.measure.deferred.settle`): before anything reads them."""
        if window.carried:
            with torch.no_grad():
                deferred.settle(window, self.use_sums)
        return window

    def check_undefined(self, window: Window | None = None) -> None:
        """Parameters whose output reached a layer or operation that mixes samples (found in the
        forward): an error naming them all, left out of the Tap (``undefined="exclude"``), or
        measured on (``"contribution"``): :class:`gradlens.measure.undefined.UndefinedParams`."""
        bad = {q: why for q, why in self.tap.tainted.items() if q in self.tap.params}
        if bad:
            rest = self.undefined.apply(bad, self.tap.params, self.model, window if window is not None else self.window,
                                        self.plan.per_sample)
            if rest is self.tap.params:  # "contribution": all measured on
                return
            self.tap.set_params(rest)  # the Lens updates its coverage after the capture
            self._set_groups(rest)

    # ------------------------------------------------------------------ events from capture
    def _in_backward(self, what: str) -> MicroStep | None:
        """The micro-step whose backward just reached ``what`` (a use, or a parameter): inside
        a capture, its first backward (whose end is then watched); None while the curvature
        instruments' Hessian-vector products run (:attr:`graph` busy: not a micro-step)."""
        micro = self.micro
        if micro is None and self.graph is not None and self.graph.busy:
            return None
        if micro is None:
            raise RuntimeError(
                f"backward reached {what!r} outside lens.capture() during a tracked window; wrap "
                "the backward: with lens.capture(): loss.backward()"
            )
        if micro.backward_done:
            raise RuntimeError(
                "a second backward() inside one lens.capture(): each micro-step's backward needs "
                "its own capture (with lens.capture(): loss.backward())"
            )
        if not micro.end_watched:
            micro.end_watched = True
            queue_backward_callback(lambda: setattr(micro, "backward_done", True))
        return micro

    def _check_axes(self) -> None:
        """One error for every use of this micro-step whose sample axis is unknown."""
        err = self.tap.axis_error() if hasattr(self.tap, "axis_error") else None
        if err is not None:
            raise err

    def _begin_use(self, what: str, batch: int, forward: int) -> MicroStep | None:
        """Checks at each use reaching backward; None: nothing to measure (an empty batch).
        What depends on the forward pass alone (consumed, axes, undefined parameters, the
        reduction) is checked at the first use of each forward in the micro-step."""
        micro = self.micro
        if micro is not None and forward in micro.forwards and micro.end_watched and not micro.backward_done:
            if micro.empty:
                return None
            if batch != micro.batch_size:
                self._batch_mismatch(micro, batch, what)
            return micro
        micro = self._in_backward(what)
        if micro is None:
            return None
        if forward in self.consumed:
            raise RuntimeError(
                f"this backward reached {what!r} of a forward pass that an earlier lens.capture() "
                "already measured (a graph backpropagated twice, retain_graph=True): its samples "
                "would count twice; run a new forward pass for each captured micro-step"
            )
        micro.forwards.add(forward)
        self._check_axes()
        if batch == 0:
            micro.empty = True
        if micro.empty:
            return None
        if self.tap.tainted:
            self.check_undefined(self.window)
        micro.resolve()
        if micro.reduction is not None:
            check_reduction(self.window.stats, micro.reduction)
        if micro.batch_size is None:
            micro.batch_size = batch
        elif batch != micro.batch_size:
            self._batch_mismatch(micro, batch, what)
        return micro

    @staticmethod
    def _batch_mismatch(micro: MicroStep, batch: int, what: str) -> None:
        raise RuntimeError(
            f"the loss saw a batch of {micro.batch_size} but the model's input had {batch} "
            f"samples (at {what!r}); gradlens needs the first dimension of the loss input and "
            "of the model's first input to be the sample dimension, or, for sequence-first data, "
            "the samples' dim declared once: gradlens.extend(model, batch_dim=1) (a loss then "
            "takes the model's [T, B, ...] output as it is, or flattened)"
        )

    @staticmethod
    def _dtype(g: Tensor) -> torch.dtype:
        """The dtype of measurement: float32 or float64 as given, float32 for lower precisions."""
        return g.dtype if g.dtype in (torch.float32, torch.float64) else torch.float32

    def on_use(self, site: Site, a: Tensor, g: Tensor, weight_via_node: frozenset, batch: int, forward: int,
               fused: bool = False) -> Tensor | None:
        """Backward reached a closed-form use (``a`` its input, ``g`` its output gradient, both
        batch-first): measure it, or keep it if its parameters are shared (their g_n is the sum
        over uses, measured when the micro-step ends).

        ``weight_via_node``: the attributes whose dL/dp of this call a hook on its autograd node
        delivers (:meth:`on_weight_grad`); their grad_sum is not computed here.
        ``fused``: the use is a fused Linear call (:class:`~gradlens.capture.fused._FusedLinear`)
        whose backward has not formed dL/dW yet. Returns that call's dL/dW ``[*weight]`` when
        this measurement formed it anyway (the sum of the per-sample weight gradients it
        materialised, divided by the per-sample scale), else None (the call computes it)."""
        micro = self._begin_use(site.name, batch, forward)
        if micro is None:
            return None
        tap_params, uses = self.tap.params, self.tap.uses
        silent = self.silent
        names = {attr: q for attr, q in site.params.items() if q in tap_params and q not in silent}
        if not names:
            return None
        # the hand-off slot for the fused call's dL/dW: kernels (LinearKernel.reduce) and
        # instruments (BatchDot.update_layer) fill ``slot.value``; it never leaves the Meter
        slot = WeightGrad() if fused else None
        grad_mode = torch.is_grad_enabled()  # off in a plain backward: no context to enter
        if grad_mode:
            torch.set_grad_enabled(False)
        try:
            dtype = g.dtype if g.dtype in _MEASURED else torch.float32
            raw = g.detach() if g.requires_grad else g  # (a backward with create_graph=True)
            if raw.dtype != dtype:
                raw = raw.to(dtype)
            scale = micro.scale()
            # made by this forward's autograd graph (or converted here): no later forward
            # writes into it, so a stacked use may keep it until the window's end (data, a
            # buffer, or a view of either: copied if kept; asked only where uses stack)
            made = self._stacks and a.grad_fn is not None and (
                (base := compat.view_base(a)) is None or base.grad_fn is not None)
            a = a.detach()
            if a.dtype != dtype and a.is_floating_point():
                a, made = a.to(dtype), True
            micro.seen.update(names.values())
            single = [attr for attr, q in names.items() if uses[q] <= 1]
            shared = [attr for attr in names if attr not in single]
            # per-sample units; kept unscaled (with the scale) where only BatchDot reads it, or
            # where the use is stacked (deferred.settle scales it)
            delta = None
            if single:
                part = site if len(single) == len(site.params) else site.only(single)
                wg = (slot, scale) if slot is not None and "weight" in single else None
                if self.plan.carry_scale and not shared:
                    self.measure_use(part, a, raw, micro, False, wg, scale=scale)
                else:
                    via = frozenset(attr for attr in weight_via_node if attr in single) if weight_via_node else ()
                    if not (self._stacks and wg is None and self._stack(micro, part, a, raw, via, made)):
                        delta = raw * scale
                        self.measure_use(part, a, delta, micro, via, wg)
            if shared:
                if delta is None:
                    delta = raw * scale
                part = site.only(shared)
                if part.kernel.kind == "linear":
                    micro.linear_uses.append((part, a, delta))
                else:
                    deferred.add_shared(micro, part, a, delta)
        finally:
            if grad_mode:
                torch.set_grad_enabled(True)
        return None if slot is None else slot.value

    def _stack(self, micro: MicroStep, site: Site, a: Tensor, delta: Tensor, via, made: bool) -> bool:
        """Keep a single use to be measured with others like it at the window's end
        (:func:`gradlens.measure.deferred.stack`): only its norms and window gradient are wanted (the
        latter from autograd for the attributes in ``via``). What a site's stacking depends on
        besides shapes is worked out once per site (a cache that a change of parameters or
        groups clears)."""
        got = self._stacking.get(id(site))
        if got is None or got[0] is not site:
            if len(self._stacking) > 4096:  # sites of functional calls are made per forward
                self._stacking.clear()
            # one sample's gradient elements, where settle materialises them (sums of squares)
            numel = site.kernel.numel(site.module, site.params) if "sum_grad_squared" in self.use_sums else 0
            got = self._stacking[id(site)] = (site, deferred.stack_key(site, self._split(site.params, True)), numel)
        if got[1] is None or not deferred.stack(micro, site, a, delta, got[1], via, made, got[2]):
            return False
        self.window.sites[site.name] = site
        return True

    def on_op_use(self, use: OpUse, g: Tensor) -> None:
        """Backward reached an operation where parameters meet the batch: per-sample gradients
        of each parameter through the exact per-operation rule (see :mod:`gradlens.capture.ops`)."""
        micro = self._begin_use(use.name, use.batch, use.forward)
        if micro is None:
            return
        tap = self.tap
        dtype = self._dtype(g)
        delta = (g.detach() if g.requires_grad else g).to(dtype) * micro.scale()
        per_q: dict[str, Tensor] = {}
        for pos, t, names in use.inputs:
            names = [q for q in names if q in tap.params and q not in self.silent]
            if not names:
                continue
            params = [tap.params[q] for q in names]
            if use.factor == 1:
                direct = ops.batched_lookup(use.func, use.args, use.kwargs, pos, t, params, delta, use.axis)
                if direct is not None:  # a lookup of ids that span the batch: no [B, *t.shape]
                    direct = direct.detach() if direct.requires_grad else direct
                    add_into(per_q, names[0], direct if use.rows is None else ops.rows_to_samples(direct, use))
                    continue
            if len(names) == 1:  # a slice of a routed expert weight: kept as its tokens' factors
                got = ops.routed_factors(use, pos, t, tap.params[names[0]], delta)
                if got is not None:
                    micro.routed.setdefault(names[0], []).append((*got, use.batch))
                    micro.seen.add(names[0])
                    continue
            gt = ops.routed_lookup(use, pos, t, delta)  # routed experts: sample n's rows, in closed form
            if gt is None:
                gt = ops.grouped_weight(use, pos, t, delta)
            if gt is None:
                gt = ops.per_sample_wrt(use.func, use.args, use.kwargs, pos, t, delta, use.axis)
                if use.factor != 1:  # rows n * f + j of the axis: sample n's gradient sums its f rows
                    gt = gt.reshape(use.batch, use.factor, *gt.shape[1:]).sum(1)
                if use.rows is not None:  # rows reordered, selected or repeated: sample n's sums its rows
                    gt = ops.rows_to_samples(gt, use)
            if len(names) == 1 and t is tap.params[names[0]]:
                got = [gt]
            else:
                got = ops.chain_to_params(t, [tap.params[q] for q in names], gt.to(t.dtype))
            for q, gq in zip(names, got):
                if gq is not None:
                    add_into(per_q, q, gq.detach().to(dtype))
        with torch.no_grad():
            for q, gq in per_q.items():
                micro.seen.add(q)
                if tap.uses[q] <= 1:
                    self.measure_param(f"{use.name}:{q}", q, gq, micro)
                else:
                    add_into(micro.shared, q, gq)

    def measure_param(self, name: str, q: str, g: Tensor, micro: MicroStep) -> None:
        """Measure the materialised per-sample gradients ``g [B, *param]`` of tracked parameter
        ``q`` as one use named ``name`` (shared parameters summed over their uses, the exact
        per-operation rule)."""
        site = Site(name, Materialised("p", self.tap.params[q]), MaterialisedKernel(), {"p": q})
        self.measure_use(site, g, g.new_zeros(g.shape[0]), micro)

    def measure_summed(self, name: str, q: str, uses: list, micro: MicroStep) -> None:
        """Measure tracked parameter ``q`` whose per-sample gradients are the sum over its
        ``uses`` (``[(site, attr, a, delta)]``), formed one slice of samples at a time
        (:class:`~gradlens.kernels.SummedUsesKernel`) as one use named ``name``."""
        b = uses[0][3].shape[0]
        stand_in = torch.zeros(b, dtype=uses[0][3].dtype, device=uses[0][3].device)
        site = Site(name, Materialised("p", self.tap.params[q]), SummedUsesKernel(uses), {"p": q})
        self.measure_use(site, stand_in, stand_in, micro)

    def finish(self, micro: MicroStep) -> None:
        """After backward: measure the shared parameters (sum over their uses) and check that
        every tracked parameter that received a gradient was measured."""
        with torch.no_grad():
            routed.measure(self, micro)
            deferred.measure(self, micro)
        if micro.grad_parts:
            self._add_grad_parts(micro)
        if self.plan.light:
            return
        tap = self.tap
        self._check_axes()
        missing = sorted(q for q in tap.received if q in tap.params and q not in micro.seen and q not in self.silent)
        if missing:
            raise RuntimeError(
                f"the tracked parameters {missing} received a gradient in this backward, but "
                "no use of them inside the model's forward was measured (a parameter used only "
                "outside model(...), e.g. in a loss term, has no per-sample gradient); exclude "
                f"them: Lens(..., exclude={missing!r})"
            )

    def check_unmeasured(self) -> None:
        """After a capture whose backward measured no use: if a backward did reach tracked
        parameters (it ran, but every use it passed was refused), the reason: the uses whose
        sample axis is unknown, the parameters that are undefined, or those no use measured.
        (Without a backward nothing is raised here: the capture then says so.)"""
        tap = self.tap
        received = sorted(q for q in getattr(tap, "received", ()) if q in tap.params)
        if not received or (self.micro is not None and self.micro.empty):
            return  # (an empty micro-batch: nothing to measure)
        self._check_axes()
        if tap.tainted:
            self.check_undefined(self.window)
        missing = [q for q in received if q in tap.params]
        if missing:
            raise RuntimeError(
                f"this backward reached the tracked parameters {missing}, but no use of them inside the "
                "model's forward was measured (a parameter used only outside model(...), e.g. in a loss "
                f"term, has no per-sample gradient); exclude them: Lens(..., exclude={missing!r})"
            )

    def measure_use(
        self, w: Site, a: Tensor, delta: Tensor, micro: MicroStep, weight_via_node=(),
        weight_grad=None, scale=None,
    ) -> None:
        """Measure one use: ``a`` the layer input, ``delta`` the output gradient in per-sample
        units (both batch-first). ``weight_grad``: ``(slot, per-sample scale)`` of a fused
        Linear call, handed to the kernel's reduction or an instrument (which may fill
        ``slot.value`` with dL/dW); :meth:`on_use` returns it. ``scale`` (a plan that carries
        it, see :attr:`Plan.carry_scale`): ``delta`` is unscaled and every instrument receives
        it with its scale.

        Each piece is computed once and handed to every instrument that needs it: the kernel's
        reduction (norms and sums, straight into the window's accumulators), the rank-one
        factors, and one pass of materialised ``[b, *param]`` slices whose squares serve both
        the norms and the sum of squares."""
        if scale is not None:
            self.window.sites[w.name] = w
            for inst in self.plan.layer:
                fill = weight_grad is not None and weight_grad[0].value is None and inst.fills_weight_grad
                inst.update_layer(micro.states[id(inst)], w, a, delta, weight_grad=weight_grad if fill else None,
                                  scale=scale)
            return
        window = self.window
        window.sites[w.name] = w
        kernel, module, stats = w.kernel, w.module, window.stats
        per_sample = bool(self.plan.per_sample)
        # Rank-one weights (Linear): instruments with a factor fast path skip materialisation.
        factors = kernel.outer_factors(module, a, delta) if self.plan.exact else {}
        # Quantities with a factor formula (Linear) never materialise, unless the per-sample pass
        # runs anyway (exact per-sample instruments, no rank-one factors: a sequence layer's
        # histogram); the rest come from that pass too: one pass serves them all.
        from_chunks = self.use_sums if not kernel.factored or (self.plan.exact and not factors) else frozenset()
        want = self.use_sums - from_chunks
        if want:
            # sums go straight into the window's accumulators (in place, no per-step copies)
            acc = {"sum_grad_squared": stats.sum_grad_squared, "grad_sum": stats.grad_sum}
            if weight_grad is not None:
                acc["weight_grad"] = weight_grad
            skip = {("grad_sum", attr) for attr in weight_via_node} if weight_via_node else ()
            for group, names in self._split(w.params, "batch_l2" in want):
                for l2 in kernel.reduce(module, a, delta, want, names, acc, skip):
                    micro.add_l2(l2, group)
        for inst in self.plan.layer:
            if weight_grad is not None and weight_grad[0].value is None and getattr(inst, "fills_weight_grad", False):
                inst.update_layer(micro.states[id(inst)], w, a, delta, weight_grad=weight_grad)
            else:
                inst.update_layer(micro.states[id(inst)], w, a, delta)
        if not (per_sample or from_chunks):
            return
        done: set[tuple[int, str]] = set()
        # Sampled histograms draw their entries from the layer's factors: no materialisation.
        for inst in self.plan.sampled:
            for attr, qname in w.params.items():
                draw = functools.partial(kernel.entries, module, a, delta, attr)
                inst.update_sampled(micro.states[id(inst)], qname, self.tap.params[qname], draw,
                                    delta.shape[0])
                done.add((id(inst), attr))
        for attr, (d2, a2) in factors.items():
            if attr in w.params:
                qname = w.params[attr]
                for inst in self.plan.exact:
                    if inst.update_outer(micro.states[id(inst)], qname, self.tap.params[qname], d2, a2):
                        done.add((id(inst), attr))
        attrs = [
            attr
            for attr in w.params
            if from_chunks or any((id(i), attr) not in done for i in self.plan.per_sample)
        ]
        if not attrs:
            return
        slices.measure(self, w, a, delta, micro, attrs, done, from_chunks, weight_via_node, weight_grad)

    def _split(self, names: dict[str, str], by_group: bool) -> list[tuple[str | None, dict[str, str]]]:
        """``[(group, names)]``: a use's parameters (attribute -> qualified name) by group, when
        ``batch_l2`` goes to groups (``by_group``); else ``[(None, names)]``. Most uses lie in
        one group (under ``groups="module"`` all but a call mixing parameters of several
        modules, e.g. a tied head with its own bias): then one reduction, as without groups."""
        of = self.group_of
        if not (by_group and of):
            return [(None, names)]
        parts: dict[str, dict[str, str]] = {}
        for attr, q in names.items():
            parts.setdefault(of[q], {})[attr] = q
        return list(parts.items())

#: dtypes measured as given (lower precisions are measured in float32)
_MEASURED = (torch.float32, torch.float64)
