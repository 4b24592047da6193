"""The tracked-window forward of ``nn.RNN``/``nn.LSTM``/``nn.GRU``.

The modules run one fused kernel over time, which hides the per-step uses of their weights.
During tracked windows they run :func:`rnn_forward` instead, an explicit loop over time in which
every parameter is used through batch-first ``F.linear`` calls (closed form: the input weights
once over all positions, the recurrent weights one use per time step, which the Lens concatenates
into one sequence use). Untracked windows keep the modules' own (fused) forwards. Results equal
the modules' own to rounding. Registered by :mod:`gradlens.capture.registry`
(``register_forward``).

A ``PackedSequence`` input (a sample is a sequence) runs the same loop over its packed data:
time step t takes the first ``batch_sizes[t]`` sequences (sorted by length) of the hidden state,
the input weights one use over all rows of the data. The capture follows which sample each row
of the data and of the hidden state belongs to (:class:`gradlens.capture.rows.Rows`), so each
sample's gradient sums its own time steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.kernels.base import refuse_forward

PackedSequence = nn.utils.rnn.PackedSequence

__all__ = ["rnn_forward"]


_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def rnn_forward(self: nn.RNNBase, tap, input: Tensor, hx=None):
    """``nn.RNN``/``nn.LSTM``/``nn.GRU`` forward as an explicit loop over time with
    batch-first ``F.linear`` calls (the input weights once over all positions)."""
    if getattr(self, "proj_size", 0):
        refuse_forward(self, tap, "proj_size > 0")
    if isinstance(input, PackedSequence):
        return _packed_forward(self, tap, input, hx)
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
        _mark_state(tap, h0, c0)
    else:
        h0 = hx if batched else hx.unsqueeze(1)
        _mark_state(tap, h0)
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
                h, c = _cell(mode, act, gx[:, i], gh, h, c)
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


def _cell(mode: str, act, gi: Tensor, gh: Tensor, h: Tensor, c: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One time step of the cell from its input and hidden projections ``gi``, ``gh``."""
    if mode == "LSTM":
        ig, fg, gg, og = (gi + gh).chunk(4, dim=1)
        c = torch.sigmoid(fg) * c + torch.sigmoid(ig) * torch.tanh(gg)
        return torch.sigmoid(og) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, in_ = gi.chunk(3, dim=1)
        hr, hz, hn = gh.chunk(3, dim=1)
        r = torch.sigmoid(ir + hr)
        zg = torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - zg) * n + zg * h, None
    return act(gi + gh), None


def _mark_state(tap, *states: Tensor) -> None:
    """An initial state ``[layers * directions, B, H]`` given by the caller: its samples are on
    dim 1 (what the module's contract says), unless the capture already follows it."""
    for t in states:
        if isinstance(t, Tensor) and t.dim() == 3 and t not in tap._data and t.requires_grad:
            tap.mark_data(t, 1)


def _packed_forward(self: nn.RNNBase, tap, input: PackedSequence, hx=None):
    """The loop over time of :func:`rnn_forward` on a ``PackedSequence``: time step t uses the
    first ``batch_sizes[t]`` rows of the hidden state (sequences sorted by length); the output
    is packed like the input, the final states in the samples' order."""
    data, sizes, sorted_idx, unsorted_idx = input.data, input.batch_sizes, input.sorted_indices, input.unsorted_indices
    mode = self.mode
    lstm = mode == "LSTM"
    steps = [int(n) for n in sizes]  # (batch_sizes lives on the CPU)
    b = steps[0]
    starts = [0]
    for n in steps[:-1]:
        starts.append(starts[-1] + n)
    dirs = 2 if self.bidirectional else 1
    hs = self.hidden_size
    if hx is None:
        z = data.new_zeros(self.num_layers * dirs, b, hs)
        tap.mark_rows(z, 1, sorted_idx)  # the state's rows are the sequences in sorted order
        h0, c0 = z, z
    else:
        if lstm:
            h0, c0 = hx
            _mark_state(tap, h0, c0)
        else:
            h0, c0 = hx, None
            _mark_state(tap, h0)
        if sorted_idx is not None:  # the caller's states are in the samples' order
            h0 = h0.index_select(1, sorted_idx)
            c0 = c0.index_select(1, sorted_idx) if lstm else None
    act = torch.relu if mode == "RNN_RELU" else torch.tanh
    h_n, c_n = [], []
    layer_in = data
    for layer in range(self.num_layers):
        outs = []
        for d in range(dirs):
            sfx = f"_l{layer}" + ("_reverse" if d else "")
            w_ih, w_hh = getattr(self, "weight_ih" + sfx), getattr(self, "weight_hh" + sfx)
            b_ih = getattr(self, "bias_ih" + sfx) if self.bias else None
            b_hh = getattr(self, "bias_hh" + sfx) if self.bias else None
            gx = F.linear(layer_in, w_ih, b_ih)  # [rows, G*H], one use over every time step
            idx = layer * dirs + d
            hin = h0[idx]
            cin = c0[idx] if lstm else None
            rows = [None] * len(steps)
            if not d:
                h, c = hin, cin
                for t, n in enumerate(steps):
                    gh = F.linear(h[:n], w_hh, b_hh)
                    new_h, new_c = _cell(mode, act, gx[starts[t]:starts[t] + n], gh, h[:n], c[:n] if lstm else None)
                    rows[t] = new_h
                    h = torch.cat([new_h, h[n:]]) if n < b else new_h
                    if lstm:
                        c = torch.cat([new_c, c[n:]]) if n < b else new_c
            else:  # backwards in time: a sequence starts at its last step from the initial state
                h = c = None
                for t in range(len(steps) - 1, -1, -1):
                    n = steps[t]
                    have = 0 if h is None else h.shape[0]
                    if n > have:
                        h = hin[:n] if h is None else torch.cat([h, hin[have:n]])
                        if lstm:
                            c = cin[:n] if c is None else torch.cat([c, cin[have:n]])
                    gh = F.linear(h, w_hh, b_hh)
                    h, c = _cell(mode, act, gx[starts[t]:starts[t] + n], gh, h, c)
                    rows[t] = h
            outs.append(torch.cat(rows))
            h_n.append(h)
            if lstm:
                c_n.append(c)
        layer_in = torch.cat(outs, dim=1) if dirs == 2 else outs[0]
        if self.dropout and self.training and layer < self.num_layers - 1:
            layer_in = F.dropout(layer_in, p=self.dropout)
    hn = torch.stack(h_n)
    cn = torch.stack(c_n) if lstm else None
    if unsorted_idx is not None:
        hn = hn.index_select(1, unsorted_idx)
        cn = cn.index_select(1, unsorted_idx) if lstm else None
    out = PackedSequence(layer_in, sizes, sorted_idx, unsorted_idx)
    return out, ((hn, cn) if lstm else hn)
