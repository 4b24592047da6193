"""Where records go and how they are seen: sinks and the log (:mod:`~gradlens.output.sinks`),
plots (:mod:`~gradlens.output.plot`)."""
