"""The slips real training loops make (issue 39), each exact against the float64 oracle or
refused with a fix that works as written:

- ``torch.compile(model)`` runs the forward while the Lens has the plain module (a GPT-style
  model, float32 and float64): no crash, the traced window and the eager ones exact;
- ``capture(multiplier=, loss=)``: one meaning each; a stated factor that gradlens also measures
  is refused (CPU at once, an accelerator's device path when the window closes), every
  documented combination exact;
- a Lens built (or its state lost) mid-window of a GradientAccumulateOptimizer waits for the
  next window and says so, with and without a log;
- the messages name the real cause: a merge ended by the process group's shorter timeout, inf/nan
  in a window without a GradScaler, ``load_log`` on a line without ``"step"``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import GradientAccumulateOptimizer, Lens, load_log
from gradlens.core.sync import forced_device_paths
from gradlens.instruments import AccumulationCheck, BatchL2, GradNorm

import oracle as O
import nanogpt


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------- torch.compile, the plain module
def _gpt_oracle(model0, state, x, y):
    """batch_l2 [N] and grad_norm of one micro-batch of a token-mean loss with every target
    counted: g_n is the gradient of sequence n's own token mean."""

    def seq_loss(m, i):
        logits, _ = m(x[i:i + 1])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y[i].view(-1))

    gs = O.per_sample_loop(model0, state, seq_loss, x.shape[0])
    return O.norm_set(gs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_forward_with_the_lens_on_the_plain_module(dtype):
    """nanoGPT's names: ``unoptimized_model`` to the Lens, ``model = torch.compile(model)`` for the
    forward. The first tracked window is traced with gradlens' hooks (its derived tensors'
    per-sample VJPs pass a compiled backward: taken one sample at a time), the next run eagerly;
    every window equals the oracle."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model0 = nanogpt.GPT().to(dtype)
    unoptimized_model = gradlens.extend(copy.deepcopy(model0))
    model = torch.compile(unoptimized_model)
    opt = torch.optim.AdamW(unoptimized_model.parameters(), lr=1e-3)
    lens = Lens(unoptimized_model, [BatchL2(), GradNorm()], optimizer=opt)
    rtol = 1e-9 if dtype == torch.float64 else 2e-4
    for window in range(2):
        (x, y), = nanogpt.batches([3], seed=window)
        state = _state(unoptimized_model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, loss = model(x, y)
            with lens.capture():
                loss.backward()
        if window == 0:
            assert any("Give the Lens the compiled module" in str(w.message) for w in caught)
        opt.step()
        opt.zero_grad()
        rec = lens.records[-1]
        o = _gpt_oracle(model0.double(), {k: v.double() for k, v in state.items()}, x, y)
        O.close(rec["batch_l2"], o["batch_l2"], rtol=rtol, atol=0)
        O.close(rec["grad_norm"], o["grad_norm"], rtol=rtol, atol=0)
    lens.close()
    torch._dynamo.reset()


# ---------------------------------------------------------------- multiplier= and loss=
K = 3


def _mlp_loop(named_of, capture_of, backward_of, *, scaler=None, sizes=(4, 2, 6), device_paths=False):
    """One window of micro-batches ``sizes``: ``named_of(raw, b)`` the tensor the capture names
    (``raw``: the micro-batch's mean MSE, computed outside the model), ``capture_of(named, b)``
    the capture's arguments, ``backward_of(named)`` what is backpropagated. Returns the Lens, its
    optimizer, model, the model's copy before extend, the window's data and start state."""
    model0 = O.make_mlp(0)
    model = gradlens.extend(copy.deepcopy(model0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [BatchL2(), GradNorm()], optimizer=opt, grad_scaler=scaler)
    x, y = O.make_data(sum(sizes))
    state = _state(model)
    i = 0
    with (forced_device_paths() if device_paths else torch.enable_grad()):
        for b in sizes:
            named = named_of(F.mse_loss(model(x[i:i + b]), y[i:i + b]), b)
            i += b
            with lens.capture(**capture_of(named, b)):
                backward_of(named).backward()
    return lens, opt, model, model0, x, y, state


def _raw(raw, b):
    return raw


def _exact(lens, model0, x, y, state, loss_known=True):
    rec = lens.records[-1]
    o = O.norm_set(O.per_sample(model0, state, lambda out, t: F.mse_loss(out, t), x, y))
    O.close(rec["batch_l2"], o["batch_l2"])
    O.close(rec["grad_norm"], o["grad_norm"])
    if loss_known:
        m = copy.deepcopy(model0)
        m.load_state_dict(state)
        O.close(rec["loss"], F.mse_loss(m(x), y))
    return rec


_TWICE = (r"lens\.capture\(multiplier=0\.333333, loss=\.\.\.\): gradlens measured the factor 0\.333333 between "
          r"loss and the backward .* it would be divided out twice\. .*Drop multiplier=: "
          r"lens\.capture\(reduction='mean', loss=loss\)\. This window's statistics are dropped")


def test_a_stated_factor_that_is_also_measured_is_refused_and_the_fix_is_exact():
    with pytest.raises(ValueError, match=_TWICE):
        _mlp_loop(_raw, lambda raw, b: dict(reduction="mean", multiplier=1 / K, loss=raw), lambda raw: raw / K)
    # the fix as the message writes it
    lens, opt, model, model0, x, y, state = _mlp_loop(_raw, lambda raw, b: dict(reduction="mean", loss=raw),
                                                       lambda raw: raw / K)
    opt.step()
    _exact(lens, model0, x, y, state)


def test_a_stated_factor_times_the_grad_scalers_scale_is_refused():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    with pytest.raises(ValueError, match=_TWICE.replace("the factor 0\\.333333", "the factor 85\\.3333")):
        _mlp_loop(_raw, lambda raw, b: dict(reduction="mean", multiplier=1 / K, loss=raw),
                  lambda raw: scaler.scale(raw / K), scaler=scaler)


def test_on_an_accelerator_the_refusal_comes_when_the_window_closes():
    lens, opt, model, *_ = _mlp_loop(_raw, lambda raw, b: dict(reduction="mean", multiplier=1 / K, loss=raw),
                                     lambda raw: raw / K, device_paths=True)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=_TWICE):
        opt.step()  # the step pre-hook refuses before the update
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert lens.records == [] and lens.step == 0


def test_the_documented_combinations_are_exact():
    n = 12
    cases = {
        # a loop's loss / K, the loss named: the 1/K measured
        "loss=": (_raw, lambda raw, b: dict(reduction="mean", loss=raw), lambda raw: raw / K, True),
        # a loop's loss / K that gradlens does not see: stated
        "multiplier= alone": (_raw, lambda raw, b: dict(reduction="mean", multiplier=1 / K), lambda raw: raw / K,
                              False),
        # a declared window objective (the Trainer's): the named loss is B_k / N times the micro-step's mean
        "window objective": (lambda raw, b: raw * b / n, lambda share, b: dict(reduction="mean", loss=share,
                                                                              multiplier=b / n),
                             lambda share: share, True),
        # that objective times a fixed loss scale on its way to backward: 256 measured, B_k / N stated
        "window objective * 256": (lambda raw, b: raw * b / n, lambda share, b: dict(reduction="mean", loss=share,
                                                                                    multiplier=b / n),
                                   lambda share: share * 256.0, True),
    }
    for name, (named_of, capture_of, backward_of, loss_known) in cases.items():
        lens, opt, model, model0, x, y, state = _mlp_loop(named_of, capture_of, backward_of)
        opt.step()
        rec = _exact(lens, model0, x, y, state, loss_known)
        assert (rec.values.get("loss") is None) == (not loss_known), name


# ---------------------------------------------------------------- a Lens built mid-window
@pytest.mark.parametrize("with_log", [False, True])
def test_a_lens_built_mid_window_waits_for_the_next_window(with_log, tmp_path):
    model0 = O.make_mlp(0)
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
    x, y = O.make_data(12)
    loss_fn(model(x[:4]), y[:4]).backward()  # the resumed run's first micro-step, before the Lens
    opt.step(num_samples=4)
    opt.zero_grad()
    log = str(tmp_path / "log.jsonl") if with_log else None
    lens = Lens(model, [BatchL2(), GradNorm(), AccumulationCheck()], optimizer=opt, log=log)
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2 + 3 * 2):  # the rest of window 0, then windows 1 and 2
            if opt.micro_step == 0:
                states.append(_state(model))
            b, c = 4, (i + 1) % 3  # each window's micro-steps: the chunks 0, 1, 2 of x
            loss = loss_fn(model(x[c * b:(c + 1) * b]), y[c * b:(c + 1) * b])
            with lens.capture():
                loss.backward()
            opt.step(num_samples=b)
            opt.zero_grad()
    msgs = [str(w.message) for w in caught if "GradientAccumulateOptimizer is inside a window" in str(w.message)]
    assert len(msgs) == 1
    assert msgs[0].startswith("the GradientAccumulateOptimizer is inside a window (1 of its 3 micro-steps folded, "
                              "after 0 updates) that this Lens did not see from its start")
    assert "window 0 covers only part of that update, so it is not recorded" in msgs[0]
    assert "the Lens records from window 1" in msgs[0]
    assert [(r.step, r.num_samples, r.micro_steps) for r in lens.records] == [(1, 12, 3), (2, 12, 3)]
    for rec, state in zip(lens.records, states):
        o = O.norm_set(O.per_sample(model0, state, lambda out, t: F.mse_loss(out, t), x, y))
        O.close(rec["batch_l2"], o["batch_l2"])
        O.close(rec["grad_norm"], o["grad_norm"])
        assert rec["accumulation_check"]["rel_error"] < 1e-14
    lens.close()
    if with_log:
        assert [(r.step, r.num_samples, r.micro_steps) for r in load_log(log)] == [(1, 12, 3), (2, 12, 3)]


def test_a_window_loaded_mid_window_without_the_lens_state_waits_too():
    """The Lens built first, then the optimizer's mid-window state loaded (a resume that lost the
    Lens's state): the rest of that window is not recorded either."""
    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    x, y = O.make_data(4)
    loss_fn(model(x), y).backward()
    opt.step(num_samples=4)
    saved = copy.deepcopy(opt.state_dict())  # mid-window
    opt.zero_grad()
    fresh = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    lens = Lens(model, [GradNorm()], optimizer=fresh)
    fresh.load_state_dict(saved)
    with pytest.warns(RuntimeWarning, match=r"inside a window \(1 of its 2 micro-steps folded.*window 0 covers only part"):
        for _ in range(3):
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
            fresh.step(num_samples=4)
            fresh.zero_grad()
    assert [(r.step, r.micro_steps) for r in lens.records] == [(1, 2)]


# ---------------------------------------------------------------- the messages
def _pg_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=3))
    done = os.path.join(out_dir, "done")
    model = gradlens.extend(nn.Linear(4, 2))
    lens = Lens(model, [GradNorm()], timeout=60)  # longer than the process group's
    if rank == 0:
        loss = gradlens.extend(nn.MSELoss())(model(torch.randn(3, 4)), torch.randn(3, 2))
        with lens.capture():
            loss.backward()
        t0 = time.monotonic()
        try:
            lens.flush()
            result = ("no error", 0.0)
        except RuntimeError as err:
            result = (str(err), time.monotonic() - t0)
        torch.save(result, os.path.join(out_dir, "rank0.pt"))
        open(done, "w").close()
    else:  # never enters the window's merge
        while not os.path.exists(done):
            time.sleep(0.05)
    os._exit(0)


def test_a_merge_ended_by_the_process_groups_shorter_timeout_says_so():
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_pg_worker, 2, out_dir)
        msg, took = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    assert msg.startswith("the merge of window 0 across ranks failed after 3.0 s, before the Lens's timeout=60 s: "
                          "the process group's own timeout (3 s) is shorter and ends every wait first"), msg
    assert "raise the process group's timeout (init_process_group(..., timeout=timedelta(seconds=...))), " \
           "not Lens(timeout=...)" in msg
    assert 2.0 < took < 10.0


def test_inf_in_the_input_without_a_grad_scaler_blames_the_data():
    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [BatchL2(), GradNorm()], optimizer=opt)
    x, y = O.make_data(4)
    x[1, 2] = float("inf")
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    with pytest.warns(RuntimeWarning) as caught:
        opt.step()
    msg = " ".join(str(w.message) for w in caught)
    assert "and so did the gradient the optimizer stepped with (p.grad): this window's inputs, loss or " \
           "parameters were not finite (no GradScaler skipped this step" in msg
    assert "grad_scaler=" not in msg


def test_a_window_a_grad_scaler_skipped_still_names_the_grad_scaler():
    """A GradScaler the Lens does not know skips a step (inf): that window merges into the next,
    whose record holds inf while the optimizer stepped with a finite gradient."""
    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    lens = Lens(model, [BatchL2(), GradNorm()], optimizer=opt)
    x, y = O.make_data(4)
    bad = x.clone()
    bad[0, 0] = float("inf")
    caught = []
    for inputs in (bad, x):
        loss = loss_fn(model(inputs), y)
        with lens.capture():
            scaler.scale(loss).backward()
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            scaler.step(opt)  # skipped the first time: no optimizer step, the window goes on
        scaler.update()
        opt.zero_grad()
        caught += [str(w.message) for w in got]
    msg = " ".join(caught)
    assert "although the optimizer updated with a finite gradient: if a GradScaler skipped an earlier step, that " \
           "window was merged into this one; pass Lens(..., grad_scaler=scaler)" in msg


def test_load_log_names_the_missing_fields_of_a_line(tmp_path):
    path = str(tmp_path / "log.jsonl")
    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [GradNorm()], optimizer=opt, log=path)
    x, y = O.make_data(4)
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    opt.step()
    lens.close()
    with open(path, "a") as f:
        f.write(json.dumps({"loss": 1.5, "epoch": 3}) + "\n")
    with pytest.warns(UserWarning) as caught:
        records = load_log(path)
    assert len(records) == 1
    msg = str(caught[0].message)
    assert "line 2 (not a gradlens record: no 'step', 'num_samples', 'micro_steps', 'values' (a record line " \
           "holds 'step', 'num_samples', 'micro_steps', 'values'; this one holds 'loss', 'epoch')" in msg
    assert msg.count("not a gradlens record") == 1
