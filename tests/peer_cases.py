"""Layers as the peers (Opacus, BackPACK) test them, written here without importing them: the
shapes and options of their per-sample-gradient grids, a DP-style recurrent layer that loops
over the slices of packed data itself (as Opacus' ``DPRNN`` does), a written-out attention with
learned key/value biases (as its ``DPMultiheadAttention`` + ``SequenceBias``), and the oracle
they use: each sample alone through a float64 deep copy taken before ``gradlens.extend``, its
loss the same reduction of its own output (``L1Loss`` against zeros, Opacus' criterion).

Used by tests/test_peer_layers.py and tests/test_conformance.py."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_sequence

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, SumGradSquared


# ---------------------------------------------------------------------------- DP-style layers
class SlicedCell(nn.Module):
    """An RNN / GRU / LSTM cell of two ``nn.Linear`` (input and hidden projections) that takes
    the first ``bs`` rows of its state (a packed time step)."""

    def __init__(self, d: int, h: int, mode: str, bias: bool = True):
        super().__init__()
        k = {"rnn": 1, "gru": 3, "lstm": 4}[mode]
        self.mode, self.h = mode, h
        self.ih = nn.Linear(d, k * h, bias=bias)
        self.hh = nn.Linear(h, k * h, bias=bias)

    def forward(self, x: Tensor, state: tuple[Tensor, Tensor], bs: int):
        h, c = state
        gx, gh = self.ih(x), self.hh(h[:bs])
        if self.mode == "rnn":
            return torch.tanh(gx + gh), c
        if self.mode == "gru":
            r1, z1, n1 = torch.split(gx, self.h, 1)
            r2, z2, n2 = torch.split(gh, self.h, 1)
            r = torch.sigmoid(r1 + r2)
            z = torch.sigmoid(z1 + z2)
            n = torch.tanh(n1 + r * n2)
            return (1 - z) * n + z * h[:bs], c
        i, f, g, o = torch.split(gx + gh, self.h, 1)
        c = torch.sigmoid(f) * c[:bs] + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c


class SlicedRNN(nn.Module):
    """A multi-layer, optionally bidirectional RNN on a ``PackedSequence`` that loops over the
    time steps of the packed data itself: ``data.split(batch_sizes)``, the state's first
    ``batch_sizes[t]`` rows per step, zero initial states made as constants (``torch.zeros``)
    and joined to the state where a sequence starts (the reverse direction): the pattern of
    Opacus' ``DPRNN``. Returns the output ``PackedSequence``."""

    def __init__(self, d: int, h: int, mode: str = "lstm", layers: int = 1, bidirectional: bool = False,
                 bias: bool = True):
        super().__init__()
        dirs = 2 if bidirectional else 1
        self.h, self.dirs, self.layers = h, dirs, layers
        self.cells = nn.ModuleList(
            SlicedCell(d if layer == 0 else h * dirs, h, mode, bias) for layer in range(layers) for _ in range(dirs))

    def _direction(self, xs, sizes, cell, reverse):
        b = sizes[0]
        dtype = xs[0].dtype
        h0, c0 = torch.zeros(b, self.h, dtype=dtype), torch.zeros(b, self.h, dtype=dtype)
        if reverse:
            xs, sizes = xs[::-1], sizes[::-1]
        outs = []
        prev = sizes[0] if reverse else b
        h, c = (h0[:prev], c0[:prev]) if reverse else (h0, c0)
        for t, bs in enumerate(sizes):
            if bs > prev:  # sequences that start here (backwards in time): their initial state
                h, c = torch.cat((h, h0[prev:bs]), 0), torch.cat((c, c0[prev:bs]), 0)
            nh, nc = cell(xs[t], (h, c), bs)
            outs.append(nh)
            if reverse:
                h, c = nh, nc
            else:
                h, c = torch.cat([nh, h[bs:]]), torch.cat([nc, c[bs:]])
            prev = bs
        return outs[::-1] if reverse else outs

    def forward(self, packed: PackedSequence) -> PackedSequence:
        sizes = [int(n) for n in packed.batch_sizes]
        xs = packed.data.split(sizes)
        for layer in range(self.layers):
            outs = [self._direction(xs, sizes, self.cells[layer * self.dirs + d], d == 1) for d in range(self.dirs)]
            xs = [torch.cat([o[t] for o in outs], 1) for t in range(len(sizes))]
        return PackedSequence(torch.cat(xs), packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)


class SequenceBias(nn.Module):
    """A learned ``[d]`` vector appended to every sequence of a ``[T, B, d]`` input (Opacus'
    ``SequenceBias``: the ``add_bias_kv`` of its attention)."""

    def __init__(self, d: int, batch_first: bool = False):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(d))
        self.batch_first = batch_first

    def forward(self, x: Tensor) -> Tensor:
        if self.batch_first:
            return torch.cat([x, self.bias.expand(x.shape[0], 1, -1)], 1)
        return torch.cat([x, self.bias.expand(1, x.shape[1], -1)], 0)


class WrittenAttention(nn.Module):
    """Multi-head attention written out with ``nn.Linear`` projections on ``[T, B, d]`` (the
    computation of Opacus' ``DPMultiheadAttention``), with ``add_bias_kv`` (a
    :class:`SequenceBias` on keys and values) and ``add_zero_attn``."""

    def __init__(self, d: int, heads: int, bias: bool = True, add_bias_kv: bool = False, add_zero_attn: bool = False,
                 kdim: int | None = None, vdim: int | None = None):
        super().__init__()
        self.d, self.heads = d, heads
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(kdim or d, d, bias=bias)
        self.v = nn.Linear(vdim or d, d, bias=bias)
        self.out = nn.Linear(d, d, bias=bias)
        self.bk = SequenceBias(d) if add_bias_kv else None
        self.bv = SequenceBias(d) if add_bias_kv else None
        self.zero = add_zero_attn

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        t, b, d = q.shape
        hd = d // self.heads
        q, k, v = self.q(q), self.k(k), self.v(v)
        if self.bk is not None:
            k, v = self.bk(k), self.bv(v)
        q = q.reshape(t, b * self.heads, hd).transpose(0, 1) / hd ** 0.5
        k = k.reshape(k.shape[0], b * self.heads, hd).transpose(0, 1)
        v = v.reshape(v.shape[0], b * self.heads, hd).transpose(0, 1)
        if self.zero:
            k = torch.cat([k, k.new_zeros(b * self.heads, 1, hd)], 1)
            v = torch.cat([v, v.new_zeros(b * self.heads, 1, hd)], 1)
        att = torch.softmax(q @ k.transpose(1, 2), -1) @ v
        return self.out(att.transpose(0, 1).reshape(t, b, d))


# ---------------------------------------------------------------------------- the oracle
@dataclass
class Case:
    """One setting of a peer's grid: ``make()`` -> the module (float64), ``inputs(n, gen)`` ->
    the model's inputs for ``n`` samples, ``one(inputs, i)`` -> sample i's inputs alone, the
    samples' dim of those inputs (``batch_dim``), the outcome gradlens documents."""

    peer: str
    layer: str
    settings: dict
    make: Callable[[], nn.Module]
    inputs: Callable[[int, torch.Generator], tuple]
    one: Callable[[tuple, int], tuple]
    batch_dim: int = 0
    outcome: str = "exact"
    #: per input, the dim its samples are joined on (None: one value shared by all samples, a
    #: mask); default: ``batch_dim`` for every tensor
    join_dims: tuple | None = None

    @property
    def id(self) -> str:
        return f"{self.peer}-{self.layer}-" + "-".join(f"{k}={v}" for k, v in self.settings.items())


def _out(y: Any) -> Tensor:
    if isinstance(y, tuple) and not isinstance(y, PackedSequence):
        y = y[0]
    return y.data if isinstance(y, PackedSequence) else y


def loss_of(out: Any, reduction: str) -> Tensor:
    y = _out(out)
    return F.l1_loss(y, torch.zeros_like(y), reduction=reduction)


def oracle(case: Case, model: nn.Module, inputs: tuple, split: tuple, reduction: str) -> Tensor:
    """[N, D] per-sample gradients, each sample alone (the micro-batch method), in the units of
    docs/design.md: under a mean objective g_n = B_k * dL_n, L_n being sample n's share of its
    micro-batch's mean over all output elements (E_k of them, E_n its own): the gradient of the
    mean over its own elements times B_k E_n / E_k (1 where every sample has as many; packed
    sequences of several lengths differ)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows, start = [], 0
    for b in split:
        parts = []
        for i in range(start, start + b):
            out = _out(model(*case.one(inputs, i)))
            parts.append((out, F.l1_loss(out, torch.zeros_like(out), reduction=reduction)))
        total = sum(o.numel() for o, _ in parts)
        for out, loss in parts:
            if reduction == "mean":
                loss = loss * (b * out.numel() / total)
            g = torch.autograd.grad(loss, params, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if v is None else v).reshape(-1) for p, v in zip(params, g)]))
        start += b
    return torch.stack(rows)


def split_inputs(case: Case, inputs: tuple, start: int, size: int) -> tuple:
    """Samples ``start:start + size`` of the inputs (each sample via ``case.one``, joined)."""
    parts = [case.one(inputs, i) for i in range(start, start + size)]
    return join(parts, case.batch_dim, case.join_dims)


def join(parts: list[tuple], dim: int, dims: tuple | None = None) -> tuple:
    out = []
    for k, items in enumerate(zip(*parts)):
        first = items[0]
        if dims is not None and dims[k] is None:
            out.append(first)  # shared by every sample
        elif isinstance(first, PackedSequence):
            seqs = []
            for p in items:
                seqs.extend(unpack(p))
            out.append(pack_sequence(seqs, enforce_sorted=False))
        elif isinstance(first, tuple):  # (ids, offsets) of a bag
            ids = torch.cat([p[0] for p in items])
            offs = torch.cumsum(torch.tensor([0] + [p[0].numel() for p in items[:-1]]), 0)
            out.append((ids, offs))
        elif isinstance(first, Tensor):
            out.append(torch.cat(items, dim if dims is None else dims[k]))
        else:
            out.append(first)
    return tuple(out)


def unpack(p: PackedSequence) -> list[Tensor]:
    padded, lengths = nn.utils.rnn.pad_packed_sequence(p, batch_first=True)
    return [padded[i, :int(lengths[i])] for i in range(len(lengths))]


def run_case(case: Case, reduction: str, split: tuple, instruments=None) -> tuple[Any, Tensor]:
    """(record, oracle [N, D]) of ``case`` over micro-batches of sizes ``split``, its loss an
    extended ``L1Loss`` (the peers' criterion) of the model's output against zeros."""
    torch.manual_seed(0)
    base = case.make().double()
    ref = copy.deepcopy(base)
    n = sum(split)
    gen = torch.Generator().manual_seed(1)
    inputs = case.inputs(n, gen)
    model = gradlens.extend(base, batch_dim=case.batch_dim if case.batch_dim else None)
    loss_fn = gradlens.extend(nn.L1Loss(reduction=reduction))
    lens = Lens(model, instruments or [BatchL2(), SumGradSquared()])
    try:
        start = 0
        for b in split:
            part = split_inputs(case, inputs, start, b)
            y = _out(model(*part))
            loss = loss_fn(y, torch.zeros_like(y))
            with lens.capture():
                loss.backward()
            start += b
        rec = lens.flush()
    finally:
        lens.close()
    return rec, oracle(case, ref, inputs, split, reduction)


def check_case(case: Case, reduction: str, split: tuple) -> None:
    rec, G = run_case(case, reduction, split)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-9, atol=1e-12)
    want = G.square().sum(0)
    got = torch.cat([rec["sum_grad_squared"][q].reshape(-1)
                     for q, p in case.make().named_parameters() if p.requires_grad])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


__all__ = ["Case", "SlicedRNN", "SlicedCell", "SequenceBias", "WrittenAttention", "run_case", "check_case",
           "oracle", "loss_of", "join", "unpack"]
