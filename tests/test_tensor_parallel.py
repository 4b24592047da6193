"""Tensor parallelism (``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel``,
gloo, CPU, float64) and the 2-D layout (FSDP2 over the data dim of a ``(dp, tp)`` mesh, TP
inside): the records equal the float64 torch.func oracle of the *unsharded* model built before
sharding, on the batch of the data ranks (N not multiplied by the TP degree), for K unequal
micro-batches; replicated parameters (LayerNorms, the row-wise layer's bias, the head) counted
once; ``sum_grad_squared`` in the full parameter shapes; the same record on every rank. What
is refused under tensor parallelism is refused with a message naming the instrument."""

from __future__ import annotations

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, GradHist1d, GradNorm, NoiseScale, NoiseScaleTwoBatch, NormTest, SumGradSquared
from oracle import flat, hist_oracle, per_sample_grads, two_batch
import test_distributed
from test_distributed import _init, _spawn

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402 - TP support is gradlens' own: no skip
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

RTOL = 1e-9
WINDOWS = ([2, 3, 1], [3, 1, 2])  # K unequal micro-batches per window (per data rank)


class MLPBlock(nn.Module):
    """A replicated LayerNorm -> column-wise ``up`` -> tanh -> row-wise ``down`` (residual) ->
    a replicated head."""

    def __init__(self, d=6, h=8, c=3):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, c)

    def forward(self, x):
        return self.head(x + self.down(torch.tanh(self.up(self.norm(x)))))


class AttentionBlock(nn.Module):
    """GPT-style: LayerNorm -> column-wise q, k, v (heads split over the TP ranks: the local head
    count is read from the shapes) -> causal attention -> row-wise output projection (residual)
    -> LayerNorm -> mean over T -> head."""

    def __init__(self, d=8, heads=2, c=3):
        super().__init__()
        self.head_dim = d // heads
        self.ln = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, c)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln(x)
        q, k, v = (m(h).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return self.head(self.ln_f(x).mean(1))


PLANS = {
    "mlp": {"up": ColwiseParallel(), "down": RowwiseParallel()},
    "attn": {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()},
}


def _problem(name: str, n: int):
    """(unsharded float64 model, x [n, ...], y [n]) with fixed seeds (the same on every rank)."""
    torch.manual_seed(0)
    model = (MLPBlock() if name == "mlp" else AttentionBlock()).double()
    g = torch.Generator().manual_seed(1)
    shape = (n, 6) if name == "mlp" else (n, 5, 8)
    return model, torch.randn(*shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g)


HIST = (9, 0.05)  # GradHist1d's bins (odd: 0 inside a bin) and range (-r, r)


def _instruments():
    bins, r = HIST
    return [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale(), NoiseScaleTwoBatch(),
            GradHist1d(bins=bins, range=(-r, r))]


def _windows(x, y, sizes_per_window, start=0):
    """Micro-batches of consecutive samples from ``start``: one list per window."""
    out, at = [], start
    for sizes in sizes_per_window:
        window = []
        for b in sizes:
            window.append((x[at:at + b], y[at:at + b]))
            at += b
        out.append(window)
    return out


def _record_values(rec):
    v = rec.values
    return {
        "N": rec.num_samples, "K": rec.micro_steps,
        "batch_l2": v["batch_l2"].clone(),
        "sum_grad_squared": {q: t.clone() for q, t in v["sum_grad_squared"].items()},
        "grad_norm": v["grad_norm"], "norm_test": v["norm_test"], "noise_scale": v["noise_scale"],
        "two_batch": (v["noise_scale_two_batch"]["grad_sq"], v["noise_scale_two_batch"]["trace_sigma"]),
        "hist": (v["grad_hist_1d"].counts.tolist(), v["grad_hist_1d"].clamped_low, v["grad_hist_1d"].clamped_high),
    }


def _run(model, windows, log=None, light=False):
    """Records of ``windows`` under a Lens of :func:`_instruments` (``light``: GradNorm and
    NoiseScaleTwoBatch alone, the parameter-hook capture, windows closed by ``flush()``; else
    by the update of an SGD with lr=0, which leaves the oracle's parameters as they are)."""
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = None if light else torch.optim.SGD(model.parameters(), lr=0.0)
    lens = Lens(model, [GradNorm(), NoiseScaleTwoBatch()] if light else _instruments(), log=log, optimizer=opt)
    records = []
    for window in windows:
        for x, y in window:
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
        if opt is None:
            rec = lens.flush()
        else:
            opt.step()
            opt.zero_grad()
            rec = lens.records[-1]
        two = rec.values["noise_scale_two_batch"]
        records.append({"N": rec.num_samples, "K": rec.micro_steps, "grad_norm": rec.values["grad_norm"],
                        "two_batch": (two["grad_sq"], two["trace_sigma"])} if light else _record_values(rec))
    lens.close()
    return records


def _refusals(model):
    out = {}
    for inst in (GradHist1d(bins=5, range=(-1, 1), sample=0.5), BatchDot()):
        try:
            Lens(model, [GradNorm(), inst]).close()
            out[type(inst).__name__] = "no error"
        except ValueError as err:
            out[type(inst).__name__] = str(err)
    return out


def _tp_worker(rank, world, port, out_dir):
    """Both blocks on a 2-rank TP mesh: the full capture, the light one, the refusals."""
    _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for name in PLANS:
        model, x, y = _problem(name, sum(map(sum, WINDOWS)))
        parallelize_module(model, mesh, PLANS[name])
        model = gradlens.extend(model)
        windows = _windows(x, y, WINDOWS)
        out[name] = _run(model, windows, log=os.path.join(out_dir, f"{name}.jsonl"))
        out[name + "_light"] = _run(model, windows, light=True)
        if name == "mlp":
            out["refusals"] = _refusals(model)
            try:  # a data-parallel group that holds TP peers
                Lens(model, [GradNorm()], process_group=dist.group.WORLD).close()
                out["group"] = "no error"
            except ValueError as err:
                out["group"] = str(err)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _dp_tp_worker(rank, world, port, out_dir):
    """Both blocks under FSDP2 over the data dim of a (2, 2) mesh, TP inside."""
    _init(rank, world, port)
    per_rank = sum(map(sum, WINDOWS))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh["dp"].get_local_rank()
    out = {}
    for name in PLANS:
        model, x, y = _problem(name, 2 * per_rank)
        parallelize_module(model, mesh["tp"], PLANS[name])
        fully_shard(model, mesh=mesh["dp"])
        # data rank r's micro-batches: its block of each window's samples (rank-major in the oracle)
        windows, at = [], 0
        for sizes in WINDOWS:
            n = sum(sizes)
            lo = at + dp * n
            windows += _windows(x[lo:lo + n], y[lo:lo + n], [sizes])
            at += 2 * n
        out[name] = _run(gradlens.extend(model), windows)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    dist.destroy_process_group()


def _oracle(model, x, y, sizes):
    """The record values of one window from the unsharded model's float64 per-sample gradients."""
    gs = per_sample_grads(model, x, y)
    G = flat(gs)
    n = G.shape[0]
    mean = G.mean(0)
    g2 = float(mean.dot(mean))
    tr = float((G - mean).square().sum()) / (n - 1)
    return {
        "N": n, "K": len(sizes),
        "batch_l2": G.square().sum(1),
        "sum_grad_squared": {q: g.square().sum(0) for q, g in gs.items()},
        "grad_norm": math.sqrt(g2), "norm_test": math.sqrt(tr / n) / math.sqrt(g2), "noise_scale": tr / g2,
        "two_batch": two_batch(G, sizes),
        "hist": _hist(G),
    }


def _hist(G):
    counts, low, high = hist_oracle(G, -HIST[1], HIST[1], HIST[0])
    return counts.tolist(), low, high


def _check(got, want):
    assert (got["N"], got["K"]) == (want["N"], want["K"])
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=RTOL)
    assert got["two_batch"] == pytest.approx(want["two_batch"], rel=1e-8)
    if "batch_l2" not in got:  # the light capture
        return
    torch.testing.assert_close(got["batch_l2"], want["batch_l2"], rtol=RTOL, atol=1e-12)
    assert got["sum_grad_squared"].keys() == want["sum_grad_squared"].keys()
    for q, t in want["sum_grad_squared"].items():
        assert got["sum_grad_squared"][q].shape == t.shape, q  # the full parameter shape
        torch.testing.assert_close(got["sum_grad_squared"][q], t, rtol=RTOL, atol=1e-12, msg=q)
    for key in ("norm_test", "noise_scale"):
        assert got[key] == pytest.approx(want[key], rel=RTOL), key
    assert got["hist"] == want["hist"]


def _same_on_every_rank(results):
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert (a["N"], a["K"]) == (b["N"], b["K"])
            assert a["grad_norm"] == b["grad_norm"] and a["two_batch"] == b["two_batch"]
            if "batch_l2" not in a:
                continue
            torch.testing.assert_close(a["batch_l2"], b["batch_l2"], rtol=0, atol=0)
            assert a["hist"] == b["hist"]
            for q in a["sum_grad_squared"]:
                torch.testing.assert_close(a["sum_grad_squared"][q], b["sum_grad_squared"][q], rtol=0, atol=0)


def test_tensor_parallel_two_ranks_equal_unsharded_oracle():
    """An MLP block (replicated LayerNorm and head, column-wise up, row-wise down) and a GPT-style
    attention block (column-wise q, k, v, row-wise o) on 2 TP ranks: the full capture and the light
    one (GradNorm, NoiseScaleTwoBatch alone) equal the oracle (GradHist1d's counts exactly);
    instruments without a TP rule (BatchDot, sampled GradHist1d) are refused by name."""
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_tp_worker, 2, tmp)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(2)]
        logged = {}
        for name in PLANS:
            with open(os.path.join(tmp, f"{name}.jsonl")) as f:
                logged[name] = [line for line in f if '"step"' in line]
    for name in PLANS:
        model, x, y = _problem(name, sum(map(sum, WINDOWS)))
        assert len(logged[name]) == len(WINDOWS), logged[name]  # one writer: each record once
        for kind in (name, name + "_light"):
            _same_on_every_rank([r[kind] for r in results])
            at = 0
            for rec, sizes in zip(results[0][kind], WINDOWS):
                n = sum(sizes)
                _check(rec, _oracle(model, x[at:at + n], y[at:at + n], sizes))
                at += n
    msg = results[0]["group"]
    assert "holds several ranks of one tensor-parallel group" in msg and "mesh_2d['dp'].get_group()" in msg, msg
    for name, msg in results[0]["refusals"].items():
        assert f"instruments {name} are not supported under tensor parallelism" in msg, msg
        assert "drop them from the Lens's instruments" in msg, msg


def test_fsdp_over_data_with_tensor_parallel_inside_four_ranks_equal_oracle(monkeypatch):
    """(dp, tp) = (2, 2): N sums over the data ranks only, rank-major; both blocks."""
    monkeypatch.setattr(test_distributed, "DEADLINE_S", 300.0)  # 4 processes on a shared 2-core machine
    per_rank = sum(map(sum, WINDOWS))
    with tempfile.TemporaryDirectory() as tmp:
        _spawn(_dp_tp_worker, 4, tmp)
        results = [torch.load(os.path.join(tmp, f"{r}.pt")) for r in range(4)]
    for name in PLANS:
        model, x, y = _problem(name, 2 * per_rank)
        _same_on_every_rank([r[name] for r in results])
        at = 0
        for rec, sizes in zip(results[0][name], WINDOWS):
            n = 2 * sum(sizes)
            _check(rec, _oracle(model, x[at:at + n], y[at:at + n], sizes + sizes))
            at += n
