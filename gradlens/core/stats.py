"""The window's shared statistics: sums over its samples, mergeable across micro-steps and ranks.

:class:`WindowStats` holds what every instrument may read (N, K, the loss, the per-sample norms
``[B_k]``, the per-parameter sums sum_n g_n and sum_n g_n^2); :class:`Accumulators` are its
running sums, written in place into buffers kept from earlier windows; :class:`DistParts` is what
one participant of a merge across ranks sends. The quantities a capture can provide
(:data:`QUANTITIES`) are described in :mod:`gradlens.instruments.base`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from gradlens.compat import storage_use_count
from gradlens.core.limits import SMALL_NUMEL as _SMALL_NUMEL
from gradlens.core.param_shapes import full_shape

__all__ = ["Accumulators", "DistParts", "WindowStats", "QUANTITIES", "LIGHT_QUANTITIES"]

QUANTITIES = frozenset(
    {"batch_l2", "sum_grad_squared", "grad_sum", "per_sample", "layer", "micro_grad_sq", "graph_grad",
     "sample_origin"}
)
#: what parameter hooks alone provide (no per-sample capture): a Lens whose instruments need
#: nothing else runs in light mode (:class:`gradlens.capture.light.ParamTap`), on any model
LIGHT_QUANTITIES = frozenset({"grad_sum", "micro_grad_sq", "graph_grad"})



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
    #: after a merge across ranks: the rank (within the merge's process group) of each entry of
    #: ``batch_l2`` (one per micro-step, rank-major); empty before (every entry is this
    #: process's own). Not in a Lens checkpoint (a window is saved before it is merged)
    micro_ranks: list[int] = field(default_factory=list)

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
            micro_ranks=self.micro_ranks + other.micro_ranks,
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
            micro_ranks=list(self.micro_ranks),
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
        this rank has no entry, and a presence count), and to gather: ``batch_l2`` ``[N_r]``,
        with ``"sample_origin"`` needed its micro-step sizes ``[K_r]`` (so that the merged window
        keeps one ``[B_k]`` vector per micro-step: the samples' origin) and, with groups, their parts ``[G, N_r]``."""
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
                sums.append(acc[q] if q in acc else p.new_zeros(full_shape(p), dtype=torch.promote_types(p.dtype, torch.float32)))
            sums.append(torch.tensor(present, dtype=f64))
        pieces = [self.batch_l2_all().double()] if "batch_l2" in ctx.needs else []
        if pieces and "sample_origin" in ctx.needs:  # the micro-step sizes [K_r] (SampleOrigin)
            sizes = [t.numel() for t in self.batch_l2]
            pieces.append(torch.tensor(sizes, dtype=f64).reshape(len(sizes)))
        groups = getattr(ctx, "groups", ())
        if groups and "batch_l2" in ctx.needs:  # [G, N_r]: one more gathered piece
            n = sum(t.numel() for t in self.batch_l2)
            dev = self.batch_l2[0].device if self.batch_l2 else None
            rows = [torch.cat(self.group_l2[g]).double() if self.group_l2.get(g)
                    else torch.zeros(n, dtype=f64, device=dev) for g in groups]
            pieces.append(torch.stack(rows) if n else torch.zeros(len(groups), 0, dtype=f64))
        return DistParts(sums=sums, pieces=pieces)

    def from_buffers(self, ctx, sums, per_rank, pieces) -> "WindowStats":
        """The window of all ranks from :meth:`to_buffers`' merged buffers (rank-major): one
        ``batch_l2`` vector per micro-step of every rank, :attr:`micro_ranks` their ranks."""
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
        if pieces:  # with the micro-step sizes: each rank's [N_r] split into its micro-steps
            origin = "sample_origin" in ctx.needs
            sizes = ([[int(b) for b in k.tolist()] for k in pieces[1]] if origin
                     else [[t.numel()] for t in pieces[0]])
            for r, (t, ks) in enumerate(zip(pieces[0], sizes)):
                parts = [v for v in t.split(ks) if v.numel()]
                out.batch_l2 += parts
                out.micro_ranks += [r] * len(parts)
            if len(pieces) > 1 + origin:
                out.group_l2 = {g: [] for g in ctx.groups}
                for t, ks in zip(pieces[1 + origin], sizes):
                    keep = [b for b in ks if b]
                    for i, g in enumerate(ctx.groups):
                        out.group_l2[g] += list(t[i].split(keep)) if keep else []
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
