"""Across ranks: merging a window's statistics over data-parallel ranks
(:mod:`~gradlens.distributed.merge`) and a Lens on an FSDP2-sharded model
(:mod:`~gradlens.distributed.fsdp`)."""
