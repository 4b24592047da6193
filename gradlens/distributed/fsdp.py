"""A Lens on a model sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Outside its forward and backward, a ``fully_shard``-ed module holds its parameters as sharded
``DTensor`` parameters (``model.named_parameters()`` returns these: full shape, this rank's
rows); during them FSDP2 swaps in *unsharded* parameters: plain ``nn.Parameter`` objects of the
full shape (in the ``MixedPrecisionPolicy``'s ``param_dtype``), one per parameter, created at
its module's first all-gather and kept for the module's lifetime (their storage is freed after
use and refilled at the next all-gather). Autograd accumulates each backward's ``dL/dp`` into
the unsharded parameter, and FSDP2 then reduce-scatters it into the sharded ``p.grad``.

So the per-sample pieces of a use (its input ``a``, its output gradient ``delta``) are what
they are under DDP: full-shaped, for this rank's own samples. :class:`ShardedView` gives the
Lens the unsharded parameters under the qualified names of ``model.named_parameters()``; the
Lens tracks them (hooks, per-sample sums in the full parameter shapes), and merges the ranks'
windows with the same one all_reduce (+ one all_gather) as under DDP (gradlens/distributed/merge.py).
Nothing is gathered beyond what FSDP2 gathers itself, except the parameter values below and
once, when a Lens is built before the model's first forward: it unshards each
``fully_shard``-ed module once, one after the other (the all-gather FSDP2's own first forward
makes), so that the unsharded parameters exist.

What does not apply: ``p.grad`` is a sharded, reduce-scattered DTensor, so the DDP route of the
global gradient sum (:class:`~gradlens.distributed.merge.DDPGradRoute`) never applies: ``grad_sum``
travels in the all_reduce. Instruments that read parameter values get the gathered full values:
``GradHist2d``'s parameter axis, binned once per tracked window (:meth:`ShardedView.bin_values`),
``Alpha``'s theta_t and theta_{t+1} (:meth:`ShardedView.present_values`); sampled ``GradHist2d``,
which reads sampled entries during backward, is refused (:func:`check_instruments`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import nn

from gradlens import compat

__all__ = ["ShardedView", "check_instruments", "unmanaged_dtensors", "check_fold", "check_monitor",
           "NOISE_UNDER_FSDP"]

def _is_dtensor(p: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(p, DTensor)


#: what measures the two-batch noise scale under FSDP2 (the refusals below suggest it)
NOISE_UNDER_FSDP = (
    "under FSDP2 use the Lens instrument: lens = Lens(model, [NoiseScaleTwoBatch()], optimizer=opt) "
    "(small batches = each rank's micro-batches, big batch = the window of all ranks)"
)


def check_fold(params: Sequence[Any]) -> None:
    """``GradientAccumulateOptimizer.step()`` on FSDP2-sharded parameters: refuse a micro-step
    whose backward left no gradient (one under ``set_requires_gradient_sync(False)``: FSDP2
    keeps it in its unsharded parameters until a synchronised backward, so the wrapper would
    fold several micro-steps as one, with one micro-step's weight). One check of the first
    parameter's type on other models."""
    first = next(iter(params), None)
    if first is None or not _is_dtensor(first) or any(p.grad is not None for p in params):
        return
    raise RuntimeError(
        "GradientAccumulateOptimizer.step(): no parameter has a gradient in this micro-step and "
        "the parameters are FSDP2 (fully_shard) shards: a backward under "
        "model.set_requires_gradient_sync(False) leaves its gradient inside FSDP2 until a "
        "synchronised backward, so this micro-step cannot be weighted by its own sample count. "
        "Keep gradient sync on for every micro-step (model.set_requires_gradient_sync(True), "
        "FSDP2's default): the wrapper accumulates the window itself"
    )


def check_monitor(params: Sequence[Any], who: str) -> None:
    """Refuse a gradient-reading noise monitor on FSDP2-sharded parameters (their ``p.grad``
    is a reduce-scattered shard, not the micro-step's gradient on this rank)."""
    if any(_is_dtensor(p) for p in params):
        raise TypeError(
            f"{who} reads each micro-step's p.grad, which FSDP2 (fully_shard) holds as a "
            f"reduce-scattered shard of the ranks' average; {NOISE_UNDER_FSDP}"
        )


def unmanaged_dtensors(model: nn.Module) -> list[str]:
    """Names of ``model``'s DTensor parameters that FSDP2 does not manage (tensor
    parallelism, a hand-made ``distribute_tensor``)."""
    managed = compat.fsdp_params(model)
    return [n for n, p in model.named_parameters() if _is_dtensor(p) and id(p) not in managed]


class ShardedView:
    """The unsharded parameters of a ``fully_shard``-ed model, for one Lens.

    Build it with :meth:`of` (None when nothing in the model is sharded).
    """

    #: the Lens' parameters (the unsharded ones) are full-shaped objects of their own: small uses
    #: may be stacked to the window's end (see :class:`gradlens.distributed.deepspeed.ZeroView`)
    partitioned = False

    def __init__(self, model: nn.Module):
        self.model = model

    @classmethod
    def of(cls, model: nn.Module) -> "ShardedView | None":
        return cls(model) if compat.fsdp_params(model) else None

    def _ensure_unsharded(self, fps: dict[int, Any]) -> None:
        """Unshard (then reshard) once each ``fully_shard``-ed module whose unsharded
        parameters do not exist yet (a model that has not run a forward). A collective: every
        rank builds its Lens at the same point."""
        from torch.distributed.fsdp import FSDPModule

        missing = {id(compat.fsdp_param_slots(fp)[0][0]) for fp in fps.values()
                   if compat.fsdp_unsharded_param(fp) is None}
        if not missing:
            return
        for mod in self.model.modules():
            if isinstance(mod, FSDPModule) and any(
                id(compat.fsdp_param_slots(fp)[0][0]) in missing
                for fp in compat.fsdp_module_params(mod)
            ):
                mod.unshard()
                mod.reshard()

    def unsharded(self, params: dict[str, nn.Parameter]) -> dict[str, nn.Parameter]:
        """``params`` (qualified name -> parameter, as ``model.named_parameters()`` gives
        them) with every sharded parameter replaced by its unsharded one (full shape)."""
        fps = compat.fsdp_params(self.model)
        self._ensure_unsharded(fps)
        out = {}
        for q, p in params.items():
            fp = fps.get(id(p))
            out[q] = p if fp is None else compat.fsdp_unsharded_param(fp)
        return out

    def bin_values(self, instruments: Sequence[Any], states: dict[int, Any], params: dict[str, nn.Parameter]) -> None:
        """When a tracked window opens (every rank): each exact ``GradHist2d`` bins the full
        values of every tracked parameter for the window, gathered one parameter at a time
        (``DTensor.full_tensor()``: one all-gather of D numbers per tracked window, the values
        freed after binning; the bins, D int32, are what GradHist2d keeps on one process too).
        Nothing is gathered without a GradHist2d."""
        hists = [i for i in instruments if i.bins_param_values]
        if not hists:
            return
        fps = compat.fsdp_params(self.model)
        sharded = {id(compat.fsdp_unsharded_param(fp)): fp.sharded_param for fp in fps.values()}
        for q, p in params.items():
            src = sharded.get(id(p))
            values = (src.full_tensor() if src is not None else p).detach()
            for inst in hists:
                inst.bin_param(states[id(inst)], q, values)
            del values

    def present_values(self, instruments: Sequence[Any], states: dict[int, Any],
                       params: dict[str, nn.Parameter]) -> None:
        """Around the real update (every rank): ``Alpha``'s state reads the parameters' values
        before and after it (theta_t, theta_{t+1}); give it the gathered full values instead of
        the unsharded parameters, whose storage FSDP2 has freed by then. Every tracked parameter
        is gathered in a fixed order (``DTensor.full_tensor()``: one all-gather of D numbers each
        time, twice per tracked window; D numbers of memory, as Alpha needs on one process).
        Nothing is gathered without an Alpha."""
        readers = [i for i in instruments if i.reads_update_values and id(i) in states]
        if not readers:
            return
        full = self.full_values(params)
        for inst in readers:
            inst.present_values(states[id(inst)], full)

    def full_values(self, params: dict[str, nn.Parameter]) -> dict[str, Any]:
        """Name -> the full values of every parameter in ``params`` (the unsharded ones of the
        Lens), gathered in a fixed order (``DTensor.full_tensor()``: one all-gather of D numbers;
        a collective, every rank calls it at the same point)."""
        fps = compat.fsdp_params(self.model)
        sharded = {id(compat.fsdp_unsharded_param(fp)): fp.sharded_param for fp in fps.values()}
        full = {}
        for q, p in params.items():
            src = sharded.get(id(p))
            full[q] = src.full_tensor().detach() if src is not None else p
        return full

    @contextlib.contextmanager
    def presented(self) -> Iterator[None]:
        """While the Tap is built or installed: every module holds its unsharded parameters
        (identities only; no data is touched or gathered), as during its forward; afterwards
        each module holds again what it held before."""
        swapped = []
        for fp in compat.fsdp_params(self.model).values():
            full = compat.fsdp_unsharded_param(fp)
            if full is None:
                continue
            for mod, attr in compat.fsdp_param_slots(fp):
                before = compat.set_module_parameter(mod, attr, full)
                if before is not full:
                    swapped.append((mod, attr, before))
        try:
            yield
        finally:
            for mod, attr, before in reversed(swapped):
                compat.set_module_parameter(mod, attr, before)


def presenting(view: ShardedView | None):
    """``view.presented()``, or nothing to do without a sharded model."""
    return contextlib.nullcontext() if view is None else view.presented()


def check_instruments(instruments: Sequence[Any]) -> None:
    """Refuse, on a ``fully_shard``-ed model, the instruments that read parameter values where
    FSDP2 has them only sharded (:meth:`~gradlens.instruments.base.Instrument.sharded_refusal`)."""
    bad = [(type(i).__name__, why) for i in instruments if (why := i.sharded_refusal()) is not None]
    if bad:
        names = ", ".join(n for n, _ in bad)
        why = "; ".join(f"{n}: {w}" for n, w in bad)
        raise ValueError(
            f"instruments {names} are not supported on a model sharded with FSDP2 (fully_shard) "
            f"({why}, where FSDP2 may already have freed the unsharded parameter); drop them from "
            "the Lens's instruments (e.g. GradHist2d without sample=, Alpha, GradHist1d, BatchDot "
            "and the norm and noise instruments work under FSDP2), or train the model under "
            "DistributedDataParallel when it fits on one device"
        )
