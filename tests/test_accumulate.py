"""GradientAccumulateOptimizer / GradientAccumulateModel == one optimizer step on the whole window."""

from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.functional import mse_loss

from gradlens import GradientAccumulateModel, GradientAccumulateOptimizer
from gradlens.training.agc import adaptive_clip_grad_

from oracle import (
    ACCUM_SPLITS,
    OPTIMIZERS,
    SplitCase,
    assert_params_close,
    inner_step_count,
    make_data,
    make_mlp,
    rel_err,
)

TOL = 1e-10


def _window_data(case: SplitCase, seed: int = 1):
    """Per window: the list of micro-batches (x_k, y_k) and their concatenation."""
    total = sum(sum(w) for w in case.windows)
    x, y = make_data(total, seed)
    out, start = [], 0
    for sizes in case.windows:
        micro = []
        for b in sizes:
            micro.append((x[start : start + b], y[start : start + b]))
            start += b
        out.append(micro)
    return out


def _fold_each(model, opt, batches):
    """One micro-step per (x, y): backward of the mean loss, step(num_samples=len(x)), zero_grad."""
    for x, y in batches:
        mse_loss(model(x), y).backward()
        opt.step(num_samples=len(x))
        opt.zero_grad()


def _run_reference(model, opt, windows, reduction="mean", scheduler=None, skip=()):
    lrs = []
    for w, micro in enumerate(windows):
        if w in skip:
            continue
        x = torch.cat([m[0] for m in micro])
        y = torch.cat([m[1] for m in micro])
        opt.zero_grad()
        mse_loss(model(x), y, reduction=reduction).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def _run_accumulated(model, opt, windows, reduction="mean", give_num_samples=True, scheduler=None):
    lrs, updates = [], []
    for micro in windows:
        for x, y in micro:
            mse_loss(model(x), y, reduction=reduction).backward()
            opt.step(num_samples=len(x) if give_num_samples else None)
            updates.append(opt.has_updated)
            opt.zero_grad()
            if opt.has_updated and scheduler is not None:
                scheduler.step()
            if opt.has_updated:
                lrs.append(opt.param_groups[0]["lr"])
    if opt.flush():
        updates[-1] = "flush"
        if scheduler is not None:
            scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs, updates


@pytest.mark.parametrize("split", ACCUM_SPLITS, ids=lambda s: s.name)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_equivalence_with_one_big_batch(opt_name, split):
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS[opt_name](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(
        OPTIMIZERS[opt_name](list(acc_model.parameters())), accum_steps=split.accum_steps
    )
    _run_reference(ref_model, ref_opt, windows)
    _, updates = _run_accumulated(acc_model, opt, windows)

    assert_params_close(acc_model, ref_model, TOL)
    assert opt.iterations == len(windows)
    assert inner_step_count(opt.optimizer) == inner_step_count(ref_opt)
    expected = []
    for sizes in split.windows:
        full = len(sizes) == split.accum_steps
        expected += [False] * (len(sizes) - 1) + [True if full else "flush"]
    assert updates == expected


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adamw"])
def test_equal_sizes_without_num_samples(opt_name):
    split = ACCUM_SPLITS[2]  # equal_k4
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS[opt_name](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(OPTIMIZERS[opt_name](list(acc_model.parameters())), 4)
    _run_reference(ref_model, ref_opt, windows)
    _run_accumulated(acc_model, opt, windows, give_num_samples=False)
    assert_params_close(acc_model, ref_model, TOL)


@pytest.mark.parametrize("opt_name", ["sgd_momentum", "adam"])
def test_reduction_sum(opt_name):
    split = ACCUM_SPLITS[3]  # unequal_k3
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS[opt_name](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(
        OPTIMIZERS[opt_name](list(acc_model.parameters())), 3, reduction="sum"
    )
    _run_reference(ref_model, ref_opt, windows, reduction="sum")
    _run_accumulated(acc_model, opt, windows, reduction="sum")
    assert_params_close(acc_model, ref_model, TOL)


def test_lr_scheduler_steps_on_real_updates():
    split = ACCUM_SPLITS[4]  # partial_last
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["adamw"](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(OPTIMIZERS["adamw"](list(acc_model.parameters())), 4)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda t: 1.0 / (1 + t))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1 + t))
    ref_lrs = _run_reference(ref_model, ref_opt, windows, scheduler=ref_sched)
    lrs, _ = _run_accumulated(acc_model, opt, windows, scheduler=sched)
    assert lrs == ref_lrs
    assert len(lrs) == 3
    assert_params_close(acc_model, ref_model, TOL)


@settings(max_examples=15, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 6), min_size=1, max_size=5),
    accum_steps=st.integers(1, 4),
)
def test_property_any_split(sizes, accum_steps):
    """Any micro-batch sizes, any accum_steps: every window equals one step on its samples."""
    windows_sizes = [tuple(sizes[i : i + accum_steps]) for i in range(0, len(sizes), accum_steps)]
    split = SplitCase("h", accum_steps, tuple(windows_sizes))
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(
        OPTIMIZERS["sgd_momentum"](list(acc_model.parameters())), accum_steps
    )
    _run_reference(ref_model, ref_opt, windows)
    _run_accumulated(acc_model, opt, windows)
    assert_params_close(acc_model, ref_model, TOL)


# ------------------------------------------------------------------- counters, hooks, gradients
def test_counters_and_gradients_and_zero_grad_keeps_window():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
    x, y = make_data(6)
    grads = []
    for k, (b0, b1) in enumerate([(0, 1), (1, 3)]):
        mse_loss(model(x[b0:b1]), y[b0:b1]).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step(num_samples=b1 - b0)
        opt.zero_grad(set_to_none=(k == 0))  # both flavours keep the accumulation
        assert opt.micro_step == k + 1 and not opt.has_updated and opt.iterations == 0
    expected = [(1 * g0 + 2 * g1) / 3 for g0, g1 in zip(*grads)]
    for got, want in zip(opt.gradients, expected):
        assert rel_err(got, want) < 1e-14
    assert len(opt.state) == 0  # no accumulator in the inner optimizer's state
    mse_loss(model(x[3:]), y[3:]).backward()
    opt.step(num_samples=3)
    assert opt.has_updated and opt.iterations == 1 and opt.micro_step == 0
    assert all(g is None for g in opt.gradients)
    opt.reset()
    assert opt.micro_step == 0


def test_step_hooks_fire_on_real_updates_only_around_the_update():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), accum_steps=2)
    events = []

    def pre(o, args, kwargs):
        assert o is opt
        events.append(("pre", [p.detach().clone() for p in model.parameters()],
                       [p.grad.clone() for p in model.parameters()]))

    def post(o, args, kwargs):
        events.append(("post", [p.detach().clone() for p in model.parameters()], o.iterations))

    h_pre = opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    ends = []
    opt.register_window_end_hook(lambda o, updated: ends.append(updated))
    x, y = make_data(8)
    theta0 = [p.detach().clone() for p in model.parameters()]
    micro_grads = []
    for k in range(4):
        mse_loss(model(x[2 * k : 2 * k + 2]), y[2 * k : 2 * k + 2]).backward()
        micro_grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        assert len(events) == 2 * ((k + 1) // 2)
    kinds = [e[0] for e in events]
    assert kinds == ["pre", "post", "pre", "post"]
    # pre-hook: parameters at theta_t and p.grad = the window gradient; post: theta_{t+1}
    for before, after in zip(events[0][1], theta0):
        assert torch.equal(before, after)
    for g_hook, g0, g1 in zip(events[0][2], *micro_grads[:2]):
        assert rel_err(g_hook, (g0 + g1) / 2) < 1e-14
    for after, before, g in zip(events[1][1], theta0, events[0][2]):
        assert rel_err(after, before - 0.5 * g) < 1e-14
    assert events[1][2] == 1 and events[3][2] == 2
    assert ends == [True, True]
    h_pre.remove()
    opt.step()
    opt.step()
    kinds = [e[0] for e in events]
    assert kinds == ["pre", "post", "pre", "post", "post"]  # removed pre-hook no longer fires


def test_global_optimizer_hooks_fire_once_per_update():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
    calls = []
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(
        lambda o, a, k: calls.append(type(o).__name__)
    )
    try:
        x, y = make_data(6)
        for k in range(6):
            mse_loss(model(x[k : k + 1]), y[k : k + 1]).backward()
            opt.step()
            opt.zero_grad()
    finally:
        handle.remove()
    assert calls == ["SGD", "SGD"]


def test_clip_is_called_once_per_window_on_the_window_gradient():
    model = make_mlp(0)
    seen = []

    def clip(params):
        seen.append([p.grad.clone() for p in params])
        torch.nn.utils.clip_grad_norm_(params, max_norm=0.01)

    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), 2, clip=clip)
    ref = copy.deepcopy(model)
    x, y = make_data(4)
    for k in range(2):
        mse_loss(model(x[2 * k : 2 * k + 2]), y[2 * k : 2 * k + 2]).backward()
        opt.step(num_samples=2)
        opt.zero_grad()
    assert len(seen) == 1
    mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm=0.01)
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert_params_close(model, ref, TOL)


def test_clip_with_agc_excluding_head_by_name():
    model, ref = make_mlp(0), make_mlp(0)
    clip = functools.partial(adaptive_clip_grad_, model, 0.01, exclude=("2.weight", "2.bias"))
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), 2, clip=lambda _: clip()
    )
    x, y = make_data(5)
    for sl in (slice(0, 2), slice(2, 5)):
        mse_loss(model(x[sl]), y[sl]).backward()
        opt.step(num_samples=sl.stop - sl.start)
        opt.zero_grad()
    mse_loss(ref(x), y).backward()
    adaptive_clip_grad_(ref, 0.01, exclude=("2.weight", "2.bias"))
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    assert_params_close(model, ref, TOL)


# ------------------------------------------------------------------------------- checkpointing
@pytest.mark.parametrize("opt_name", ["adamw", "sgd_nesterov"])
def test_mid_window_checkpoint_resume(opt_name):
    split = SplitCase("ckpt", 3, ((2, 3, 1), (4, 1, 2), (3, 3, 2)))
    micro = [m for w in _window_data(split) for m in w]
    stop = 5  # saved after micro-step 2 of window 2

    def fresh():
        model = make_mlp(0)
        opt = GradientAccumulateOptimizer(OPTIMIZERS[opt_name](list(model.parameters())), 3)
        return model, opt

    model_a, opt_a = fresh()
    _fold_each(model_a, opt_a, micro)

    model_b, opt_b = fresh()
    _fold_each(model_b, opt_b, micro[:stop])
    assert opt_b.micro_step == 2
    buffer = io.BytesIO()
    torch.save({"model": model_b.state_dict(), "opt": opt_b.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    model_c, opt_c = fresh()
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    assert opt_c.micro_step == 2 and opt_c.iterations == 1
    _fold_each(model_c, opt_c, micro[stop:])
    for p, q in zip(model_c.parameters(), model_a.parameters()):
        assert torch.equal(p, q)
    assert inner_step_count(opt_c.optimizer) == inner_step_count(opt_a.optimizer)
    assert opt_c.iterations == opt_a.iterations == 3


def test_window_grad_hook_sees_the_window_gradient_before_clipping():
    """Gradients 1, 2, 3 with num_samples 1, 2, 3: the hook sees (1 + 4 + 9) / 6 once per
    update, before clipping (window_sum mid-window: the unnormalised 1 + 4 = 5)."""
    p = nn.Parameter(torch.zeros(1))
    seen, sums, clipped = [], [], []

    def clip(params):
        clipped.append(float(params[0].grad))
        params[0].grad.clamp_(max=2.0)

    opt = GradientAccumulateOptimizer(torch.optim.SGD([p], lr=1.0), accum_steps=3, clip=clip)
    opt.register_window_grad_hook(lambda o: seen.append(float(o.window_grad(p))))
    for g, b in ((1.0, 1), (2.0, 2), (3.0, 3)):
        p.grad = torch.tensor([g])
        opt.step(num_samples=b)
        opt.zero_grad()
        sums.append(None if opt.window_sum(p) is None else float(opt.window_sum(p)))
    assert seen == [pytest.approx(14.0 / 6.0)] and clipped == seen
    assert sums == [1.0, 5.0, None]
    assert float(p.detach()) == pytest.approx(-2.0)


def test_accumulator_changed_outside_the_wrapper_is_an_error():
    """The window's first p.grad is kept as the accumulator: changing it in place outside the
    wrapper is refused at the next step (not a wrong window); model.zero_grad(set_to_none=False)
    between micro-steps is the forgotten-zero_grad error, and the window is dropped."""
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
    x, y = make_data(6)
    mse_loss(model(x[:2]), y[:2]).backward()
    opt.step(num_samples=2)
    next(model.parameters()).grad.mul_(2.0)  # in place, after the fold
    opt.zero_grad()
    mse_loss(model(x[2:4]), y[2:4]).backward()
    with pytest.raises(RuntimeError, match=r"changed outside the wrapper.*opt.zero_grad\(\)"):
        opt.step(num_samples=2)
    opt.reset()
    opt.zero_grad()
    mse_loss(model(x[:2]), y[:2]).backward()
    opt.step(num_samples=2)
    model.zero_grad(set_to_none=False)
    mse_loss(model(x[2:4]), y[2:4]).backward()
    with pytest.raises(RuntimeError, match=r"without zero_grad\(\) in between.*this window is dropped"):
        opt.step(num_samples=2)
    assert opt.micro_step == 0


def test_in_memory_state_dict_survives_later_windows():
    """The wrapper reuses its accumulator buffers from window to window: a state_dict kept in
    memory (not serialised) mid-window must still resume exactly after later windows ran."""
    split = SplitCase("mem", 2, ((2, 3), (4, 1), (3, 2)))
    micro = [m for w in _window_data(split) for m in w]

    def fresh():
        model = make_mlp(0)
        return model, GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)

    model_a, opt_a = fresh()
    _fold_each(model_a, opt_a, micro)
    model_b, opt_b = fresh()
    _fold_each(model_b, opt_b, micro[:3])  # mid-window 2
    kept = {"model": copy.deepcopy(model_b.state_dict()), "opt": opt_b.state_dict()}
    before = [t.clone() for t in kept["opt"]["gradlens_accumulate"]["accumulators"].values()]
    _fold_each(model_b, opt_b, micro[3:])  # the wrapper writes windows 2 and 3 into its buffers
    after = list(kept["opt"]["gradlens_accumulate"]["accumulators"].values())
    assert len(before) == len(after) > 0
    assert all(torch.equal(u, v) for u, v in zip(before, after))
    model_c, opt_c = fresh()
    model_c.load_state_dict(kept["model"])
    opt_c.load_state_dict(kept["opt"])
    _fold_each(model_c, opt_c, micro[3:])
    for p, q in zip(model_c.parameters(), model_a.parameters()):
        assert torch.equal(p, q)


def test_version_1_state_dict_still_loads():
    """Version 1 sections held the unnormalised window sums: a mid-window one (made here from a
    version 2 one) resumes to the same parameters, up to rounding."""
    split = SplitCase("v1", 3, ((2, 3, 1), (4, 1, 2)))
    micro = [m for w in _window_data(split) for m in w]

    def fresh():
        model = make_mlp(0)
        return model, GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), 3)

    model_a, opt_a = fresh()
    _fold_each(model_a, opt_a, micro)
    model_b, opt_b = fresh()
    _fold_each(model_b, opt_b, micro[:5])
    saved = copy.deepcopy({"model": model_b.state_dict(), "opt": opt_b.state_dict()})
    section = saved["opt"]["gradlens_accumulate"]
    assert section["version"] == 2
    weights = section.pop("last_weight")
    section["version"] = 1
    section["accumulators"] = {i: acc * weights[i] for i, acc in section["accumulators"].items()}
    model_c, opt_c = fresh()
    model_c.load_state_dict(saved["model"])
    opt_c.load_state_dict(saved["opt"])
    _fold_each(model_c, opt_c, micro[5:])
    assert_params_close(model_c, model_a, TOL)


def test_load_plain_torch_state_dict_starts_empty_window():
    model = make_mlp(0)
    plain = torch.optim.Adam(model.parameters())
    x, y = make_data(3)
    mse_loss(model(x), y).backward()
    plain.step()
    opt = GradientAccumulateOptimizer(torch.optim.Adam(model.parameters()), 2)
    opt.load_state_dict(plain.state_dict())
    assert opt.micro_step == 0 and inner_step_count(opt.optimizer) == 1


# ------------------------------------------------------------------------------------- AMP
def test_grad_scaler_skips_exactly_the_window_with_inf():
    """Standard AMP loop (scaler.step/update every micro-step), scale changing mid-window."""
    split = SplitCase("amp", 2, ((2, 3), (1, 4), (3, 2), (2, 2)))
    windows = _window_data(split)
    poisoned = 1
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["adam"](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(OPTIMIZERS["adam"](list(acc_model.parameters())), 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales, updates = [], []
    for w, micro in enumerate(windows):
        for k, (x, y) in enumerate(micro):
            loss = mse_loss(acc_model(x), y)
            if w == poisoned and k == 0:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scales.append(scaler.get_scale())
            scaler.step(opt, num_samples=len(x))
            scaler.update()
            updates.append(opt.has_updated)
            opt.zero_grad()
        if w == poisoned:
            assert all(g is None for g in opt.gradients)  # accumulators clean for the next window
    assert len(set(scales)) > 2  # the scale moved inside windows
    assert updates == [False, True, False, False, False, True, False, True]
    assert opt.skipped_windows == 1 and opt.iterations == 3
    _run_reference(ref_model, ref_opt, windows, skip={poisoned})
    assert_params_close(acc_model, ref_model, TOL)
    assert inner_step_count(opt.optimizer) == 3


def test_grad_scaler_with_autocast_float16_on_cpu():
    model = make_mlp(0, torch.float32)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = make_data(4, dtype=torch.float32)
    before = [p.detach().clone() for p in model.parameters()]
    for sl in (slice(0, 2), slice(2, 4)):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = mse_loss(model(x[sl]).float(), y[sl])
        scaler.scale(loss).backward()
        scaler.step(opt, num_samples=2)
        scaler.update()
        opt.zero_grad()
    assert opt.has_updated
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_mixing_plain_and_scaler_steps_in_a_window_raises():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    x, y = make_data(4)
    scaler.scale(mse_loss(model(x[:2]), y[:2])).backward()
    opt.step(num_samples=2)  # wrong: the scaled gradient is not unscaled here
    opt.zero_grad()
    scaler.scale(mse_loss(model(x[2:]), y[2:])).backward()
    with pytest.raises(RuntimeError, match=r"call scaler.step\(opt\) and scaler.update\(\) on every"):
        scaler.step(opt, num_samples=2)


# ------------------------------------------------------------------------------------ bf16
def test_bf16_parameters_fp32_accumulators():
    torch.manual_seed(0)
    model = nn.Linear(64, 16).to(torch.bfloat16)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=100)
    x = torch.randn(64 * 4, 64).to(torch.bfloat16)
    naive = [torch.zeros_like(p) for p in model.parameters()]  # bf16 accumulation (p.grad style)
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in model.parameters()]
    for k in range(64):
        out = model(x[4 * k : 4 * k + 4])
        (out.float().square().mean() * (1 + k % 5)).backward()
        for n, e, p in zip(naive, exact, model.parameters()):
            n.add_(p.grad)
            e.add_(p.grad.double())
        opt.step(num_samples=4)
        opt.zero_grad()
    fp32_err = max(rel_err(g, e / 64) for g, e in zip(opt.gradients, exact))
    bf16_err = max(rel_err(n / 64, e / 64) for n, e in zip(naive, exact))
    assert all(g.dtype == torch.float32 for g in opt.gradients)
    assert fp32_err < 1e-6, fp32_err
    assert bf16_err > 100 * fp32_err, (bf16_err, fp32_err)
    before = model.weight.detach().clone()
    assert opt.flush()
    assert model.weight.dtype == torch.bfloat16 and not torch.equal(before, model.weight)


# --------------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors():
    model = make_mlp(0)
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"accum_steps must be >= 1.*got 0"):
        GradientAccumulateOptimizer(sgd(), accum_steps=0)
    with pytest.raises(TypeError, match=r"accum_steps must be an int.*2.5"):
        GradientAccumulateOptimizer(sgd(), accum_steps=2.5)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, got list"):
        GradientAccumulateOptimizer(list(model.parameters()), accum_steps=2)
    with pytest.raises(TypeError, match=r"already a GradientAccumulateOptimizer"):
        GradientAccumulateOptimizer(GradientAccumulateOptimizer(sgd(), 2), 2)
    with pytest.raises(ValueError, match=r"reduction must be 'mean'.*got 'avg'"):
        GradientAccumulateOptimizer(sgd(), 2, reduction="avg")
    with pytest.raises(TypeError, match=r"accum_dtype must be a floating torch.dtype"):
        GradientAccumulateOptimizer(sgd(), 2, accum_dtype=torch.int32)
    with pytest.raises(TypeError, match=r"clip must be a callable"):
        GradientAccumulateOptimizer(sgd(), 2, clip=1.0)
    opt = GradientAccumulateOptimizer(sgd(), 2)
    for bad in (0, -3):
        with pytest.raises(ValueError, match=rf"num_samples must be > 0.*got {bad}"):
            opt.step(num_samples=bad)
    with pytest.raises(TypeError, match=r"num_samples must be a positive Python number.*Tensor"):
        opt.step(num_samples=torch.tensor(3))
    opt.step(num_samples=2)
    with pytest.raises(ValueError, match=r"give it on every micro-step of a window or on none"):
        opt.step()


def test_bad_state_dict_raises():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    x, y = make_data(2)
    mse_loss(model(x), y).backward()
    opt.step(num_samples=2)
    state = opt.state_dict()

    bad_version = copy.deepcopy(state)
    bad_version["gradlens_accumulate"]["version"] = 99
    with pytest.raises(ValueError, match=r"'version'\] is 99.*reads version 1 or 2"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3).load_state_dict(
            bad_version
        )
    other = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()
    with pytest.raises(ValueError, match=r"accumulator of shape \(7, 5\) for parameter 0.*\(4, 5\)"):
        GradientAccumulateOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), 3).load_state_dict(
            state
        )
    with pytest.raises(ValueError, match=r"reduction='mean'.*reduction='sum'"):
        GradientAccumulateOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), 3, reduction="sum"
        ).load_state_dict(state)
    with pytest.raises(ValueError, match=r"micro_step=1.*accum_steps=1.*accum_steps=3"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 1).load_state_dict(
            state
        )


# ------------------------------------------------------------------- GradientAccumulateModel
class FakeLens:
    """Records how often ``capture()`` was entered and that backward ran inside it."""

    def __init__(self, model: nn.Module) -> None:
        self.entered = 0
        self.backward_inside = 0
        self.model = model

    def capture(self):
        lens = self

        class _Capture:
            def __enter__(self):
                lens.entered += 1
                self.before = [None if p.grad is None else p.grad.clone() for p in lens.model.parameters()]

            def __exit__(self, *exc):
                after = [p.grad for p in lens.model.parameters()]
                if any(a is not None and (b is None or not torch.equal(a, b))
                       for a, b in zip(after, self.before)):
                    lens.backward_inside += 1
                return False

        return _Capture()


@pytest.mark.parametrize("n, accum_steps", [(12, 4), (10, 4), (7, 3), (3, 5)])
def test_model_train_step_equals_full_batch(n, accum_steps):
    ref_model, model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["sgd_momentum"](list(ref_model.parameters()))
    lens = FakeLens(model)
    trainer = GradientAccumulateModel(
        model, OPTIMIZERS["sgd_momentum"](list(model.parameters())), mse_loss, accum_steps, lens=lens
    )
    for step in range(3):
        x, y = make_data(n, seed=10 + step)
        loss = trainer.train_step((x, y))
        ref_opt.zero_grad()
        ref_loss = mse_loss(ref_model(x), y)
        ref_loss.backward()
        ref_opt.step()
        assert rel_err(loss, ref_loss) < 1e-13
    assert_params_close(model, ref_model, TOL)
    micro = min(n, accum_steps)
    assert lens.entered == 3 * micro and lens.backward_inside == 3 * micro


def test_model_reduction_sum_and_composition_with_optimizer_wrapper():
    ref_model, model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["adam"](list(ref_model.parameters()))
    opt = GradientAccumulateOptimizer(OPTIMIZERS["adam"](list(model.parameters())), 2, reduction="sum")
    loss_fn = functools.partial(mse_loss, reduction="sum")
    trainer = GradientAccumulateModel(model, opt, loss_fn, 3, reduction="sum")
    batches = [make_data(n, seed=20 + n) for n in (7, 5, 6, 4)]
    for x, y in batches:
        trainer.train_step((x, y))
    for i in range(0, 4, 2):
        x = torch.cat([batches[i][0], batches[i + 1][0]])
        y = torch.cat([batches[i][1], batches[i + 1][1]])
        ref_opt.zero_grad()
        loss_fn(ref_model(x), y).backward()
        ref_opt.step()
    assert opt.iterations == 2
    assert_params_close(model, ref_model, TOL)


def test_model_bad_input():
    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"accum_steps must be >= 1.*got 0"):
        GradientAccumulateModel(model, opt, mse_loss, 0)
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        GradientAccumulateModel(model, "sgd", mse_loss, 2)
    with pytest.raises(TypeError, match=r"lens must be a gradlens Lens"):
        GradientAccumulateModel(model, opt, mse_loss, 2, lens=object())
    trainer = GradientAccumulateModel(model, opt, mse_loss, 2)
    x, y = make_data(4)
    with pytest.raises(TypeError, match=r"batch must be a tuple \(inputs..., target\)"):
        trainer.train_step(x)
    with pytest.raises(ValueError, match=r"same leading \(batch\) size, got \[4, 3\]"):
        trainer.train_step((x, y[:3]))
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor, got shape \(2, 3\)"):
        GradientAccumulateModel(model, opt, functools.partial(mse_loss, reduction="none"), 2).train_step(
            (x, y)
        )


# ------------------------------------------------------------------- misuse (issue 12)
def test_misuse_is_an_error_not_a_misweighted_window():
    model = make_mlp(0)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
    x, y = make_data(6)
    mse_loss(model(x[:2]), y[:2]).backward()
    opt.step(num_samples=2)
    with pytest.raises(RuntimeError, match=r"step\(\) was called twice for one backward"):
        opt.step(num_samples=2)
    mse_loss(model(x[2:4]), y[2:4]).backward()  # zero_grad forgotten: p.grad = g1 + g2
    with pytest.raises(RuntimeError, match=r"without zero_grad\(\) in between.*opt.zero_grad\(\)"):
        opt.step(num_samples=2)
    # the window's first p.grad was kept as its accumulator, so that backward changed the
    # window: it is dropped, and the next micro-step starts a new one
    assert opt.micro_step == 0
    opt.zero_grad(set_to_none=False)  # in place is fine through the wrapper
    mse_loss(model(x[2:4]), y[2:4]).backward()
    opt.step(num_samples=2)
    assert opt.micro_step == 1
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    mse_loss(model(x[4:6]), y[4:6]).backward()
    opt.step(num_samples=2)
    assert opt.micro_step == 2


def test_num_samples_unlike_the_lens_micro_batch_is_an_error():
    import gradlens
    from gradlens.instruments import BatchL2

    model = gradlens.extend(make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    lens = gradlens.Lens(model, [BatchL2()], optimizer=opt)
    x, y = make_data(6)
    loss = loss_fn(model(x[:4]), y[:4])
    with lens.capture():
        loss.backward()
    with pytest.raises(ValueError, match=r"num_samples=3.*micro-batch of 4 samples.*len\(x\)"):
        opt.step(num_samples=3)
    opt.step(num_samples=4)
    lens.close()


def test_grad_scaler_given_to_the_wrapper_uses_only_public_api():
    """grad_scaler=scaler: the scale from get_scale(), inf/nan detected by the wrapper."""
    split = SplitCase("amp", 2, ((2, 3), (1, 4), (3, 2)))
    windows = _window_data(split)
    ref_model, acc_model = make_mlp(0), make_mlp(0)
    ref_opt = OPTIMIZERS["adam"](list(ref_model.parameters()))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    opt = GradientAccumulateOptimizer(OPTIMIZERS["adam"](list(acc_model.parameters())), 2, grad_scaler=scaler)
    for w, micro in enumerate(windows):
        for k, (x, y) in enumerate(micro):
            loss = mse_loss(acc_model(x), y)
            if w == 1 and k == 1:
                loss = loss * float("nan")
            scaler.scale(loss).backward()
            scaler.step(opt, num_samples=len(x))
            scaler.update()
            opt.zero_grad()
    assert opt.skipped_windows == 1 and opt.iterations == 2
    _run_reference(ref_model, ref_opt, windows, skip={1})
    assert_params_close(acc_model, ref_model, TOL)
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        GradientAccumulateOptimizer(OPTIMIZERS["adam"](list(acc_model.parameters())), 2, grad_scaler=3)


def test_wrapper_keeps_no_torch_private_internals():
    import importlib
    import inspect

    # the wrapper and every module it is made of
    names = ("accumulate", "accum_optimizer", "wrapped_optimizer", "accum_state", "accum_section",
             "accum_scaling", "accum_checks", "accum_model")
    for name in names:
        src = inspect.getsource(importlib.import_module(f"gradlens.training.{name}"))
        for private in ("_patch_step_function", "_optimizer_step_pre_hooks", "found_inf", "hooked"):
            assert private not in src, (name, private)


# ---------------------------------------------------------------- issue 20: inf/nan without a scaler
def _nan_run(skip: bool):
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    start = copy.deepcopy(model.state_dict())
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, skip_nonfinite=skip)
    x, y = torch.randn(12, 3, dtype=torch.float64), torch.randn(12, 2, dtype=torch.float64)
    updates = []
    for w in range(3):
        for k in range(2):
            sl = slice(6 * (w % 2) + 3 * k, 6 * (w % 2) + 3 * k + 3)
            loss = mse_loss(model(x[sl]), y[sl])
            if w == 1 and k == 1:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad()
        updates.append(opt.has_updated)
    return model, start, opt, updates, x, y


def test_nonfinite_window_without_scaler_warns_and_is_applied():
    with pytest.warns(RuntimeWarning, match=r"window 1 \(0-based; 1 real updates so far\) has an inf/nan gradient; the update was applied.*grad_scaler=scaler.*skip_nonfinite=True"):
        model, _, opt, updates, _, _ = _nan_run(skip=False)
    assert updates == [True, True, True] and opt.iterations == 3
    assert torch.isnan(model.weight).all()  # what the warning says: applied


def test_nonfinite_window_skipped_with_skip_nonfinite():
    with pytest.warns(RuntimeWarning, match=r"window 1 \(0-based; 1 real updates so far\) has an inf/nan gradient; the update was skipped \(skip_nonfinite=True\)"):
        model, start, opt, updates, x, y = _nan_run(skip=True)
    assert updates == [True, False, True] and opt.iterations == 2 and opt.skipped_windows == 1
    # reference: plain SGD on the two finite windows (the same samples, one batch each)
    ref = nn.Linear(3, 2).double()
    ref.load_state_dict(start)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for w in (0, 2):
        sl = slice(6 * (w % 2), 6 * (w % 2) + 6)
        mse_loss(ref(x[sl]), y[sl]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_finite_windows_give_no_warning_and_skip_nonfinite_checked(recwarn):
    model = nn.Linear(3, 2)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2)
    for _ in range(4):
        model(torch.randn(3, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.iterations == 2 and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    with pytest.raises(TypeError, match=r"skip_nonfinite must be True or False, got 'yes'"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 2, skip_nonfinite="yes")
