"""The training side: exact gradient accumulation (:mod:`~gradlens.training.accumulate`, made of
the ``accum_*`` modules and :mod:`~gradlens.training.wrapped_optimizer`), adaptive gradient
clipping (:mod:`~gradlens.training.agc`), accumulation-aware BatchNorm
(:mod:`~gradlens.training.batchnorm`) and checkpoints that survive a kill
(:mod:`~gradlens.training.checkpoint`)."""
