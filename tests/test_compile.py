"""torch.compile (issue 12): untracked windows cause no graph break; tracked windows say once
what they cost."""

from __future__ import annotations

import warnings

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def test_untracked_windows_compile_without_graph_breaks_tracked_warn_once():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
    compiled = torch.compile(model, backend="eager")
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(compiled, [BatchL2(), GradNorm()], optimizer=opt, every=2)  # windows 0, 2 tracked
    assert lens.model is model
    x, y = torch.randn(6, 4), torch.randn(6, 3)
    seen = []
    for window in range(4):
        before = _breaks()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = loss_fn(compiled(x), y)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append([str(c.message) for c in caught if "torch.compile" in str(c.message)])
        if window == 0:
            assert _breaks() > before  # a tracked window's output hooks do break the graph
        if window % 2 == 1:
            assert _breaks() == before, f"untracked window {window} broke the graph"
    assert len(seen[0]) == 1 and "graph break" in seen[0][0] and seen[1:] == [[], [], []]
    assert [r.step for r in lens.records] == [0, 2]
    lens.close()
    torch._dynamo.reset()
    assert lens.records[1]["grad_norm"] > 0
