"""A Weights & Biases sink: ``Lens(..., sinks=[WandbSink()])``.

Imports ``wandb`` only when this module is imported.
"""

from __future__ import annotations

from typing import Any

from gradlens.core.records import Record, flatten, flatten_histograms

__all__ = ["WandbSink"]


class WandbSink:
    """Write gradlens records to a W&B run: scalars and histograms.

    Per record, one ``run.log({...})`` call with:

    - ``gradlens/step``: the record's window index (``record.step``); every ``gradlens/*``
      metric is defined with it as its x-axis (``run.define_metric``), so records that are
      written late (``Alpha`` waits for the next window) land at their own step, and the sink
      does not fight with the steps of other loggers (Lightning's ``WandbLogger``, the
      ``Trainer``'s ``WandbCallback``) that log to the same run;
    - the scalars of :func:`gradlens.core.records.flatten` (``gradlens/loss``,
      ``gradlens/grad_norm``, ...);
    - ``wandb.Histogram(np_histogram=(counts, edges))`` for every histogram of
      :func:`gradlens.core.records.flatten_histograms`, from the record's own counts and edges
      (never re-binned; W&B allows at most 512 bins: use ``GradHist1d(bins<=512)``).

    Args:
        run: a ``wandb`` run. ``None``: the active run (``wandb.run``), or, when there is none,
            a new one from ``wandb.init(**init_kwargs)`` that this sink owns and finishes in
            :meth:`close`. Offline use: ``WANDB_MODE=offline`` (or ``mode="offline"``).
        prefix: the name prefix of every metric (default ``"gradlens/"``).
        **init_kwargs: passed to ``wandb.init`` when the sink starts its own run.

    Raises:
        ImportError: wandb is not installed (``pip install wandb``).
    """

    def __init__(self, run: Any = None, *, prefix: str = "gradlens/", **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ImportError("WandbSink needs the wandb package: pip install wandb") from err
        if not isinstance(prefix, str):
            raise TypeError(f"WandbSink(prefix=...) must be a str, got {type(prefix).__name__}")
        self._wandb = wandb
        self.prefix = prefix
        self._owns_run = False
        if run is None:
            run = wandb.run
            if run is None:
                run = wandb.init(**init_kwargs)
                self._owns_run = True
        elif init_kwargs:
            raise ValueError(
                f"WandbSink got run=... and wandb.init arguments {sorted(init_kwargs)}; pass one "
                "or the other"
            )
        if not (callable(getattr(run, "log", None)) and callable(getattr(run, "define_metric", None))):
            raise TypeError(f"WandbSink(run=...) needs a wandb run (wandb.init()), got {type(run).__name__}")
        self.run = run
        self.step_metric = f"{prefix}step"
        run.define_metric(self.step_metric)
        run.define_metric(f"{prefix}*", step_metric=self.step_metric)
        self._closed = False

    def write(self, record: Record) -> None:
        """Log the scalars and histograms of ``record`` in one ``run.log`` call.

        Raises:
            TypeError: ``record`` is not a gradlens Record.
            ValueError: the sink is closed, or a histogram has more than 512 bins.
        """
        if not isinstance(record, Record):
            raise TypeError(f"WandbSink.write(record=...) needs a gradlens Record, got {type(record).__name__}")
        if self._closed:
            raise ValueError("WandbSink is closed; open a new sink to write")
        data: dict[str, Any] = {self.step_metric: record.step}
        data.update(flatten(record, self.prefix))
        for tag, (counts, edges) in flatten_histograms(record, self.prefix).items():
            if counts.numel() > self._wandb.Histogram.MAX_LENGTH:
                raise ValueError(
                    f"{tag} has {counts.numel()} bins but wandb.Histogram takes at most "
                    f"{self._wandb.Histogram.MAX_LENGTH}; use fewer bins (e.g. GradHist1d(bins=256))"
                )
            data[tag] = self._wandb.Histogram(np_histogram=(counts.numpy(), edges.numpy()))
        self.run.log(data)

    def close(self) -> None:
        """Finish the run if this sink started it (else leave it running). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._owns_run:
            self.run.finish()

    def __enter__(self) -> WandbSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
