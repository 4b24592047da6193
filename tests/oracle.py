"""Independent float64 references: per-sample gradients from ``torch.func`` and the case table.

The oracle never runs gradlens code: it builds per-sample gradients with
``vmap(grad(loss of one sample))`` on a deep copy of the model taken before ``gradlens.extend``,
and derives every statistic from the full ``[N, D]`` matrix of flattened per-sample gradients.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
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
    return torch.cat([g.flatten(1) for g in gs.values()], dim=1)


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
