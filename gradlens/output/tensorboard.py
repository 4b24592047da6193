"""Records in TensorBoard: :class:`TensorBoardSink` writes a record's scalars and histograms
through a ``torch.utils.tensorboard.SummaryWriter`` (imported when a sink is made), under the
names every sink and logger uses (:func:`gradlens.core.records.flatten`,
:func:`gradlens.core.records.flatten_histograms`).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from gradlens.core.records import Record, flatten, flatten_histograms

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Write records to TensorBoard, at ``global_step = record.step``.

    What is written, per record:

    - a scalar ``gradlens/<key>`` for every value that is a real number or a 0-d tensor
      (``gradlens/loss``, ``gradlens/grad_norm``, ``gradlens/noise_scale``, ...), and
      ``gradlens/<key>/<name>`` for such numbers inside dict values (e.g. per-parameter);
    - for a :class:`~gradlens.Hist1d` under ``key``: a histogram ``gradlens/<key>`` built with
      ``SummaryWriter.add_histogram_raw`` from the record's own counts and edges (no re-binning
      of samples), plus scalars ``gradlens/<key>/clamped_low`` and ``.../clamped_high``;
    - for a :class:`~gradlens.Hist2d`: its two marginals as histograms
      ``gradlens/<key>/grad`` and ``gradlens/<key>/param`` (TensorBoard has no 2D histogram),
      plus scalars ``gradlens/<key>/clamped_param`` and ``.../clamped_grad``.

    The names are those of :func:`gradlens.core.records.flatten` and
    :func:`gradlens.core.records.flatten_histograms`, as for every other sink and logger.

    TensorBoard's histogram summary also wants min, max, sum and sum of squares of the samples;
    gradlens keeps only counts, so min/max are the outer edges of the first/last non-empty bins
    and sum/sum of squares are computed from bin centres (approximate; they only affect
    TensorBoard's tooltips, not the drawn histogram).

    Args:
        writer_or_logdir: a ``SummaryWriter`` (left open by :meth:`close`, only flushed), or a
            log folder for a new ``SummaryWriter`` that this sink owns and closes.

    Raises:
        ImportError: TensorBoard is not installed (``pip install tensorboard``).
    """

    def __init__(self, writer_or_logdir: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise ImportError(
                "TensorBoardSink needs the tensorboard package: pip install tensorboard"
            ) from err
        if isinstance(writer_or_logdir, (str, os.PathLike)):
            self.writer = SummaryWriter(log_dir=str(writer_or_logdir))
            self._owns_writer = True
        elif hasattr(writer_or_logdir, "add_scalar") and hasattr(
            writer_or_logdir, "add_histogram_raw"
        ):
            self.writer = writer_or_logdir
            self._owns_writer = False
        else:
            raise TypeError(
                "TensorBoardSink(writer_or_logdir=...) needs a torch.utils.tensorboard "
                f"SummaryWriter or a log folder path, got {type(writer_or_logdir).__name__}"
            )
        self._closed = False

    def write(self, record: Record) -> None:
        """Write the scalars and histograms of ``record`` at step ``record.step``."""
        if not isinstance(record, Record):
            raise TypeError(
                "TensorBoardSink.write(record=...) needs a gradlens Record, got "
                f"{type(record).__name__}"
            )
        if self._closed:
            raise ValueError("TensorBoardSink is closed; open a new sink to write")
        step = record.step
        for tag, (counts, edges) in flatten_histograms(record, who="TensorBoardSink.write").items():
            self._histogram(tag, counts, edges, step)
        for tag, number in flatten(record, who="TensorBoardSink.write").items():
            self.writer.add_scalar(tag, number, step)

    def _histogram(self, tag: str, counts: Tensor, edges: Tensor, step: int) -> None:
        counts = counts.detach().cpu().to(torch.float64)
        edges = edges.detach().cpu().to(torch.float64)
        num = float(counts.sum())
        if num <= 0:
            return  # TensorBoard cannot show an empty histogram
        nonzero = torch.nonzero(counts).flatten()
        lo_bin, hi_bin = int(nonzero[0]), int(nonzero[-1])
        centres = 0.5 * (edges[:-1] + edges[1:])
        # TensorBoard buckets are (previous limit, limit]; a leading empty bucket whose limit is
        # the first edge keeps the left edge of the range.
        self.writer.add_histogram_raw(
            tag,
            min=float(edges[lo_bin]),
            max=float(edges[hi_bin + 1]),
            num=num,
            sum=float((counts * centres).sum()),
            sum_squares=float((counts * centres**2).sum()),
            bucket_limits=edges.tolist(),
            bucket_counts=[0.0] + counts.tolist(),
            global_step=step,
        )

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this sink created it. Closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
