"""The ``torch.optim.Optimizer`` interface of an optimizer that wraps another one:
:class:`WrappedOptimizer`.

A wrapper such as :class:`~gradlens.training.accumulate.GradientAccumulateOptimizer` must be a
``torch.optim.Optimizer`` (LR schedulers and GradScaler check ``isinstance``) without being a
second optimizer: its ``param_groups``, ``state`` and ``defaults`` are the inner optimizer's, and
the step and state-dict hooks live in the wrapper's own registries (public
``torch.utils.hooks.RemovableHandle`` objects), run when the wrapper says. ``Optimizer.__init__``
is not called, so none of ``Optimizer``'s private internals is re-created or relied on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer(Optimizer):
    """An ``Optimizer`` whose ``param_groups``, ``state`` and ``defaults`` are those of the inner
    ``optimizer`` and whose hooks are its own.

    Hooks keep ``torch.optim``'s signatures: ``register_step_pre_hook(hook)`` /
    ``register_step_post_hook(hook)`` with ``hook(optimizer, args, kwargs)``, fired when the
    subclass calls :meth:`_run_step_pre_hooks` / :meth:`_run_step_post_hooks` (values returned
    by pre-hooks are ignored); the state-dict pre / post hooks and load-state-dict pre / post
    hooks as in ``torch.optim``, run by :meth:`_state_dict_with_hooks` and
    :meth:`_load_state_dict_with_hooks`. A subclass adds its own kinds of hook to
    :attr:`_HOOK_KINDS` and registers them with :meth:`_register`.

    Args:
        optimizer: the inner ``torch.optim.Optimizer`` (``self.optimizer``).
    """

    #: the hook registries (``self._hooks[kind]``: handle id -> hook, in call order)
    _HOOK_KINDS: tuple[str, ...] = ("step_pre", "step_post", "sd_pre", "sd_post", "load_pre", "load_post")

    def __init__(self, optimizer: Optimizer) -> None:
        # Optimizer.__init__ is not called: param_groups and state are the inner optimizer's.
        self._hooks: dict[str, OrderedDict[int, Callable]] = {k: OrderedDict() for k in self._HOOK_KINDS}
        self.optimizer = optimizer

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

    def _run_step_pre_hooks(self) -> None:
        for pre_hook in list(self._hooks["step_pre"].values()):
            pre_hook(self, (self,), {})

    def _run_step_post_hooks(self) -> None:
        for post_hook in list(self._hooks["step_post"].values()):
            post_hook(self, (self,), {})

    def _state_dict_with_hooks(self, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``build()`` between the state-dict pre-hooks (``hook(optimizer)``) and post-hooks
        (``hook(optimizer, state_dict)``, whose non-None return replaces the state dict)."""
        for pre_hook in list(self._hooks["sd_pre"].values()):
            pre_hook(self)
        out = build()
        for post_hook in list(self._hooks["sd_post"].values()):
            result = post_hook(self, out)
            if result is not None:
                out = result
        return out

    def _load_state_dict_with_hooks(self, state_dict: dict[str, Any], load: Callable[[dict[str, Any]], None]) -> None:
        """``load(state_dict)`` after the load pre-hooks (``hook(optimizer, state_dict)``, whose
        non-None return replaces the state dict) and before the post-hooks (``hook(optimizer)``)."""
        for pre_hook in list(self._hooks["load_pre"].values()):
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        load(state_dict)
        for post_hook in list(self._hooks["load_post"].values()):
            post_hook(self)

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
        """The inner optimizer's ``state`` (a wrapper keeps its own state, e.g. accumulators, elsewhere)."""
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

    def _params(self) -> list[Tensor]:
        """The parameters of every group, in ``param_groups`` order (the flat index order)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
