"""Issue 40: a checkpoint cannot run code. The Lens state is plain data (what
``torch.load(weights_only=True)`` reads) rebuilt by constructing gradlens' own state classes
(gradlens.lens.state_codec); an altered state is refused with a StateDictError before anything
of it is applied, and a marker file shows that nothing in it ran."""

from __future__ import annotations

import copy
import io
import os
import pathlib
import re

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens, load_checkpoint, save_checkpoint
from gradlens.instruments import (
    CABS, Alpha, BatchDot, BatchL2, Distance, EarlyStopping, GradHist1d, GradHist2d, GradNorm, InnerTest, MeanGSNR,
    NoiseScale, NormTest, OrthoTest, SumGradSquared, UpdateSize, AccumulationCheck,
)
from gradlens.core.records import TensorSummary
from gradlens.instruments.base import Instrument
from gradlens.lens import state_codec
from gradlens.lens.state import LENS_STATE_VERSION, StateDictError

SIZES = (3, 2, 4)  # K = 3 unequal micro-steps per window


class Evil:
    """An object that writes the marker file whenever anything is done with it: unpickled
    (``__reduce__`` names ``os.system``), copied, compared, shown, hashed, iterated."""

    marker: pathlib.Path

    def __init__(self, marker: pathlib.Path):
        self.marker = marker

    def _touch(self, *a, **k):
        self.marker.touch()
        return True

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))

    __deepcopy__ = __copy__ = __eq__ = __ne__ = __hash__ = __bool__ = __iter__ = __len__ = _touch

    def __repr__(self):
        self._touch()
        return "Evil()"


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _micro(i):
    gen = torch.Generator().manual_seed(300 + i)
    b = SIZES[i % 3]
    return torch.randn(b, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen)


class ListSink:
    """The records as they become final (a pending record once the next window completes it)."""

    def __init__(self):
        self.records = []

    def write(self, record):
        self.records.append(copy.deepcopy(record))

    def close(self):
        pass


def _setup(make, seed=0, sgd=False, sink=None):
    model = gradlens.extend(_mlp(seed))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    inner = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else torch.optim.Adam(model.parameters(), lr=0.05)
    opt = gradlens.GradientAccumulateOptimizer(inner, accum_steps=3)
    return model, loss_fn, opt, Lens(model, make(), optimizer=opt, sinks=[sink] if sink is not None else [])


def _run(model, loss_fn, opt, lens, steps):
    for i in steps:
        x, y = _micro(i)
        out = model(x)
        loss = loss_fn(out, y)
        with lens.capture(losses=nn.functional.cross_entropy(out.detach(), y, reduction="none")):
            loss.backward()
        opt.step(num_samples=len(x))
        opt.zero_grad()


def _saved(make=lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max"), Alpha()], stop=4):
    """The state of a Lens stopped mid-window (window 1 after one micro-step; Alpha's record 0
    pending), through torch.save / torch.load(weights_only=True)."""
    model, loss_fn, opt, lens = _setup(make)
    _run(model, loss_fn, opt, lens, range(stop))
    buf = io.BytesIO()
    torch.save(lens.state_dict(), buf)
    lens.close(write_pending=False)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _plain(value) -> bool:
    """Only what torch.load(weights_only=True) reads, and no tensor subclass."""
    if value is None or type(value) in (bool, int, float, str) or type(value) in (torch.Tensor, nn.Parameter):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v) for v in value)
    if type(value) is dict:
        return all(type(k) in (str, int) and _plain(v) for k, v in value.items())
    return False


# --------------------------------------------------------------------------- what a state holds


def test_a_state_is_plain_data_of_version_3_with_the_window_and_the_pending_record():
    sd = _saved()
    assert sd["version"] == LENS_STATE_VERSION == 3 and "blob" not in sd
    assert sd["window"] is True and sd["pending"] == 0
    assert _plain(sd)
    window = sd["partial_window"]
    assert set(window) == {"stats", "states", "sites", "coverage"} and len(window["states"]) == 3
    assert window["stats"][:2] == ("obj", "WindowStats")
    assert window["states"][0] is None and window["states"][1][:2] == ("obj", "_Hist1dState")
    assert window["sites"]["0"][0] in ("obj", "same")  # (the same Site as the one Alpha's state keeps)
    shown = repr(_strip_tensors(window))
    assert "('obj', 'Site', " in shown and "'module': ('ref', 'm', '0')" in shown  # a module, by name
    pending = sd["pending_record"]
    assert pending["record"][:2] == ("obj", "Record") and [k for k, _ in pending["states"]] == [2]


def test_the_state_is_a_snapshot_and_loading_leaves_the_dict_as_it_was():
    model, loss_fn, opt, lens = _setup(lambda: [BatchL2(), SumGradSquared(), GradNorm()])
    _run(model, loss_fn, opt, lens, range(1))
    sd = lens.state_dict()
    before = copy.deepcopy(sd)
    _run(model, loss_fn, opt, lens, range(1, 2))  # the window's sums grow in place
    model, loss_fn, opt, fresh = _setup(lambda: [BatchL2(), SumGradSquared(), GradNorm()], seed=1)
    fresh.load_state_dict(sd)
    _run(model, loss_fn, opt, fresh, range(1, 2))  # the loaded window's sums grow in place
    flat = lambda v: [t for t in _tensors(v)]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(flat(sd), flat(before), strict=True))
    lens.close()
    fresh.close()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _resumed_equals_uninterrupted(setup, total: int, stop: int) -> None:
    """``setup(seed, sink) -> (model, loss_fn, opt, lens)``: a run of ``total`` micro-steps, and
    one stopped after ``stop`` (saved through torch.save / torch.load(weights_only=True),
    closed) and resumed by a fresh process (other initial weights, the checkpoint loaded): the
    same records, as the sinks receive them."""
    full, first, second = ListSink(), ListSink(), ListSink()
    model, loss_fn, opt, lens = setup(0, full)
    _run(model, loss_fn, opt, lens, range(total))
    lens.close()
    model, loss_fn, opt, lens = setup(0, first)
    _run(model, loss_fn, opt, lens, range(stop))
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "lens": lens.state_dict()}, buf)
    lens.close(write_pending=False)  # the process stops; the pending record is the checkpoint's
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    model, loss_fn, opt, lens = setup(1, second)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    lens.load_state_dict(ckpt["lens"])
    _run(model, loss_fn, opt, lens, range(stop, total))
    lens.close()
    resumed = first.records + second.records
    assert [r.step for r in resumed] == [r.step for r in full.records] == list(range(total // 3))
    for got, want in zip(resumed, full.records):
        assert got == want, (stop, got.step)


@pytest.mark.parametrize("stop", [4, 5])
def test_every_instrument_resumes_mid_window_to_the_record_of_the_uninterrupted_run(stop):
    """Instruments the other resume tests leave out (Distance and UpdateSize with their parameter
    norms, CABS, EarlyStopping, InnerTest, NoiseScale), beside exact BatchDot, OrthoTest,
    GradHist2d and Alpha, saved after 1 and 2 micro-steps of window 1."""

    def make():
        return [Distance(), UpdateSize(), CABS(), EarlyStopping(), InnerTest(), NoiseScale(per_sample=True), NormTest(),
                MeanGSNR(), BatchDot(), OrthoTest(), GradHist2d(bins=(3, 4)), Alpha()]

    _resumed_equals_uninterrupted(lambda seed, sink: _setup(make, seed, sgd=True, sink=sink), 9, stop)


class Uses(nn.Module):
    """A Linear called twice (its uses concatenated: an F.linear stand-in), a parameter in an
    elementwise operation (materialised per-sample gradients), an ``F.linear`` call."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4))
        self.w = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        h = torch.tanh(self.a(torch.tanh(self.a(x)))) * self.scale
        return nn.functional.linear(h, self.w)


class NormSummary(Instrument):
    """A stateless instrument whose value is a TensorSummary."""

    key = "norm_summary"
    needs = frozenset({"batch_l2"})

    def finalize(self, stats, state):
        return TensorSummary.of(stats.batch_l2_all())


def test_every_state_class_the_registry_admits_is_written_read_with_weights_only_and_resumes():
    """One state holding an object of each admitted class but the curvature state (whose window
    is never saved with micro-steps): the window of every kind of instrument, an F.linear use, a
    shared Linear's and a materialised use, a sampled histogram's strata, a pending record with
    histograms and a summary; resumed, the records of the uninterrupted run."""

    def setup(seed, sink=None):
        torch.manual_seed(seed)
        model = gradlens.extend(Uses().double())
        opt = gradlens.GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3)
        insts = [GradHist1d(bins=4, sample=0.5), GradHist2d(bins=(2, 3)), MeanGSNR(), BatchDot(), Alpha(), Distance(),
                 NormSummary(), AccumulationCheck()]
        return model, gradlens.extend(nn.CrossEntropyLoss()), opt, Lens(model, insts, optimizer=opt,
                                                                        sinks=[sink] if sink else [])

    model, loss_fn, opt, lens = setup(0)
    _run(model, loss_fn, opt, lens, range(4))
    buf = io.BytesIO()
    torch.save(lens.state_dict(), buf)
    lens.close(write_pending=False)
    buf.seek(0)
    sd = torch.load(buf, weights_only=True)
    written = set(re.findall(r"\('obj', '(\w+)'", repr(_strip_tensors(sd))))
    assert written == set(state_codec.REGISTRY) - {"_CurvState"}, written
    _resumed_equals_uninterrupted(setup, 9, 4)


def _strip_tensors(value):
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (list, tuple)):
        return type(value)(_strip_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: _strip_tensors(v) for k, v in value.items()}
    return value


def test_a_window_state_of_a_class_gradlens_does_not_know_is_refused_when_saved():
    class Mine:
        def __init__(self):
            self.total = 0

    class Counting(Instrument):
        key = "counting"
        needs = frozenset({"batch_l2"})

        def start_window(self):
            return Mine()

        def finalize(self, stats, state):
            return state.total

    model, loss_fn, opt, lens = _setup(lambda: [BatchL2(), Counting()])
    lens.state_dict()  # between windows: no window state is written
    _run(model, loss_fn, opt, lens, range(1))
    with pytest.raises(StateDictError, match=r"Lens.state_dict\(\): partial window's state of Counting \(record key "
                       r"'counting'\) is a .*Mine, which a Lens state does not hold \(plain data: .*or call "
                       r"state_dict\(\) between windows"):
        lens.state_dict()
    lens.close()


# --------------------------------------------------------------------------- altered states


PLACES = [
    "the partial window's statistics", "an instrument's window state", "an instrument's whole window state",
    "a site", "the pending record", "the pending record's state", "an instrument's state between windows",
    "an instrument's whole state", "the parameter table",
]


def _altered(sd: dict, place: str, evil) -> dict:
    """A copy of ``sd`` with ``evil`` in ``place`` (one of :data:`PLACES`)."""
    s = copy.deepcopy(sd)
    window, pending = s["partial_window"], s["pending_record"]
    if place == PLACES[0]:
        window["stats"][3]["loss_sum"] = evil
    elif place == PLACES[1]:
        window["states"][1][3]["counts"] = evil
    elif place == PLACES[2]:
        window["states"][1] = evil
    elif place == PLACES[3]:
        window["sites"]["0"] = evil
    elif place == PLACES[4]:
        pending["record"][3]["values"]["batch_l2"] = evil
    elif place == PLACES[5]:
        pending["states"][0][1] = evil
    elif place == PLACES[6]:
        s["instruments"][1]["state"]["range"] = evil
    elif place == PLACES[7]:
        s["instruments"][0]["state"] = evil
    else:
        s["parameters"]["names"][0] = evil
    return s


@pytest.mark.parametrize("place", PLACES)
def test_code_in_an_altered_state_is_refused_by_load_state_dict_and_never_runs(tmp_path, place):
    marker = tmp_path / "ran"
    sd = _altered(_saved(), place, Evil(marker))
    lens = _setup(lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max"), Alpha()], seed=1)[3]
    window = lens._window
    with pytest.raises(StateDictError, match="(damaged|altered|malformed)"):
        lens.load_state_dict(sd)
    assert not marker.exists()
    assert lens._window is window and lens.step == 0 and lens._pending.held is None  # nothing applied
    lens.close()


@pytest.mark.parametrize("place", PLACES)
def test_code_in_an_altered_checkpoint_is_refused_by_load_checkpoint_and_never_runs(tmp_path, place):
    marker = tmp_path / "ran"
    make = lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max"), Alpha()]  # noqa: E731
    model, loss_fn, opt, lens = _setup(make)
    _run(model, loss_fn, opt, lens, range(4))
    path = save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, lens=lens)
    lens.close(write_pending=False)
    ckpt = torch.load(path, weights_only=True)
    ckpt["lens"] = _altered(ckpt["lens"], place, Evil(marker))
    torch.save(ckpt, path)  # (pickles Evil: its __reduce__ names os.system)
    assert not marker.exists()
    model, loss_fn, opt, lens = _setup(make, seed=1)
    with pytest.raises(StateDictError, match=r"load_checkpoint\(path=.*\): the file holds objects that "
                       r"torch.load\(weights_only=True\) refuses.*nothing of it was loaded or run"):
        load_checkpoint(path, model=model, optimizer=opt, lens=lens)
    assert not marker.exists()
    assert lens.step == 0
    lens.close()


def test_a_state_naming_classes_or_objects_gradlens_does_not_have_is_refused():
    sd = _saved()
    lens = _setup(lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max"), Alpha()], seed=1)[3]
    stats = sd["partial_window"]["stats"]

    def altered(value, where="stats"):
        s = copy.deepcopy(sd)
        if where == "stats":
            s["partial_window"]["stats"] = value
        else:
            s["partial_window"]["sites"]["0"] = value
        return s

    cases = [
        (altered(("obj", "system", 0, {"command": "touch x"})), r"holds an object of class 'system', which is not "
         "one of gradlens' state classes"),
        (altered(("obj", "posix.system", 0, {})), r"class 'posix.system'"),
        (altered(("obj", "WindowStats", 0, {**stats[3], "extra": 1})), r"holds a WindowStats with fields"),
        (altered(("call", "os.system", ["touch x"])), r"holds a tuple tagged \('call',\)"),
        (altered(("same", 7)), r"refers to an object that comes later or not at all"),
        (altered(("dtype", "__class__")), r"names the dtype \('__class__',\)"),
        (altered(("ref", "m", "no.such.module"), "site"), r"refers to module 'no.such.module', which this Lens "
         "does not have"),
        (altered(("ref", "p", "0.weight"), "site"), r"partial window does not hold window statistics and the sites"),
        (altered({1: stats}), r"is a dict with keys that are not strings"),
    ]
    window = lens._window
    for state, message in cases:
        with pytest.raises(StateDictError, match=message):
            lens.load_state_dict(state)
        assert lens._window is window and lens.step == 0
    lens.load_state_dict(sd)  # the untouched state still loads
    assert lens.step == 1 and lens._window.micro_steps == 1
    lens.close()


@pytest.mark.parametrize("through", ["load_state_dict", "load_checkpoint"])
def test_a_version_2_state_with_a_pickle_is_refused_without_unpickling(tmp_path, through):
    """Version 2 kept the window as a pickle in a uint8 tensor: refused by its version, with the
    way out; the pickle (whose __reduce__ names os.system) is never read."""
    import pickle

    marker = tmp_path / "ran"
    blob = torch.frombuffer(bytearray(pickle.dumps({"window": Evil(marker)})), dtype=torch.uint8)
    sd = _saved()
    old = {k: v for k, v in sd.items() if k not in ("partial_window", "pending_record")}
    old.update(version=2, blob=blob)
    model, loss_fn, opt, lens = _setup(lambda: [BatchL2(), GradHist1d(bins=5, adapt="abs_max"), Alpha()], seed=1)
    message = (r"has version 2 \(written by an earlier gradlens, which kept the partial window and the pending record as "
               r"a pickle: loading it could run code named in the file\); this gradlens reads version 3 only and "
               r"never unpickles a checkpoint. Resume it with the gradlens that wrote it if you trust the file, or "
               r"start this Lens afresh")
    with pytest.raises(StateDictError, match=message):
        if through == "load_state_dict":
            lens.load_state_dict(old)
        else:
            path = save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt)
            ckpt = torch.load(path, weights_only=True)
            torch.save({**ckpt, "lens": old}, path)
            load_checkpoint(path, model=model, optimizer=opt, lens=lens)
    assert not marker.exists() and lens.step == 0
    lens.close()


def test_no_module_of_gradlens_unpickles():
    """``grep -rn "pickle.load\\|pickle.loads\\|Unpickler" gradlens/`` finds nothing: no code path
    of gradlens unpickles anything (torch.load is always weights_only=True)."""
    root = pathlib.Path(gradlens.__file__).parent
    hits, loads = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        hits += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"pickle\.loads?\b|Unpickler\b", text)]
        loads += [f"{path.name}: {m.group(0)}" for m in re.finditer(r"torch\.load\([^)]*\)", text)
                  if "weights_only=True" not in m.group(0)]
    assert hits == [] and loads == []
