"""Distance, UpdateSize, CABS and EarlyStopping under torch.distributed (2 gloo ranks, unequal
per-rank batches, K unequal micro-steps): every rank's record equals the formulas on the float64
oracle's per-sample gradients of all N samples and on the parameters DDP produced."""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import CABS, Distance, EarlyStopping, UpdateSize
from oracle import MODELS, early_stopping, flat, make_problem, per_sample_grads, trace_sigma
from test_distributed import _init, _spawn

SIZES = [5, 7]  # per rank; N = 12
LR = 0.3


def _windows():
    model, x0, y0 = make_problem(MODELS["mlp"], seed=0)
    _, x1, y1 = make_problem(MODELS["mlp"], seed=1)
    return model, [(x0, y0), (x1, y1)]


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        model0, windows = _windows()
        lo = sum(SIZES[:rank])
        mine = slice(lo, lo + SIZES[rank])
        model = gradlens.extend(copy.deepcopy(model0))
        ddp = nn.parallel.DistributedDataParallel(model)
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        lens = Lens(model, [Distance(), UpdateSize(), CABS(), EarlyStopping()], optimizer=opt)
        thetas = [copy.deepcopy(model.state_dict())]
        for x, y in windows:
            micro = list(zip(torch.tensor_split(x[mine], 2), torch.tensor_split(y[mine], 2)))
            for k, (xb, yb) in enumerate(micro):
                with ddp.no_sync() if k == 0 else contextlib.nullcontext():
                    loss = loss_fn(ddp(xb), yb)
                    with lens.capture():
                        loss.backward()
            opt.step()
            opt.zero_grad()
            thetas.append(copy.deepcopy(model.state_dict()))
        lens.close()
        records = [dict(r.values) for r in lens.records]
        torch.save({"records": records, "thetas": thetas}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _flat(state) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in state.values()])


def test_two_ranks_equal_the_oracle_of_all_samples():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, 2, out_dir)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    model0, windows = _windows()
    for res in results:
        thetas = [_flat(s) for s in res["thetas"]]
        assert len(res["records"]) == 2
        for t, (vals, (x, y)) in enumerate(zip(res["records"], windows)):
            model = copy.deepcopy(model0)
            model.load_state_dict(res["thetas"][t])
            G = flat(per_sample_grads(model, x, y))
            with torch.no_grad():
                loss = nn.functional.cross_entropy(model(x), y).item()
            assert vals["distance"] == pytest.approx(float((thetas[t] - thetas[0]).norm()), rel=1e-9, abs=1e-14)
            assert vals["update_size"] == pytest.approx(float((thetas[t + 1] - thetas[t]).norm()), rel=1e-9)
            assert vals["cabs"] == pytest.approx(LR * trace_sigma(G) / loss, rel=1e-8)
            assert vals["early_stopping"] == pytest.approx(early_stopping(G), rel=1e-8)
    assert results[0]["records"][1]["distance"] > 0
