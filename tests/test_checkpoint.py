"""Issue 20: gradlens.save_checkpoint / load_checkpoint (atomic), a resumed run's log holds each
step once, and a process killed (SIGKILL) during a log write or a checkpoint save resumes."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import random
import signal
import time
import warnings

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens, load_checkpoint, load_log, save_checkpoint
from gradlens.instruments import Alpha, BatchL2, GradNorm, SumGradSquared

from oracle import flat, mlp, per_sample_grads
from windows import run_windows

SIZES = (5, 1, 6, 2)  # unequal micro-batches; 2 micro-steps per window


def _setup(log, seed=0, reduction="mean"):
    torch.manual_seed(seed)  # a fresh process starts from other weights: the checkpoint's load
    model = gradlens.extend(mlp().double())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    opt = gradlens.GradientAccumulateOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), accum_steps=2)
    insts = [BatchL2(), GradNorm(), SumGradSquared(), Alpha()]
    lens = Lens(model, insts, optimizer=opt, log=log, every=lambda s: s % 4 != 3)
    return model, loss_fn, opt, lens


def _micro(i):
    gen = torch.Generator().manual_seed(500 + i)
    b = SIZES[i % len(SIZES)]
    return torch.randn(b, 12, generator=gen, dtype=torch.float64), torch.randint(0, 4, (b,), generator=gen)


def _steps(model, loss_fn, opt, lens, indices, after=None):
    """The micro-batches ``indices`` through the Lens (the accumulating optimizer makes the
    windows of 2); ``after(i)`` after micro-step i."""
    indices = list(indices)
    run_windows(model, [[_micro(i) for i in indices]], lens=lens, loss=loss_fn, optimizer=opt, fresh_copy=False,
                close=False, on_micro=None if after is None else (lambda run, w, k, loss: after(indices[k])))


def _reference(tmp_path, total, reduction="mean"):
    log = tmp_path / "reference.jsonl"
    model, loss_fn, opt, lens = _setup(log, reduction=reduction)
    _steps(model, loss_fn, opt, lens, range(total))
    lens.close()
    return lens.records, load_log(log)


# --------------------------------------------------------------------------- the functions


def test_save_and_load_checkpoint_round_trip_and_bad_use(tmp_path):
    model, loss_fn, opt, lens = _setup(None)
    _steps(model, loss_fn, opt, lens, range(3))  # mid-window: the optimizer's and the Lens's partial windows
    path = save_checkpoint(tmp_path / "ckpt.pt", model=model, optimizer=opt, lens=lens, epoch=4, note="x")
    assert path == tmp_path / "ckpt.pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary file left
    model2, loss_fn2, opt2, lens2 = _setup(None, seed=1)
    assert load_checkpoint(path, model=model2, optimizer=opt2, lens=lens2) == {"epoch": 4, "note": "x"}
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert lens2.step == lens.step == 1
    _steps(model, loss_fn, opt, lens, range(3, 6))
    _steps(model2, loss_fn2, opt2, lens2, range(3, 6))
    assert lens2.records[-1] == lens.records[-1]  # the partial window resumed exactly

    with pytest.raises(TypeError, match=r"save_checkpoint\(model=...\) needs an nn.Module, got dict"):
        save_checkpoint(tmp_path / "c.pt", model={})
    with pytest.raises(TypeError, match=r"save_checkpoint\(optimizer=...\) needs an object with state_dict"):
        save_checkpoint(tmp_path / "c.pt", model=model, optimizer=3)
    with pytest.raises(FileNotFoundError, match=r"folder .*nope' does not exist; create it first"):
        save_checkpoint(tmp_path / "nope" / "c.pt", model=model)
    save_checkpoint(tmp_path / "model-only.pt", model=model)
    with pytest.raises(ValueError, match=r"lens=...\): the checkpoint holds no lens state; save it with save_checkpoint\(..., lens=lens\)"):
        load_checkpoint(tmp_path / "model-only.pt", model=model2, lens=lens2)
    torch.save({"model": model.state_dict()}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a checkpoint of gradlens.save_checkpoint"):
        load_checkpoint(tmp_path / "plain.pt", model=model2)
    with pytest.raises(FileNotFoundError, match="no such checkpoint file"):
        load_checkpoint(tmp_path / "missing.pt", model=model2)
    lens.close()
    lens2.close()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_run_resumed_onto_its_log_shows_each_step_once(tmp_path, reduction):
    total, saved_at, stopped_at = 20, 7, 15  # 10 windows; the checkpoint mid-window 3
    ref_records, ref_log = _reference(tmp_path, total, reduction)
    log, ckpt = tmp_path / "run.jsonl", tmp_path / "ckpt.pt"
    model, loss_fn, opt, lens = _setup(log, reduction=reduction)
    _steps(model, loss_fn, opt, lens, range(saved_at))
    save_checkpoint(ckpt, model=model, optimizer=opt, lens=lens)
    _steps(model, loss_fn, opt, lens, range(saved_at, stopped_at))
    lens.close(write_pending=False)  # the run stops (a crash) 4 micro-steps after its checkpoint
    assert [r.step for r in load_log(log)] == [0, 1, 2, 4, 5]

    model, loss_fn, opt, lens = _setup(log, seed=1, reduction=reduction)
    load_checkpoint(ckpt, model=model, optimizer=opt, lens=lens)
    _steps(model, loss_fn, opt, lens, range(saved_at, total))
    lens.close()
    header = [line for line in log.read_text().splitlines() if "__gradlens_segment__" in line]
    assert len(header) == 1 and '"run":0,"start":2' in header[0]  # Alpha's pending record 2
    back = load_log(log)
    assert [r.step for r in back] == [0, 1, 2, 4, 5, 6, 8, 9]  # each step once (3, 7 untracked)
    assert back == ref_log
    # the values against the float64 oracle: window 4 (micro-steps 8, 9) from a replay
    model, loss_fn, opt, lens = _setup(None, reduction=reduction)
    _steps(model, loss_fn, opt, lens, range(8))
    xs, ys = zip(*(_micro(i) for i in (8, 9)))
    g = flat(per_sample_grads(model, torch.cat(xs), torch.cat(ys)))
    rec4 = next(r for r in back if r.step == 4)
    torch.testing.assert_close(rec4["batch_l2"], (g * g).sum(1), rtol=1e-10, atol=1e-12)
    lens.close()
    from gradlens.output.plot import _load_records  # what `gradlens plot` and dashboard() read

    assert [r.step for r in _load_records(str(log))[0]] == [0, 1, 2, 4, 5, 6, 8, 9]


# --------------------------------------------------------------------------- kill -9


def _child(folder, mode, total, kill_at):
    """A training process: resumes from the checkpoint if there is one, saves one after every
    micro-step (and writes log lines); ``mode`` "save"/"log" kills itself in the middle of its
    ``kill_at``-th checkpoint save / log write; "random" is killed by the parent."""
    torch.set_num_threads(1)  # forked: the parent's OpenMP thread pool is not in this process
    log, ckpt = os.path.join(folder, "run.jsonl"), os.path.join(folder, "ckpt.pt")
    resume = os.path.exists(ckpt)
    model, loss_fn, opt, lens = _setup(log, seed=os.getpid() if resume else 0)
    start = 0
    if resume:
        start = load_checkpoint(ckpt, model=model, optimizer=opt, lens=lens)["micro_step"]
    count = [0]
    if mode == "save":
        import gradlens.training.checkpoint as C

        real = C.torch.save

        def dying_save(obj, f, *args, **kwargs):
            if not str(getattr(f, "name", "")).endswith(".tmp"):  # torch's own inner saves
                return real(obj, f, *args, **kwargs)
            count[0] += 1
            if count[0] == kill_at:
                buf = io.BytesIO()
                real(obj, buf)
                f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            real(obj, f)

        C.torch.save = dying_save
    if mode == "log":
        sink = lens._sinks[0]
        real_file = sink._file

        class Dying:
            closed = property(lambda self: real_file.closed)

            def write(self, data):
                count[0] += 1
                if count[0] == kill_at:
                    real_file.write(bytes(data[: len(data) // 2]))
                    os.kill(os.getpid(), signal.SIGKILL)
                return real_file.write(data)

            def close(self):
                real_file.close()

        sink._file = Dying()
    def checkpoint(i):
        save_checkpoint(ckpt, model=model, optimizer=opt, lens=lens, micro_step=i + 1)
        if mode != "none":
            time.sleep(0.01)  # at most 100 micro-steps a second: the kills land before the end

    _steps(model, loss_fn, opt, lens, range(start, total), after=checkpoint)
    lens.close()


def _check_after_kill(folder, ref_by_step):
    model, loss_fn, opt, lens = _setup(None)
    done = load_checkpoint(folder / "ckpt.pt", model=model, optimizer=opt, lens=lens)["micro_step"]
    lens.close()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a cut last line is expected
        back = load_log(folder / "run.jsonl")
    steps = [r.step for r in back]
    assert steps == sorted(set(steps))  # no duplicate, in order
    for r in back:
        assert r == ref_by_step[r.step]  # no glued or mixed record
    return done, back


def _join_or_kill(child, timeout: float) -> bool:
    """Join ``child``; kill it if it is still running after ``timeout`` s (a hung child must not
    keep the test run from exiting). Returns whether it had to be killed."""
    child.join(timeout)
    if not child.is_alive():
        return False
    child.kill()
    child.join()
    return True


def test_kill_9_during_log_writes_and_checkpoint_saves_then_resume(tmp_path):
    total = 64
    _, ref_log = _reference(tmp_path, total)
    ref_by_step = {r.step: r for r in ref_log}
    folder = tmp_path / "run"
    folder.mkdir()
    ctx = mp.get_context("fork")
    rng = random.Random(20)
    t0 = time.monotonic()
    progress = []
    for mode, kill_at in [("save", 3), ("random", None), ("log", 2), ("random", None), ("save", 5), ("random", None)]:
        before = 0 if not (folder / "ckpt.pt").exists() else _check_after_kill(folder, ref_by_step)[0]
        child = ctx.Process(target=_child, args=(str(folder), mode, total, kill_at))
        child.start()
        if mode == "random":
            time.sleep(rng.uniform(0.05, 0.15))
            os.kill(child.pid, signal.SIGKILL)
        hung = _join_or_kill(child, 60)
        assert not hung and child.exitcode == -signal.SIGKILL, (mode, hung, child.exitcode)
        done, back = _check_after_kill(folder, ref_by_step)
        if mode == "save":  # killed in its kill_at-th save: the previous checkpoint is intact
            assert done == before + kill_at - 1
        if mode == "log":
            with pytest.warns(UserWarning, match="truncated or corrupt line"):
                load_log(folder / "run.jsonl")
        progress.append(done)
    assert progress == sorted(progress) and progress[-1] < total
    child = ctx.Process(target=_child, args=(str(folder), "none", total, None))
    child.start()
    hung = _join_or_kill(child, 60)
    assert child.exitcode == 0 and not hung
    done, back = _check_after_kill(folder, ref_by_step)
    assert done == total and back == ref_log  # the resumed run continued: every record, once
    assert time.monotonic() - t0 < 20
