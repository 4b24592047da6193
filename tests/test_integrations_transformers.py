"""Hugging Face Trainer: LensTrainerCallback records == float64 oracle of the same windows.

A tiny model (Embedding + Linear on [B, T, d]) computes its own token-mean cross-entropy; the
real Trainer runs on CPU with ``gradient_accumulation_steps=3``, a sequential sampler and a
float64 model. The oracle: ``torch.func`` per-sample gradients of each sequence's own token-mean
loss (= B * grad of its share of the micro-batch loss, DESIGN.md) at each window's starting
parameters. Run with ``/work/venv-models/bin/python -m pytest -m frameworks``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradlens.instruments import Alpha, BatchL2, GradHist1d, GradNorm, SumGradSquared

try:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradlens.integrations.transformers import LensTrainerCallback

    _IMPORT_ERROR = None
except ImportError as err:  # collected (and deselected) by the default run
    _IMPORT_ERROR = err
    TrainerCallback = object

import oracle as O

pytestmark = pytest.mark.frameworks


@pytest.fixture(autouse=True)
def _frameworks_present():
    """The default run collects this file and deselects it (marker ``frameworks``); when the
    tests do run, a missing framework fails them, never skips them."""
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR

K, B, T, V, N_TOTAL = 3, 4, 5, 11, 35  # windows of 3 micro-batches of 4; the last is [4, 4, 3]
LO, HI, BINS = -0.3, 0.3, 32


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, 6)
        self.head = nn.Linear(6, V)

    def forward(self, input_ids, labels=None):
        logits = self.head(torch.tanh(self.emb(input_ids)))  # [B, T, V]
        out = {"logits": logits}
        if labels is not None:  # the model's own loss: token-mean cross-entropy
            out["loss"] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


class Snapshots(TrainerCallback):
    def __init__(self):
        self.states = []

    def on_step_begin(self, args, state, control, model=None, **kw):  # once per window
        self.states.append(copy.deepcopy(model.state_dict()))


def _data():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (N_TOTAL, T), generator=g)
    labels = torch.randint(0, V, (N_TOTAL, T), generator=g)
    return ids, labels


def _seq_loss(out, labels):
    return F.cross_entropy(out["logits"].flatten(0, 1), labels.flatten())


def _train(tmp_path, instruments, **kw):
    torch.manual_seed(0)
    model = TinyLM().double()
    model0 = copy.deepcopy(model)
    ids, labels = _data()
    ds = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B,
        gradient_accumulation_steps=K, num_train_epochs=1, learning_rate=0.5,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        train_sampling_strategy="sequential", report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True,
    )
    snaps = Snapshots()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[snaps])
    cb = LensTrainerCallback(trainer, instruments, **kw)
    trainer.train()
    return cb, snaps.states, model0, ids, labels, trainer


def test_trainer_records_equal_oracle(tmp_path):
    """model_accepts_loss_kwargs is False (no **kwargs): the per-micro-batch mean, / K."""
    insts = [BatchL2(), SumGradSquared(), GradNorm(), GradHist1d(bins=BINS, range=(LO, HI))]
    cb, states, model0, ids, labels, trainer = _train(tmp_path, insts)
    recs = cb.records
    n = K * B
    windows = [(ids[s:s + n], labels[s:s + n]) for s in range(0, N_TOTAL, n)]
    assert len(recs) == len(windows) == len(states) == 3
    assert [r.step for r in recs] == [0, 1, 2]
    assert [r.micro_steps for r in recs] == [3, 3, 3]
    assert [r.num_samples for r in recs] == [12, 12, 11]
    # the parameters moved between windows (so each window's oracle point matters)
    assert not torch.equal(states[0]["head.weight"], states[1]["head.weight"])
    for t, rec in enumerate(recs):
        gs = O.per_sample(model0, states[t], _seq_loss, *windows[t])
        o = O.norm_set(gs)
        O.close(rec["batch_l2"], o["batch_l2"])
        O.close(rec["grad_norm"], o["grad_norm"])
        assert sorted(rec["sum_grad_squared"]) == sorted(o["sum_grad_squared"])
        for name, v in o["sum_grad_squared"].items():
            O.close(rec["sum_grad_squared"][name], v)
        counts, low, high = O.hist_counts(gs, LO, HI, BINS)
        h = rec["grad_hist_1d"]
        assert torch.equal(h.counts, counts) and (h.clamped_low, h.clamped_high) == (low, high)
        assert (low, high) != (0, 0) or counts[0] + counts[-1] < counts.sum()
    # the scalars went through trainer.log: log_history at the Trainer's step (updates done)
    hist = {e["step"]: e for e in trainer.state.log_history if "gradlens/grad_norm" in e}
    assert sorted(hist) == [1, 2, 3]
    own = {e["step"]: e for e in trainer.state.log_history if "loss" in e}
    assert sorted(own) == [1, 2, 3]  # the Trainer's own entries stay next to gradlens'
    for rec in recs:
        assert {"grad_norm", "learning_rate"} <= set(own[rec.step + 1])
    for rec in recs:
        assert hist[rec.step + 1]["gradlens/grad_norm"] == pytest.approx(float(rec["grad_norm"]), rel=1e-12)
        assert hist[rec.step + 1]["gradlens/grad_hist_1d/clamped_low"] == rec["grad_hist_1d"].clamped_low


def test_trainer_refuses_alpha_and_says_why(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    trainer = Trainer(model=TinyLM(), args=args, train_dataset=[])
    with pytest.raises(ValueError, match=r"cannot run Alpha.*per.*loss|Alpha: it needs every sample"):
        LensTrainerCallback(trainer, [GradNorm(), Alpha()])


class KwLM(TinyLM):
    """Takes ``num_items_in_batch`` as Hugging Face models do: the Trainer then passes the
    window's label-token count, and the loss is the summed token losses over it."""

    def forward(self, input_ids, labels=None, num_items_in_batch=None, **kwargs):
        if num_items_in_batch is None:
            return super().forward(input_ids, labels)
        out = super().forward(input_ids)
        out["loss"] = F.cross_entropy(
            out["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        ) / num_items_in_batch
        return out


def _token_sum_loss(outputs, labels, num_items_in_batch=None):
    """A ``compute_loss_func`` normalising over the window's label tokens."""
    return F.cross_entropy(
        outputs["logits"].flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    ) / num_items_in_batch


def _ragged_labels(labels):
    """Each sequence keeps its last 1..T label tokens (the others are -100): windows whose
    sequences carry different numbers of label tokens."""
    g = torch.Generator().manual_seed(1)
    keep = torch.randint(1, T + 1, (labels.shape[0],), generator=g)
    pos = torch.arange(T)[None, :]
    return labels.masked_fill(pos < (T - keep)[:, None], -100)


@pytest.mark.parametrize("route", ["model_num_items", "compute_loss_func"])
def test_trainer_window_normalised_loss_equals_oracle(tmp_path, route):
    """The Trainer's default normalisation (the loss of each micro-step = its summed token
    losses / the window's label-token count M, no 1/K): records of that window objective,
    g_n = N * grad L_n (DESIGN.md), against the float64 oracle of the same windows."""
    torch.manual_seed(0)
    model = (KwLM() if route == "model_num_items" else TinyLM()).double()
    model0 = copy.deepcopy(model)
    ids, labels = _data()
    labels = _ragged_labels(labels)
    ds = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B,
        gradient_accumulation_steps=K, num_train_epochs=1, learning_rate=0.5,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        train_sampling_strategy="sequential", report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True,
    )
    snaps = Snapshots()
    extra = {"compute_loss_func": _token_sum_loss} if route == "compute_loss_func" else {}
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[snaps], **extra)
    assert trainer.model_accepts_loss_kwargs == (route == "model_num_items")
    cb = LensTrainerCallback(trainer, [BatchL2(), GradNorm(), GradHist1d()])  # the README's
    trainer.train()
    recs = cb.records
    n = K * B
    windows = [(ids[s:s + n], labels[s:s + n]) for s in range(0, N_TOTAL, n)]
    assert [r.num_samples for r in recs] == [12, 12, 11] and len(states := snaps.states) == 3
    tokens = [int((w[1] != -100).sum()) for w in windows]
    assert len(set(tokens)) > 1 and len({int(c) for c in (labels != -100).sum(1)}) > 1
    logged = {e["step"]: e for e in trainer.state.log_history if "grad_norm" in e}
    assert sorted(logged) == [1, 2, 3]
    ours = {e["step"]: e for e in trainer.state.log_history if "gradlens/grad_norm" in e}
    assert sorted(ours) == [1, 2, 3]
    for t, rec in enumerate(recs):
        big_n, m = rec.num_samples, tokens[t]

        def share(out, lab, big_n=big_n, m=m):  # N * L_n, L_n = sequence n's token losses / M
            logits = out["logits"].flatten(0, 1)
            ce = F.cross_entropy(logits, lab.flatten(), ignore_index=-100, reduction="sum")
            return big_n * ce / m

        gs = O.per_sample(model0, states[t], share, *windows[t])
        o = O.norm_set(gs)
        O.close(rec["batch_l2"], o["batch_l2"])
        O.close(rec["grad_norm"], o["grad_norm"])
        O.hist_matches(rec["grad_hist_1d"], O.flat(gs), -2.0, 2.0, 100)  # GradHist1d's default range
        # the window objective L = sum_n L_n: gradlens' loss, and the Trainer's logged loss
        with torch.no_grad():
            m0 = copy.deepcopy(model0)
            m0.load_state_dict(states[t])
            out = TinyLM.forward(m0, windows[t][0])
            window_loss = F.cross_entropy(
                out["logits"].flatten(0, 1), windows[t][1].flatten(), ignore_index=-100, reduction="sum"
            ) / m
        O.close(rec["loss"], window_loss)
        assert "window objective" in rec.meta["units"]
        # the Trainer's own entries stay, next to gradlens' at the same step
        entry = logged[rec.step + 1]
        assert {"loss", "grad_norm", "learning_rate"} <= set(entry)
        assert entry["grad_norm"] == pytest.approx(float(rec["grad_norm"]), rel=1e-9)
        assert entry["loss"] == pytest.approx(float(window_loss), rel=1e-6)  # the Trainer sums it in float32
        assert ours[rec.step + 1]["gradlens/grad_norm"] == pytest.approx(entry["grad_norm"], rel=1e-9)


def test_trainer_callback_bad_arguments():
    with pytest.raises(TypeError, match=r"transformers.Trainer"):
        LensTrainerCallback(object(), [GradNorm()])


def test_trainer_gpt2_window_normalised_equals_oracle(tmp_path):
    """A real causal LM (tiny GPT-2, float64 weights) under the Trainer's default
    normalisation, sequences with different label-token counts: records of the window
    objective. GPT-2's loss casts the logits to float32 (transformers' ForCausalLMLoss), so the
    float64 oracle agrees to float32 precision (rtol 1e-5)."""
    from oracle_models import hf_gpt2

    torch.manual_seed(0)
    model = hf_gpt2().double()
    model.loss_type = "ForCausalLM"  # so that the Trainer counts the shifted labels, as the loss uses them
    model0 = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 50, (N_TOTAL, 8), generator=g)
    keep = torch.randint(2, 9, (N_TOTAL,), generator=g)  # 1..7 predicted tokens per sequence
    labels = ids.masked_fill(torch.arange(8)[None, :] >= keep[:, None], -100)
    ds = [{"input_ids": i, "labels": l} for i, l in zip(ids, labels)]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B,
        gradient_accumulation_steps=K, num_train_epochs=1, learning_rate=0.5,
        lr_scheduler_type="constant", optim="sgd", weight_decay=0.0, max_grad_norm=0.0,
        train_sampling_strategy="sequential", report_to="none", save_strategy="no",
        logging_steps=1, use_cpu=True, seed=0, disable_tqdm=True,
    )
    snaps = Snapshots()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[snaps])
    assert trainer.model_accepts_loss_kwargs
    cb = LensTrainerCallback(trainer, [BatchL2(), GradNorm()])
    trainer.train()
    recs, states = cb.records, snaps.states
    assert [r.num_samples for r in recs] == [12, 12, 11] and len(states) == 3
    logged = {e["step"]: e for e in trainer.state.log_history if "grad_norm" in e}
    n = K * B
    for t, rec in enumerate(recs):
        lab = labels[t * n:(t + 1) * n]
        m = int((lab[:, 1:] != -100).sum())  # the Trainer's count: shifted labels

        def loss_n(mod, i, t=t, m=m, big_n=rec.num_samples):  # N * L_n
            logits = mod(input_ids=ids[t * n + i][None]).logits[0, :-1]
            ce = F.cross_entropy(logits, labels[t * n + i, 1:], ignore_index=-100, reduction="sum")
            return big_n * ce / m

        gs = O.per_sample_loop(model0, states[t], loss_n, rec.num_samples)
        o = O.norm_set(gs)
        O.close(rec["batch_l2"], o["batch_l2"], rtol=1e-5, atol=1e-8)
        O.close(rec["grad_norm"], o["grad_norm"], rtol=1e-5, atol=1e-8)
        assert logged[rec.step + 1]["grad_norm"] == pytest.approx(float(rec["grad_norm"]), rel=1e-6)


def test_trainer_window_sample_count_mismatch_is_an_error(tmp_path):
    """If the window's sample count read from the Trainer's batches disagrees with the samples
    the model saw, the per-sample units would be wrong: an error stops the run at that window."""

    class Miscount(TrainerCallback):  # stands in for batches whose first axis is not the samples
        def on_step_begin(self, args, state, control, **kw):
            lens_cb._window_samples += 1

    torch.manual_seed(0)
    ids, labels = _data()
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_train_batch_size=B,
        gradient_accumulation_steps=K, max_steps=1, save_strategy="no", disable_tqdm=True,
    )
    trainer = Trainer(model=KwLM().double(), args=args, callbacks=[Miscount()],
                      train_dataset=[{"input_ids": i, "labels": l} for i, l in zip(ids, labels)])
    lens_cb = LensTrainerCallback(trainer, [GradNorm()])
    with pytest.raises(RuntimeError, match=r"held 12 samples by the model's input but the Trainer's batches held 13"):
        trainer.train()


def test_the_window_units_note_keeps_the_contribution_definition():
    """Lens(undefined="contribution") under the Trainer: the callback's units note (window
    objective) keeps the definition that record.meta["contribution"] refers to."""
    from gradlens.core.records import Record
    from gradlens.integrations.transformers import _UnitsNote

    class Callback:
        _units = "window"

    for meta, named in (({"contribution": {"0.weight": "'1' (BatchNorm1d with batch statistics)"}}, True), ({}, False)):
        record = Record(0, 4, 2, {})
        record.meta.update(meta, units="g_n = B_k * d(micro-step objective)_n (mean objective)")
        _UnitsNote(Callback()).write(record)
        assert "window objective" in record.meta["units"]
        assert ("not per-sample gradients" in record.meta["units"]) is named
