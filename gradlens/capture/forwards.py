"""Tracked-window forwards of modules whose inner layout hides the sample axis.

``nn.MultiheadAttention`` merges the batch with the heads and flattens positions before its
output projection; ``nn.RNN``/``LSTM``/``GRU`` run one fused kernel over time. During tracked
windows they run these equivalent batch-first computations instead, so that every parameter is
used through ``F.linear`` on ``[B, T, d]`` (closed form; the recurrent weights are one use per
time step, which the Lens concatenates into one sequence use). Untracked windows keep the
modules' own (fused) forwards. Results equal the modules' own to rounding.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat

__all__ = ["mha_forward", "rnn_forward"]


def _refuse(module: nn.Module, tap, what: str) -> None:
    name = tap.name_of(module)
    raise NotImplementedError(
        f"gradlens: {type(module).__name__} {name!r} with {what} has no tracked-window forward; "
        f"leave its parameters out: Lens(..., exclude=[{name!r}])"
    )


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
    """``nn.MultiheadAttention.forward`` with batch-first ``F.linear`` projections."""
    if self.bias_k is not None or self.add_zero_attn:
        _refuse(self, tap, "add_bias_kv or add_zero_attn")
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
    q = q.reshape(b, t, h, hd).transpose(1, 2)
    k = k.reshape(b, s, h, hd).transpose(1, 2)
    v = v.reshape(b, s, h, hd).transpose(1, 2)
    if attn_mask is not None and attn_mask.dim() == 3:
        attn_mask = attn_mask.reshape(b, h, t, s)
    mask = _merge_masks(attn_mask, key_padding_mask, b, h, t, s, q.dtype, q.device, is_causal)
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


_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def rnn_forward(self: nn.RNNBase, tap, input: Tensor, hx=None):
    """``nn.RNN``/``nn.LSTM``/``nn.GRU`` forward as an explicit loop over time with
    batch-first ``F.linear`` calls (the input weights once over all positions)."""
    if isinstance(input, nn.utils.rnn.PackedSequence):
        _refuse(self, tap, "a PackedSequence input (pad the batch instead)")
    if getattr(self, "proj_size", 0):
        _refuse(self, tap, "proj_size > 0")
    mode = self.mode
    lstm = mode == "LSTM"
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(0 if self.batch_first else 1)
    if not self.batch_first:
        x = x.transpose(0, 1)  # [B, T, I]
    b, t = x.shape[0], x.shape[1]
    dirs = 2 if self.bidirectional else 1
    hs = self.hidden_size
    if hx is None:
        z = x.new_zeros(self.num_layers * dirs, b, hs)
        tap.mark_data(z, axis=1)
        h0, c0 = z, z
    elif lstm:
        h0, c0 = hx
        if not batched:
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
    else:
        h0 = hx if batched else hx.unsqueeze(1)
    act = torch.relu if mode == "RNN_RELU" else torch.tanh
    h_n, c_n = [], []
    layer_in = x
    for layer in range(self.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(self, "weight_ih" + sfx), getattr(self, "weight_hh" + sfx)
            b_ih = getattr(self, "bias_ih" + sfx) if self.bias else None
            b_hh = getattr(self, "bias_hh" + sfx) if self.bias else None
            gx = F.linear(layer_in, w_ih, b_ih)  # [B, T, G*H], one use over all positions
            idx = layer * dirs + d
            h = h0[idx]
            c = c0[idx] if lstm else None
            steps = range(t - 1, -1, -1) if d else range(t)
            seq = [None] * t
            for i in steps:
                gh = F.linear(h, w_hh, b_hh)
                gi = gx[:, i]
                if lstm:
                    ig, fg, gg, og = (gi + gh).chunk(4, dim=1)
                    c = torch.sigmoid(fg) * c + torch.sigmoid(ig) * torch.tanh(gg)
                    h = torch.sigmoid(og) * torch.tanh(c)
                elif mode == "GRU":
                    ir, iz, in_ = gi.chunk(3, dim=1)
                    hr, hz, hn = gh.chunk(3, dim=1)
                    r = torch.sigmoid(ir + hr)
                    zg = torch.sigmoid(iz + hz)
                    n = torch.tanh(in_ + r * hn)
                    h = (1 - zg) * n + zg * h
                else:
                    h = act(gi + gh)
                seq[i] = h
            outs.append(torch.stack(seq, dim=1))
            h_n.append(h)
            if lstm:
                c_n.append(c)
        layer_in = torch.cat(outs, dim=2) if dirs == 2 else outs[0]
        if self.dropout and self.training and layer < self.num_layers - 1:
            layer_in = F.dropout(layer_in, p=self.dropout)
    out = layer_in if self.batch_first else layer_in.transpose(0, 1)
    hn = torch.stack(h_n)
    cn = torch.stack(c_n) if lstm else None
    if not batched:
        out = out.squeeze(0 if self.batch_first else 1)
        hn = hn.squeeze(1)
        cn = cn.squeeze(1) if lstm else None
    return out, ((hn, cn) if lstm else hn)
