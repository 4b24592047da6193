"""Where people train: PyTorch Lightning, Hugging Face ``Trainer``, Weights & Biases.

Each integration lives in its own module and imports its framework only when that module is
imported; ``import gradlens`` (and ``import gradlens.integrations``) imports none of them.

- :mod:`gradlens.integrations.lightning`: :class:`~gradlens.integrations.lightning.LensCallback`,
  a Lightning ``Callback`` (windows are Lightning's optimizer steps).
- :mod:`gradlens.integrations.transformers`:
  :class:`~gradlens.integrations.transformers.LensTrainerCallback`, a ``TrainerCallback`` for
  Hugging Face's ``Trainer``.
- :mod:`gradlens.integrations.wandb`: :class:`~gradlens.integrations.wandb.WandbSink`, a sink
  (``Lens(..., sinks=[WandbSink()])``) writing scalars and histograms to a W&B run.

The helpers below give the flat scalar and histogram names all of them (and
:class:`gradlens.output.sinks.TensorBoardSink`) use: :func:`gradlens.core.records.flatten` and
:func:`gradlens.core.records.flatten_histograms`. See ``docs/integrations.md``.
"""

from __future__ import annotations

from torch import Tensor

from gradlens.core.records import Record, flatten, flatten_histograms

__all__ = ["record_scalars", "record_histograms"]


def record_scalars(record: Record, prefix: str = "gradlens/") -> dict[str, float]:
    """The scalars of ``record`` by name: :func:`gradlens.core.records.flatten` (host floats; one
    sync per value, once per record), the names every sink and logger uses."""
    return flatten(record, prefix, who="record_scalars")


def record_histograms(record: Record, prefix: str = "gradlens/") -> dict[str, tuple[Tensor, Tensor]]:
    """The histograms of ``record`` by name: :func:`gradlens.core.records.flatten_histograms`
    (``(counts [bins], edges [bins + 1] float64)`` on the CPU, never re-binned)."""
    return flatten_histograms(record, prefix, who="record_histograms")
