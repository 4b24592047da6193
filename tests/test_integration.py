"""The pieces together: Lens + GradientAccumulateOptimizer / GradientAccumulateModel + log.

Each record must still equal the float64 oracle of one batch of N samples.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import gradlens
from gradlens import GradientAccumulateModel, GradientAccumulateOptimizer, Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, NoiseScale, SumGradSquared
from oracle import MODELS, flat, hist_oracle, make_problem, per_sample_grads
from windows import micro_batches, run_windows


def _instruments(r):
    return [BatchL2(), SumGradSquared(), GradNorm(), NoiseScale(), GradHist1d(bins=8, range=(-r, r))]


def _check(rec, model_at_window_start, x, y):
    G = flat(per_sample_grads(model_at_window_start, x, y))
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=0)
    torch.testing.assert_close(torch.tensor(rec["grad_norm"], dtype=torch.float64), G.mean(0).norm(), rtol=1e-10, atol=0)
    lo, hi = rec["grad_hist_1d"].range
    assert torch.equal(rec["grad_hist_1d"].counts, hist_oracle(G, lo, hi, 8)[0])


def test_lens_with_accumulating_adam_over_windows(tmp_path):
    model, x, y = make_problem(MODELS["cnn"])
    r = 0.5 * float(flat(per_sample_grads(model, x, y)).abs().max())
    log = gradlens.output.sinks.JsonlSink(tmp_path / "run.jsonl", full=True)  # full tensors: .arrays
    run = run_windows(model, [micro_batches(x, y, [5, 1, 6])] * 3, _instruments(r), log=log, snapshots=True,
                      optimizer=lambda ps: GradientAccumulateOptimizer(torch.optim.Adam(ps, lr=1e-2), accum_steps=3))
    lens, snapshots = run.lens, run.thetas[:3]  # the model at each window's start
    assert [r.step for r in lens.records] == [0, 1, 2]
    for rec, snap in zip(lens.records, snapshots):
        assert (rec.num_samples, rec.micro_steps) == (12, 3)
        _check(rec, snap, x, y)
    assert gradlens.load_log(tmp_path / "run.jsonl") == lens.records


def test_lens_inside_gradient_accumulate_model():
    model, x, y = make_problem(MODELS["mlp"])
    start = copy.deepcopy(model)
    r = 0.5 * float(flat(per_sample_grads(model, x, y)).abs().max())
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lens = Lens(model, _instruments(r), optimizer=opt)
    trainer = GradientAccumulateModel(model, opt, loss_fn, accum_steps=5, lens=lens)
    loss = trainer.train_step((x, y))
    rec = lens.records[-1]
    assert (rec.num_samples, rec.micro_steps) == (12, 5)
    _check(rec, start, x, y)
    torch.testing.assert_close(torch.tensor(rec["loss"], dtype=torch.float64), loss.double().cpu(), rtol=1e-10, atol=0)
