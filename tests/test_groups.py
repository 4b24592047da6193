"""Per-group statistics (issue 22, ``Lens(groups=...)``): each group's values == the float64
oracle restricted to that group's parameters, K unequal micro-steps and K = 1, mean and sum,
``groups="param"``, ``"module"`` and patterns, on the oracle table's models (tied weights and a
train-mode BatchNorm with ``undefined="exclude"`` included), and under DDP with 2 gloo ranks;
group totals add up to the record's totals; logs, the one flattening and sinks carry groups.

The groups the oracle expects are computed here from the issue's rules (fnmatch, the owning
module's qualified name), never from gradlens.
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import json
import math
import os
import tempfile

import pytest
import torch
from torch import nn

import gradlens
from gradlens.output.sinks import JsonlSink
from gradlens import Lens, load_log
from gradlens.instruments import (
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    MeanGSNR,
    NormTest,
)
from gradlens.core.records import TensorSummary, flatten, flatten_histograms, record_from_json, record_to_json
from oracle_models import CASES, SPLITS, per_sample_grads, problem, tracked_names
from oracle import hist_oracle, near_edges
from windows import all_instruments, run_windows
from test_models_oracle import BN_LEAVE_OUT, GSNR_FLOOR, HIST2D_BINS, HIST_BINS, run_lens

#: the record keys whose per-group values are checked against the oracle
SCALAR_KEYS = ("grad_norm", "norm_test", "noise_scale", "mean_gsnr", "inner_test", "ortho_test")

_CASES = [name for name, case in CASES.items() if not case.frameworks]


def _instruments(grad_r=1.0, param_r=1.0):
    return all_instruments(grad_r, param_r, bins=HIST_BINS, bins_2d=HIST2D_BINS, leave_out=("NoiseScaleTwoBatch", "Alpha"))


def _ranges(gs, model, names):
    """Ranges that clamp some values and put no element on an edge (as test_models_oracle)."""
    G = torch.cat([g.reshape(len(g), -1) for g in gs.values()], dim=1)
    params = dict(model.named_parameters())
    return 0.4987 * float(G.abs().max()), 0.4987 * max(float(params[k].detach().abs().max()) for k in names)


def check_group_hists(rec, gs_all, thetas, want, grad_r, param_r, rtol):
    """Each group's 1D and 2D histograms == the oracle's counts of that group's elements."""
    pb, gb = HIST2D_BINS
    for group, members in want.items():
        G = torch.cat([gs_all[q].reshape(len(gs_all[q]), -1) for q in members], dim=1)
        theta = torch.cat([thetas[q].detach().flatten() for q in members])
        h = rec.groups[group]["grad_hist_1d"]
        counts, low, high = hist_oracle(G, -grad_r, grad_r, HIST_BINS)
        amb = near_edges(G, -grad_r, grad_r, max(HIST_BINS, gb), rtol) if rtol > 1e-9 else 0
        assert h.total == G.numel()
        assert int((h.counts - counts).abs().sum()) <= 2 * amb, (group, h.counts, counts)
        assert abs(h.clamped_low - low) + abs(h.clamped_high - high) <= amb
        h2 = rec.groups[group]["grad_hist_2d"]
        pidx = torch.floor((theta + param_r) * pb / (2 * param_r)).clamp(0, pb - 1).long()
        gidx = torch.floor((G + grad_r) * gb / (2 * grad_r)).clamp(0, gb - 1).long()
        joint = torch.bincount((pidx * gb + gidx).flatten(), minlength=pb * gb).view(pb, gb)
        assert int((h2.counts - joint).abs().sum()) <= 2 * amb, (group, h2.counts, joint)
        assert h2.clamped_param == G.shape[0] * int(((theta < -param_r) | (theta > param_r)).sum())
    # counts add up over the groups to the record's histograms
    for key in ("grad_hist_1d", "grad_hist_2d"):
        assert torch.equal(sum(v[key].counts for v in rec.groups.values()), rec[key].counts)
    assert sum(v["grad_hist_1d"].clamped_low for v in rec.groups.values()) == rec["grad_hist_1d"].clamped_low
    assert sum(v["grad_hist_2d"].clamped_param for v in rec.groups.values()) == rec["grad_hist_2d"].clamped_param


def _patterns(names):
    """A pattern spec for a model: the first tracked parameter's module, then every weight
    (overlapping the first: a parameter joins the first group it matches), rest "other"."""
    first = names[0].rpartition(".")[0]
    return {"head": [f"{first}.*" if first else names[0]], "weights": ["*weight"]}


def expected_groups(spec, names):
    """Group -> parameter names by the issue's rules (independent of gradlens)."""
    out = {}
    for q in names:
        if spec == "param":
            g = q
        elif spec == "module":
            g = q.rpartition(".")[0] or "(model)"
        else:
            g = next((k for k, pats in spec.items() if any(fnmatch.fnmatchcase(q, p) for p in pats)), "other")
        out.setdefault(g, []).append(q)
    if isinstance(spec, dict):  # the spec's order, "other" last
        out = {g: out[g] for g in [*spec, "other"] if g in out}
    return out


def group_oracle(gs: dict, reduction: str, var_max: float) -> dict:
    """Every per-group value from the group's per-sample gradients ``gs`` (name -> [N, *p]);
    ``var_max``: the largest variance over all tracked coordinates (MeanGSNR's round-off floor
    is the window's, not the group's)."""
    G = torch.cat([g.reshape(len(g), -1) for g in gs.values()], dim=1)
    n = G.shape[0]
    mean, var = G.mean(0), G.var(0)
    g2 = mean.square().sum()
    ok = var > GSNR_FLOOR * var_max
    p = G @ mean
    orth = G - (p / g2)[:, None] * mean[None, :]
    return {
        "batch_dot": G @ G.T,
        "inner_test": (p.var() / n).sqrt() / g2,
        "ortho_test": (orth.square().sum() / (n - 1) / (n * g2)).sqrt(),
        "batch_l2": G.square().sum(1),
        "sum_grad_squared": {k: g.square().sum(0) for k, g in gs.items()},
        "grad_norm": (mean if reduction == "mean" else G.sum(0)).norm(),
        "noise_scale": var.sum() / g2,
        "norm_test": (var.sum() / n).sqrt() / mean.norm(),
        "mean_gsnr": (mean[ok].square() / var[ok]).mean() if ok.any() else torch.tensor(math.nan),
    }


def _close(a, b, rtol, scale=None, what=""):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if scale is None:
        scale = float(b.abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * scale + 1e-300, equal_nan=True, msg=what)


def check_groups(rec, gs_all, spec, reduction, rtol):
    """record.groups == the oracle restricted to each group; groups add up to the totals."""
    names = list(gs_all)
    want = expected_groups(spec, names)
    assert list(rec.groups) == list(want), (list(rec.groups), list(want))
    scale_l2 = float(torch.cat([g.reshape(len(g), -1) for g in gs_all.values()], 1).square().sum(1).max())
    scale_sq = max(float(g.square().sum(0).max()) for g in gs_all.values())
    var_max = max(float(g.var(0).max()) for g in gs_all.values())
    for group, members in want.items():
        got = rec.groups[group]
        o = group_oracle({q: gs_all[q] for q in members}, reduction, var_max)
        _close(got["batch_l2"], o["batch_l2"], rtol, scale_l2, f"{group}/batch_l2")
        _close(got["batch_dot"], o["batch_dot"], rtol, scale_l2, f"{group}/batch_dot")
        assert set(got["sum_grad_squared"]) == set(members)
        for q in members:
            _close(got["sum_grad_squared"][q], o["sum_grad_squared"][q], rtol, scale_sq, f"{group}/{q}")
        # a norm relative to the total's: a group whose exact gradient is 0 (a bias before a
        # norm layer) is 0 up to rounding in both computations
        _close(got["grad_norm"], o["grad_norm"], rtol, float(rec["grad_norm"]), f"{group}/grad_norm")
        one = sum(gs_all[q][0].numel() for q in members) == 1
        for key in SCALAR_KEYS[1:]:
            if key in ("norm_test", "noise_scale", "inner_test", "ortho_test") and float(o["grad_norm"]) < 1e-6 * float(rec["grad_norm"]):
                continue  # its ratios to ||G|| are then rounding noise over rounding noise
            if key == "ortho_test" and one:  # one coordinate (a 0-dim parameter): no orthogonal
                assert 0 <= got[key] < 1e-6, (group, got[key])  # part, 0 up to sqrt(rounding)
                continue
            if key == "mean_gsnr" and not math.isfinite(float(o[key])):
                assert math.isnan(got[key]), (group, got[key])
                continue
            _close(got[key], o[key], max(rtol, 1e-9), what=f"{group}/{key}")
    # sums over parameters add up over the disjoint groups (norms squared too, and the Gram
    # g_n . g_m); the ratios (norm_test, noise_scale, mean_gsnr, inner_test, ortho_test) are not
    # sums and do not add
    total_l2 = sum(v["batch_l2"] for v in rec.groups.values())
    _close(total_l2, rec["batch_l2"], 1e-12)
    _close(sum(v["batch_dot"] for v in rec.groups.values()), rec["batch_dot"], 1e-12)
    _close(sum(v["grad_norm"] ** 2 for v in rec.groups.values()), rec["grad_norm"] ** 2, 1e-12)
    merged = {q: t for v in rec.groups.values() for q, t in v["sum_grad_squared"].items()}
    assert merged.keys() == rec["sum_grad_squared"].keys()
    for q in merged:
        assert torch.equal(merged[q], rec["sum_grad_squared"][q])


_GROUPINGS = ["param", "module", "patterns"]


@pytest.mark.parametrize("grouping", _GROUPINGS)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", _CASES)
def test_groups_match_the_oracle_restricted_to_each_group(name, reduction, grouping):
    """K = 3 unequal micro-steps [5, 1, 6] (and K = 1 for groups="module"): every group's values
    == the float64 oracle of that group's parameters."""
    case, model, windows = problem(name)
    names = tracked_names(case, model)
    spec = _patterns(names) if grouping == "patterns" else grouping
    kwargs = dict(BN_LEAVE_OUT if case.trackable is not None else {}, groups=spec)
    splits = ("K3-unequal", "K1") if grouping == "module" else ("K3-unequal",)
    grad_r, param_r = _ranges(per_sample_grads(case, model, windows[0]), model, names)
    for split in splits:
        sizes = SPLITS[split]
        lens, thetas = run_lens(case, model, windows, sizes, reduction, _instruments(grad_r, param_r), kwargs)
        rec = lens.records[0]
        gs = per_sample_grads(case, thetas[0], windows[0], sizes)
        assert set(rec["sum_grad_squared"]) == set(gs)
        check_groups(rec, gs, spec, reduction, case.rtol)
        check_group_hists(rec, gs, dict(thetas[0].named_parameters()), expected_groups(spec, list(gs)),
                          grad_r, param_r, case.rtol)


def _tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _one_window(lens, model, sizes=(3, 4)):
    g = torch.Generator().manual_seed(3)
    window = [(torch.randn(b, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g))
              for b in sizes]
    return run_windows(model, [window], lens=lens, fresh_copy=False, close=False).flushed[0]


def test_groups_argument_is_checked():
    model = gradlens.extend(_tiny())
    for bad, match in [
        ("layer", r"Lens\(groups='layer'\): use None, 'param', 'module' or a dict"),
        ({}, r"non-empty dict group name -> list of fnmatch patterns"),
        ([("a", "*")], r"non-empty dict group name"),
        ({"other": ["0.*"]}, r"'other' is the group of unmatched parameters"),
        ({"a/b": ["0.*"]}, r"group names must be non-empty str without '/', got 'a/b'"),
        ({"a": [3]}, r"group 'a' needs a list of fnmatch patterns \(str\), got \[3\]"),
    ]:
        with pytest.raises((TypeError, ValueError), match=match):
            Lens(model, [BatchL2()], groups=bad)
    # the example the messages give works as written
    Lens(model, [BatchL2()], groups={"attn": ["*.attn.*"], "mlp": ["*.mlp.*"]}).close()


def test_patterns_first_match_wins_and_unmatched_form_other():
    model = gradlens.extend(_tiny())
    lens = Lens(model, [BatchL2(), GradNorm()], groups={"biases": ["*.bias"], "first": ["0.*"]})
    rec = _one_window(lens, model)
    assert list(rec.groups) == ["biases", "first", "other"]
    assert lens.groups == {"biases": ("0.bias", "2.bias"), "first": ("0.weight",), "other": ("2.weight",)}
    lens.close()
    lens = Lens(model, [BatchL2()], groups={"none": ["nothing.*"], "all": ["*"]})
    rec = _one_window(lens, model)
    assert list(rec.groups) == ["all"]  # groups without parameters are left out
    lens.close()


def test_without_groups_records_have_none_and_the_log_keeps_its_layout():
    model = gradlens.extend(_tiny())
    lens = Lens(model, [BatchL2(), GradNorm()])
    rec = _one_window(lens, model)
    assert rec.groups == {}
    assert "groups" not in record_to_json(rec)
    lens.close()


def test_log_round_trip_and_flattening_carry_groups():
    """load_log restores record.groups (summaries for tensors, as for totals); flatten and
    flatten_histograms give gradlens/<group>/<key>; every sink and logger uses them."""
    model = gradlens.extend(_tiny())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.jsonl")
        lens = Lens(model, _instruments(), log=path, groups="module")
        rec = _one_window(lens, model)
        lens.close()
        back = load_log(path)[0]
        # a log that keeps at most 8 elements of a value inline: larger histograms as summaries
        small_path = os.path.join(tmp, "small.jsonl")
        with JsonlSink(small_path, max_elements=8) as sink:
            sink.write(rec)
        small = load_log(small_path)[0]
    assert list(back.groups) == ["0", "2"]
    for g in back.groups:  # histograms within max_elements (4096 by default): in full
        assert back.groups[g]["grad_hist_1d"] == rec.groups[g]["grad_hist_1d"]
        assert back.groups[g]["grad_hist_2d"] == rec.groups[g]["grad_hist_2d"]
    for g in back.groups:
        assert back.groups[g]["grad_norm"] == rec.groups[g]["grad_norm"]
        # small tensors inline as for the totals (JsonlSink(max_elements=...)), per-parameter
        # tensors as summaries
        assert torch.equal(back.groups[g]["batch_l2"], rec.groups[g]["batch_l2"])
        assert type(back["batch_l2"]) is type(back.groups[g]["batch_l2"])
        weight = "0.weight" if g == "0" else "2.weight"
        assert back.groups[g]["sum_grad_squared"][weight] == TensorSummary.of(rec.groups[g]["sum_grad_squared"][weight])
    assert record_from_json(json.loads(json.dumps(record_to_json(rec)))) == rec
    flat = flatten(rec)
    for g in ("0", "2"):
        for key in SCALAR_KEYS:
            assert flat[f"gradlens/{g}/{key}"] == pytest.approx(rec.groups[g][key], nan_ok=True)
    assert flat["gradlens/grad_norm"] == rec["grad_norm"]
    hists = flatten_histograms(rec)
    assert set(hists) == {f"gradlens/{g}{key}" for g in ("", "0/", "2/")
                          for key in ("grad_hist_1d", "grad_hist_2d/grad", "grad_hist_2d/param")}
    assert torch.equal(hists["gradlens/2/grad_hist_1d"][0], rec.groups["2"]["grad_hist_1d"].counts)
    # group histograms of more than max_elements bins go to the log as scalar summaries (the
    # full ones are in memory, and in the TensorBoard / W&B sinks)
    for g in ("0", "2"):
        h, summary = rec.groups[g]["grad_hist_1d"], small.groups[g]["grad_hist_1d"]
        assert summary["total"] == h.total == 7 * (25 if g == "0" else 18)  # N x the group's elements
        assert (summary["clamped_low"], summary["clamped_high"]) == (h.clamped_low, h.clamped_high)
        assert summary["clamped_fraction"] == pytest.approx((h.clamped_low + h.clamped_high) / h.total)
        for q in (0.05, 0.25, 0.5, 0.75, 0.95):
            assert summary[f"q{round(100 * q):02d}"] == pytest.approx(_quantile(h.counts, h.edges, q))
        h2, summary2 = rec.groups[g]["grad_hist_2d"], small.groups[g]["grad_hist_2d"]
        assert summary2["clamped_param"] == h2.clamped_param
        assert summary2["q50"] == pytest.approx(_quantile(h2.counts.sum(0), h2.grad_edges, 0.5))
    assert flatten(small)["gradlens/2/grad_hist_1d/q50"] == small.groups["2"]["grad_hist_1d"]["q50"]


def _quantile(counts, edges, q):
    """The q-quantile of binned counts, linear within a bin (a loop over bins)."""
    total = float(sum(counts.tolist()))
    seen = 0.0
    for i, c in enumerate(counts.tolist()):
        if c and seen + c >= q * total:
            return float(edges[i]) + (q * total - seen) / c * float(edges[i + 1] - edges[i])
        seen += c
    return float(edges[-1])


def test_groups_follow_undefined_exclusions_and_frozen_parameters():
    """Parameters left out (undefined="exclude", frozen) leave their groups; the groups of a
    window are those of its tracked parameters."""
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 3)).double())
    lens = Lens(model, [BatchL2(), GradNorm()], undefined="exclude", groups="module")
    rec = _one_window(lens, model)
    assert list(rec.groups) == ["1", "2"]  # 0 reaches the train-mode BatchNorm
    _close(sum(v["batch_l2"] for v in rec.groups.values()), rec["batch_l2"], 1e-12)
    lens.close()
    model = gradlens.extend(_tiny())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [BatchL2()], optimizer=opt, groups="param")
    _one_window(lens, model)
    model[2].bias.requires_grad_(False)
    opt.step()
    opt.zero_grad()
    rec = _one_window(lens, model)
    assert list(rec.groups) == ["0.weight", "0.bias", "2.weight"]
    lens.close()


def test_group_values_in_tensorboard_and_wandb_names(tmp_path):
    """The TensorBoard sink writes the flattened names (gradlens/<group>/<key>)."""
    written = []

    class Writer:  # the SummaryWriter calls TensorBoardSink makes
        def add_scalar(self, tag, value, step):
            written.append(tag)

        def add_histogram_raw(self, tag, **kw):
            written.append(tag)

        def flush(self):
            pass

        def close(self):
            pass

    model = gradlens.extend(_tiny())
    lens = Lens(model, [GradNorm(), NormTest(), GradHist1d()], tensorboard=Writer(), groups="module")
    rec = _one_window(lens, model)
    lens.close()
    assert {"gradlens/0/grad_norm", "gradlens/2/grad_norm", "gradlens/0/norm_test",
            "gradlens/0/grad_hist_1d", "gradlens/2/grad_hist_1d", "gradlens/grad_hist_1d"} <= set(written)
    # the names the Lightning and Trainer loggers (and W&B) take: the same flattening
    from gradlens.integrations import record_histograms, record_scalars

    scalars = record_scalars(rec)
    assert scalars["gradlens/2/grad_norm"] == rec.groups["2"]["grad_norm"]
    assert scalars["gradlens/0/grad_hist_1d/clamped_low"] == rec.groups["0"]["grad_hist_1d"].clamped_low
    assert torch.equal(record_histograms(rec)["gradlens/0/grad_hist_1d"][0], rec.groups["0"]["grad_hist_1d"].counts)


# ------------------------------------------------------------------------------ DDP, 2 gloo ranks
from oracle import MODELS, make_problem  # noqa: E402
from oracle import per_sample_grads as plain_per_sample_grads  # noqa: E402
from test_distributed import _init, _spawn  # noqa: E402

RANK_SIZES = [5, 7]  # unequal per-rank batches, N = 12; each rank splits its batch in 2 unequal micro-steps


def _ddp_problem(name):
    model, x, y = make_problem(MODELS[name], seed=0)
    _, x1, y1 = make_problem(MODELS[name], seed=1)
    gs = plain_per_sample_grads(model, x, y)
    return model, [(x, y), (x1, y1)], gs


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, name: str, spec) -> None:
    _init(rank, world, port)
    try:
        model0, windows, gs = _ddp_problem(name)
        names = list(gs)
        grad_r, param_r = _ranges(gs, model0, names)
        out = {}
        # "light_equal": equal micro-steps on both ranks (6 = 3 + 3), where the fast route
        # (the window gradient from DDP's p.grad, from the second window on) applies
        for label, instruments, sizes, cut in (
            ("all", _instruments(grad_r, param_r), RANK_SIZES, lambda b: [1, b - 1]),
            ("light", [GradNorm()], RANK_SIZES, lambda b: [1, b - 1]),
            ("light_equal", [GradNorm()], [6, 6], lambda b: [3, 3]),
        ):
            lo = sum(sizes[:rank])
            mine = slice(lo, lo + sizes[rank])
            model = gradlens.extend(copy.deepcopy(model0))
            ddp = nn.parallel.DistributedDataParallel(model)
            loss_fn = gradlens.extend(nn.CrossEntropyLoss())
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
            lens = Lens(model, instruments, optimizer=opt, groups=spec)
            thetas = [copy.deepcopy(model.state_dict())]
            for x, y in windows:  # from the second window on, DDP's p.grad gives grad_sum
                xs, ys = x[mine], y[mine]
                for k, (xb, yb) in enumerate(zip(xs.split(cut(len(xs))), ys.split(cut(len(xs))))):
                    with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                        loss = loss_fn(ddp(xb), yb)
                        with lens.capture():
                            loss.backward()
                opt.step()
                opt.zero_grad()
                thetas.append(copy.deepcopy(model.state_dict()))
            fast = lens._ddp_route.fast
            lens.close()
            out[label] = ([(r.num_samples, dict(r.values), r.groups) for r in lens.records], thetas, fast)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("name,spec", [("mlp", "module"), ("cnn", "param"), ("mlp", {"hidden": ["1.*", "3.*"]})])
def test_groups_under_ddp_equal_the_oracle_of_all_samples(name, spec):
    """2 gloo ranks x 2 unequal micro-steps, 2 windows: every group's values == the oracle of
    all N samples (rank-major) restricted to the group, as one batch would give; also in light
    mode (GradNorm alone), whose fast route reads the window gradient from DDP's p.grad from the
    second window on: the groups then need it per parameter."""
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_ddp_worker, 2, out_dir, name, spec)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    model0, windows, gs0 = _ddp_problem(name)
    names = list(gs0)
    grad_r, param_r = _ranges(gs0, model0, names)
    want = expected_groups(spec, names)
    for rank_out in results:  # every rank holds the merged records
        assert rank_out["light_equal"][2] and not rank_out["light"][2]  # the route each one took
        for label in ("all", "light", "light_equal"):
            records, thetas, _ = rank_out[label]
            assert len(records) == 2
            for t, (n, values, groups) in enumerate(records):
                model = copy.deepcopy(model0)
                model.load_state_dict(thetas[t])
                gs = plain_per_sample_grads(model, *windows[t])
                assert n == sum(RANK_SIZES)
                if label == "all":
                    rec = gradlens.Record(t, n, 4, values, {}, groups)
                    check_groups(rec, gs, spec, "mean", 1e-10)
                    check_group_hists(rec, gs, dict(model.named_parameters()), want, grad_r, param_r, 1e-10)
                    continue
                assert list(groups) == list(want)
                for group, members in want.items():
                    G = torch.cat([gs[q].reshape(len(gs[q]), -1) for q in members], dim=1)
                    _close(groups[group]["grad_norm"], G.mean(0).norm(), 1e-10, what=f"{t}/{group}")


def _disagree_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        model = gradlens.extend(_tiny())
        try:
            Lens(model, [BatchL2()], groups="module" if rank == 0 else "param")
            got = "built"
        except RuntimeError as err:
            got = str(err)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(got)
    finally:
        torch.distributed.destroy_process_group()


def test_ranks_with_different_groups_are_refused():
    """The per-group pieces travel in a layout fixed by the groups: ranks must agree on them."""
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_disagree_worker, 2, out_dir)
        got = [open(os.path.join(out_dir, f"rank{r}.txt")).read() for r in range(2)]
    for text in got:
        assert "parameters: ranks [1] differ from rank 0" in text, text
        assert "groups='module'" in text or "groups='param'" in text, text


# ------------------------------------------------------------------------------ no host reads
from gradlens.core.sync import forced_device_paths  # noqa: E402
from test_sync import MODELS as SYNC_MODELS  # noqa: E402
from test_sync import SETS, HostReads, _train  # noqa: E402


def _train_grouped(make, data, insts, reads, groups):
    """tests/test_sync.py's probe loop, 2 windows, with groups."""
    return _train(make, data, insts, reads, windows=2, groups=groups)


@pytest.mark.parametrize("model", sorted(SYNC_MODELS))
@pytest.mark.parametrize("what", sorted(SETS))
def test_groups_make_no_host_read_in_tracked_micro_steps(model, what):
    """The per-group pieces (batch_l2 parts, histogram parts) stay on the device in the hot path
    (groups="param" splits every layer's parameters over groups)."""
    make, data = SYNC_MODELS[model]
    with forced_device_paths(), HostReads() as reads:
        records = _train_grouped(make, data, SETS[what], reads, "param")
    assert not reads.calls, ", ".join(f"{k} x{v}" for k, v in reads.calls.items())
    assert records and all(r.groups for r in records)


@pytest.mark.parametrize("model", sorted(SYNC_MODELS))
def test_group_histograms_are_the_same_on_the_device_paths(model):
    make, data = SYNC_MODELS[model]
    insts = lambda: [GradHist1d(bins=30, range=(-0.5, 0.5)), GradHist2d(bins=(6, 20)), BatchL2()]  # noqa: E731
    cpu = _train_grouped(make, data, insts, None, "module")
    with forced_device_paths():
        dev = _train_grouped(make, data, insts, None, "module")
    for a, b in zip(cpu, dev):
        assert list(a.groups) == list(b.groups)
        for g in a.groups:
            assert a.groups[g]["grad_hist_1d"] == b.groups[g]["grad_hist_1d"]
            assert torch.equal(a.groups[g]["grad_hist_2d"].counts, b.groups[g]["grad_hist_2d"].counts)
            torch.testing.assert_close(a.groups[g]["batch_l2"], b.groups[g]["batch_l2"])


def test_a_window_resumed_from_a_mid_window_state_dict_keeps_its_groups():
    """Lens.state_dict inside a window with groups (the per-group norms and histogram parts of
    the micro-steps so far) resumes to the record an uninterrupted window gives."""
    model = gradlens.extend(_tiny())
    insts = lambda: [BatchL2(), GradNorm(), MeanGSNR(), GradHist1d(bins=7), GradHist2d(bins=(3, 5)), BatchDot()]  # noqa: E731
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(b, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g))
               for b in (3, 4)]
    saved = []
    (ref,) = run_windows(model, [batches], lens=Lens(model, insts(), groups="param"), fresh_copy=False,
                         on_micro=lambda run, w, k, loss: k == 0 and saved.append(run.lens.state_dict())).flushed
    lens = Lens(model, insts(), groups="param")
    lens.load_state_dict(saved[0])
    (rec,) = run_windows(model, [batches[1:]], lens=lens, fresh_copy=False).flushed
    assert list(rec.groups) == list(ref.groups) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for grp in ref.groups:
        for key, v in ref.groups[grp].items():
            if isinstance(v, torch.Tensor):
                torch.testing.assert_close(rec.groups[grp][key], v, rtol=1e-12, atol=0)
            elif isinstance(v, float):
                assert rec.groups[grp][key] == pytest.approx(v, rel=1e-12, nan_ok=True)
            else:
                assert rec.groups[grp][key] == v, (grp, key)


def test_an_instrument_joins_groups_by_declaring_per_group():
    """The hook for new instruments: per_group = True and, with a window state, group_state."""
    from gradlens.instruments.base import Instrument

    class SumOfSums(Instrument):  # sum over parameters of sum_n g_n, per parameter kept
        key = "sum_of_sums"
        needs = frozenset({"grad_sum"})
        per_group = True

        def finalize(self, stats, state):
            return float(sum(float(v.sum()) for v in stats.grad_sum.values()))

    class Kept(SumOfSums):  # a window state, but no group_state
        key = "kept"

        def start_window(self):
            return {}

    model = gradlens.extend(_tiny())
    lens = Lens(model, [SumOfSums()], groups="module")
    rec = _one_window(lens, model)
    lens.close()
    assert sum(v["sum_of_sums"] for v in rec.groups.values()) == pytest.approx(rec["sum_of_sums"], rel=1e-12)
    lens = Lens(model, [Kept()], groups="module")
    with pytest.raises(NotImplementedError, match=r"Kept.per_group is True but it keeps a window state and does "
                                                  r"not define group_state\(state, names\)"):
        _one_window(lens, model)
    lens.close()

    class Bad(SumOfSums):
        per_group = "yes"

    with pytest.raises(TypeError, match=r"Bad.per_group must be True or False, got 'yes'"):
        Lens(model, [Bad()])
