"""Long runs (issue 12): no leak, logs that survive a restart, a Lens that resumes."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from windows import all_instruments, run_windows


def test_no_graph_or_layer_tensor_outlives_its_micro_step():
    """A few hundred tracked micro-steps (extended loss, functional loss, GradScaler, every
    instrument, keep_records=False): the input, every layer output and the loss of a finished
    micro-step are freed (weak references die), also through lens.close()."""
    torch.manual_seed(0)
    model = gradlens.extend(nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    lens = Lens(model, all_instruments(bins=8, bins_2d=(4, 4), leave_out=("NoiseScaleTwoBatch",)), optimizer=opt,
                keep_records=False)
    refs = []
    for i in range(300):
        x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
        hidden = model[0](x)
        out = model[2](model[1](hidden))
        functional = i % 3 == 2
        loss = nn.functional.mse_loss(out, torch.zeros_like(out)) if functional else loss_fn(out, y)
        losses = nn.functional.cross_entropy(out.detach(), y, reduction="none")
        with lens.capture(reduction="mean" if functional else None, losses=losses, loss=loss if functional else None):
            scaler.scale(loss).backward()
        if i % 2 == 1:
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        refs += [weakref.ref(t) for t in (x, hidden, out, loss)]
        del x, y, hidden, out, loss, losses
    gc.collect()
    alive = sum(r() is not None for r in refs[:-8])
    assert alive == 0, f"{alive} tensors of finished micro-steps are still alive"
    lens.close()
    gc.collect()
    assert sum(r() is not None for r in refs) <= 4  # at most the last loss call's tensors


# --------------------------------------------------------------------------- logs


def _resnet18_shapes() -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of torchvision's resnet18 (11.7 M parameters)."""
    shapes = {"conv1.weight": (64, 3, 7, 7), "bn1.weight": (64,), "bn1.bias": (64,)}
    cin = 64
    for li, cout in enumerate((64, 128, 256, 512), start=1):
        for b in range(2):
            p = f"layer{li}.{b}"
            first_in = cin if b == 0 else cout
            shapes[f"{p}.conv1.weight"] = (cout, first_in, 3, 3)
            shapes[f"{p}.conv2.weight"] = (cout, cout, 3, 3)
            for bn in ("bn1", "bn2"):
                shapes[f"{p}.{bn}.weight"] = shapes[f"{p}.{bn}.bias"] = (cout,)
            if b == 0 and cin != cout:
                shapes[f"{p}.downsample.0.weight"] = (cout, cin, 1, 1)
                shapes[f"{p}.downsample.1.weight"] = shapes[f"{p}.downsample.1.bias"] = (cout,)
        cin = cout
    shapes["fc.weight"], shapes["fc.bias"] = (1000, 512), (1000,)
    return shapes


def test_resnet18_sized_record_is_small_by_default_and_full_where_asked(tmp_path):
    from gradlens.core.records import Hist1d, Record
    from gradlens.output.sinks import JsonlSink, load_log

    shapes = _resnet18_shapes()
    assert 11_600_000 < sum(torch.Size(s).numel() for s in shapes.values()) < 11_700_000
    gen = torch.Generator().manual_seed(0)
    values = {
        "loss": 2.3,
        "batch_l2": torch.rand(128, dtype=torch.float64, generator=gen),
        "sum_grad_squared": {k: torch.rand(s, generator=gen) for k, s in shapes.items()},
        "grad_norm": 0.7,
        "norm_test": 1.2,
        "grad_hist_1d": Hist1d(torch.arange(100), torch.linspace(-1, 1, 101, dtype=torch.float64)),
    }
    record = Record(0, 128, 4, values)
    path = tmp_path / "run.jsonl"
    with JsonlSink(path) as sink:
        sink.write(record)
    assert path.stat().st_size < 200_000, path.stat().st_size
    (back,) = load_log(path)
    assert back["sum_grad_squared"]["fc.weight"].shape == (1000, 512)
    path2 = tmp_path / "full.jsonl"
    with JsonlSink(path2, full=["sum_grad_squared"]) as sink:
        sink.write(record)
    assert path2.stat().st_size < 200_000
    (back,) = load_log(path2)
    assert back == record


def _train(lens_kwargs, windows, model_seed=0, start_window=0):
    torch.manual_seed(model_seed)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    gen = torch.Generator().manual_seed(1)
    data = [[(torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen))] for _ in range(windows)]
    return run_windows(model, data, [BatchL2(), GradNorm(), SumGradSquared()], loss="mse",
                       optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), **lens_kwargs).lens


def test_lens_log_resumes_and_never_truncates(tmp_path):
    from gradlens.output.sinks import load_log

    path = tmp_path / "run.jsonl"
    first = _train({"log": path}, 10)
    assert [r.step for r in load_log(path)] == list(range(10))
    # a run restarted without a checkpoint: appended as a new run whose steps count from 0
    # (issue 20: it used to continue the old step numbers, so its records carried wrong steps)
    lens = _train({"log": path}, 3)
    assert [r.step for r in lens.records] == [0, 1, 2]
    with pytest.warns(UserWarning, match=r"holds 2 runs .*returning the last \(3 records\).*run=0"):
        last = load_log(path)
    assert [(r.step, r["grad_norm"]) for r in last] == [(r.step, r["grad_norm"]) for r in lens.records]
    old = load_log(path, run=0)  # the old run is kept, told apart
    assert [(r.step, r["grad_norm"]) for r in old] == [(r.step, r["grad_norm"]) for r in first.records]
    both = load_log(path, run="all")
    assert [(r.step, r.meta["run"]) for r in both] == [(s, 0) for s in range(10)] + [(s, 1) for s in range(3)]
    _train({"log": path, "log_mode": "append"}, 1)  # the older name: the same
    assert [r.step for r in load_log(path, run=2)] == [0]
    assert len(path.read_text().splitlines()) == 10 + 3 + 1 + 2  # the records, two run headers
    _train({"log": path, "log_mode": "overwrite"}, 2)  # only when asked
    assert [r.step for r in load_log(path)] == [0, 1]
    with pytest.raises(ValueError, match=r"load_log\(run=1\): the log .* holds 1 run\(s\); use run=0..0"):
        load_log(path, run=1)
    with pytest.raises(TypeError, match=r"load_log\(run='last'\) takes a run index"):
        load_log(path, run="last")
    with pytest.raises(ValueError, match="log_mode must be 'resume', 'append' or 'overwrite'"):
        _train({"log": path, "log_mode": "w"}, 1)


def test_keep_records_int_keeps_the_last_n():
    assert [r.step for r in _train({"keep_records": 3}, 7).records] == [4, 5, 6]
    assert len(_train({"keep_records": True}, 4).records) == 4
    assert _train({"keep_records": False}, 4).records == []
    assert _train({"keep_records": 0}, 2).records == []
    with pytest.raises(ValueError, match=r"keep_records must be True, False or an int >= 0"):
        _train({"keep_records": -1}, 1)


# --------------------------------------------------------------------------- Lens.state_dict


def _resume_setup(log, seed):
    torch.manual_seed(seed)  # a fresh process would start from other weights: loaded below
    model = gradlens.extend(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = gradlens.GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), accum_steps=3)
    instruments = all_instruments(0.1, 1, bins=6, bins_2d=(3, 4), leave_out=("NoiseScaleTwoBatch", "OrthoTest"),
                                  GradHist1d={"adapt": "abs_max"}, GradHist2d={"adapt": "min_max"})
    lens = Lens(model, instruments, optimizer=opt, log=log, every=lambda s: s != 3)
    return model, loss_fn, opt, lens


def _micro_batch(i):
    gen = torch.Generator().manual_seed(100 + i)
    b = (4, 2, 5)[i % 3]
    return torch.randn(b, 4, generator=gen), torch.randint(0, 3, (b,), generator=gen)


def _run(model, loss_fn, opt, lens, micro_steps):
    """The micro-batches ``micro_steps`` through the Lens (the accumulating optimizer makes the
    windows of 3)."""
    run_windows(model, [[_micro_batch(i) for i in micro_steps]], lens=lens, loss=loss_fn, optimizer=opt, losses=True,
                fresh_copy=False, close=False)


@pytest.mark.parametrize("stop", [6, 7, 11])  # at a window boundary, after 1 and 2 micro-steps
def test_resumed_lens_gives_the_records_of_the_uninterrupted_run(tmp_path, stop):
    import io

    from gradlens.output.sinks import load_log

    total = 18  # 6 windows of 3 micro-steps; window 3 is not tracked
    full_log = tmp_path / "full.jsonl"
    model, loss_fn, opt, lens = _resume_setup(full_log, 0)
    _run(model, loss_fn, opt, lens, range(total))
    lens.close()
    expected = lens.records

    log = tmp_path / "run.jsonl"
    model, loss_fn, opt, lens = _resume_setup(log, 0)
    _run(model, loss_fn, opt, lens, range(stop))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "lens": lens.state_dict()}, buf)
    first = list(lens.records)
    lens.close(write_pending=False)  # the process stops here
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)

    model, loss_fn, opt, lens = _resume_setup(log, 1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    lens.load_state_dict(ckpt["lens"])
    _run(model, loss_fn, opt, lens, range(stop, total))
    lens.close()
    steps_first = {r.step for r in first}
    resumed = [r for r in first if r.step not in {q.step for q in lens.records}] + lens.records
    assert [r.step for r in resumed] == [r.step for r in expected] == [0, 1, 2, 4, 5]
    for got, want in zip(resumed, expected):
        if got.step in steps_first and "alpha" in want.meta and got.meta != want.meta:
            continue  # the first Lens's copy of the pending record; the log holds the settled one
        assert got == want, got.step
    assert load_log(log) == load_log(full_log)  # the log continues, every record once
    assert any(r["alpha"] is not None for r in load_log(log))


def test_lens_load_state_dict_refuses_another_lens(tmp_path):
    model, loss_fn, opt, lens = _resume_setup(None, 0)
    sd = lens.state_dict()
    other = Lens(gradlens.extend(nn.Sequential(nn.Linear(4, 3))), [BatchL2()])
    with pytest.raises(ValueError, match="has 11 instruments, this Lens 1"):
        other.load_state_dict(sd)
    with pytest.raises(TypeError, match="takes the dict from Lens.state_dict"):
        other.load_state_dict({"step": 1})


# --------------------------------------------------------------------------- GradScaler, plain optim


@pytest.mark.parametrize("tell_lens", [True, False])
def test_plain_optimizer_with_grad_scaler_skipped_window_is_dropped_not_merged(tell_lens):
    """plain torch.optim + GradScaler: the window whose step was skipped on overflow leaves no
    trace; the next record equals the float64 oracle of its own samples."""
    from oracle import flat, per_sample_grads

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**6)
    lens = Lens(model, [BatchL2(), GradNorm()], optimizer=opt,
                grad_scaler=scaler if tell_lens else None)
    gen = torch.Generator().manual_seed(3)
    for w in range(3):
        x = torch.randn(8, 5, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (8,), generator=gen)
        G = flat(per_sample_grads(model, x, y))
        for k, (xb, yb) in enumerate(zip(x.split([3, 5]), y.split([3, 5]))):
            loss = loss_fn(model(xb), yb)
            if w == 1 and k == 1:
                loss = loss * float("inf")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with lens.capture():
                    scaler.scale(loss).backward()  # the scaled loss: the Lens divides it out
            dropped = [str(c.message) for c in caught if "was dropped" in str(c.message)]
            assert len(dropped) == (w == 2 and k == 0 and tell_lens)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            scaler.step(opt)
        merged = [str(c.message) for c in caught if "pass Lens(..., grad_scaler=scaler)" in str(c.message)]
        assert len(merged) == (w == 2 and not tell_lens)  # a clear message, never silence
        scaler.update()
        opt.zero_grad()
        if not tell_lens:
            continue
        if w != 1:
            rec = lens.records[-1]
            assert (rec.num_samples, rec.micro_steps) == (8, 2)
            torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=0)
            assert rec["grad_norm"] == pytest.approx(float(G.mean(0).norm()), rel=1e-10)
    if tell_lens:
        assert len(lens.records) == 2 and lens.skipped_windows == 1
        assert [r.step for r in lens.records] == [0, 1]
