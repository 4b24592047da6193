"""Issue 42, routed experts in factored form (gradlens.kernels.routed): the uses of a 3-D expert
weight (the eager loop's ``F.linear(x, w[e])``, ``grouped_mm`` with offsets) are slices of one
parameter, kept as their tokens' factors and measured once per micro-step without the
``[B, E, out, in]`` per-sample gradients: every quantity of the kernel against per-sample
gradients summed token by token in float64, the route taken and exact in a model against the
per-sample loop (K = 3 micro-batches of 2, 3, 1), and a tracked window's peak memory, in a fresh
process, far below ``B E out in`` numbers."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, SumGradSquared
from gradlens.kernels.base import check_kernel
from gradlens.kernels.routed import Routed, RoutedKernel, pack
from oracle import hist_matches
from test_moe_routing import SIZES, TinyMoE, _check, _data, _oracle
from windows import all_instruments, run_windows


def _tokens(seed, b=5, e=4, p1=3, p2=6, m=23):
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, b - 1, (m,), generator=g)  # the last sample gets no token
    expert = torch.randint(0, e, (m,), generator=g)
    expert[:4] = 1  # several tokens of one sample in one expert
    owner[:4] = 0
    u = torch.randn(m, p1, generator=g, dtype=torch.float64)
    v = torch.randn(m, p2, generator=g, dtype=torch.float64)
    G = torch.zeros(b, e, p1, p2, dtype=torch.float64)
    for t in range(m):  # token by token: the oracle
        G[owner[t], expert[t]] += torch.outer(u[t], v[t])
    return owner, expert, u, v, G


@pytest.mark.parametrize("pairs", [True, False])
def test_routed_kernel_quantities_match_token_sums(pairs, monkeypatch):
    """Norms (token pairs, or formed segments), sum of squares, sum, directions, Gram across
    two packings of unequal sizes, materialised slices: == per-sample gradients summed token by
    token."""
    check_kernel(RoutedKernel())
    monkeypatch.setattr(RoutedKernel, "_pairs_cheaper", staticmethod(lambda a, d: pairs))
    k = RoutedKernel()
    o1, e1, u1, v1, G1 = _tokens(0)
    o2, e2, u2, v2, G2 = _tokens(1, b=3, m=9)
    param = torch.zeros(4, 3, 6, dtype=torch.float64)
    mod = Routed("p", param)
    a1, d1 = pack(o1, e1, u1, v1, 5)
    a2, d2 = pack(o2, e2, u2, v2, 3)
    close = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(k.batch_l2(mod, a1, d1)["p"], G1.flatten(1).square().sum(1), **close)
    torch.testing.assert_close(k.sum_grad_squared(mod, a1, d1)["p"], G1.square().sum(0), **close)
    torch.testing.assert_close(k.grad_sum(mod, a1, d1)["p"], G1.sum(0), **close)
    torch.testing.assert_close(k.per_sample(mod, a1, d1, 1, 4)["p"], G1[1:4], **close)
    D = torch.randn(4, 3, 6, dtype=torch.float64)
    torch.testing.assert_close(k.directional(mod, a1, d1, {"p": D}, ["p"]), (G1 * D).flatten(1).sum(1), **close)
    G = torch.cat([G1, G2]).flatten(1)
    torch.testing.assert_close(k.gram(mod, [(a1, d1), (a2, d2)], ["p"]), G @ G.T, **close)
    assert not k.gram_materialises(mod, a1, d1)


def _count(monkeypatch):
    calls = {"batch_l2": 0, "per_sample": 0}
    for name in calls:
        real = getattr(RoutedKernel, name)

        def wrap(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(RoutedKernel, name, wrap)
    return calls


@pytest.mark.parametrize("form", ["loop", "grouped"])
def test_routed_experts_take_the_factored_route_exactly(form, monkeypatch):
    """The loop over the experts and grouped_mm: each expert weight measured by the routed
    kernel once per micro-step (2 weights x 3 micro-steps), no materialised slices, no
    per-operation rule for them; exact against the float64 per-sample loop (unequal
    micro-batches 2, 3, 1) for BatchL2, SumGradSquared, GradNorm, BatchDot, coverage 1.0."""
    import gradlens.capture.ops as ops

    calls = _count(monkeypatch)
    real_lookup, real_grouped = ops.routed_lookup, ops.grouped_weight
    materialised = []
    monkeypatch.setattr(ops, "routed_lookup", lambda *a: materialised.append(1) or real_lookup(*a))
    monkeypatch.setattr(ops, "grouped_weight", lambda *a: materialised.append(1) or real_grouped(*a))
    torch.manual_seed(5)
    model = TinyMoE(form).double()
    x, y = _data(torch.Generator().manual_seed(6))
    G = _oracle(model, x, y)
    dtype = torch.float32 if form == "grouped" else torch.float64
    run = run_windows(model.to(dtype), [list(zip(x.to(dtype).split(SIZES), y.split(SIZES)))],
                      [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()], close=False)
    assert run.lens.coverage == 1.0
    _check(run.record, G, [k for k, _ in model.named_parameters()], 1e-4 if form == "grouped" else 1e-10)
    assert calls == {"batch_l2": 2 * len(SIZES), "per_sample": 0}
    assert not materialised
    run.lens.close()


class _AlsoWhole(TinyMoE):
    """TinyMoE whose expert weight ``w_up`` also meets the batch whole (``h * w_up.mean()``):
    a use of another kind in the same micro-step."""

    def forward(self, x):
        return super().forward(x * (1 + self.w_up.mean()))


def test_routed_part_joins_a_materialised_use_of_the_same_weight(monkeypatch):
    """An expert weight with a routed use and a whole one (its g_n the sum of both): the
    routed tokens' part is added into the materialised [B, *param] of the other; exact, and a
    histogram of every g_n (formed in chunks) matches the oracle's."""
    bins, r = 9, 0.2  # (0 inside a bin: the exact zeros of slices no token reached)
    added = []
    real = RoutedKernel.add_per_sample
    monkeypatch.setattr(RoutedKernel, "add_per_sample", lambda self, *a: added.append(a[3]) or real(self, *a))
    torch.manual_seed(7)
    model = _AlsoWhole("loop").double()
    x, y = _data(torch.Generator().manual_seed(8))
    G = _oracle(model, x, y)
    run = run_windows(model, [list(zip(x.split(SIZES), y.split(SIZES)))],
                      [BatchL2(), SumGradSquared(), GradNorm(), BatchDot(), GradHist1d(bins=bins, range=(-r, r))])
    names = [k for k, _ in model.named_parameters()]
    _check(run.record, G, names, 1e-10)
    assert len(added) == len(SIZES)  # w_up's routed part, once per micro-step
    hist_matches(run.record["grad_hist_1d"], torch.cat([G[k].flatten(1) for k in names], 1), -r, r, bins)


class _StoredInOut(nn.Module):
    """``[B, T, 4]`` -> ``[B, 3]``: an expert weight stored ``[E, in, out]`` used as it is,
    ``grouped_mm(x, w, offs=offs)`` (GPT-OSS' layout), each token to the expert of its largest
    of the first E features."""

    def __init__(self, e=3, d=8):
        super().__init__()
        self.e = e
        self.inp = nn.Linear(4, d)
        self.w = nn.Parameter(torch.randn(e, d, d) / d ** 0.5)
        self.head = nn.Linear(d, 3)

    def forward(self, x):
        h = self.inp(x).reshape(-1, self.inp.out_features)
        with torch.no_grad():
            ids, perm = torch.sort(h[:, :self.e].argmax(-1))
            offs = torch.cumsum(torch.bincount(ids, minlength=self.e), 0).to(torch.int32)
            back = torch.empty_like(perm)
            back[perm] = torch.arange(perm.numel())
        y = F.grouped_mm(h[perm], self.w, offs=offs)[back]
        return self.head(torch.tanh(y).view(x.shape[0], x.shape[1], -1).mean(1))


def test_grouped_weight_stored_in_out_exact(monkeypatch):
    """``grouped_mm(x, w)`` with ``w [E, in, out]`` itself (no transpose): the factors' roles
    swap (u = the input, v = the output gradient); exact against a per-sample loop (float32,
    as torch's CPU grouped_mm) with micro-batches 2, 3, 1, through the routed kernel."""
    calls = _count(monkeypatch)
    torch.manual_seed(2)
    model = _StoredInOut()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    rows = [torch.autograd.grad(F.cross_entropy(ref(x[i:i + 1]), y[i:i + 1]), list(params.values())) for i in range(6)]
    G = {k: torch.stack([r[j] for r in rows]).double() for j, k in enumerate(params)}
    run = run_windows(model, [list(zip(x.split(SIZES), y.split(SIZES)))],
                      [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()])
    _check(run.record, G, list(params), 1e-4)
    assert calls["batch_l2"] == len(SIZES)


def _all_records(factored, cross, monkeypatch):
    import gradlens.capture.ops as ops

    if not factored:
        monkeypatch.setattr(ops, "routed_factors", lambda *a: None)
    torch.manual_seed(0)
    model = TinyMoE("loop").double()
    x, y = _data(torch.Generator().manual_seed(1))
    windows = [list(zip(x.split(SIZES), y.split(SIZES))), list(zip(x.flip(0).split(SIZES), y.flip(0).split(SIZES)))]
    run = run_windows(model, windows, all_instruments(grad_r=0.3, param_r=2.0, cross=cross))
    monkeypatch.undo()
    return run.lens.records


@pytest.mark.parametrize("cross", [None, pytest.param({"mode": "sketch", "k": 16}, marks=pytest.mark.slow)])
def test_every_instrument_agrees_with_the_materialising_route(cross, monkeypatch):
    """Every first-order instrument (projections of InnerTest / OrthoTest, Grams, sketches,
    1-D and 2-D histograms from chunks), two windows: the factored route's records == those
    of the route that forms each sample's [E, out, in] (the per-operation rule, exact against
    the oracle in tests/test_moe_routing.py)."""
    got, want = _all_records(True, cross, monkeypatch), _all_records(False, cross, monkeypatch)
    assert len(got) == len(want) == 2
    for rg, rw in zip(got, want):
        assert set(rg.values) == set(rw.values)
        for k in rg.values:
            a, b = rg[k], rw[k]
            if hasattr(a, "counts"):
                assert torch.equal(a.counts, b.counts), k
            elif isinstance(a, dict):
                assert a.keys() == b.keys(), k
                for q in a:
                    torch.testing.assert_close(torch.as_tensor(a[q]).double(), torch.as_tensor(b[q]).double(),
                                               rtol=1e-9, atol=1e-12)
            elif a is None or b is None:
                assert a is None and b is None, k
            else:
                torch.testing.assert_close(torch.as_tensor(a).double(), torch.as_tensor(b).double(), rtol=1e-9,
                                           atol=1e-12)


_PEAK = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    import gradlens
    from gradlens import Lens
    from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, SumGradSquared
    torch.set_num_threads(1)
    B, T, D, E, K = 64, 4, 256, 8, 2
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(D, E, bias=False)
            self.w_up = nn.Parameter(torch.randn(E, D, D) / D ** 0.5)
            self.w_down = nn.Parameter(torch.randn(E, D, D) / D ** 0.5)
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            h = x.reshape(-1, D)
            w, idx = torch.topk(F.softmax(self.gate(h), dim=-1), K, dim=-1)
            out = torch.zeros_like(h)
            with torch.no_grad():
                mask = F.one_hot(idx, E).permute(2, 1, 0)
                hit = (mask.sum((-1, -2)) > 0).nonzero()
            for e in hit:
                e = e[0]
                pos, tok = torch.where(mask[e])
                y = F.linear(F.silu(F.linear(h[tok], self.w_up[e])), self.w_down[e])
                out.index_add_(0, tok, y * w[tok, pos, None])
            return self.head((h + out).view(x.shape[0], T, D).mean(1))

    model = gradlens.extend(Net().double())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    data = [(torch.randn(B, T, D, dtype=torch.float64), torch.randint(0, 3, (B,))) for _ in range(2)]
    lens, got = None, []

    def window():
        for x, y in data:
            loss = loss_fn(model(x), y) / 2
            if lens is None:
                loss.backward()
                continue
            with lens.capture():
                loss.backward()
        if lens is not None:
            got.append(lens.flush())
        model.zero_grad()

    def maxrss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    window()
    window()  # warm-up: untracked windows, no Lens
    lens = Lens(model, [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()])
    full, data = data, [tuple(t[:2] for t in mb) for mb in data]
    window()  # a tracked window of 2 samples per micro-step: what is allocated once
    data = full
    base = maxrss()
    window()  # a tracked window of B samples per micro-step
    tracked = maxrss() - base
    assert len(got) == 2 and got[-1]["batch_l2"].shape == (2 * B,), got[-1]["batch_l2"].shape
    print(json.dumps({"tracked": tracked, "per_sample_bytes": B * E * D * D * 8, "weight_bytes": E * D * D * 8}))
    """
)


def test_routed_experts_tracked_window_peak_stays_below_per_sample_gradients():
    """The peak resident memory of a tracked window (BatchL2, SumGradSquared, GradNorm,
    BatchDot) of a routed block with large experts (E = 8 of 256 x 256, loop form, B = 64),
    over what earlier windows reached, in a fresh process (glibc's mmap threshold fixed, so
    that freed blocks leave the resident set): below a quarter of one expert weight's
    ``[B, E, out, in]`` per-sample gradients (268 MB; the materialising route formed them for
    each expert's use of each of the two weights: 829 MB without BatchDot, whose exact mode
    it took past its 1 GiB budget) and 16 copies of a weight (here about 9: the sums of squares
    and sums, BatchDot's token factors, blocks of formed segments)."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tracked"] < got["per_sample_bytes"] / 4, got
    assert got["tracked"] < 16 * got["weight_bytes"], got
