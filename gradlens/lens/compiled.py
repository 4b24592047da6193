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

__all__ = ["CompileNotice"]

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

    def warn_once(self, tap: Any, light: bool) -> None:
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
            warnings.warn(_COMPILED + (_TRACED if traced else ""), RuntimeWarning, stacklevel=4)
