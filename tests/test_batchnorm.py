"""AccumBatchNorm: running statistics after K micro-steps == nn.BatchNorm on the whole window."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from gradlens import AccumBatchNorm1d, AccumBatchNorm2d, AccumBatchNorm3d, convert_accum_batchnorm
from gradlens.training.batchnorm import flush_accum_batchnorm

# (accum class, reference class, per-sample shape); each sample's channels have their own offset
LAYOUTS = [
    (AccumBatchNorm1d, nn.BatchNorm1d, (4,)),
    (AccumBatchNorm1d, nn.BatchNorm1d, (4, 5)),
    (AccumBatchNorm2d, nn.BatchNorm2d, (4, 3, 3)),
    (AccumBatchNorm3d, nn.BatchNorm3d, (4, 2, 2, 3)),
]
SPLITS = {"equal": (3, 3, 3), "unequal": (2, 7, 3)}


def _inputs(total: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(total, *shape, generator=g) * 2.0
    # a drift along the batch makes the between-micro-batch term matter
    drift = torch.linspace(-3, 3, total).view(total, *([1] * len(shape)))
    return x + drift + 5.0


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: f"{l[0].__name__}{l[2]}")
def test_running_stats_equal_full_batch(layout, split, momentum):
    accum_cls, ref_cls, shape = layout
    sizes = SPLITS[split]
    bn = accum_cls(shape[0], accum_steps=len(sizes), momentum=momentum)
    ref = ref_cls(shape[0], momentum=momentum)
    plain = ref_cls(shape[0], momentum=momentum)  # same data, per micro-batch updates
    for window in range(3):
        x = _inputs(sum(sizes), shape, seed=window)
        ref(x)
        for k, part in enumerate(torch.split(x, sizes)):
            out = bn(part)
            # normalisation uses the micro-batch statistics, exactly as nn.BatchNorm does
            torch.testing.assert_close(out, plain(part), rtol=0, atol=0)
            assert bn.window_open == (k < len(sizes) - 1)
        torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == window + 1
    # plain BatchNorm on micro-batches is not the same thing (it is what gets fixed here)
    assert not torch.allclose(plain.running_var, ref.running_var, rtol=1e-3)
    bn.eval(), ref.eval()
    x = _inputs(4, shape, seed=9)
    torch.testing.assert_close(bn(x), ref(x), rtol=1e-5, atol=1e-5)


def test_pooled_variance_includes_between_batch_term_and_is_robust():
    """Large common offset (cancellation-prone) and very different micro-batch means."""
    bn = AccumBatchNorm1d(2, accum_steps=2, momentum=1.0, dtype=torch.float64)
    a = torch.randn(50, 2, dtype=torch.float64) + 1e6
    b = torch.randn(30, 2, dtype=torch.float64) + 1e6 + 10.0
    bn(a), bn(b)
    full = torch.cat([a, b])
    torch.testing.assert_close(bn.running_mean, full.mean(0), rtol=1e-14, atol=0)
    torch.testing.assert_close(bn.running_var, full.var(0, unbiased=True), rtol=1e-9, atol=0)
    averaged = (a.var(0) + b.var(0)) / 2  # the within-batch average misses ~25
    assert torch.all(bn.running_var - averaged > 20)


def test_flush_closes_partial_window():
    bn = AccumBatchNorm2d(3, accum_steps=4)
    ref = nn.BatchNorm2d(3)
    x = _inputs(7, (3, 2, 2), seed=3)
    ref(x)
    bn(x[:5]), bn(x[5:])
    assert bn.window_open and int(bn.num_batches_tracked) == 0
    assert bn.flush() and not bn.window_open
    assert not bn.flush()  # nothing open
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-6, atol=1e-6)
    model = nn.Sequential(AccumBatchNorm1d(4, 3), nn.ReLU(), AccumBatchNorm1d(4, 3))
    model(torch.randn(5, 4))
    assert flush_accum_batchnorm(model) == 2
    bn(x[:2])
    bn.reset_window()
    assert not bn.window_open and int(bn.num_batches_tracked) == 1


def test_no_tracking_and_eval_behave_like_nn():
    bn = AccumBatchNorm2d(3, accum_steps=2, track_running_stats=False)
    ref = nn.BatchNorm2d(3, track_running_stats=False)
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(bn(x), ref(x), rtol=0, atol=0)
    assert bn.running_mean is None and not bn.flush()


def _small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 6),
        nn.BatchNorm1d(6, momentum=None),
        nn.Linear(6, 2),
    )


def test_conversion_preserves_trained_model_exactly():
    torch.manual_seed(0)
    model = _small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(8, 2, 4, 4)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    model.eval()
    x = torch.randn(5, 2, 4, 4)
    before = model(x)
    params_before = list(model.parameters())
    state_before = copy.deepcopy(model.state_dict())

    converted = convert_accum_batchnorm(model, accum_steps=3)
    assert converted is model
    assert isinstance(model[1], AccumBatchNorm2d) and isinstance(model[1], nn.BatchNorm2d)
    assert isinstance(model[5], AccumBatchNorm1d) and model[5].momentum is None
    assert not model.training and model[1].accum_steps == 3
    assert all(p is q for p, q in zip(model.parameters(), params_before))  # same Parameters
    assert torch.equal(model(x), before)
    for key, value in state_before.items():
        assert torch.equal(model.state_dict()[key], value)

    # a bare BatchNorm root is returned converted
    bn = nn.BatchNorm3d(2)
    assert isinstance(convert_accum_batchnorm(bn, 2), AccumBatchNorm3d)


def test_state_dict_plain_load_and_mid_window_resume():
    plain = nn.BatchNorm2d(3)
    plain(torch.randn(6, 3, 2, 2) + 1)
    bn = AccumBatchNorm2d(3, accum_steps=3)
    bn.load_state_dict(plain.state_dict())  # strict: no missing window keys
    assert torch.equal(bn.running_mean, plain.running_mean)
    assert set(plain.state_dict()) <= set(bn.state_dict())

    xs = [_inputs(4, (3, 2, 2), seed=s) for s in range(3)]
    straight = AccumBatchNorm2d(3, accum_steps=3)
    for x in xs:
        straight(x)
    half = AccumBatchNorm2d(3, accum_steps=3)
    half(xs[0])
    buffer = io.BytesIO()
    torch.save(half.state_dict(), buffer)
    buffer.seek(0)
    resumed = AccumBatchNorm2d(3, accum_steps=3)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.window_open
    resumed(xs[1]), resumed(xs[2])
    assert torch.equal(resumed.running_var, straight.running_var)
    assert torch.equal(resumed.running_mean, straight.running_mean)


def test_bad_input():
    with pytest.raises(ValueError, match=r"accum_steps must be >= 1.*got 0"):
        AccumBatchNorm2d(3, accum_steps=0)
    with pytest.raises(TypeError, match=r"accum_steps must be an int.*'2'"):
        convert_accum_batchnorm(nn.BatchNorm1d(2), "2")
    # (nn.SyncBatchNorm is converted since issue 43: tests/test_batchnorm_kinds.py; a subclass
    # whose forward may compute something else is still refused, naming the fix)
    class MyBatchNorm(nn.BatchNorm1d):
        pass

    with pytest.raises(TypeError, match=r"cannot convert .*MyBatchNorm.*register_accum_batchnorm\(.*MyBatchNorm"):
        convert_accum_batchnorm(nn.Sequential(MyBatchNorm(2)), 2)
    with pytest.raises(ValueError, match=r"more than 1 value per channel"):
        AccumBatchNorm1d(2, 2)(torch.randn(1, 2))
    bn = AccumBatchNorm1d(2, 2)
    bn(torch.randn(3, 2))
    with pytest.raises(RuntimeError, match=r"open window; call flush\(\)"):
        convert_accum_batchnorm(bn, 4)


# ------------------------------------------------------------- windows from the optimizer, masks
def _bn_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1)).double()


def test_follows_the_optimizer_windows_and_skips_what_it_skips():
    """accum_steps given once (to the optimizer); a GradScaler-skipped window and a reset()
    window leave the running statistics alone; real windows equal nn.BatchNorm on the window."""
    from gradlens import GradientAccumulateOptimizer

    model = _bn_model()
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), accum_steps=2)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    model = convert_accum_batchnorm(model, optimizer=opt)
    bn = model[1]
    assert bn.follows_optimizer and bn.accum_steps == 2
    ref = nn.BatchNorm1d(4).double()
    gen = torch.Generator().manual_seed(1)
    for w in range(4):
        xs = [torch.randn(b, 3, generator=gen, dtype=torch.float64) * 2 + w for b in (3, 5)]
        poisoned, dropped = w == 1, w == 2
        for k, x in enumerate(xs):
            loss = model(x).square().mean()
            if poisoned and k == 1:
                loss = loss * float("inf")
            if dropped and k == 1:
                opt.reset()
                opt.zero_grad()
                break
            scaler.scale(loss).backward()
            scaler.step(opt, num_samples=len(x))
            scaler.update()
            opt.zero_grad()
        if not (poisoned or dropped):
            with torch.no_grad():
                ref(model[0](torch.cat(xs)))
        torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
        assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked)
    assert opt.skipped_windows == 1 and int(ref.num_batches_tracked) == 2
    with pytest.raises(ValueError, match=r"accum_steps=3 but the optimizer has accum_steps=2"):
        convert_accum_batchnorm(_bn_model(), 3, optimizer=opt)
    with pytest.raises(TypeError, match=r"needs a GradientAccumulateOptimizer"):
        convert_accum_batchnorm(_bn_model(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_mask_statistics_over_unmasked_positions_exact_over_unequal_micro_batches(momentum):
    """Padded sequences [B, C, L] with a [B, L] mask: outputs and running statistics equal the
    float64 oracle over the valid positions only, over micro-batches of 2, 5 and 3."""
    gen = torch.Generator().manual_seed(0)
    sizes, C, L = (2, 5, 3), 3, 6
    bn = AccumBatchNorm1d(C, accum_steps=3, momentum=momentum, dtype=torch.float64)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5, generator=gen)
        bn.bias.uniform_(-1, 1, generator=gen)
    run_mean, run_var = torch.zeros(C, dtype=torch.float64), torch.ones(C, dtype=torch.float64)
    for window in range(2):
        xs = []
        for b in sizes:
            x = torch.randn(b, C, L, generator=gen, dtype=torch.float64) * 3 + window
            lengths = torch.randint(1, L + 1, (b,), generator=gen)
            mask = torch.arange(L)[None, :] < lengths[:, None]
            x = x.masked_fill(~mask[:, None, :], 1e3)  # padding values must not count
            out = bn(x, mask)
            valid = x.permute(0, 2, 1)[mask]  # [n_valid, C]
            mu, var = valid.mean(0), valid.var(0, unbiased=False)
            want = (x - mu[None, :, None]) / (var[None, :, None] + bn.eps).sqrt()
            want = want * bn.weight[None, :, None] + bn.bias[None, :, None]
            torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
            xs.append(valid)
        pooled = torch.cat(xs)
        m = 1.0 / (window + 1) if momentum is None else momentum
        run_mean = (1 - m) * run_mean + m * pooled.mean(0)
        run_var = (1 - m) * run_var + m * pooled.var(0, unbiased=True)
        torch.testing.assert_close(bn.running_mean, run_mean, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bn.running_var, run_var, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"mask must be a tensor of shape \(2, 6\)"):
        bn(torch.randn(2, C, L, dtype=torch.float64), torch.ones(2, 5, dtype=torch.bool))
    bn.eval()
    x = torch.randn(2, C, L, dtype=torch.float64)
    torch.testing.assert_close(bn(x, torch.ones(2, L, dtype=torch.bool)), bn(x))  # eval ignores it
