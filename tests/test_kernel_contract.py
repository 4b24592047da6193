"""Kernel contract suite: every registered kernel against a float64 ``torch.func`` oracle.

For each layer type in the registry (:data:`gradlens.capture.registry._KERNELS`, iterated, so a new
registration without a case here fails), a table of shapes builds the module (float64), an
input ``a [B, ...]`` and an output gradient ``delta [B, ...]``. The oracle is
``vmap(grad(<m(x_n), delta_n>))`` of the layer's own forward, one sample at a time (for layers
that mix samples, the same VJP of the batch forward with one sample's output gradient); it never
calls gradlens. Every method a kernel offers is compared: the per-sample slices and their sums,
the sampled entries, the outer factors, the stacked sums of several uses, and the cross-micro-step maths (factor forms, Gram,
projections, sketches). So are the capture's fast paths a kernel declares on its class: samples
of several rows (``rows_per_sample``), the call's own autograd node as its dL/dp
(``routes_param_grads``), and the fused forward of its layer classes (``fused_layers``).
Mismatches of one layer type are collected and reported together.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

import gradlens.kernels as K
from gradlens.core.stats import Accumulators
from gradlens.capture.registry import _KERNELS, _display

DT = torch.float64
TOL = dict(rtol=1e-9, atol=1e-10)


class Conv1D(nn.Module):
    """A stand-in for Hugging Face's ``transformers.pytorch_utils.Conv1D`` (not installed
    here): ``y = x @ W + b`` with ``W [d_in, d_out]``, computed as that class does (one
    ``addmm`` of the rows, then a view), so that its autograd node is the real one's."""

    def __init__(self, d_out: int, d_in: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_in, d_out))
        self.bias = nn.Parameter(torch.randn(d_out))

    def forward(self, x: Tensor) -> Tensor:
        rows = torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight)
        return rows.view(*x.shape[:-1], rows.shape[-1])


@dataclass
class Case:
    """One shape: ``make()`` -> module (float64 after the suite casts it), ``shape`` of the
    input ``[B, ...]``; ``index`` > 0: integer inputs below it (Embedding)."""

    name: str
    make: Callable[[], nn.Module]
    shape: tuple[int, ...]
    index: int = 0
    #: the shapes of further inputs of a layer with several (``nn.Bilinear``: ``x2``); the
    #: kernel then gets them joined (:meth:`Kernel.join_inputs`)
    more: tuple[tuple[int, ...], ...] = ()


def _bn_eval(cls, c, **kw):
    def make():
        m = cls(c, **kw)
        with torch.no_grad():
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.uniform_(0.5, 1.5)
            m.bias.uniform_(-0.2, 0.2)
        return m.eval()
    return make


def _no_bias_grad(m: nn.Module) -> nn.Module:
    m.bias.requires_grad_(False)
    return m


#: registry key -> the shapes every kernel it hands out is checked on
CASES: dict[type | str, list[Case]] = {
    nn.Bilinear: [
        Case("flat", lambda: nn.Bilinear(4, 3, 5), (3, 4), more=((3, 3),)),
        Case("B1", lambda: nn.Bilinear(2, 3, 2), (1, 2), more=((1, 3),)),
        Case("no-bias", lambda: nn.Bilinear(3, 2, 4, bias=False), (4, 3), more=((4, 2),)),
        Case("seq", lambda: nn.Bilinear(3, 2, 2), (3, 4, 3), more=((3, 4, 2),)),
        Case("two-axes", lambda: nn.Bilinear(2, 3, 3), (2, 2, 3, 2), more=((2, 2, 3, 3),)),
        Case("bias-frozen", lambda: _no_bias_grad(nn.Bilinear(3, 3, 2)), (3, 2, 3), more=((3, 2, 3),)),
    ],
    nn.Linear: [
        Case("B1", lambda: nn.Linear(4, 3), (1, 4)),
        Case("no-bias", lambda: nn.Linear(4, 3, bias=False), (3, 4)),
        Case("seq", lambda: nn.Linear(5, 6), (4, 3, 5)),  # T x T Gram cheaper
        Case("seq-long", lambda: nn.Linear(2, 3), (3, 6, 2)),  # materialised norms and Gram
        Case("two-axes", lambda: nn.Linear(3, 2), (2, 2, 3, 3)),
        Case("bias-frozen", lambda: _no_bias_grad(nn.Linear(4, 3)), (3, 2, 4)),
    ],
    "transformers.pytorch_utils.Conv1D": [
        Case("flat", lambda: Conv1D(3, 4), (3, 4)),
        Case("seq", lambda: Conv1D(6, 5), (2, 3, 5)),
        Case("seq-long", lambda: Conv1D(3, 2), (3, 6, 2)),
    ],
    nn.Conv2d: [
        Case("pad1", lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5)),
        Case("B1-stride-nobias", lambda: nn.Conv2d(2, 3, 3, stride=2, bias=False), (1, 2, 6, 7)),
        Case("same-even", lambda: nn.Conv2d(2, 2, (2, 3), padding="same", dilation=(2, 1)), (3, 2, 5, 4)),
        Case("valid", lambda: nn.Conv2d(1, 2, 2, padding="valid"), (2, 1, 4, 4)),
        Case("groups", lambda: nn.Conv2d(4, 2, 3, groups=2, padding=1), (2, 4, 4, 4)),
        Case("groups-same", lambda: nn.Conv2d(4, 4, 3, groups=2, padding="same"), (2, 4, 4, 3)),
        Case("reflect", lambda: nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), (2, 2, 4, 4)),
    ],
    nn.Conv1d: [
        Case("stride", lambda: nn.Conv1d(2, 3, 3, stride=2, padding=1), (3, 2, 7)),
        Case("B1-dilation", lambda: nn.Conv1d(2, 2, 2, dilation=2, bias=False), (1, 2, 6)),
        Case("same", lambda: nn.Conv1d(2, 3, 4, padding="same"), (2, 2, 6)),
        Case("groups", lambda: nn.Conv1d(4, 4, 3, groups=4), (2, 4, 5)),
    ],
    nn.Conv3d: [
        Case("basic", lambda: nn.Conv3d(1, 2, 2, padding=1), (2, 1, 3, 3, 3)),
        Case("same", lambda: nn.Conv3d(2, 2, 3, padding="same", bias=False), (2, 2, 3, 3, 2)),
    ],
    nn.ConvTranspose1d: [
        Case("stride", lambda: nn.ConvTranspose1d(2, 3, 3, stride=2), (2, 2, 4)),
        Case("output-padding", lambda: nn.ConvTranspose1d(2, 2, 3, stride=2, output_padding=1), (3, 2, 4)),
    ],
    nn.ConvTranspose2d: [
        Case("B1-pad", lambda: nn.ConvTranspose2d(2, 3, 3, padding=1), (1, 2, 3, 4)),
        Case("groups", lambda: nn.ConvTranspose2d(4, 2, 2, stride=2, groups=2), (2, 4, 3, 3)),
        Case("output-padding", lambda: nn.ConvTranspose2d(2, 2, 3, stride=2, output_padding=(1, 0)), (2, 2, 3, 3)),
    ],
    nn.ConvTranspose3d: [
        Case("basic", lambda: nn.ConvTranspose3d(1, 2, 2), (2, 1, 2, 3, 2)),
    ],
    nn.EmbeddingBag: [  # a bag (a row of the last dim) per sample; flat ids with offsets: tests/test_peer_layers.py
        Case("sum", lambda: nn.EmbeddingBag(7, 3, mode="sum"), (3, 4), index=7),
        Case("mean-padding-idx", lambda: nn.EmbeddingBag(6, 4, mode="mean", padding_idx=2), (4, 5), index=6),
        Case("max", lambda: nn.EmbeddingBag(5, 2, mode="max"), (2, 3), index=5),
    ],
    nn.Embedding: [
        Case("B1", lambda: nn.Embedding(7, 3), (1, 4), index=7),
        Case("padding-idx", lambda: nn.Embedding(6, 4, padding_idx=2), (3, 5), index=6),
        Case("two-axes", lambda: nn.Embedding(5, 2), (2, 2, 3), index=5),
        Case("scale-grad-by-freq", lambda: nn.Embedding(5, 2, scale_grad_by_freq=True), (2, 3), index=5),
    ],
    nn.modules.batchnorm._BatchNorm: [
        Case("1d-eval", _bn_eval(nn.BatchNorm1d, 3), (4, 3)),
        Case("1d-eval-seq", _bn_eval(nn.BatchNorm1d, 3), (2, 3, 4)),
        Case("2d-eval-B1", _bn_eval(nn.BatchNorm2d, 2), (1, 2, 3, 3)),
        Case("2d-train", lambda: nn.BatchNorm2d(2), (5, 2, 3, 2)),
        Case("1d-no-running", lambda: nn.BatchNorm1d(3, track_running_stats=False).eval(), (5, 3)),
    ],
    nn.modules.instancenorm._InstanceNorm: [
        Case("1d-train", lambda: nn.InstanceNorm1d(3, affine=True), (3, 3, 5)),
        Case("2d-eval-running", _bn_eval(nn.InstanceNorm2d, 2, affine=True, track_running_stats=True), (2, 2, 3, 3)),
        Case("no-affine", lambda: nn.InstanceNorm1d(3), (2, 3, 4)),
    ],
    nn.GroupNorm: [
        Case("spatial", lambda: nn.GroupNorm(2, 4), (3, 4, 2, 3)),
        Case("B1-seq", lambda: nn.GroupNorm(1, 3), (1, 3, 4)),
    ],
    nn.LayerNorm: [
        Case("flat", lambda: nn.LayerNorm(4), (3, 4)),
        Case("seq-2d-shape", lambda: nn.LayerNorm((3, 4)), (2, 3, 4)),
        Case("no-bias", lambda: nn.LayerNorm(5, bias=False), (2, 3, 5)),
        Case("no-affine", lambda: nn.LayerNorm(4, elementwise_affine=False), (2, 4)),
    ],
}
if hasattr(nn, "RMSNorm"):
    CASES[nn.RMSNorm] = [
        Case("flat", lambda: nn.RMSNorm(4), (3, 4)),
        Case("seq-eps", lambda: nn.RMSNorm((2, 3), eps=1e-3), (2, 4, 2, 3)),
    ]


# --------------------------------------------------------------------------- the oracle
def _params(m: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach() for n, p in m.named_parameters(recurse=False) if p.requires_grad}


def oracle(m: nn.Module, x: Tensor, delta: Tensor, mixes: bool) -> dict[str, Tensor]:
    """attribute -> ``[B, *param]``: g_n = d/dtheta <m(x)_n, delta_n>, from the module's own
    forward (one sample at a time; for layers that mix samples, the batch forward)."""
    ref = copy.deepcopy(m)
    if mixes and ref.training:  # batch statistics either way; no running-stat update inside grad
        ref.track_running_stats = False
    buffers = {n: b.clone() for n, b in ref.named_buffers(recurse=False)}
    xs = x if isinstance(x, tuple) else (x,)  # a layer of several inputs: all of them
    if not mixes:
        def one(p, di, *xi):
            return (functional_call(ref, (p, buffers), tuple(t.unsqueeze(0) for t in xi)) * di.unsqueeze(0)).sum()
        return vmap(grad(one), in_dims=(None, 0) + (0,) * len(xs))(_params(ref), delta, *xs)
    b = x.shape[0]

    def row(p, e):
        out = functional_call(ref, (p, buffers), (x,))
        return (out * delta * e.view(b, *[1] * (out.dim() - 1))).sum()
    return vmap(grad(row), in_dims=(None, 0))(_params(ref), torch.eye(b, dtype=DT))


def _flat(g: dict[str, Tensor], attrs) -> Tensor:
    return torch.cat([g[a].flatten(1) for a in attrs], dim=1)


def _blocks(m: nn.Module, kernel: K.Kernel, g: dict[str, Tensor], attrs) -> list[tuple[str, Tensor]]:
    """The sketch's blocks ``[B, rows, cols]`` as documented by :meth:`Kernel.sketch`: matrix
    layers one ``"wb"`` block ``[d_out, d_in + 1]`` (the bias as the last column; an untracked
    parameter's part stays 0), else one ``[shape[0], -1]`` block per attribute."""
    dims = kernel.matrix_dims(m)
    if dims is None:
        return [(a, g[a].reshape(g[a].shape[0], g[a].shape[1] if g[a].dim() > 1 else 1, -1)) for a in attrs]
    d_out, d_in = dims
    b = next(iter(g.values())).shape[0]
    full = torch.zeros(b, d_out, d_in + 1, dtype=DT)
    if "weight" in attrs:
        full[:, :, :d_in] = g["weight"].reshape(b, d_out, d_in)
    if "bias" in attrs:
        full[:, :, d_in] = g["bias"]
    return [("wb", full)]


class _Pairs:
    """``pair(block, rows, cols) -> (u [k, rows], v [k, cols])``, fixed per block."""

    def __init__(self, k: int):
        self.k, self.got = k, {}
        self.gen = torch.Generator().manual_seed(5)

    def __call__(self, block, rows, cols):
        if (block, rows, cols) not in self.got:
            self.got[block, rows, cols] = (torch.randn(self.k, rows, generator=self.gen, dtype=DT),
                                           torch.randn(self.k, cols, generator=self.gen, dtype=DT))
        return self.got[block, rows, cols]


def _sketch_oracle(m, kernel, g, attrs, pair) -> Tensor:
    out = 0
    for block, G in _blocks(m, kernel, g, attrs):
        u, v = pair(block, G.shape[1], G.shape[2])
        out = out + torch.einsum("kr,nrc,kc->nk", u, G, v)
    return out


# --------------------------------------------------------------------------- the checks
class Report:
    """Collects mismatches (``what: detail``) instead of stopping at the first."""

    def __init__(self):
        self.bad: list[str] = []
        self.where = ""

    def close(self, what: str, got, want) -> None:
        try:
            if isinstance(want, Tensor):
                if not isinstance(got, Tensor) or got.shape != want.shape:
                    shape = tuple(got.shape) if isinstance(got, Tensor) else type(got).__name__
                    self.bad.append(f"{self.where} {what}: shape {shape}, want {tuple(want.shape)}")
                    return
                torch.testing.assert_close(got.to(DT), want, **TOL)
            elif got != want:
                self.bad.append(f"{self.where} {what}: {got!r}, want {want!r}")
        except AssertionError as e:
            self.bad.append(f"{self.where} {what}: " + str(e).splitlines()[0] + " " + str(e).splitlines()[-1])

    def run(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as e:  # a method that raises is a mismatch too; report and go on
            self.bad.append(f"{self.where} {what}: raised {type(e).__name__}: {e}")


def _inputs(case: Case, m: nn.Module, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """``(x, delta)``; a layer of several inputs (``case.more``): ``x`` the tuple of them."""
    if case.index:
        x = torch.randint(case.index, case.shape, generator=gen)
    else:
        x = torch.randn(case.shape, generator=gen, dtype=DT)
    xs = (x,) + tuple(torch.randn(shape, generator=gen, dtype=DT) for shape in case.more)
    with torch.no_grad():
        y = copy.deepcopy(m)(*xs)
    return (xs if case.more else x), torch.randn(y.shape, generator=gen, dtype=DT)


def check_case(rep: Report, case: Case, m: nn.Module, kernel: K.Kernel, key: type | str | None = None) -> None:
    """Every method and declaration of ``kernel`` on ``case`` against the oracle (``key``: the
    registry key the kernel came from; a name key also names the layer class for
    ``fused_layers``)."""
    gen = torch.Generator().manual_seed(hash(case.name) % 1000)
    xs, delta = _inputs(case, m, gen)
    # the kernel reads one tensor per use: several inputs joined as the capture joins them
    x = kernel.join_inputs(m, xs) if isinstance(xs, tuple) else xs
    rep.close("inputs", kernel.inputs, len(xs) if isinstance(xs, tuple) else 1)
    B = x.shape[0]
    mixes = kernel.mixes_samples
    want = oracle(m, xs, delta, mixes)
    attrs = kernel.params(m)
    rep.close("params", sorted(attrs), sorted(want))
    names = {a: f"layer.{a}" for a in attrs}

    def per_sample():
        got = kernel.per_sample(m, x, delta, 0, B)
        for a in attrs:
            rep.close(f"per_sample[{a}]", got.get(a), want[a])
        if B > 1:
            got = kernel.per_sample(m, x, delta, 1, B)
            for a in attrs:
                rep.close(f"per_sample[{a}] samples 1:{B}", got.get(a), want[a][1:])
        for a in attrs:
            rep.close(f"per_sample(attrs=[{a!r}])", kernel.per_sample(m, x, delta, 0, B, attrs=[a]).get(a), want[a])
    rep.run("per_sample", per_sample)

    def add_per_sample():
        for a in attrs:
            base = torch.randn(want[a].shape, generator=gen, dtype=DT)
            out = base.clone()
            kernel.add_per_sample(m, x, delta, a, out)
            rep.close(f"add_per_sample[{a}]", out, base + want[a])
    rep.run("add_per_sample", add_per_sample)

    def entries():
        for a in attrs:
            numel = want[a][0].numel()
            j = torch.cat([torch.tensor([0, numel - 1]), torch.randint(numel, (5,), generator=gen)])
            rep.close(f"entries[{a}]", kernel.entries(m, x, delta, a, j), want[a].reshape(B, -1)[:, j])
    rep.run("entries", entries)

    def outer_factors():
        for a, (d, f) in kernel.outer_factors(m, x, delta).items():
            g = torch.einsum("no,ni->noi", d, f).reshape(want[a].shape)
            rep.close(f"outer_factors[{a}]", g, want[a])
    rep.run("outer_factors", outer_factors)

    def sums():
        l2 = sum(want[a].flatten(1).square().sum(1) for a in attrs)
        got = kernel.batch_l2(m, x, delta)
        rep.close("batch_l2 (total)", sum(got[a] for a in attrs), l2)
        for a in attrs:
            rep.close(f"batch_l2[{a}]", got.get(a), want[a].flatten(1).square().sum(1))
            rep.close(f"sum_grad_squared[{a}]", kernel.sum_grad_squared(m, x, delta).get(a), want[a].square().sum(0))
            rep.close(f"grad_sum[{a}]", kernel.grad_sum(m, x, delta).get(a), want[a].sum(0))
    rep.run("batch_l2/sum_grad_squared/grad_sum", sums)

    # two micro-steps of unequal sizes (batch statistics need two samples or more per piece)
    cut = 2 if mixes else 1
    pieces = [(0, B)] if B <= cut else [(0, cut), (cut, B)]
    # what each micro-step sees: layers with batch statistics normalise over their own piece
    piece_want = [oracle(m, x[s:e], delta[s:e], mixes) if mixes else {a: want[a][s:e] for a in attrs}
                  for s, e in pieces]
    cat_want = {a: torch.cat([p[a] for p in piece_want]) for a in attrs}

    def reduce():
        for sub in ([attrs] + ([[attrs[0]]] if len(attrs) > 1 else [])):
            acc = {"sum_grad_squared": Accumulators({}), "grad_sum": Accumulators({})}
            l2 = []
            for s, e in pieces:
                parts = kernel.reduce(m, x[s:e], delta[s:e], {"batch_l2", "sum_grad_squared", "grad_sum"},
                                      {a: names[a] for a in sub}, acc)
                l2.append(sum(parts))
            rep.close(f"reduce batch_l2 {sub}", torch.cat(l2), sum(cat_want[a].flatten(1).square().sum(1) for a in sub))
            rep.close(f"reduce keys {sub}", sorted(acc["grad_sum"]), sorted(names[a] for a in sub))
            for a in sub:
                rep.close(f"reduce sum_grad_squared[{a}] {sub}", acc["sum_grad_squared"].get(names[a]), cat_want[a].square().sum(0))
                rep.close(f"reduce grad_sum[{a}] {sub}", acc["grad_sum"].get(names[a]), cat_want[a].sum(0))
        if "weight" in attrs:  # the weight's sum delivered elsewhere (autograd's node)
            acc = {"sum_grad_squared": Accumulators({}), "grad_sum": Accumulators({})}
            kernel.reduce(m, x, delta, {"grad_sum"}, names, acc, skip={("grad_sum", "weight")})
            rep.close("reduce skip grad_sum[weight]", names["weight"] in acc["grad_sum"], False)
    rep.run("reduce", reduce)

    def factor_forms():
        dims = kernel.matrix_dims(m)
        sf = kernel.seq_factors(m, x, delta, attrs)
        ut = kernel.use_tgram(m, x, delta, B)
        rep.close("use_tgram is a bool", type(ut), bool)
        rep.close("gram_materialises is a bool", type(kernel.gram_materialises(m, x, delta)), bool)
        rep.close("mean_via_gram is a bool", type(kernel.mean_via_gram(m, x, delta, B)), bool)
        if ut and sf is None:
            rep.bad.append(f"{rep.where} use_tgram: True without seq_factors")
        if dims is not None:
            rep.close("matrix_dims", dims[0] * dims[1], m.weight.numel())
        if sf is not None:
            X, Dl = sf
            rep.close("seq_factors positions", X.shape[1], kernel.positions(m, x, delta))
            got = torch.einsum("nto,nti->noi", Dl, X)
            full = _blocks(m, kernel, want, attrs)[0][1]
            cols = ([*range(dims[1])] if "weight" in attrs else []) + ([dims[1]] if "bias" in attrs else [])
            rep.close("seq_factors (sum_t Dl X^T)", got, full[:, :, cols])
    rep.run("matrix_dims/positions/seq_factors", factor_forms)

    def stacked():  # k uses of this module, samples concatenated (gradlens.measure.deferred)
        if kernel.stack_key(m, tuple(attrs)) is None or mixes or B < 2:
            return
        k, b = 2, B // 2
        xs, ds = x[: k * b], delta[: k * b]
        groups = [names] + ([{attrs[0]: names[attrs[0]]}] if len(attrs) > 1 else [])
        acc = {"sum_grad_squared": Accumulators({}), "grad_sum": Accumulators({})}
        for squares in ([], attrs, attrs[-1:]):  # without sums of squares, with all, with one
            l2, got = kernel.stacked_reduce(m, xs, ds, k, groups, {"grad_sum": attrs, "sum_grad_squared": squares}, acc)
            where = f" (squares of {squares})"
            for names_j, parts in zip(groups, l2):
                rep.close(f"stacked_reduce batch_l2 {sorted(names_j)}{where}", sum(parts),
                          sum(want[a][: k * b].flatten(1).square().sum(1) for a in names_j))
            rep.close(f"stacked_reduce quantities{where}", sorted(got), ["grad_sum"] + (["sum_grad_squared"] if squares else []))
            for a in attrs:
                per_use = want[a][: k * b].reshape(k, b, *want[a].shape[1:])
                rep.close(f"stacked_reduce grad_sum[{a}]{where}", got["grad_sum"].get(a), per_use.sum(1))
                rep.close(f"stacked_grad_sum[{a}]", kernel.stacked_grad_sum(m, xs, ds, k, [a]).get(a), per_use.sum(1))
                if squares:
                    rep.close(f"stacked_reduce sum_grad_squared[{a}]{where}", got["sum_grad_squared"].get(a),
                              per_use.square().sum(1) if a in squares else None)
        rep.close("stacked_reduce without sums", kernel.stacked_reduce(m, xs, ds, k, groups, {}, acc)[1], {})
    rep.run("stacked_reduce/stacked_grad_sum", stacked)

    subsets = [attrs] + ([[attrs[-1]]] if len(attrs) > 1 else [])

    def flat_and_directional():
        for sub in subsets:
            flat = _flat(want, sub)
            if B > 1:
                rep.close(f"flat_per_sample {sub}", kernel.flat_per_sample(m, x, delta, 1, B, sub), flat[1:])
            D = {a: torch.randn(want[a].shape[1:], generator=gen, dtype=DT) for a in sub}
            rep.close(f"directional {sub}", kernel.directional(m, x, delta, D, sub), flat @ _flat({a: D[a][None] for a in sub}, sub)[0])
    rep.run("flat_per_sample/directional", flat_and_directional)

    def gram():
        for sub in subsets:
            G = _flat(cat_want, sub)
            got = kernel.gram(m, [(x[s:e], delta[s:e]) for s, e in pieces], sub)
            rep.close(f"gram {sub} of micro-steps {[e - s for s, e in pieces]}", got, G @ G.T)
            if hasattr(kernel, "gram_with_sum"):  # Linear: the Gram and the weight's sum in one pass
                k, wsum = kernel.gram_with_sum(m, x, delta, sub)
                F_ = _flat(want, sub)
                rep.close(f"gram_with_sum {sub} Gram", k, F_ @ F_.T)
                if wsum is not None:
                    rep.close(f"gram_with_sum {sub} weight sum", wsum, want["weight"].sum(0))
    rep.run("gram", gram)

    def sketch():
        for sub in subsets:
            pair = _Pairs(6)
            rep.close(f"sketch {sub}", kernel.sketch(m, x, delta, sub, 6, pair), _sketch_oracle(m, kernel, want, sub, pair))
            if kernel.matrix_dims(m) is not None:  # both routes of matrix layers
                u, v = pair("wb", *_blocks(m, kernel, want, sub)[0][1].shape[1:])
                d_in = v.shape[1] - 1
                for route in ("sketch_factors", "sketch_materialised"):
                    got = getattr(kernel, route)(m, x, delta, sub, u, v[:, :d_in], v[:, d_in])
                    rep.close(f"{route} {sub}", got, _sketch_oracle(m, kernel, want, sub, pair))
            D = {a: torch.randn(want[a].shape[1:], generator=gen, dtype=DT) for a in sub}
            rep.close(f"sketch_direction {sub}", kernel.sketch_direction(m, D, sub, 6, pair, delta),
                      _sketch_oracle(m, kernel, {a: D[a][None] for a in sub}, sub, pair)[0])
    rep.run("sketch/sketch_direction", sketch)

    def rows_per_sample():  # samples as the leading factor of their axis: [n * f, ...] as [n, f, ...]
        if not kernel.rows_per_sample or B < 2:  # ([n, ..., f] for a kernel with rows_last)
            return
        f = 2 if B % 2 == 0 else B
        n = B // f
        xf, df = x.reshape(n, f, *x.shape[1:]), delta.reshape(n, f, *delta.shape[1:])
        if kernel.rows_last:
            xf, df = xf.movedim(1, -1), df.movedim(1, -1)
        wf = {a: want[a].reshape(n, f, *want[a].shape[1:]).sum(1) for a in attrs}  # a sample's rows summed
        got = kernel.per_sample(m, xf, df, 0, n)
        for a in attrs:
            rep.close(f"rows_per_sample: per_sample[{a}] of [{n}, {f}, ...]", got.get(a), wf[a])
        acc = {"sum_grad_squared": Accumulators({}), "grad_sum": Accumulators({})}
        parts = kernel.reduce(m, xf, df, {"batch_l2", "sum_grad_squared", "grad_sum"}, names, acc)
        rep.close("rows_per_sample: reduce batch_l2", sum(parts), sum(wf[a].flatten(1).square().sum(1) for a in attrs))
        for a in attrs:
            rep.close(f"rows_per_sample: reduce sum_grad_squared[{a}]", acc["sum_grad_squared"].get(names[a]), wf[a].square().sum(0))
            rep.close(f"rows_per_sample: reduce grad_sum[{a}]", acc["grad_sum"].get(names[a]), wf[a].sum(0))
    rep.run("rows_per_sample", rows_per_sample)

    def routes_param_grads():  # the call's autograd node sees exactly its dL/dp = sum_n g_n
        if not kernel.routes_param_grads(m):
            return
        from gradlens.capture.events import Site
        from gradlens.capture.param_grads import _hook_param_grads

        ref = copy.deepcopy(m)
        got = {}
        out = ref(x.clone())
        hooked = _hook_param_grads(out, ref, Site("layer", ref, kernel, dict(names)),
                                   lambda site, g, a: got.__setitem__(a, g))
        rep.close("routes_param_grads: parameters hooked at the call's node", sorted(hooked), sorted(attrs))
        (out * delta).sum().backward()
        for a in attrs:
            rep.close(f"routes_param_grads: the node's dL/d{a}", got.get(a), want[a].sum(0))
    rep.run("routes_param_grads", routes_param_grads)

    def fused_layers():  # the fused call computes what the layer's own forward and backward do
        from gradlens.capture.events import WeightGrad
        from gradlens.capture.fused import _FusedLinear
        from gradlens.capture.registry import qualname

        layer = {qualname(type(m))} | ({key} if isinstance(key, str) else set())
        for cls, transposed in kernel.fused_layers.items():
            if cls not in layer:
                continue
            own, fused = copy.deepcopy(m), copy.deepcopy(m)
            x_own, x_fused = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            y_own = own(x_own)
            y_fused = _FusedLinear.apply(x_fused, fused.weight, fused.bias, WeightGrad(), transposed)
            rep.close(f"fused_layers[{cls}] (transposed={transposed}): forward", y_fused, y_own)
            (y_own * delta).sum().backward()
            (y_fused * delta).sum().backward()
            rep.close(f"fused_layers[{cls}]: dL/dx", x_fused.grad, x_own.grad)
            for a in attrs:
                rep.close(f"fused_layers[{cls}]: dL/d{a}", getattr(fused, a).grad, want[a].sum(0))
    rep.run("fused_layers", fused_layers)


def _kernel_of(key, m: nn.Module) -> K.Kernel | None:
    factory = next(f for k, f, _ in _KERNELS if k is key or k == key)
    return factory(m)


def _key_id(key) -> str:
    return _display(key)


@pytest.mark.parametrize("key", list(dict.fromkeys(k for k, _, _ in _KERNELS)), ids=_key_id)
def test_registered_kernel_matches_the_oracle(key):
    cases = CASES.get(key)
    assert cases, (f"{_display(key)} is registered but has no case in CASES of "
                   "tests/test_kernel_contract.py; add its shapes there")
    rep = Report()
    torch.manual_seed(0)
    covered = 0
    for case in cases:
        m = case.make().to(DT)
        kernel = _kernel_of(key, m)
        if kernel is None:  # this configuration is captured per operation (no closed form)
            continue
        K.check_kernel(kernel)
        covered += 1
        rep.where = f"{type(kernel).__name__} on {case.name} {tuple(case.shape)}:"
        check_case(rep, case, m, kernel, key)
    assert covered, f"no case of {_display(key)} gets a kernel"
    assert not rep.bad, f"{len(rep.bad)} mismatches of {_display(key)}:\n" + "\n".join(rep.bad)


def test_linear_calls_and_materialised_parameters_match_the_oracle():
    """The two kernels the Lens builds itself: ``F.linear`` calls (:class:`OpLinear`, only the
    tracked parameters) and materialised ``[B, *param]`` gradients."""
    rep = Report()
    torch.manual_seed(1)
    lin = nn.Linear(4, 3).to(DT)
    for shape in ((3, 4), (2, 5, 4)):
        case = Case("op-linear", lambda: lin, shape)
        for tracked in (("weight", "bias"), ("weight",)):
            rep.where = f"LinearKernel on OpLinear{tracked} {shape}:"
            op = K.OpLinear(lin.weight, lin.bias, tracked)
            x, delta = _inputs(case, lin, torch.Generator().manual_seed(2))
            want = oracle(lin, x, delta, False)
            kernel = K.LinearKernel()
            got = kernel.per_sample(op, x, delta, 0, x.shape[0])
            for a in tracked:
                rep.close(f"per_sample[{a}]", got.get(a), want[a])
            G = _flat(want, tracked)
            rep.close("gram", kernel.gram(op, [(x, delta)], list(tracked)), G @ G.T)
            l2 = kernel.reduce(op, x, delta, {"batch_l2"}, {a: a for a in tracked},
                               {"sum_grad_squared": Accumulators(), "grad_sum": Accumulators()})
            rep.close("reduce batch_l2", sum(l2), G.square().sum(1))
    # materialised: the stored per-sample gradients of a Conv2d weight, as the Lens keeps them
    conv = nn.Conv2d(2, 2, 3).to(DT)
    x, delta = _inputs(Case("c", lambda: conv, (3, 2, 4, 4)), conv, torch.Generator().manual_seed(3))
    want = oracle(conv, x, delta, False)["weight"]
    stand_in = K.Materialised("p", conv.weight)
    kernel = K.MaterialisedKernel()
    K.check_kernel(kernel)
    rep.where = "MaterialisedKernel:"
    check_case_materialised(rep, stand_in, kernel, want)
    # and of a 0-dim parameter (a learned temperature, issue 42): [B] per-sample gradients
    scalar = nn.Parameter(torch.tensor(0.5, dtype=DT))
    rep.where = "MaterialisedKernel (0-dim):"
    check_case_materialised(rep, K.Materialised("p", scalar), kernel,
                            torch.randn(5, generator=torch.Generator().manual_seed(4), dtype=DT))
    assert not rep.bad, f"{len(rep.bad)} mismatches:\n" + "\n".join(rep.bad)


def check_case_materialised(rep: Report, m, kernel, want: Tensor) -> None:
    B = want.shape[0]
    a = want.clone()
    g = {"p": want}
    rep.close("per_sample", kernel.per_sample(m, a, None, 1, B)["p"], want[1:])
    n = want[0].numel()
    j = torch.tensor(sorted({0, min(5, n - 1), n - 1}))
    rep.close("entries", kernel.entries(m, a, None, "p", j), want.reshape(B, -1)[:, j])
    rep.close("batch_l2", kernel.batch_l2(m, a, a)["p"], want.reshape(B, -1).square().sum(1))
    rep.close("sum_grad_squared", kernel.sum_grad_squared(m, a, a)["p"], want.square().sum(0))
    G = want.reshape(B, -1)
    rep.close("gram", kernel.gram(m, [(a[:1], a[:1]), (a[1:], a[1:])], ["p"]), G @ G.T)
    D = {"p": torch.randn(want.shape[1:], dtype=DT)}
    rep.close("directional", kernel.directional(m, a, a, D, ["p"]), G @ D["p"].flatten())
    pair = _Pairs(4)
    rep.close("sketch", kernel.sketch(m, a, a, ["p"], 4, pair), _sketch_oracle(m, kernel, g, ["p"], pair))


def test_every_kernel_class_is_exercised():
    """Every public kernel class of gradlens.kernels is handed out by some case of CASES (or
    is one of those the Lens builds itself: the two checked above, and SummedUsesKernel, the
    sum of a shared parameter's uses, checked against the oracle in tests/test_memory_paths.py)."""
    public = {c for c in vars(K).values()
              if isinstance(c, type) and issubclass(c, K.Kernel) and c is not K.Kernel
              and not c.__name__.startswith("_")}
    seen = {K.LinearKernel, K.MaterialisedKernel, K.SummedUsesKernel}
    for key, cases in CASES.items():
        for case in cases:
            seen.add(type(_kernel_of(key, case.make().to(DT))))
    missing = sorted(c.__name__ for c in public - seen)
    assert not missing, f"kernel classes no case reaches: {missing}; add a shape that selects them to CASES"


def test_oracle_is_not_the_kernel():
    """The suite sees a wrong layer: a Linear kernel whose sequence bias gradient keeps only the
    first position fails per_sample and everything derived from its slices."""
    class Broken(K.LinearKernel):
        def per_sample(self, module, a, delta, start, stop, attrs=None):
            out = super().per_sample(module, a, delta, start, stop, attrs)
            if "bias" in out and delta.dim() > 2:
                out["bias"] = delta[start:stop, 0]
            return out
    case = CASES[nn.Linear][2]
    m = case.make().to(DT)
    right, wrong = Report(), Report()
    check_case(right, case, m, K.LinearKernel())
    check_case(wrong, case, m, Broken())
    assert not right.bad
    assert any("per_sample[bias]" in b for b in wrong.bad)
    assert any("flat_per_sample" in b for b in wrong.bad)
