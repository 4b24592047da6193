"""NoiseScaleDDP: the two-batch noise scale of DDP training (rank-local vs all-reduced gradients).

Exact against a float64 oracle (torch.func per-sample gradients of each rank's window, the
estimate solved from its two expectation equations) with 2 and 3 gloo processes, unequal
per-rank batch sizes, mean and sum losses, ``no_sync`` accumulation, ``gradient_as_bucket_view``,
a GradScaler; one all_reduce per ``sync_every`` windows; unbiased for |G|^2 and tr(Sigma) on a
linear-Gaussian model with known truth and unequal rank sizes; clear errors."""

from __future__ import annotations

import copy
import gc
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradlens.instruments import NoiseScaleDDP
from gradlens.instruments.noise import rank_average_estimates
from oracle import MODELS, flat, make_problem, per_sample_grads
from test_distributed import _init, _spawn

RTOL = 1e-9

#: per window, per rank: micro-batch sizes (several = no_sync accumulation, the last synchronised)
PLANS = {
    2: [[[6], [6]], [[2, 3], [4, 1, 2]], [[5], [3]]],
    3: [[[4], [4], [4]], [[3], [1, 2], [5]], [[2, 2], [6], [1]]],
}
SCALED_WINDOW = 2  # its backward runs through a GradScaler (scale 2^10)


def _batch(name: str, window: int, rank: int, size: int):
    _, x, y = make_problem(MODELS[name], seed=100 + 10 * window + rank)
    return x[:size], y[:size]


def _run(worker, rank: int, world: int, port: int, *args) -> None:
    """``worker(rank, world, *args)`` in an initialised gloo group. Its DDP modules are its own
    locals, freed (with the hooks' cycles) before the group is destroyed: a DDP module still
    alive at destroy_process_group, freed at interpreter exit, aborted about 1 run in 25 here
    ("terminate called without an active exception"), with or without gradlens."""
    _init(rank, world, port)
    try:
        worker(rank, world, *args)
    finally:
        gc.collect()
        dist.destroy_process_group()


def _worker(rank: int, world: int, port: int, *args) -> None:
    _run(_oracle_run, rank, world, port, *args)


def _oracle_run(rank: int, world: int, out_dir: str, name: str, reduction: str, ddp_kw: dict) -> None:
    calls = {"all_reduce": 0}
    original = dist.all_reduce

    def counting(*a, **k):
        calls["all_reduce"] += 1
        return original(*a, **k)

    dist.all_reduce = counting  # DDP's own all-reduces run in C++ and are not counted
    model0 = make_problem(MODELS[name])[0]
    ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model0), **ddp_kw)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    noise = NoiseScaleDDP(ddp, batch_size=1, reduction=reduction, sync_every=2, scaler=scaler)
    arrived = []
    for w, plan in enumerate(PLANS[world]):
        sizes = plan[rank]
        noise.batch_size = sum(sizes)
        for k, b in enumerate(sizes):
            x, y = _batch(name, w, rank, b)
            sync = k == len(sizes) - 1
            with ddp.no_sync() if not sync else torch.enable_grad():
                loss = F.cross_entropy(ddp(x), y, reduction="sum")
                if reduction == "mean":
                    loss = loss / sum(sizes)  # p.grad: the mean gradient of the window
                if w == SCALED_WINDOW:
                    loss = scaler.scale(loss)
                loss.backward()
        arrived.append(len(noise.values))
        ddp.zero_grad()
    arrived.append(len(noise.flush()))
    torch.save({"values": list(noise.values), "arrived": arrived, "calls": calls["all_reduce"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.all_reduce = original


def _oracle(name: str, world: int, reduction: str):
    """Per window (|G|^2, tr(Sigma)) from the two expectation equations of rank-local vs averaged
    gradients, solved numerically; with equal rank sizes also the paper's pair."""
    model0 = make_problem(MODELS[name])[0]
    out = []
    for w, plan in enumerate(PLANS[world]):
        gs, a, b = [], [], []
        for r in range(world):
            G = torch.cat([flat(per_sample_grads(model0, *_batch(name, w, r, s))) for s in plan[r]])
            n = G.shape[0]
            scale = n if reduction == "mean" else 1.0  # p.grad = sum / scale
            gs.append(G.sum(0) / scale)
            a.append(n / scale)
            b.append(n / scale**2)
        u = torch.stack(gs).mean(0)
        A = sum(float(g.dot(g)) for g in gs)
        lhs = torch.tensor([[sum(v * v for v in a), sum(b)], [sum(a) ** 2, sum(b)]], dtype=torch.float64)
        rhs = torch.tensor([A, world * world * float(u.dot(u))], dtype=torch.float64)
        g2, tr = torch.linalg.solve(lhs, rhs).tolist()
        sizes = [sum(plan[r]) for r in range(world)]
        out.append((g2, tr, sizes))
    return out


@pytest.mark.parametrize(
    "world,name,reduction,ddp_kw",
    [
        (2, "mlp", "mean", {}),
        (2, "cnn", "sum", {"gradient_as_bucket_view": True}),
        (2, "mlp", "sum", {"static_graph": True}),
        (2, "cnn", "mean", {"find_unused_parameters": True, "bucket_cap_mb": 0.001}),
        (3, "seq", "mean", {"gradient_as_bucket_view": True}),
        (3, "mlp", "sum", {}),
    ],
)
def test_matches_float64_oracle(world, name, reduction, ddp_kw):
    """Every rank's records equal the oracle's, whatever DDP's options (buckets as gradient
    views, a static graph, unused-parameter search with many small buckets)."""
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, world, out_dir, name, reduction, ddp_kw)
        got = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    want = _oracle(name, world, reduction)
    for r in range(world):
        # sync_every=2: windows 0 and 1 arrive with the second, window 2 with flush()
        assert got[r]["arrived"] == [0, 2, 2, 1]
        assert got[r]["calls"] == 2  # one all_reduce per sync_every windows, one for the flush
        assert repr(got[r]["values"]) == repr(got[0]["values"])  # every rank holds the same records (NaN too)
    values = got[0]["values"]
    assert [v["window"] for v in values] == [0, 1, 2]
    for v, (g2, tr, sizes) in zip(values, want):
        assert math.isclose(v["grad_sq"], g2, rel_tol=RTOL, abs_tol=1e-12), (v, g2)
        assert math.isclose(v["trace_sigma"], tr, rel_tol=RTOL, abs_tol=1e-12), (v, tr)
        assert v["batch_big"] == sum(sizes) and v["small_batches"] == world
        assert math.isclose(v["batch_small"], sum(s * s for s in sizes) / sum(sizes))
        if len(set(sizes)) == 1:
            # equal sizes: the paper's pair |G|^2 = (N|G_big|^2 - b|G_small|^2)/(N - b), tr = ...
            model0 = make_problem(MODELS[name])[0]
            w = v["window"]
            plan = PLANS[world][w]
            G = [torch.cat([flat(per_sample_grads(model0, *_batch(name, w, r, s))) for s in plan[r]])
                 for r in range(world)]
            bs, n = sizes[0], sum(sizes)
            small = sum(float(g.mean(0).square().sum()) for g in G) / world
            big = float(torch.cat(G).mean(0).square().sum())
            assert math.isclose(v["grad_sq"], (n * big - bs * small) / (n - bs), rel_tol=1e-8)
            assert math.isclose(v["trace_sigma"], (small - big) / (1 / bs - 1 / n), rel_tol=1e-8)


def test_unbiased_on_linear_gaussian_model_with_unequal_ranks():
    """y = w*.x + eps, x ~ N(0, I_d), per-sample loss (w.x - y)^2 at w = w* + v: G = 2 v,
    tr(Sigma) = 4 ((d + 1)|v|^2 + d s^2). Ranks of 2, 5 and 9 samples, each holding its mean
    gradient (mean loss) or its sum, DDP's average of them: over many windows the mean of
    :func:`rank_average_estimates` is within 4 standard errors of the truth."""
    d, s, windows, sizes = 5, 0.6, 800, [2, 5, 9]
    gen = torch.Generator().manual_seed(2)
    w_star = torch.randn(d, generator=gen, dtype=torch.float64)
    v = 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    w = w_star + v
    true = (float((2 * v).square().sum()), 4 * ((d + 1) * float(v.square().sum()) + d * s * s))
    R = len(sizes)
    for reduction in ("mean", "sum"):
        est = []
        for _ in range(windows):
            gs = []
            for b in sizes:
                x = torch.randn(b, d, generator=gen, dtype=torch.float64)
                y = x @ w_star + s * torch.randn(b, generator=gen, dtype=torch.float64)
                per_sample = 2 * (x @ w - y)[:, None] * x  # d/dw (w.x - y)^2
                gs.append(per_sample.mean(0) if reduction == "mean" else per_sample.sum(0))
            u = torch.stack(gs).mean(0)
            a = [1.0] * R if reduction == "mean" else [float(b) for b in sizes]
            bb = [1.0 / b for b in sizes] if reduction == "mean" else [float(b) for b in sizes]
            est.append(rank_average_estimates(
                sum(float(g.dot(g)) for g in gs), float(u.dot(u)), R, sum(a), sum(t * t for t in a), sum(bb)))
        est = torch.tensor(est)
        mean, se = est.mean(0), est.std(0) / math.sqrt(windows)
        for label, m, e, t in zip(("|G|^2", "tr(Sigma)"), mean.tolist(), se.tolist(), true):
            assert abs(m - t) < 4 * e, f"{reduction} {label}: {m:.4f} +- {e:.4f} vs true {t:.4f}"
            assert e < 0.15 * t  # the test has power: the standard error is small against the truth


def test_one_rank_gives_nan():
    assert all(math.isnan(v) for v in rank_average_estimates(1.0, 1.0, 1, 1.0, 1.0, 0.5))


def _errors_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _run(_errors_run, rank, world, port, out_dir)


def _errors_run(rank: int, world: int, out_dir: str) -> None:
    messages = {}
    model = nn.Linear(3, 2)
    for key, make in {
        "not_ddp": lambda: NoiseScaleDDP(model, batch_size=4),
        "batch": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)), batch_size=0),
        "reduction": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)),
                                           batch_size=4, reduction="avg"),
        "sync_every": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)),
                                            batch_size=4, sync_every=0),
        "scaler": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)),
                                        batch_size=4, scaler=2.0**16),
        "history": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)),
                                         batch_size=4, history=0),
        "callback": lambda: NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)),
                                          batch_size=4, callback="print"),
    }.items():
        try:
            make()
        except (TypeError, ValueError) as err:
            messages[key] = f"{type(err).__name__}: {err}"
    hooked = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    try:
        NoiseScaleDDP(hooked, batch_size=4)
    except ValueError as err:
        messages["comm_hook"] = f"ValueError: {err}"
    # the fix the refusal names works: a DDP without a comm hook is accepted
    plain = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    noise = NoiseScaleDDP(plain, batch_size=4)
    plain(torch.randn(4, 3)).sum().backward()
    messages["accepted"] = repr(noise)
    noise.remove()
    # a restart: the smoothing state and window count continue from the checkpoint
    resumed = NoiseScaleDDP(plain, batch_size=4)
    resumed.load_state_dict({"beta": 0.5, "grad_sq_ema": 2.0, "trace_sigma_ema": 6.0, "windows": 7})
    torch.manual_seed(rank)
    plain.zero_grad()
    plain(torch.randn(4, 3)).pow(2).sum().backward()
    v = resumed.flush()[0]
    messages["resumed"] = (v["window"], v["b_simple_smoothed"],
                           (3.0 + 0.5 * v["trace_sigma"]) / (1.0 + 0.5 * v["grad_sq"]),
                           resumed.state_dict()["windows"])
    resumed.remove()
    # a state it did not write is refused before anything is set, naming what is wrong
    before = resumed.state_dict()
    for key, bad in {"lacks": {"beta": 0.5, "grad_sq_ema": 2.0, "trace_sigma_ema": 6.0},
                     "beta": {"beta": 1.5, "grad_sq_ema": 2.0, "trace_sigma_ema": 6.0, "windows": 7},
                     "windows": {"beta": 0.5, "grad_sq_ema": 2.0, "trace_sigma_ema": 6.0, "windows": -1},
                     "ema": {"beta": 0.5, "grad_sq_ema": float("nan"), "trace_sigma_ema": 6.0, "windows": 7},
                     "not_dict": [0.5, 2.0, 6.0, 7]}.items():
        try:
            resumed.load_state_dict(bad)
        except ValueError as err:  # (a StateDictError)
            messages["load_" + key] = f"{type(err).__name__}: {err}"
    messages["load_kept"] = resumed.state_dict() == before
    # the monitor holds its DDP module weakly: flushing after it is freed says so
    gone = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    orphan = NoiseScaleDDP(gone, batch_size=4)
    gone(torch.randn(4, 3)).sum().backward()
    del gone
    gc.collect()
    try:
        orphan.flush()
    except RuntimeError as err:
        messages["freed"] = str(err)
    orphan.remove()
    from torch.distributed.algorithms.join import Join

    joined = nn.parallel.DistributedDataParallel(nn.Linear(3, 2))
    noise = NoiseScaleDDP(joined, batch_size=4)
    try:
        with Join([joined]):
            joined(torch.randn(4, 3)).sum().backward()
    except RuntimeError as err:
        messages["join"] = str(err)
    noise.flush()
    noise.remove()  # the fix the message names: then Join runs
    with Join([joined]):
        joined(torch.randn(4, 3)).sum().backward()
    messages["join_after_remove"] = joined.module.weight.grad is not None
    torch.save(messages, os.path.join(out_dir, f"rank{rank}.pt"))


def test_errors_name_the_fix():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_errors_worker, 2, out_dir)
        msg = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    assert msg["not_ddp"].startswith("TypeError") and "NoiseScaleMonitor" in msg["not_ddp"]
    assert msg["batch"].startswith("ValueError") and "batch_size" in msg["batch"]
    assert msg["reduction"].startswith("ValueError") and "'mean' or 'sum'" in msg["reduction"]
    assert msg["sync_every"].startswith("ValueError") and "sync_every" in msg["sync_every"]
    assert msg["scaler"].startswith("TypeError") and "GradScaler" in msg["scaler"]
    assert msg["history"].startswith("ValueError") and "history must be an int >= 1" in msg["history"]
    assert msg["callback"].startswith("TypeError") and "callback must be callable" in msg["callback"]
    assert "was freed" in msg["freed"] and "flush before dropping the DDP module" in msg["freed"]
    assert "comm hook" in msg["comm_hook"] and "fp16_compress_hook" in msg["comm_hook"]
    assert "pending=1" in msg["accepted"]
    assert "Join" in msg["join"] and "noise.remove()" in msg["join"]
    assert msg["join_after_remove"]
    assert "lacks key(s) ['windows']" in msg["load_lacks"] and msg["load_lacks"].startswith("StateDictError")
    assert "beta=1.5" in msg["load_beta"] and "[0, 1)" in msg["load_beta"]
    assert "windows=-1" in msg["load_windows"] and "an int >= 0" in msg["load_windows"]
    assert "grad_sq_ema=nan" in msg["load_ema"] and "NoiseScaleDDP" in msg["load_ema"]
    assert "takes the dict from its state_dict()" in msg["load_not_dict"]
    assert msg["load_kept"]
    window, smoothed, expected, windows = msg["resumed"]
    assert window == 7 and windows == 8 and math.isclose(smoothed, expected, rel_tol=1e-12)


def test_one_process_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="2 or more ranks.*NoiseScaleMonitor"):
            NoiseScaleDDP(nn.parallel.DistributedDataParallel(nn.Linear(3, 2)), batch_size=4)
    finally:
        dist.destroy_process_group()
