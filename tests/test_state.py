"""Lens checkpoints (gradlens.lens.state, issue 19 item 2 / issue 20): a resumed run gives exactly the
records of the uninterrupted one, and a state of another Lens is refused at load_state_dict."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    Alpha,
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    NoiseScale,
    NoiseScaleTwoBatch,
    SumGradSquared,
)
from gradlens.lens.state import StateDictError

from oracle import flat, hist_oracle, per_sample_grads
from windows import all_instruments, run_windows

SIZES = (4, 1, 3)  # K = 3 unequal micro-steps, N = 8 per window
WINDOWS = 4


def exact_set():
    return all_instruments(0.1, 1, bins=6, bins_2d=(3, 4), leave_out=("NoiseScaleTwoBatch", "InnerTest"),
                           NoiseScale={"per_sample": True}, GradHist1d={"adapt": "abs_max"},
                           GradHist2d={"adapt": "min_max"})


def sampled_set():
    return [
        GradHist1d(bins=6, range=(-0.1, 0.1), adapt="min_max", sample=0.3, seed=3),
        GradHist2d(bins=(3, 4), range=((-1, 1), (-0.1, 0.1)), adapt="abs_max", sample=0.3, seed=4),
        BatchDot(mode="sketch", k=8, seed=5), Alpha(mode="sketch", k=8, seed=6),
        InnerTest(mode="sketch", k=8, seed=7), NoiseScaleTwoBatch(beta=0.5), GradNorm(),
    ]


def light_set():  # the window gradient only: parameter hooks (gradlens.capture.light.ParamTap)
    return [GradNorm(), NoiseScaleTwoBatch(beta=0.5)]


SETS = {"exact": exact_set, "sampled": sampled_set, "light": light_set}


class ListSink:
    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(copy.deepcopy(record))

    def close(self):
        pass


def _mlp(seed=0, out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, out)).double()


def _setup(make, reduction, seed=0):
    """A model, an extended loss, a GradientAccumulateOptimizer over K=3 and a Lens whose
    window 2 is not tracked (a schedule position to keep)."""
    model = gradlens.extend(_mlp(seed))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = gradlens.GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.05), accum_steps=3)
    sink = ListSink()
    lens = Lens(model, make(), optimizer=opt, every=lambda s: s != 2, sinks=[sink])
    return model, loss_fn, opt, lens, sink


def _micro_batch(i):
    gen = torch.Generator().manual_seed(100 + i)
    b = SIZES[i % 3]
    return torch.randn(b, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen)


def _run(model, loss_fn, opt, lens, micro_steps):
    """The micro-batches ``micro_steps`` through the Lens (the accumulating optimizer makes the
    windows of 3)."""
    run_windows(model, [[_micro_batch(i) for i in micro_steps]], lens=lens, loss=loss_fn, optimizer=opt, losses=True,
                fresh_copy=False, close=False)


def _save(model, opt, lens) -> dict:
    """A checkpoint through torch.save and torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "lens": lens.state_dict()}, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# --------------------------------------------------------------------------- round trips


# stop: after window 0 (a boundary; Alpha's record 0 pending), after 1 and 2 micro-steps of
# window 1 (mid-window, record 0 still pending), inside the untracked window 2
@pytest.mark.parametrize("stop", [3, 4, 5, 7])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(SETS))
def test_resumed_run_writes_the_records_of_the_uninterrupted_run(name, reduction, stop):
    total = 3 * WINDOWS
    model, loss_fn, opt, lens, full = _setup(SETS[name], reduction)
    _run(model, loss_fn, opt, lens, range(total))
    lens.close()
    assert [r.step for r in full.records] == [0, 1, 3]

    model, loss_fn, opt, lens, first = _setup(SETS[name], reduction)
    _run(model, loss_fn, opt, lens, range(stop))
    ckpt = _save(model, opt, lens)
    lens.close(write_pending=False)  # the process stops here
    assert ckpt["lens"]["window"] is (stop % 3 != 0 and stop < 6)

    model, loss_fn, opt, lens, second = _setup(SETS[name], reduction, seed=1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    lens.load_state_dict(ckpt["lens"])
    assert lens.step == stop // 3
    _run(model, loss_fn, opt, lens, range(stop, total))
    lens.close()
    resumed = first.records + second.records
    assert [r.step for r in resumed] == [0, 1, 3]
    for got, want in zip(resumed, full.records):
        assert got == want, got.step
    if name == "light":
        assert lens._meter.plan.light and ckpt["lens"]["pending"] is None
        smoothed = [r["noise_scale_two_batch"]["b_simple_smoothed"] for r in resumed]
        assert smoothed[2] != resumed[2]["noise_scale_two_batch"]["b_simple"]  # an average over windows
        return
    assert ckpt["lens"]["pending"] == {3: 0, 4: 0, 5: 0, 7: 1}[stop]  # Alpha's record waits
    alpha = [r.get("alpha") for r in resumed]
    assert alpha[0] is not None and alpha[1] is None  # window 2 untracked: record 1's is missing


@pytest.mark.parametrize("after", [1, 2])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_window_split_by_a_checkpoint_matches_the_float64_oracle(reduction, after):
    """Window 1 is saved after ``after`` of its 3 unequal micro-steps and finished by another
    Lens: its statistics equal those of the per-sample gradients from torch.func."""
    model, loss_fn, opt, lens, _ = _setup(exact_set, reduction)
    _run(model, loss_fn, opt, lens, range(3 + after))
    theta = copy.deepcopy(model)  # accumulating: window 1's parameters until its update
    ckpt = _save(model, opt, lens)
    lens.close(write_pending=False)
    model, loss_fn, opt, lens, _ = _setup(exact_set, reduction, seed=1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    lens.load_state_dict(ckpt["lens"])
    assert set(lens._window.sites) == {"0", "2"}  # the uses measured before the checkpoint (rank merging)
    _run(model, loss_fn, opt, lens, range(3 + after, 6))
    rec = lens.records[0]
    assert (rec.step, rec.num_samples, rec.micro_steps) == (1, 8, 3)

    xs, ys = zip(*(_micro_batch(i) for i in range(3, 6)))
    gs = per_sample_grads(theta, torch.cat(xs), torch.cat(ys))
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    G = flat({q: gs[q] for q in names})
    tol = dict(rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), **tol)
    torch.testing.assert_close(rec["batch_dot"], G @ G.T, **tol)
    for q in names:
        torch.testing.assert_close(rec["sum_grad_squared"][q], gs[q].square().sum(0), **tol)
    h = rec["grad_hist_1d"]
    lo, hi = h.range
    assert (lo, hi) != (-0.1, 0.1)  # adapted after window 0, restored from the checkpoint
    counts, low, high = hist_oracle(G, lo, hi, 6)
    assert torch.equal(h.counts, counts) and (h.clamped_low, h.clamped_high) == (low, high)


def test_every_instrument_state_round_trips_into_a_fresh_instance():
    """After some windows, each instrument's state_dict loads into a new instance with the same
    settings and gives the same state_dict (plain data, through weights_only)."""
    for make in (exact_set, sampled_set):
        model, loss_fn, opt, lens, _ = _setup(make, "mean")
        _run(model, loss_fn, opt, lens, range(6))
        saved = [i.state_dict() for i in lens.instruments]
        buf = io.BytesIO()
        torch.save(saved, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        for inst, fresh, state in zip(lens.instruments, make(), loaded):
            if isinstance(inst, Alpha):  # the last update, kept for the next window
                assert state["direction"] is not None and state["direction"].keys() == set(lens.tracked)
            fresh.load_state_dict(state)
            again = fresh.state_dict()
            assert again.keys() == state.keys(), type(inst).__name__
            for k in state:
                if isinstance(state[k], dict):
                    assert state[k].keys() == again[k].keys()
                    assert all(torch.equal(state[k][q], again[k][q]) for q in state[k])
                else:
                    assert again[k] == state[k], (type(inst).__name__, k)
        lens.close()
    hist = exact_set()[6]
    assert hist.state_dict()["range"] == [-0.1, 0.1]
    assert BatchL2().state_dict() == {}


def test_a_saved_lens_is_plain_data_with_a_header_that_names_instruments_and_parameters(tmp_path):
    model, loss_fn, opt, lens, _ = _setup(lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max")], "mean")
    _run(model, loss_fn, opt, lens, range(4))
    path = tmp_path / "lens.pt"
    torch.save(lens.state_dict(), path)
    sd = torch.load(path, weights_only=True)
    assert sd["version"] == 3 and sd["format"] == "gradlens.Lens"
    kinds = [(e["type"], e["key"]) for e in sd["instruments"]]
    assert kinds == [("BatchL2", "batch_l2"), ("GradHist1d", "grad_hist_1d")]
    assert sd["parameters"] == {
        "names": ["0.weight", "0.bias", "2.weight", "2.bias"],
        "shapes": [[6, 4], [6], [3, 6], [3]],
        "dtypes": ["float64"] * 4,
    }
    assert (sd["step"], sd["window"], sd["pending"]) == (1, True, None)
    assert sd["partial_window"]["stats"][:2] == ("obj", "WindowStats") and sd["pending_record"] is None
    lens.close()
    model, loss_fn, opt, lens, _ = _setup(lambda: [BatchL2()], "mean")
    sd = lens.state_dict()  # at a boundary, nothing pending: no window at all
    assert sd["partial_window"] is None and sd["window"] is False


# --------------------------------------------------------------------------- mismatches


def _saved(instruments, model=None, micro_steps=1):
    lens = run_windows(model if model is not None else _mlp(), [[_micro_batch(i) for i in range(micro_steps)]],
                       instruments, fresh_copy=False, end="none", close=False).lens
    sd = lens.state_dict()
    lens.close()
    return sd


def _fresh(instruments, model=None, **kw):
    return Lens(gradlens.extend(model if model is not None else _mlp()), instruments, **kw)


@pytest.fixture
def no_unpickling(monkeypatch):
    """The header is checked before anything is rebuilt: a mismatch never reaches the partial
    window (nothing is ever unpickled: tests/test_state_safety.py)."""
    from gradlens.lens import state

    def refuse(*a, **k):
        raise AssertionError("the partial window was rebuilt before the header was checked")

    monkeypatch.setattr(state, "_decode", refuse)


def test_another_instrument_order_is_refused_at_load(no_unpickling):
    sd = _saved([BatchL2(), GradNorm()])
    lens = _fresh([GradNorm(), BatchL2()])
    with pytest.raises(ValueError, match=r"the same instruments in another order: saved \[BatchL2 \('batch_l2'\), "
                       r"GradNorm \('grad_norm'\)\], this Lens \[GradNorm .*same instruments in the same order"):
        lens.load_state_dict(sd)


def test_another_instrument_set_is_refused_at_load(no_unpickling):
    sd = _saved([BatchL2(), GradNorm()])
    with pytest.raises(ValueError, match=r"other instruments: saved .*this Lens \[BatchL2 \('batch_l2'\), "
                       "SumGradSquared"):
        _fresh([BatchL2(), SumGradSquared()]).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"has 2 instruments, this Lens 1"):
        _fresh([BatchL2()]).load_state_dict(sd)


def test_another_parameter_shape_is_refused_at_load(no_unpickling):
    sd = _saved([BatchL2(), GradHist1d(bins=4)], model=nn.Sequential(nn.Linear(4, 3)).double())
    lens = _fresh([BatchL2(), GradHist1d(bins=4)], model=nn.Sequential(nn.Linear(4, 5)).double())
    with pytest.raises(ValueError, match=r"parameters of other shapes than in the Lens state_dict: '0.weight' "
                       r"\(3, 4\) saved, \(5, 4\) here; '0.bias' \(3,\) saved, \(5,\) here; build the Lens "
                       "on the model of the saved run"):
        lens.load_state_dict(sd)
    assert lens.step == 0


def test_another_parameter_name_set_is_refused_at_load(no_unpickling):
    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(4, 6)
            self.head = nn.Linear(6, 3)

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    sd = _saved([BatchL2()])
    with pytest.raises(ValueError, match=r"tracks other parameters: saved but not tracked here \['0.bias', "
                       r"'0.weight', '2.bias', '2.weight'\], tracked here but not saved \['body.bias'"):
        _fresh([BatchL2()], model=Named().double()).load_state_dict(sd)
    with pytest.raises(ValueError, match=r"saved but not tracked here \['2.bias', '2.weight'\], tracked here but "
                       r"not saved \[\]; .* same exclude="):
        _fresh([BatchL2()], exclude=["2"]).load_state_dict(sd)


def test_another_dtype_is_refused_at_load(no_unpickling):
    sd = _saved([BatchL2()])
    with pytest.raises(ValueError, match=r"other dtypes than in the Lens state_dict: '0.weight' float64 saved, "
                       r"float32 here; '0.bias' .*; cast the model as in the saved run "
                       r"\(e.g. model.to\(torch.float64\)\)"):
        _fresh([BatchL2()], model=_mlp().float()).load_state_dict(sd)


def test_wrong_version_and_not_a_dict_are_refused():
    sd = _saved([BatchL2()])
    lens = _fresh([BatchL2()])
    with pytest.raises(ValueError, match=r"version 4; this gradlens reads version 3: load it with the gradlens "
                       "that wrote it, or start this Lens afresh"):
        lens.load_state_dict({**sd, "version": 4})
    with pytest.raises(ValueError, match=r"has version 1 .*reads version 3 only. Resume it with the gradlens that "
                       "wrote it, or start this Lens afresh"):
        version_1 = {"version": 1, "step": 2, "skipped_windows": 0, "blob": torch.zeros(3, dtype=torch.uint8)}
        lens.load_state_dict(version_1)
    with pytest.raises(ValueError, match=r"takes the dict from Lens.state_dict\(\), got list"):
        lens.load_state_dict([sd])
    with pytest.raises(TypeError, match=r"takes the dict from Lens.state_dict\(\), got a dict with keys \['model'"):
        lens.load_state_dict({"model": {}, "opt": {}})
    with pytest.raises(ValueError, match=r"malformed entries \['step'\]"):
        lens.load_state_dict({**sd, "step": -1})
    with pytest.raises(ValueError, match=r"format is 'gradlens.Accumulate', not 'gradlens.Lens'"):
        lens.load_state_dict({**sd, "format": "gradlens.Accumulate"})
    with pytest.raises(ValueError, match=r"lacks \['parameters'\]"):
        lens.load_state_dict({k: v for k, v in sd.items() if k != "parameters"})
    cut = {**sd, "partial_window": {**sd["partial_window"], "stats": sd["partial_window"]["stats"][:2]}}
    with pytest.raises(ValueError, match=r"partial window's stats holds a malformed object node; the checkpoint is "
                       r"damaged or was altered .*: resume from an earlier one"):
        lens.load_state_dict(cut)
    lens.load_state_dict(sd)  # the untouched dict still loads
    assert lens.step == 0 and lens._window.micro_steps == 1


def test_other_instrument_settings_are_refused_naming_instrument_and_key(no_unpickling):
    sd = _saved([BatchL2(), GradHist1d(bins=6)])
    with pytest.raises(ValueError, match=r"GradHist1d \(record key 'grad_hist_1d'\) was saved with bins=6, this one "
                       r"has bins=8; build it as in the saved run: GradHist1d\(\.\.\., bins=6\)"):
        _fresh([BatchL2(), GradHist1d(bins=8)]).load_state_dict(sd)
    sd = _saved([BatchDot(mode="sketch", k=8, seed=1)])
    with pytest.raises(ValueError, match=r"BatchDot \(record key 'batch_dot'\) was saved with seed=1, this one has "
                       "seed=2"):
        _fresh([BatchDot(mode="sketch", k=8, seed=2)]).load_state_dict(sd)
    sd = _saved([NoiseScale(per_sample=True)])
    with pytest.raises(ValueError, match=r"NoiseScale \(record key 'noise_scale'\) was saved with per_sample=True"):
        _fresh([NoiseScale()]).load_state_dict(sd)


def test_a_failed_load_changes_nothing():
    hist = GradHist1d(bins=4, range=(-1.0, 1.0), adapt="abs_max")
    sd = _saved([GradHist1d(bins=4, range=(-1.0, 1.0), adapt="abs_max"), BatchDot(mode="sketch", k=4)], micro_steps=3)
    sd["instruments"][0]["state"]["range"] = [-0.5, 0.5]
    lens = _fresh([hist, BatchDot(mode="sketch", k=5)])
    window = lens._window
    with pytest.raises(ValueError, match=r"BatchDot \(record key 'batch_dot'\) was saved with k=4, this one has k=5"):
        lens.load_state_dict(sd)
    assert hist.range == (-1.0, 1.0) and lens._window is window and lens.step == 0


def test_instrument_load_state_dict_checks_keys_and_values():
    h = GradHist1d(bins=4)
    good = h.state_dict()
    with pytest.raises(ValueError, match=r"the state of GradHist1d \(record key 'grad_hist_1d'\) lacks key\(s\) "
                       r"\['draws'\]"):
        h.load_state_dict({k: v for k, v in good.items() if k != "draws"})
    with pytest.raises(ValueError, match=r"has key\(s\) \['extra'\] that GradHist1d does not keep"):
        h.load_state_dict({**good, "extra": 1})
    with pytest.raises(ValueError, match=r"has range=\[1.0, 0.0\], which must be a pair \[lo, hi\] of finite "
                       "numbers with lo < hi"):
        h.load_state_dict({**good, "range": [1.0, 0.0]})
    with pytest.raises(ValueError, match=r"has draws=-1, which must be an int >= 0"):
        h.load_state_dict({**good, "draws": -1})
    with pytest.raises(TypeError, match=r"GradHist1d \(record key 'grad_hist_1d'\).load_state_dict\(state=\.\.\.\) "
                       "takes the dict from its state_dict\\(\\), got list"):
        h.load_state_dict([good])
    with pytest.raises(ValueError, match=r"the state of BatchL2 \(record key 'batch_l2'\) has key\(s\) "
                       r"\['adapt', 'bins', "
                       r"'draws', 'range', 'sample', 'seed'\] that BatchL2 does not keep"):
        BatchL2().load_state_dict(good)
    a = Alpha()
    bad = {**a.state_dict(), "direction_token": 3}
    with pytest.raises(ValueError, match=r"Alpha \(record key 'alpha'\) has direction_token=3 but no direction"):
        a.load_state_dict(bad)
    with pytest.raises(ValueError, match=r"has direction=\[1\], which must be None or a dict parameter "
                       "name -> tensor"):
        a.load_state_dict({**a.state_dict(), "direction": [1], "direction_token": 1})
    n = NoiseScaleTwoBatch(beta=0.5)
    with pytest.raises(ValueError, match=r"grad_sq_ema=nan, which must be a finite number"):
        n.load_state_dict({**n.state_dict(), "grad_sq_ema": float("nan")})
    assert issubclass(StateDictError, ValueError) and issubclass(StateDictError, TypeError)


def test_a_partial_window_needs_a_schedule_that_tracks_it(no_unpickling):
    sd = _saved([BatchL2()])
    with pytest.raises(ValueError, match=r"saved inside tracked window 0, which this Lens's schedule \(every=\.\.\.\) "
                       "does not track; use the same schedule"):
        _fresh([BatchL2()], every=lambda s: s > 0).load_state_dict(sd)


def test_alpha_direction_of_another_shape_is_refused_at_load(no_unpickling):
    model, loss_fn, opt, lens, _ = _setup(lambda: [Alpha()], "mean")
    _run(model, loss_fn, opt, lens, range(4))
    sd = lens.state_dict()
    lens.close(write_pending=False)
    assert sd["instruments"][0]["state"]["direction"]["0.weight"].shape == (6, 4)
    sd["instruments"][0]["state"]["direction"]["0.weight"] = torch.zeros(5, 4, dtype=torch.float64)
    fresh = _setup(lambda: [Alpha()], "mean", seed=1)[3]
    with pytest.raises(ValueError, match=r"the state of Alpha \(record key 'alpha'\) has direction\['0.weight'\] "
                       r"of shape \(5, 4\), parameter '0.weight' is \(6, 4\)"):
        fresh.load_state_dict(sd)
    assert fresh.instruments[0].state_dict()["direction"] is None

