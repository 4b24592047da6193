"""Sample axes whose rows are not the samples in order, and what an operation can say about the
samples besides where their axis went.

:class:`Rows` is a sample axis ``(dim, 1)`` with an ``owner`` tensor: row ``r`` of dim ``dim``
holds (a part of) sample ``owner[r]``. It follows what reorders, selects or repeats the rows of
the batch with a known index: a permutation (``h[p]``, ``index_select``, ``flip``, ``roll``, a
``gather`` whose index is the same for every column), a selection (a slice or a boolean mask of
the samples, ``split`` / ``chunk`` of the batch, the time steps of packed sequences), a
repetition (``repeat_interleave``, ``repeat``), a concatenation of such parts (``cat``), and a
flattening in which the samples are not the leading factor (``[T, B, d] -> [T * B, d]``). A use
whose input has such an axis is measured on its rows put back in sample order
(:func:`samples_first`): ``[B, ...]`` where each sample has at most one row (absent samples get
zero rows: their gradient is zero), ``[B, R_max, ...]`` where some have several (only for kernels
whose samples may hold several rows, :attr:`gradlens.kernels.Kernel.rows_per_sample`).

:class:`Mix` and :class:`Pool` are the answers of an axis rule (:func:`gradlens.capture.axes.carry`)
for operations that combine samples: ``Mix`` an output whose rows each depend on several samples
(``softmax`` / ``cumsum`` / ``sort`` over the batch, ``h @ h.T``), ``Pool`` an output reduced over
the samples (``h.mean(0)``; ``linear`` for sums and means, whose combination with other pooled
values keeps a loss a sum over samples). The capture then marks the parameters upstream as
undefined (:meth:`gradlens.capture.tap.Tap._taint_before`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Rows", "Mix", "Pool", "owner_of", "rows_axis", "samples_first", "packed_owner", "unify"]


class Rows(tuple):
    """A sample axis ``(dim, 1)`` whose row ``r`` belongs to sample ``owner[r]`` (``owner``: a
    1-D int64 tensor, one entry per row of dim ``dim``, values in ``[0, B)``). Two ``Rows`` are
    equal only if they share the same ``owner`` tensor (identity; equal values in different
    tensors are compared where it matters, :func:`unify`). An owner of -1 marks a row of no
    sample yet (a constant joined to the batch), filled when it meets a sample's row."""

    def __new__(cls, dim: int, owner: Tensor):
        self = tuple.__new__(cls, (dim, 1))
        self.owner = owner
        return self

    def __eq__(self, other: Any) -> bool:
        return type(other) is Rows and tuple.__eq__(self, other) and other.owner is self.owner

    def __ne__(self, other: Any) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((self[0], id(self.owner)))

    def __repr__(self) -> str:
        return f"Rows(dim={self[0]}, rows={self.owner.numel()})"

    def at(self, dim: int) -> "Rows":
        """The same rows on another dim (the rows moved by a transpose, a view, ...)."""
        return self if dim == self[0] else Rows(dim, self.owner)

    def layout(self, batch: int) -> tuple[Tensor, Tensor | None, int]:
        """``(owner, pos, width)``: each row's sample and its place among that sample's rows
        (None where every sample has at most one row: ``width`` 1). Reads the rows' largest
        count per sample on the host. Raises ValueError while some rows hold no sample (a
        constant joined to the batch whose rows no sample claimed, see :func:`unify`)."""
        owner = self.owner
        if owner.numel() and bool((owner < 0).any()):
            raise ValueError(f"{owner.numel()} rows of which {int((owner < 0).sum())} hold no sample")
        counts = torch.bincount(owner, minlength=batch)
        width = int(counts.max()) if owner.numel() else 1
        pos = None
        if width > 1:
            order = torch.argsort(owner, stable=True)
            starts = torch.cumsum(counts, 0) - counts
            ranked = torch.arange(owner.numel(), device=owner.device) - starts[owner[order]]
            pos = torch.empty_like(owner)
            pos[order] = ranked
        return owner, pos, max(width, 1)


def unify(a: Any, b: Any) -> bool:
    """Whether the sample axes ``a`` and ``b`` (on the same dim) hold the same samples in their
    rows, where rows of no sample (owner -1: a constant joined to the batch, e.g. a zero initial
    state) take the sample of the other's row: such rows are filled in place, in both owners (so
    that uses of them measured later see it). One host read."""
    if a is b:
        return True
    if a is None or b is None or a[0] != b[0]:
        return False
    ra, rb = type(a) is Rows, type(b) is Rows
    if not (ra or rb):
        return tuple.__eq__(a, b)
    oa = a.owner if ra else _in_order(b.owner.numel(), a[1], b.owner.device)
    ob = b.owner if rb else _in_order(a.owner.numel(), b[1], a.owner.device)
    if oa is None or ob is None or oa.shape != ob.shape:
        return False
    if oa is ob:
        return True
    known = (oa >= 0) & (ob >= 0)
    if not bool((oa[known] == ob[known]).all()):
        return False
    if ra:
        oa.copy_(torch.where(oa < 0, ob, oa))
    if rb:
        ob.copy_(torch.where(ob < 0, oa, ob))
    return True


def _in_order(rows: int, f: int, device: Any) -> Tensor | None:
    """The owner of ``rows`` rows of a plain axis ``(dim, f)``: ``n`` for rows ``n * f + j``."""
    if rows % f:
        return None
    idx = torch.arange(rows // f, device=device)
    return idx if f == 1 else idx.repeat_interleave(f)


class Mix:
    """An axis rule's answer for an operation that mixes samples: ``axis`` is its output's
    sample axis (None: none), ``what`` says which operation and how (for the error)."""

    __slots__ = ("axis", "what")

    def __init__(self, axis: Any, what: str):
        self.axis, self.what = axis, what

    def __repr__(self) -> str:
        return f"Mix({self.axis!r}, {self.what!r})"


class Pool:
    """An axis rule's answer for an output reduced over the samples: ``linear`` for a sum or
    mean (a loss that is a sum over samples stays one), else a reduction that also mixes them."""

    __slots__ = ("what", "linear")

    def __init__(self, what: str, linear: bool):
        self.what, self.linear = what, linear

    def __repr__(self) -> str:
        return f"Pool({self.what!r}, linear={self.linear})"


#: the types an axis rule may answer besides an axis
EVENTS = (Mix, Pool)


def owner_of(ax: Any, size: int, batch: int, device: Any) -> Tensor | None:
    """The owner of each of the ``size`` rows of the sample dim of axis ``ax``: ``Rows.owner``,
    or ``n`` for rows ``n * f + j`` of a plain axis ``(dim, f)``; None if the sizes disagree."""
    if type(ax) is Rows:
        return ax.owner if ax.owner.numel() == size else None
    f = ax[1]
    if batch * f != size:
        return None
    idx = torch.arange(batch, device=device)
    return idx if f == 1 else idx.repeat_interleave(f)


def rows_axis(dim: int, owner: Tensor, batch: int) -> Any:
    """The axis of rows with owners ``owner`` on ``dim`` (-1: a row of no sample yet): a plain
    ``(dim, 1)`` when they are the samples in order (one host read: this path is taken only by
    operations that move rows), else :class:`Rows` (a fresh owner tensor: rows of no sample
    are filled in place when they meet a sample's, :func:`unify`)."""
    owner = owner.detach()
    if owner.dtype != torch.int64:
        owner = owner.long()
    if owner.numel() == batch and bool((owner == torch.arange(batch, device=owner.device)).all()):
        return (dim, 1)
    return Rows(dim, owner.clone())


def samples_first(t: Tensor, ax: Rows, batch: int) -> Tensor:
    """``t`` (rows on ``ax``'s dim) as ``[B, ...]`` (each sample at most one row, zeros for absent
    samples) or ``[B, R_max, ...]`` (zero rows after each sample's own), samples in order."""
    owner, pos, width = ax.layout(batch)
    t = t.movedim(ax[0], 0) if ax[0] else t
    if pos is None:
        out = t.new_zeros((batch,) + tuple(t.shape[1:]))
        out.index_copy_(0, owner, t)
        return out
    out = t.new_zeros((batch, width) + tuple(t.shape[1:]))
    out.view((batch * width,) + tuple(t.shape[1:])).index_copy_(0, owner * width + pos, t)
    return out


def packed_owner(batch_sizes: Tensor, sorted_indices: Tensor | None, device: Any) -> Tensor:
    """The sample of each row of a ``PackedSequence``'s data: rows of time step t are the first
    ``batch_sizes[t]`` sequences in sorted order, sequence ``i`` being sample
    ``sorted_indices[i]`` (``i`` when unsorted)."""
    sizes = batch_sizes.to("cpu", torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    rows = int(sizes.sum())
    seq = torch.arange(rows) - torch.repeat_interleave(starts, sizes)
    seq = seq.to(device)
    if sorted_indices is not None:
        seq = sorted_indices.to(device)[seq]
    return seq
