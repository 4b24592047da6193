"""The global gradient sum read from DDP's all-reduced ``p.grad`` (gradlens.distributed.merge.DDPGradRoute).

Equal per-rank and per-micro-step batch sizes under DistributedDataParallel (gloo, CPU): after
the first window ``grad_sum`` no longer travels (the all_reduce shrinks by the tracked size), and
every record still equals the float64 oracle on the rank-major concatenated batch. A window in
which ``p.grad`` was changed after backward (gradient clipping) or whose micro-batches differ in
size falls back to sending ``grad_sum`` (a second all_reduce, once) and stays exact.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, NoiseScale, NoiseScaleTwoBatch, NormTest, SumGradSquared
from oracle import MODELS, flat, make_problem, per_sample_grads, two_batch
from test_distributed import _close, _init, _spawn


WORLD = 2
LR = 0.3
# per window: micro-batch sizes of every rank (equal across ranks) and what happens before step
PLAN = [
    ([6], None),  # first window: grad_sum travels (nothing known yet), verdict positive
    ([6], None),  # read from p.grad
    ([2, 2, 2], None),  # K = 3 under no_sync, read from p.grad
    ([6], "clip"),  # p.grad clipped after backward: second all_reduce with grad_sum (light
    # instruments: no, the squared norm was taken at the end of the backward)
    ([6], "clip"),  # clipped again: p.grad was copied at the end of the backward, so no second
    # all_reduce (grad_sum travels in the first: the last verdict was negative)
    ([3, 3], None),  # grad_sum travels again (the last verdict was negative); verdict positive
    ([4, 2], None),  # unequal micro-batches: second all_reduce
    ([5], None),  # fewer samples: the inline gather's prediction fails, batch_l2 is gathered
]


def _windows():
    model, _, _ = make_problem(MODELS["mlp"], seed=0)
    data = [make_problem(MODELS["mlp"], seed=s)[1:] for s in range(len(PLAN))]
    return model, data


def _run_plan(rank: int, instruments, after_update=lambda lens: None, on_build=lambda lens: None, **lens_kwargs):
    """The PLAN's windows under DDP on this rank's share of each window (micro-steps before the
    last under no_sync), through a Lens; ``on_build(lens)`` once the Lens is built,
    ``after_update(lens)`` after every update. Returns (lens, the model's state dict at the
    start of every window and at the end)."""
    model0, data = _windows()
    model = gradlens.extend(copy.deepcopy(model0))
    ddp = nn.parallel.DistributedDataParallel(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    lens = Lens(model, instruments, optimizer=opt, **lens_kwargs)
    on_build(lens)
    thetas = [copy.deepcopy(model0).state_dict()]
    for (micro_sizes, event), (x, y) in zip(PLAN, data):
        n = sum(micro_sizes)
        mine = slice(rank * n, (rank + 1) * n)
        xs, ys = x[mine].split(micro_sizes), y[mine].split(micro_sizes)
        for k, (xb, yb) in enumerate(zip(xs, ys)):
            with ddp.no_sync() if k < len(xs) - 1 else contextlib.nullcontext():
                loss = loss_fn(ddp(xb), yb)
                with lens.capture():
                    loss.backward()
        if event == "clip":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1e-3)
        opt.step()
        opt.zero_grad()
        after_update(lens)
        thetas.append(copy.deepcopy(model.state_dict()))
    lens.close()
    return lens, thetas


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        sizes = []
        original = dist.all_reduce

        def counting(tensor, *a, **k):
            sizes.append(tensor.numel())
            return original(tensor, *a, **k)

        dist.all_reduce = counting
        gathers = []
        gather_fns = {fn: getattr(dist, fn) for fn in ("all_gather_into_tensor", "all_gather_single") if hasattr(dist, fn)}
        for fn, orig in gather_fns.items():
            setattr(dist, fn, lambda *a, _orig=orig, **k: (gathers.append(1), _orig(*a, **k))[1])
        calls, fast, built = [], [], []
        mark = [0, 0]  # collectives counted when the window started

        def on_build(lens):  # the Lens's one configuration check: one all_reduce of [R, 3] hashes
            built.append((list(sizes), len(gathers)))
            mark[:] = [len(sizes), len(gathers)]

        def after_update(lens):
            calls.append((sizes[mark[0]:], len(gathers) - mark[1]))
            mark[:] = [len(sizes), len(gathers)]
            fast.append(lens._ddp_route.fast)

        insts = [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale(), NoiseScaleTwoBatch()]
        lens, thetas = _run_plan(rank, insts, after_update, on_build)
        dist.all_reduce = original
        for fn, orig in gather_fns.items():
            setattr(dist, fn, orig)
        records = [(r.num_samples, r.micro_steps, dict(r.values)) for r in lens.records]
        torch.save((records, thetas, calls, fast, built), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_global_grad_sum_from_ddp_grad_equals_oracle():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, WORLD, out_dir)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    model0, data = _windows()
    records, thetas, calls, fast, built = results[0]
    assert built == [([WORLD * 3], 0)]  # building the Lens: its configuration check only
    tracked = sum(p.numel() for p in model0.parameters())
    n_params = len(list(model0.parameters()))
    # the all_reduce carries grad_sum only where the route cannot be used
    assert fast == [True, True, True, False, True, True, False, True]
    assert [len(c) for c, _ in calls] == [1, 1, 1, 2, 1, 1, 2, 1]
    # batch_l2 is gathered when its shapes are new; otherwise it travels inside the all_reduce
    # (12 float64 slots)
    assert [g for _, g in calls] == [1, 0, 0, 0, 0, 0, 0, 1]
    full = calls[4][0][0]
    assert calls[0][0][0] == full - 12
    for t in (1, 2, 3, 5):  # grad_sum and its presence flags left out
        assert calls[t][0][0] == full - tracked - n_params
    assert calls[3][0][1] >= tracked and calls[6][0][1] >= tracked  # the fallback sends it
    for t, ((micro_sizes, _), (x, y)) in enumerate(zip(PLAN, data)):
        n_rank = sum(micro_sizes)
        m = copy.deepcopy(model0)
        m.load_state_dict(thetas[t])
        G = flat(per_sample_grads(m, x[: WORLD * n_rank], y[: WORLD * n_rank]))
        n, micro, vals = records[t]
        assert n == G.shape[0] and micro == WORLD * len(micro_sizes)
        _close(vals["batch_l2"], G.square().sum(1))
        names = [nm for nm, _ in model0.named_parameters()]
        for nm, g in zip(names, G.split([p.numel() for p in model0.parameters()], dim=1)):
            _close(vals["sum_grad_squared"][nm].flatten(), g.square().sum(0))
        mean, var = G.mean(0), G.var(0)
        _close(vals["grad_norm"], mean.norm())
        _close(vals["noise_scale"], var.sum() / mean.square().sum())
        _close(vals["norm_test"], (var.sum() / n).sqrt() / mean.norm())
        g2, tr = two_batch(G, micro_sizes * WORLD)
        _close(vals["noise_scale_two_batch"]["grad_sq"], g2)
        _close(vals["noise_scale_two_batch"]["trace_sigma"], tr)
    for other in results[1:]:  # every rank holds the same records
        for (n0, m0, v0), (n1, m1, v1) in zip(records, other[0]):
            assert (n0, m0) == (n1, m1) and v0["grad_norm"] == v1["grad_norm"]


def _light_worker(rank: int, world: int, port: int, out_dir: str, merge: str) -> None:
    """A Lens of the window gradient only (light capture) over the same PLAN: sync or deferred."""
    _init(rank, world, port)
    try:
        seen, fast = [], []  # records present after each update, the route's verdicts

        def after_update(lens):
            seen.append(len(lens.records))
            fast.append(lens._ddp_route.fast)

        lens, thetas = _run_plan(rank, [GradNorm(), NoiseScaleTwoBatch()], after_update, merge=merge)
        records = [(r.step, r.num_samples, dict(r.values)) for r in lens.records]
        torch.save((records, thetas, seen, fast), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("merge", ["sync", "deferred"])
def test_light_lens_under_ddp_equals_oracle(merge):
    """GradNorm + NoiseScaleTwoBatch hook only the parameters (light capture); under DDP the
    global gradient norm comes from p.grad (or, after clipping / unequal micro-batches, from the
    window's own sums): exact in both merge modes; "deferred" gives each record one window
    later and close() completes the last."""
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_light_worker, WORLD, out_dir, merge)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    model0, data = _windows()
    records, thetas, seen, fast = results[0]
    lag = 1 if merge == "deferred" else 0
    assert seen == [t + 1 - lag for t in range(len(PLAN))]
    # clipping after backward keeps the route (||p.grad||^2 was taken at the end of the
    # backward); only the window of unequal micro-batches sends the window sums
    if merge == "sync":
        assert fast == [True, True, True, True, True, True, False, True]
    assert [r[0] for r in records] == list(range(len(PLAN)))
    for t, ((micro_sizes, _), (x, y)) in enumerate(zip(PLAN, data)):
        n_rank = sum(micro_sizes)
        m = copy.deepcopy(model0)
        m.load_state_dict(thetas[t])
        G = flat(per_sample_grads(m, x[: WORLD * n_rank], y[: WORLD * n_rank]))
        _, n, vals = records[t]
        assert n == G.shape[0]
        _close(vals["grad_norm"], G.mean(0).norm())
        g2, tr = two_batch(G, micro_sizes * WORLD)
        _close(vals["noise_scale_two_batch"]["grad_sq"], g2)
        _close(vals["noise_scale_two_batch"]["trace_sigma"], tr)
    for other in results[1:]:
        assert [r[2]["grad_norm"] for r in other[0]] == [r[2]["grad_norm"] for r in records]


def test_deferred_merge_refuses_per_sample_instruments():
    model, _, _ = make_problem(MODELS["mlp"], seed=0)
    with pytest.raises(ValueError, match="merge='sync'"):
        Lens(gradlens.extend(model), [BatchL2(), GradNorm()], merge="deferred")
    with pytest.raises(ValueError, match="'sync' or 'deferred'"):
        Lens(gradlens.extend(model), [GradNorm()], merge="later")
