"""Measurement: the Meter (:mod:`~gradlens.measure.meter`) turns each captured use into the pieces
its plan asks for; uses measured later (:mod:`~gradlens.measure.deferred`), the materialising pass
(:mod:`~gradlens.measure.slices`) and the window gradient from autograd
(:mod:`~gradlens.measure.window_grad`)."""
