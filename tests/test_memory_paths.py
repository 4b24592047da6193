"""Issue 35 item 3: a shared (tied) parameter's g_n formed one slice of samples at a time and its
sums added in place (the paths a vocabulary-sized tied table takes: one sample per slice) give
the float64 oracle's numbers over unequal micro-batches; a record's tensors never change after
it is emitted (the next window sums into a fresh buffer)."""

import copy

import torch
from torch import nn

import gradlens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from gradlens.kernels import materialised
from gradlens.measure import slices

from oracle import per_sample_grads
from oracle_models import TiedLM


def _run(model, parts, windows):
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = gradlens.Lens(model, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt, keep_records=windows)
    for _ in range(windows):
        for x, y in parts:
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
        opt.step()
        opt.zero_grad()
    return lens.records


def test_tied_parameter_one_sample_per_slice_matches_oracle(monkeypatch):
    # every slice one sample, summed in place (_one_sample, MaterialisedKernel.reduce's addcmul_)
    monkeypatch.setattr(slices, "CPU_SLICE_ELEMENTS", 1)
    monkeypatch.setattr(materialised, "CHUNK_ELEMENTS", 1)
    torch.manual_seed(0)
    model = TiedLM().double()
    oracle_model = copy.deepcopy(model)  # before gradlens.extend
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (6, 5), generator=g), torch.randint(0, 11, (6,), generator=g)
    parts = [(x[:2], y[:2]), (x[2:5], y[2:5]), (x[5:], y[5:])]
    calls = []
    summed = materialised.SummedUsesKernel.per_sample
    monkeypatch.setattr(materialised.SummedUsesKernel, "per_sample",
                        lambda self, *a, **k: calls.append(1) or summed(self, *a, **k))
    rec = _run(model, parts, 1)[-1]
    assert calls  # the tied table's uses were summed slice by slice (SummedUsesKernel)
    gs = per_sample_grads(oracle_model, x, y)
    want_l2 = sum(v.reshape(6, -1).square().sum(1) for v in gs.values())
    torch.testing.assert_close(rec["batch_l2"], want_l2, rtol=1e-10, atol=1e-12)
    for name, v in gs.items():
        torch.testing.assert_close(rec["sum_grad_squared"][name], v.square().sum(0), rtol=1e-10, atol=1e-12)
    window_grad = torch.cat([v.mean(0).reshape(-1) for v in gs.values()])
    assert abs(rec["grad_norm"] - float(window_grad.norm())) <= 1e-10 * float(window_grad.norm())


def test_emitted_record_never_changes():
    torch.manual_seed(1)
    model = TiedLM().double()
    g = torch.Generator().manual_seed(4)
    x, y = torch.randint(0, 11, (5, 5), generator=g), torch.randint(0, 11, (5,), generator=g)
    records = _run(model, [(x[:3], y[:3]), (x[3:], y[3:])], 3)
    assert len(records) == 3
    first = records[0]["sum_grad_squared"]
    kept = {k: v.clone() for k, v in first.items()}
    ptrs = [{k: v.data_ptr() for k, v in r["sum_grad_squared"].items()} for r in records]
    assert all(ptrs[0][k] != ptrs[1][k] for k in ptrs[0])  # the next window summed elsewhere
    # the model moved (lr 0.1), so later windows' sums differ: the first record still holds its own
    assert any(not torch.equal(kept[k], records[2]["sum_grad_squared"][k]) for k in kept)
    for k, v in first.items():
        assert torch.equal(v, kept[k])


def _window_sum_elements(source: str) -> tuple[int, int]:
    """(elements of the window sums held right before the update, of the tracked parameters):
    window 2 of a tied LM with BatchL2 + SumGradSquared + GradNorm(source), the first window's
    record still held."""
    torch.manual_seed(2)
    model = gradlens.extend(TiedLM().double())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction="sum"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = gradlens.Lens(model, [BatchL2(), SumGradSquared(), GradNorm(source=source)], optimizer=opt)
    g = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 11, (5, 5), generator=g), torch.randint(0, 11, (5,), generator=g)
    held = 0
    for _ in range(2):
        for xb, yb in ((x[:3], y[:3]), (x[3:], y[3:])):
            loss = loss_fn(model(xb), yb)
            with lens.capture():
                loss.backward()
        lens._meter.settle(lens._window)  # the small uses' sums, as the update would settle them
        stats = lens._window.stats
        held = sum(t.numel() for d in (stats.sum_grad_squared, stats.grad_sum) for t in d.values())
        opt.step()
        opt.zero_grad()
    assert lens.records[-1]["grad_norm"] is not None
    return held, sum(p.numel() for p in model.parameters())


def test_grad_norm_from_p_grad_holds_no_window_gradient():
    """Issue 35's memory floor: GradNorm() holds sum_n g_n (one parameter-sized tensor) beside
    SumGradSquared's running sum; GradNorm(source="p.grad") holds none of its own."""
    sums, params = _window_sum_elements("sums")
    assert sums == 2 * params
    from_grads, params = _window_sum_elements("p.grad")
    assert from_grads == params
