"""The Lens (:mod:`~gradlens.lens.lens`) and its parts: argument checks, the record of a closed
window, rank merging, GradScaler skips, torch.compile, the curvature graph, checkpoints."""
