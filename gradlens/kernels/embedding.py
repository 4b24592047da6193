"""The kernel of ``nn.Embedding``: g_n of the table is a scatter of the output gradients into
the rows of the sample's indices (no ``[B, V, D]`` tensor for the norms and sums)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from gradlens.kernels.base import Kernel, _by_columns

__all__ = ["EmbeddingKernel", "EmbeddingBagKernel", "bag_rows"]


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

    def add_per_sample(self, module, a, delta, attr, out):
        idx, d = self._flat(module, a, delta)  # scattered into ``out [B, V, D]`` (no temporary)
        out.scatter_add_(1, idx.unsqueeze(-1).expand_as(d), d.to(out.dtype))

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


class EmbeddingBagKernel(EmbeddingKernel):
    """``nn.EmbeddingBag`` (modes ``"sum"`` and ``"mean"``, per-sample weights included): a bag is
    a sample, and g_n of the table is the scatter of ``w_ni * delta_n`` into the rows of the bag's
    ids ``i``, ``w_ni`` being what id ``i`` adds to the bag (1, or one over the bag's non-padding
    count, times its per-sample weight). It takes the module's own layout (ids ``[B, ..., L]``,
    one bag per row of the last dim, and the output gradient ``[B, ..., D]``), or the rows the
    capture makes of a flat call with offsets or per-sample weights (:func:`bag_rows`: ids
    ``[B, L]`` with the weighted output gradients ``[B, L, D]``): the embedding kernel's rows."""

    def routes_param_grads(self, module):
        return False  # the call's dL/dp is not one embedding lookup's

    def _flat(self, module, a, delta):
        if a.dim() == delta.dim():  # the module's own layout: weigh each id by its share of its bag
            keep = torch.ones(a.shape, dtype=delta.dtype, device=delta.device)
            if module.padding_idx is not None:
                keep = keep * (a != module.padding_idx)
            if module.mode == "mean":
                keep = keep / keep.sum(-1, keepdim=True).clamp_min(1)
            delta = keep.unsqueeze(-1) * delta.unsqueeze(-2)
        return super()._flat(module, a, delta)


def bag_rows(module: nn.EmbeddingBag, ids: Tensor, offsets: Tensor | None, weights: Tensor | None,
             batch: int) -> tuple[Tensor, Tensor]:
    """``(ids [B, L], w [B, L])``: each bag's ids in its row (padded with id 0 and weight 0 to the
    longest bag, L) and what each adds to its bag, for a call ``module(ids, offsets,
    per_sample_weights=weights)`` (``ids`` ``[B, L]`` without offsets, or flat with ``offsets``
    cutting ``B`` bags). Reads the longest bag's length on the host once."""
    if ids.dim() == 2:
        rows = ids
        valid = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        w = weights
    else:
        n = batch
        starts = offsets[:n].to(ids.device)
        ends = torch.cat([starts[1:], torch.tensor([ids.numel()], device=ids.device)])
        if module.include_last_offset:
            ends[-1] = offsets[n].to(ids.device)
        lengths = (ends - starts).clamp_min(0)
        width = max(int(lengths.max()) if n else 1, 1)
        r = torch.arange(ids.numel(), device=ids.device)
        owner = (torch.searchsorted(starts, r, right=True) - 1).clamp_min(0)
        pos = r - starts[owner]
        keep = pos < lengths[owner]  # (ids past the last offset of include_last_offset belong to no bag)
        rows = ids.new_zeros(n, width)
        valid = torch.zeros(n, width, dtype=torch.bool, device=ids.device)
        rows[owner[keep], pos[keep]] = ids[keep]
        valid[owner[keep], pos[keep]] = True
        w = None
        if weights is not None:
            w = weights.new_zeros(n, width)
            w[owner[keep], pos[keep]] = weights[keep]
    if module.padding_idx is not None:
        valid = valid & (rows != module.padding_idx)
    share = valid.to(torch.float64 if w is None else w.dtype)
    if module.mode == "mean":
        share = share / share.sum(1, keepdim=True).clamp_min(1)
    if w is not None:
        share = share * w
    return rows, share
