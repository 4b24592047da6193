"""Framework-free parts of the integrations (default suite): Lens(sinks=[...]) and the sink
protocol, lens.capture(multiplier=, loss=) against a float64 torch.func oracle, the
optimizer.step(closure) path, discard_window, record_scalars / record_histograms, and that
``import gradlens`` imports no framework."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import Alpha, BatchL2, GradHist1d, GradHist2d, GradNorm, SumGradSquared
from gradlens.integrations import record_histograms, record_scalars
from oracle import flat, per_sample_grads
from windows import run_windows


class ListSink:
    def __init__(self):
        self.records, self.closed = [], 0

    def write(self, record):
        self.records.append(record)

    def close(self):
        self.closed += 1


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def _batches(seed, sizes):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(b, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (b,), generator=g))
            for b in sizes]


# ------------------------------------------------------------------ sinks
def test_sinks_receive_every_record_once_in_order_and_are_closed():
    a, b = ListSink(), ListSink()

    def pending(run, w):  # Alpha keeps the newest record pending: it reaches the sinks when the next window closes
        assert [r.step for r in a.records] == list(range(w))

    lens = run_windows(_mlp(), [_batches(w, [4, 2]) for w in range(3)], [GradNorm(), Alpha()],
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), sinks=[a, b], losses=True,
                       on_window=pending, close=False).lens
    lens.close()
    lens.close()
    assert [r.step for r in a.records] == [0, 1, 2] and a.records == b.records
    assert a.records[0]["alpha"] is not None and a.records[2]["alpha"] is None
    assert (a.closed, b.closed) == (1, 1)


@pytest.mark.parametrize("bad, what", [
    (object(), r"lacks write\(\) and close\(\)"),
    (type("OnlyWrite", (), {"write": lambda self, r: None})(), r"lacks close\(\)"),
])
def test_sinks_without_the_protocol_are_refused(bad, what):
    model = gradlens.extend(_mlp())
    with pytest.raises(TypeError, match=what + r".*write\(record\) and close\(\)"):
        Lens(model, [GradNorm()], sinks=[bad])


def test_sinks_must_be_a_list():
    model = gradlens.extend(_mlp())
    with pytest.raises(TypeError, match=r"Lens\(sinks=...\) takes a list of sinks"):
        Lens(model, [GradNorm()], sinks=ListSink())


# ------------------------------------------------------------------ multipliers
def _window(model0, insts, step):
    """One window of K = 3 unequal micro-batches with a *functional* mean loss;
    ``step(loss) -> (capture kwargs, tensor to backpropagate)``; returns the record."""
    def objective(loss, run, w, k):
        kwargs, total = step(loss)
        return total, kwargs

    return run_windows(model0, [_batches(0, [5, 1, 6])], insts, loss=F.cross_entropy, capture={"reduction": "mean"},
                       objective=objective).flushed[0]


def _oracle(model0):
    x = torch.cat([b[0] for b in _batches(0, [5, 1, 6])])
    y = torch.cat([b[1] for b in _batches(0, [5, 1, 6])])
    return flat(per_sample_grads(model0, x, y))


S = 1024.0  # a GradScaler-like scale; 1/3 is a framework's 1/K


def _lightning_like(loss):
    scaled = loss / 3  # the framework divides by K (known), then a GradScaler multiplies by S
    return {"loss": scaled, "multiplier": 1 / 3}, scaled * S


STEPS = {
    "multiplier": lambda loss: ({"multiplier": S / 3}, loss * (S / 3)),
    "tensor-multiplier": lambda loss: ({"multiplier": torch.tensor(S / 3, dtype=torch.float64)}, loss * (S / 3)),
    "loss": lambda loss: ({"loss": loss}, loss * (S / 3)),
    "loss-and-multiplier": _lightning_like,
}


@pytest.mark.parametrize("how", sorted(STEPS))
def test_capture_divides_out_what_multiplied_a_functional_loss(how):
    model0 = _mlp()
    rec = _window(model0, [BatchL2(), GradNorm(), SumGradSquared()], STEPS[how])
    G = _oracle(model0)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(torch.as_tensor(rec["grad_norm"], dtype=torch.float64), G.mean(0).norm(),
                               rtol=1e-10, atol=1e-12)


def test_capture_without_the_multiplier_differs_from_the_oracle():
    """The same window with the 1/K scaling not declared: the capture refuses (units would be
    off by 1/K), so the test above can fail."""
    model0 = _mlp()
    with pytest.raises(ValueError, match=r"needs the loss tensor too.*loss=loss"):
        _window(model0, [BatchL2()], lambda loss: ({}, loss / 3))


def test_capture_multiplier_errors():
    model = gradlens.extend(_mlp())
    lens = Lens(model, [GradNorm()])
    x, y = _batches(0, [4])[0]
    loss = F.cross_entropy(model(x), y)
    with pytest.raises(ValueError, match=r"go with a stated reduction.*drop them"):
        with lens.capture(multiplier=0.5):
            pass
    for bad in (0.0, -1.0, float("inf"), True, "1/3", torch.ones(2)):
        with pytest.raises(ValueError, match=r"multiplier=.*positive"):
            with lens.capture("mean", multiplier=bad):
                pass
    with pytest.raises(ValueError, match=r"loss=.*does not require grad.*before \.detach"):
        with lens.capture("mean", loss=loss.detach()):
            pass
    with pytest.raises(ValueError, match=r"loss=.*0-d loss tensor"):
        with lens.capture("mean", loss=torch.ones(3, requires_grad=True)):
            pass
    other = F.cross_entropy(model(x), y)  # a loss that is not backpropagated
    with pytest.raises(RuntimeError, match=r"did not pass through the given loss tensor"):
        with lens.capture("mean", loss=other):
            loss.backward()
    # the window was dropped: a correct micro-step afterwards gives a clean record
    loss = F.cross_entropy(model(x), y)
    with lens.capture("mean", loss=loss):
        (loss * 2).backward()
    rec = lens.flush()
    assert rec.num_samples == 4 and rec.micro_steps == 1
    lens.close()


# ------------------------------------------------------------------ optimizer.step(closure)
@pytest.mark.parametrize("positional", [False, True])
def test_step_with_closure_snapshots_after_the_closure(positional):
    """optimizer.step(closure) (Lightning's way): the last micro-step runs inside step(); the
    record (Alpha included) equals the one of the plain loop."""

    def run(with_closure):
        model = gradlens.extend(_mlp())
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        lens = Lens(model, [Alpha(), GradNorm()], optimizer=opt)
        for w in range(2):
            batches = _batches(w, [3, 4])

            def micro(x, y):
                out = model(x)
                loss = loss_fn(out, y)
                with lens.capture(losses=F.cross_entropy(out.detach(), y, reduction="none")):
                    loss.backward()
                return loss

            micro(*batches[0])
            if with_closure:
                closure = lambda: micro(*batches[1])
                opt.step(closure) if positional else opt.step(closure=closure)
            else:
                micro(*batches[1])
                opt.step()
            opt.zero_grad()
        lens.close()
        return lens.records

    plain, closed = run(False), run(True)
    assert plain[0]["alpha"] is not None and closed[0].meta["alpha"] == "exact"
    assert closed[0]["alpha"] == pytest.approx(plain[0]["alpha"], rel=1e-12)


def test_discard_window_drops_statistics_without_a_record():
    model = gradlens.extend(_mlp())
    lens = Lens(model, [BatchL2()])
    run_windows(model, [_batches(0, [4])], lens=lens, fresh_copy=False, end="none", close=False)
    lens.discard_window()
    assert lens.skipped_windows == 1 and lens.step == 0 and not lens.records
    (rec,) = run_windows(model, [_batches(1, [3])], lens=lens, fresh_copy=False, close=False).flushed
    assert rec.step == 0 and rec.num_samples == 3
    lens.close()
    with pytest.raises(RuntimeError, match=r"closed"):
        lens.discard_window()


# ------------------------------------------------------------------ record flattening
def test_record_scalars_and_histograms():
    (rec,) = run_windows(_mlp(), [_batches(0, [5])], [BatchL2(), GradNorm(), GradHist1d(bins=8, range=(-0.1, 0.1)),
                                                       GradHist2d(bins=(3, 4), range=((-1, 1), (-0.2, 0.2)))]).flushed
    s = record_scalars(rec)
    assert s["gradlens/grad_norm"] == float(rec["grad_norm"])
    assert s["gradlens/loss"] == float(rec["loss"])
    assert s["gradlens/grad_hist_1d/clamped_high"] == rec["grad_hist_1d"].clamped_high
    assert not any(k.startswith("gradlens/batch_l2") for k in s)  # [N] is not a scalar
    h = record_histograms(rec, prefix="x/")
    assert sorted(h) == ["x/grad_hist_1d", "x/grad_hist_2d/grad", "x/grad_hist_2d/param"]
    assert torch.equal(h["x/grad_hist_1d"][0], rec["grad_hist_1d"].counts)
    assert torch.equal(h["x/grad_hist_2d/grad"][0], rec["grad_hist_2d"].counts.sum(0))
    with pytest.raises(TypeError, match=r"needs a gradlens Record"):
        record_scalars({"loss": 1.0})


# ------------------------------------------------------------------ imports
def test_import_gradlens_imports_no_framework():
    code = (
        "import sys, gradlens, gradlens.lens.lens, gradlens.integrations, gradlens.output.sinks\n"
        "bad = [m for m in ('lightning', 'pytorch_lightning', 'transformers', 'wandb', 'accelerate')"
        " if m in sys.modules]\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
