"""The two-batch gradient noise scale and the global gradient norm under FSDP2 (``fully_shard``,
2 gloo ranks, CPU, float64), against the float64 torch.func oracle on a copy of the unsharded
model made before sharding: small batches = each rank's micro-batches, big batch = the window of
all ranks. Per-rank batches 5 / 7 in unequal micro-steps (2 + 3 and 4 + 1 + 2), and one
micro-step per rank (rank-local vs global); the light capture (``NoiseScaleTwoBatch`` +
``GradNorm`` only: parameter hooks, no per-layer capture) and the full one (with ``BatchL2`` and
``SampleOrigin``: the samples' origin under FSDP2); ``record["grad_norm"]`` equal to the
unsharded model's gradient norm, to the norm of FSDP2's reduce-scattered ``p.grad`` gathered
whole, and to what ``torch.nn.utils.clip_grad_norm_`` returns on the sharded model (equal
per-rank batches, where FSDP2's average of the ranks' gradients is the window's mean); a norm
off by sqrt(shard count) (each rank's local shard alone) would fail."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, NoiseScaleTwoBatch, SampleOrigin
from oracle import MODELS, flat, make_problem, per_sample_grads, two_batch
from test_distributed import _init, _spawn

import torch.distributed.fsdp as fsdp  # noqa: E402 - FSDP2 support is gradlens' own: no skip

RTOL = dict(rtol=1e-9, atol=1e-12)
LR = 0.2
BETA = 0.9
#: per window, each rank's micro-batch sizes: unequal micro-steps (twice: the EMA spans windows),
#: then one micro-step per rank (small batch = the rank's batch), then equal batches 6 / 6
LAYOUTS = [[[2, 3], [4, 1, 2]], [[2, 3], [4, 1, 2]], [[5], [7]], [[6], [6]]]
SEEDS = (1, 2, 3, 4)


def _shard(model: nn.Module) -> nn.Module:
    """``fully_shard`` each Linear but the last, then the root; the parameters stay unsharded
    between a window's micro-steps (``reshard_after_forward=False``): the ranks' numbers of
    micro-steps differ, and FSDP2's all-gathers must pair up."""
    for m in [m for m in model if isinstance(m, nn.Linear)][:-1]:
        fsdp.fully_shard(m, reshard_after_forward=False)
    fsdp.fully_shard(model, reshard_after_forward=False)
    return model


def _run(rank: int, model0: nn.Module, data, instruments) -> dict:
    model = gradlens.extend(_shard(copy.deepcopy(model0)))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lens = Lens(model, instruments, optimizer=opt)
    out = {"thetas": [], "grad_full_norm": [], "clip_norm": [], "local_norm": []}
    for (x, y), layout in zip(data, LAYOUTS):
        out["thetas"].append({n: p.full_tensor().detach().clone() for n, p in model.named_parameters()})
        lo = sum(sum(s) for s in layout[:rank])
        mine = layout[rank]
        xs, ys = x[lo: lo + sum(mine)].split(mine), y[lo: lo + sum(mine)].split(mine)
        for k, (xb, yb) in enumerate(zip(xs, ys)):
            last = k == len(mine) - 1
            model.set_requires_gradient_sync(last)
            model.set_reshard_after_backward(last)
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward()
        # FSDP2's own gradient: reduce-scattered shards of the ranks' average
        full = [p.grad.full_tensor() for p in model.parameters()]
        out["grad_full_norm"].append(math.sqrt(sum(float(g.square().sum()) for g in full)))
        out["local_norm"].append(math.sqrt(sum(float(p.grad.to_local().square().sum()) for p in model.parameters())))
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
        out["clip_norm"].append(float(total.full_tensor() if hasattr(total, "full_tensor") else total))
        opt.step()
        opt.zero_grad()
    out["light"] = lens._meter.plan.light
    lens.close()
    out["records"] = [(r.num_samples, r.micro_steps, dict(r.values)) for r in lens.records]
    del lens, opt, model  # free the FSDP modules before destroy_process_group
    return out


def _worker(rank, world, port, out_dir):
    _init(rank, world, port)
    try:
        model0, _, _ = make_problem(MODELS["mlp"], seed=0)
        data = [make_problem(MODELS["mlp"], seed=s)[1:] for s in SEEDS]
        result = {
            "light": _run(rank, model0, data, [NoiseScaleTwoBatch(beta=BETA), GradNorm()]),
            "full": _run(rank, model0, data, [NoiseScaleTwoBatch(beta=BETA), GradNorm(), BatchL2(), SampleOrigin()]),
        }
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _close(a, b):
    torch.testing.assert_close(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64), **RTOL)


def test_noise_scale_and_grad_norm_under_fsdp2_equal_the_unsharded_oracle():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, 2, out_dir)
        outs = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    model0, _, _ = make_problem(MODELS["mlp"], seed=0)
    data = [make_problem(MODELS["mlp"], seed=s)[1:] for s in SEEDS]
    for route in ("light", "full"):
        assert outs[0][route]["light"] is (route == "light")  # the light capture: no per-layer capture
        ema_g2 = ema_tr = 0.0
        for w, ((x, y), layout) in enumerate(zip(data, LAYOUTS)):
            n = sum(sum(s) for s in layout)
            sizes = [b for s in layout for b in s]  # the small batches, rank-major
            theta = copy.deepcopy(model0)  # the unsharded model at this window's parameters
            theta.load_state_dict(outs[0][route]["thetas"][w])
            G = flat(per_sample_grads(theta, x[:n], y[:n]))
            g2, tr = two_batch(G, sizes)
            ema_g2 = BETA * ema_g2 + (1 - BETA) * g2
            ema_tr = BETA * ema_tr + (1 - BETA) * tr
            # the unsharded model's own gradient of the window's mean loss (autograd, no per-sample)
            ref = copy.deepcopy(theta)
            nn.functional.cross_entropy(ref(x[:n]), y[:n]).backward()
            unsharded = math.sqrt(sum(float(p.grad.square().sum()) for p in ref.parameters()))
            _close(unsharded, G.mean(0).norm())  # the oracle agrees with itself
            for out in outs:  # the same record on both ranks
                num, micro, vals = out[route]["records"][w]
                assert (num, micro) == (n, len(sizes))
                ns = vals["noise_scale_two_batch"]
                _close(ns["grad_sq"], g2)
                _close(ns["trace_sigma"], tr)
                if g2 > 0:
                    _close(ns["b_simple"], tr / g2)
                else:
                    assert math.isnan(ns["b_simple"])
                if ema_g2 > 0:
                    _close(ns["b_simple_smoothed"], ema_tr / ema_g2)
                else:
                    assert math.isnan(ns["b_simple_smoothed"])
                assert ns["batch_big"] == n and ns["small_batches"] == len(sizes)
                _close(ns["batch_small"], sum(b * b for b in sizes) / n)
                _close(vals["grad_norm"], unsharded)
                if route == "full":
                    _close(vals["batch_l2"], G.square().sum(1))
                    rows = [(r, k, b) for r, s in enumerate(layout) for k, b in enumerate(s)]
                    assert vals["sample_origin"].tolist() == [list(t) for t in rows]
                if len(set(map(sum, layout))) == 1:
                    # equal per-rank batches: FSDP2's averaged gradient is the window's mean, and
                    # its global norm (gathered, or torch's clip_grad_norm_) is the unsharded one
                    _close(out[route]["grad_full_norm"][w], unsharded)
                    _close(out[route]["clip_norm"][w], unsharded)
                    # each rank's shard alone is not the global norm (the classic bug)
                    assert abs(out[route]["local_norm"][w] - unsharded) > 1e-3 * unsharded
