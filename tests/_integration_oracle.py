"""Float64 oracle for the framework integration tests: per-sample gradients with
``torch.func.vmap(grad(...))`` on a copy of the model at each window's starting parameters
(snapshotted by the test, never by gradlens), and the statistics derived from them."""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from oracle import hist_oracle


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


def flat(gs: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.flatten(1) for g in gs.values()], dim=1)


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
    """Alpha from the weighted least-squares quadratic along s in [0, 1] (theta_t + s d)
    (numpy lstsq, as tests/test_dots.py's oracle)."""
    phi = np.array([[1, 0, 0], [1, 1, 1], [0, 1, 0], [0, 1, 2]], dtype=np.float64)
    y = np.array([float(v) for v in (*f, *df)], dtype=np.float64)
    sw = 1 / np.sqrt(np.array([float(v) for v in (*var_f, *var_df)], dtype=np.float64))
    mu = np.linalg.lstsq(phi * sw[:, None], y * sw, rcond=None)[0]
    if mu[2] <= 0:
        return -1.0
    return 1.0 / (-mu[1] / (2 * mu[2])) - 1.0


def close(a, b, rtol=1e-9, atol=1e-12):
    torch.testing.assert_close(
        torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
        rtol=rtol, atol=atol,
    )


def per_sample_loop(model: nn.Module, state: dict, loss_n: Callable, n: int) -> dict[str, torch.Tensor]:
    """name -> [n, *param] float64 per-sample gradients by a plain loop: ``loss_n(m, i)`` is
    sample i's own loss on ``m``, a float64 copy of ``model`` at parameters ``state`` (for
    models with several inputs, e.g. a Hugging Face model called with keywords)."""
    m = copy.deepcopy(model).double()
    m.load_state_dict(state)
    for mod in m.modules():
        mod._forward_hooks.clear()
        mod._forward_pre_hooks.clear()
    params = dict(m.named_parameters())
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
