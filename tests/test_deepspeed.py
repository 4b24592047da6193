"""DeepSpeed ZeRO stages 1, 2 and 3 (2 gloo ranks on the CPU, float64 models, marker
``deepspeed``): a Lens in a plain DeepSpeed loop (``engine(x)``, ``engine.backward(loss)`` inside
``lens.capture()``, ``engine.step()`` on every micro-step, DeepSpeed's own
``gradient_accumulation_steps`` K and its 1/K loss scaling) gives the records of the global batch
of all ranks and micro-steps (rank-major), for every instrument, against the float64 torch.func
oracle on the concatenated batch and the parameters as DeepSpeed wrote them; the Lens is built
from each object a user holds (the engine, ``engine.module`` with ``engine.optimizer``, with the
torch optimizer, with the engine); what is refused names the stage; a tracked window's peak
memory under stage 3 is measured and reported, the gathered parameters released.

Needs DeepSpeed (``pip install 'gradlens[deepspeed]'``): without it every test here fails with
that instruction, never skips. The first run builds DeepSpeed's ``deepspeed_shm_comm`` C++
extension (about 100 s, cached under ``~/.cache/torch_extensions``): the module fixture builds
it once, before any worker starts. (The Trainer: tests/test_deepspeed_trainer.py.)
"""

from __future__ import annotations

import copy
import gc
import importlib
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    CABS,
    BatchL2,
    Distance,
    EarlyStopping,
    GradHist2d,
    GradNorm,
    HessTrace,
    NoiseScaleTwoBatch,
    SumGradSquared,
    TICDiag,
    UpdateSize,
)
from oracle import MODELS, flat, make_problem, per_sample_grads
from test_distributed import _close, _init, _spawn
from oracle import early_stopping as _eb, trace_sigma as _trace, two_batch as _oracle_two_batch
from test_fsdp import _check, _instruments, _param_range

pytestmark = pytest.mark.deepspeed

LR = 0.3
SIZES = [5, 7]  # per rank: N = 12, the oracle's
K = {1: 2, 2: 2, 3: 3}  # micro-steps per window (DeepSpeed's gradient_accumulation_steps) by stage
MODEL = {1: "mlp", 2: "cnn", 3: "cnn"}
#: stage 1 steps the engine inside the capture (Accelerate's order), stage 2 uses a functional loss
#: which object the Lens of each stage's run is built from
FORM = {1: "engine", 2: "engine.optimizer", 3: "torch optimizer"}


@pytest.fixture(scope="module", autouse=True)
def _deepspeed_ready():
    """DeepSpeed is installed (else every test fails, naming the fix) and its shared-memory
    communication extension is built, once, in this process (the workers then load it)."""
    try:
        importlib.import_module("deepspeed")
    except ImportError as err:
        pytest.fail(f"the tests marked 'deepspeed' need DeepSpeed: pip install 'gradlens[deepspeed]' ({err})")
    from deepspeed.comm.torch import build_shm_op

    build_shm_op()


def float64_zero3() -> None:
    """Let DeepSpeed's ZeRO-3 take the tests' float64 models on any CPU. Its ``zero.Init``
    (which stage 3 runs on a model built outside it) uses the model's dtype for the tensors it
    creates where the accelerator reports fp16 support (a CPU with mkldnn fp16), and then refuses
    float64 ("Invalid data type torch.float64"); where the accelerator reports none, it keeps its
    bf16 default for those tensors and the float64 parameters as they are. The tests need the
    latter on every machine: the CPU accelerator reports no fp16 here (no test uses fp16)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        accelerator.is_fp16_supported = lambda: False


def _ds_init(rank: int, world: int, port: int) -> None:
    """The process group (gloo), and the environment DeepSpeed reads."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _init(rank, world, port)
    float64_zero3()


def ds_config(stage: int, k: int, micro: int = 3, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": k,
        "zero_optimization": {"stage": stage, **zero}, "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def full_state(engine, stage: int) -> dict[str, torch.Tensor]:
    """The model's full parameters as DeepSpeed holds them (stage 3: gathered; a collective)."""
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage != 3:
        return {q: p.detach().clone() for q, p in params.items()}
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {q: p.detach().clone() for q, p in params.items()}


def _problem(name: str, windows: int = 4):
    models = [make_problem(MODELS[name], seed=s) for s in range(windows)]
    model0 = models[0][0]
    G = flat(per_sample_grads(model0, models[0][1], models[0][2]))
    return model0, [(x, y) for _, x, y in models], 0.5 * float(G.abs().max())


def _split(x, rank: int, k: int):
    lo = sum(SIZES[:rank])
    return torch.tensor_split(x[lo: lo + SIZES[rank]], k)


def _micro_sizes(k: int) -> list[int]:
    return [len(t) for r in range(len(SIZES)) for t in _split(torch.arange(sum(SIZES)), r, k)]


def _lens_from(form: str, engine, opt, instruments, **kw) -> Lens:
    if form == "engine":
        return Lens(engine, instruments, **kw)
    if form == "engine.optimizer":
        return Lens(engine.module, instruments, optimizer=engine.optimizer, **kw)
    if form == "engine as optimizer":
        return Lens(engine.module, instruments, optimizer=engine, **kw)
    if form == "engine and torch optimizer":
        return Lens(engine, instruments, optimizer=opt, **kw)
    return Lens(engine.module, instruments, optimizer=opt, **kw)


def _refusals(engine, opt, stage: int) -> dict[str, str]:
    """What a Lens under this stage refuses (messages), and that every object a user holds
    builds the same Lens (the engine's module, the torch optimizer inside DeepSpeed's)."""
    out = {}
    for inst in (HessTrace(), TICDiag()):
        with pytest.raises(ValueError, match=f"not supported under DeepSpeed ZeRO stage {stage}") as err:
            Lens(engine, [BatchL2(), inst])
        out[type(inst).__name__] = str(err.value)
    sampled = GradHist2d(bins=(4, 4), sample=0.3)
    if stage == 3:
        with pytest.raises(ValueError, match="not supported under DeepSpeed ZeRO stage 3") as err:
            Lens(engine, [sampled])
        out["sampled GradHist2d"] = str(err.value)
    else:  # the parameters are whole on every rank: accepted
        Lens(engine, [sampled]).close()
    other = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=LR)
    # stage 3 links the parameters to DeepSpeed's optimizer, which holds the torch one; stages 1
    # and 2 do not: the torch optimizer (DeepSpeed's or another) is refused, naming the fix
    why = "not the optimizer DeepSpeed updates this model with" if stage == 3 else "steps DeepSpeed's flat partitions"
    for key, given in (("other optimizer", other), ("torch optimizer", opt)):
        if stage == 3 and given is opt:
            continue
        with pytest.raises(ValueError, match=why) as err:
            Lens(engine.module, [BatchL2()], optimizer=given)
        out[key] = str(err.value)
    for form in ("engine", "engine.optimizer", "engine as optimizer", "engine and torch optimizer") + (
            ("torch optimizer",) if stage == 3 else ()):
        lens = _lens_from(form, engine, opt, [BatchL2()])
        assert lens.model is engine.module and lens.optimizer is opt, form
        assert lens.coverage == 1.0, form  # counted in the model's shapes (ZeRO-3: ds_numel)
        lens.close()
    return out


def _run_window(engine, lens, loss_fn, x, y, rank: int, k: int, functional: bool, step_inside: bool = False) -> None:
    """One window: this rank's slice in k micro-steps, DeepSpeed's loop (engine.step() on every
    micro-step; it updates at the k-th). ``step_inside``: engine.step() inside the capture, as
    ``accelerator.backward`` (and so the Trainer) runs it."""
    for xb, yb in zip(_split(x, rank, k), _split(y, rank, k)):
        out = engine(xb)
        losses = F.cross_entropy(out, yb, reduction="none").detach()
        if functional:  # engine.backward divides by K after this loss: measured on it
            loss = F.cross_entropy(out, yb)
            capture = lens.capture(reduction="mean", loss=loss, losses=losses)
        else:
            loss = loss_fn(out, yb)
            capture = lens.capture(losses=losses)
        with capture:
            engine.backward(loss)
            if step_inside:
                engine.step()
        if not step_inside:
            engine.step()


def _worker(rank, world, port, out_dir, stage):
    _ds_init(rank, world, port)
    try:
        import deepspeed

        k, name = K[stage], MODEL[stage]
        model0, windows, grad_r = _problem(name)
        model = gradlens.extend(copy.deepcopy(model0))
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, k))
        out = {"refusals": _refusals(engine, opt, stage)}
        assert all(p.numel() == 0 for p in engine.module.parameters()) == (stage == 3)
        insts = [*_instruments(grad_r, _param_range(model0), alpha=True), UpdateSize(), Distance(), CABS(),
                 EarlyStopping()]
        lens = _lens_from(FORM[stage], engine, opt, insts)
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        thetas = [full_state(engine, stage)]
        for x, y in windows[:2]:
            _run_window(engine, lens, loss_fn, x, y, rank, k, functional=stage == 2, step_inside=stage == 1)
            thetas.append(full_state(engine, stage))
        lens.close()  # writes window 1's pending Alpha record
        out["records"] = [(r.step, r.num_samples, r.micro_steps, dict(r.values), dict(r.meta)) for r in lens.records]
        # instruments of the window gradient only (the light capture), then of norms and sums only
        # (small uses stacked to the window's end under stages 1 and 2, measured at once under 3)
        for insts, (x, y) in (([GradNorm(), NoiseScaleTwoBatch()], windows[2]),
                              ([BatchL2(), SumGradSquared(), GradNorm()], windows[3])):
            lens = _lens_from("engine", engine, opt, insts)
            _run_window(engine, lens, loss_fn, x, y, rank, k, functional=False)
            out["records"].append((lens.records[0].num_samples, dict(lens.records[0].values)))
            lens.close()
            thetas.append(full_state(engine, stage))
        out["thetas"] = thetas
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        del lens, engine, opt, model
    finally:
        dist.destroy_process_group()


def _model_at(model0: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    m = copy.deepcopy(model0)
    m.load_state_dict(state, strict=True)
    return m


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in state.values()])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stage_every_instrument_equals_the_global_batch_oracle(stage):
    from oracle import window_oracle as oracle_window

    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, 2, out_dir, stage)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    k, name = K[stage], MODEL[stage]
    model0, windows, grad_r = _problem(name)
    param_r = _param_range(model0)
    names_shapes = [(q, p.shape) for q, p in model0.named_parameters()]
    micro_sizes = _micro_sizes(k)
    res = results[0]
    refusals = res["refusals"]
    for key in ("HessTrace", "TICDiag"):
        assert "engine.backward has no create_graph" in refusals[key]
    assert ("sampled GradHist2d" in refusals) == (stage == 3)
    assert "Lens(engine, ...)" in refusals["other optimizer"]
    assert ("torch optimizer" in refusals) == (stage != 3)
    thetas = res["thetas"]
    flats = [_flat(t) for t in thetas]
    assert all(float((b - a).norm()) > 0 for a, b in zip(flats, flats[1:]))  # every window updated
    records = res["records"][:2]
    assert len(records) == 2
    for t, (step, n, micro_steps, vals, meta) in enumerate(records):
        assert step == t and micro_steps == len(micro_sizes) and n == sum(SIZES)
        assert meta["coverage"] == 1.0
        m = _model_at(model0, thetas[t])
        x, y = windows[t]
        G = flat(per_sample_grads(m, x, y))
        _check(vals, n, G, names_shapes, micro_sizes, grad_r, m, param_r)
        # the update-based instruments read the parameters as DeepSpeed wrote them back
        _close(vals["update_size"], (flats[t + 1] - flats[t]).norm())
        _close(vals["distance"], (flats[t] - flats[0]).norm())
        with torch.no_grad():
            loss = F.cross_entropy(m(x), y).item()
        assert vals["loss"] == pytest.approx(loss, rel=1e-12)  # DeepSpeed's 1/K divided out
        assert vals["cabs"] == pytest.approx(LR * _trace(G) / loss, rel=1e-8)
        assert vals["early_stopping"] == pytest.approx(_eb(G), rel=1e-8)
        if t == 0:  # Alpha and the projections onto DeepSpeed's update, on both windows' oracles
            o = oracle_window([m, _model_at(model0, thetas[1])], windows, 0)
            for key in ("start", "end", "update_sq_norm"):
                _close(vals["search_dir_projections"][key], o[key])
            _close(vals["alpha"], o["alpha"], rtol=1e-7)
    # the light capture (window 2) and the norms-only plan (window 3)
    for t, (n, vals) in ((2, res["records"][2]), (3, res["records"][3])):
        assert n == sum(SIZES)
        G = flat(per_sample_grads(_model_at(model0, thetas[t]), *windows[t]))
        _close(vals["grad_norm"], G.mean(0).norm())
        if t == 2:
            g2, tr = _oracle_two_batch(G, micro_sizes)
            _close(vals["noise_scale_two_batch"]["grad_sq"], g2)
            _close(vals["noise_scale_two_batch"]["trace_sigma"], tr)
        else:
            _close(vals["batch_l2"], G.square().sum(1))
            gs = G.split([s.numel() for _, s in names_shapes], dim=1)
            for (q, shape), g in zip(names_shapes, gs):
                assert tuple(vals["sum_grad_squared"][q].shape) == tuple(shape)
                _close(vals["sum_grad_squared"][q].flatten(), g.square().sum(0))
    other = results[1]  # every rank holds the same records and parameters
    for a, b in zip(res["records"][:2], other["records"][:2]):
        assert a[:3] == b[:3]
        _close(a[3]["batch_dot"], b[3]["batch_dot"], rtol=0)
        assert a[3]["update_size"] == b[3]["update_size"]
    for a, b in zip(flats, [_flat(t) for t in other["thetas"]]):
        assert torch.equal(a, b)


# ------------------------------------------------------------------- peak memory under stage 3
class Wide(nn.Sequential):
    """Three 256 x 256 layers (float64: 512 KiB a weight) and a small head."""

    def __init__(self):
        super().__init__(nn.Linear(12, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256),
                         nn.Tanh(), nn.Linear(256, 4))


class _PeakRSS:
    """The process's resident memory during a block, sampled every 0.2 ms by a thread (glibc
    told to map every allocation of 16 KiB or more on its own and to return it at once, so that
    the resident size follows what torch holds): ``peak`` and ``after``, in bytes above the
    resident size when the block began."""

    def __init__(self):
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 16384)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def measure(self, fn) -> tuple[int, int]:
        import threading
        import time

        start = self._rss()
        peak = [start]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], self._rss())
                time.sleep(0.0002)

        t = threading.Thread(target=sample)
        t.start()
        try:
            fn()
        finally:
            done.set()
            t.join()
        return max(peak[0], self._rss()) - start, self._rss() - start


def _census() -> dict[tuple, int]:
    """The tensors of 4096 elements or more that Python code holds (parameters aside), counted by
    (shape, dtype): what a Lens, or DeepSpeed, keeps between windows."""
    gc.collect()
    out: dict[tuple, int] = {}
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.numel() >= 4096:
            key = (tuple(t.shape), str(t.dtype))
            out[key] = out.get(key, 0) + 1
    return out


def _memory_worker(rank, world, port, out_dir):
    _ds_init(rank, world, port)
    try:
        import deepspeed

        torch.manual_seed(0)
        model = gradlens.extend(Wide().double())
        full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        largest = max(p.numel() * p.element_size() for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(
            3, 2, micro=6, stage3_param_persistence_threshold=0))  # no parameter kept whole between uses
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        g = torch.Generator().manual_seed(3)
        data = [(torch.randn(24, 12, generator=g, dtype=torch.float64), torch.randint(0, 4, (24,), generator=g))
                for _ in range(6)]
        # windows 2 and 4 are tracked: window 0 warms DeepSpeed up (its first step allocates its
        # buffers); window 1's step opens window 2, the first tracked window (what is allocated
        # once: lazy imports, the CPU math library's caches for new shapes); window 3's step opens
        # window 4 (GradHist2d bins the gathered values); window 4 is measured (UpdateSize and
        # Distance read the gathered values around its update; its step opens window 5,
        # untracked); window 5 is the untracked reference. Slices of per-sample gradients kept small.
        lens = Lens(engine, [BatchL2(), GradHist2d(bins=(8, 8), range=((-0.2, 0.2), (-0.5, 0.5))), UpdateSize(),
                             Distance()], every=lambda s: s in (2, 4), chunk_elements=4096)
        partitioned = []

        def window(x, y):
            for xb, yb in zip(torch.tensor_split(x[12 * rank: 12 * rank + 12], 2),
                              torch.tensor_split(y[12 * rank: 12 * rank + 12], 2)):
                loss = loss_fn(engine(xb), yb)
                with lens.capture():
                    engine.backward(loss)
                engine.step()
            partitioned.append(all(p.numel() == 0 for p in engine.module.parameters()))

        rss = _PeakRSS()
        for w in range(3):
            window(*data[w])
        held = [_census()]
        opening = rss.measure(lambda: window(*data[3]))
        held.append(_census())
        tracked = rss.measure(lambda: window(*data[4]))
        held.append(_census())
        untracked = rss.measure(lambda: window(*data[5]))
        held.append(_census())
        assert [r.step for r in lens.records] == [2, 4] and lens.records[1]["update_size"] > 0
        lens.close()
        torch.save({"opening": opening, "tracked": tracked, "untracked": untracked, "partitioned": partitioned,
                    "held": held, "full_bytes": full_bytes, "largest": largest},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        del lens, engine, opt, model
    finally:
        dist.destroy_process_group()


def test_stage3_tracked_window_peak_memory_measured_and_gathered_values_released(record_property, capsys):
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_memory_worker, 2, out_dir)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    lines = []
    for rank, res in enumerate(results):
        full, largest = res["full_bytes"], res["largest"]
        assert res["partitioned"] == [True] * 6  # after each window every parameter is a [0] partition again
        before, opened, after_tracked, after_untracked = res["held"]
        # between windows the Lens keeps no gathered value: after the tracked window (and the
        # untracked one after it) the same large tensors exist as after the warm-up window; once
        # the tracked window is open, GradHist2d's parameter bins (int32, as on one process)
        extra_open = {k: n - before.get(k, 0) for k, n in opened.items() if n != before.get(k, 0)}
        assert extra_open and all(dtype == "torch.int32" for (_, dtype) in extra_open), extra_open
        assert after_tracked == before and after_untracked == before
        (open_peak, _), (peak, _), (base_peak, _) = res["opening"], res["tracked"], res["untracked"]
        extra = peak - base_peak
        # the tracked window's peak above an untracked one: GradHist2d's bins of the window, the
        # full values UpdateSize and Distance read around the update (a copy and UpdateSize's
        # snapshot of theta_t), one gathered parameter at a time, small per-sample slices: a few
        # copies of the model, never per-sample copies of it
        assert extra < 4 * full, (extra, full)
        lines.append(
            f"rank {rank}: model {full / 1024:.0f} KiB (largest parameter {largest / 1024:.0f} KiB, this rank's "
            f"partition {full / 2048:.0f} KiB); peak resident memory of an untracked window +{base_peak / 1024:.0f} "
            f"KiB, of the tracked window +{peak / 1024:.0f} KiB (+{extra / 1024:.0f} KiB = {extra / full:.2f} x the "
            f"model), of the window whose step opens it (GradHist2d's bins) +{open_peak / 1024:.0f} KiB"
        )
        record_property(f"rank{rank}_tracked_window_extra_peak_bytes", extra)
    with capsys.disabled():
        print("\nZeRO-3, 2 ranks, Lens(BatchL2, GradHist2d, UpdateSize, Distance):\n  " + "\n  ".join(lines))
