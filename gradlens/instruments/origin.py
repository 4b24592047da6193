"""Where each sample of a window came from: rank, micro-step, index within the micro-batch.

:class:`SampleOrigin` writes ``record["sample_origin"]``, one row ``(rank, micro_step, size)``
per micro-batch of the window, in the order of the record's per-sample vectors (``batch_l2``
``[N]``, the rows of ``batch_dot`` ``[N, N]``, each group's ``batch_l2``): under
``torch.distributed`` rank-major (rank 0's micro-batches in the order its micro-steps saw them,
then rank 1's, ...), as the merge across ranks orders the samples. One row per micro-batch, not
per sample, so the key stays small (``3 K`` integers for K micro-batches of all ranks) and a
log keeps it in full. :func:`sample_origins` expands it to one row per sample;
:func:`top_samples` names the samples with the largest per-sample norms and their origin.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from gradlens.core.records import Record, TensorSummary
from gradlens.core.stats import WindowStats
from gradlens.instruments.base import Instrument

__all__ = ["SampleOrigin", "sample_origins", "top_samples"]


class SampleOrigin(Instrument):
    """``record["sample_origin"]``: int64 ``[M, 3]``, one row ``(rank, micro_step, size)`` per
    micro-batch of the window (M = micro-batches of all ranks; rows in the window's sample
    order, rank-major under ``torch.distributed``; ``size`` sums to N).

    ``rank`` is the rank within the Lens' process group (the merge's); with one process, or
    ``Lens(process_group=False)``, this process's rank (0 without ``torch.distributed``).
    ``micro_step`` counts that rank's captured micro-steps of the window from 0 (a capture
    whose backward reached no sample is not one). It reads the window's per-sample norms
    (``needs`` ``batch_l2``), whose per-micro-step ``[B_k]`` vectors give the sizes; across
    ranks (``needs`` ``sample_origin``) each rank's ``K_r`` sizes travel with them.
    """

    key = "sample_origin"
    needs = frozenset({"batch_l2", "sample_origin"})

    def finalize(self, stats: WindowStats, state: Any) -> Tensor:
        sizes = [t.numel() for t in stats.batch_l2]
        ranks = list(stats.micro_ranks) if stats.micro_ranks else [_own_rank()] * len(sizes)
        rows, seen = [], {}
        for r, b in zip(ranks, sizes):
            rows.append((r, seen.get(r, 0), b))
            seen[r] = seen.get(r, 0) + 1
        return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3)


def _own_rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _origin_rows(record: Record) -> Tensor:
    if not isinstance(record, Record):
        raise TypeError(f"expected a gradlens Record (lens.records[i] or load_log(path)[i]), got {type(record).__name__}")
    rows = record.values.get("sample_origin")
    if rows is None:
        raise KeyError(
            f"record of step {record.step} has no 'sample_origin'; add the instrument: "
            "Lens(model, [BatchL2(), SampleOrigin()], ...)"
        )
    if isinstance(rows, TensorSummary):
        raise ValueError(
            f"record of step {record.step}: 'sample_origin' was written as a summary ({rows.shape}); "
            "keep it in full in the log: Lens(..., log=JsonlSink(path, full=['sample_origin']))"
        )
    return torch.as_tensor(rows, dtype=torch.int64).reshape(-1, 3)


def sample_origins(record: Record) -> Tensor:
    """int64 ``[N, 3]``: for each sample of ``record`` (in the order of its per-sample vectors)
    ``(rank, micro_step, index)``, ``index`` its position within its micro-batch, expanded
    from ``record["sample_origin"]`` (:class:`SampleOrigin`).

    Raises:
        KeyError: the record has no ``"sample_origin"`` (the message names the instrument).
        ValueError: its sizes do not add up to ``record.num_samples``.
    """
    rows = _origin_rows(record)
    sizes = rows[:, 2]
    if int(sizes.sum()) != record.num_samples:
        raise ValueError(
            f"record of step {record.step}: 'sample_origin' counts {int(sizes.sum())} samples, the "
            f"record {record.num_samples}; it does not belong to this record"
        )
    if not len(rows):
        return torch.zeros(0, 3, dtype=torch.int64)
    starts = torch.cumsum(sizes, 0) - sizes
    index = torch.arange(record.num_samples) - torch.repeat_interleave(starts, sizes)
    return torch.stack([torch.repeat_interleave(rows[:, 0], sizes), torch.repeat_interleave(rows[:, 1], sizes), index], 1)


def top_samples(record: Record, k: int = 5, key: str = "batch_l2", group: str | None = None) -> list[dict]:
    """The ``k`` samples of ``record`` with the largest ``record[key]`` (a per-sample ``[N]``
    vector; default ``batch_l2``, ||g_n||^2 in squared per-sample gradient units; ``group``:
    the vector of ``record.groups[group]``), largest first (ties: the earlier sample first).

    Each is a dict ``{"sample": n, "rank": r, "micro_step": k, "index": i, "value": v,
    "norm": sqrt(v)}``: ``n`` the position in the record's per-sample vectors, ``(r, k, i)``
    its origin (:func:`sample_origins`); ``"norm"`` only for ``batch_l2`` (||g_n||). Works on a
    record of ``lens.records`` and on one read back with :func:`gradlens.load_log`.

    Raises:
        KeyError: ``key`` (or ``"sample_origin"``) is not in the record; the message names the
            instrument to add.
        ValueError: ``k`` < 1, or ``record[key]`` is not an ``[N]`` vector kept in full.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"top_samples(k={k!r}): k must be an int >= 1")
    origin = sample_origins(record)
    values = record.values if group is None else record.groups.get(group)
    if values is None:
        raise KeyError(f"top_samples(group={group!r}): the record has groups {sorted(record.groups)}")
    if key not in values:
        raise KeyError(
            f"top_samples(key={key!r}): the record of step {record.step} has no {key!r}; add its "
            "instrument (BatchL2() for 'batch_l2') or pass a per-sample key it has"
        )
    vec = values[key]
    if isinstance(vec, TensorSummary):
        raise ValueError(
            f"top_samples(key={key!r}): the log kept only a summary of it; write it in full: "
            f"JsonlSink(path, full=[{key!r}])"
        )
    vec = torch.as_tensor(vec, dtype=torch.float64)
    if vec.shape != (record.num_samples,):
        raise ValueError(
            f"top_samples(key={key!r}) needs a per-sample vector [N] = [{record.num_samples}], got "
            f"shape {tuple(vec.shape)}; use a key such as 'batch_l2'"
        )
    # stable: among equal values the earlier sample first; a nan value last
    order = torch.argsort(torch.nan_to_num(vec, nan=-math.inf), descending=True, stable=True)[:k].tolist()
    out = []
    for n in order:
        r, m, i = (int(v) for v in origin[n])
        item = {"sample": int(n), "rank": r, "micro_step": m, "index": i, "value": float(vec[n])}
        if key == "batch_l2":
            item["norm"] = math.sqrt(max(float(vec[n]), 0.0))
        out.append(item)
    return out
