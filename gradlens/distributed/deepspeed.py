"""A Lens on a model trained with DeepSpeed ZeRO (stages 1, 2 and 3), in a plain loop or through
the Hugging Face Trainer / Accelerate.

What a user holds after ``engine, optimizer, _, _ = deepspeed.initialize(model=model,
optimizer=opt, config=...)``: the engine (an ``nn.Module`` around ``model``, ``engine.module``),
DeepSpeed's optimizer (``engine.optimizer``: ``DeepSpeedZeroOptimizer`` for stages 1 and 2,
``DeepSpeedZeroOptimizer_Stage3`` for stage 3, not a ``torch.optim.Optimizer``) and the torch
optimizer it was given (``opt``, which DeepSpeed keeps as ``engine.optimizer.optimizer``).
:func:`resolve` takes any of them (``Lens(engine, ...)``, ``Lens(engine.module, ...,
optimizer=engine.optimizer)``, ``optimizer=opt``, ``optimizer=engine``, Accelerate's
``DeepSpeedOptimizerWrapper``) and finds the model, the torch optimizer and DeepSpeed's optimizer.

**Where the update is.** The torch optimizer steps DeepSpeed's flat fp32 partitions (each rank
its own part); DeepSpeed copies them into the model's parameters after that step, still inside
its own ``step()`` (stages 1 and 2: into each rank's partition, then an all-gather of the whole
model; stage 3: into each rank's partition only). So a hook on the torch optimizer sees
theta_t on both sides of the update (and, under stage 3, runs once per sub-group). The Lens
instead wraps DeepSpeed's optimizer's ``step`` (:meth:`ZeroView.step_hooks`, an attribute of
that one object, removed when the Lens closes): before it runs, the window is complete (the
ranks merge, theta_t is read); after it returns, the model holds theta_{t+1} as DeepSpeed wrote
it, and the window closes. A step DeepSpeed skipped (``optimizer.overflow``: fp16 inf/nan) drops
the window instead, like a GradScaler's.

**The global batch.** Each rank captures its own micro-steps; the window merges over the ranks
as under DDP (:mod:`gradlens.distributed.merge`: one all_reduce, plus one all_gather when
per-sample vectors are kept). DeepSpeed's ``engine.backward(loss)`` divides the loss by its
``gradient_accumulation_steps`` (K) before ``backward``: the multiplier 1/K lies between the loss
and backward, where gradlens measures it (an extended loss module, a loss inside the model, or
``lens.capture(reduction=..., loss=loss)``) and divides it out. (``loss.backward()`` on a loss
computed outside the model instead lets DeepSpeed divide the model outputs' gradients by K,
after the loss: use ``engine.backward(loss)``, as DeepSpeed's own examples do.)

**Stage 3.** Outside its module's forward and backward, each parameter (the same
``nn.Parameter`` object throughout) holds an empty ``[0]`` partition. The per-sample pieces of a
use (input, output gradient) are full-shaped; what the kernels read of a parameter when its
output gradient arrives is its shape, taken from ``ds_shape`` (:mod:`gradlens.core.param_shapes`:
DeepSpeed gathers a module's parameters in backward only after the gradient has passed the
module's outputs, where the capture hooks them); every use is measured then (small uses are not
stacked to the window's end). Parameter
values are gathered only for the instruments that read them, only on tracked windows, one
parameter at a time (``deepspeed.zero.GatheredParameters``: an all-gather of its D_p numbers)
and released at once: ``GradHist2d`` bins each parameter's values when a window opens
(:meth:`ZeroView.bin_values`); ``Alpha``, ``UpdateSize`` and ``Distance`` get copies of the
full values right before and right after DeepSpeed's step (:meth:`ZeroView.present_values`;
copies of D numbers, what these instruments keep on one process too). Sizes read after backward
come from ``ds_shape`` (:mod:`gradlens.core.param_shapes`).

**Refused** (:meth:`ZeroView.check_instruments`, naming the stage): the curvature instruments
(``HessMaxEV``, ``HessTrace``, ``TICDiag``, ``TICTrace``: they need the micro-steps' gradients
with their graphs, and ``engine.backward`` has no ``create_graph``; their Hessian-vector
products would run DeepSpeed's gradient hooks, which reduce every gradient into its
partitions), and under stage 3 the instruments whose :meth:`~gradlens.instruments.base.Instrument.sharded_refusal`
says why (sampled ``GradHist2d`` reads parameter values during backward).

DeepSpeed is never imported here unless the model is DeepSpeed's (its objects are told by the
package their class comes from).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

__all__ = ["ZeroView", "resolve", "from_deepspeed", "is_engine"]


def from_deepspeed(obj: Any) -> bool:
    """An instance of a class defined in the ``deepspeed`` package (or a subclass of one),
    told without importing it."""
    return any(c.__module__.split(".")[0] == "deepspeed" for c in type(obj).__mro__)


def is_engine(obj: Any) -> bool:
    """A DeepSpeed engine (``deepspeed.initialize``'s first result): an ``nn.Module`` of the
    ``deepspeed`` package around the user's model (``.module``)."""
    return isinstance(obj, nn.Module) and from_deepspeed(obj) and isinstance(getattr(obj, "module", None), nn.Module)


def _is_ds_optimizer(obj: Any) -> bool:
    """DeepSpeed's optimizer (``engine.optimizer``): an object of the ``deepspeed`` package with
    a ``step()`` that updates the model, holding the torch optimizer as ``.optimizer``."""
    return (obj is not None and not isinstance(obj, nn.Module) and from_deepspeed(obj)
            and callable(getattr(obj, "step", None))
            and isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer))


def linked_optimizer(model: nn.Module) -> Any:
    """The DeepSpeed ZeRO optimizer that updates ``model``'s parameters, or None: DeepSpeed
    links each parameter to it under stage 3 (``_z3_optimizer``; under stages 1 and 2
    ``_zero_optimizer``, only with CPU offload)."""
    for p in model.parameters():
        for attr in ("_z3_optimizer", "_zero_optimizer"):
            opt = getattr(p, attr, None)
            if opt is not None and _is_ds_optimizer(opt):
                return opt
    return None


def _fragments_linked(model: nn.Module) -> bool:
    """Whether DeepSpeed maps ``model``'s parameters to fragments of its flat fp32 partitions
    (``_hp_mapping``: ZeRO stages 1 and 2, DeepSpeed's bf16 optimizer)."""
    return any(hasattr(p, "_hp_mapping") for p in model.parameters())


def _stage(model: nn.Module, ds_opt: Any) -> int:
    """The ZeRO stage: 3 when the parameters are partitioned (``ds_id``), 2 when DeepSpeed's
    optimizer partitions the gradients, else 1 (0 for a DeepSpeed optimizer that is no ZeRO one)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return 3
    if not hasattr(ds_opt, "partition_gradients"):
        return 0
    return 2 if ds_opt.partition_gradients else 1


def resolve(model: Any, optimizer: Any) -> tuple[Any, Any, "ZeroView | None"]:
    """``(model, torch optimizer or None, ZeroView or None)`` for ``Lens(model, ...,
    optimizer=optimizer)``; unchanged arguments and None when DeepSpeed is not involved.

    ``model``: the engine (its ``module`` is watched; without ``optimizer`` the engine's
    optimizer drives the windows) or the model itself. ``optimizer``: DeepSpeed's optimizer,
    the engine, or the torch optimizer DeepSpeed was given (Accelerate's wrapper is unwrapped
    before, by :func:`gradlens.lens.optimizers.unwrap_optimizer`).
    """
    ds_opt = engine = None
    if is_engine(model):
        engine, model = model, model.module
        if optimizer is None:
            optimizer = engine.optimizer
            if not _is_ds_optimizer(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(
                    f"Lens(engine): the DeepSpeed engine's optimizer is {type(optimizer).__name__}, which "
                    "gradlens cannot hook; build the engine with an optimizer "
                    "(deepspeed.initialize(model=model, optimizer=torch.optim.SGD(...), config=...))"
                )
    if is_engine(optimizer):
        optimizer = optimizer.optimizer
    if _is_ds_optimizer(optimizer):
        ds_opt, optimizer = optimizer, optimizer.optimizer
    elif engine is not None and _is_ds_optimizer(engine.optimizer) and optimizer is engine.optimizer.optimizer:
        ds_opt = engine.optimizer  # Lens(engine, ..., optimizer=the torch optimizer DeepSpeed was given)
    if not isinstance(model, nn.Module):
        return model, optimizer, None
    linked = linked_optimizer(model)
    if ds_opt is None and linked is not None and optimizer is not None:
        if optimizer is not linked.optimizer:
            raise ValueError(
                f"Lens(optimizer=...): {type(optimizer).__name__} is not the optimizer DeepSpeed updates "
                f"this model with (its ZeRO optimizer holds a {type(linked.optimizer).__name__}); pass "
                "the engine's: Lens(engine, ...) or Lens(engine.module, ..., optimizer=engine.optimizer)"
            )
        ds_opt = linked
    if ds_opt is None and linked is None and optimizer is not None and _fragments_linked(model):
        raise ValueError(
            f"Lens(optimizer=...): this model is trained by DeepSpeed (ZeRO stage 1 or 2), whose "
            f"{type(optimizer).__name__} steps DeepSpeed's flat partitions, copied into the model only "
            "after that step (so the update would read as 0); pass the engine or DeepSpeed's optimizer "
            "instead: Lens(engine, ...) or Lens(engine.module, ..., optimizer=engine.optimizer)"
        )
    if ds_opt is not None and linked is not None and ds_opt is not linked:
        raise ValueError(
            "Lens(optimizer=...): this DeepSpeed optimizer does not update the model given; pass "
            "the engine's own: Lens(engine, ...) or Lens(engine.module, ..., optimizer=engine.optimizer)"
        )
    ds_opt = ds_opt if ds_opt is not None else linked
    if ds_opt is None:
        return model, optimizer, None
    return model, optimizer, ZeroView(model, ds_opt)


class _StepHook:
    """The wrapper of DeepSpeed's optimizer's ``step`` (an instance attribute); ``remove()``
    restores what was there if the wrapper is still in place, and makes it a plain call
    otherwise (another wrapper was installed over it)."""

    def __init__(self, owner: Any, before: Callable[[], None], after: Callable[[bool], None]):
        self.owner, self.active = owner, True
        self.previous = vars(owner).get("step")  # an instance attribute already there, or None
        inner = owner.step
        hook = self

        def step(*args, **kwargs):
            if not hook.active:
                return inner(*args, **kwargs)
            before()
            out = inner(*args, **kwargs)
            after(not bool(getattr(owner, "overflow", False)))  # DeepSpeed skipped the update on inf/nan
            return out

        self.wrapper = step
        owner.step = step

    def remove(self) -> None:
        self.active = False
        if vars(self.owner).get("step") is self.wrapper:
            if self.previous is None:
                del self.owner.step
            else:
                self.owner.step = self.previous


class ZeroView:
    """A model under DeepSpeed ZeRO for one Lens: DeepSpeed's optimizer (``ds_optimizer``), the
    torch optimizer inside it, the ``stage``; gathers stage 3's parameter values where
    instruments read them. Same surface as :class:`gradlens.distributed.fsdp.ShardedView` where
    the Lens reads it."""

    def __init__(self, model: nn.Module, ds_optimizer: Any):
        self.model = model
        self.ds_optimizer = ds_optimizer
        self.stage = _stage(model, ds_optimizer)
        #: stage 3: a parameter's data is an empty partition outside its module's forward (the
        #: Meter measures every use in backward, reading sizes from the model's shapes)
        self.partitioned = self.stage == 3

    @property
    def name(self) -> str:
        return f"DeepSpeed ZeRO stage {self.stage}"

    def __repr__(self) -> str:
        return f"ZeroView({self.name}, {type(self.ds_optimizer).__name__})"

    # ------------------------------------------------------------------ checks
    def check_instruments(self, instruments: Sequence[Any]) -> None:
        """Refuse the instruments this stage cannot serve, all at once, naming the stage."""
        bad = []
        for inst in instruments:
            if "graph_grad" in inst.needs:
                bad.append((type(inst).__name__,
                            "it needs each micro-step's gradient with its autograd graph, and engine.backward "
                            "has no create_graph; its Hessian-vector products would also run DeepSpeed's "
                            "gradient hooks, which reduce every gradient into DeepSpeed's partitions"))
            elif self.stage == 3 and (why := inst.sharded_refusal()) is not None:
                bad.append((type(inst).__name__, why + ", where ZeRO-3 holds only this rank's partition"))
        if bad:
            names = ", ".join(n for n, _ in bad)
            why = "; ".join(f"{n}: {w}" for n, w in bad)
            raise ValueError(
                f"instruments {names} are not supported under {self.name} ({why}); drop them from the "
                "Lens's instruments (the norm, histogram, noise, cross-sample and update instruments "
                "work under every ZeRO stage: see docs/distributed.md, 'DeepSpeed'), or measure them "
                "in a run without DeepSpeed"
            )

    # ------------------------------------------------------------------ the Lens' view of the parameters
    def unsharded(self, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """The parameters to track: the model's own (ZeRO-3 swaps their data, not the objects)."""
        return params

    def presented(self):
        """Nothing to swap while the Tap is built or installed."""
        return contextlib.nullcontext()

    def _full(self, params: dict[str, nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full values ``[*param]``) one parameter at a time: stage 3 gathers each
        (``deepspeed.zero.GatheredParameters``, a collective: every rank, same order) and
        partitions it again when the consumer asks for the next; the consumer copies what it
        keeps. Stages 1 and 2: the parameters themselves (every rank holds them whole)."""
        if self.stage != 3:
            for q, p in params.items():
                yield q, p.detach()
            return
        import deepspeed  # the model is DeepSpeed's: it is imported already

        gathered = deepspeed.zero.GatheredParameters
        for q, p in params.items():
            if not hasattr(p, "ds_id"):
                yield q, p.detach()
                continue
            with gathered([p], modifier_rank=None):
                yield q, p.detach()

    def full_values(self, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """Name -> full values of every parameter in ``params`` (stage 3: gathered copies, D
        numbers; stages 1 and 2: the parameters, no copy). A collective under stage 3."""
        if self.stage != 3:
            return dict(self._full(params))
        return {q: v.clone() for q, v in self._full(params)}

    def bin_values(self, instruments: Sequence[Any], states: dict[int, Any], params: dict[str, nn.Parameter]) -> None:
        """When a tracked window opens (every rank), stage 3: each exact ``GradHist2d`` bins the
        full values of each tracked parameter, gathered one at a time and released after binning
        (the bins, D int32, are what it keeps on one process too). Stages 1 and 2 bin the
        parameters themselves at their first use, as on one process."""
        hists = [i for i in instruments if i.bins_param_values]
        if self.stage != 3 or not hists:
            return
        for q, values in self._full(params):
            for inst in hists:
                inst.bin_param(states[id(inst)], q, values)

    def present_values(self, instruments: Sequence[Any], states: dict[int, Any],
                       params: dict[str, nn.Parameter]) -> None:
        """Right before and right after DeepSpeed's step (every rank): the instruments that read
        the parameters' values around the update (``Alpha``, ``UpdateSize``, ``Distance``) get
        them as DeepSpeed holds them (stage 3: gathered copies, once for all of them; nothing
        gathered without such an instrument)."""
        readers = [i for i in instruments if i.reads_update_values and id(i) in states]
        if not readers:
            return
        full = self.full_values(params)
        for inst in readers:
            inst.present_values(states[id(inst)], full)

    # ------------------------------------------------------------------ the update
    def step_hooks(self, before: Callable[[], None], after: Callable[[bool], None]) -> list:
        """Wrap DeepSpeed's optimizer's ``step``: ``before()`` right before it, ``after(updated)``
        right after it (``updated`` False when DeepSpeed skipped the update). Returns the
        removable handle (in a list, as the Lens keeps its hooks)."""
        return [_StepHook(self.ds_optimizer, before, after)]
