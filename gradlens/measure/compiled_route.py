"""The compiled route: tracked micro-steps of a ``torch.compile(model)`` that run the compiled
graph, the statistics coming back as the gradients of probe tensors
(:mod:`gradlens.kernels.probed`).

The first tracked micro-step of a compiled model runs eagerly (the Tap, stance
``"force_eager"``): it follows the sample axis and finds shared parameters and mixing layers.
:meth:`CompiledRoute.judge` then decides, once: the later tracked micro-steps run compiled if
every tracked parameter belongs to a layer of :data:`gradlens.kernels.probed.PROBED`, used once
per forward, whose input holds the samples on dim 0, one row each, and nothing mixes samples;
otherwise they stay eager and :attr:`CompiledRoute.reason` says why (one warning, and
``record.meta["route"]`` / ``["route_reason"]``).

On the compiled route the tracked layers' forwards are replaced by their probed forwards (the
compiled graph is traced once more, then cached beside the untracked one), a forward pre-hook on
the compiled wrapper (outside the compiled region) makes fresh zero probes per forward, and
:meth:`CompiledRoute.finish` reads their gradients after backward into the micro-step, in
per-sample units (``MicroStep.scale()``, as the eager route). The window gradient and
``||dL/dtheta||^2`` come from parameter hooks (:meth:`WindowGradient.on_param_grad`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from gradlens.capture.units import MicroStep, check_reduction
from gradlens.kernels.probed import forward_for, probe_width, probed_class

__all__ = ["CompiledRoute", "ROUTE_NEEDS", "route_refusal"]

#: what the compiled route provides: per-sample norms, sums of squares, the window gradient
ROUTE_NEEDS = frozenset({"batch_l2", "sum_grad_squared", "grad_sum", "micro_grad_sq"})


def route_refusal(wrapper: nn.Module | None, in_place: bool, plan: Any) -> str | None:
    """Why a Lens on a compiled model cannot take the compiled route at all (None: it may,
    once the first tracked micro-step has been judged)."""
    if wrapper is None:
        if in_place:
            return ("the model was compiled in place (model.compile()): its probes must be made outside the "
                    "compiled region; give the Lens torch.compile(model)")
        return "the Lens got the plain module of a compiled forward; give it torch.compile(model)"
    extra = plan.needs - ROUTE_NEEDS
    if extra or plan.micro:
        names = sorted(type(i).__name__ for i in plan.micro) or sorted(extra)
        return f"{', '.join(names)} need{'s' if len(names) == 1 else ''} the eager route"
    return None


class CompiledRoute:
    """The compiled route of one Lens (see the module docstring).

    Args:
        meter: the Lens' :class:`~gradlens.measure.meter.Meter`.
        wrapper: the ``torch.compile(model)`` wrapper the Lens was given.
        refusal: why the route is impossible (:func:`route_refusal`), or None.

    Attributes:
        state: ``"pending"`` (the next tracked micro-step runs eagerly and is judged),
            ``"compiled"`` or ``"eager"``.
        reason: why the route is what it is (a sentence).
        micro_routes: the route of each micro-step of the current window.
    """

    def __init__(self, meter: Any, wrapper: nn.Module | None, refusal: str | None):
        self.meter, self.wrapper = meter, wrapper
        self.state = "eager" if refusal is not None else "pending"
        self.reason = refusal or "the first tracked micro-step runs eagerly to check the layers"
        self.micro_routes: list[str] = []
        self.sites: list[tuple[nn.Module, list[tuple[int, str]]]] = []  # module, [(probe column, name)]
        self.judged: dict[str, nn.Parameter] = {}
        self.handles: list = []
        self.current: list | None = None  # (module, probe, sq tensors) of the last forward with grad
        self.batch: int | None = None
        self.forwards = 0
        #: called at each probed forward, before the probes are made (the Lens re-reads the
        #: trainable parameters at a window's first forward); returns False to run it eagerly
        self.on_forward = None

    @property
    def on(self) -> bool:
        """The compiled route is installed (the current micro-step runs compiled)."""
        return bool(self.handles)

    # ------------------------------------------------------------------ judging
    def judge(self, micro: MicroStep) -> bool:
        """After the eager first tracked micro-step (before the Tap's per-micro-step state is
        reset): decide the route; True if it changed to ``"compiled"`` or ``"eager"``."""
        if self.state != "pending":
            return False
        why = self._why_not(micro)
        self.state = "eager" if why else "compiled"
        self.reason = why or ("every tracked parameter is in a probed layer (" + ", ".join(
            sorted({type(m).__name__ for m, _ in self.sites})) + ") used once per forward, samples on dim 0")
        self.judged = dict(self.meter.tap.params)
        return True

    def _why_not(self, micro: MicroStep) -> str | None:
        meter = self.meter
        tap = meter.tap
        if meter.undefined_params or tap.tainted:
            bad = dict(meter.undefined_params) or dict(tap.tainted)
            q = sorted(bad)[0]
            return f"samples are mixed: {q!r} reaches {bad[q]}"
        if any(call.roots for call in micro.loss_calls):
            return "the loss is computed inside the model's forward (the compiled route needs an extended loss outside it)"
        owner: dict[str, tuple[nn.Module, str, str]] = {}
        for mod, site in tap.sites.values():
            if site is None:
                continue
            for attr, q in site.params.items():
                owner[q] = (mod, attr, site.name)
        sites: dict[int, tuple[nn.Module, list]] = {}
        for q in tap.params:
            if q not in owner:
                return f"parameter {q!r} is not used by a layer of its own module (an operation on it)"
            mod, attr, name = owner[q]
            if not probed_class(mod) or forward_for(mod) is None:
                return f"parameter {q!r} is in {name!r} ({type(mod).__name__}), which has no probed form"
            if "forward" in mod.__dict__ and not any(m is mod for m in tap._replaced):  # (not the Tap's)
                return f"{name!r} has a forward of its own (an instance attribute)"
            n = tap.uses.get(q, 0)
            if n != 1:
                return (f"parameter {q!r} is used {n} times in one forward (shared: its probe would hold cross terms)"
                        if n else f"parameter {q!r} was not used by the first tracked micro-step")
            if tap.layouts.get(name) is not True:
                return f"the input of {name!r} does not hold the samples on dim 0, one row each"
            cols = probe_width(mod)
            sites.setdefault(id(mod), (mod, []))[1].append((cols.index(attr), q))
        self.sites = list(sites.values())
        return None

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        """Replace the tracked layers' forwards by their probed forwards and hook the wrapper
        (a tracked window on the compiled route opens; idempotent)."""
        if self.handles or self.state != "compiled":
            return
        for mod, _ in self.sites:
            mod.forward = forward_for(mod)
            mod._gradlens_probe, mod._gradlens_sq = None, None
        ref = weakref.ref(self)
        self.handles.append(self.wrapper.register_forward_pre_hook(
            lambda m, args, kwargs: _make_probes(ref, args, kwargs), with_kwargs=True))
        meter = self.meter
        if meter.plan.needs & {"grad_sum", "micro_grad_sq"}:
            for q, p in meter.tap.params.items():
                self.handles.append(p.register_hook(_param_grad(meter, q)))
        self.current, self.forwards = None, 0

    def remove(self) -> None:
        """Put the layers' own forwards back and remove the hooks (idempotent)."""
        for h in self.handles:
            h.remove()
        if self.handles:
            for mod, _ in self.sites:
                for attr in ("forward", "_gradlens_probe", "_gradlens_sq"):
                    mod.__dict__.pop(attr, None)
        self.handles = []
        self.current, self.forwards = None, 0

    def same_params(self) -> bool:
        """The tracked parameters are those judged."""
        params = self.meter.tap.params
        return params.keys() == self.judged.keys() and all(p is self.judged[q] for q, p in params.items())

    def reconsider(self) -> None:
        """The tracked parameters changed since the judgement: judge again at the next
        tracked micro-step (which runs eagerly)."""
        self.remove()
        self.state, self.reason = "pending", "the tracked parameters changed: judged again"

    # ------------------------------------------------------------------ a micro-step
    def finish(self, micro: MicroStep) -> None:
        """After backward on the compiled route: the probes' gradients into ``micro`` (its
        per-sample norms, the window's sums of squares), in per-sample units."""
        got, forwards = self.current, self.forwards
        self.current, self.forwards = None, 0
        for mod, _ in (self.sites if self.handles else ()):  # read once: a layer called outside a
            mod._gradlens_probe, mod._gradlens_sq = None, None  # forward of the wrapper runs its own op
        if forwards > 1:
            raise RuntimeError(
                f"{forwards} forward passes with gradients ran before this lens.capture() on the compiled "
                "route: gradlens measures one forward per captured micro-step (run a forward, then its "
                "capture)")
        if got is None or not any(p.grad is not None for _, p, _ in got):
            if micro.seen:  # the backward reached tracked parameters, but no probe of a forward
                raise RuntimeError(
                    "this backward on the compiled route reached tracked parameters but no probed layer "
                    "of a forward run since the last lens.capture() (a graph backpropagated twice, "
                    "retain_graph=True, a forward run before the window opened, or the module inside "
                    "torch.compile(model) called instead of the compiled model): run a new forward of "
                    "the compiled model for each captured micro-step")
            return
        meter = self.meter
        if micro.batch_size is None:
            micro.batch_size = self.batch
        elif micro.batch_size != self.batch:
            meter._batch_mismatch(micro, self.batch, "the compiled forward")
        micro.resolve()
        if micro.reduction is not None:
            check_reduction(meter.window.stats, micro.reduction)
        if self.batch == 0:
            micro.empty = True
            return
        scale = micro.scale()
        s2 = scale * scale
        acc = meter.window.stats.sum_grad_squared
        squares = "sum_grad_squared" in meter.use_sums
        groups = meter.group_of if meter.groups else {}
        cols = dict(self.sites_by_id)
        with torch.no_grad():
            for mod, probe, sq in got:
                if probe.grad is None:
                    continue
                for j, q in cols[id(mod)]:
                    if q not in meter.tap.params:
                        continue
                    micro.seen.add(q)
                    micro.add_l2(probe.grad[:, j] * s2, groups.get(q))
                    if squares and sq is not None and sq[j].grad is not None:
                        p = meter.tap.params[q]
                        v = (sq[j].grad * s2).to(torch.promote_types(p.dtype, torch.float32))
                        if q in acc:
                            acc[q].add_(v)
                        else:
                            acc[q] = v

    @property
    def sites_by_id(self) -> list[tuple[int, list[tuple[int, str]]]]:
        return [(id(mod), cols) for mod, cols in self.sites]


def _first_tensor(args: tuple, kwargs: dict) -> Tensor | None:
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, Tensor):
            return x
    return None


def _make_probes(ref: Any, args: tuple, kwargs: dict) -> None:
    """The compiled wrapper's forward pre-hook (outside the compiled region): fresh zero probes
    for this forward, one ``[B, A]`` per probed layer (and its ``sq`` tensors where the sum of
    squares is wanted), set as the layers' attributes (inputs of the compiled graph)."""
    route = ref()
    if route is None or not route.handles or not torch.is_grad_enabled():
        return
    if route.on_forward is not None and route.on_forward() is False:
        return  # the route was given up for this forward (it runs eagerly)
    x = _first_tensor(args, kwargs)
    if x is None:
        return
    b = x.shape[0]
    squares = "sum_grad_squared" in route.meter.use_sums
    current = []
    for mod, _ in route.sites:
        attrs = probe_width(mod)
        w = mod.weight
        probe = torch.zeros(b, len(attrs), dtype=w.dtype, device=w.device, requires_grad=True)
        sq = tuple(torch.zeros_like(getattr(mod, a), requires_grad=True) for a in attrs) if squares else None
        mod._gradlens_probe, mod._gradlens_sq = probe, sq
        current.append((mod, probe, sq))
    route.current, route.batch = current, b
    route.forwards += 1


def _param_grad(meter: Any, q: str):
    """A parameter hook of the compiled route: dL/dp of ``q`` to the Meter (window gradient,
    ``||dL/dtheta||^2``) inside a capture."""
    def hook(grad: Tensor) -> None:
        if meter.micro is not None:
            meter.on_param_grad(q, grad)

    return hook
