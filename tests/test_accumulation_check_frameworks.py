"""AccumulationCheck under the framework callbacks (issue 39), against the float64 oracle: the
Hugging Face Trainer's own normalisation (its window objective: round-off, with its gradient
clipping on) and its per-micro-batch token mean divided by K (unequal counted tokens: the value
and the cause); Lightning's ``accumulate_grad_batches`` and Accelerate's ``accumulate`` (both
divide the loss by K: equal windows round-off with clipping on, the last window of an epoch,
[4, 4, 3], the value and the cause). Run with the frameworks environment: ``pytest -m frameworks``."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import AccumulationCheck, GradNorm

try:
    import lightning as L
    from accelerate import Accelerator
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradlens.integrations.lightning import LensCallback
    from gradlens.integrations.transformers import LensTrainerCallback

    _IMPORT_ERROR = None
except ImportError as err:  # collected (and deselected) by the default run
    _IMPORT_ERROR = err
    TrainerCallback = object
    L = None

import oracle as O

pytestmark = pytest.mark.frameworks
KEY = "accumulation_check"


@pytest.fixture(autouse=True)
def _frameworks_present():
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR


K, B, T, V, N_TOTAL = 3, 4, 5, 11, 35  # windows of 3 micro-batches of 4; the last is [4, 4, 3]


def _rel(a: dict, b: dict) -> float:
    num = sum(float((a[q] - b[q]).double().square().sum()) for q in b)
    return math.sqrt(num / sum(float(b[q].double().square().sum()) for q in b))


def _split(n: int) -> list[int]:
    sizes = [B] * (n // B) + ([n % B] if n % B else [])
    return sizes


# ---------------------------------------------------------------- the Hugging Face Trainer
class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.head = nn.Linear(6, V)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.emb(input_ids)))
        out = {"logits": logits}
        if labels is not None:  # a token-mean over the micro-batch's counted tokens
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


class KwLM(TinyLM):
    """Takes ``num_items_in_batch``: the Trainer's window objective (summed token losses over
    the window's counted tokens)."""

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        if num_items_in_batch is None:
            return super().forward(input_ids, labels)
        out = super().forward(input_ids)
        out["loss"] = F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                      reduction="sum") / num_items_in_batch
        return out


class Snapshots(TrainerCallback):
    def __init__(self):
        self.states = []

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.states.append(copy.deepcopy(model.state_dict()))


def _lm_data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N_TOTAL, T), generator=g)
    labels = torch.randint(0, V, (N_TOTAL, T), generator=g)
    keep = torch.randint(1, T + 1, (N_TOTAL,), generator=g)  # ragged: unequal counted tokens
    labels = labels.masked_fill(torch.arange(T)[None, :] < (T - keep)[:, None], -100)
    return ids, labels


def _lm_grads(model0, state, ids, labels, sizes):
    """(g_tok, g_opt of the per-micro-batch token mean / K) at ``state``."""
    m = copy.deepcopy(model0)
    m.load_state_dict(state)
    params = dict(m.named_parameters())

    def ce(i, j, reduction):
        logits = TinyLM.forward(m, ids[i:j])["logits"]
        return F.cross_entropy(logits.flatten(0, 1), labels[i:j].flatten(), ignore_index=-100, reduction=reduction)

    whole = ce(0, len(ids), "mean")
    bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
    per_k = sum(ce(bounds[k], bounds[k + 1], "mean") for k in range(len(sizes))) / len(sizes)
    g_tok = dict(zip(params, torch.autograd.grad(whole, list(params.values()))))
    g_opt = dict(zip(params, torch.autograd.grad(per_k, list(params.values()))))
    return g_tok, g_opt


@pytest.mark.parametrize("window_normalised", [True, False], ids=["num_items_in_batch", "token-mean-over-K"])
def test_trainer_normalisations(tmp_path, window_normalised):
    torch.manual_seed(0)
    model = (KwLM() if window_normalised else TinyLM()).double()
    model0 = copy.deepcopy(model)
    ids, labels = _lm_data()
    ds = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B, gradient_accumulation_steps=K,
        num_train_epochs=1, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd", weight_decay=0.0,
        max_grad_norm=0.05, train_sampling_strategy="sequential", report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True,
    )
    snaps = Snapshots()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[snaps])
    assert trainer.model_accepts_loss_kwargs == window_normalised
    cb = LensTrainerCallback(trainer, [AccumulationCheck(), GradNorm()])
    with pytest.warns(RuntimeWarning) if not window_normalised else _nothing():
        trainer.train()
    recs = cb.records
    n = K * B
    assert len(recs) == 3
    for t, rec in enumerate(recs):
        v = rec[KEY]
        assert v["clip_factor"] < 1  # the Trainer clipped: told apart
        lo, hi = t * n, min((t + 1) * n, N_TOTAL)
        g_tok, g_opt = _lm_grads(model0, snaps.states[t], ids[lo:hi], labels[lo:hi], _split(hi - lo))
        if window_normalised:
            assert v["rel_error"] < 1e-12 and v["cause"] is None and v["reference"] == "samples"
            O.close(v["grad_norm_window"], math.sqrt(sum(float(g.square().sum()) for g in g_tok.values())), rtol=1e-9)
        else:
            assert v["reference"] == "tokens"
            O.close(v["rel_error"], _rel(g_opt, g_tok), rtol=1e-9)
            assert v["cause"].startswith("unequal token counts under a per-micro-step token mean")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------- Lightning and Accelerate
def _cls_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TOTAL, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N_TOTAL,), generator=g)
    return x, y


def _check_windows(recs, states, model0, x, y, prefix=""):
    """Windows 0, 1 ([4, 4, 4]): round-off; window 2 ([4, 4, 3], the loss divided by K): the
    oracle's value and the cause."""
    n = K * B
    assert [r.num_samples for r in recs] == [12, 12, 11]
    for t, rec in enumerate(recs):
        v = rec[KEY]
        lo, hi = t * n, min((t + 1) * n, N_TOTAL)
        gs = O.per_sample(model0, {k[len(prefix):]: s for k, s in states[t].items() if k.startswith(prefix)},
                          lambda out, c: F.cross_entropy(out, c), x[lo:hi], y[lo:hi])
        g = {q: s.mean(0) for q, s in gs.items()}
        sizes = _split(hi - lo)
        bounds = [0] + torch.tensor(sizes).cumsum(0).tolist()
        g_opt = {q: sum(s[bounds[k]:bounds[k + 1]].mean(0) for k in range(len(sizes))) / len(sizes) for q, s in gs.items()}
        if t < 2:
            assert v["rel_error"] < 1e-12 and v["cause"] is None
        else:
            O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-9)
            assert v["cause"].startswith("unequal micro-batches under loss / K: the window's 3 micro-batches of [4, 4, 3]")


if L is not None:
    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
            self.loss_fn = gradlens.extend(nn.CrossEntropyLoss())

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.loss_fn(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    class NetSnapshots(L.Callback):
        def __init__(self):
            self.states = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx % K == 0:
                self.states.append(copy.deepcopy(pl_module.net.state_dict()))


def test_lightning_accumulate_grad_batches_with_clipping(tmp_path):
    torch.manual_seed(0)
    model = Net()
    net0 = copy.deepcopy(model.net).double()
    x, y = _cls_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False)
    cb, snaps = LensCallback([AccumulationCheck(), GradNorm()]), NetSnapshots()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_epochs=1, precision="64-true", accumulate_grad_batches=K,
        gradient_clip_val=0.05, callbacks=[snaps, cb], logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    with pytest.warns(RuntimeWarning, match="AccumulationCheck: .*unequal micro-batches under loss / K"):
        trainer.fit(model, loader)
    assert all(r[KEY]["clip_factor"] < 1 for r in cb.records)
    _check_windows(cb.records, snaps.states, net0, x, y)


def test_accelerate_accumulate_with_clipping():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    model0 = copy.deepcopy(model)
    x, y = _cls_data()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=B, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    accelerator = Accelerator(gradient_accumulation_steps=K, cpu=True)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=optimizer)
    states, start = [], True
    with pytest.warns(RuntimeWarning, match="AccumulationCheck: .*unequal micro-batches under loss / K"):
        for xb, yb in loader:
            if start:
                states.append(copy.deepcopy(model.state_dict()))
                start = False
            with accelerator.accumulate(model):
                loss = loss_fn(model(xb), yb)
                with lens.capture():
                    accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.05)
                optimizer.step()
                optimizer.zero_grad()
            start = accelerator.sync_gradients
    lens.close()
    assert all(r[KEY]["clip_factor"] < 1 for r in lens.records)
    _check_windows(lens.records, states, model0, x, y)
