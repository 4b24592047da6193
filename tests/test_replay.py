"""Planned forwards (gradlens/capture/replay.py): the first tracked forward of each micro-batch
size is followed by the mode and recorded; later ones are replayed from the site hooks. A
forward that departs from its plan (another branch, fewer or other layers, rows moved or mixed
between layers) is measured exactly or refused, never from a stale plan. Oracle: float64
per-sample gradients by a per-sample loop on a copy made before ``gradlens.extend``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens.capture.replay import Replay
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from oracle import norm_set, per_sample_loop

SIZES = (2, 3, 1)


class Branchy(nn.Module):
    """An MLP whose forward takes the branch ``self.route`` says (set before each call)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.alt, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.route = "plain"

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        r = self.route
        if r == "plain":
            h = torch.tanh(self.fc2(h))
        elif r == "alt":  # another layer, and a residual
            h = torch.relu(self.alt(h)) + h
        elif r == "skip":  # fewer uses than planned
            pass
        elif r == "extra":  # elementwise operations the plan did not see, before a planned layer
            h = torch.tanh(self.fc2(torch.relu(h) * 0.5 + h))
        elif r == "flip":  # the batch's rows moved between two layers
            h = torch.tanh(self.fc2(h.flip(0)))
        elif r == "perm":
            h = torch.tanh(self.fc2(h[torch.randperm(h.shape[0])]))
        elif r == "mix":  # samples mixed between two layers
            h = torch.tanh(self.fc2(h - h.mean(0, keepdim=True)))
        return self.head(h)


@pytest.fixture(autouse=True)
def _replay_on():
    was = Replay.enabled
    Replay.enabled = True
    yield
    Replay.enabled = was


def _windows(routes: dict[int, str], n_windows: int = 3):
    """Windows of micro-batches SIZES; ``routes``: micro-step index (over the run) -> route."""
    g = torch.Generator().manual_seed(3)
    out, k = [], 0
    for _ in range(n_windows):
        win = []
        for b in SIZES:
            win.append((torch.randn(b, 5, generator=g, dtype=torch.float64),
                        torch.randint(0, 3, (b,), generator=g), routes.get(k, "plain")))
            k += 1
        out.append(win)
    return out


def _run(windows, enabled=True):
    torch.manual_seed(0)
    base = Branchy().double()
    plain = copy.deepcopy(base)  # the oracle's copy, made before extend
    Replay.enabled = enabled
    model = gradlens.extend(base)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = gradlens.Lens(model, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt)
    states = []
    for win in windows:
        states.append(copy.deepcopy(model.state_dict()))
        for x, y, route in win:
            model.route = route
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
    return lens, plain, states


def _oracle(plain, state, win):
    rows = []
    for x, y, route in win:
        m = copy.deepcopy(plain)
        m.route = route

        def loss_n(mm, i, x=x, y=y):
            return F.cross_entropy(mm(x[i:i + 1]), y[i:i + 1])

        rows.append(per_sample_loop(m, state, loss_n, x.shape[0]))
    return norm_set({k: torch.cat([r[k] for r in rows]) for k in rows[0]})


def _check_exact(lens, plain, states, windows):
    assert len(lens.records) == len(windows)
    for rec, state, win in zip(lens.records, states, windows):
        want = _oracle(plain, state, win)
        torch.testing.assert_close(rec.values["batch_l2"], want["batch_l2"], rtol=1e-10, atol=1e-12)
        for q, v in want["sum_grad_squared"].items():
            torch.testing.assert_close(rec.values["sum_grad_squared"][q], v, rtol=1e-10, atol=1e-12)
        assert rec.values["grad_norm"] == pytest.approx(float(want["grad_norm"]), rel=1e-10)


def test_replayed_forwards_equal_the_oracle():
    windows = _windows({})
    lens, plain, states = _run(windows)
    rp = lens._tap._replay
    assert {key[0] for key in rp.plans} == set(SIZES)  # one plan per micro-batch size (and input shape)
    assert rp.replayed == 6  # windows 2 and 3 replayed every micro-step
    _check_exact(lens, plain, states, windows)


@pytest.mark.parametrize("route", ["alt", "skip", "extra"])
def test_another_branch_on_a_later_micro_step_stays_exact(route):
    # the third micro-step of the second window (B = 1, whose plan the first window recorded)
    # takes another branch; the others replay
    windows = _windows({5: route})
    lens, plain, states = _run(windows)
    _check_exact(lens, plain, states, windows)
    assert lens._tap._replay.replayed >= 4


def test_another_branch_equals_the_full_route():
    windows = _windows({2: "alt", 4: "skip", 5: "alt", 7: "extra"}, n_windows=4)
    lens, _, _ = _run(windows)
    full, _, _ = _run(windows, enabled=False)
    assert lens._tap._replay.replayed > 0 and full._tap._replay.replayed == 0
    for a, b in zip(lens.records, full.records):
        torch.testing.assert_close(a.values["batch_l2"], b.values["batch_l2"], rtol=0, atol=0)


@pytest.mark.parametrize("route", ["flip", "perm", "mix"])
def test_rows_moved_or_mixed_in_a_later_micro_step_are_never_measured_from_the_plan(route):
    # the first window records every size; in the second, micro-step 4 (B = 3) moves or mixes
    # the batch's rows between two layers: refused (the full route would measure rows moved
    # with a known index, and call the mixed layers undefined), never a record from the plan
    windows = _windows({4: route})
    with pytest.raises(RuntimeError, match="replayed from its plan"):
        _run(windows)


def test_replay_off_follows_every_forward():
    windows = _windows({})
    lens, plain, states = _run(windows, enabled=False)
    assert lens._tap._replay.replayed == 0 and not lens._tap._replay.plans
    _check_exact(lens, plain, states, windows)


class _PerOp(nn.Module):
    """A parameter used outside a layer (a per-operation use): never planned."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_model_with_per_operation_uses_is_not_replayed():
    model = gradlens.extend(_PerOp().double())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    lens = gradlens.Lens(model, [BatchL2()])
    for x, y, _ in _windows({})[0] * 3:
        loss = loss_fn(model(x), y)
        with lens.capture():
            loss.backward()
    assert lens._tap._replay.replayed == 0 and not lens._tap._replay.plans


class _Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(5, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):  # x [B, T, 5]
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))).mean(1))


def test_a_new_sequence_length_is_followed_and_exact():
    # micro-steps of T = 4, then T = 7 with micro-batch sizes the plans know: a plan of its own
    torch.manual_seed(0)
    base = _Seq().double()
    plain = copy.deepcopy(base)
    model = gradlens.extend(base)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = gradlens.Lens(model, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt)
    g = torch.Generator().manual_seed(5)
    windows = [[(torch.randn(b, t, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g))
                for b, t in zip(SIZES, ts)] for ts in ((4, 4, 4), (4, 7, 4), (7, 4, 4))]
    states = []
    for win in windows:
        states.append(copy.deepcopy(model.state_dict()))
        for x, y in win:
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
    assert lens._tap._replay.replayed >= 4
    for rec, state, win in zip(lens.records, states, windows):
        rows = []
        for x, y in win:
            def loss_n(mm, i, x=x, y=y):
                return F.cross_entropy(mm(x[i:i + 1]), y[i:i + 1])
            rows.append(per_sample_loop(plain, state, loss_n, x.shape[0]))
        want = norm_set({k: torch.cat([r[k] for r in rows]) for k in rows[0]})
        torch.testing.assert_close(rec.values["batch_l2"], want["batch_l2"], rtol=1e-10, atol=1e-12)
