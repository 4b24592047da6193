"""The tracked-window forward of ``nn.MultiheadAttention``.

The module merges the batch with the heads and flattens positions before its output projection,
which hides the sample axis. During tracked windows it runs :func:`mha_forward` instead, an
equivalent batch-first computation in which every parameter is used through ``F.linear`` on
``[B, T, d]`` (closed form: :class:`gradlens.kernels.linear.LinearKernel`). Untracked windows
keep the module's own (fused) forward. Results equal the module's own to rounding. Registered by
:mod:`gradlens.capture.registry` (``register_forward``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat
from gradlens.kernels.base import refuse_forward

__all__ = ["mha_forward"]


def _merge_masks(attn_mask, key_padding_mask, b, h, t, s, dtype, device, is_causal) -> Tensor | None:
    """An additive float mask ``[B or 1, H or 1, T, S]`` (None: no mask)."""
    mask = None
    if attn_mask is not None:
        m = attn_mask
        if m.dtype == torch.bool:
            m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill(m, float("-inf"))
        else:
            m = m.to(dtype)
        mask = m.view(1, 1, t, s) if m.dim() == 2 else m.view(b, h, t, s)
    elif is_causal:
        causal = torch.ones(t, s, dtype=torch.bool, device=device).triu(1)
        mask = torch.zeros(t, s, dtype=dtype, device=device).masked_fill(causal, float("-inf")).view(1, 1, t, s)
    if key_padding_mask is not None:
        k = key_padding_mask
        if k.dtype == torch.bool:
            k = torch.zeros(k.shape, dtype=dtype, device=k.device).masked_fill(k, float("-inf"))
        else:
            k = k.to(dtype)
        k = k.view(b, 1, 1, s)
        mask = k if mask is None else mask + k
    return mask


def mha_forward(
    self: nn.MultiheadAttention,
    tap,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None = None,
    need_weights: bool = True,
    attn_mask: Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
):
    """``nn.MultiheadAttention.forward`` with batch-first ``F.linear`` projections. With
    ``add_bias_kv`` the learned ``bias_k`` / ``bias_v`` join every sample's keys and values as one
    more position (a concatenation with the batch: an exact per-operation use); with
    ``add_zero_attn`` a position of zeros follows; masks let both through, as the module's own
    forward does."""
    batched = query.dim() == 3
    same = query is key and key is value
    if not batched:  # [T, E]: one sample
        query, key, value = (x.unsqueeze(0) for x in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not self.batch_first:
        query, key, value = (x.transpose(0, 1) for x in (query, key, value))
    b, t, e = query.shape
    s = key.shape[1]
    h = self.num_heads
    hd = e // h
    if compat.mha_packed_in_proj(self):
        w, bias = self.in_proj_weight, self.in_proj_bias
        if same:
            q, k, v = F.linear(query, w, bias).chunk(3, dim=-1)
        else:
            ws = w.chunk(3)
            bs = bias.chunk(3) if bias is not None else (None, None, None)
            q, k, v = (F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), ws, bs))
    else:
        bs = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q = F.linear(query, self.q_proj_weight, bs[0])
        k = F.linear(key, self.k_proj_weight, bs[1])
        v = F.linear(value, self.v_proj_weight, bs[2])
    extra = 0  # positions added after the keys: the bias, the zeros
    if self.bias_k is not None:
        k = torch.cat([k, self.bias_k.reshape(1, 1, e).expand(b, 1, e)], dim=1)
        v = torch.cat([v, self.bias_v.reshape(1, 1, e).expand(b, 1, e)], dim=1)
        extra += 1
    q = q.reshape(b, t, h, hd).transpose(1, 2)
    k = k.reshape(b, s + extra, h, hd).transpose(1, 2)
    v = v.reshape(b, s + extra, h, hd).transpose(1, 2)
    if self.add_zero_attn:
        k = torch.cat([k, k.new_zeros(b, h, 1, hd)], dim=2)
        v = torch.cat([v, v.new_zeros(b, h, 1, hd)], dim=2)
        extra += 1
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.reshape(b, h, t, s)
    mask = _merge_masks(attn_mask, key_padding_mask, b, h, t, s, q.dtype, q.device, is_causal)
    if extra and mask is not None:  # the added positions are never masked
        mask = F.pad(mask, (0, extra))
    p = self.dropout if self.training else 0.0
    weights = None
    if need_weights:
        scores = (q / math.sqrt(hd)) @ k.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        attn = torch.softmax(scores, dim=-1)
        weights = attn.mean(1) if average_attn_weights else attn
        if p > 0:
            attn = F.dropout(attn, p=p)
        out = attn @ v
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
    out = out.transpose(1, 2).reshape(b, t, e)
    out = F.linear(out, self.out_proj.weight, self.out_proj.bias)
    if not batched:
        out = out.squeeze(0)
        weights = weights.squeeze(0) if weights is not None else None
    elif not self.batch_first:
        out = out.transpose(0, 1)
    return out, weights
