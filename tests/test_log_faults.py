"""Issue 20, sinks and logs: a failing sink never corrupts the Lens, a cut line is never glued to
the next, runs and resumes on one log, one writer per log."""

from __future__ import annotations

import copy
import errno
import json
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens, load_log
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from gradlens.output.sinks import JsonlSink

from oracle import flat, mlp, per_sample_grads
from windows import micro_batches, run_windows

SPLIT = [5, 1, 6]  # K = 3 unequal micro-batches, N = 12


def _data(window):
    gen = torch.Generator().manual_seed(1000 + window)
    x = torch.randn(sum(SPLIT), 12, generator=gen, dtype=torch.float64)
    return x, torch.randint(0, 4, (sum(SPLIT),), generator=gen)


def _train(lens_kwargs, windows, reduction="mean", instruments=None, between=None):
    """``windows`` windows of K = 3 micro-steps; returns (lens, oracle batch_l2 per window)."""
    torch.manual_seed(0)
    model = gradlens.extend(mlp().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, instruments or [BatchL2(), GradNorm()], optimizer=opt, **lens_kwargs)
    between = between or (lambda w, lens: None)
    between(0, lens)  # ``between(w, lens)`` before window w
    data = [_data(w) for w in range(windows)]
    run = run_windows(model, [micro_batches(x, y, SPLIT) for x, y in data], lens=lens, reduction=reduction,
                      optimizer=opt, fresh_copy=False, snapshots=True, close=False,
                      on_window=lambda run, w: w + 1 < windows and between(w + 1, run.lens))
    expected = []
    for theta, (x, y) in zip(run.thetas, data):  # float64 oracle of each window, at its start
        g = flat(per_sample_grads(theta, x, y))
        expected.append((g * g).sum(1))
    return lens, expected


class FlakySink:
    """A user sink whose writes raise for the steps in ``fail`` (each once, or always)."""

    def __init__(self, fail=(), always=False):
        self.fail, self.always = set(fail), always
        self.steps, self.closed = [], 0

    def write(self, record):
        if self.always or record.step in self.fail:
            self.fail.discard(record.step)
            raise OSError(errno.ENOSPC, "No space left on device")
        self.steps.append(record.step)

    def close(self):
        self.closed += 1

    def __repr__(self):
        return "FlakySink()"


def _messages(caught, text):
    return [str(w.message) for w in caught if text in str(w.message)]


# --------------------------------------------------------------------------- a sink that raises


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_sink_that_raises_warns_once_and_the_windows_stay_apart(reduction):
    sink = FlakySink(fail={1, 2})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, expected = _train({"sinks": [sink]}, 5, reduction)
    msgs = _messages(caught, "could not write")
    assert len(msgs) == 1  # reported once, naming the sink and the error
    assert "record of step 1 to the sink FlakySink() (OSError: [Errno 28] No space left" in msgs[0]
    assert "the step advanced" in msgs[0] and "dropped after 3 failed writes" in msgs[0]
    assert lens.step == 5
    assert [(r.step, r.num_samples) for r in lens.records] == [(w, 12) for w in range(5)]  # not merged
    for record, want in zip(lens.records, expected):
        torch.testing.assert_close(record["batch_l2"], want, rtol=1e-10, atol=1e-12)
    assert sink.steps == [0, 1, 2, 3, 4]  # the held records went first, in order
    lens.close()
    assert sink.closed == 1


def test_a_sink_that_keeps_failing_is_dropped_and_the_others_go_on():
    bad, good = FlakySink(always=True), FlakySink()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, expected = _train({"sinks": [bad, good]}, 5)
    assert len(_messages(caught, "could not write")) == 1
    (dropped,) = _messages(caught, "dropped the sink")
    assert "FlakySink() after 3 failed writes in a row (last: OSError" in dropped
    assert "records of steps [0, 1, 2] were not written to it" in dropped
    assert bad.closed == 1 and good.steps == [0, 1, 2, 3, 4] and lens.step == 5
    for record, want in zip(lens.records, expected):
        torch.testing.assert_close(record["batch_l2"], want, rtol=1e-10, atol=1e-12)
    lens.close()
    assert bad.closed == 1 and good.closed == 1


# --------------------------------------------------------------------------- a file whose writes fail


class HalfWriter:
    """A log file object that writes half of what it is given, then raises (a disk full)."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def write(self, data):
        self.calls += 1
        self.real.write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    @property
    def closed(self):
        return self.real.closed

    def close(self):
        self.real.close()


def test_a_line_cut_by_a_failed_write_is_ended_before_the_next(tmp_path):
    path = tmp_path / "run.jsonl"

    def between(w, lens):
        sink = lens._sinks[0]
        if w == 1:
            sink._file = HalfWriter(sink._file)  # the record of window 1 is cut, twice
        if w == 3:
            sink._file = sink._file.real  # space is back

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, expected = _train({"log": path}, 5, between=between)
    lens.close()
    assert len(_messages(caught, "could not write the record of step 1 to the sink JsonlSink(")) == 1
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b""
    cut = [n + 1 for n, line in enumerate(lines[:-1]) if not line.endswith(b"}")]
    assert cut == [2, 3]  # the two cut lines, each alone on its line
    with pytest.warns(UserWarning, match=r"2 truncated or corrupt line\(s\) skipped: line 2 .*line 3 "):
        back = load_log(path)
    assert [r.step for r in back] == [0, 1, 2, 3, 4]  # the held records were written again
    for record, want in zip(back, expected):
        torch.testing.assert_close(record["batch_l2"], want, rtol=1e-10, atol=1e-12)


def _fsize_child(path, result):
    """In a forked process: a file-size limit cuts window 2's line, lifted at window 4."""
    torch.set_num_threads(1)  # forked: the parent's OpenMP thread pool is not in this process
    import os
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]

    def between(w, lens):
        if w == 2:
            resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(path) + 100, hard))
        if w == 4:
            resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, expected = _train({"log": path}, 6, between=between)
    lens.close()
    Path(result).write_text(json.dumps({
        "step": lens.step,
        "warnings": [str(w.message) for w in caught if "could not write" in str(w.message)],
        "expected": [e.tolist() for e in expected],
    }))


def test_a_file_size_limit_cuts_a_line_and_the_log_recovers(tmp_path):
    import multiprocessing as mp

    path, result = tmp_path / "run.jsonl", tmp_path / "result.json"
    child = mp.get_context("fork").Process(target=_fsize_child, args=(str(path), str(result)))
    child.start()
    child.join(120)
    if child.is_alive():  # a hung child must not keep the test run from exiting
        child.kill()
        child.join()
    assert child.exitcode == 0
    out = json.loads(result.read_text())
    assert out["step"] == 6
    (msg,) = out["warnings"]
    assert "record of step 2 to the sink JsonlSink(" in msg and "OSError: [Errno 27] File too large" in msg
    raw = path.read_bytes()
    assert raw.endswith(b"\n") and raw.count(b"\n") == 7  # 6 records and the cut line
    with pytest.warns(UserWarning, match=r"1 truncated or corrupt line\(s\) skipped: line 3 "):
        back = load_log(path)
    assert [r.step for r in back] == [0, 1, 2, 3, 4, 5]
    for record, want in zip(back, out["expected"]):
        torch.testing.assert_close(record["batch_l2"], torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_an_arrays_folder_that_cannot_be_created(tmp_path):
    path = tmp_path / "run.jsonl"
    (tmp_path / "run.jsonl.arrays").write_text("a file where the folder should be")
    sink = JsonlSink(path, full=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, expected = _train({"log": sink}, 4, instruments=[BatchL2(), SumGradSquared()])
    (first,) = _messages(caught, "could not write")
    assert "record of step 0 to the sink JsonlSink(" in first and "FileExistsError" in first
    (dropped,) = _messages(caught, "dropped the sink")
    assert "steps [0, 1, 2] were not written" in dropped
    assert sink.closed and lens.step == 4
    assert [(r.step, r.num_samples) for r in lens.records] == [(w, 12) for w in range(4)]
    for record, want in zip(lens.records, expected):
        torch.testing.assert_close(record["batch_l2"], want, rtol=1e-10, atol=1e-12)
    assert path.read_bytes() == b""  # no half record, no line pointing at a missing file
    lens.close()


# --------------------------------------------------------------------------- one writer per log


def test_a_second_writer_on_one_log_is_refused(tmp_path):
    path = tmp_path / "run.jsonl"
    first, _ = _train({"log": path}, 1)
    with pytest.raises(RuntimeError, match=r"run\.jsonl' is being written by another Lens or JsonlSink.*lens\.close\(\)"):
        _train({"log": path}, 1)
    with pytest.raises(RuntimeError, match="is being written by another"):
        JsonlSink(path, mode="overwrite")
    assert [r.step for r in load_log(path)] == [0]  # the refused overwrite truncated nothing
    first.close()  # releases the lock
    second, _ = _train({"log": path}, 2)
    second.close()
    with pytest.warns(UserWarning, match="holds 2 runs"):
        assert [r.step for r in load_log(path)] == [0, 1]


def test_a_writer_in_another_process_is_refused_until_it_dies(tmp_path):
    import multiprocessing as mp
    import os
    import signal

    path = tmp_path / "run.jsonl"
    ctx = mp.get_context("fork")
    ready = ctx.Event()

    def hold():
        sink = JsonlSink(path)  # held until the process is killed
        ready.set()
        signal.pause()
        sink.close()  # never reached

    child = ctx.Process(target=hold)
    child.start()
    try:
        assert ready.wait(30)
        with pytest.raises(RuntimeError, match="is being written by another"):
            JsonlSink(path)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(30)
    with JsonlSink(path):  # the dead process's lock is gone
        pass


# --------------------------------------------------------------------------- the loss note


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_nan_loss_is_reported_as_non_finite_and_an_unknown_one_as_unknown(tmp_path, reduction):
    import math

    torch.manual_seed(0)
    model = gradlens.extend(mlp().double())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    x, y = _data(0)
    with torch.no_grad():
        per_sample = nn.functional.cross_entropy(copy.deepcopy(model)(x), y, reduction="none")
    want = float(per_sample.mean() if reduction == "mean" else per_sample.sum())  # float64 oracle
    bad = x.clone()
    bad[3, 0] = float("nan")  # one sample's loss is nan
    path = tmp_path / "run.jsonl"
    lens = Lens(model, [BatchL2(), GradNorm()], log=path)
    records = []
    for inputs, kwargs in ((x, {}), (bad, {}), (x, {"reduction": reduction, "multiplier": 1.0})):
        records += run_windows(model, [micro_batches(inputs, y, SPLIT)], lens=lens, fresh_copy=False, close=False,
                               loss=(lambda out, t: nn.functional.cross_entropy(out, t, reduction=reduction))
                               if kwargs else loss_fn, capture=kwargs,
                               on_micro=lambda run, w, k, loss: run.model.zero_grad()).flushed
    lens.close()
    known, nan, unknown = records
    assert known["loss"] == pytest.approx(want, rel=1e-12) and "loss" not in known.meta
    assert math.isnan(nan["loss"])  # the value stays nan
    assert nan.meta["loss"].startswith("non-finite: the window's loss is nan (a micro-step's loss was nan")
    assert "functional" not in nan.meta["loss"]
    assert unknown["loss"] is None
    assert unknown.meta["loss"].startswith("unknown: a functional loss without loss=")
    back = load_log(path)
    assert math.isnan(back[1]["loss"]) and back[1].meta == nan.meta and back[2]["loss"] is None


def test_records_a_sink_still_holds_are_written_at_close_or_named():
    class FromStep4(FlakySink):
        def write(self, record):
            self.always = record.step >= 4
            super().write(record)

    late, dead = FlakySink(fail={4}), FromStep4()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens, _ = _train({"sinks": [late, dead]}, 5)  # both fail at the last record, step 4
        assert late.steps == dead.steps == [0, 1, 2, 3]
        lens.close()
    assert late.steps == [0, 1, 2, 3, 4] and late.closed == 1  # the held record, at close
    assert dead.steps == [0, 1, 2, 3] and dead.closed == 1
    assert len(_messages(caught, "could not write the record of step 4 to the sink")) == 2
    (lost,) = _messages(caught, "before closing it")
    assert "records of steps [4] to the sink FlakySink() before closing it (OSError" in lost
