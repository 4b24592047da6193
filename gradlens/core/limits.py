"""The size thresholds of gradlens, in one place: each is a trade-off measured on the reference
machine (2 CPU cores; docs/benchmarks.md), named here with what it bounds and its unit. The
modules that use a threshold import it from here (and read it as their own module attribute, so
that a test may lower it on that module).

Memory: :data:`CHUNK_ELEMENTS` bounds every transient block (a materialised ``[b, *param]``
slice of per-sample gradients and the like); ``Lens(chunk_elements=...)`` overrides it per Lens.
On the CPU a slice is further capped at :data:`CPU_SLICE_ELEMENTS`, so that the passes over it
stay in the cache. The others decide between two exact routes by cost, never the result.
"""

from __future__ import annotations

__all__ = [
    "CHUNK_ELEMENTS", "CPU_SLICE_ELEMENTS", "SAMPLED_CHUNK_ELEMENTS", "SMALL_USE", "STACK_BUDGET",
    "SMALL_SUM", "FUSE_MIN", "DIRECT_COUNT", "INLINE_GATHER_MAX", "SMALL_GRAD", "SMALL_NUMEL",
    "SMALL_DOT", "DEFAULT_MAX_BYTES", "MAX_BINS",
]

# ------------------------------------------------------------------ memory of transient blocks
#: elements of one transient block: a materialised ``[b, *param]`` slice, a ``T x T`` Gram
#: chunk, a chunk of the per-operation vjp (:mod:`gradlens.capture.ops`), a histogram product
#: block; the default of ``Lens(chunk_elements=...)`` and of the framework callbacks
CHUNK_ELEMENTS = 1 << 22
#: most elements of one materialised slice on the CPU (4 MB in float32: within a last-level
#: cache). On the 2-core reference machine a narrow-range GradHist2d of a 256-512-512-10 MLP ran
#: 20% faster with slices of 2**20 than of 2**22 elements, and slower again with 2**18 (Python
#: per slice) (:mod:`gradlens.measure.slices`)
CPU_SLICE_ELEMENTS = 1 << 20
#: elements of one block of sampled histogram entries (:mod:`gradlens.instruments.sampling`)
SAMPLED_CHUNK_ELEMENTS = 1 << 20
#: most bins of one histogram (2D: param_bins * grad_bins): 128 KB of int64 counts per state and
#: a log line of about 0.3 MB (counts and edges, ~20 bytes a bin); the histograms read it as
#: ``gradlens.instruments.hist.MAX_BINS``: raise it there (``= ...``) only where that memory and
#: log size are intended
MAX_BINS = 1 << 14
#: default memory budget of one exact-mode cross-micro-step instrument, bytes kept for its
#: window (:mod:`gradlens.instruments.crosssample`)
DEFAULT_MAX_BYTES = 1 << 30

# ------------------------------------------------------------------ routes chosen by cost
#: largest use (elements of its input and output gradient) kept to be measured with others
#: like it at the window's end (:mod:`gradlens.measure.deferred`)
SMALL_USE = 1 << 17
#: most elements of the uses one micro-step keeps for that (beyond: measured at once)
STACK_BUDGET = 1 << 22
#: most multiply-adds of a stacked use's window gradient (:meth:`~gradlens.kernels.Kernel.sum_cost`)
#: formed with the stacked uses rather than taken from autograd through a node hook (which
#: costs about as much as a product of this size on a CPU)
SMALL_SUM = 1 << 19
#: fewest multiply-adds of a sequence Linear call's weight gradient for it to run fused
#: (:mod:`gradlens.capture.fused`): below, the Python autograd Function's own cost exceeds the
#: product it saves
FUSE_MIN = 1 << 20
#: at most this many elements, a 1D histogram counts one bin index per element in one
#: ``bincount`` (:mod:`gradlens.instruments.binning`; above, pairs of elements per index)
DIRECT_COUNT = 1 << 17
#: largest per-sample block (elements, all ranks together) carried inside a window's
#: all_reduce instead of a separate all_gather (:mod:`gradlens.distributed.merge`)
INLINE_GATHER_MAX = 1 << 16
#: largest dL/dp of one layer call kept until the micro-step's end: a kept gradient makes
#: autograd copy it into a fresh ``p.grad`` (:mod:`gradlens.measure.window_grad`)
SMALL_GRAD = 1 << 16
#: parameters up to this many elements share one concatenated dot in the window's
#: ||sum_n g_n||^2 (:mod:`gradlens.core.stats`)
SMALL_NUMEL = 1 << 16
#: tensors of at most this many elements are concatenated before their dot product in
#: :func:`gradlens.core.sq_norms.sum_sq`
SMALL_DOT = 1 << 14
