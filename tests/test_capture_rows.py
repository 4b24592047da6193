"""Issue rows on the capture: several loss terms, stale losses, graphs captured twice, a second
Lens, two backwards, parameters frozen later, empty micro-batches. Oracle: a float64 per-sample
loop on a copy of the model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from windows import micro_batches, run_windows

B = 6


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4)).double()


def _data():
    torch.manual_seed(1)
    return torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 4, (B,)), torch.randn(B, 4, dtype=torch.float64)


def _oracle(model, share):
    x, y, t = _data()
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for n in range(B):
        g = torch.autograd.grad(share(model(x), y, t, n), params)
        rows.append(torch.cat([v.reshape(-1) for v in g]))
    return torch.stack(rows)


@pytest.mark.parametrize("order", ["ce_first", "mse_first"])
def test_two_loss_terms_are_one_objective_in_either_order(order):
    """mean CE + 0.01 * MSE(sum): g_n = B * grad of sample n's share, whatever the order."""
    model = _model()
    G = _oracle(
        copy.deepcopy(model),
        lambda out, y, t, n: B * (F.cross_entropy(out, y, reduction="none")[n] / B
                                  + 0.01 * F.mse_loss(out, t, reduction="none")[n].sum()),
    )
    m = gradlens.extend(model)
    ce, mse = gradlens.extend(nn.CrossEntropyLoss()), gradlens.extend(nn.MSELoss(reduction="sum"))
    lens = Lens(m, [BatchL2(), GradNorm()])
    x, y, t = _data()
    out = m(x)
    if order == "ce_first":
        a = ce(out, y)
        b = mse(out, t)
    else:
        b = mse(out, t)
        a = ce(out, y)
    with lens.capture():
        (a + 0.01 * b).backward()
    rec = lens.flush()
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.tensor(rec["grad_norm"], dtype=torch.float64), G.mean(0).norm())
    assert rec["loss"] == pytest.approx(float(a + 0.01 * b), rel=1e-12)


def test_a_validation_loss_before_the_capture_does_not_count():
    model = _model()
    m = gradlens.extend(model)
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    validation = ce(m(x * 3), y)  # grad enabled, never backpropagated
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    rec = lens.flush()
    assert rec["loss"] == pytest.approx(float(loss), rel=1e-12)
    assert rec["loss"] != pytest.approx(float(validation), rel=1e-6)


def test_a_graph_captured_twice_is_an_error():
    m = gradlens.extend(_model())
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already measured.*would count twice"):
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()


def test_two_backwards_in_one_capture_is_an_error():
    m = gradlens.extend(_model())
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [BatchL2()])
    x, y, _ = _data()
    l1, l2 = ce(m(x), y), ce(m(x[:3]), y[:3])
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="second backward.*own capture"):
        with lens.capture():
            l1.backward()
            l2.backward()


def test_a_second_open_lens_on_the_model_is_refused():
    m = gradlens.extend(_model())
    first = Lens(m, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"already watched by an open Lens.*lens.close\(\)"):
        Lens(m, [GradNorm()])
    first.close()
    Lens(m, [GradNorm()]).close()  # the fix, as the message says


def test_parameters_frozen_and_unfrozen_later_are_followed():
    model = _model()
    ref = copy.deepcopy(model)
    m = gradlens.extend(model)
    ce = gradlens.extend(nn.CrossEntropyLoss())
    lens = Lens(m, [SumGradSquared(), BatchL2()])
    x, y, _ = _data()
    for p in list(m[0].parameters()) + list(ref[0].parameters()):
        p.requires_grad_(False)
    G = _oracle(ref, lambda out, y, t, n: F.cross_entropy(out[n : n + 1], y[n : n + 1]))
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    for p in m[0].parameters():  # unfrozen: tracked from the next window on
        p.requires_grad_(True)
    rec = lens.flush()
    assert sorted(rec["sum_grad_squared"]) == ["2.bias", "2.weight"]
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    assert sorted(lens.flush()["sum_grad_squared"]) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def _full_then_empty_micro_step():
    """A Lens whose window holds a micro-step of all B samples, then one of none."""
    ce = gradlens.extend(nn.CrossEntropyLoss(reduction="sum"))
    x, y, _ = _data()
    run = run_windows(_model(), [[(x, y), (x[:0], y[:0])]], [BatchL2()], loss=ce, fresh_copy=False, end="none",
                      close=False)
    return run.model, ce, run.lens, x, y


def test_an_empty_micro_batch_adds_nothing():
    m, ce, lens, x, y = _full_then_empty_micro_step()
    rec = lens.flush()
    assert rec.num_samples == B and rec.micro_steps == 1 and rec["loss"] == pytest.approx(float(ce(m(x), y)))
    assert rec.meta["empty_micro_steps"] == 1


@pytest.mark.parametrize("drop", ["discard_window", "error"])
def test_a_dropped_window_keeps_its_empty_micro_steps(drop):
    """A window dropped without a record (a skipped update, an exception inside the capture)
    takes its empty micro-steps with it: the next window's record counts only its own."""
    m, ce, lens, x, y = _full_then_empty_micro_step()
    if drop == "discard_window":
        lens.discard_window()
    else:
        loss = ce(m(x), y)
        with pytest.warns(RuntimeWarning, match="statistics are dropped"), pytest.raises(KeyError):
            with lens.capture():
                loss.backward()
                raise KeyError("interrupted")
    loss = ce(m(x), y)
    with lens.capture():
        loss.backward()
    rec = lens.flush()
    assert rec.micro_steps == 1 and rec.num_samples == B
    assert "empty_micro_steps" not in rec.meta  # (the key is there when the count is not 0)


class _Branchy(nn.Module):
    """A trunk and a head; ``skip=True`` leaves the head out of the forward."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(5, 4)
        self.head = nn.Linear(4, 4)

    def forward(self, x, skip=False):
        h = torch.tanh(self.trunk(x))
        return h if skip else self.head(h)


def test_a_layer_skipped_by_a_micro_step_counts_its_zero_elements():
    """Micro-step 2 skips the head: its per-sample gradients are exact zeros there, and both
    histograms hold N x D elements equal to the float64 oracle's."""
    from gradlens.instruments import GradHist1d, GradHist2d

    from oracle import bins_oracle, hist_oracle

    torch.manual_seed(0)
    model = _Branchy().double()
    x, y = torch.randn(B, 5, dtype=torch.float64), torch.randint(0, 4, (B,))
    split = [(slice(0, 4), False), (slice(4, B), True)]
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    rows = []
    for sl, skip in split:
        for n in range(sl.start, sl.stop):
            out = ref(x[n:n + 1], skip=skip)
            g = torch.autograd.grad(F.cross_entropy(out, y[n:n + 1]), params, allow_unused=True)
            rows.append(torch.cat([(torch.zeros_like(p) if v is None else v).reshape(-1)
                                   for p, v in zip(params, g)]))
    G = torch.stack(rows)  # [N, D]
    theta = torch.cat([p.detach().reshape(-1) for p in params])

    h1 = GradHist1d(bins=8, range=(-0.4, 0.4))
    h2 = GradHist2d(bins=(4, 8), range=((-0.6, 0.6), (-0.4, 0.4)))
    (rec,) = run_windows(model, [[(x[sl], y[sl], {"skip": skip}) for sl, skip in split]], [h1, h2, BatchL2()],
                         loss=nn.CrossEntropyLoss(reduction="sum"), fresh_copy=False, close=False).flushed
    counts, low, high = hist_oracle(G, -0.4, 0.4, 8)
    got = rec["grad_hist_1d"]
    assert int(got.counts.sum()) == G.numel()
    torch.testing.assert_close(got.counts, counts, rtol=0, atol=0)
    assert (got.clamped_low, got.clamped_high) == (low, high)
    pidx = bins_oracle(theta, -0.6, 0.6, 4)
    gidx = bins_oracle(G, -0.4, 0.4, 8)
    joint = torch.bincount((pidx[None, :] * 8 + gidx).reshape(-1), minlength=32).view(4, 8)
    torch.testing.assert_close(rec["grad_hist_2d"].counts, joint, rtol=0, atol=0)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)


class _PosEmb(nn.Module):
    def __init__(self, batched_ids: bool, padding_idx):
        super().__init__()
        self.tok = nn.Embedding(9, 4)
        self.pos = nn.Embedding(5, 4, padding_idx=padding_idx)
        self.head = nn.Linear(4, 4)
        self.batched_ids = batched_ids

    def forward(self, ids):
        t = ids.shape[1]
        pos = torch.arange(t)[None] if self.batched_ids else torch.arange(t)
        if str(self.batched_ids).startswith("expanded"):  # [B, T]: spans the batch, not data
            pos = pos.expand(ids.shape[0], t)
        if self.batched_ids == "expanded-sub-mul":
            return self.head(torch.tanh((self.tok(ids) - self.pos(pos)) * self.pos(pos))).mean(1)
        return self.head(torch.tanh(self.tok(ids) + self.pos(pos))).mean(1)


@pytest.mark.parametrize("batched_ids", [True, False, "expanded", "expanded-sub-mul"])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_position_embeddings_of_non_data_ids_are_exact_in_closed_form(batched_ids, padding_idx, monkeypatch):
    """wpe(arange(T)) meets the batch at an add: its per-sample gradient is the lookup's
    closed form (no batched VJP), equal to the float64 per-sample loop. Ids expanded to
    ``[B, T]`` (what Opacus needs) or broadcast from ``[1, T]`` (transformers') take the batched
    lookup (one index_add, no one-sample restrictions of the add)."""
    from gradlens.capture import ops
    from gradlens.instruments import GradHist1d

    from oracle import hist_oracle

    torch.manual_seed(0)
    model = _PosEmb(batched_ids, padding_idx).double()
    ids, y = torch.randint(0, 9, (B, 5)), torch.randint(0, 4, (B,))
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    G = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(F.cross_entropy(ref(ids[n:n + 1]), y[n:n + 1]), params)])
        for n in range(B)
    ])
    used = []
    real, real_batched = ops._embedding_lookup, ops.batched_lookup
    monkeypatch.setattr(ops, "_embedding_lookup", lambda *a: used.append(1) or real(*a))
    monkeypatch.setattr(ops, "batched_lookup", lambda *a: (lambda r: r is not None and used.append(2) or r)(real_batched(*a)))
    monkeypatch.setattr(ops, "_generic", lambda *a: pytest.fail("the one-sample vjp ran"))
    run = run_windows(model, [micro_batches(ids, y, [2, B - 2])], [BatchL2(), SumGradSquared(), GradHist1d(bins=9, range=(-0.3, 0.3))],
                      fresh_copy=False, close=False)
    lens, (rec,) = run.lens, run.flushed
    assert used and lens.coverage == 1.0
    assert (2 in used) == (batched_ids is not False)  # ids [B, T] or [1, T]: the batched lookup
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
    sgs = torch.cat([rec["sum_grad_squared"][k].reshape(-1) for k, _ in model.named_parameters()])
    torch.testing.assert_close(sgs, G.square().sum(0), rtol=1e-10, atol=1e-14)
    counts, low, high = hist_oracle(G, -0.3, 0.3, 9)
    assert torch.equal(rec["grad_hist_1d"].counts, counts)
