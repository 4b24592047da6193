"""The one test oracle: independent float64 references and the shared case tables.

The oracle never runs gradlens code: it builds per-sample gradients with
``vmap(grad(loss of one sample))`` on a deep copy of the model taken before ``gradlens.extend``,
and derives every statistic from the full ``[N, D]`` matrix of flattened per-sample gradients.

- instruments: :data:`N`, :data:`SPLITS`, :data:`MODELS`, :func:`make_problem`,
  :func:`per_sample_grads`, :func:`flat`, :func:`bins_oracle`, :func:`hist_oracle`,
  :func:`window_oracle` (the cross-micro-step values), :func:`two_batch`, :func:`trace_sigma`,
  :func:`early_stopping`, :func:`near_edges`;
- framework integrations (per-sample gradients at a snapshotted state, any loss):
  :func:`per_sample`, :func:`norm_set`, :func:`hist_counts`, :func:`alpha`, :func:`close`;
- the training side (accumulation, AGC, BatchNorm, DDP): :func:`make_mlp`, :func:`make_data`,
  :data:`OPTIMIZERS`, :data:`ACCUM_SPLITS` (windows of micro-batch sizes), :func:`rel_err`,
  :func:`assert_params_close`, :func:`inner_step_count`.
(Model zoo oracles with their own losses: tests/oracle_models.py.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

N = 12
SPLITS = {"K1": [12], "K2-equal": [6, 6], "K3-unequal": [5, 1, 6]}


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Flatten(), nn.Linear(12, 9), nn.ReLU(), nn.Linear(9, 7), nn.ReLU(), nn.Linear(7, 4)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(3, 4, 3, stride=1),
        nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(4, 4),
    )


def mlp_bn_eval() -> nn.Module:
    """An MLP with an eval-mode BatchNorm1d (per-sample gradients defined)."""
    m = nn.Sequential(nn.Linear(12, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        m[1].running_mean.uniform_(-0.5, 0.5)
        m[1].running_var.uniform_(0.5, 2.0)
        m[1].weight.uniform_(0.5, 1.5)
        m[1].bias.uniform_(-0.2, 0.2)
    return m.eval()


class SeqModel(nn.Module):
    """Embedding -> Linear on [B, T, d] (a sequence axis) -> mean over T -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 5)
        self.proj = nn.Linear(5, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, tokens):
        return self.head(torch.tanh(self.proj(self.emb(tokens))).mean(1))


def conv1d_net() -> nn.Module:
    """Conv1d (BackPACK's derivatives) and a ConvTranspose1d, then a Linear head."""
    return nn.Sequential(
        nn.Conv1d(2, 3, 3, padding=1),
        nn.ReLU(),
        nn.ConvTranspose1d(3, 2, 2, stride=2),
        nn.Flatten(),
        nn.Linear(2 * 12, 4),
    )


def cnn_strided() -> nn.Module:
    """Strided Conv2d (gradlens' unfold kernel) and a grouped, dilated one (BackPACK's)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=2, dilation=2, groups=2, bias=False),
        nn.Flatten(),
        nn.Linear(4 * 4 * 4, 4),
    )


@dataclass
class Case:
    name: str
    make: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    tokens: int = 0  # > 0: integer inputs in [0, tokens)


MODELS = {
    "mlp": Case("mlp", mlp, (12,)),
    "cnn": Case("cnn", cnn, (2, 8, 8)),
    "mlp_bn_eval": Case("mlp_bn_eval", mlp_bn_eval, (12,)),
    "seq": Case("seq", SeqModel, (7,), tokens=10),
    "conv1d": Case("conv1d", conv1d_net, (2, 6)),
    "cnn_strided": Case("cnn_strided", cnn_strided, (2, 8, 8)),
}


def make_problem(case: Case, seed: int = 0):
    """(model float64, x [N, *input], y [N]) with fixed seeds."""
    torch.manual_seed(seed)
    model = case.make().double()
    if case.tokens:
        x = torch.randint(0, case.tokens, (N, *case.input_shape))
    else:
        x = torch.randn(N, *case.input_shape, dtype=torch.float64)
    y = torch.randint(0, 4, (N,))
    return model, x, y


def per_sample_grads(model: nn.Module, x, y) -> dict[str, torch.Tensor]:
    """name -> [N, *param] float64 gradients of each sample's own cross-entropy loss."""
    model = copy.deepcopy(model)
    for m in model.modules():  # a copy taken while a Lens watches carries its hooks: drop them
        m._forward_hooks.clear()
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.detach() for k, v in model.named_buffers()}

    def loss_one(p, xi, yi):
        out = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    return vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)


def flat(gs: dict[str, torch.Tensor]) -> torch.Tensor:
    """[N, D] per-sample gradients over all parameters."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in gs.values()], dim=1)


def bins_oracle(values: torch.Tensor, lo: float, hi: float, bins: int) -> torch.Tensor:
    """int64 bin of each value by the documented rule, from the float64 edges
    ``lo + (hi - lo) * k / bins`` (an edge at 0 exactly 0): the number of inner edges <= v,
    i.e. values below ``lo`` in bin 0, at or above ``hi`` (and NaN) in the last bin."""
    k = torch.arange(1, bins, dtype=torch.float64)
    inner = lo + (hi - lo) * k / bins
    inner[(inner.abs() < 1e-12 * (hi - lo))] = 0.0
    v = values.double().flatten()
    idx = torch.searchsorted(inner, v.nan_to_num(nan=float("inf")), right=True)
    return idx.reshape(values.shape)


def hist_oracle(values: torch.Tensor, lo: float, hi: float, bins: int):
    """(counts, clamped_low, clamped_high) by the documented rule, float64."""
    v = values.double().flatten()
    counts = torch.bincount(bins_oracle(v, lo, hi, bins), minlength=bins)
    return counts, int((v < lo).sum()), int((v > hi).sum() + v.isnan().sum())


# ---------------------------------------------------------------- framework integrations
# per-sample gradients at each window's starting parameters (snapshotted by the test, never by
# gradlens), and the statistics derived from them


def per_sample(model: nn.Module, state: dict, loss_one: Callable, *data) -> dict[str, torch.Tensor]:
    """name -> [N, *param] float64 per-sample gradients of ``loss_one(out_of_one_sample, *targets)``
    at parameters ``state`` (a state_dict)."""
    m = copy.deepcopy(model).double()
    m.load_state_dict(state)
    for mod in m.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    params = {k: v.detach().double() for k, v in m.named_parameters()}
    buffers = {k: v.detach() for k, v in m.named_buffers()}

    def one(p, x, *t):
        out = functional_call(m, (p, buffers), (x.unsqueeze(0),))
        return loss_one(out, *(ti.unsqueeze(0) for ti in t))

    in_dims = (None,) + (0,) * len(data)
    return vmap(grad(one), in_dims=in_dims)(params, *data)


def norm_set(gs: dict[str, torch.Tensor], prefix: str = "") -> dict:
    """batch_l2 [N], sum_grad_squared {name: [*param]}, grad_norm of the mean gradient."""
    G = flat(gs)
    return {
        "batch_l2": G.square().sum(1),
        "sum_grad_squared": {prefix + k: g.square().sum(0) for k, g in gs.items()},
        "grad_norm": G.mean(0).norm(),
    }


def hist_counts(gs: dict[str, torch.Tensor], lo: float, hi: float, bins: int):
    return hist_oracle(flat(gs), lo, hi, bins)


def alpha(sq, f, df, var_f, var_df) -> float:
    """Alpha from the weighted least-squares quadratic along s in [0, 1] (theta_t + s d),
    solved with numpy lstsq on sqrt-weighted rows (independent of gradlens' parametrisation);
    ``sq`` (|d|^2) is not used: the quadratic is in s."""
    phi = np.array([[1, 0, 0], [1, 1, 1], [0, 1, 0], [0, 1, 2]], dtype=np.float64)
    y = np.array([float(v) for v in (*f, *df)], dtype=np.float64)
    sw = 1 / np.sqrt(np.array([float(v) for v in (*var_f, *var_df)], dtype=np.float64))
    mu = np.linalg.lstsq(phi * sw[:, None], y * sw, rcond=None)[0]
    if mu[2] <= 0:
        return -1.0
    return 1.0 / (-mu[1] / (2 * mu[2])) - 1.0


def window_oracle(thetas: list[nn.Module], windows, t: int) -> dict:
    """The cross-micro-step values of window t (BatchDot, InnerTest, OrthoTest, the
    search-direction projections, Alpha) from the per-sample gradients at ``thetas[t]`` and
    ``thetas[t + 1]`` (the end point: window t + 1's data at theta_{t+1});
    ``windows[t] = (x, y)``, the cross-entropy of :func:`per_sample_grads`."""
    (x0, y0), (x1, y1) = windows[t], windows[t + 1]
    G0 = flat(per_sample_grads(thetas[t], x0, y0))
    G1 = flat(per_sample_grads(thetas[t + 1], x1, y1))
    n = G0.shape[0]
    d = torch.cat([
        (b.detach() - a.detach()).flatten()
        for a, b in zip(thetas[t].parameters(), thetas[t + 1].parameters())
    ])
    mean = G0.mean(0)
    g2 = mean.square().sum()
    p = G0 @ mean
    orth = G0 - (p / g2)[:, None] * mean[None, :]
    with torch.no_grad():
        l0 = nn.functional.cross_entropy(thetas[t](x0), y0, reduction="none")
        l1 = nn.functional.cross_entropy(thetas[t + 1](x1), y1, reduction="none")
    sq = d.dot(d)
    ps, pe = G0 @ d, G1 @ d
    return {
        "batch_dot": G0 @ G0.T,
        "inner_test": (p.var() / n).sqrt() / g2,
        "ortho_test": (orth.square().sum() / (n - 1) / (n * g2)).sqrt(),
        "start": ps / sq,
        "end": pe / sq,
        "update_sq_norm": sq,
        "alpha": alpha(
            sq, (l0.mean(), l1.mean()), (ps.mean(), pe.mean()),
            (l0.var() / len(l0), l1.var() / len(l1)), (ps.var() / n, pe.var() / len(pe)),
        ),
    }


def two_batch(G: Tensor, sizes: list[int]) -> tuple[float, float]:
    """NoiseScaleTwoBatch's |G|^2 and tr(Sigma) estimates from the per-sample gradients
    ``G [N, D]`` of micro-batches of ``sizes`` samples (in order)."""
    s = [blk.sum(0) for blk in G.split(sizes)]
    S = sum(float(v.dot(v)) for v in s)
    Q = float(sum(b * b for b in sizes))
    tot = G.sum(0)
    T = float(tot.dot(tot))
    N = float(G.shape[0])
    return (T - S) / (N * N - Q), (N * N * S - Q * T) / (N * (N * N - Q))


def trace_sigma(G: Tensor) -> float:
    """tr of the unbiased covariance of the per-sample gradients ``G [N, D]`` (CABS' numerator)."""
    n = G.shape[0]
    return float(((G - G.mean(0)) ** 2).sum() / (n - 1))


def early_stopping(G: Tensor) -> float:
    """EarlyStopping's criterion ``1 - N mean_j(G_j^2 / var_j)`` over the coordinates whose
    variance is above ``1e-13`` of the largest."""
    n = G.shape[0]
    mean, var = G.mean(0), G.var(0, unbiased=True)
    ok = var > 1e-13 * var.max()
    return 1.0 - n * float((mean[ok] ** 2 / var[ok]).mean())


def near_edges(values: Tensor, lo: float, hi: float, bins: int, rtol: float) -> int:
    """How many of ``values`` lie within reach of a bin edge of ``bins`` bins over ``(lo, hi)``
    at relative precision rtol (those a histogram computed at that precision may bin either
    way; 0 at float64 rounding)."""
    pos = (values.flatten() - lo) * bins / (hi - lo)
    reach = 10 * rtol * (values.flatten().abs() * bins / (hi - lo) + 1)
    return int(((pos - pos.round()).abs() <= reach).sum())


def close(a, b, rtol=1e-9, atol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
        rtol=rtol, atol=atol,
    )


# ---------------------------------------------------------------- the training side


D_IN, D_HIDDEN, D_OUT = 5, 7, 3


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """A tiny MLP ``[B, 5] -> [B, 3]``, deterministic for a seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, D_OUT)).to(dtype)


def make_data(n: int, seed: int = 1, dtype: torch.dtype = torch.float64) -> tuple[Tensor, Tensor]:
    """Regression data ``x [n, 5]``, ``y [n, 3]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=g, dtype=dtype)
    y = torch.randn(n, D_OUT, generator=g, dtype=dtype)
    return x, y


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    "sgd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


@dataclass(frozen=True)
class SplitCase:
    """Micro-batch sizes per window; a last window shorter than ``accum_steps`` is flushed."""

    name: str
    accum_steps: int
    windows: tuple[tuple[int, ...], ...]


ACCUM_SPLITS = [
    SplitCase("k1", 1, ((6,), (4,), (5,))),
    SplitCase("equal_k2", 2, ((3, 3), (3, 3), (3, 3))),
    SplitCase("equal_k4", 4, ((2, 2, 2, 2), (2, 2, 2, 2))),
    SplitCase("unequal_k3", 3, ((1, 4, 2), (5, 1, 3), (2, 2, 6))),
    SplitCase("partial_last", 4, ((3, 1, 2, 5), (2, 2, 2, 2), (4, 1))),
]


def inner_step_count(opt: torch.optim.Optimizer) -> int | None:
    """The inner optimizer's per-parameter step counter (None for plain SGD, which has none)."""
    for state in opt.state.values():
        if "step" in state:
            return int(state["step"])
    return None


def rel_err(a: Tensor, b: Tensor) -> float:
    """``||a - b|| / ||b||`` in float64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def assert_params_close(m1: nn.Module, m2: nn.Module, tol: float) -> None:
    for (name, p), q in zip(m1.named_parameters(), m2.parameters()):
        err = rel_err(p, q)
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.1e}"


def per_sample_loop(model: nn.Module, state: dict, loss_n: Callable, n: int) -> dict[str, torch.Tensor]:
    """name -> [n, *param] float64 per-sample gradients by a plain loop: ``loss_n(m, i)`` is
    sample i's own loss on ``m``, a float64 copy of ``model`` at parameters ``state`` (for
    models with several inputs, e.g. a Hugging Face model called with keywords)."""
    m = copy.deepcopy(model).double()
    m.load_state_dict(state)
    for mod in m.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    params = {k: p for k, p in m.named_parameters() if p.requires_grad}  # (a frozen one: no gradient)
    rows = []
    for i in range(n):
        gs = torch.autograd.grad(loss_n(m, i), list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params.values(), gs)])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def hist_matches(h, values, lo, hi, bins, eps=1e-12):
    """Asserts that the counts of Hist1d ``h`` == the oracle's of ``values`` (the documented
    rule on ``bins`` bins over ``(lo, hi)``), except that a value within eps of a bin edge (per-sample
    gradients that are zero in exact arithmetic, 0 or +-1e-17 after rounding, on the edge at 0)
    may fall on either side of it: those are counted apart and must fill only the two bins that
    meet at their edge; every other bin is exact."""
    u = (values.double() - lo) * bins / (hi - lo)  # the binning rule's coordinate: edges at integers
    edge = u.round()
    gap = (u - edge).abs() * (hi - lo) / bins
    inside = (edge > 0) & (edge < bins)
    near = inside & (gap < eps)  # exact zeros too: the model's rounding may give them a sign
    far, low, high = hist_oracle(values[~near], lo, hi, bins)
    assert (h.clamped_low, h.clamped_high) == (low, high)
    extra = h.counts - far
    assert (extra >= 0).all() and int(extra.sum()) == int(near.sum())
    at = edge[near].long()  # the bin right of the edge
    allowed = torch.zeros(bins, dtype=torch.bool)
    allowed[at] = True
    allowed[at - 1] = True
    assert not extra[~allowed].any()
    assert int(near.sum()) < 0.5 * values.numel()  # most values are binned exactly (the near ones:
    # e.g. rows of an embedding that a sample does not use, padded positions)


def batchnorm_copies(model: nn.Module) -> dict[str, nn.Module]:
    """Deep copies of every BatchNorm layer of ``model`` (by qualified name): the oracle of
    :func:`batchnorm_window` holds its running statistics there. Take them before conversion."""
    return {n: copy.deepcopy(m) for n, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def batchnorm_window(plain: nn.Module, copies: dict[str, nn.Module], parts) -> list[Tensor]:
    """The running statistics a window of micro-batches ``parts`` should leave: each BatchNorm
    of ``plain`` (an unconverted training-mode copy, normalising each micro-batch with its own
    statistics) records its inputs over the window, and its copy in ``copies`` runs once, in
    training mode, on their concatenation (nn.BatchNorm's own update, momentum applied once).
    Returns ``plain``'s outputs of the micro-batches."""
    seen: dict[str, list[Tensor]] = {n: [] for n in copies}
    mods = dict(plain.named_modules())
    hooks = [mods[n].register_forward_pre_hook(lambda mod, args, n=n: seen[n].append(args[0].detach()))
             for n in copies]
    try:
        outs = [plain(p) for p in parts]
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for n, ref in copies.items():
            ref.train()
            ref(torch.cat(seen[n]))
    return outs
