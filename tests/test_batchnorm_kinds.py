"""Issue 43: the BatchNorm layers people use, converted by ``convert_accum_batchnorm``:
``nn.SyncBatchNorm`` (one process: an AccumBatchNorm; two gloo ranks: the window statistics
pooled over both ranks' micro-batches) and BatchNorm subclasses with a fused activation added
through ``register_accum_batchnorm`` (timm's ``BatchNormAct2d``: tests/test_batchnorm_frameworks.py).
Oracle: each BatchNorm layer run once on what it received over the window (all ranks'
samples; tests/oracle.py ``batchnorm_window``; for the first layer that is one batch of the
window's samples), float64, micro-batches of 2, 3 and 1."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradlens import AccumSyncBatchNorm, convert_accum_batchnorm
from gradlens.training import batchnorm as bnmod
from gradlens.training.batchnorm import AccumBatchNormAct2d, register_accum_batchnorm
from oracle import batchnorm_copies, batchnorm_window
from test_distributed import _init, _spawn

SPLIT = (2, 3, 1)
TOL = dict(rtol=1e-12, atol=1e-12)


def _x(n: int, seed: int, shape=(3, 4, 4)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    drift = torch.linspace(-2, 2, n, dtype=torch.float64).view(n, *([1] * len(shape)))
    return torch.randn(n, *shape, generator=g, dtype=torch.float64) * 2 + drift + 3


def _bn_stats(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    return [(m.running_mean, m.running_var, int(m.num_batches_tracked))
            for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _assert_stats(model: nn.Module, ref) -> None:
    """``ref``: a model, or the oracle's BatchNorm copies (tests/oracle.py)."""
    got = _bn_stats(model)
    want = _bn_stats(nn.ModuleList(ref.values()) if isinstance(ref, dict) else ref)
    assert len(got) == len(want) > 0
    for (m, v, n), (rm, rv, rn) in zip(got, want):
        torch.testing.assert_close(m, rm, **TOL)
        torch.testing.assert_close(v, rv, **TOL)
        assert n == rn


def _sync_cnn(momentum=0.1) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.SyncBatchNorm(4, momentum=momentum), nn.ReLU(),
        nn.Conv2d(4, 2, 3), nn.SyncBatchNorm(2, momentum=None), nn.Flatten(), nn.Linear(8, 3),
    ).double()


@pytest.mark.parametrize("momentum", [0.1, None])
def test_sync_batchnorm_on_one_process_is_an_accum_batchnorm(momentum):
    """No process group: outputs equal nn.SyncBatchNorm's (bit for bit), running statistics
    after windows of micro-batches 2, 3, 1 equal those of one batch of 6 (BatchNorm's own)."""
    model = _sync_cnn(momentum)
    first, plain, ref = copy.deepcopy(model[:2]), copy.deepcopy(model), copy.deepcopy(model)
    copies = batchnorm_copies(model)
    params = list(model.parameters())
    model = convert_accum_batchnorm(model, accum_steps=len(SPLIT))
    assert type(model[1]) is AccumSyncBatchNorm and isinstance(model[1], nn.SyncBatchNorm)
    assert model[1].momentum == momentum and model[4].momentum is None
    assert all(p is q for p, q in zip(model.parameters(), params))
    for window in range(2):
        x = _x(sum(SPLIT), window)
        first(x)  # the first layer's statistics: one batch of the window's 6 samples
        parts = x.split(list(SPLIT))
        for out, want in zip([model(p) for p in parts], batchnorm_window(plain, copies, parts)):
            torch.testing.assert_close(out, want, rtol=0, atol=0)
        _assert_stats(model, copies)
        _assert_stats(model[:2], first)
    assert not torch.allclose(_bn_stats(plain)[0][1], _bn_stats(first)[0][1], rtol=1e-3)  # what is fixed
    model.eval()
    ref.load_state_dict({**ref.state_dict(), **{f"{n}.{k}": v for n, m in copies.items()
                                                 for k, v in m.state_dict().items()}})
    ref.eval()
    x = _x(4, 9)
    torch.testing.assert_close(model(x), ref(x), **TOL)


class ConvBNAct(nn.BatchNorm2d):
    """A BatchNorm2d with its activation and dropout fused (the layout of timm's BatchNormAct2d)."""

    def __init__(self, c: int, act: nn.Module):
        super().__init__(c)
        self.drop = nn.Identity()
        self.act = act

    def forward(self, x):
        return self.act(self.drop(super().forward(x)))


def test_register_accum_batchnorm_converts_a_fused_subclass_keeping_its_activation(monkeypatch):
    monkeypatch.setattr(bnmod, "_CONVERSIONS", dict(bnmod._CONVERSIONS))  # the registration stays here
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), ConvBNAct(4, nn.Hardswish()), nn.Flatten(), nn.Linear(64, 2)).double()
    with pytest.raises(TypeError, match=r"ConvBNAct.*register_accum_batchnorm\(ConvBNAct, convert\)"):
        convert_accum_batchnorm(copy.deepcopy(model), 3)
    with pytest.raises(TypeError, match="takes a BatchNorm class"):
        register_accum_batchnorm(nn.Linear, lambda bn, k: bn)
    register_accum_batchnorm(ConvBNAct, lambda bn, k: bnmod._rebuild(bn, AccumBatchNormAct2d, k, act=bn.act,
                                                                       drop=bn.drop))
    ref, plain = copy.deepcopy(model), copy.deepcopy(model)
    act = model[1].act
    model = convert_accum_batchnorm(model, accum_steps=3)
    assert type(model[1]) is AccumBatchNormAct2d and model[1].act is act
    for window in range(2):
        x = _x(sum(SPLIT), window, (3, 6, 6))
        ref(x)  # one BatchNorm: its statistics are those of one batch of the window's samples
        for part in x.split(list(SPLIT)):
            torch.testing.assert_close(model(part), plain(part), rtol=0, atol=0)
        _assert_stats(model, ref)
    model.eval(), ref.eval()
    x = _x(3, 7, (3, 6, 6))
    torch.testing.assert_close(model(x), ref(x), **TOL)
    # the activation is applied: without it the eval output differs
    bare = nn.BatchNorm2d(4).double().eval()
    bare.load_state_dict(ref[1].state_dict())
    h = ref[0](x)
    assert not torch.allclose(model[1](h), bare(h))
    torch.testing.assert_close(model[1](h), act(bare(h)), **TOL)


# ------------------------------------------------------------------------------ two gloo ranks
RANK_SPLITS = {0: (2, 3, 1), 1: (1, 2, 3)}  # K = 3 micro-steps, unequal over ranks and steps


def _rank_data(rank: int, seed: int, shape=(3, 4, 4)) -> list[torch.Tensor]:
    x = _x(12, seed, shape)
    a = x[:6].split(list(RANK_SPLITS[0]))
    b = x[6:].split(list(RANK_SPLITS[1]))
    return [a, b][rank], list(zip(a, b))


def _sync_worker(rank: int, world: int, port: int) -> None:
    _init(rank, world, port)
    try:
        torch.manual_seed(0)
        bn = nn.SyncBatchNorm(3, momentum=0.3).double()
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-1, 1)
        ref = nn.BatchNorm2d(3, momentum=0.3).double()
        ref.load_state_dict(bn.state_dict())
        model = convert_accum_batchnorm(bn, 3)
        assert type(model) is AccumSyncBatchNorm
        for window in range(2):
            mine, pairs = _rank_data(rank, window)
            g = torch.Generator().manual_seed(10 + window)
            for part, (a, b) in zip(mine, pairs):
                # forward: normalised with the micro-batch of both ranks
                x = part.clone().requires_grad_(True)
                w = torch.randn(len(a) + len(b), 3, 4, 4, generator=g, dtype=torch.float64)
                out = model(x)
                step = nn.BatchNorm2d(3).double().train()
                step.weight, step.bias = nn.Parameter(model.weight.detach().clone()), nn.Parameter(model.bias.detach().clone())
                both = torch.cat([a, b]).requires_grad_(True)
                want = step(both)
                lo, hi = (0, len(a)) if rank == 0 else (len(a), len(a) + len(b))
                torch.testing.assert_close(out, want[lo:hi], **TOL)
                # backward: the gradient of both ranks' losses reaches this rank's input
                model.zero_grad()
                (out * w[lo:hi]).sum().backward()
                (want * w).sum().backward()
                torch.testing.assert_close(x.grad, both.grad[lo:hi], **TOL)
                for p, q in ((model.weight, step.weight), (model.bias, step.bias)):
                    got = p.grad.clone()
                    dist.all_reduce(got)
                    torch.testing.assert_close(got, q.grad, **TOL)
            with torch.no_grad():
                ref(_x(12, window))  # one batch of the window's samples of both ranks
            torch.testing.assert_close(model.running_mean, ref.running_mean, **TOL)
            torch.testing.assert_close(model.running_var, ref.running_var, **TOL)
            assert int(model.num_batches_tracked) == int(ref.num_batches_tracked) == window + 1
        # masked [B, C, L]: statistics over the valid positions of both ranks
        bn1 = convert_accum_batchnorm(nn.SyncBatchNorm(3, momentum=1.0).double(), 3)
        mine, pairs = _rank_data(rank, 5, (3, 5))
        valid = []
        gm = torch.Generator().manual_seed(3)
        for part, (a, b) in zip(mine, pairs):
            masks = [torch.arange(5)[None, :] < torch.randint(1, 6, (len(t), 1), generator=gm) for t in (a, b)]
            m = masks[rank]
            out = bn1(part, m)
            both, mb = torch.cat([a, b]), torch.cat(masks)
            vals = both.permute(0, 2, 1)[mb]  # [n_valid, C]
            mu, var = vals.mean(0), vals.var(0, unbiased=False)
            torch.testing.assert_close(out, (part - mu[None, :, None]) / (var[None, :, None] + 1e-5).sqrt(), **TOL)
            valid.append(vals)
        pooled = torch.cat(valid)
        torch.testing.assert_close(bn1.running_mean, pooled.mean(0), **TOL)
        torch.testing.assert_close(bn1.running_var, pooled.var(0, unbiased=True), **TOL)
    finally:
        dist.destroy_process_group()


def test_sync_batchnorm_on_two_gloo_ranks_pools_the_window_of_both_ranks():
    """2 ranks x micro-batches (2, 3, 1) / (1, 2, 3): each micro-step's output and input
    gradient equal nn.BatchNorm2d on both ranks' micro-batch, the weight gradients summed over
    ranks equal its weight gradients, and each window's running statistics equal nn.BatchNorm2d
    on the window's 12 samples (a masked BatchNorm1d input: the valid positions of both ranks)."""
    _spawn(_sync_worker, 2)
