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
- ``"graph_grad"``: each micro-step's gradient with its autograd graph (the micro-step's
  backward ran with ``create_graph=lens.create_graph``), times its per-sample scale, summed
  over the window (:class:`gradlens.instruments.curvature.WindowGraph`, bound to the
  instrument's state by ``bind_graph``); for Hessian-vector products of the window objective.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import Tensor

from gradlens.compat import storage_use_count
from gradlens.core.state_checks import check_state

__all__ = ["Accumulators", "DistParts", "Instrument", "WindowStats", "QUANTITIES", "LIGHT_QUANTITIES", "check_instrument"]

QUANTITIES = frozenset(
    {"batch_l2", "sum_grad_squared", "grad_sum", "per_sample", "layer", "micro_grad_sq", "graph_grad"}
)
#: what parameter hooks alone provide (no per-sample capture): a Lens whose instruments need
#: nothing else runs in light mode (:class:`gradlens.capture.ParamTap`), on any model
LIGHT_QUANTITIES = frozenset({"grad_sum", "micro_grad_sq", "graph_grad"})

#: parameters up to this many elements share one concatenated dot in the window's ||sum g_n||^2
_SMALL_NUMEL = 1 << 16


@dataclass
class DistParts:
    """What one participant of a merge across ranks (:mod:`gradlens.distributed.merge`) (the window's shared sums, or one instrument state) sends.

    Attributes:
        sums: tensors added across ranks (same shapes on every rank).
        per_rank: small tensors every rank sees from every rank (same shapes on every rank);
            returned as ``[R, *shape]``.
        pieces: tensors gathered from every rank (any shape, at most 6 dims; the same number of
            pieces on every rank); returned as one list per piece of R tensors (rank order).
    """

    sums: list[Tensor] = field(default_factory=list)
    per_rank: list[Tensor] = field(default_factory=list)
    pieces: list[Tensor] = field(default_factory=list)



_STORAGE_BASE = storage_use_count(torch.empty(1))


def _unshared(buf: Tensor) -> bool:
    """True if only the pool refers to ``buf``: no other Python reference to the object (the
    pool, the caller's variable and getrefcount's argument make 3) and no other tensor on its
    memory."""
    users = storage_use_count(buf)
    return sys.getrefcount(buf) <= 4 and users is not None and users <= _STORAGE_BASE


class Accumulators(dict):
    """A dict parameter name -> running sum whose large first values may be written into a
    buffer kept from an earlier window (``pool``), so that a step does not fault in fresh
    memory for them. A buffer is reused only when nothing but the pool refers to it any more
    (a record that still holds the previous window's sum keeps its own tensor)."""

    def __init__(self, pool: dict | None = None):
        super().__init__()
        self.pool = pool

    def buffer(self, key: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        if self.pool is None:
            return None
        buf = self.pool.get(key)
        free = buf is not None and _unshared(buf)
        if not (free and buf.shape == shape and buf.dtype == like.dtype and buf.device == like.device):
            buf = self.pool[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf

    def scratch(self, tag: str, like: Tensor) -> Tensor | None:
        """A reusable buffer shaped like ``like`` for a temporary that dies within one kernel
        call (e.g. the squared layer input); None without a pool."""
        if self.pool is None:
            return None
        key = ("scratch", tag, tuple(like.shape), like.dtype, like.device)
        buf = self.pool.get(key)
        if buf is None:
            buf = self.pool[key] = torch.empty_like(like, memory_format=torch.contiguous_format)
        return buf


@dataclass
class WindowStats:
    """Sums over one window (or part of one), mergeable across micro-steps and ranks.

    Attributes:
        reduction: the loss reduction of the window, ``"mean"`` or ``"sum"``.
        num_samples: N = sum_k B_k.
        micro_steps: K.
        loss_sum: sum_n loss_n (float64 0-d tensor) — the window mean loss is loss_sum / N.
        batch_l2: per micro-step ``[B_k]`` vectors of ||g_n||^2 (concatenate for ``[N]``).
        sum_grad_squared: parameter name -> ``[*param]``, sum_n g_n^2.
        grad_sum: parameter name -> ``[*param]``, sum_n g_n.
        loss_unknown: micro-steps (of every rank) whose loss gradlens could not read (a
            functional loss captured with ``multiplier=`` and no ``loss=``): the window's loss
            is then unknown, not nan.
    """

    reduction: str = "mean"
    num_samples: int = 0
    micro_steps: int = 0
    loss_sum: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    batch_l2: list[Tensor] = field(default_factory=list)
    sum_grad_squared: dict[str, Tensor] = field(default_factory=Accumulators)
    grad_sum: dict[str, Tensor] = field(default_factory=Accumulators)
    #: sum over micro-steps (and ranks) of ||s_k||^2, s_k = sum_{n in k} g_n (0-d float64; only
    #: filled when an instrument needs "micro_grad_sq", e.g. NoiseScaleTwoBatch)
    micro_grad_sq: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    #: sum over the micro-steps whose ||s_k||^2 is in ``micro_grad_sq`` of B_k^2
    micro_size_sq: float = 0.0
    #: ||sum_n g_n||^2 when it is known without ``grad_sum`` (the global gradient read from
    #: DDP's ``p.grad`` for instruments that need only this norm), else None
    grad_sum_sq: Tensor | None = None
    loss_unknown: int = 0
    #: per parameter group (``Lens(groups=...)``): group name -> per micro-step ``[B_k]``
    #: vectors of ||g_n||^2 over that group's parameters (like ``batch_l2``; groups add up to it)
    group_l2: dict[str, list[Tensor]] = field(default_factory=dict)

    def merge(self, other: "WindowStats") -> "WindowStats":
        """Combine two disjoint sets of samples (associative; order of samples kept a, b)."""
        if self.micro_steps and other.micro_steps and self.reduction != other.reduction:
            raise ValueError(
                f"cannot merge windows with loss reductions {self.reduction!r} and "
                f"{other.reduction!r}; use one reduction within a window"
            )
        return WindowStats(
            reduction=self.reduction if self.micro_steps else other.reduction,
            num_samples=self.num_samples + other.num_samples,
            micro_steps=self.micro_steps + other.micro_steps,
            loss_sum=self.loss_sum + other.loss_sum,
            batch_l2=self.batch_l2 + other.batch_l2,
            sum_grad_squared=_add_dicts(self.sum_grad_squared, other.sum_grad_squared),
            grad_sum=_add_dicts(self.grad_sum, other.grad_sum),
            micro_grad_sq=self.micro_grad_sq + other.micro_grad_sq,  # 0-d: no device sync
            micro_size_sq=self.micro_size_sq + other.micro_size_sq,
            loss_unknown=self.loss_unknown + other.loss_unknown,
            group_l2=_cat_groups(self, other),
        )

    def restrict(self, group: str, names) -> "WindowStats":
        """The window seen through one parameter group: the same samples, counts and loss, with
        ``batch_l2`` the group's ``[N]`` norms (:attr:`group_l2`) and the per-parameter sums of
        the parameters ``names`` only (a view: the tensors are shared, nothing is copied)."""
        keep = set(names)
        view = WindowStats(
            reduction=self.reduction,
            num_samples=self.num_samples,
            micro_steps=self.micro_steps,
            loss_sum=self.loss_sum,
            batch_l2=list(self.group_l2.get(group, [])),
            sum_grad_squared={q: v for q, v in self.sum_grad_squared.items() if q in keep},
            grad_sum={q: v for q, v in self.grad_sum.items() if q in keep},
            loss_unknown=self.loss_unknown,
        )
        # the layer instruments' memo of pure functions of their factors (per-layer Grams,
        # keyed by layer and tensors) is shared with the groups; the sums' memo is not
        view._gradlens_cross_memo = self.__dict__.setdefault("_gradlens_cross_memo", {})
        return view

    # ---- derived views, in per-sample units --------------------------------------------
    def batch_l2_all(self) -> Tensor:
        """``[N]`` ||g_n||^2 in the order the samples were seen."""
        return torch.cat(self.batch_l2) if self.batch_l2 else torch.zeros(0, dtype=torch.float64)

    def grad_sum_sq_norm(self) -> Tensor:
        """||sum_n g_n||^2 over the tracked parameters (0-d float64; computed once, in the
        accumulation dtype, float32 or wider)."""
        if self.grad_sum_sq is not None:
            return self.grad_sum_sq
        memo = self.__dict__.setdefault("_memo", {})
        if "grad_sum_sq" not in memo:
            # small tensors of one dtype share one dot (a concatenation bounded in size), the
            # others get their own: a few ops per window, not three per parameter
            small: dict[torch.dtype, list[Tensor]] = {}
            parts = [torch.zeros((), dtype=torch.float64)]

            def dot(group: list[Tensor]) -> None:
                flat = torch.cat(group) if len(group) > 1 else group[0]
                parts.append(torch.dot(flat, flat).double())

            for s in self.grad_sum.values():
                if s.numel() > _SMALL_NUMEL:
                    dot([s.reshape(-1)])
                    continue
                group = small.setdefault(s.dtype, [])
                group.append(s.reshape(-1))
                if len(group) >= 16:  # concatenations of at most 16 small tensors
                    dot(group)
                    small[s.dtype] = []
            for group in small.values():
                if group:
                    dot(group)
            memo["grad_sum_sq"] = torch.stack(parts).sum() if len(parts) > 1 else parts[0]
        return memo["grad_sum_sq"]

    def mean_grad_sq_norm(self) -> Tensor:
        """||G||^2 for the sample mean G = (1/N) sum_n g_n (0-d float64)."""
        return self.grad_sum_sq_norm() / max(self.num_samples, 1) ** 2

    def window_grad_sq_norm(self) -> Tensor:
        """||g||^2 of the window gradient: the mean G (reduction "mean") or sum_n g_n ("sum")."""
        if self.reduction == "sum":
            return self.grad_sum_sq_norm()
        return self.mean_grad_sq_norm()

    def window_loss(self) -> float:
        """The window's loss: mean over N samples ("mean") or sum ("sum")."""
        total = float(self.loss_sum)
        return total / max(self.num_samples, 1) if self.reduction == "mean" else total

    # ---- across ranks (gradlens.distributed.merge) ---------------------------------------------
    def to_buffers(self, ctx):
        """This rank's sums in a layout fixed by ``ctx`` (every tracked parameter, zeros where
        this rank has no entry, and a presence count), and ``batch_l2`` ``[N_r]`` to gather."""
        f64 = torch.float64
        sums = [
            torch.tensor([self.num_samples, self.micro_steps, int(self.micro_size_sq), self.loss_unknown],
                         dtype=torch.int64),
            self.loss_sum.double().reshape(()),
            self.micro_grad_sq.double().reshape(()),
        ]
        for quantity, acc in (("sum_grad_squared", self.sum_grad_squared), ("grad_sum", self.grad_sum)):
            if quantity not in ctx.needs:
                continue
            present = []
            for q, p in ctx.params.items():
                present.append(1.0 if q in acc else 0.0)
                sums.append(acc[q] if q in acc else p.new_zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32)))
            sums.append(torch.tensor(present, dtype=f64))
        pieces = [self.batch_l2_all().double()] if "batch_l2" in ctx.needs else []
        groups = getattr(ctx, "groups", ())
        if groups and "batch_l2" in ctx.needs:  # [G, N_r]: one more gathered piece
            n = sum(t.numel() for t in self.batch_l2)
            dev = self.batch_l2[0].device if self.batch_l2 else None
            rows = [torch.cat(self.group_l2[g]).double() if self.group_l2.get(g)
                    else torch.zeros(n, dtype=f64, device=dev) for g in groups]
            pieces.append(torch.stack(rows) if n else torch.zeros(len(groups), 0, dtype=f64))
        return DistParts(sums=sums, pieces=pieces)

    def from_buffers(self, ctx, sums, per_rank, pieces) -> "WindowStats":
        """The window of all ranks from :meth:`to_buffers`' merged buffers (rank-major)."""
        counts, loss_sum, micro_sq = sums[0], sums[1], sums[2]
        out = WindowStats(
            reduction=self.reduction,
            num_samples=int(round(float(counts[0]))),
            micro_steps=int(round(float(counts[1]))),
            loss_sum=loss_sum,
            micro_grad_sq=micro_sq,
            micro_size_sq=float(counts[2]),
            loss_unknown=int(round(float(counts[3]))),
            sum_grad_squared=Accumulators(getattr(self.sum_grad_squared, "pool", None)),
            grad_sum=Accumulators(getattr(self.grad_sum, "pool", None)),
        )
        i = 3
        for quantity, acc in (("sum_grad_squared", out.sum_grad_squared), ("grad_sum", out.grad_sum)):
            if quantity not in ctx.needs:
                continue
            values = sums[i : i + len(ctx.params)]
            present = sums[i + len(ctx.params)]
            i += len(ctx.params) + 1
            for (q, _), v, seen in zip(ctx.params.items(), values, present.tolist()):
                if seen > 0:
                    acc[q] = v
        if pieces:
            out.batch_l2 = [t for t in pieces[0] if t.numel()]
        if len(pieces) > 1:
            ranks = [t for t in pieces[1] if t.numel()]
            out.group_l2 = {g: [t[i] for t in ranks] for i, g in enumerate(ctx.groups)}
        return out


def _cat_groups(a: WindowStats, b: WindowStats) -> dict[str, list[Tensor]]:
    """``group_l2`` of two merged windows: per group, a's vectors then b's (a side that has
    samples but no entry for a group contributes zeros, so samples stay aligned)."""
    if not a.group_l2 and not b.group_l2:
        return {}
    out = {}
    for g in {**a.group_l2, **b.group_l2}:
        parts = []
        for side in (a, b):
            if g in side.group_l2:
                parts += side.group_l2[g]
            elif side.batch_l2:
                parts += [torch.zeros_like(t) for t in side.batch_l2]
        out[g] = parts
    return out


def _add_dicts(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict[str, Tensor]:
    out = Accumulators(getattr(a, "pool", None))
    out.update(a)
    for k, v in b.items():
        out[k] = out[k] + v if k in out else v
    return out


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
        :class:`gradlens.capture.Site`: ``.name``, ``.module``, ``.kernel``, ``.params``).
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
        parameter; the set may change between windows when layers are frozen or unfrozen),
        ``optimizer`` is the Lens' optimizer (None without one). For instruments that read the
        parameters themselves (Distance's theta_0) or the optimizer's settings (CABS' learning
        rate); raise ``ValueError`` here to refuse an optimizer. Default: nothing."""
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
        :class:`gradlens.distributed.merge.DistParts`: sums, per-rank values, pieces to gather).
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


def _defines(cls: type, name: str) -> bool:
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
    for method, why in wanted:
        if not _defines(cls, method):
            raise TypeError(
                f"{name}.needs has {why} but {name} does not define {method}; define it, or "
                "drop that quantity from needs"
            )
