"""Issue 36, the peers' layers measured exactly (docs/conformance.md): sequence-first outputs
into an extended loss, MultiheadAttention with ``add_bias_kv`` / ``add_zero_attn`` and masks,
torch's RNNs on packed sequences (a sample is a sequence) with given initial states or packing
inside the model, layers that slice packed data themselves, and ``nn.EmbeddingBag`` with offsets
(a bag is a sample); with the refusals that remain and their fixes. Oracle: each sample alone on
a float64 deep copy taken before ``gradlens.extend`` (tests/peer_cases.py), K unequal
micro-batches, reductions "mean" and "sum"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, SumGradSquared

from peer_cases import Case, SlicedRNN, check_case, unpack

SPLIT = (3, 1, 2)


# ---------------------------------------------------------------------------- sequence-first
class SeqFirst(nn.Module):
    """[T, B, d] in and out: a Linear stack, an LSTM or a transformer layer (batch_first=False)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "lstm":
            self.body = nn.LSTM(4, 5)
        elif kind == "transformer":
            self.body = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0)
        else:
            self.body = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5))
        self.head = nn.Linear(5 if kind != "transformer" else 4, 3)

    def forward(self, x):
        h = self.body(x)
        return self.head(h[0] if isinstance(h, tuple) else h)


def _seq_case(kind, flat):
    def inputs(n, gen):
        return (torch.randn(5, n, 4, generator=gen, dtype=torch.float64),)

    return Case("gradlens", f"seq-first-{kind}", {"flat": flat}, lambda: SeqFirst(kind), inputs,
                lambda inp, i: (inp[0][:, i:i + 1],), batch_dim=1)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["linear", "lstm", "transformer"])
def test_sequence_first_outputs_into_an_extended_loss_are_exact(kind, reduction):
    """``extend(model, batch_dim=1)``: an extended loss takes the model's [T, B, ...] output."""
    check_case(_seq_case(kind, False), reduction, SPLIT)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_flattened_sequence_first_output_into_an_extended_loss_is_exact(reduction):
    """``loss_fn(out.reshape(-1, C), ...)`` of a [T, B, C] output: rows t * B + n of sample n."""
    torch.manual_seed(0)
    base = SeqFirst("lstm").double()
    ref = copy.deepcopy(base)
    model = gradlens.extend(base, batch_dim=1)
    loss_fn = gradlens.extend(nn.L1Loss(reduction=reduction))
    lens = Lens(model, [BatchL2()])
    x = torch.randn(5, sum(SPLIT), 4, dtype=torch.float64)
    start, rows = 0, []
    params = list(ref.parameters())
    for b in SPLIT:
        out = model(x[:, start:start + b])
        loss = loss_fn(out.reshape(-1, 3), torch.zeros(5 * b, 3, dtype=torch.float64))
        with lens.capture():
            loss.backward()
        for i in range(b):
            o = ref(x[:, start + i:start + i + 1]).abs().sum()
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(o / (5 * 3) if reduction == "mean" else o,
                                                                                params)]))
        start += b
    G = torch.stack(rows)
    torch.testing.assert_close(lens.flush()["batch_l2"], G.square().sum(1), rtol=1e-9, atol=1e-12)
    lens.close()


def test_an_undeclared_sequence_first_output_is_refused_naming_batch_dim():
    """Without the declaration dim 0 of the model's input is read as the samples, which its
    LSTM contradicts: the error names the fix, which works as written."""
    torch.manual_seed(0)
    model = gradlens.extend(SeqFirst("lstm").double())  # (its LSTM says batch_first=False)
    loss_fn = gradlens.extend(nn.L1Loss())
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    lens = Lens(model, [BatchL2()])
    out = model(x)
    loss = loss_fn(out.reshape(-1, 3), torch.zeros(15, 3, dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"gradlens\.extend\(model, batch_dim=1\)"):
        with lens.capture():
            loss.backward()
    lens.close()
    model = gradlens.extend(model, batch_dim=1)  # the fix, as written
    lens = Lens(model, [BatchL2()])
    out = model(x)
    loss = loss_fn(out.reshape(-1, 3), torch.zeros(15, 3, dtype=torch.float64))
    with lens.capture():
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (3,)
    lens.close()


# ---------------------------------------------------------------------------- attention
class MHA(nn.Module):
    def __init__(self, bias_kv, zero_attn, kdim, batch_first):
        super().__init__()
        self.m = nn.MultiheadAttention(4, 2, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=kdim,
                                       batch_first=batch_first)
        if bias_kv:
            with torch.no_grad():
                self.m.bias_k.normal_()
                self.m.bias_v.normal_()

    def forward(self, q, k, v, kpm, am):
        return self.m(q, k, v, key_padding_mask=kpm, attn_mask=am)[0]


@pytest.mark.parametrize("mask", [None, "key_padding", "attn_bool", "attn_float", "attn_3d"])
@pytest.mark.parametrize("bias_kv, zero_attn", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("batch_first, kdim", [(True, None), (False, 3)])
def test_multihead_attention_with_bias_kv_and_zero_attn_is_exact(bias_kv, zero_attn, batch_first, kdim, mask):
    d_k = kdim or 4
    heads = 2

    def inputs(n, gen):
        q = torch.randn(n, 3, 4, generator=gen, dtype=torch.float64)
        k = torch.randn(n, 4, d_k, generator=gen, dtype=torch.float64)
        v = torch.randn(n, 4, d_k, generator=gen, dtype=torch.float64)
        kpm = (torch.rand(n, 4, generator=gen) < 0.4) if mask == "key_padding" else None
        if kpm is not None:
            kpm[:, 0] = False
        am = None
        if mask == "attn_bool":
            am = torch.rand(3, 4, generator=gen) < 0.4
            am[:, 0] = False
        elif mask == "attn_float":
            am = torch.randn(3, 4, generator=gen, dtype=torch.float64)
        elif mask == "attn_3d":
            am = torch.randn(n * heads, 3, 4, generator=gen, dtype=torch.float64)
        if not batch_first:
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        return (q, k, v, kpm, am)

    def one(inp, i):
        q, k, v, kpm, am = inp
        pick = (lambda t: t[i:i + 1]) if batch_first else (lambda t: t[:, i:i + 1])
        am_i = am[i * heads:(i + 1) * heads] if am is not None and am.dim() == 3 else am
        return (pick(q), pick(k), pick(v), None if kpm is None else kpm[i:i + 1], am_i)

    bd = 0 if batch_first else 1
    case = Case("gradlens", "mha", {}, lambda: MHA(bias_kv, zero_attn, kdim, batch_first), inputs, one,
                batch_dim=bd, join_dims=(bd, bd, bd, 0, 0 if mask == "attn_3d" else None))
    check_case(case, "mean", (2, 1))


# ---------------------------------------------------------------------------- packed sequences
class PackInside(nn.Module):
    """Padded [B, T, d] input and lengths, packed inside (unsorted), an LSTM, unpacked."""

    def __init__(self, bidirectional):
        super().__init__()
        self.rnn = nn.LSTM(3, 4, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(4 * (2 if bidirectional else 1), 2)

    def forward(self, x, lengths):
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(padded).sum(1)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_packing_inside_the_model_is_followed_through_sort_pack_and_unsort(bidirectional):
    def inputs(n, gen):
        lengths = torch.tensor([1 + (3 * i) % 4 for i in range(n)])
        return (torch.randn(n, 4, 3, generator=gen, dtype=torch.float64), lengths)

    case = Case("gradlens", "pack-inside", {}, lambda: PackInside(bidirectional), inputs,
                lambda inp, i: (inp[0][i:i + 1], inp[1][i:i + 1]))
    check_case(case, "sum", SPLIT)
    check_case(case, "mean", SPLIT)


class GivenState(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(3, 4, num_layers=2)
        self.h0 = nn.Linear(3, 4)

    def forward(self, packed, first):
        h0 = torch.tanh(self.h0(first)).unsqueeze(0).expand(2, -1, -1).contiguous()
        state = (h0, h0 * 0.5) if isinstance(self.rnn, nn.LSTM) else h0
        return self.rnn(packed, state)[0]


@pytest.mark.parametrize("cls", [nn.GRU, nn.LSTM])
def test_a_packed_rnn_with_initial_states_from_the_batch_is_exact(cls):
    """The caller's initial states ([layers, B, H], in the samples' order) are permuted to the
    packed order as the module does; their parameters are measured too."""
    def inputs(n, gen):
        seqs = [torch.randn(1 + (2 * i) % 3, 3, generator=gen, dtype=torch.float64) for i in range(n)]
        return (pack_sequence(seqs, enforce_sorted=False), torch.randn(n, 3, generator=gen, dtype=torch.float64))

    def one(inp, i):
        return (pack_sequence([unpack(inp[0])[i]]), inp[1][i:i + 1])

    case = Case("gradlens", "given-state", {}, lambda: GivenState(cls), inputs, one)
    check_case(case, "sum", SPLIT)


def test_rows_of_a_constant_that_no_sample_claims_are_refused_naming_the_fix():
    """A constant joined to the batch's rows and used by a layer before any sample's row meets
    it: refused in backward, naming the use and the fix."""
    torch.manual_seed(0)

    class Pad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = torch.cat([x, torch.zeros(2, 3, dtype=x.dtype)])
            return self.lin(h)[: len(x)]

    model = gradlens.extend(Pad().double())
    lens = Lens(model, [BatchL2()])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    loss = model(x).sum()
    with pytest.raises(RuntimeError, match=r"cannot measure the use 'lin': .* hold no sample.*zeros_like.*exclude"):
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
    lens.close()


def test_an_rnn_with_proj_size_is_refused_and_the_fix_works():
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(3, 3)).double())

    class Proj(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(3, 4, proj_size=2, batch_first=True)
            self.head = nn.Linear(2, 2)

        def forward(self, x):
            return self.head(self.rnn(x)[0]).sum(1)

    model = gradlens.extend(Proj().double())
    x = torch.randn(3, 4, 3, dtype=torch.float64)
    lens = Lens(model, [BatchL2()])
    with pytest.raises(NotImplementedError, match=r"proj_size > 0 .* Lens\(\.\.\., exclude=\['rnn'\]\)"):
        model(x)
    lens.close()
    lens = Lens(model, [BatchL2()], exclude=["rnn"])  # the fix, as written
    loss = model(x).sum()
    with lens.capture(reduction="sum", loss=loss):
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (3,)
    lens.close()


@pytest.mark.parametrize("mode", ["rnn", "gru", "lstm"])
def test_a_layer_that_slices_packed_data_itself_is_exact(mode):
    """The DP-style loop (tests/peer_cases.py, SlicedRNN), bidirectional, two layers."""
    def inputs(n, gen):
        return (pack_sequence([torch.randn(1 + (3 * i) % 4, 3, generator=gen, dtype=torch.float64) for i in range(n)],
                              enforce_sorted=False),)

    case = Case("gradlens", "sliced", {}, lambda: SlicedRNN(3, 4, mode, 2, True), inputs,
                lambda inp, i: (pack_sequence([unpack(inp[0])[i]]),))
    check_case(case, "mean", SPLIT)


# ---------------------------------------------------------------------------- EmbeddingBag
class Bags(nn.Module):
    def __init__(self, mode, padding_idx=None, last=False):
        super().__init__()
        self.bag = nn.EmbeddingBag(10, 4, mode=mode, padding_idx=padding_idx, include_last_offset=last)
        self.head = nn.Linear(4, 2)

    def forward(self, ids, offsets=None, weights=None):
        return self.head(torch.tanh(self.bag(ids, offsets, per_sample_weights=weights)))


@pytest.mark.parametrize("mode, padding_idx, form", [
    ("sum", None, "flat"), ("mean", 2, "flat"), ("max", None, "flat"), ("sum", 3, "weights"),
    ("mean", None, "last_offset"), ("sum", 1, "rows"), ("mean", 2, "rows"), ("max", None, "rows"),
])
def test_embedding_bag_a_bag_is_a_sample(mode, padding_idx, form):
    sizes = [2, 3, 1, 4, 2, 1]

    def inputs(n, gen):
        if form == "rows":
            return (torch.randint(0, 10, (n, 3), generator=gen),)
        bags = [torch.randint(0, 10, (s,), generator=gen) for s in sizes[:n]]
        weights = [torch.rand(s, generator=gen, dtype=torch.float64) for s in sizes[:n]]
        return (bags, weights)

    def pack(bags, weights):
        ids = torch.cat(bags)
        offs = torch.cumsum(torch.tensor([0] + [len(b) for b in bags[:-1]]), 0)
        if form == "last_offset":
            offs = torch.cat([offs, torch.tensor([len(ids)])])
        return (ids, offs, torch.cat(weights) if form == "weights" else None)

    def one(inp, i):
        return (inp[0][i:i + 1],) if form == "rows" else pack(inp[0][i:i + 1], inp[1][i:i + 1])

    torch.manual_seed(0)
    base = Bags(mode, padding_idx, form == "last_offset").double()
    ref = copy.deepcopy(base)
    model = gradlens.extend(base)
    gen = torch.Generator().manual_seed(1)
    inp = inputs(sum(SPLIT), gen)
    lens = Lens(model, [BatchL2(), SumGradSquared()])
    start, rows = 0, []
    params = list(ref.parameters())
    for b in SPLIT:
        part = (inp[0][start:start + b],) if form == "rows" else pack(inp[0][start:start + b], inp[1][start:start + b])
        loss = F.l1_loss(model(*part), torch.zeros(b, 2, dtype=torch.float64), reduction="sum")
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
        for i in range(start, start + b):
            o = ref(*one(inp, i)).abs().sum()
            rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params)]))
        start += b
    rec = lens.flush()
    G = torch.stack(rows)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-9, atol=1e-12)
    got = torch.cat([rec["sum_grad_squared"][q].reshape(-1) for q, _ in ref.named_parameters()])
    torch.testing.assert_close(got, G.square().sum(0), rtol=1e-9, atol=1e-12)
    lens.close()
