"""Where records go and how they are seen: sinks and the log (:mod:`~gradlens.output.sinks`, where
they are imported from; defined in :mod:`~gradlens.output.jsonl`, :mod:`~gradlens.output.log_format`,
:mod:`~gradlens.output.log_reader`, :mod:`~gradlens.output.tensorboard` and
:mod:`~gradlens.output.sink_set`), plots (:mod:`~gradlens.output.plot`)."""
