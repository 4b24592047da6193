"""Shared pieces of the benchmark scripts: the reference models, interleaved timing that is
correct on CUDA, and the peak memory of one step."""

from __future__ import annotations

import atexit
import functools
import importlib
import io
import math
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn


def mlp() -> nn.Module:
    """784-512-512-10 ReLU MLP (input [B, 1, 28, 28])."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def cnn() -> nn.Module:
    """conv 3-32-64 3x3 + 2x2 max pools, linear 4096-10 (input [B, 3, 32, 32])."""
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )


def device_sync(device) -> Callable[[], None]:
    """``torch.cuda.synchronize`` for a CUDA device, else a no-op.

    CUDA kernels run asynchronously: a host timer around an unsynchronised step measures the
    launches, not the work. Every timed region starts and ends with this call."""
    device = torch.device(device)
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def interleaved_ms(
    steps: dict, rounds: int, warmup: int = 3, sync: Callable[[], None] | None = None, block: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Median ms per call of each step function, timed in interleaved rounds (``block``
    consecutive calls of every configuration per round) so that drift and load from other
    processes hit all rows alike.

    ``block`` > 1 keeps work a step leaves running in the background (a deferred collective,
    finished in the configuration's next step) charged to its own configuration: within a
    block it finishes in the next call of the same configuration; only the block's last call
    leaks it into the next configuration's first call, one call in ``block``, which the median
    discounts.

    ``sync`` (e.g. :func:`device_sync`) runs before the timer starts and before it stops, so that
    on a GPU each time is the step's device work, not its launch; warm-up calls are synchronised
    too (one-time CUDA / cuBLAS initialisation stays out of the timed rounds).

    ``clock``: ``time.perf_counter`` (wall time, default) or ``time.process_time`` (this
    process's CPU time: on a machine shared with other jobs it moves less than wall time; with
    one torch thread it is the step's own work)."""
    sync = sync or (lambda: None)
    for st in steps.values():
        for _ in range(warmup):
            st()
            sync()
    times = {k: [] for k in steps}
    for _ in range(rounds):
        for k, st in steps.items():
            for _ in range(block):
                sync()
                t0 = clock()
                st()
                sync()
                times[k].append(clock() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


@functools.lru_cache(maxsize=None)
def reference_package(rev: str, name: str = "gradlens_ref"):
    """gradlens as of git revision ``rev`` of this checkout, imported as package ``name`` beside
    the working tree's ``gradlens``, so that a benchmark can time both in one process, rounds
    interleaved (the before / after of a change, without the drift between two runs).

    The revision's ``gradlens/`` is extracted (``git archive``) into a temporary directory
    (removed at exit) and every whole word ``gradlens`` in its sources is renamed to ``name``:
    its imports then resolve to the copy. The two packages share nothing but torch. Once per
    ``(rev, name)`` in a process."""
    root = Path(__file__).resolve().parent.parent
    try:
        blob = subprocess.run(["git", "-C", str(root), "archive", rev, "gradlens"], capture_output=True,
                              check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", b"") or b""
        raise SystemExit(f"--against {rev}: cannot read gradlens/ at that revision with git archive "
                         f"({err.decode(errors='replace').strip() or e})") from None
    tmp = Path(tempfile.mkdtemp(prefix="gradlens-ref-"))
    atexit.register(shutil.rmtree, tmp, True)
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        try:
            tar.extractall(tmp, filter="data")
        except TypeError:  # Python without extraction filters (the archive is git's own)
            tar.extractall(tmp)
    pkg = tmp / name
    (tmp / "gradlens").rename(pkg)
    word = re.compile(r"\bgradlens\b")
    for src in pkg.rglob("*.py"):
        src.write_text(word.sub(name, src.read_text()))
    sys.path.insert(0, str(tmp))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(tmp))


def memory_note(device) -> str:
    """One line saying what :func:`peak_memory_mib` measures on ``device`` (print it in headers)."""
    if torch.device(device).type == "cuda":
        return ("peak MiB: highest CUDA memory held by tensors during one extra, untimed step of the "
                "configuration, above what was allocated just before it (torch.cuda.max_memory_allocated "
                "after reset_peak_memory_stats); model, data and state kept between steps are not counted")
    return ("peak MiB: highest CPU tensor memory during one extra, untimed step of the configuration, above "
            "what was allocated just before it (running sum of the CPU allocator's allocations and frees "
            "recorded by torch.profiler with profile_memory=True; it does not see frees of tensors allocated "
            "before the step: its warning about a 'memory block of unknown size' says so); model, data and "
            "state kept between steps are not counted")


def peak_memory_mib(step: Callable[[], None], device) -> float:
    """Peak tensor memory of one call of ``step`` above the memory allocated just before it, in MiB
    (2**20 bytes); ``nan`` where it cannot be measured.

    Run it outside the timed rounds (it adds a step, and on CPU a profiler). CUDA: the caching
    allocator's peak counter, reset before the step (``max_memory_allocated - memory_allocated``).
    CPU: torch.profiler(profile_memory=True) records every allocation (+bytes) and free (-bytes)
    of the CPU allocator during the step; the maximum of their running sum in time order is the
    peak (tensors freed during the step that were allocated before it may take it below 0)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    if device.type != "cpu":
        return math.nan
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    try:
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        deltas = sorted((e.start_ns(), e.nbytes()) for e in events if e.device_type().name == "CPU")
    except Exception:  # noqa: BLE001 - a profiler without these fields: say "n/a", not a number
        return math.nan
    run = peak = 0
    for _, nbytes in deltas:
        run += nbytes
        peak = max(peak, run)
    return peak / 2**20


def fmt_mib(value: float) -> str:
    """``value`` MiB as printed in the tables (``n/a`` for nan)."""
    return "n/a" if math.isnan(value) else f"{value:.1f}"


def failure(e: BaseException) -> str:
    """``"<Type>: <first line of the message>"`` (at most 300 characters) for a ``failed:`` row."""
    msg = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {msg}"[:300]


def build_all(builds, make_args: Callable[[], tuple], sync: Callable[[], None]):
    """Build every ``(name, build)`` row as ``build(*make_args())`` (fresh arguments per row, e.g.
    a copy of the model) and run its first step (synchronised),
    so that a configuration that cannot run (a missing comparison tool, an operation it does not
    support on the device) fails here, before the timing.

    Returns ``(steps, closers, failed)``: ``steps[name]`` the step function of each row that ran,
    ``closers`` their close functions, ``failed[name]`` the reason of each row that did not."""
    steps, closers, failed = {}, [], {}
    for name, build in builds:
        try:
            step, close = build(*make_args())
        except Exception as e:  # noqa: BLE001 - every row must print
            failed[name] = failure(e)
            continue
        closers.append(close)
        try:
            step()
            sync()
        except Exception as e:  # noqa: BLE001
            failed[name] = failure(e)
            continue
        steps[name] = step
    return steps, closers, failed


def peak_memory_all(steps: dict, device) -> dict:
    """:func:`peak_memory_mib` of every step in ``steps`` (``nan`` where measuring fails)."""
    out = {}
    for name, step in steps.items():
        try:
            out[name] = peak_memory_mib(step, device)
        except Exception:  # noqa: BLE001 - a failed measurement prints n/a
            out[name] = math.nan
    return out


def has_cockpit() -> bool:
    """Whether cockpit-for-pytorch imports (``pip install -e .[bench]``)."""
    try:
        import cockpit  # noqa: F401
    except Exception:
        return False
    return True


def cockpit_step(what):
    """A builder ``(model, x, y) -> (step, close)`` of a training step with cockpit attached:
    ``what`` is ``"economy"`` or a list of cockpit quantity class names, tracked every step."""

    def build(model, x, y):
        import backpack
        from cockpit import Cockpit, quantities
        from cockpit.utils.configuration import configuration
        from cockpit.utils.schedules import linear

        model = backpack.extend(model)
        loss_fn = backpack.extend(nn.CrossEntropyLoss())
        loss_none = nn.CrossEntropyLoss(reduction="none")
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if what == "economy":
            qs = configuration("economy", track_schedule=linear(1))
        else:
            qs = [getattr(quantities, name)(track_schedule=linear(1)) for name in what]
        cp = Cockpit(model.parameters(), quantities=qs)
        state = {"i": 0}

        def step():
            out = model(x)
            loss = loss_fn(out, y)
            info = {"batch_size": len(x), "individual_losses": loss_none(out, y), "loss": loss, "optimizer": opt}
            with cp(state["i"], info=info):
                loss.backward(create_graph=cp.create_graph(state["i"]))
            opt.step()
            opt.zero_grad()
            state["i"] += 1

        return step, lambda: None

    return build
