"""torch.distributed (gloo, CPU): R ranks x K micro-steps give the record of one batch of all N
samples (float64 torch.func oracle on the rank-major concatenated batch), for every instrument;
rank 0 writes the log once; one all_reduce per tracked window (plus one all_gather when
per-sample vectors are kept and their shapes differ from the last window's), nothing on
untracked windows. (FSDP2 models: tests/test_fsdp.py.)"""

from __future__ import annotations

import contextlib
import gc
import copy
import json
import math
import os
import socket
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import GradientAccumulateOptimizer, Lens, load_log
from gradlens.instruments import (
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    MeanGSNR,
    NoiseScaleMonitor,
    NoiseScaleTwoBatch,
    NormTest,
    OrthoTest,
    SumGradSquared,
)
from oracle import MODELS, bins_oracle, flat, hist_oracle, make_problem, per_sample_grads, two_batch, window_oracle
from windows import all_instruments, micro_batches, run_windows


DEADLINE_S = 90.0
RANK_SIZES = {2: [5, 7], 3: [3, 5, 4]}  # unequal per-rank batches, N = 12 (the oracle's)
LR = 0.3
RTOL = 1e-9


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_after(rank: int, fn, *args) -> None:
    """Run worker ``fn(rank, *args)``; when it returns (its results saved, its process group
    destroyed), end the process at once with status 0. Interpreter teardown is skipped: torch's
    DDP / FSDP / gloo objects that the garbage collector only frees there (reference cycles)
    abort the process about 1 run in 16-25 ("terminate called without an active exception",
    SIGABRT), with or without gradlens. An exception in ``fn`` propagates as usual."""
    fn(rank, *args)
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(fn, world: int, *args) -> None:
    context = mp.start_processes(
        _exit_after, args=(fn, world, _free_port(), *args), nprocs=world, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"distributed workers did not finish within {DEADLINE_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()


def _init(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30),
    )


def _problem(name: str):
    model, x0, y0 = make_problem(MODELS[name], seed=0)
    _, x1, y1 = make_problem(MODELS[name], seed=1)
    G = flat(per_sample_grads(model, x0, y0))
    grad_r = 0.5 * float(G.abs().max())
    param_r = 0.5 * max(float(p.detach().abs().max()) for p in model.parameters())
    return model, [(x0, y0), (x1, y1)], grad_r, param_r


def _instruments(grad_r: float, param_r: float, mode: str):
    if mode == "sampled":
        return [GradHist1d(bins=10, range=(-grad_r, grad_r), sample=0.3, seed=4),
                GradHist2d(bins=(6, 8), range=((-param_r, param_r), (-grad_r, grad_r)), sample=0.3)]
    return all_instruments(grad_r, param_r, bins=10, bins_2d=(6, 8), cross={"mode": mode, "k": 64} if mode == "sketch" else {})


def _run_rank(rank, world, name, K, mode, log):
    """Two windows on a DDP model: this rank's slice of each window's batch, K micro-steps."""
    model0, windows, grad_r, param_r = _problem(name)
    sizes = RANK_SIZES[world]
    lo = sum(sizes[:rank])
    mine = slice(lo, lo + sizes[rank])
    model = gradlens.extend(copy.deepcopy(model0))
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    # the usual DDP accumulation loop: no_sync() on all but the last micro-step, so that the
    # accumulated p.grad is all-reduced once and every rank makes the same update
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    lens = Lens(model, _instruments(grad_r, param_r, mode), optimizer=opt, log=log)
    thetas = [copy.deepcopy(model0).state_dict()]
    for x, y in windows:
        micro = list(zip(torch.tensor_split(x[mine], K), torch.tensor_split(y[mine], K)))
        for k, (xb, yb) in enumerate(micro):
            with ddp.no_sync() if k < K - 1 else contextlib.nullcontext():
                out = ddp(xb)
                loss = loss_fn(out, yb)
                with lens.capture(losses=F.cross_entropy(out, yb, reduction="none").detach()):
                    loss.backward()
        opt.step()
        opt.zero_grad()
        thetas.append(copy.deepcopy(model.state_dict()))
    lens.close()
    return [(r.step, r.num_samples, r.micro_steps, dict(r.values), dict(r.meta)) for r in lens.records], thetas


def _merge_worker(rank: int, world: int, port: int, out_dir: str, name: str, mode: str) -> None:
    _init(rank, world, port)
    try:
        result = {}
        for K in (1, 3):
            log = os.path.join(out_dir, f"log_K{K}.jsonl")
            result[K] = _run_rank(rank, world, name, K, mode, log)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _close(a, b, rtol=RTOL):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
        rtol=rtol, atol=1e-12,
    )


def _check_window(vals, num_samples, G, theta_t, theta_next, window, next_window, micro_sizes,
                  grad_r, param_r, mode):
    n = G.shape[0]
    assert num_samples == n
    _close(vals["batch_l2"], G.square().sum(1))  # rank-major sample order
    names = list(per_sample_grads_names(theta_t))
    gs = dict(zip(names, G.split([p.numel() for p in theta_t.parameters()], dim=1)))
    for nm, g in gs.items():
        _close(vals["sum_grad_squared"][nm].flatten(), g.square().sum(0))
    mean = G.mean(0)
    _close(vals["grad_norm"], mean.norm())
    var = G.var(0)
    _close(vals["noise_scale"], var.sum() / mean.square().sum())
    _close(vals["norm_test"], (var.sum() / n).sqrt() / mean.norm())
    ok = var > 0
    _close(vals["mean_gsnr"], (mean[ok].square() / var[ok]).mean())
    counts, low, high = hist_oracle(G, -grad_r, grad_r, 10)
    assert torch.equal(vals["grad_hist_1d"].counts, counts)
    assert (vals["grad_hist_1d"].clamped_low, vals["grad_hist_1d"].clamped_high) == (low, high)
    theta = torch.cat([p.detach().flatten() for p in theta_t.parameters()])
    pb, gb = 6, 8
    pidx = bins_oracle(theta, -param_r, param_r, pb)
    gidx = bins_oracle(G, -grad_r, grad_r, gb)
    joint = torch.bincount((pidx * gb + gidx).flatten(), minlength=pb * gb).view(pb, gb)
    assert torch.equal(vals["grad_hist_2d"].counts, joint)
    assert vals["grad_hist_2d"].clamped_param == n * int(((theta < -param_r) | (theta > param_r)).sum())
    g2, tr = two_batch(G, micro_sizes)
    ns = vals["noise_scale_two_batch"]
    _close(ns["grad_sq"], g2)
    _close(ns["trace_sigma"], tr)
    if g2 > 0:
        _close(ns["b_simple"], tr / g2)
    else:  # a negative |G|^2 estimate (small N) has no meaningful ratio
        assert math.isnan(ns["b_simple"])
    assert ns["batch_big"] == n and ns["small_batches"] == len(micro_sizes)
    if mode == "exact" and next_window is not None:
        o = window_oracle([theta_t, theta_next], [window, next_window], 0)
        for key in ("batch_dot", "inner_test", "ortho_test"):
            _close(vals[key], o[key])
        sp = vals["search_dir_projections"]
        for key in ("start", "end", "update_sq_norm"):
            _close(sp[key], o[key])
        _close(vals["alpha"], o["alpha"], rtol=1e-7)


def per_sample_grads_names(model):
    return [n for n, _ in model.named_parameters()]


def _micro_sizes(world: int, K: int) -> list[int]:
    out = []
    for b in RANK_SIZES[world]:
        out += [len(t) for t in torch.tensor_split(torch.arange(b), K) if len(t)]
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_times_micro_steps_equal_one_batch_oracle(world):
    name = "mlp"
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_merge_worker, world, out_dir, name, "exact")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
        logs = {K: load_log(os.path.join(out_dir, f"log_K{K}.jsonl")) for K in (1, 3)}
        raw_lines = {K: open(os.path.join(out_dir, f"log_K{K}.jsonl")).read().splitlines() for K in (1, 3)}
        assert sorted(os.listdir(out_dir)) == sorted(
            [f"rank{r}.pt" for r in range(world)] + ["log_K1.jsonl", "log_K3.jsonl"]
        )
    model0, windows, grad_r, param_r = _problem(name)
    for K in (1, 3):
        records, thetas = results[0][K]
        models = []
        for sd in thetas:
            m = copy.deepcopy(model0)
            m.load_state_dict(sd)
            models.append(m)
        assert len(records) == 2
        for t, (step, n, micro, vals, meta) in enumerate(records):
            assert step == t and micro == len(_micro_sizes(world, K))
            G = flat(per_sample_grads(models[t], *windows[t]))
            nxt = windows[t + 1] if t + 1 < len(windows) else None
            _check_window(vals, n, G, models[t], models[t + 1], windows[t], nxt,
                          _micro_sizes(world, K), grad_r, param_r, "exact")
            assert meta["batch_dot"] == "exact"
        # every rank holds the same merged records
        for other in results[1:]:
            for (s0, n0, m0, v0, _), (s1, n1, m1, v1, _) in zip(records, other[K][0]):
                assert (s0, n0, m0) == (s1, n1, m1)
                _close(v0["batch_dot"], v1["batch_dot"], rtol=0)
                assert v0["grad_norm"] == v1["grad_norm"]
        # rank 0 wrote the log, once: one line per window, equal to the records
        assert len(raw_lines[K]) == 2
        for rec, (step, n, _, vals, _) in zip(logs[K], records):
            assert rec.step == step and rec.num_samples == n
            _close(rec["grad_norm"], vals["grad_norm"], rtol=0)
            assert (rec["alpha"] is None) == (vals["alpha"] is None)
            if vals["alpha"] is not None:
                _close(rec["alpha"], vals["alpha"], rtol=0)
    # the update DDP made: the average of the rank means (not sample-weighted for unequal sizes)
    sizes = RANK_SIZES[world]
    x, y = windows[0]
    ref = copy.deepcopy(model0)
    grads = []
    for xr, yr in zip(x.split(sizes), y.split(sizes)):
        ref.zero_grad()
        F.cross_entropy(ref(xr), yr).backward()
        grads.append([p.grad.clone() for p in ref.parameters()])
    m1 = copy.deepcopy(model0)
    m1.load_state_dict(results[0][1][1][1])
    for i, (p0, p1) in enumerate(zip(model0.parameters(), m1.parameters())):
        _close(p1, p0 - LR * sum(g[i] for g in grads) / world)


def test_sketch_mode_merges_across_ranks():
    """Sketch mode: the sketches of all ranks are gathered (the sketch is a fixed linear map, the
    same on every rank), so the merged record equals one process on the concatenated batch."""
    world, name = 2, "cnn"
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_merge_worker, world, out_dir, name, "sketch")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    model0, windows, grad_r, param_r = _problem(name)
    # single process, one batch of N, same sketch seed: the reference for the sketched values
    for K in (1, 3):
        records, thetas = results[0][K]
        ref = run_windows(model0, [windows[:1]], [BatchDot(mode="sketch", k=64), InnerTest(mode="sketch", k=64)],
                          process_group=False, close=False).flushed[0]
        vals = records[0][3]
        _close(vals["batch_dot"], ref["batch_dot"])
        _close(vals["inner_test"], ref["inner_test"])
        G = flat(per_sample_grads(model0, *windows[0]))
        _check_window(vals, records[0][1], G, model0, None, windows[0], None,
                      _micro_sizes(world, K), grad_r, param_r, "sketch")


def test_sampled_histograms_merge_across_ranks():
    """Sampled histograms under DDP: each rank's estimate and variance add (ranks draw their own
    coordinates). Every drawn coordinate bins all its samples, so the estimated total is exactly
    N x D; the estimates lie within a few standard errors of the float64 oracle's counts."""
    world, name = 2, "mlp"
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_merge_worker, world, out_dir, name, "sampled")
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    model0, windows, grad_r, param_r = _problem(name)
    G = flat(per_sample_grads(model0, *windows[0]))
    exact, _, _ = hist_oracle(G, -grad_r, grad_r, 10)
    for K in (1, 3):
        vals = results[0][K][0][0][3]
        h1, h2 = vals["grad_hist_1d"], vals["grad_hist_2d"]
        assert h1.sample == 0.3 and h1.stderr is not None and h2.stderr is not None
        assert h1.total == pytest.approx(G.numel()) and h2.total == pytest.approx(G.numel())
        assert bool((h1.stderr >= 0).all()) and bool(torch.isfinite(h1.stderr).all())
        z = (h1.counts - exact.double()) / h1.stderr.clamp(min=1e-9)
        assert float(z.abs().max()) < 6, z
        assert results[1][K][0] == [] or results[1][K][0][0][3]["grad_hist_1d"] == h1


# ------------------------------------------------------------------- collectives per window
def assert_carry_scale(lens):
    assert lens._meter.plan.carry_scale


def _dot_alone_worker(rank: int, world: int, port: int, out_dir: str, name: str) -> None:
    """BatchDot as the only instrument (output gradients kept unscaled with their scale): one
    window of K = 1 and one of K = 3 micro-steps of this rank's slice, mean loss."""
    _init(rank, world, port)
    try:
        model0, windows, _, _ = _problem(name)
        sizes = RANK_SIZES[world]
        lo = sum(sizes[:rank])
        mine = slice(lo, lo + sizes[rank])
        x, y = windows[0]
        # theta fixed (lr 0): one oracle for both windows
        lens = run_windows(model0, [list(zip(torch.tensor_split(x[mine], K), torch.tensor_split(y[mine], K)))
                                    for K in (1, 3)], [BatchDot()], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0),
                           on_micro=lambda run, w, k, loss: assert_carry_scale(run.lens)).lens
        torch.save([r["batch_dot"] for r in lens.records], os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["seq", "mlp"])
def test_batch_dot_alone_merges_unscaled_factors_across_ranks(name):
    """Ranks x K micro-steps of a BatchDot-only Lens (its factors travel in per-sample units)
    == the oracle's Gram of the rank-major batch, on every rank."""
    world = 2
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_dot_alone_worker, world, out_dir, name)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
    model0, windows, _, _ = _problem(name)
    G = flat(per_sample_grads(model0, *windows[0]))
    for grams in results:
        assert len(grams) == 2
        for k in grams:
            _close(k, G @ G.T)


def _count_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        calls = {"all_reduce": 0, "all_gather": 0, "other": 0}
        originals = {}
        for fn in ("all_reduce", "all_gather_into_tensor", "all_gather_single", "all_gather",
                   "broadcast", "all_gather_object", "reduce_scatter_tensor", "all_to_all_single"):
            if not hasattr(dist, fn):
                continue
            originals[fn] = getattr(dist, fn)

            def wrapped(*a, _fn=fn, **k):
                key = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
                       "all_gather_single": "all_gather"}.get(_fn, "other")
                calls[key] += 1
                return originals[_fn](*a, **k)

            setattr(dist, fn, wrapped)
        model0, windows, grad_r, param_r = _problem("mlp")
        model = gradlens.extend(copy.deepcopy(model0))
        out = {}
        configs = {
            "norms": [SumGradSquared(), GradNorm()],
            "two_batch": [NoiseScaleTwoBatch()],
            "hist_adapt": [GradHist1d(adapt="abs_max"), GradHist2d(adapt="min_max")],
            # MeanGSNR's shifted moments are gathered (merged about one shift, exactly)
            "per_sample": [BatchL2(), NormTest(), BatchDot(), InnerTest(), OrthoTest(), MeanGSNR()],
        }
        x, y = windows[0]
        for key, insts in configs.items():
            opt = torch.optim.SGD(model.parameters(), lr=0.0)
            lens = Lens(model, insts, optimizer=opt, every=2)
            per_window, before = [], [dict(calls)]  # the counts when the window started

            def count(run, w, per_window=per_window, before=before):  # the collectives of window w
                per_window.append({k: calls[k] - before[-1][k] for k in calls})
                before.append(dict(calls))

            run_windows(model, [micro_batches(x, y, [3] * 4)] * 4, lens=lens, optimizer=opt, fresh_copy=False,
                        on_window=count)
            out[key] = per_window
        before = dict(calls)
        rec = run_windows(model, [[(x, y)]], [BatchL2(), GradNorm()], fresh_copy=False, process_group=False,
                          close=False).flushed[0]
        out["local"] = ({k: calls[k] - before[k] for k in calls}, rec.num_samples)
        # a float32 model: sums travel in a float32 buffer, counts as exact limbs
        out["f32"] = dict(run_windows(copy.deepcopy(model0).float(), [[(x.float(), y)]],
                                      [GradHist1d(bins=7, range=(-grad_r, grad_r)), SumGradSquared(), GradNorm()],
                                      close=False).flushed[0].values)
        # the optimizer route under DDP: each micro-step's p.grad is averaged over the ranks
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(model0))
        gao = GradientAccumulateOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.0), accum_steps=3)
        monitor = NoiseScaleMonitor(gao, ranks=world)
        xr, yr = windows[rank]
        before = dict(calls)
        for xb, yb in zip(xr.split(4), yr.split(4)):
            F.cross_entropy(ddp(xb), yb).backward()
            gao.step(num_samples=len(xb))
            gao.zero_grad()
        out["monitor"] = (monitor.values, {k: calls[k] - before[k] for k in calls})
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_one_collective_per_tracked_window_and_none_untracked():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_count_worker, 2, out_dir)
        out = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    none = {"all_reduce": 0, "all_gather": 0, "other": 0}
    one = {"all_reduce": 1, "all_gather": 0, "other": 0}
    two = {"all_reduce": 1, "all_gather": 1, "other": 0}
    for key in ("norms", "two_batch", "hist_adapt"):
        assert out[key] == [one, none, one, none], (key, out[key])
    # from the second tracked window on, the gathered shapes are predicted (same batch sizes) and
    # the small per-sample vectors travel inside the all_reduce (gradlens.distributed.merge.exchange)
    assert out["per_sample"] == [two, none, one, none]
    calls, n = out["local"]
    assert calls == none and n == 12  # process_group=False: this rank's samples only
    # NoiseScaleMonitor(ranks=2) on DDP: small batch k = micro-batch k of both ranks
    values, calls = out["monitor"]
    assert calls == none  # nothing beyond DDP's own all-reduce
    (x0, y0), (x1, y1) = _problem("mlp")[1]
    model0 = _problem("mlp")[0]
    blocks = []
    for k in range(3):
        sl = slice(4 * k, 4 * k + 4)
        blocks.append(torch.cat([x0[sl], x1[sl]]))
    xs = torch.cat(blocks)
    ys = torch.cat([torch.cat([y0[4 * k : 4 * k + 4], y1[4 * k : 4 * k + 4]]) for k in range(3)])
    g2, tr = two_batch(flat(per_sample_grads(model0, xs, ys)), [8, 8, 8])
    _close(values[0]["grad_sq"], g2)
    _close(values[0]["trace_sigma"], tr)
    assert values[0]["batch_big"] == 24 and values[0]["small_batches"] == 3
    # float32 wire: both ranks used the same 12 samples, so the global batch is them twice
    model0, windows, grad_r, _ = _problem("mlp")
    x, y = windows[0]
    G = flat(per_sample_grads(model0, x, y))
    G2 = torch.cat([G, G])

    counts, _, _ = hist_oracle(G2.float().double(), -grad_r, grad_r, 7)
    h = out["f32"]["grad_hist_1d"]
    assert h.total == G2.numel() and (h.counts - counts).abs().sum() <= 4  # float32 rounding at edges
    _close(out["f32"]["grad_norm"], G.mean(0).norm(), rtol=1e-5)
    names = [nm for nm, _ in model0.named_parameters()]
    for nm, g in zip(names, G2.split([p.numel() for p in model0.parameters()], dim=1)):
        _close(out["f32"]["sum_grad_squared"][nm].flatten(), g.square().sum(0), rtol=1e-4)


def test_process_group_argument_checked():
    model = gradlens.extend(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        Lens(model, [GradNorm()], process_group=object())
    lens = Lens(model, [GradNorm()], process_group=False)  # explicit local: fine
    lens.close()


# ------------------------------------------------------------------- issue 20: rank agreement
def _config_cases(rank: int, tmp: str):
    """(name, kwargs of Lens) per case, for this rank: the ranks differ where the name says."""
    log = os.path.join(tmp, "resumed.jsonl")
    return [
        ("same", dict(instruments=[GradNorm(), GradHist1d(bins=10)], every=2)),
        ("every", dict(instruments=[GradNorm()], every=1 if rank == 0 else 2)),
        ("bins", dict(instruments=[GradNorm(), GradHist1d(bins=10 if rank == 0 else 20)])),
        ("instrument list", dict(instruments=[GradNorm()] + ([BatchL2()] if rank == 1 else []))),
        ("parameters", dict(instruments=[GradNorm()], exclude=("2",) if rank == 1 else ())),
        ("sketch k", dict(instruments=[BatchDot(mode="sketch", k=64 if rank == 0 else 32)])),
        # a callable is compared on 64 windows (documented): these agree there
        ("callable same", dict(instruments=[GradNorm()],
                               every=(lambda s: s % 2 == 0) if rank == 0 else (lambda s: s < 10**6 and s % 2 == 0))),
        ("callable", dict(instruments=[GradNorm()],
                          every=(lambda s: s % 2 == 0) if rank == 0 else (lambda s: s % 3 == 0))),
        # rank 0 writes a log that holds a record of step 4: a fresh Lens on it starts a new run
        # at step 0 (log segments, docs/long_runs.md), so its schedule's phase is every other
        # rank's and the check passes (the log used to move rank 0's first step to 5, which
        # the check then refused with every=2)
        ("log on rank 0, every=2", dict(instruments=[GradNorm()], every=2, log=log)),
        ("log on rank 0, every=1", dict(instruments=[GradNorm()], every=1, log=log)),
    ]


def _agree_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        from gradlens.core.records import Record
        from gradlens.output.sinks import JsonlSink

        if rank == 0:
            with JsonlSink(os.path.join(out_dir, "resumed.jsonl")) as sink:
                sink.write(Record(4, 1, 1, {"loss": 0.0}))
        dist.barrier()
        out = {}
        for name, kw in _config_cases(rank, out_dir):
            model = gradlens.extend(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
            instruments = kw.pop("instruments")
            try:
                lens = Lens(model, instruments, **kw)
                out[name] = ("ok", lens.step)
                lens.close()
            except RuntimeError as err:
                out[name] = ("error", str(err))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_with_different_lens_configurations_are_refused_on_every_rank():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_agree_worker, 2, out_dir)
        outs = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    expect = {
        "every": (r"schedule: ranks \[1\] differ from rank 0 \(this rank, {r}: every={every} with the "
                  r"first window at phase 0, merge='sync'\)", {0: {"every": 1}, 1: {"every": 2}}),
        "bins": (r"instruments: ranks \[1\] differ from rank 0 \(this rank, {r}: \[.*GradHist1d\(key="
                 r"'grad_hist_1d', adapt=None, bins={bins},", {0: {"bins": 10}, 1: {"bins": 20}}),
        "instrument list": (r"instruments: ranks \[1\] differ from rank 0", {}),
        "parameters": (r"parameters: ranks \[1\] differ from rank 0 \(this rank, {r}: 0.weight:\(6, 4\)"
                       r":torch.float32; 0.bias", {}),
        "sketch k": (r"instruments: ranks \[1\] differ.*BatchDot\(key='batch_dot', k={k}, ",
                     {0: {"k": 64}, 1: {"k": 32}}),
        "callable": (r"schedule: ranks \[1\] differ from rank 0 \(this rank, {r}: every=<callable> "
                     r"tracking windows first \+ \[0, {second}, ", {0: {"second": 2}, 1: {"second": 3}}),
    }
    import re

    for r, out in enumerate(outs):
        assert out["same"] == ("ok", 0)
        assert out["callable same"] == ("ok", 0)
        assert out["log on rank 0, every=2"] == ("ok", 0)
        assert out["log on rank 0, every=1"] == ("ok", 0)
        for name, (pattern, fill) in expect.items():
            kind, msg = out[name]
            assert kind == "error", (name, r, out[name])
            assert re.search(pattern.format(r=r, **fill.get(r, {})), msg), (name, r, msg)
            assert "Build the Lens with the same instruments" in msg
            # only the part that differs is named
            others = {"instruments", "schedule", "parameters"} - {pattern.split(":")[0]}
            assert not any(f"{o}: ranks" in msg for o in others), (name, msg)


def _stall_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    done = os.path.join(out_dir, "done")
    try:
        late = dist.new_group([0, 1])  # its own group: a timed-out collective spoils its group
        model = gradlens.extend(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        result = {}
        # 1. a rank that never builds its Lens: the configuration check times out
        if rank == 0:
            t0 = time.monotonic()
            try:
                Lens(model, [GradNorm()], process_group=late, timeout=2)
                result["build"] = ("no error", 0.0)
            except RuntimeError as err:
                result["build"] = (str(err), time.monotonic() - t0)
        dist.barrier()  # rank 1 waits here for case 1 to end
        # 2. both build the Lens; rank 1 never enters the window's merge
        lens = Lens(model, [BatchL2(), GradNorm()], timeout=2)
        if rank == 0:
            x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
            t0 = time.monotonic()
            try:
                lens.flush()
                result["merge"] = ("no error", 0.0)
            except RuntimeError as err:
                result["merge"] = (str(err), time.monotonic() - t0)
            torch.save(result, os.path.join(out_dir, "rank0.pt"))
            open(done, "w").close()
        else:
            while not os.path.exists(done):
                time.sleep(0.05)
    except BaseException:
        import traceback

        traceback.print_exc()
        os._exit(1)
    os._exit(0)  # no destroy_process_group: the other rank left a collective unmatched


def test_a_stalled_rank_times_out_instead_of_hanging():
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_stall_worker, 2, out_dir)
        out = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    msg, took = out["build"]
    assert msg.startswith("the Lens configuration check across ranks failed or did not complete within timeout=2 s"), msg
    assert 1.5 < took < 6.0, took
    msg, took = out["merge"]
    assert msg.startswith("the merge of window 0 across ranks failed or did not complete within timeout=2 s: "
                          "another rank has not reached it"), msg
    assert "Lens(..., timeout=seconds)" in msg
    assert 1.5 < took < 6.0, took
    assert time.monotonic() - t0 < 40.0


def test_timeout_argument_checked():
    model = gradlens.extend(nn.Linear(3, 2))
    for bad in (0, -1.0, float("inf"), "30", True):
        with pytest.raises(ValueError, match=r"timeout must be a number of seconds > 0 or None.*Lens\(\.\.\., timeout=300\)"):
            Lens(model, [GradNorm()], timeout=bad)
    Lens(model, [GradNorm()], timeout=None).close()
