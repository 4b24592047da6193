"""The instrument protocol and the window's shared, mergeable statistics.

An instrument declares which per-micro-step quantities it needs (``needs``), keeps an optional
private window state (histogram counts, ...), and turns the merged window statistics into one
record value in ``finalize``. Instruments never talk to each other: derived statistics (norm
test, GSNR, noise scale) read the shared :class:`WindowStats`.

Quantities a capture can provide (all in per-sample units g_n, see docs/design.md):

- ``"batch_l2"``: ||g_n||^2 summed over tracked parameters, ``[B_k]`` per micro-step.
- ``"sum_grad_squared"``: sum_n g_n * g_n per parameter, ``[*param]``.
- ``"grad_sum"``: sum_n g_n per parameter, ``[*param]``.
- ``"per_sample"``: materialised g_n, one layer and a slice of samples at a time, passed to
  :meth:`Instrument.update`.
- ``"layer"``: the layer's input and per-sample-scaled output gradient, passed to
  :meth:`Instrument.update_layer` (for factor-based cross-micro-step quantities).
- ``"micro_grad_sq"``: ||s_k||^2 of each micro-step's gradient sum s_k = sum_{n in k} g_n, from
  hooks on the tracked parameters (no per-sample kernel), summed into
  :attr:`WindowStats.micro_grad_sq` with sum_k B_k^2 in :attr:`WindowStats.micro_size_sq`.
- ``"sample_origin"``: under ``torch.distributed``, each rank's micro-step sizes travel with
  ``batch_l2``, so that the merged :attr:`WindowStats.batch_l2` keeps one ``[B_k]`` vector per
  micro-step (:class:`~gradlens.instruments.origin.SampleOrigin`).
- ``"graph_grad"``: each micro-step's gradient with its autograd graph (the micro-step's
  backward ran with ``create_graph=lens.create_graph``), times its per-sample scale, summed
  over the window (:class:`gradlens.instruments.curvature.WindowGraph`, bound to the
  instrument's state by ``bind_graph``); for Hessian-vector products of the window objective.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Mapping

from torch import Tensor

from gradlens.core.state_checks import check_state
from gradlens.core.stats import LIGHT_QUANTITIES, QUANTITIES, Accumulators, DistParts, WindowStats

__all__ = ["Accumulators", "DistParts", "Instrument", "WindowStats", "QUANTITIES", "LIGHT_QUANTITIES", "check_instrument"]


class Instrument:
    """Base class. Subclasses set ``key`` (the record key) and ``needs``.

    Life of a window: ``start_window()`` -> state; for instruments that need ``"per_sample"``,
    ``update(state, name, param, grad_batch)`` for each tracked parameter and slice of samples
    (``grad_batch``: ``[b, *param]``, per-sample units); ``merge(a, b)`` combines two states of
    the same window (micro-steps or ranks); ``finalize(stats, state)`` gives the record value;
    ``end_window(state)`` lets an instrument adapt for the next window (histogram ranges).

    What an instrument needs is declared in the attributes below (checked once, when a Lens is
    built, by :func:`check_instrument`). ``key`` and ``gram_in_backward`` are fixed per class;
    the others have a class default that an instance may refine from its arguments (in
    ``__init__``, or as a property: a sketch-mode test also needs ``"grad_sum"``).
    """

    #: the record key this instrument writes, ``record[key]`` (unique within a Lens)
    key: ClassVar[str] = ""
    #: the quantities of :data:`QUANTITIES` it reads (per-sample units; see the module docstring)
    needs: frozenset[str] = frozenset()
    #: ``None``, or the fraction of entries drawn: the Lens then calls :meth:`update_sampled`
    #: with entries computed from the layer's factors instead of materialising ``[b, *param]``
    sample: float | None = None
    #: :meth:`update_layer` takes ``delta`` as autograd delivered it with its per-sample
    #: ``scale=`` (no ``delta * scale`` copy); only for ``"layer"`` in ``needs``
    carries_scale: bool = False
    #: :meth:`update_layer` fills a fused Linear call's dL/dW from its own pass
    #: (``weight_grad=``); only for ``"layer"`` in ``needs``
    fills_weight_grad: bool = False
    #: :meth:`update_layer` forms the micro-step's Gram in backward (BatchDot)
    gram_in_backward: ClassVar[bool] = False
    #: the value decomposes over parameters: under ``Lens(groups=...)`` the Lens calls
    #: :meth:`finalize_group` once per group for ``record.groups[group][key]``
    per_group: bool = False
    #: it bins the tracked parameters' values once per window (:meth:`bin_param`, GradHist2d):
    #: on a sharded model (FSDP2, DeepSpeed ZeRO-3) the Lens gives it the gathered full values
    #: when a window opens
    bins_param_values: ClassVar[bool] = False
    #: it reads the parameters' values around the real update (:meth:`present_values`: Alpha,
    #: UpdateSize, Distance): on a sharded model the Lens gives it the gathered full values there
    reads_update_values: ClassVar[bool] = False
    #: it compares the gradient the optimizer steps with (``p.grad``) to the window's
    #: (:class:`~gradlens.instruments.accumulation.AccumulationCheck`): the Lens then calls its
    #: ``grads_before_backward(state, micro)`` before each captured backward,
    #: ``grads_abort()`` when the capture ends (normally or not),
    #: ``grads_after_backward(state, micro, scaler)`` once the micro-step folded (``scaler``: the
    #: Lens's GradScaler or None), ``grads_written(state)`` when a
    #: :class:`~gradlens.GradientAccumulateOptimizer` has written its window gradient, and
    #: ``grads_before_update(state, stats, scaler)`` with the merged window right before the update
    reads_optimizer_grads: ClassVar[bool] = False

    def sharded_refusal(self) -> str | None:
        """Why this instrument cannot measure a model sharded with FSDP2 (``fully_shard``): it
        reads parameter values where FSDP2 holds only shards; None (default) if it can."""
        return None

    def bin_param(self, state: Any, name: str, values: Tensor) -> None:
        """Bin parameter ``name``'s full values ``[*param]`` for this window (only where
        :attr:`bins_param_values`)."""
        raise NotImplementedError(f"{type(self).__name__} declares bins_param_values but has no bin_param")

    def present_values(self, state: Any, values: Mapping[str, Tensor]) -> None:
        """Read the parameters' values from ``values`` (name -> full tensor) instead of the
        parameters themselves, around the real update (only where :attr:`reads_update_values`)."""
        raise NotImplementedError(f"{type(self).__name__} declares reads_update_values but has no present_values")

    def start_window(self) -> Any:
        return None

    def start_micro(self, window_state: Any) -> Any:
        """State of one micro-step of the window whose state is ``window_state`` (merged into it
        when the micro-step ends); per-window caches shared by micro-steps live in the window
        state, never on the instrument. Default: a fresh :meth:`start_window`."""
        return self.start_window()

    def update(self, state: Any, name: str, param: Tensor, grad_batch: Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not take per-sample gradients")

    def merge(self, a: Any, b: Any) -> Any:
        return a

    def finalize(self, stats: WindowStats, state: Any) -> Any:
        raise NotImplementedError

    def end_window(self, state: Any) -> None:
        return None

    # ---- per parameter group (Lens(groups=...)) -------------------------------------------
    def bind_groups(self, group_of: dict[str, str]) -> None:
        """Called by the Lens when a tracked window opens (before :meth:`start_window`) with
        tracked parameter -> its group (empty without groups): an instrument whose window
        state must keep per-group parts (histogram counts) reads it in :meth:`update`."""
        return None

    def group_state(self, state: Any, names: tuple[str, ...]) -> Any:
        """The part of the window ``state`` that belongs to the parameters ``names`` (one
        group), as a state :meth:`finalize` reads. Default: stateless instruments (``None``),
        whose value comes from :class:`WindowStats` alone; an instrument with a state and
        ``per_group`` overrides this (or :meth:`finalize_group`)."""
        if state is None:
            return None
        raise NotImplementedError(
            f"{type(self).__name__}.per_group is True but it keeps a window state and does not "
            "define group_state(state, names); define it, or set per_group = False"
        )

    def finalize_group(self, stats: WindowStats, state: Any, names: tuple[str, ...]) -> Any:
        """``record.groups[group][key]``: the value over the parameters ``names`` of one group.
        ``stats`` is the merged window seen through the group (:meth:`WindowStats.restrict`:
        its ``batch_l2`` and per-parameter sums are the group's), ``state`` the merged window
        state (all parameters, all ranks). Default: :meth:`finalize` of the group's state."""
        return self.finalize(stats, self.group_state(state, names))

    def update_outer(self, state: Any, name: str, param: Tensor, delta: Tensor, a: Tensor) -> bool:
        """Optional fast path for rank-one per-sample gradients g_n = delta_n a_n^T (Linear
        weights without a sequence axis; ``delta [B, O]``, ``a [B, I]``, finite). Return True
        if handled; False (the default) makes the Lens materialise ``[b, O, I]`` slices and
        call :meth:`update` instead."""
        return False

    def update_sampled(self, state: Any, name: str, param: Tensor, entries, batch: int) -> None:
        """For ``sample`` set: ``entries(j)`` returns ``[batch, m]``, the entries g_n[j] of this
        use's per-sample gradients at the flat indices ``j [m]`` into ``param``, computed from
        the layer's factors."""
        raise NotImplementedError(f"{type(self).__name__} does not sample")

    def update_zeros(self, state: Any, name: str, param: Tensor, count: int) -> None:
        """A tracked parameter that this micro-step's backward never reached (a layer the
        forward skipped): its per-sample gradients are ``count`` samples of exact zeros. Only
        instruments that count elements need this (sums and norms are unchanged by zeros)."""
        return None

    # ---- optional extension points (used by instruments that need more than the above) ----
    def update_layer(self, state: Any, module: Any, a: Tensor, delta: Tensor, weight_grad: Any = None,
                     scale: float | Tensor | None = None) -> None:
        """For ``"layer" in needs``: called once per use of tracked parameters with a closed-form
        kernel per micro-step, with the use's input ``a`` ``[B, ...]`` and output gradient
        ``delta`` ``[B, ...]`` in per-sample units (``module`` is a
        :class:`gradlens.capture.events.Site`: ``.name``, ``.module``, ``.kernel``, ``.params``).
        ``weight_grad``: ``(WeightGrad, per-sample scale)`` of a fused Linear call still without
        its dL/dW, passed only where :attr:`fills_weight_grad`. ``scale``: passed only where
        :attr:`carries_scale`; ``delta`` is then unscaled and ``delta * scale`` its per-sample
        units."""
        raise NotImplementedError(f"{type(self).__name__} does not take layer factors")

    def micro_done(self, state: Any, batch_size: int, reduction: str, losses: Tensor | None) -> None:
        """Called at the end of each captured micro-step, before its state is merged."""
        return None

    def attach(self, params: Callable[[], Mapping[str, Tensor]], optimizer: Any) -> None:
        """Called once by the :class:`~gradlens.Lens` when it is built, before its first window:
        ``params()`` returns the tracked parameters as they are now (qualified name ->
        parameter; the set may change between windows when layers are frozen or unfrozen; on a
        sharded model, FSDP2 or DeepSpeed ZeRO-3, their gathered full values: a collective, so
        call it only where every rank does, as the Lens' own calls are), ``optimizer`` is the
        Lens' optimizer (None without one; under DeepSpeed the torch optimizer inside
        DeepSpeed's). For instruments that read the parameters themselves (Distance's theta_0) or
        the optimizer's settings (CABS' learning rate); raise ``ValueError`` here to refuse an
        optimizer. Default: nothing."""
        return None

    def before_update(self, state: Any) -> None:
        """Window state, right before the watched optimizer's real update (params at theta_t)."""
        return None

    def after_update(self, state: Any) -> None:
        """Window state, right after the real update (params at theta_{t+1}), before finalize."""
        return None

    def extra(self, state: Any) -> dict[str, Any]:
        """Record values beside ``record[key]`` (e.g. ``{"hess_trace_stderr": ...}``), read
        after finalize."""
        return {}

    def meta(self, state: Any) -> dict[str, Any]:
        """Entries for ``record.meta`` (e.g. ``{"batch_dot": "exact"}``), read after finalize."""
        return {}

    def defers(self, state: Any) -> bool:
        """True if this window's record needs the next window (e.g. Alpha's end point): the Lens
        then keeps the record pending and calls :meth:`settle` when the next window closes."""
        return False

    def settle(self, record: Any, state: Any, next_state: Any, reason: str | None) -> None:
        """Complete a pending ``record`` (written by this instrument's window ``state``) from
        ``next_state``, the state of the window that followed it, or, if that window was not
        captured (``next_state is None``), record why the value is missing (``reason``)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # ---- across ranks (gradlens.distributed.merge) -------------------------------------------
    def to_buffers(self, state: Any, ctx: Any) -> Any:
        """What this window ``state`` sends when ranks merge (a
        :class:`gradlens.core.stats.DistParts`: sums, per-rank values, pieces to gather).
        Stateless instruments send nothing; an instrument with a state must override this."""
        if state is None:
            return DistParts()
        raise NotImplementedError(
            f"{type(self).__name__} keeps a window state but does not say how to merge it across "
            "ranks (to_buffers/from_buffers); use it without torch.distributed or with "
            "Lens(..., process_group=False)"
        )

    def from_buffers(self, state: Any, ctx: Any, sums, per_rank, pieces) -> Any:
        """The state of all ranks from the merged buffers of :meth:`to_buffers`: ``sums``
        (added), ``per_rank`` (``[R, ...]``), ``pieces`` (per piece, one tensor per rank)."""
        return state

    # ---- checkpoints (gradlens.lens.state) --------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What this instrument keeps BETWEEN windows (the window state itself is saved by the
        Lens), as plain data that ``torch.load(weights_only=True)`` reads: tensors, and dicts /
        lists / str / int / float / bool / None. Default: ``{}`` (nothing kept). An instrument
        whose attributes change after ``__init__`` (an adaptive range, a random stream, a
        moving average) overrides this and :meth:`load_state_dict`."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. Checks every key and value first
        (:func:`gradlens.core.state_checks.check_state`): a state of another instrument or with other
        settings raises :class:`gradlens.core.state_checks.StateDictError` (a ``ValueError``) naming this
        instrument and the key."""
        check_state(self, state)

    def parameter_tensors(self, state: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
        """The parts of a :meth:`state_dict` shaped like the tracked parameters: key ->
        {qualified name -> ``[*param]``} (the Lens checks their names and shapes against the
        model before :meth:`load_state_dict`). Default: none."""
        return {}


#: what an instrument that sets ``reads_optimizer_grads`` defines (the Lens calls them)
OPTIMIZER_GRADS_METHODS = ("grads_before_backward", "grads_after_backward", "grads_written", "grads_before_update",
                           "grads_abort")


def _defines(cls: type, name: str) -> bool:
    if not hasattr(Instrument, name):
        return callable(getattr(cls, name, None))
    return getattr(cls, name) is not getattr(Instrument, name)


def check_instrument(inst: Any) -> None:
    """Check what ``inst`` declares (:attr:`Instrument.key`, ``needs``, ``sample``,
    ``carries_scale``, ``fills_weight_grad``, ``gram_in_backward``) against
    :data:`QUANTITIES` and the methods it defines; raises ``TypeError`` / ``ValueError`` naming
    the class, the attribute and the fix. The Lens calls it once per instrument when built."""
    cls = type(inst)
    name = cls.__name__
    if not isinstance(inst, Instrument):
        raise TypeError(
            f"instruments must be gradlens.instruments objects, got {inst!r}; subclass "
            "gradlens.instruments.base.Instrument (or pass an instance, e.g. BatchL2())"
        )
    if not isinstance(inst.key, str) or not inst.key:
        raise TypeError(
            f"{name}.key must be a non-empty str (the record key), got {inst.key!r}; set the "
            f"class attribute key = \"{name.lower()}\""
        )
    needs = inst.needs
    if not isinstance(needs, (frozenset, set)) or not all(isinstance(q, str) for q in needs):
        raise TypeError(
            f"{name}.needs must be a frozenset of quantity names, got {needs!r}; e.g. "
            "needs = frozenset({\"batch_l2\"})"
        )
    unknown = set(needs) - QUANTITIES
    if unknown:
        raise ValueError(
            f"{name}.needs names {sorted(unknown)}, which no capture provides; "
            f"the quantities are {sorted(QUANTITIES)}"
        )
    for flag in ("carries_scale", "fills_weight_grad", "gram_in_backward"):
        value = getattr(inst, flag)
        if not isinstance(value, bool):
            raise TypeError(
                f"{name}.{flag} must be True or False, got {value!r}; set the class attribute "
                f"(or a property returning a bool)"
            )
        if value and "layer" not in needs:
            raise ValueError(
                f"{name}.{flag} is True but \"layer\" is not in {name}.needs ({sorted(needs)}); "
                f"only update_layer uses it: add \"layer\" to needs or set {flag} = False"
            )
    if not isinstance(inst.per_group, bool):
        raise TypeError(
            f"{name}.per_group must be True or False, got {inst.per_group!r}; set the class "
            "attribute (or a property returning a bool)"
        )
    sample = inst.sample
    if sample is not None and (isinstance(sample, bool) or not isinstance(sample, (int, float))
                               or not 0 < sample < 1):
        raise ValueError(
            f"{name}.sample must be None (exact) or the fraction of entries drawn, 0 < sample < 1, "
            f"got {sample!r}; e.g. sample=0.01"
        )
    wanted = []
    if "layer" in needs:
        wanted.append(("update_layer", "\"layer\""))
    if "per_sample" in needs:
        wanted.append(("update" if sample is None else "update_sampled",
                       "\"per_sample\"" + ("" if sample is None else f" with sample={sample}")))
    if inst.bins_param_values:
        wanted.append(("bin_param", "bins_param_values = True"))
    if inst.reads_update_values:
        wanted.append(("present_values", "reads_update_values = True"))
    if inst.reads_optimizer_grads:
        wanted += [(m, "reads_optimizer_grads = True") for m in OPTIMIZER_GRADS_METHODS]
    for method, why in wanted:
        if not _defines(cls, method):
            raise TypeError(
                f"{name} declares {why} but does not define {method}; define it, or drop that "
                "declaration" if method in ("bin_param", "present_values", *OPTIMIZER_GRADS_METHODS) else
                f"{name}.needs has {why} but {name} does not define {method}; define it, or "
                "drop that quantity from needs"
            )
