"""PyTorch Lightning: LensCallback records == float64 oracle of the same windows.

Runs the real Lightning Trainer on CPU (float64: ``precision="64-true"``) with
``accumulate_grad_batches=3``, no shuffling; the oracle's per-sample gradients come from
``torch.func`` at each window's starting parameters, snapshotted by a test callback.
Run with ``/work/venv-models/bin/python -m pytest -m frameworks``.
"""

from __future__ import annotations

import copy
import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens.instruments import Alpha, BatchL2, GradHist1d, GradNorm, SumGradSquared

try:
    import lightning.pytorch as L
    from lightning.pytorch.loggers import CSVLogger

    from gradlens.integrations.lightning import LensCallback, report_losses

    _IMPORT_ERROR = None
except ImportError as err:  # collected (and deselected) by the default run
    import types

    _IMPORT_ERROR = err
    L = types.SimpleNamespace(LightningModule=nn.Module, Callback=object)

import oracle as O

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _frameworks_present():
    """The default run collects this file and deselects it (marker ``frameworks``); when the
    tests do run, a missing framework fails them, never skips them."""
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR

K, B, N_TOTAL = 3, 4, 35  # windows of 3 micro-batches of 4; the last window is [4, 4, 3]
LO, HI, BINS = -0.5, 0.5, 40


class Net(L.LightningModule):
    def __init__(self, functional: bool, alpha: bool):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        self.functional = functional
        self.alpha = alpha
        self.loss_fn = gradlens.extend(nn.CrossEntropyLoss())

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        if self.alpha:
            report_losses(self, F.cross_entropy(out.detach(), y, reduction="none"))
        return F.cross_entropy(out, y) if self.functional else self.loss_fn(out, y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


class Snapshots(L.Callback):
    """The net's parameters at the start of every window (and at the end of training)."""

    def __init__(self):
        self.states = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx % K == 0:
            self.states.append(copy.deepcopy(pl_module.net.state_dict()))

    def on_train_end(self, trainer, pl_module):
        self.states.append(copy.deepcopy(pl_module.net.state_dict()))


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TOTAL, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N_TOTAL,), generator=g)
    return x, y


def _fit(tmp_path, functional: bool, alpha: bool = True, **cb_kwargs):
    torch.manual_seed(0)
    model = Net(functional, alpha)
    net0 = copy.deepcopy(model.net).double()
    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False)
    insts = [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=BINS, range=(LO, HI))]
    if alpha:
        insts.append(Alpha())
    cb = LensCallback(insts, reduction="mean" if functional else None, **cb_kwargs)
    snaps = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, precision="64-true",
        accumulate_grad_batches=K, callbacks=[snaps, cb], logger=CSVLogger(tmp_path, name="run"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, log_every_n_steps=1,
    )
    trainer.fit(model, loader)
    return cb, snaps.states, net0, x, y, trainer


def _windows(x, y):
    n = K * B
    return [(x[s:s + n], y[s:s + n]) for s in range(0, len(x), n)]


def _ce(out, y):
    return F.cross_entropy(out, y)


@pytest.mark.parametrize("functional", [False, True], ids=["extended-loss", "functional-loss"])
def test_lightning_records_equal_oracle(tmp_path, functional):
    cb, states, net0, x, y, trainer = _fit(tmp_path, functional)
    windows = _windows(x, y)
    recs = cb.records
    assert len(recs) == len(windows) == 3 and len(states) == 4
    assert [r.step for r in recs] == [0, 1, 2]
    assert [r.micro_steps for r in recs] == [3, 3, 3]
    assert [r.num_samples for r in recs] == [12, 12, 11]
    grads = [O.per_sample(net0, states[t], _ce, *windows[t]) for t in range(3)]
    for t, rec in enumerate(recs):
        o = O.norm_set(grads[t], prefix="net.")
        O.close(rec["batch_l2"], o["batch_l2"])
        O.close(rec["grad_norm"], o["grad_norm"])
        assert sorted(rec["sum_grad_squared"]) == sorted(o["sum_grad_squared"])
        for name, v in o["sum_grad_squared"].items():
            O.close(rec["sum_grad_squared"][name], v)
        counts, low, high = O.hist_counts(grads[t], LO, HI, BINS)
        h = rec["grad_hist_1d"]
        assert torch.equal(h.counts, counts) and (h.clamped_low, h.clamped_high) == (low, high)
        with torch.no_grad():
            m = copy.deepcopy(net0)
            m.load_state_dict(states[t])
            losses = F.cross_entropy(m(windows[t][0]), windows[t][1], reduction="none")
        O.close(rec["loss"], losses.mean())
    # Alpha: window t's start point at theta_t, end point = window t+1's samples at theta_{t+1}
    for t in range(2):
        rec = recs[t]
        assert rec.meta["alpha"] == "exact", rec.meta["alpha"]
        m0, m1 = copy.deepcopy(net0), copy.deepcopy(net0)
        m0.load_state_dict(states[t])
        m1.load_state_dict(states[t + 1])
        d = torch.cat([(states[t + 1][k] - states[t][k]).flatten() for k in states[t]])
        G0, G1 = O.flat(grads[t]), O.flat(grads[t + 1])
        ps, pe = G0 @ d, G1 @ d
        with torch.no_grad():
            l0 = F.cross_entropy(m0(windows[t][0]), windows[t][1], reduction="none")
            l1 = F.cross_entropy(m1(windows[t + 1][0]), windows[t + 1][1], reduction="none")
        sq = d.dot(d)
        want = O.alpha(sq, (l0.mean(), l1.mean()), (ps.mean(), pe.mean()),
                       (l0.var() / len(l0), l1.var() / len(l1)), (ps.var() / len(ps), pe.var() / len(pe)))
        assert rec["alpha"] is not None and math.isfinite(rec["alpha"])
        O.close(rec["alpha"], want, rtol=1e-7)
        O.close(rec["search_dir_projections"]["start"], ps / sq)
        O.close(rec["search_dir_projections"]["end"], pe / sq)
    # the last window has no successor: no alpha, and the record says why (not "no update")
    assert recs[2]["alpha"] is None and "closed" in recs[2].meta["alpha"]
    assert "no optimizer update" not in recs[2].meta["alpha"]
    # the scalars reached the Trainer's logger at the record's step
    rows = list(csv.DictReader(open(trainer.logger.experiment.metrics_file_path)))
    got = {int(r["step"]): float(r["gradlens/grad_norm"]) for r in rows if r.get("gradlens/grad_norm")}
    assert sorted(got) == [0, 1, 2]
    for rec in recs:
        assert got[rec.step] == pytest.approx(float(rec["grad_norm"]), rel=1e-12)
    alphas = {int(r["step"]): float(r["gradlens/alpha"]) for r in rows if r.get("gradlens/alpha")}
    assert sorted(alphas) == [0, 1] and alphas[0] == pytest.approx(recs[0]["alpha"], rel=1e-12)


def test_lightning_without_extended_loss_says_what_to_do(tmp_path):
    class Plain(Net):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

    x, y = _data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B)
    trainer = L.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, precision="64-true",
    )
    with pytest.raises(RuntimeError, match=r"reduction='mean'"):
        _fit_with(trainer, Plain(False, False), loader)


def _fit_with(trainer, model, loader):
    cb = LensCallback([BatchL2()])
    trainer.callbacks.append(cb)
    trainer.fit(model, loader)


def test_lightning_callback_bad_arguments():
    with pytest.raises(TypeError, match=r"instead of an instance"):
        LensCallback([BatchL2])
    with pytest.raises(ValueError, match=r"reduction"):
        LensCallback([BatchL2()], reduction="none")


def test_report_losses_without_callback_says_how():
    model = Net(False, True)
    with pytest.raises(RuntimeError, match=r"LensCallback"):
        report_losses(model, torch.zeros(3))


# ----------------------------------------------------------------------------- a Hugging Face model inside
class HFNet(L.LightningModule):
    """A LightningModule that holds a Hugging Face model as an attribute; the loss comes from
    inside it (``labels=``)."""

    def __init__(self):
        super().__init__()
        from oracle_models import hf_bert

        torch.manual_seed(0)
        self.net = hf_bert()

    def training_step(self, batch, batch_idx):
        return self.net(**batch).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)


def _hf_data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (N_TOTAL, 9), generator=g)
    keep = torch.randint(4, 10, (N_TOTAL,), generator=g)  # padded sequences of unequal length
    mask = (torch.arange(9)[None, :] < keep[:, None]).long()
    labels = torch.randint(0, 4, (N_TOTAL,), generator=g)
    return [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in zip(ids, mask, labels)]


def _hf_fit(tmp_path, lens_cb):
    model = HFNet()
    net0 = copy.deepcopy(model.net).double()
    data = _hf_data()
    loader = torch.utils.data.DataLoader(data, batch_size=B, shuffle=False)
    snaps = Snapshots()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, precision="64-true",
        accumulate_grad_batches=K, callbacks=[snaps, lens_cb], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, loader)
    return snaps.states, net0, data


def _hf_oracle(net0, state, data, window):
    def loss_n(m, i):
        s = data[window * K * B + i]
        out = m(input_ids=s["input_ids"][None], attention_mask=s["attention_mask"][None])
        return F.cross_entropy(out.logits, s["labels"][None])  # sample i's own loss

    n = min(K * B, len(data) - window * K * B)
    return O.per_sample_loop(net0, state, loss_n, n)


def test_lightning_hf_model_inside_readme_snippet(tmp_path):
    """The README snippet as printed, on a LightningModule holding a Hugging Face model
    (``self.net(**batch).loss``): records == the float64 per-sample oracle of each window."""
    lens_cb = LensCallback([BatchL2(), GradNorm(), GradHist1d()])
    states, net0, data = _hf_fit(tmp_path, lens_cb)
    recs = lens_cb.records
    assert [r.num_samples for r in recs] == [12, 12, 11] and [r.micro_steps for r in recs] == [3, 3, 3]
    assert lens_cb.lens.coverage == 1.0
    for t, rec in enumerate(recs):
        gs = _hf_oracle(net0, states[t], data, t)
        o = O.norm_set(gs, prefix="net.")
        O.close(rec["batch_l2"], o["batch_l2"])
        O.close(rec["grad_norm"], o["grad_norm"])
        O.hist_matches(rec["grad_hist_1d"], O.flat(gs), -2.0, 2.0, 100)  # GradHist1d's default range


@pytest.mark.parametrize("reduction", [None, "mean"])
def test_lightning_hf_model_message_names_module_and_it_works(tmp_path, reduction):
    """Instruments of the window gradient only (GradNorm) watch the LightningModule's own
    forward, which Lightning never calls: the error names module='net' (with or without a
    stated reduction), and that fix, as written, gives the oracle's numbers."""
    with pytest.raises(RuntimeError, match=r"LensCallback\(\.\.\., module='net'\)"):
        _hf_fit(tmp_path, LensCallback([GradNorm()], reduction=reduction))
    lens_cb = LensCallback([GradNorm()], module='net')
    states, net0, data = _hf_fit(tmp_path, lens_cb)
    recs = lens_cb.records
    assert [r.num_samples for r in recs] == [12, 12, 11]
    for t, rec in enumerate(recs):
        gs = _hf_oracle(net0, states[t], data, t)
        O.close(rec["grad_norm"], O.norm_set(gs)["grad_norm"])
