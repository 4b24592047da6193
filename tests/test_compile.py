"""torch.compile (issues 12, 21): untracked windows cause no graph break; tracked windows run
the model eagerly (no graph break either), say once what they cost, and give the eager records."""

from __future__ import annotations

import copy
import warnings

import pytest

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm
from windows import micro_batches, run_windows


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
        assert _breaks() == before, f"window {window} broke the graph"  # tracked ones run eagerly
    assert len(seen[0]) == 1 and "no graph break" in seen[0][0] and "eagerly" in seen[0][0]
    assert seen[1:] == [[], [], []]
    assert [r.step for r in lens.records] == [0, 2]
    lens.close()
    torch._dynamo.reset()
    assert lens.records[1]["grad_norm"] > 0


def test_compiled_tracked_windows_equal_the_eager_records_and_keep_the_stance():
    """A compiled CNN and the same CNN eager, K = 3 unequal micro-steps: equal records; the
    compiler's stance is back to default after each tracked window; untracked windows run the
    compiled graph. (Its Conv2d pads "same", which has no probed form: the eager route, whose
    stance this checks; tests/test_compiled_route.py has the compiled route.)"""
    from torch._dynamo.utils import counters

    from gradlens import compat

    torch._dynamo.reset()
    torch.manual_seed(0)

    def cnn():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(2, 3, 3, padding="same"), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 16, 4)).double()

    x, y = torch.randn(8, 2, 4, 4, dtype=torch.float64), torch.randint(0, 4, (8,))
    recs = []
    for compile_it in (False, True):
        model = gradlens.extend(cnn())
        run = torch.compile(model, backend="eager") if compile_it else model
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        def window_open(_run, w, k, loss):
            if k == 2:  # tracked windows (0, 2) of the compiled model run eagerly while open; untracked
                # ones stay compiled; an eager model's Lens leaves the stance alone
                assert compat.compile_stance() == ("force_eager" if compile_it and w != 1 else "default")

        def next_open(_run, w):  # the next window (1, 2, 3) is open: tracked when even
            assert compat.compile_stance() == ("force_eager" if compile_it and w % 2 == 1 else "default")

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lens = run_windows(run, [micro_batches(x, y, [3, 1, 4])] * 3, lens=Lens(run, [BatchL2(), GradNorm()], optimizer=opt, every=2),
                               loss=loss_fn, optimizer=opt, fresh_copy=False, on_micro=window_open, on_window=next_open).lens
        assert compat.compile_stance() == "default"
        recs.append(list(lens.records))
    assert [r.step for r in recs[1]] == [0, 2] == [r.step for r in recs[0]]
    for eager, compiled in zip(*recs):
        torch.testing.assert_close(compiled["batch_l2"], eager["batch_l2"], rtol=1e-12, atol=0)
        assert compiled["grad_norm"] == pytest.approx(eager["grad_norm"], rel=1e-12)
    assert counters["stats"]["unique_graphs"] >= 1  # the untracked window ran compiled
    torch._dynamo.reset()


def test_a_model_compiled_in_place_runs_its_tracked_windows_eagerly():
    """model.compile() (the Lens gets the module itself): tracked windows set the eager stance,
    add no graph break, and the records equal those of an eager copy."""
    from gradlens import compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = gradlens.extend(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    model = copy.deepcopy(eager)
    model.compile(backend="eager")
    x, y = torch.randn(7, 4, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    loss_fn = gradlens.extend(nn.MSELoss())
    recs = []
    for m in (eager, model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lens = Lens(m, [BatchL2(), GradNorm()])
            before = _breaks()
            run_windows(m, [micro_batches(x, y, [2, 5])], lens=lens, loss=loss_fn, fresh_copy=False, end="none",
                        close=False)
            assert compat.compile_stance() == ("force_eager" if m is model else "default")
            assert _breaks() == before
            recs.append(lens.flush())
            lens.close()
        assert compat.compile_stance() == "default"
    torch.testing.assert_close(recs[1]["batch_l2"], recs[0]["batch_l2"], rtol=1e-12, atol=0)
    assert recs[1]["grad_norm"] == pytest.approx(recs[0]["grad_norm"], rel=1e-12)
    torch._dynamo.reset()


def test_a_lens_on_the_plain_module_of_a_compiled_forward_says_so_then_runs_eagerly():
    """Lens(model) while torch.compile(model) runs the forward: the first tracked window is
    traced (its hooks break the graph) and the warning names the fix; the next tracked windows
    run eagerly (no graph break) with the records of an eager copy."""
    from gradlens import compat

    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = gradlens.extend(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double())
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="eager")
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    loss_fn = gradlens.extend(nn.MSELoss())
    out = {}
    for name, m, run in (("eager", eager, eager), ("compiled", model, compiled)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        lens = Lens(m, [BatchL2(), GradNorm()], optimizer=opt)
        caught_all, breaks = [], []
        for _window in range(3):
            before = _breaks()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = loss_fn(run(x), y)
                with lens.capture():
                    loss.backward()
            breaks.append(_breaks() - before)
            caught_all.append([str(c.message) for c in caught if "torch.compile" in str(c.message)])
            opt.step()
            opt.zero_grad()
        lens.close()
        out[name] = (list(lens.records), caught_all, breaks)
    recs, caught, breaks = out["compiled"]
    assert len(caught[0]) == 1 and "Give the Lens the compiled module (Lens(torch.compile(model), ...))" in caught[0][0]
    assert caught[1:] == [[], []]
    assert breaks[0] > 0 and breaks[1:] == [0, 0]
    assert compat.compile_stance() == "default"
    for e, c in zip(out["eager"][0], recs):
        torch.testing.assert_close(c["batch_l2"], e["batch_l2"], rtol=1e-12, atol=0)
    torch._dynamo.reset()
