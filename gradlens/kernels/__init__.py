"""Per-layer kernels: per-sample gradient quantities from a layer's input and output gradient.

A kernel receives the module, its input ``a`` (``[B, ...]``, as seen in the forward pass) and
``delta``, the gradient of the *per-sample* losses with respect to the module output
(``[B, ...]``, rescaled so that row n belongs to g_n, see docs/design.md), and returns parameter
attribute (``"weight"``, ``"bias"``) -> value: ``per_sample`` ``[b, *param]`` slices of g_n, the
``[B]`` norms ``batch_l2``, the sums ``sum_grad_squared`` / ``grad_sum`` (``reduce`` adds them
into the window's accumulators), and the cross-micro-step maths (Grams, projections, sketches).
Every method has a default derived from materialised slices; a kernel must define only
``per_sample``. What a kernel offers beyond that is declared on its class and checked by
:func:`check_kernel`. The contract in full: :mod:`gradlens.kernels.base`.

Where each family lives:

- :mod:`~gradlens.kernels.base`: :class:`Kernel`, :func:`check_kernel`, the chunking rule
  (:func:`sample_chunks`, :data:`CHUNK_ELEMENTS`) and the shared helpers;
- :mod:`~gradlens.kernels.linear`: ``nn.Linear``, ``F.linear`` calls (:class:`OpLinear`),
  transformers' ``Conv1D``: the factor identities, no ``[B, *param]`` tensor;
- :mod:`~gradlens.kernels.conv`: Conv2d (unfold + bmm) and any convolution through
  ``torch.func.vmap`` (string padding, ``output_padding``);
- :mod:`~gradlens.kernels.norms`: LayerNorm, RMSNorm, GroupNorm, InstanceNorm, BatchNorm (eval
  and batch statistics);
- :mod:`~gradlens.kernels.embedding`: ``nn.Embedding``;
- :mod:`~gradlens.kernels.bilinear`: ``nn.Bilinear``, a layer of two inputs
  (:attr:`Kernel.inputs`, :meth:`Kernel.join_inputs`);
- :mod:`~gradlens.kernels.backpack`: BackPACK's derivatives (Conv1d/3d, transposed and grouped
  convolutions);
- :mod:`~gradlens.kernels.materialised`: parameters whose per-sample gradients were formed
  explicitly;
- :mod:`~gradlens.kernels.attention`, :mod:`~gradlens.kernels.recurrent`: the tracked-window
  forwards of ``nn.MultiheadAttention`` and the RNNs (batch-first ``F.linear`` calls, so that
  their parameters are Linear uses).
"""

from __future__ import annotations

from gradlens.kernels.backpack import BackpackConvKernel, BackpackKernel
from gradlens.kernels.base import (
    CHUNK_ELEMENTS, KINDS, Kernel, add_into, check_kernel, joint_sq_norm, sample_chunks, tgram_cheaper,
)
from gradlens.kernels.bilinear import BilinearKernel
from gradlens.kernels.conv import Conv2dKernel, VmapConvKernel
from gradlens.kernels.embedding import EmbeddingKernel
from gradlens.kernels.linear import LinearKernel, OpLinear, TransposedLinearKernel
from gradlens.kernels.materialised import Materialised, MaterialisedKernel, SummedUsesKernel
from gradlens.kernels.norms import (
    BatchNormBatchStatsKernel, BatchNormEvalKernel, GroupNormKernel, InstanceNormKernel, LayerNormKernel,
    RMSNormKernel,
)

__all__ = [
    "Kernel", "KINDS", "CHUNK_ELEMENTS", "check_kernel", "sample_chunks", "tgram_cheaper", "add_into",
    "joint_sq_norm", "LinearKernel", "TransposedLinearKernel", "OpLinear", "Conv2dKernel", "VmapConvKernel",
    "LayerNormKernel", "RMSNormKernel", "GroupNormKernel", "InstanceNormKernel", "BatchNormBatchStatsKernel",
    "BatchNormEvalKernel", "EmbeddingKernel", "BackpackKernel", "BackpackConvKernel", "Materialised",
    "MaterialisedKernel", "SummedUsesKernel", "BilinearKernel",
]
