"""The peers' per-sample-gradient grids, run through gradlens (docs/conformance.md).

Opacus' tests of its grad samplers (``opacus/tests/grad_samples``) draw shapes and layer options
with hypothesis; here every option of those grids is enumerated (sizes fixed small, varied
from row to row), written without importing Opacus: its DP layers are reproduced in
tests/peer_cases.py (an RNN that slices packed data per time step, attention written out with
learned key/value biases). Each row: K = 2 unequal micro-batches, an extended ``L1Loss`` of the
output against zeros (Opacus' criterion), reductions "mean" and "sum", against each sample alone
on a float64 copy (Opacus' micro-batch method). Every row is exact; the layers gradlens refuses
are listed in docs/conformance.md with the fix, and checked by tests/test_peer_layers.py.

The default suite runs one row in :data:`STEP` of each layer's grid; ``pytest -m slow`` runs all.
A test keeps docs/conformance.md's table equal to the grid (layers, options, row counts)."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_sequence

from peer_cases import Case, SequenceBias, SlicedRNN, WrittenAttention, check_case

STEP = 12  # the default suite's share of each grid: every STEP-th row

ROWS: list[Case] = []


def _tensor_inputs(shape_of):
    """inputs(n, gen) for one float tensor; one(inputs, i) picks sample i on ``dim``."""
    def inputs(n, gen):
        return (torch.randn(shape_of(n), generator=gen, dtype=torch.float64),)
    return inputs


def _pick(dim):
    def one(inputs, i):
        return (inputs[0].narrow(dim, i, 1),)
    return one


def _add(layer, settings, make, shape_of, dim=0, **kw):
    ROWS.append(Case("opacus", layer, settings, make, _tensor_inputs(shape_of), _pick(dim), batch_dim=dim, **kw))


# ---- nn.Linear: input_dim 2-4, bias, batch_first (input_dim 2 with batch_first only)
for k, (input_dim, bias, first) in enumerate(itertools.product((2, 3, 4), (True, False), (True, False))):
    if input_dim == 2 and not first:
        continue
    w, z, h = 10 + k % 8, 1 + k % 4, 1 + k % 3
    rest = {2: (w,), 3: (z, w), 4: (z, h, w)}[input_dim]
    shape = (lambda n, r=rest: (n, *r)) if first else (lambda n, r=rest: (r[0], n, *r[1:]))
    _add("nn.Linear", {"input_dim": input_dim, "bias": bias, "batch_first": first},
         lambda w=w, bias=bias: nn.Linear(w, w + 2, bias=bias), shape, 0 if first else 1)


# ---- convolutions: channels, expander / shrinker, kernel, stride, padding, dilation, groups
def _conv(cls, nd, sizes, paddings, kernels=(2, 3), strides=(1, 2), dilations=(1, 2)):
    for k, (c, out_mul, kernel, stride, pad, dil, grouped) in enumerate(itertools.product(
            (1, 3), (2, 0.5), kernels, strides, paddings, dilations, (False, True))):
        out = max(int(c * out_mul), 1)
        groups = c if grouped and out % c == 0 else 1
        if grouped and groups == 1:
            continue
        if pad == "same" and stride != 1:
            continue
        space = tuple(s + (k % 3) for s in sizes)
        settings = {"C": c, "out": out, "kernel": kernel, "stride": stride, "padding": pad, "dilation": dil,
                    "groups": groups}
        _add(f"nn.{cls.__name__}", settings,
             lambda c=c, out=out, kernel=kernel, stride=stride, pad=pad, dil=dil, groups=groups:
             cls(c, out, kernel, stride=stride, padding=pad, dilation=dil, groups=groups),
             lambda n, c=c, space=space: (n, c, *space))


_conv(nn.Conv1d, 1, (8,), (0, 1, 2, "same", "valid"))
_conv(nn.Conv2d, 2, (11, 12), (0, 2, "same", "valid"))
_conv(nn.Conv3d, 3, (3, 6, 6), (0, 2, (1, 2, 1), "same", "valid"), kernels=(2, (1, 2, 3)),
      strides=(1, (1, 2, 1)), dilations=(1, (1, 2, 2)))


# ---- norms
def _norm_shapes():
    for input_dim, norm_dim in itertools.product((2, 3, 4), (1, 2, 3)):
        if norm_dim >= input_dim:
            continue
        z, h, w = 3, 2, 6
        x = {2: (w,), 3: (z, w), 4: (z, h, w)}[input_dim]
        yield input_dim, norm_dim, x, list(x[-norm_dim:])


for input_dim, norm_dim, rest, norm in _norm_shapes():
    _add("nn.LayerNorm", {"input_dim": input_dim, "norm_dim": norm_dim},
         lambda norm=norm: nn.LayerNorm(norm), lambda n, r=rest: (n, *r))
    if hasattr(nn, "RMSNorm"):
        _add("nn.RMSNorm", {"input_dim": input_dim, "norm_dim": norm_dim},
             lambda norm=norm: nn.RMSNorm(norm), lambda n, r=rest: (n, *r))
for c, groups in itertools.product((1, 4, 8), (1, 4, "C")):
    g = c if groups == "C" else groups
    if c % g:
        continue
    _add("nn.GroupNorm", {"C": c, "num_groups": groups}, lambda g=g, c=c: nn.GroupNorm(g, c),
         lambda n, c=c: (n, c, 5, 4))
for cls, space in ((nn.InstanceNorm1d, (7,)), (nn.InstanceNorm2d, (5, 4)), (nn.InstanceNorm3d, (2, 4, 5))):
    for c in (1, 3):
        _add(f"nn.{cls.__name__}", {"C": c, "affine": True},
             lambda cls=cls, c=c: cls(c, affine=True, track_running_stats=False),
             lambda n, c=c, space=space: (n, c, *space))


# ---- nn.Embedding: input dims 2-4, batch_first
for dims, first in itertools.product((2, 3, 4), (True, False)):
    rest = {2: (5,), 3: (5, 3), 4: (5, 3, 2)}[dims]

    def ids(n, gen, rest=rest, first=first):
        shape = (n, *rest) if first else (rest[0], n, *rest[1:])
        return (torch.randint(0, 11, shape, generator=gen),)

    ROWS.append(Case("opacus", "nn.Embedding", {"dim": dims, "batch_first": first}, lambda: nn.Embedding(11, 12),
                     ids, _pick(0 if first else 1), batch_dim=0 if first else 1))


# ---- nn.EmbeddingBag: flat ids with offsets (a bag is a sample), modes
def _bags(n, gen):
    sizes = torch.randint(1, 5, (n,), generator=gen)
    ids = torch.cat([torch.randperm(13, generator=gen)[:int(s)] for s in sizes])
    return ((ids, torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), sizes[:-1]]), 0)),)


def _one_bag(inputs, i):
    ids, offs = inputs[0]
    end = offs[i + 1] if i + 1 < len(offs) else len(ids)
    return ((ids[offs[i]:end], torch.zeros(1, dtype=torch.long)),)


class Bag(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(13, 10, mode=mode)

    def forward(self, x):
        return self.bag(*x)


for mode in ("sum", "mean", "max"):
    ROWS.append(Case("opacus", "nn.EmbeddingBag", {"mode": mode}, lambda mode=mode: Bag(mode), _bags, _one_bag))


# ---- SequenceBias (the key/value bias of Opacus' attention): batch_first
for first in (True, False):
    _add("SequenceBias", {"batch_first": first}, lambda first=first: SequenceBias(5, first),
         (lambda n: (n, 7, 5)) if first else (lambda n: (7, n, 5)), 0 if first else 1)


# ---- attention: torch's nn.MultiheadAttention and the written-out one, [T, B, d] inputs
class Attn(nn.Module):
    """q, k, v stacked on the last dim of one input (Opacus' adapter)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        q, k, v = x.unbind(-1)
        out = self.inner(q, k, v)
        return out[0] if isinstance(out, tuple) else out


for kind, heads, bias, bias_kv, zero_attn in itertools.product(
        ("nn.MultiheadAttention", "written-out"), (1, 2), (True, False), (True, False), (True, False)):
    def make(kind=kind, heads=heads, bias=bias, bias_kv=bias_kv, zero_attn=zero_attn):
        if kind == "written-out":
            return Attn(WrittenAttention(4, heads, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn))
        m = nn.MultiheadAttention(4, heads, bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn)
        if bias_kv:
            with torch.no_grad():
                m.bias_k.normal_()
                m.bias_v.normal_()
        return Attn(m)
    _add(kind, {"heads": heads, "bias": bias, "add_bias_kv": bias_kv, "add_zero_attn": zero_attn}, make,
         lambda n: (5, n, 4, 3), 1)


# ---- recurrent layers: torch's and a DP-style one that slices packed data; packed or padded
def _seqs(n, gen, d, first, packed, sort):
    lengths = [1 + int(v) for v in torch.randint(0, 3, (n,), generator=gen)]
    if packed:
        if sort:
            lengths = sorted(lengths, reverse=True)
        seqs = [torch.randn(t, d, generator=gen, dtype=torch.float64) for t in lengths]
        return (pack_sequence(seqs, enforce_sorted=sort),)
    x = torch.randn((n, 3, d) if first else (3, n, d), generator=gen, dtype=torch.float64)
    return (x,)


def _one_seq(first, packed):
    def one(inputs, i):
        x = inputs[0]
        if packed:
            from peer_cases import unpack

            return (pack_sequence([unpack(x)[i]]),)
        return (x.narrow(0 if first else 1, i, 1),)
    return one


class Rnn(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        out = self.inner(x)
        return out[0] if isinstance(out, tuple) else out


for kind, layers, bias, first, bidi, packed, sort in itertools.product(
        ("nn.RNN", "nn.GRU", "nn.LSTM", "sliced-LSTM", "sliced-GRU"), (1, 2), (True, False), (True, False),
        (False, True), (False, True), (False, True)):
    if kind.startswith("sliced") and not packed:
        continue  # (the DP-style layer is written for packed data here)
    if sort and not packed:
        continue
    if packed and not first and kind.startswith("sliced"):
        continue

    def make(kind=kind, layers=layers, bias=bias, first=first, bidi=bidi):
        if kind.startswith("sliced"):
            return Rnn(SlicedRNN(4, 5, kind.split("-")[1].lower(), layers, bidi, bias))
        cls = getattr(nn, kind.split(".")[1])
        return Rnn(cls(4, 5, num_layers=layers, bias=bias, batch_first=first, bidirectional=bidi))

    ROWS.append(Case("opacus", kind, {"layers": layers, "bias": bias, "batch_first": first, "bidirectional": bidi,
                                      "packed": packed, "sorted": sort}, make,
                     lambda n, gen, first=first, packed=packed, sort=sort: _seqs(n, gen, 4, first, packed, sort),
                     _one_seq(first, packed), batch_dim=0 if (first or packed) else 1))


def _ids(rows):
    return [c.id for c in rows]


SPLITS = [(2, 1), (1, 3)]


def _params(rows):
    out = []
    for k, case in enumerate(rows):
        out.append(pytest.param(case, "mean" if k % 2 else "sum", SPLITS[k % 2], id=case.id))
    return out


def _default(rows):
    by_layer: dict[str, list] = {}
    for c in rows:
        by_layer.setdefault(c.layer, []).append(c)
    return [c for cs in by_layer.values() for c in cs[::STEP]]


@pytest.mark.parametrize("case, reduction, split", _params(_default(ROWS)))
def test_peer_grid_rows_are_exact(case, reduction, split):
    check_case(case, reduction, split)


@pytest.mark.slow
@pytest.mark.parametrize("case, reduction, split", _params(ROWS))
def test_every_peer_grid_row_is_exact_in_both_reductions(case, reduction, split):
    check_case(case, reduction, split)
    check_case(case, "sum" if reduction == "mean" else "mean", split)


def test_the_conformance_page_lists_the_grid():
    """docs/conformance.md's table: one line per layer with its options and row count, as
    :data:`ROWS` holds them, every row exact."""
    page = (pathlib.Path(__file__).parents[1] / "docs" / "conformance.md").read_text()
    table = {}
    for line in page.splitlines():
        m = re.match(r"\| `([^`]+)` \| (.+?) \| (\d+) \| exact \|$", line)
        if m:
            table[m.group(1)] = (set(re.findall(r"`(\w+)`", m.group(2))), int(m.group(3)))
    want: dict[str, tuple[set, int]] = {}
    for c in ROWS:
        opts, n = want.get(c.layer, (set(), 0))
        want[c.layer] = (opts | set(c.settings), n + 1)
    assert table == want
