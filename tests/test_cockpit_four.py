"""Distance, UpdateSize, CABS and EarlyStopping against their formulas on the float64 oracle's
per-sample gradients (tests/oracle.py), over plain-SGD trajectories the oracle computes itself,
K unequal micro-steps, mean and sum losses, and Distance restarted from a checkpoint."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import CABS, Distance, EarlyStopping, UpdateSize
from oracle import MODELS, early_stopping, flat, make_problem, per_sample_grads, trace_sigma
from windows import micro_batches, run_windows, split_windows

LR = 0.3
WINDOWS = 3
SPLITS = {"K1": [12], "K3-unequal": [5, 1, 6]}


def _batches(case, windows: int):
    """One (x, y) batch of N = 12 per window, and the float64 model at theta_0."""
    model, x0, y0 = make_problem(case, seed=0)
    batches = [(x0, y0)] + [make_problem(case, seed=1 + w)[1:] for w in range(windows - 1)]
    return model, batches


def _oracle_run(model: nn.Module, batches, reduction: str, split=(12,)):
    """Per window: theta_t (flat), the per-sample gradients [N, D] at theta_t and the mean loss;
    theta_{t+1} = theta_t - LR * p.grad with p.grad what the loop accumulates: the sum over
    micro-steps of each micro-batch's mean (or sum) of per-sample gradients."""
    model = copy.deepcopy(model)
    out = []
    for x, y in batches:
        theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        G = flat(per_sample_grads(model, x, y))  # [N, D]
        with torch.no_grad():
            loss = nn.functional.cross_entropy(model(x), y).item()
        g = sum(Gk.mean(0) if reduction == "mean" else Gk.sum(0) for Gk in G.split(list(split)))
        out.append({"theta": theta, "G": G, "loss": loss})
        with torch.no_grad():
            i = 0
            for p in model.parameters():
                p -= LR * g[i : i + p.numel()].reshape(p.shape)
                i += p.numel()
    out.append({"theta": torch.cat([p.detach().reshape(-1) for p in model.parameters()])})
    return out


def _lens_run(model, batches, split, reduction, instruments, state=None, **kw):
    """The batches, each split into micro-batches ``split``, through a Lens on ``model`` itself
    (plain SGD, restored from ``state``); returns the open Lens."""
    return run_windows(model, split_windows(batches, split), instruments, reduction=reduction,
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), state=state, fresh_copy=False, close=False,
                       **kw).lens


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
def test_four_instruments_equal_their_formulas_on_the_oracle(model_name, split, reduction):
    model, batches = _batches(MODELS[model_name], WINDOWS)
    ref = _oracle_run(model, batches, reduction, SPLITS[split])
    lens = _lens_run(copy.deepcopy(model), batches, SPLITS[split], reduction,
                     [Distance(), UpdateSize(), CABS(), EarlyStopping()])
    records = lens.records
    lens.close()
    assert [r.num_samples for r in records] == [12] * WINDOWS
    theta0 = ref[0]["theta"]
    for t, r in enumerate(records):
        G = ref[t]["G"]
        n = G.shape[0]
        dist = float((ref[t]["theta"] - theta0).norm())
        upd = float((ref[t + 1]["theta"] - ref[t]["theta"]).norm())
        lr_eff = LR if reduction == "mean" else LR * n
        assert r["distance"] == pytest.approx(dist, rel=1e-9, abs=1e-12), t
        assert r["update_size"] == pytest.approx(upd, rel=1e-9), t
        assert r["cabs"] == pytest.approx(lr_eff * trace_sigma(G) / ref[t]["loss"], rel=1e-8), t
        assert r["early_stopping"] == pytest.approx(early_stopping(G), rel=1e-8), t
    assert records[0]["distance"] == 0.0  # theta_0 is where the first window's gradients were taken
    assert all(r["distance"] > 0 for r in records[1:])


def test_distance_restarts_from_its_state():
    model, batches = _batches(MODELS["mlp"], 3)
    ref = _oracle_run(model, batches, "sum")
    m = copy.deepcopy(model)
    first = _lens_run(m, batches[:1], [5, 7], "sum", [Distance()])
    state = first.state_dict()
    first.close()
    assert set(state["instruments"][0]["state"]) == {"theta0"}
    # a new Lens on the moved model, restored: measures from the first Lens' theta_0
    resumed = _lens_run(m, batches[1:], [5, 1, 6], "sum", [Distance()], state=state)
    got = [r["distance"] for r in resumed.records]
    resumed.close()
    want = [float((ref[t]["theta"] - ref[0]["theta"]).norm()) for t in (1, 2)]
    assert got == pytest.approx(want, rel=1e-9)
    # without the state, a fresh Lens starts at its own build: the first distance is 0
    m2 = copy.deepcopy(model)
    _lens_run(m2, batches[:1], [12], "mean", [UpdateSize()]).close()
    fresh = _lens_run(m2, batches[1:2], [12], "mean", [Distance()])
    assert fresh.records[0]["distance"] == 0.0
    fresh.close()


def test_distance_state_is_checked():
    model, batches = _batches(MODELS["mlp"], 1)
    lens = _lens_run(copy.deepcopy(model), batches, [12], "mean", [Distance()])
    inst = lens.instruments[0]
    with pytest.raises(ValueError, match="lacks key"):
        inst.load_state_dict({})
    with pytest.raises(ValueError, match="theta0=.*must be a dict parameter name -> tensor"):
        inst.load_state_dict({"theta0": [1.0]})
    lens.close()


def test_update_size_without_an_update_is_none_with_the_reason():
    model, batches = _batches(MODELS["mlp"], 1)
    (record,) = run_windows(model, [batches[:1]], [UpdateSize(), Distance()],
                            optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), end="flush").flushed
    assert record["update_size"] is None
    assert record.meta["update_size"].startswith("missing: no optimizer update closed this window")
    assert record["distance"] == 0.0


def _lens_with(optimizer_factory, instruments=None):
    model = gradlens.extend(nn.Linear(3, 2))
    return model, lambda: Lens(model, instruments or [CABS()], optimizer=optimizer_factory(model))


def test_cabs_refuses_other_optimizers_with_the_reason():
    _, build = _lens_with(lambda m: torch.optim.Adam(m.parameters()))
    with pytest.raises(ValueError, match=r"CABS\(\) is derived for plain SGD .* got Adam"):
        build()
    _, build = _lens_with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"param_groups\[0\] has momentum=0.9 .* momentum=0\)"):
        build()
    _, build = _lens_with(lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=1e-4))
    with pytest.raises(ValueError, match=r"weight_decay=0.0001"):
        build()
    _, build = _lens_with(lambda m: None)
    with pytest.raises(ValueError, match=r"give the Lens its optimizer: Lens\(model, \[CABS\(\)"):
        build()
    _, build = _lens_with(lambda m: gradlens.GradientAccumulateOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), accum_steps=2))
    build().close()  # SGD inside the accumulating wrapper is plain SGD


def test_cabs_and_update_size_through_the_accumulating_optimizer():
    model, batches = _batches(MODELS["mlp"], 2)
    ref = _oracle_run(model, batches, "mean")
    lens = run_windows(model, split_windows(batches, [5, 1, 6]), [CABS(), UpdateSize()],
                       optimizer=lambda ps: gradlens.GradientAccumulateOptimizer(torch.optim.SGD(ps, lr=LR), accum_steps=3)).lens
    assert len(lens.records) == 2
    for t, r in enumerate(lens.records):
        G = ref[t]["G"]
        assert r["cabs"] == pytest.approx(LR * trace_sigma(G) / ref[t]["loss"], rel=1e-8)
        assert r["update_size"] == pytest.approx(float((ref[t + 1]["theta"] - ref[t]["theta"]).norm()), rel=1e-9)


def test_early_stopping_is_one_minus_n_times_mean_gsnr():
    from gradlens.instruments import MeanGSNR

    model, batches = _batches(MODELS["cnn"], 1)
    lens = _lens_run(copy.deepcopy(model), batches, [5, 1, 6], "sum", [EarlyStopping(), MeanGSNR()])
    (r,) = lens.records
    lens.close()
    assert r["early_stopping"] == 1.0 - 12 * r["mean_gsnr"]
    assert math.isfinite(r["early_stopping"])


def test_squared_norms_restrict_to_a_group_and_merge():
    from gradlens.instruments.trajectory import SquaredNorms

    a = SquaredNorms({"fc1.weight": torch.tensor(9.0, dtype=torch.float64),
                      "fc1.bias": torch.tensor(16.0, dtype=torch.float64)})
    assert a.norm() == 5.0
    assert a.norm(["fc1.bias", "head.weight"]) == 4.0
    assert SquaredNorms().norm() is None
    b = SquaredNorms({"fc1.bias": torch.tensor(9.0, dtype=torch.float64)})
    merged = a.merge(b)
    assert merged.norm(["fc1.bias"]) == 5.0 and a.norm() == 5.0  # a itself unchanged
    assert SquaredNorms().merge(b) is b and b.merge(SquaredNorms()) is b


def test_distance_and_update_size_per_group_are_the_norms_over_each_groups_parameters():
    """Lens(groups=...): record.groups[g]["distance"] / ["update_size"] are ||theta_t - theta_0|| /
    ||theta_{t+1} - theta_t|| over group g's parameters, read from the model's own parameters
    (float64 copies) around each update; the squares of the groups add up to the total's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).double()
    x, y = torch.randn(9, 5, dtype=torch.float64), torch.randint(0, 3, (9,))
    groups = {"first": ["0.weight", "0.bias"], "other": ["2.weight", "2.bias"]}
    run = run_windows(model, [micro_batches(x, y, [4, 1, 4])] * 3, [Distance(), UpdateSize()],
                      optimizer=lambda ps: torch.optim.Adam(ps, lr=0.05), groups={"first": ["0.*"]},
                      snapshots=True, close=False)
    lens = run.lens
    theta0 = {q: p.detach() for q, p in run.thetas[0].named_parameters()}
    assert len(lens.records) == 3
    for t, rec in enumerate(lens.records):
        before = {q: p.detach() for q, p in run.thetas[t].named_parameters()}
        after = dict(run.thetas[t + 1].named_parameters())
        assert set(rec.groups) == set(groups)
        total_d = total_u = 0.0
        for g, names in groups.items():
            d = sum(float((before[q] - theta0[q]).square().sum()) for q in names)
            u = sum(float((after[q].detach() - before[q]).square().sum()) for q in names)
            assert rec.groups[g]["distance"] == pytest.approx(d ** 0.5, rel=1e-12)
            assert rec.groups[g]["update_size"] == pytest.approx(u ** 0.5, rel=1e-12)
            total_d, total_u = total_d + d, total_u + u
        assert rec["distance"] == pytest.approx(total_d ** 0.5, rel=1e-12)
        assert rec["update_size"] == pytest.approx(total_u ** 0.5, rel=1e-12)
    lens.close()
