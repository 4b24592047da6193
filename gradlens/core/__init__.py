"""The window's values, below everything that measures or moves them: the mergeable window
statistics (:mod:`~gradlens.core.stats`), the window counters (:mod:`~gradlens.core.counter`),
records (:mod:`~gradlens.core.records`), parameter groups, and the checks of saved state."""
