"""The tracked-window forward of ``nn.RNN``/``nn.LSTM``/``nn.GRU``.

The modules run one fused kernel over time, which hides the per-step uses of their weights.
During tracked windows they run :func:`rnn_forward` instead, an explicit loop over time in which
every parameter is used through batch-first ``F.linear`` calls (closed form: the input weights
once over all positions, the recurrent weights one use per time step, which the Lens concatenates
into one sequence use). Untracked windows keep the modules' own (fused) forwards. Results equal
the modules' own to rounding. Registered by :mod:`gradlens.capture.registry`
(``register_forward``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.kernels.base import refuse_forward

__all__ = ["rnn_forward"]


_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def rnn_forward(self: nn.RNNBase, tap, input: Tensor, hx=None):
    """``nn.RNN``/``nn.LSTM``/``nn.GRU`` forward as an explicit loop over time with
    batch-first ``F.linear`` calls (the input weights once over all positions)."""
    if isinstance(input, nn.utils.rnn.PackedSequence):
        refuse_forward(self, tap, "a PackedSequence input (pad the batch instead)")
    if getattr(self, "proj_size", 0):
        refuse_forward(self, tap, "proj_size > 0")
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
