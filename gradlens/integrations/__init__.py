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

The helpers below turn a record into the flat scalar and histogram names all of them (and
:class:`gradlens.sinks.TensorBoardSink`) use. See ``docs/integrations.md``.
"""

from __future__ import annotations

from typing import Mapping

from torch import Tensor

from gradlens.records import Hist1d, Hist2d, Record
from gradlens.sinks import _as_number  # the one rule for what counts as a scalar

__all__ = ["record_scalars", "record_histograms"]


def record_scalars(record: Record, prefix: str = "gradlens/") -> dict[str, float]:
    """The scalars of ``record`` by name (host floats; one sync per value, once per record).

    - ``<prefix><key>`` for a value that is a real number or a 0-d tensor (``loss``,
      ``grad_norm``, ``noise_scale``, ``alpha``, ...; a missing ``alpha`` (None) is left out);
    - ``<prefix><key>/<name>`` for such numbers inside a dict value (e.g. per parameter,
      ``search_dir_projections/update_sq_norm``);
    - ``<prefix><key>/clamped_low`` and ``.../clamped_high`` for a :class:`~gradlens.Hist1d`.

    Tensors with samples or parameter shapes (``batch_l2`` [N], ``sum_grad_squared``) are not
    scalars and are left out.
    """
    if not isinstance(record, Record):
        raise TypeError(f"record_scalars(record=...) needs a gradlens Record, got {type(record).__name__}")
    out: dict[str, float] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Hist1d):
            out[f"{tag}/clamped_low"] = float(value.clamped_low)
            out[f"{tag}/clamped_high"] = float(value.clamped_high)
        elif isinstance(value, Hist2d):
            out[f"{tag}/clamped_param"] = float(value.clamped_param)
            out[f"{tag}/clamped_grad"] = float(value.clamped_grad)
        elif isinstance(value, Mapping):
            for name, inner in value.items():
                number = _as_number(inner)
                if number is not None:
                    out[f"{tag}/{name}"] = number
        else:
            number = _as_number(value)
            if number is not None:
                out[tag] = number
    return out


def record_histograms(record: Record, prefix: str = "gradlens/") -> dict[str, tuple[Tensor, Tensor]]:
    """The histograms of ``record`` by name, as ``(counts [bins] int64, edges [bins + 1]
    float64)`` on the CPU, straight from gradlens' own counts (never re-binned):

    - ``<prefix><key>`` for a :class:`~gradlens.Hist1d` (``grad_hist_1d``);
    - ``<prefix><key>/grad`` and ``<prefix><key>/param`` for a :class:`~gradlens.Hist2d`: its
      marginals over the parameter axis and over the gradient axis (sums of its counts).
    """
    if not isinstance(record, Record):
        raise TypeError(
            f"record_histograms(record=...) needs a gradlens Record, got {type(record).__name__}"
        )
    out: dict[str, tuple[Tensor, Tensor]] = {}
    for key, value in record.items():
        tag = f"{prefix}{key}"
        if isinstance(value, Hist1d):
            out[tag] = (value.counts.detach().cpu(), value.edges.detach().cpu().double())
        elif isinstance(value, Hist2d):
            counts = value.counts.detach().cpu()
            out[f"{tag}/grad"] = (counts.sum(0), value.grad_edges.detach().cpu().double())
            out[f"{tag}/param"] = (counts.sum(1), value.param_edges.detach().cpu().double())
    return out
