"""Cross-micro-step instruments (BatchDot, Alpha and the search-direction projections, InnerTest,
OrthoTest) == float64 torch.func oracle == the K = 1 record, for any optimizer and accumulation;
sketch mode is unbiased within its documented error bound; budgets and missing alphas say why."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import Alpha, BatchDot, InnerTest, OrthoTest
from oracle import MODELS, SPLITS, flat, make_problem, per_sample_grads, window_oracle
from windows import all_instruments, micro_batches, run_windows, split_windows

from gradlens.training.accumulate import GradientAccumulateOptimizer

RTOL = 1e-10
KEYS = ("batch_dot", "inner_test", "ortho_test")
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.3),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.05),
}


def _close(a, b, rtol=RTOL):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
        rtol=rtol, atol=1e-13,
    )


def _instruments(**kw):
    return all_instruments(order=("BatchDot", "Alpha", "InnerTest", "OrthoTest"), cross=kw)


def run(model0, windows, split, reduction, opt_name, via, instruments):
    """Two (or more) windows of data through a Lens; returns (lens, [theta_0, theta_1, ...]).

    ``via="plain"``: a torch optimizer, the window gradient accumulated by hand;
    ``via="accum"``: GradientAccumulateOptimizer.
    """
    inner = OPTIMIZERS[opt_name]
    opt = ((lambda ps: GradientAccumulateOptimizer(inner(ps), accum_steps=len(split), reduction=reduction))
           if via == "accum" else inner)
    r = run_windows(model0, split_windows(windows, split), instruments, reduction=reduction, optimizer=opt,
                    accumulate="exact", losses=True, snapshots=True)
    return r.lens, r.thetas


def _problem(name):
    model, x0, y0 = make_problem(MODELS[name], seed=0)
    _, x1, y1 = make_problem(MODELS[name], seed=1)
    return model, [(x0, y0), (x1, y1)]


VIAS = ["plain", "accum"]

_K1_CACHE: dict = {}


@pytest.mark.parametrize("via", VIAS)
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_exact_matches_oracle_and_single_batch(name, reduction, split, opt_name, via):
    model, windows = _problem(name)
    sizes = SPLITS[split]
    lens, thetas = run(model, windows, sizes, reduction, opt_name, via, _instruments())
    rec, last = lens.records
    assert rec.micro_steps == len(sizes) and rec.num_samples == sum(sizes)
    for key in ("batch_dot", "inner_test", "ortho_test", "alpha"):
        assert rec.meta[key] == "exact"
    assert rec.meta["search_dir_projections"] == "start: exact, end: exact"
    o = window_oracle(thetas, windows, 0)
    for key in KEYS:
        _close(rec[key], o[key])
    sp = rec["search_dir_projections"]
    for key in ("start", "end", "update_sq_norm"):
        _close(sp[key], o[key])
    assert rec["alpha"] is not None and math.isfinite(rec["alpha"])
    _close(rec["alpha"], o["alpha"], rtol=1e-7)
    # the last window has no successor: no alpha, and the record says why
    assert last["alpha"] is None and "closed" in last.meta["alpha"]
    o1 = flat(per_sample_grads(thetas[1], *windows[1]))
    _close(last["batch_dot"], o1 @ o1.T)
    # K micro-steps report what one batch of N reports
    key = (name, reduction, opt_name, via)
    if key not in _K1_CACHE:
        _K1_CACHE[key] = run(model, windows, [12], reduction, opt_name, via, _instruments())[0]
    ref = _K1_CACHE[key].records[0]
    for k in KEYS + ("alpha",):
        _close(rec[k], ref[k], rtol=1e-8 if k == "alpha" else RTOL)
    for k in ("start", "end", "update_sq_norm"):
        _close(sp[k], ref["search_dir_projections"][k])


def test_sequence_linear_uses_tgram_and_matches_oracle():
    """Linear layers on [B, T, d] inputs: the T x T Gram path (small T) and the materialising
    path (large T), and their projections."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2), nn.Flatten(), nn.Linear(14, 4)
    ).double()
    x0, x1 = torch.randn(9, 7, 4, dtype=torch.float64), torch.randn(9, 7, 4, dtype=torch.float64)
    y0, y1 = torch.randint(0, 4, (9,)), torch.randint(0, 4, (9,))
    windows = [(x0, y0), (x1, y1)]
    lens, thetas = run(model, windows, [4, 5], "mean", "momentum", "plain", _instruments())
    o = window_oracle(thetas, windows, 0)
    rec = lens.records[0]
    for key in KEYS:
        _close(rec[key], o[key])
    _close(rec["search_dir_projections"]["start"], o["start"])
    _close(rec["alpha"], o["alpha"], rtol=1e-7)


@pytest.mark.parametrize("route", ["tgram", "row_blocks", "row_blocks_chunked"])
def test_sequence_linear_gram_routes_match_per_sample_oracle(route, monkeypatch):
    """LinearKernel.gram on [b, T, d] factors of several micro-steps, each route the cost rule
    can take (T x T products; materialised weight rows in one block, or in blocks of 3 rows),
    equals the Gram of float64 torch.func per-sample gradients of the layer."""
    from torch.func import grad, vmap

    from gradlens.kernels import LinearKernel, linear, tgram_cheaper

    torch.manual_seed(0)
    d_in, d_out, t = (16, 12, 2) if route == "tgram" else (4, 6, 7)
    lin = nn.Linear(d_in, d_out).double()
    sizes = [3, 1, 4]
    pieces = [(torch.randn(b, t, d_in, dtype=torch.float64), torch.randn(b, t, d_out, dtype=torch.float64))
              for b in sizes]
    n = sum(sizes)
    assert tgram_cheaper(d_out, d_in, t, n) == (route == "tgram")
    if route == "row_blocks_chunked":
        monkeypatch.setattr(linear, "CHUNK_ELEMENTS", 3 * n * d_in)  # 3 rows per block: 2 blocks
    K = LinearKernel().gram(lin, pieces, ["weight", "bias"])

    def contribution(params, x, d):
        return (d * F.linear(x, params["weight"], params["bias"])).sum()

    params = {"weight": lin.weight.detach(), "bias": lin.bias.detach()}
    A = torch.cat([a for a, _ in pieces])
    D = torch.cat([d for _, d in pieces])
    g = vmap(grad(contribution), in_dims=(None, 0, 0))(params, A, D)
    G = torch.cat([g["weight"].flatten(1), g["bias"]], dim=1)
    torch.testing.assert_close(K, G @ G.T, rtol=1e-12, atol=1e-12)


def test_sequence_linear_gram_row_blocks_with_unequal_lengths():
    """Micro-steps whose sequences differ in length (T = 3 and 5) still give the exact Gram
    (weight only), against float64 per-sample gradients formed sample by sample."""
    from gradlens.kernels import LinearKernel

    torch.manual_seed(1)
    lin = nn.Linear(5, 4, bias=False).double()
    pieces = [(torch.randn(2, 3, 5, dtype=torch.float64), torch.randn(2, 3, 4, dtype=torch.float64)),
              (torch.randn(3, 5, 5, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64))]
    K = LinearKernel().gram(lin, pieces, ["weight"])
    gs = []
    for a, d in pieces:
        for i in range(a.shape[0]):
            w = lin.weight.detach().clone().requires_grad_(True)
            (d[i] * F.linear(a[i], w)).sum().backward()
            gs.append(w.grad.flatten())
    G = torch.stack(gs)
    torch.testing.assert_close(K, G @ G.T, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------ sketch mode
SEEDS = range(24)


@pytest.fixture(scope="module")
def sketch_runs():
    model, windows = _problem("cnn")
    runs = []
    for seed in SEEDS:
        insts = [BatchDot(mode="sketch", k=64, seed=seed), Alpha(mode="sketch", k=64, seed=seed)]
        lens, thetas = run(model, windows, [5, 1, 6], "mean", "momentum", "plain", insts)
        runs.append(lens.records[0])
    return runs, window_oracle(thetas, windows, 0), thetas, windows


def test_sketch_is_unbiased_within_documented_bound(sketch_runs):
    """Over 24 seeds: the mean error of every Gram entry is within 5 standard errors of 0 and the
    observed variance stays within the documented bound Var <= 8 ||g_n||^2 ||g_m||^2 / k."""
    runs, o, _, _ = sketch_runs
    k = 64
    assert all(r.meta["batch_dot"] == f"sketch(k={k})" for r in runs)
    est = torch.stack([r["batch_dot"] for r in runs])  # [S, N, N]
    exact = o["batch_dot"]
    norms = exact.diagonal()
    bound_var = 8 * norms[:, None] * norms[None, :] / k
    err = est - exact
    s = est.shape[0]
    z = err.mean(0) / (bound_var / s).sqrt()
    assert z.abs().max() < 5, float(z.abs().max())
    ratio = err.var(0) / bound_var
    assert float(ratio.mean()) < 1.0 and float(ratio.max()) < 3.0, (float(ratio.mean()), float(ratio.max()))
    assert float(err.abs().max()) > 0  # it really is an estimate


def test_sketch_projections_unbiased_and_end_exact(sketch_runs):
    runs, o, thetas, windows = sketch_runs
    k = 64
    sq = o["update_sq_norm"]
    G0 = flat(per_sample_grads(thetas[0], *windows[0]))
    start = torch.stack([r["search_dir_projections"]["start"] for r in runs]) * sq  # d . g_n
    bound_var = 8 * sq * G0.square().sum(1) / k
    err = start - o["start"] * sq
    z = err.mean(0) / (bound_var / len(runs)).sqrt()
    assert z.abs().max() < 5
    assert float((err.var(0) / bound_var).mean()) < 1.0
    for r in runs:
        assert r.meta["search_dir_projections"] == f"start: sketch(k={k}), end: exact"
        assert r.meta["alpha"] == f"sketch(k={k})"
        _close(r["search_dir_projections"]["end"], o["end"])  # end point is always exact
        _close(r["search_dir_projections"]["update_sq_norm"], sq)


@pytest.mark.parametrize("name", ["mlp", "mlp_bn_eval"])
def test_sketch_inner_and_ortho_run_and_are_close(name):
    model, windows = _problem(name)
    insts = [InnerTest(mode="sketch", k=4096), OrthoTest(mode="sketch", k=4096), BatchDot()]
    lens, thetas = run(model, windows[:1], [6, 6], "sum", "sgd", "plain", insts)
    rec = lens.records[0]
    assert rec.meta["inner_test"] == "sketch(k=4096)"
    G = flat(per_sample_grads(thetas[0], *windows[0]))
    mean = G.mean(0)
    p = G @ mean
    inner = float((p.var() / 12).sqrt() / mean.square().sum())
    assert rec["inner_test"] == pytest.approx(inner, rel=0.5)
    assert math.isfinite(rec["ortho_test"])


# ------------------------------------------------------------------------------ budgets, errors
def test_budget_exceeded_raises_and_names_sketch_mode():
    model, windows = _problem("mlp")
    with pytest.raises(RuntimeError, match=r"max_bytes=1000.*mode='sketch'"):
        run(model, windows[:1], [6, 6], "mean", "sgd", "plain", [BatchDot(max_bytes=1000)])
    # the same window fits a larger budget
    run(model, windows[:1], [6, 6], "mean", "sgd", "plain", [BatchDot(max_bytes=1 << 20)])


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode must be 'exact' or 'sketch'"):
        BatchDot(mode="fast")
    with pytest.raises(ValueError, match="k .* positive int"):
        Alpha(mode="sketch", k=0)
    with pytest.raises(ValueError, match="max_bytes"):
        InnerTest(max_bytes=-1)


def test_wrong_losses_shape_raises():
    model, windows = _problem("mlp")
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(model, [Alpha()])
    x, y = windows[0]
    loss = loss_fn(model(x), y)
    with pytest.raises(ValueError, match="per-sample losses .* 12 elements"):
        with lens.capture(losses=torch.zeros(3)):
            loss.backward()


def test_in_place_modification_is_refused():
    model, windows = _problem("mlp")
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(model, [BatchDot()])
    x, y = windows[0]
    x = x.clone()
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    x.mul_(2)  # the first layer's input, kept by reference
    with pytest.raises(RuntimeError, match="modified in place"):
        lens.flush()


def _one_window_with(step_fn, instruments=None):
    model, windows = _problem("mlp")
    return run_windows(model, [[w] for w in windows], instruments or [Alpha(), BatchDot()],
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), losses=True, end="none",
                       on_window=lambda run, w: step_fn(run.lens, run.optimizer), close=False).lens


def test_skipped_or_zero_update_gives_no_alpha_and_says_why():
    # parameters unchanged (a step that did not move them, e.g. skipped inside the step)
    lens = _one_window_with(lambda lens, opt: (opt.step(), opt.zero_grad()))
    rec = lens.records[0]
    assert rec["alpha"] is None and "update was zero" in rec.meta["alpha"]
    assert "search_dir_projections" not in rec
    # the optimizer step never fired (skipped by a GradScaler): the window is closed by flush()
    lens = _one_window_with(lambda lens, opt: lens.flush())
    rec = lens.records[0]
    assert rec["alpha"] is None and "no optimizer update" in rec.meta["alpha"]
    assert rec.meta["batch_dot"] == "exact"


def test_pending_record_goes_to_sinks_when_settled(tmp_path):
    model, windows = _problem("mlp")
    log = tmp_path / "log.jsonl"

    def written_once_the_next_window_closed(run, i):
        assert run.records[-1].meta["alpha"].startswith("pending")
        assert len(gradlens.load_log(log)) == i

    lens = run_windows(model, [[w] for w in windows + windows[:1]], [Alpha()],
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.3), log=log, losses=True,
                       on_window=written_once_the_next_window_closed, close=False).lens
    lens.flush()  # nothing captured: the pending record is written without alpha
    recs = gradlens.load_log(log)
    assert [r.step for r in recs] == [0, 1, 2]
    assert all(isinstance(r["alpha"], float) for r in recs[:2])
    assert recs[2]["alpha"] is None and "captured nothing" in recs[2].meta["alpha"]
    lens.close()


def test_untracked_next_window_gives_no_alpha():
    model, windows = _problem("mlp")
    lens = run_windows(model, [[w] for w in windows * 2], [Alpha()], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.3),
                       every=2, losses=True).lens
    assert [r.step for r in lens.records] == [0, 2]
    for r in lens.records:
        assert r["alpha"] is None and "not tracked" in r.meta["alpha"]


def test_missing_losses_say_so():
    model, windows = _problem("mlp")
    rec = run_windows(model, [[w] for w in windows], [Alpha()], optimizer=lambda ps: torch.optim.SGD(ps, lr=0.3),
                      close=False).records[0]
    assert rec["alpha"] is None and "losses=" in rec.meta["alpha"]
    assert "end" in rec["search_dir_projections"]  # projections do not need the losses


# ------------------------------------------------------------------------------ cockpit
def test_alpha_and_tests_match_cockpit_on_plain_sgd():
    """Alpha, InnerTest and OrthoTest on plain SGD equal cockpit-for-pytorch's on the same model,
    data and steps (runs only where cockpit is importable)."""
    cockpit = pytest.importorskip("cockpit")
    from backpack import extend as bp_extend

    model0, windows = _problem("cnn")
    lr = 0.3
    # cockpit
    cmodel = bp_extend(copy.deepcopy(model0))
    closs = bp_extend(nn.CrossEntropyLoss())
    copt = torch.optim.SGD(cmodel.parameters(), lr=lr)
    qs = [
        cockpit.quantities.Alpha(lambda s: s == 0),
        cockpit.quantities.InnerTest(lambda s: s == 0),
        cockpit.quantities.OrthoTest(lambda s: s == 0),
    ]
    ck = cockpit.Cockpit(cmodel.parameters(), quantities=qs)
    for step, (x, y) in enumerate(windows):
        out = cmodel(x)
        loss = closs(out, y)
        losses = F.cross_entropy(out, y, reduction="none")
        info = {"batch_size": len(x), "individual_losses": losses, "loss": loss, "optimizer": copt}
        with ck(step, info=info):
            loss.backward(create_graph=ck.create_graph(step))
        copt.step()
        copt.zero_grad()
    ck_alpha, ck_inner, ck_ortho = (q.get_output()[0] for q in qs)
    # gradlens, with accumulation over unequal micro-steps
    lens, _ = run(model0, windows, [5, 1, 6], "mean", "sgd", "plain", _instruments())
    rec = lens.records[0]
    _close(rec["alpha"], ck_alpha, rtol=1e-7)
    _close(rec["inner_test"], ck_inner, rtol=1e-8)
    _close(rec["ortho_test"], ck_ortho, rtol=1e-8)


def test_wide_mlp_gram_route_matches_oracle():
    """A layer with N (d_in + d_out) < d_in d_out takes the Gram route in InnerTest/OrthoTest."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(30, 40), nn.Tanh(), nn.Linear(40, 4)).double()
    windows = [
        (torch.randn(12, 30, dtype=torch.float64), torch.randint(0, 4, (12,))) for _ in range(2)
    ]
    lens, thetas = run(model, windows, [7, 5], "sum", "adam", "plain", _instruments())
    o = window_oracle(thetas, windows, 0)
    for key in KEYS:
        _close(lens.records[0][key], o[key])


def test_sketch_routes_agree():
    """The factor route and the materialising route compute the same sketch."""
    from gradlens.capture import Site
    from gradlens.instruments.crosssample import _Sketcher
    from gradlens.capture.registry import kernel_for

    torch.manual_seed(0)
    conv = nn.Conv2d(3, 5, 3, padding=1).double()
    lin = nn.Linear(6, 4).double()
    for mod, a, delta in [
        (conv, torch.randn(4, 3, 6, 6, dtype=torch.float64), torch.randn(4, 5, 6, 6, dtype=torch.float64)),
        (lin, torch.randn(4, 2, 6, dtype=torch.float64), torch.randn(4, 2, 4, dtype=torch.float64)),
    ]:
        w = Site("layer", mod, kernel_for(mod), {"weight": "weight", "bias": "bias"})
        sk = _Sketcher(k=2, seed=1)  # small k: sketch() takes the factor route
        factor = sk.sketch(w, a, delta)
        dims = (mod.weight.shape[0], mod.weight[0].numel())
        u, v = sk._pair(w, "wb", dims[0], dims[1] + 1, delta)
        mat = w.kernel.sketch_materialised(mod, a, delta, w.params, u, v[:, :-1], v[:, -1])
        _close(factor, mat)


def test_window_skipped_by_accumulating_optimizer_keeps_alpha_pending():
    """A window the accumulating optimizer ends without an update (GradScaler inf, reset()) is
    dropped by the Lens; the pending alpha then comes from the next real window, still at
    theta_{t+1}, and equals the oracle on that window's data."""
    model0, windows = _problem("mlp")
    model = gradlens.extend(copy.deepcopy(model0))
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.3), accum_steps=2)
    lens = Lens(model, _instruments(), optimizer=opt)
    thetas = [copy.deepcopy(model0)]

    def window(x, y, skip=False):
        mbs = micro_batches(x, y, [6, 6])
        # skip: reset() after the first micro-step, as a GradScaler inf would: the window ends
        # without an update
        run_windows(model, [mbs[:1] if skip else mbs], lens=lens, optimizer=opt, losses=True,
                    on_micro=(lambda run, w, k, loss: opt.reset()) if skip else None, fresh_copy=False,
                    close=False)

    window(*windows[0])
    theta = copy.deepcopy(model0)
    theta.load_state_dict(model.state_dict())
    thetas.append(theta)
    x_bad = torch.randn(12, 12, dtype=torch.float64)
    window(x_bad, windows[1][1], skip=True)
    assert lens.skipped_windows == 1
    assert lens.records[0].meta["alpha"].startswith("pending")
    window(*windows[1])
    lens.close()
    assert [r.step for r in lens.records] == [0, 1]
    o = window_oracle(thetas, windows, 0)
    _close(lens.records[0]["alpha"], o["alpha"], rtol=1e-7)
    _close(lens.records[0]["search_dir_projections"]["end"], o["end"])


def test_mean_tests_with_training_mode_batchnorm():
    """InnerTest and OrthoTest project g_n on G with the layer's own kernel: a BatchNorm in
    training mode normalises with the batch statistics (not the running ones), and its own
    weight and bias and the layers after it are tracked. Oracle: the float64 Jacobian of the
    per-sample losses of the batch forward."""
    torch.manual_seed(0)
    model0 = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    model0.train()
    x, y = torch.randn(12, 5, dtype=torch.float64), torch.randint(0, 3, (12,))
    ref = copy.deepcopy(model0)
    names = ["1.weight", "1.bias", "3.weight", "3.bias"]
    params = dict(ref.named_parameters())

    def losses(*ps):
        out = torch.func.functional_call(ref, {**params, **dict(zip(names, ps))}, (x,))
        return F.cross_entropy(out, y, reduction="none")

    jac = torch.autograd.functional.jacobian(losses, tuple(params[q].detach() for q in names))
    g = torch.cat([j.reshape(12, -1) for j in jac], dim=1)  # [N, D] per-sample gradients
    G = g.mean(0)
    p, g2, n = g @ G, float(G @ G), 12
    inner = math.sqrt(float(p.var()) / n) / g2
    v = (float(g.square().sum()) - float(p.square().sum()) / g2) / (n - 1)
    ortho = math.sqrt(max(v, 0.0) / (n * g2))

    lens = run_windows(model0, [[(x, y)]], [InnerTest(), OrthoTest()], undefined="exclude", loss=F.cross_entropy,
                       capture={"reduction": "mean"}, pass_loss=True, close=False).lens
    assert sorted(lens.tracked) == sorted(names)
    _close(lens.records[0]["inner_test"], inner)
    _close(lens.records[0]["ortho_test"], ortho)


def test_micro_batches_that_are_slices_with_an_in_place_first_layer_are_not_refused():
    """x.split(...) micro-batches share one version counter; an in-place first layer bumps it
    for every slice. That is no modification of an earlier micro-batch: the Gram is exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    ref = copy.deepcopy(model)
    rows = []
    for n in range(8):
        g = torch.autograd.grad(F.cross_entropy(ref(x[n:n + 1].clone()), y[n:n + 1]), list(ref.parameters()))
        rows.append(torch.cat([v.reshape(-1) for v in g]))
    G = torch.stack(rows)
    (rec,) = run_windows(model, [micro_batches(x.clone(), y, [3, 5])], [BatchDot()]).flushed
    torch.testing.assert_close(rec["batch_dot"], G @ G.T, rtol=1e-10, atol=1e-13)
