"""``torch.compile`` and the Lens: tracked windows run the model eagerly, and the Lens says so once.

gradlens follows every operation of a tracked forward in Python, so while a tracked window's
hooks are installed the compiler's stance is ``"force_eager"`` (no graph break, no recompile;
:class:`gradlens.capture.tap.Tap`); untracked windows install no hook and run the compiled graphs.
:class:`CompileNotice` notes that the model runs compiled (given ``torch.compile(model)``, a model
compiled in place, or seen by a forward pre-hook while dynamo traces) and warns once per Lens
about what a tracked window costs then.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any, Callable

import torch
from torch import nn

from gradlens import compat
from gradlens.measure.compiled_route import CompiledRoute, route_refusal

__all__ = ["CompileNotice", "make_route", "open_tracked", "end_micro", "route_meta"]

_COMPILED = (
    "the model runs under torch.compile: gradlens follows every operation of a tracked "
    "forward in Python, so tracked windows run the model eagerly (torch.compiler stance "
    "'force_eager' while the window's hooks are installed: no graph break, no recompile); "
    "untracked windows install no hook and run the compiled graphs. A tracked window costs "
    "about an eager step plus gradlens' own cost: track fewer windows (Lens(..., every=k)) "
    "to keep the cost small (docs/long_runs.md). (Said once per Lens.)"
)

_TRACED = (
    " This Lens got the plain module while a compiled one ran the forward, so this window's "
    "forward was traced with gradlens' hooks (graph breaks); from the next tracked window on "
    "it runs eagerly. Give the Lens the compiled module (Lens(torch.compile(model), ...)) or "
    "compile in place (model.compile()) to avoid that."
)


class CompileNotice:
    """Whether a Lens' model runs under ``torch.compile`` (``seen``), and the warning said once.

    Args:
        seen: the Lens was given ``torch.compile(model)`` or a model compiled in place.
    """

    def __init__(self, seen: bool):
        self.seen = seen
        self.warned = False

    def probe(self) -> Callable[[Any, Any], None]:
        """A forward pre-hook that notes a compiled forward: while dynamo traces, it sets
        ``seen`` (an attribute write: traced without a graph break), through a weak reference
        (deep-copying the model copies no notice, and the model keeps none alive)."""
        ref = weakref.ref(self)

        def compiled(module, args) -> None:
            if torch.compiler.is_compiling():
                notice = ref()
                if notice is not None:
                    notice.seen = True

        return compiled

    def warn_once(self, tap: Any, light: bool, route: CompiledRoute | None = None) -> None:
        """At a tracked capture: the first time the model is known to run compiled, warn what a
        tracked window costs and, if the Lens got the plain module (dynamo traced the hooks),
        make the next tracked forwards eager (``tap.eager_from_now()``). Nothing under light
        capture (parameter hooks only: no layer output is hooked, no graph break)."""
        if light:
            return
        if self.seen and not self.warned:
            self.warned = True
            traced = not tap.run_eager  # the Lens got the plain module: dynamo traced the hooks
            tap.eager_from_now()  # from the next tracked forward on
            if route is not None and route.state == "pending":
                warnings.warn(_ROUTE, RuntimeWarning, stacklevel=4)
                return
            why = f" (gradlens' compiled route is not taken: {route.reason}.)" if route is not None else ""
            warnings.warn(_COMPILED + (_TRACED if traced else "") + why, RuntimeWarning, stacklevel=4)


_ROUTE = (
    "the model runs under torch.compile: the first tracked micro-step runs eagerly (torch.compiler "
    "stance 'force_eager': no graph break) while gradlens checks that every tracked layer has a probed "
    "closed form (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.Embedding, transformers' Conv1D), used once per "
    "forward with the samples on "
    "dim 0; then tracked micro-steps run the compiled graph, their statistics the gradients of probe "
    "tensors (record.meta['route']). If the model does not qualify, they stay eager and a second "
    "warning says why. (Said once per Lens.)"
)


def make_route(given: nn.Module, meter: Any) -> CompiledRoute | None:
    """The compiled route of a Lens given ``given`` (None: the model does not run compiled, or
    capture is light and runs compiled anyway)."""
    wrapper = given if compat.compiled_original(given) is not given else None
    in_place = compat.compiled_in_place(given)
    if (wrapper is None and not in_place) or meter.plan.light:
        return None
    route = CompiledRoute(meter, wrapper, route_refusal(wrapper, in_place, meter.plan))
    meter.route = route
    return route


def open_tracked(lens: Any) -> bool:
    """A tracked window opens: on the compiled route, install it instead of the Tap (the
    params probe's refresh happens at the wrapper's pre-hook); True if it did."""
    route = lens._route
    if route is None:
        return False
    route.micro_routes = []
    if route.state != "compiled":
        return False
    if not route.same_params():  # frozen, unfrozen or added since the judgement
        route.reconsider()
        return False
    lens._meter.remove()
    lens._probes.disarm()
    route.install()
    route.on_forward = _first_forward(lens)
    return True


def _first_forward(lens: Any) -> Callable[[], bool]:
    """The compiled route's forward callback for one window: at the window's first forward,
    re-read the trainable parameters (as the params probe does on the eager route); if they
    changed since the judgement, this forward runs eagerly (the Tap, judged again)."""
    ref, done = weakref.ref(lens), []

    def first() -> bool:
        owner = ref()
        if owner is None or done or owner._window is None or owner._window.micro_steps or owner._meter.micro is not None:
            return True
        done.append(True)
        owner._window.coverage = owner._refresh_params()
        route = owner._route
        if route.same_params():
            return True
        route.reconsider()
        owner._meter.install()  # the Tap, stance force_eager: this forward runs eagerly
        return False

    return first


def finish_micro(route: CompiledRoute | None, meter: Any, micro: Any) -> tuple[bool, bool]:
    """A capture's backward is done: on the compiled route the probes' gradients go into
    ``micro`` first; then the Meter finishes it (or says why nothing was measured), and the
    first eager micro-step of a compiled model is judged. Returns ``(compiled, judged)``."""
    compiled = route is not None and route.on
    if compiled:
        route.finish(micro)
    if not micro.seen:
        meter.check_unmeasured()  # a backward that ran but measured nothing: why
        return compiled, False
    meter.finish(micro)
    return compiled, route is not None and not compiled and route.judge(micro)


def end_micro(lens: Any, micro: Any, compiled: bool, judged: bool) -> None:
    """After a micro-step folded: note its route; after the judgement, switch the next
    micro-steps to the compiled route, or warn once why they stay eager."""
    route = lens._route
    if route is None:
        return
    route.micro_routes.append("compiled" if compiled else "eager")
    if not judged:
        return
    if route.state == "compiled":
        routes = route.micro_routes
        lens._meter.remove()  # the Tap's hooks and the eager stance go
        open_tracked(lens)
        route.micro_routes = routes
    else:
        warnings.warn(f"gradlens' compiled route is not taken: {route.reason}; tracked micro-steps of this "
                      "model run eagerly (record.meta['route_reason']).", RuntimeWarning, stacklevel=5)


def route_meta(route: CompiledRoute | None, meta: dict) -> None:
    """``record.meta["route"]`` (``"eager"``, ``"compiled"`` or ``"eager, then compiled"``: the
    window's micro-steps) and ``["route_reason"]`` of a compiled model's record."""
    if route is None:
        return
    seen = list(dict.fromkeys(route.micro_routes))
    meta["route"] = ", then ".join(seen) if seen else route.state
    meta["route_reason"] = route.reason
