"""Units of one micro-step: which losses were backpropagated, their reduction, batch size and
multiplier, and from them the per-sample scale that turns output gradients into g_n.

The units of docs/design.md ("Units"): with L the micro-step's backpropagated objective split by
sample, L = sum_n L_n, the per-sample gradient is g_n = B * dL_n / c for a mean objective and
dL_n / c for a sum, c being the known multiplier of the loss on its way to ``backward`` (1, a
GradScaler's scale, 1/K, ...): of the loss as the model returns it, so that a factor the model
applies inside its forward stays in the objective (gradlens/capture/composed.py).
:meth:`MicroStep.scale` is that factor, B / c or 1 / c.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradlens.capture.losses import LossCall, settle_rows, settle_samples
from gradlens.core.stats import WindowStats

__all__ = ["MicroStep", "loss_calls_for", "check_multiplier", "check_reduction", "settle_flattened"]


@dataclass
class MicroStep:
    """One captured micro-step: its units (loss calls, reduction, batch size B, multiplier c,
    the per-sample scale) and what its backward measured before it folds into the window.

    ``scale()`` is B / c under a mean objective and 1 / c under a sum (float, or a 0-d tensor
    when c was measured in backward); ``output gradient * scale()`` is in g_n units.
    """

    reduction: str | None  # None until resolved from the losses that backward reached
    batch_size: int | None
    stats: WindowStats
    states: dict[int, Any]
    loss_calls: list = field(default_factory=list)
    explicit: bool = False  # capture(reduction=...) stated the reduction
    loss_value: Tensor | None = None
    seen: set[str] = field(default_factory=set)
    batch_l2: Tensor | None = None
    group_l2: dict = field(default_factory=dict)  # group -> [B] part of batch_l2 (Lens(groups=...))
    #: the uses' ``[B]`` ||g_n||^2 parts (any float dtype), summed once into ``batch_l2`` at the fold
    l2_parts: list = field(default_factory=list)
    losses: Tensor | None = None
    #: shared parameters: qualified name -> [B, *param] per-sample gradients summed over uses
    shared: dict[str, Tensor] = field(default_factory=dict)
    #: shared Linear-like uses kept as factors until the micro-step ends: (site, a, delta)
    linear_uses: list = field(default_factory=list)
    #: routed expert uses kept as token factors until the micro-step ends (uses that are slices
    #: of one 3-D parameter, :func:`gradlens.capture.ops.routed_factors`): qualified name ->
    #: [(owner, expert, u, v, batch)]
    routed: dict = field(default_factory=dict)
    #: shared parameters' other uses, kept until the micro-step ends: qualified name ->
    #: [(site, attr, a, delta)] (summed slice by slice there: :func:`gradlens.measure.deferred.measure`)
    shared_uses: dict = field(default_factory=dict)
    #: small single uses kept to be measured together (:func:`gradlens.measure.deferred.stack`): stack
    #: key -> [(site, a, delta, split, via)], and their elements (carried to the window's end
    #: when the micro-step folds)
    stacked: dict = field(default_factory=dict)
    stacked_elements: int = 0
    #: small dL/dp of single-use layer calls (qualified name, gradient), added into the window's
    #: gradient sum at the micro-step's end (:meth:`gradlens.measure.meter.Meter.on_weight_grad`)
    grad_parts: list = field(default_factory=list)
    grad_sq: Tensor | None = None  # sum over tracked parameters of ||dL/dp||^2 ("micro_grad_sq")
    forwards: set[int] = field(default_factory=set)  # forward passes this backward reached
    backward_done: bool = False
    end_watched: bool = False  # a callback marks backward_done when this backward ends
    empty: bool = False
    factor: Any = None  # capture(multiplier=...): a known factor applied to the loss
    _multiplier: Any = None
    _resolved: bool = False
    _scale: Any = None

    def add_l2(self, l2: Tensor, group: str | None = None) -> None:
        """A use's ``[B]`` ||g_n||^2 part (any float dtype): kept in :attr:`l2_parts` (summed
        once into :attr:`batch_l2` when the micro-step folds), and added to ``group``'s part
        (``Lens(groups=...)``)."""
        self.l2_parts.append(l2)
        if group is not None:
            self.add_group_l2(l2, group)

    def add_group_l2(self, l2: Tensor, group: str) -> None:
        """Add ``[B]`` ||g_n||^2 over some parameters of ``group`` into its part (float64)."""
        got = self.group_l2
        l2 = l2.double()
        got[group] = l2 if group not in got else got[group] + l2

    def resolve(self) -> None:
        """Once backward has passed the losses: which of the losses computed since the last
        capture were backpropagated, their reduction, batch size and common multiplier.

        A loss computed inside the model's forward is measured where the model returns it (its
        :class:`~gradlens.capture.composed.Root`: ``(ce_a + ce_b) / 2`` is the objective, its
        factor 1/2 is not divided out); one that reached backward through a returned value that
        is not linear in the losses, or through operations of the forward that lead to no
        returned value, is refused (:func:`_terms`).

        Several loss terms (``ce + 0.01 * mse``): a mean objective if any term is a mean; the
        largest multiplier among the terms is taken as the common one (1/K, a GradScaler scale)
        and divided out, the terms' relative weights being part of the objective; the loss value
        is the backpropagated objective over that multiplier. Order of the terms is irrelevant.
        """
        if self._resolved:
            return
        self._resolved = True
        active = [c for c in self.loss_calls if c.multiplier is not None]
        if self.explicit:
            m = None
            if active:
                m, self.loss_value = active[0].multiplier, active[0].value
            if self.factor is not None:  # the named loss = factor * the micro-step's objective
                m = self.factor if m is None else m * self.factor
                if self.loss_value is not None:
                    self.loss_value = self.loss_value / self.factor
            self._multiplier = m
            return
        if not active:
            names = [c.module_name for c in self.loss_calls]
            raise RuntimeError(
                f"none of the losses computed since the last capture ({names}) was "
                "backpropagated in this capture; compute the loss you backpropagate with an "
                "extended loss module, or state its reduction: lens.capture(reduction='mean', loss=loss)"
            )
        self.reduction = "mean" if any(c.reduction == "mean" for c in active) else "sum"
        sizes = {c.batch_size for c in active if c.batch_size is not None}
        if len(sizes) > 1:
            raise ValueError(
                f"the losses of this micro-step saw different batch sizes {sorted(sizes)}; "
                "gradlens needs one sample dimension per micro-step"
            )
        if sizes and self.batch_size is None:
            self.batch_size = sizes.pop()
        terms = _terms(active)
        if len(terms) == 1:
            self._multiplier, self.loss_value = terms[0]
            return
        mults = [m.reshape(()).double() for m, _ in terms]
        common = torch.stack(mults).max()
        total = sum(m * v.double() for m, (_, v) in zip(mults, terms))
        self._multiplier, self.loss_value = common, total / common

    @property
    def multiplier(self) -> float | Tensor | None:
        """c, what multiplied the micro-step's objective on its way to ``backward`` (measured:
        1/K, a GradScaler's scale; times a stated ``multiplier=``), once resolved; None for 1."""
        self.resolve()
        return self._multiplier

    def scale(self) -> float | Tensor:
        """Output gradients -> per-sample units: B / c under a mean loss, 1 / c under a sum,
        c being what multiplied the loss in backward (1, a GradScaler scale, 1/K, ...)."""
        if self._scale is None:
            self.resolve()
            base = float(self.batch_size) if self.reduction == "mean" else 1.0
            c = self._multiplier
            self._scale = base if c is None else base / c
        return self._scale


def _terms(active: list[LossCall]) -> list[tuple[Tensor, Tensor]]:
    """``[(multiplier, value)]``: the terms of the backpropagated objective, one per returned
    loss. A loss computed outside the model is its own term (what multiplied it on its way to
    backward, its value); one computed inside a tracked forward counts through the returned
    tensors computed from it that backward reached (their :class:`~gradlens.capture.composed.Root`:
    the factor after the model, the returned value), each once. Refused: a loss that backward
    reached through a returned value that is not linear in the losses (no per-sample split), or
    only through operations of the forward that lead to no returned value (a factor inside the
    model and one after it cannot be told apart there)."""
    terms: dict[int, tuple[Tensor, Tensor]] = {}
    for call in active:
        fired = [r for r in call.roots if r.multiplier is not None]
        bent = [r for r in fired if not r.linear]
        if bent:
            raise RuntimeError(
                f"the loss {call.module_name} computed inside the model's forward reaches the value the model "
                f"returns through {bent[0].what}, which is not a sum of the losses times constants: the "
                "per-sample split of that objective is undefined, so gradlens cannot give per-sample "
                "gradients in its units. Return a linear combination of the losses (e.g. "
                "(loss_a + loss_b) / 2, loss / c), or state the units yourself: "
                "with lens.capture(reduction='mean', loss=loss): loss.backward()"
            )
        if fired:
            for r in fired:
                terms[id(r)] = (r.multiplier, r.value)
        elif call.consumed:
            raise RuntimeError(
                f"the loss {call.module_name} computed inside the model's forward was backpropagated through "
                "operations the forward applied to it that lead to no value the model returns (or that "
                "gradlens did not see), so a factor applied inside the model (part of the objective) cannot "
                "be told apart from one applied after it (1/K, a GradScaler scale, divided out). Return the "
                "loss that is backpropagated from the model's forward, or state the units: "
                "with lens.capture(reduction='mean', loss=loss): loss.backward()"
            )
        else:
            terms[id(call)] = (call.multiplier, call.value)
    return list(terms.values())


def settle_flattened(calls: list[LossCall], batch: int | None, output_nodes: dict) -> None:
    """Losses on flattened rows (``loss_fn(logits.view(-1, V), labels.view(-1))`` with
    ``[B, T, V]`` logits): each covers the ``B`` samples of the model's input, the token-mean
    convention of docs/design.md ("Units": L_n = sample n's summed token losses over the
    micro-step's counted tokens, ``ignore_index`` targets counting for none, g_n = B dL_n).
    A flattening gradlens cannot map to the samples is refused here, naming the fix."""
    for call in calls:
        if call.rows is None:
            settle_samples(call, batch, output_nodes)
            continue
        settle_rows(call, batch, output_nodes)
        if batch is None or call.batch_size == batch:
            continue
        lead = "[" + ", ".join(str(r) for r in call.rows) + "]"
        why = (f"whose dim 0 ({call.rows[0]}) is not the micro-batch of {batch} samples of the model's input"
               if call.rows[0] != batch else
               f"and another of its dims has the micro-batch size {batch} too, so gradlens cannot tell which holds the samples")
        raise RuntimeError(
            f"{call.module_name} saw {math.prod(call.rows)} rows, a flattening of {lead} {why}. Flatten "
            "samples-first outputs ([B, T, V] logits: logits.reshape(-1, V), labels.reshape(-1)); for "
            "sequence-first outputs declare where the samples are, gradlens.extend(model, batch_dim=1), "
            "and flatten the model's output itself; or state the units and name the loss: "
            "with lens.capture(reduction='mean', loss=loss): loss.backward()"
        )


def check_reduction(window: WindowStats, reduction: str) -> None:
    """One reduction per window: ``reduction`` must be that of the window's earlier micro-steps."""
    if window.micro_steps and window.reduction != reduction:
        raise ValueError(
            f"this micro-step's loss uses reduction={reduction!r} but the window's earlier "
            f"micro-steps used {window.reduction!r}; use one reduction per window"
        )


def loss_calls_for(
    reduction: str | None, loss: Tensor | None, multiplier: Any, calls: list[LossCall]
) -> tuple[list[LossCall], str | None, str | None]:
    """The loss calls whose multipliers a capture watches, from ``capture()``'s arguments and the
    calls of extended losses since the last capture. Returns ``(calls, reduction, expected)``:
    ``reduction`` stays set only when the user's statement decides it; ``expected`` is the
    reduction known before backward (None when only backward can tell)."""
    if reduction is not None:
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        if loss is not None:  # the user names the loss: what multiplies it is divided out
            if not (isinstance(loss, Tensor) and loss.dim() == 0):
                raise TypeError(f"loss must be the 0-d loss tensor, got {type(loss).__name__}")
            named = LossCall(reduction=reduction, batch_size=None, output=loss, module_name="loss")
            for call in calls:  # the loss as a loss function computed it: its counted targets
                if call.output is loss and call.target is not None and reduction == call.reduction:
                    samples = call.rows[0] if call.rows else call.batch_size
                    y, ignore = call.target
                    if samples and y.numel() > samples:
                        named.counted = (y != ignore).sum()
            calls = [named]
        elif multiplier is not None:  # a known factor already applied to the loss
            calls = []
        elif calls:  # a loss computed inside the model (or an extended one): it knows more
            reduction = None
        else:
            raise ValueError(
                f"lens.capture(reduction={reduction!r}) needs the loss tensor too, so that "
                "whatever multiplies it before backward (a 1/K, a constant, a GradScaler "
                f"scale) is divided out instead of changing the units: "
                f"lens.capture(reduction={reduction!r}, loss=loss) with loss the unscaled loss"
            )
    elif not calls:
        raise RuntimeError(
            "no loss passed through gradlens.extend() ran since the last capture; "
            "wrap the loss module (loss_fn = gradlens.extend(torch.nn.CrossEntropyLoss())) "
            "or state the reduction: lens.capture(reduction='mean')"
        )
    expected = reduction
    if expected is None and len({c.reduction for c in calls}) == 1:
        expected = calls[0].reduction  # known before backward in the usual one-loss case
    return calls, reduction, expected


def check_multiplier(reduction, multiplier, loss) -> float | Tensor | None:
    """Checks capture()'s multiplier= and loss= arguments; returns the multiplier (detached)."""
    if multiplier is None and loss is None:
        return None
    if reduction is None:
        raise ValueError(
            "lens.capture(multiplier=..., loss=...) go with a stated reduction "
            "(lens.capture(reduction='mean', ...)); with a loss module passed through "
            "gradlens.extend() the multiplier is measured by itself: drop them"
        )
    if multiplier is not None:
        if isinstance(multiplier, Tensor):
            if multiplier.dim() != 0 or not multiplier.is_floating_point():
                raise ValueError(
                    "lens.capture(multiplier=...) must be a positive number or a 0-d float tensor, "
                    f"got a {multiplier.dtype} tensor of shape {tuple(multiplier.shape)}"
                )
            multiplier = multiplier.detach()
        elif isinstance(multiplier, bool) or not isinstance(multiplier, (int, float)) or not (
            0 < multiplier < float("inf")
        ):
            raise ValueError(
                f"lens.capture(multiplier=...) must be a positive finite number (e.g. 1 / K), got "
                f"{multiplier!r}"
            )
    if loss is not None:
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__
            raise ValueError(
                f"lens.capture(loss=...) must be the 0-d loss tensor that is backpropagated, got {what}"
            )
        if not loss.requires_grad:
            raise ValueError(
                "lens.capture(loss=...) does not require grad, so backward cannot pass through "
                "it; pass the loss before .detach()/.item()"
            )
    return multiplier
