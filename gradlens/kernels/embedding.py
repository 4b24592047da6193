"""The kernel of ``nn.Embedding``: g_n of the table is a scatter of the output gradients into
the rows of the sample's indices (no ``[B, V, D]`` tensor for the norms and sums)."""

from __future__ import annotations

import torch
from torch import nn

from gradlens.kernels.base import Kernel, _by_columns

__all__ = ["EmbeddingKernel"]


class EmbeddingKernel(Kernel):
    """``nn.Embedding``: g_n of the table is the sum of delta_nt over the positions t whose
    index is v, row v (the ``padding_idx`` row gets no gradient, as in autograd)."""

    rows_per_sample = True  # a sample's rows are more positions t

    def routes_param_grads(self, module):
        # one dense F.embedding of the indices and the table, without max_norm or scale_grad_by_freq
        return (type(module) is nn.Embedding and not module.sparse and module.max_norm is None
                and not module.scale_grad_by_freq)

    def _flat(self, module, a, delta):
        b = delta.shape[0]
        idx, d = a.reshape(b, -1), delta.reshape(b, -1, module.embedding_dim)
        if module.padding_idx is not None:
            d = d * (idx != module.padding_idx).unsqueeze(-1)
        return idx, d

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        idx, d = self._flat(module, a[start:stop], delta[start:stop])
        out = d.new_zeros(idx.shape[0], module.num_embeddings, module.embedding_dim)
        out.scatter_add_(1, idx.unsqueeze(-1).expand_as(d), d)
        return {"weight": out}

    def entries(self, module, a, delta, attr, j):
        idx, d = self._flat(module, a, delta)  # [B, T], [B, T, D]
        v, k = j // module.embedding_dim, j % module.embedding_dim
        return _by_columns(lambda vk, kk: ((idx[:, :, None] == vk) * d.index_select(2, kk)).sum(1),
                           v, k, width=idx.numel())

    def batch_l2(self, module, a, delta):
        # ||g_n||^2 = sum_{t,t'} [idx_t = idx_t'] delta_t . delta_t' (no [V, D] per sample)
        idx, d = self._flat(module, a, delta)
        same = idx.unsqueeze(2) == idx.unsqueeze(1)
        return {"weight": (torch.bmm(d, d.transpose(1, 2)) * same).sum((1, 2))}

    def grad_sum(self, module, a, delta):
        idx, d = self._flat(module, a, delta)
        out = d.new_zeros(module.num_embeddings, module.embedding_dim)
        return {"weight": out.index_add_(0, idx.reshape(-1), d.reshape(-1, d.shape[-1]))}
