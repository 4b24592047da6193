"""Curvature of the window objective (HessMaxEV, HessTrace, TICDiag, TICTrace) against a float64
oracle: ``torch.func.hessian`` of the window objective (all N samples of all micro-steps and
ranks) on a copy of the model taken before ``gradlens.extend``, and ``vmap(grad)`` per-sample
gradients for the TIC's m_j. K unequal micro-steps, mean and sum losses, 2 gloo ranks; the
Hutchinson estimate's mean and standard error over 200 windows; cockpit's configurations."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    Alpha,
    GradHist1d,
    GradHist2d,
    GradNorm,
    HessMaxEV,
    HessTrace,
    InnerTest,
    NormTest,
    OrthoTest,
    SumGradSquared,
    TICDiag,
    TICTrace,
    configuration,
)
from gradlens.instruments.curvature import TIC_EPS
from windows import micro_batches, run_windows

SPLIT = [5, 1, 6]  # K = 3 unequal micro-steps, N = 12
RTOL = 1e-8


# ---- models ---------------------------------------------------------------------------------
def tanh_mlp() -> nn.Module:
    """4-6-3 tanh MLP; with MSE on these targets its Hessian is indefinite, lambda_min close to
    -lambda_max (checked on the oracle below): a power iteration cannot tell them apart."""
    torch.manual_seed(37)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def tanh_data():
    """The probe's data (x [12, 4], targets [12, 3] of scale 3), drawn after tanh_mlp's weights."""
    torch.manual_seed(37)
    nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))  # the same draws as tanh_mlp
    return torch.randn(12, 4, dtype=torch.float64), torch.randn(12, 3, dtype=torch.float64) * 3


def small_cnn() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.MaxPool2d(2),
        nn.Conv2d(3, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 2 * 2, 4),
    ).double()


class AttnBlock(nn.Module):
    """Pre-norm single-head self-attention (LayerNorm, q/k/v/out Linear on [B, T, d], softmax
    written out: CPU ``scaled_dot_product_attention`` has no double backward) and a Linear head
    over the mean token."""

    def __init__(self, d: int = 6, out: int = 3):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, out)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(q.shape[-1]), dim=-1)
        return self.head((x + self.proj(att @ v)).mean(1))


def attn_block() -> nn.Module:
    torch.manual_seed(5)
    return AttnBlock().double()


# ---- oracle ---------------------------------------------------------------------------------
def _loss(out, y, reduction):
    """The loss gradlens sees: MSELoss / CrossEntropyLoss with ``reduction``."""
    if y.dtype.is_floating_point:
        return nn.functional.mse_loss(out, y, reduction=reduction)
    return nn.functional.cross_entropy(out, y, reduction=reduction)


def oracle(model0: nn.Module, x, y, reduction: str, reverse: bool = False):
    """(H [D, D], m [D]) float64: the Hessian of the window objective over all N samples
    (``torch.func.hessian``; ``reverse``: ``jacrev(jacrev)``, for operations without forward
    AD such as CPU attention) and m_j = (1/N) sum_n g_nj^2 from ``vmap(grad)``."""
    model = copy.deepcopy(model0)
    params = {k: v.detach() for k, v in model.named_parameters()}
    names = list(params)
    shapes = [params[k].shape for k in names]
    sizes = [params[k].numel() for k in names]
    theta = torch.cat([params[k].reshape(-1) for k in names])

    def unflat(t):
        return dict(zip(names, [c.reshape(s) for c, s in zip(t.split(sizes), shapes)]))

    def objective(t):
        return _loss(functional_call(model, unflat(t), (x,)), y, reduction)

    hess = (lambda f: torch.func.jacrev(torch.func.jacrev(f))) if reverse else torch.func.hessian
    H = hess(objective)(theta)

    def one(t, xi, yi):
        return _loss(functional_call(model, unflat(t), (xi.unsqueeze(0),)), yi.unsqueeze(0), reduction)

    G = vmap(grad(one), in_dims=(None, 0, 0))(theta, x, y)  # [N, D]
    return H, G.square().mean(0)


# ---- gradlens -------------------------------------------------------------------------------
def _loss_name(y):
    """The loss module gradlens sees: MSELoss for float targets, else CrossEntropyLoss."""
    return "mse" if y.dtype.is_floating_point else "ce"


def run_window(model0, x, y, reduction, instruments, split=SPLIT, optimizer=True, windows=1):
    """Records of ``windows`` windows of the same batch split into ``split`` micro-steps (the
    update has lr 0: the parameters stay, so every window has the same Hessian; without an
    optimizer each window ends with lens.flush() and model.zero_grad())."""
    return run_windows(model0, [micro_batches(x, y, split)] * windows, instruments, loss=_loss_name(y),
                       reduction=reduction, optimizer=(lambda ps: torch.optim.SGD(ps, lr=0.0)) if optimizer else None,
                       create_graph=True, zero_grad=True).records


def _flat_index(model0):
    return sum(p.numel() for p in model0.parameters())


# ---- exactness --------------------------------------------------------------------------------
def test_tanh_mlp_hessian_is_indefinite_with_close_extremes():
    H, _ = oracle(tanh_mlp(), *tanh_data(), "mean")
    ev = torch.linalg.eigvalsh(H)
    assert ev[0] < 0 < ev[-1]
    assert 0.95 < -float(ev[0]) / float(ev[-1]) < 1.05


@pytest.mark.parametrize("split", [[12], SPLIT])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_on_tanh_mlp(reduction, split):
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, m = oracle(model0, x, y, reduction)
    ev = torch.linalg.eigvalsh(H)
    diag = torch.diagonal(H)
    insts = [HessMaxEV(tol=1e-10), HessTrace(), TICDiag(), TICTrace()]
    (rec,) = run_window(model0, x, y, reduction, insts, split=split)
    # the largest algebraic eigenvalue, not lambda_min, whose magnitude is within 5% of it
    torch.testing.assert_close(rec["hess_max_ev"], float(ev[-1]), rtol=1e-8, atol=0)
    assert rec.meta["hess_max_ev"] == "converged"
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    assert rec.meta["hess_trace"] == "exact" and "hess_trace_stderr" not in rec
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    torch.testing.assert_close(rec["tic_trace"], float(m.sum() / (diag.sum() + TIC_EPS)), rtol=RTOL, atol=0)
    assert rec.meta["tic_diag"] == "exact" and rec.meta["tic_trace"] == "exact"
    assert rec.meta["tic_diag_method"] == "second-order backpropagation"  # Linear, Tanh residuals, MSE


def _cnn_data():
    g = torch.Generator().manual_seed(11)
    return torch.randn(12, 2, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 4, (12,), generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_on_cnn(reduction):
    model0 = small_cnn()
    x, y = _cnn_data()
    H, m = oracle(model0, x, y, reduction)
    ev, diag = torch.linalg.eigvalsh(H), torch.diagonal(H)
    insts = [HessMaxEV(tol=1e-9), HessTrace(), TICDiag(), TICTrace(), SumGradSquared()]
    (rec,) = run_window(model0, x, y, reduction, insts)
    torch.testing.assert_close(rec["hess_max_ev"], float(ev[-1]), rtol=1e-7, atol=0)
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    torch.testing.assert_close(rec["tic_trace"], float(m.sum() / (diag.sum() + TIC_EPS)), rtol=RTOL, atol=0)
    # Conv2d, Tanh residuals, max pooling, ReLU, cross-entropy
    assert rec.meta["hess_trace_method"] == "second-order backpropagation"
    # the one-hot products agree
    (onehot,) = run_window(model0, x, y, reduction, [HessTrace(method="exact")], split=[12])
    torch.testing.assert_close(onehot["hess_trace"], rec["hess_trace"], rtol=RTOL, atol=1e-12)


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.1), nn.Linear(4, 2)), "training-mode Dropout"),
        (lambda: nn.Sequential(nn.Linear(3, 4), nn.GELU(), nn.Linear(4, 2)), "layer 1 is a GELU"),
        (lambda: nn.Sequential(nn.Conv2d(1, 2, 3, groups=1, padding="same")), "string padding"),
        (lambda: AttnBlock(), "not a flat nn.Sequential"),
    ],
)
def test_backprop_diagonal_says_why_it_does_not_apply(make, why):
    from gradlens.instruments.diag_hessian import DiagHessianBackprop

    model = make()
    back = DiagHessianBackprop(model, dict(model.named_parameters()))
    assert not back.supported and why in back.why_not
    shared = nn.Linear(3, 3)
    tied = nn.Sequential(shared, nn.Tanh(), shared)
    back = DiagHessianBackprop(tied, dict(tied.named_parameters()))
    assert back.why_not == "a parameter is used by several layers"


def _attn_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(12, 5, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_attention_block_exact_and_estimator_paths(reduction):
    model0 = attn_block()
    x, y = _attn_data()
    H, m = oracle(model0, x, y, reduction, reverse=True)
    ev, diag = torch.linalg.eigvalsh(H), torch.diagonal(H)
    D = H.shape[0]
    insts = [HessMaxEV(tol=1e-9, max_iter=D), HessTrace(), TICDiag(exact_max_params=D)]
    (rec,) = run_window(model0, x, y, reduction, insts)
    torch.testing.assert_close(rec["hess_max_ev"], float(ev[-1]), rtol=1e-7, atol=0)
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    # the estimator path (parameters above the exact budget): 5 standard errors from the trace
    est = [HessTrace(exact_max_params=D - 1, probes=64), TICTrace(method="hutchinson", probes=64)]
    (rec,) = run_window(model0, x, y, reduction, est)
    assert rec.meta["hess_trace"].startswith("estimated")
    assert rec.meta["tic_trace"].startswith("estimated")
    assert abs(rec["hess_trace"] - float(diag.sum())) < 5 * rec["hess_trace_stderr"]
    assert 0 < rec["hess_trace_stderr"]


def test_fused_sequence_linear_keeps_the_graph(monkeypatch):
    """A Lens with a sum of squares runs sequence Linear layers as gradlens' fused call (its own
    backward); under create_graph its weight gradient is autograd's, so the Hessian is exact."""
    from gradlens.capture import fused

    calls = []
    original = fused._FusedLinear.apply
    monkeypatch.setattr(fused._FusedLinear, "apply", lambda *a: calls.append(1) or original(*a))
    model0 = attn_block()
    x, y = _attn_data()
    H, m = oracle(model0, x, y, "mean", reverse=True)
    diag = torch.diagonal(H)
    (rec,) = run_window(model0, x, y, "mean", [HessTrace(), TICDiag(), SumGradSquared()])
    assert len(calls) == 2 * len(SPLIT)  # qkv and proj, every micro-step
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    torch.testing.assert_close(rec["sum_grad_squared"]["qkv.weight"].reshape(-1),
                               12 * m[6 + 6 : 6 + 6 + 108], rtol=1e-9, atol=1e-12)


def test_hess_max_ev_alone_light_capture_and_flush():
    """HessMaxEV alone hooks the parameters only (no per-sample capture); a window closed by
    lens.flush() (no optimizer) computes it in finalize."""
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, _ = oracle(model0, x, y, "sum")
    (rec,) = run_window(model0, x, y, "sum", [HessMaxEV(tol=1e-10)], optimizer=False)
    torch.testing.assert_close(rec["hess_max_ev"], float(torch.linalg.eigvalsh(H)[-1]), rtol=1e-8, atol=0)


def test_lanczos_reports_when_the_tolerance_was_not_reached():
    model0 = small_cnn()
    x, y = _cnn_data()
    (rec,) = run_window(model0, x, y, "mean", [HessMaxEV(tol=1e-12, max_iter=3)])
    assert rec.meta["hess_max_ev"] == "not converged"
    assert rec.meta["hess_max_ev_iterations"] == 3 and rec.meta["hess_max_ev_residual"] > 1e-12
    (rec,) = run_window(model0, x, y, "mean", [HessMaxEV(tol=0.5, max_iter=40)])
    assert rec.meta["hess_max_ev"] == "converged" and rec.meta["hess_max_ev_residual"] <= 0.5


def test_hutchinson_unbiased_with_honest_standard_error_over_200_windows():
    """200 windows of one batch (lr 0: the same Hessian), 8 probes each: the mean estimate is
    within 4 standard errors of the exact trace, and the stated standard error (its RMS over
    windows) within a factor 1.3 of the observed spread of the estimates."""
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, _ = oracle(model0, x, y, "mean")
    exact = float(torch.diagonal(H).sum())
    recs = run_window(model0, x, y, "mean", [HessTrace(method="hutchinson", probes=8, seed=1)],
                      split=[7, 5], windows=200)
    est = torch.tensor([r["hess_trace"] for r in recs], dtype=torch.float64)
    stated = torch.tensor([r["hess_trace_stderr"] for r in recs], dtype=torch.float64)
    spread = float(est.std())
    assert len(set(est.tolist())) == 200  # fresh probes every window
    assert abs(float(est.mean()) - exact) < 4 * spread / math.sqrt(200)
    ratio = float(stated.square().mean().sqrt()) / spread
    assert 1 / 1.3 < ratio < 1.3, ratio


def test_backward_without_create_graph_is_refused():
    model = gradlens.extend(tanh_mlp())
    x, y = tanh_data()
    loss_fn = gradlens.extend(nn.MSELoss())
    lens = Lens(model, [HessTrace()])
    loss = loss_fn(model(x), y)
    with pytest.raises(RuntimeError, match=r"create_graph=True; call loss.backward\(create_graph=lens.create_graph\)"):
        with lens.capture():
            loss.backward()
    model.zero_grad()
    # the window was dropped: the next micro-steps start it afresh
    (rec,) = run_windows(model, [micro_batches(x, y, SPLIT)], lens=lens, loss=loss_fn, create_graph=True,
                         fresh_copy=False, close=False).flushed
    assert rec.num_samples == 12 and rec.micro_steps == 3
    H, _ = oracle(tanh_mlp(), x, y, "mean")
    torch.testing.assert_close(rec["hess_trace"], float(torch.diagonal(H).sum()), rtol=RTOL, atol=1e-12)
    lens.close()


def test_untracked_windows_backpropagate_without_a_graph_and_graphs_are_freed():
    import gc
    import weakref

    model = gradlens.extend(tanh_mlp())
    x, y = tanh_data()
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    lens = Lens(model, [HessMaxEV(), TICTrace()], optimizer=opt, every=2)
    seen, kept = [], []
    for step in range(4):
        seen.append(lens.create_graph)
        loss = loss_fn(model(x), y)
        with lens.capture():
            loss.backward(create_graph=lens.create_graph)
        if lens._graph is not None:
            kept.append(weakref.ref(next(iter(lens._graph.grad.values()))))
        opt.step()
        opt.zero_grad()
    gc.collect()
    assert seen == [True, False, True, False]
    assert [r.step for r in lens.records] == [0, 2]
    assert len(kept) == 2 and all(ref() is None for ref in kept)  # no graph outlives its window
    lens.close()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: HessMaxEV(tol=0.0), r"HessMaxEV\(tol=...\) must be a float in \(0, 1\), got 0.0; e.g. tol=1e-3"),
        (lambda: HessMaxEV(max_iter=1), r"HessMaxEV\(max_iter=...\) must be an int >= 2, got 1"),
        (lambda: HessTrace(method="diag"), r"HessTrace\(method=...\) must be 'auto', 'exact' or 'hutchinson', got 'diag'"),
        (lambda: TICDiag(probes=1), r"TICDiag\(probes=...\) must be an int >= 2, got 1"),
        (lambda: TICTrace(seed=1.5), r"TICTrace\(seed=...\) takes an int, got 1.5"),
        (lambda: configuration("first"), r"configuration\(label=...\) must be 'economy', 'business' or 'full'"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_configurations_are_cockpits_with_gradlens_names():
    names = {label: [type(i).__name__ for i in configuration(label)] for label in ("economy", "business", "full")}
    economy = ["Alpha", "Distance", "GradHist1d", "GradNorm", "InnerTest", "NormTest", "OrthoTest", "UpdateSize"]
    assert names["economy"] == economy
    assert names["business"] == economy + ["TICDiag", "HessTrace"]
    assert names["full"] == economy + ["TICDiag", "HessTrace", "HessMaxEV", "GradHist2d"]
    a, b = configuration("full"), configuration("full")
    assert all(i is not j for i, j in zip(a, b))  # fresh instances


# ---- torch.distributed ------------------------------------------------------------------------
RANK_SPLITS = {0: [3, 2], 1: [1, 6]}  # rank 0: samples 0..4, rank 1: 5..11; K = 2 unequal each


def _dist_insts():
    return [HessMaxEV(tol=1e-10), HessTrace(), TICDiag(), TICTrace(),
            HessTrace(method="hutchinson", probes=6, seed=3)]


def _dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from test_distributed import _init

    _init(rank, world, port)
    x, y = tanh_data()
    lo = 0 if rank == 0 else 5
    mine = slice(lo, lo + sum(RANK_SPLITS[rank]))
    out = {}
    for reduction in ("mean", "sum"):
        insts = _dist_insts()
        insts[-1].key = "hess_trace_hutchinson"  # a second HessTrace under its own record key
        (rec,) = run_window(tanh_mlp(), x[mine], y[mine], reduction, insts, split=RANK_SPLITS[rank])
        out[reduction] = (dict(rec.values), dict(rec.meta), rec.num_samples)
    torch.save(out, os.path.join(out_dir, f"{rank}.pt"))
    import torch.distributed as dist

    dist.destroy_process_group()


def test_two_gloo_ranks_equal_one_batch():
    """2 ranks x 2 unequal micro-steps each (5 + 7 samples) == one batch of 12, mean and sum:
    exact values against the oracle, the Hutchinson estimate equal to one process's (the
    same private probes on every rank)."""
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_dist_worker, 2, out_dir)
        got = [torch.load(os.path.join(out_dir, f"{r}.pt")) for r in range(2)]
    model0 = tanh_mlp()
    x, y = tanh_data()
    for reduction in ("mean", "sum"):
        H, m = oracle(model0, x, y, reduction)
        diag = torch.diagonal(H)
        single = _dist_insts()
        single[-1].key = "hess_trace_hutchinson"
        (one,) = run_window(model0, x, y, reduction, single, split=[12])
        for rank_out in got:
            values, meta, n = rank_out[reduction]
            assert n == 12
            torch.testing.assert_close(values["hess_max_ev"], float(torch.linalg.eigvalsh(H)[-1]), rtol=1e-8, atol=0)
            torch.testing.assert_close(values["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
            torch.testing.assert_close(values["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
            torch.testing.assert_close(values["tic_trace"], float(m.sum() / (diag.sum() + TIC_EPS)), rtol=RTOL, atol=0)
            # the same probes on every rank and in one process: the estimate of one batch of 12
            torch.testing.assert_close(values["hess_trace_hutchinson"], one["hess_trace_hutchinson"],
                                       rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(values["hess_trace_hutchinson_stderr"], one["hess_trace_hutchinson_stderr"],
                                       rtol=1e-10, atol=1e-12)
            assert meta["hess_trace"] == "exact" and meta["hess_trace_hutchinson"].startswith("estimated")
            assert "hess_trace_stderr" not in values


def test_state_dict_between_windows_resumes_and_mid_window_is_refused():
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, _ = oracle(model0, x, y, "mean")
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    lens = Lens(model, [HessTrace(), HessMaxEV(tol=1e-10)], optimizer=opt)
    saved = lens.state_dict()  # between windows (the first one open, nothing captured)
    loss = loss_fn(model(x[:5]), y[:5])
    with lens.capture():
        loss.backward(create_graph=lens.create_graph)
    with pytest.raises(RuntimeError, match=r"autograd graphs cannot be saved; call it between windows"):
        lens.state_dict()
    lens.close()
    opt.zero_grad()
    fresh = run_windows(model, [micro_batches(x, y, SPLIT)], lens=Lens(model, [HessTrace(), HessMaxEV(tol=1e-10)], optimizer=opt),
                        state=saved, optimizer=opt, loss=loss_fn, create_graph=True, fresh_copy=False, close=False).lens
    (rec,) = fresh.records
    torch.testing.assert_close(rec["hess_trace"], float(torch.diagonal(H).sum()), rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(rec["hess_max_ev"], float(torch.linalg.eigvalsh(H)[-1]), rtol=1e-8, atol=0)
    fresh.close()


@pytest.mark.parametrize("name", ["tanh_mlp", "attn_block"])
def test_one_exact_diagonal_per_window_for_all_instruments(name):
    """HessTrace + TICDiag + TICTrace share one diagonal per window: by second-order
    backpropagation on the Sequential tanh MLP (no Hessian-vector product at all), by D one-hot
    products on the attention block (not a Sequential: D products, not 3D)."""
    model = gradlens.extend(tanh_mlp() if name == "tanh_mlp" else attn_block())
    x, y = tanh_data() if name == "tanh_mlp" else _attn_data()
    graphs = []  # the window's graph, before the update
    lens = run_windows(model, [[(x, y)]], [HessTrace(chunk=16), TICDiag(), TICTrace()], loss=_loss_name(y),
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), create_graph=True, fresh_copy=False,
                       on_micro=lambda run, w, k, loss: graphs.append(run.lens._graph), close=False).lens
    (graph,) = graphs
    D = sum(p.numel() for p in model.parameters())
    rec = lens.records[-1]
    if name == "tanh_mlp":
        assert graph.products == 0
        assert rec.meta["hess_trace_method"] == rec.meta["tic_diag_method"] == "second-order backpropagation"
    else:
        assert graph.products == D
        assert rec.meta["tic_trace_method"] == "one-hot Hessian-vector products"
    assert lens._graph is not graph and not graph.grad
    lens.close()


def test_with_gradient_accumulate_optimizer():
    """gradlens' accumulating optimizer (its step on every micro-step, a real update every 3rd):
    the products run before the real update, on the window of all 3 micro-steps."""
    from gradlens import GradientAccumulateOptimizer

    model0 = tanh_mlp()
    x, y = tanh_data()
    H, m = oracle(model0, x, y, "mean")
    diag = torch.diagonal(H)
    lens = run_windows(model0, [micro_batches(x, y, SPLIT)], [HessTrace(), HessMaxEV(tol=1e-10), TICDiag()], loss="mse",
                       optimizer=lambda ps: GradientAccumulateOptimizer(torch.optim.SGD(ps, lr=0.1), accum_steps=len(SPLIT)),
                       create_graph=True, close=False).lens
    (rec,) = lens.records
    torch.testing.assert_close(rec["hess_trace"], float(diag.sum()), rtol=RTOL, atol=1e-12)
    torch.testing.assert_close(rec["hess_max_ev"], float(torch.linalg.eigvalsh(H)[-1]), rtol=1e-8, atol=0)
    torch.testing.assert_close(rec["tic_diag"], float((m / (diag + TIC_EPS)).sum()), rtol=RTOL, atol=0)
    lens.close()


def test_hutchinson_diagonal_is_unbiased_and_tic_diag_says_estimated():
    """The diagonal estimate mean_i v_i * H v_i (TICDiag's path above the exact budget): every
    coordinate within 5 standard errors, sqrt(sum_{k != j} H_jk^2 / probes), of H_jj."""
    model0 = tanh_mlp()
    x, y = tanh_data()
    H, m = oracle(model0, x, y, "mean")
    run = run_windows(model0, [micro_batches(x, y, SPLIT)], [TICDiag(method="hutchinson", probes=16)], loss="mse",
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.0), create_graph=True, end="none", close=False)
    lens = run.lens
    probes = 4000
    quad, diag = lens._graph.hutchinson(probes, 500, seed=7)  # before the window's update
    run.optimizer.step()
    rec = lens.records[-1]
    assert rec.meta["tic_diag"].startswith("estimated: Hutchinson diagonal, 16 Rademacher probes")
    assert math.isfinite(rec["tic_diag"])
    off = H - torch.diag(torch.diagonal(H))
    se = (off.square().sum(1) / probes).sqrt()
    assert ((diag - torch.diagonal(H)).abs() < 5 * se + 1e-12).all()
    assert quad.shape == (probes,)
    lens.close()


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_tracked_micro_steps_make_no_host_read(model):
    """tests/test_sync.py's probe on the curvature instruments' hot path (the parameter hooks
    and the fold of each micro-step's graph gradient); the window's end may read."""
    from gradlens.core.sync import forced_device_paths
    from test_sync import MODELS as SYNC_MODELS, HostReads

    make, data = SYNC_MODELS[model]
    torch.manual_seed(0)
    net = gradlens.extend(make())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    with forced_device_paths(), HostReads() as reads:
        lens = Lens(net, [HessMaxEV(max_iter=4), HessTrace(), TICDiag(), TICTrace(), SumGradSquared()], optimizer=opt)
        for _ in range(2):
            for b in (3, 5):
                x, y = data(b), torch.randint(0, 11, (b,))
                reads.active = True
                loss = loss_fn(net(x), y)
                with lens.capture():
                    loss.backward(create_graph=lens.create_graph)
                reads.active = False
            opt.step()
            opt.zero_grad()
    assert not reads.calls, ", ".join(f"{k} x{v}" for k, v in reads.calls.items())
    assert len(lens.records) == 2 and all(math.isfinite(r["hess_trace"]) for r in lens.records)
    lens.close()


def test_full_configuration_runs_and_create_graph_leaves_the_other_instruments_unchanged():
    """cockpit's "full" set on the small CNN (two windows, 3 unequal micro-steps, per-sample
    losses for Alpha): the first-order instruments under create_graph=True give the records
    that cockpit's "economy" set gives with a plain backward (histograms, norms, tests, Alpha), beside exact curvature."""
    model0 = small_cnn()
    x, y = _cnn_data()
    H, _ = oracle(model0, x, y, "mean")

    def run(label, create_graph):
        torch.manual_seed(0)
        return run_windows(model0, [micro_batches(x, y, SPLIT)] * 2, configuration(label) + [SumGradSquared()],
                           optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05), losses=True,
                           create_graph=create_graph).records

    full, plain = run("full", True), run("economy", False)
    assert len(full) == len(plain) == 2 and isinstance(full[0]["alpha"], float)
    torch.testing.assert_close(full[0]["hess_trace"], float(torch.diagonal(H).sum()), rtol=RTOL, atol=1e-12)
    for a, b in zip(full, plain):
        for key in ("grad_norm", "norm_test", "inner_test", "ortho_test", "alpha", "loss"):
            torch.testing.assert_close(a[key], b[key], rtol=1e-10, atol=1e-12)
        assert a["grad_hist_1d"] == b["grad_hist_1d"]
        for q, v in b["sum_grad_squared"].items():
            torch.testing.assert_close(a["sum_grad_squared"][q], v, rtol=1e-12, atol=0)
        assert a["grad_hist_2d"].counts.sum() == b["grad_hist_1d"].counts.sum()
        assert a.meta["hess_max_ev"] == "converged" and "tic_diag" in a
