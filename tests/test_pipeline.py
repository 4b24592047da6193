"""Pipelines (``torch.distributed.pipelining``, gloo, CPU, float64): a Lens per stage on a
two-stage ``Schedule1F1B`` / ``ScheduleGPipe`` gives, on every rank, the record of the whole
model (N = the step's batch, per-sample norms summed over the stages, per-parameter values of
every stage), equal to the float64 torch.func oracle of the unsplit model built before
splitting; what is refused, and the refusals of sequence and context parallelism.

torch's schedules split a step's batch into micro-batches of equal size (a stage's receive
buffers take the first micro-batch's shape, measured: 3, 3, 2, 2 fails inside torch), so the
unequal case here is the window: one window of one ``schedule.step()`` (N = 12, 4 micro-batches),
then one of two steps before the update (N = 24, 8 micro-batches)."""

from __future__ import annotations

import copy
import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, GradNorm, SumGradSquared
from oracle import flat, per_sample_grads
from test_distributed import _check_window, _close, _init, _spawn
from windows import all_instruments

M = 4  # micro-batches per schedule.step()
BATCH = 12
STAGES = (("0", "1"), ("2", "3"))  # the layers of stage 0 and stage 1
LR = 0.3
#: what a Lens on a pipeline stage merges (the rest is refused, below)
PIPELINE = ("BatchL2", "SumGradSquared", "GradNorm", "NormTest", "MeanGSNR", "NoiseScale",
            "NoiseScaleTwoBatch", "GradHist1d", "GradHist2d")


class PipeNet(nn.Module):
    """Linear -> tanh -> LayerNorm | Linear -> tanh -> Linear, layers keyed by name so that a
    stage keeps the whole model's parameter names."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(6, 8), "1": nn.LayerNorm(8), "2": nn.Linear(8, 5),
                                     "3": nn.Linear(5, 4)})

    def forward(self, x):
        for name, layer in self.layers.items():
            x = layer(x)
            if name in ("0", "2"):
                x = torch.tanh(x)
        return x


def _problem():
    torch.manual_seed(0)
    model = PipeNet().double()
    with torch.no_grad():
        model.layers["1"].weight.uniform_(0.5, 1.5)
        model.layers["1"].bias.uniform_(-0.3, 0.3)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(BATCH, 6, dtype=torch.float64, generator=g), torch.randint(0, 4, (BATCH,), generator=g))
               for _ in range(3)]
    windows = [batches[:1], batches[1:]]  # one step, then two steps before the update
    G = flat(per_sample_grads(model, *batches[0]))
    theta = torch.cat([p.detach().flatten() for p in model.parameters()])
    return model, windows, 0.5 * float(G.abs().max()), 0.5 * float(theta.abs().max())


def _stage_module(model0: nn.Module, rank: int) -> nn.Module:
    m = copy.deepcopy(model0)
    for name in list(m.layers):
        if name not in STAGES[rank]:
            del m.layers[name]
    return m


def _step(schedule, rank: int, x, y) -> None:
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y)


CONFIGS = {  # (schedule, loss reduction, what the Lens is built on, every)
    "1f1b-mean": ("1f1b", "mean", "schedule", 1),
    "gpipe-mean": ("gpipe", "mean", "schedule", 1),
    "1f1b-sum-stage": ("1f1b", "sum", "stage", 1),
    "gpipe-every2": ("gpipe", "mean", "schedule", 2),  # window 1 untracked: no record
}


def _run_config(rank: int, world: int, out_dir: str, kind: str, reduction: str, on: str, every: int) -> None:
    model0, windows, grad_r, param_r = _problem()
    module = gradlens.extend(_stage_module(model0, rank))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss(reduction=reduction))
    schedule = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[kind](stage, M, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    instruments = all_instruments(grad_r, param_r, bins=10, bins_2d=(6, 8), order=PIPELINE)
    log = os.path.join(out_dir, "log.jsonl")
    # Lens(schedule): the reduction comes from its loss_fn; Lens(stage): stated at the capture
    lens = Lens(schedule if on == "schedule" else stage, instruments, optimizer=opt, log=log, every=every)
    thetas = [copy.deepcopy(module.state_dict())]
    for steps in windows:
        for x, y in steps:
            with lens.capture(reduction=None if on == "schedule" else reduction):
                _step(schedule, rank, x, y)
        opt.step()
        opt.zero_grad()
        thetas.append(copy.deepcopy(module.state_dict()))
    lens.close()
    records = [(r.step, r.num_samples, r.micro_steps, dict(r.values)) for r in lens.records]
    torch.save((records, thetas, lens.tracked), os.path.join(out_dir, f"rank{rank}.pt"))


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    _init(rank, world, port)
    try:
        for name, config in CONFIGS.items():
            os.makedirs(os.path.join(out_dir, name), exist_ok=True)
            dist.barrier()
            _run_config(rank, world, os.path.join(out_dir, name), *config)
        _refusals(rank, world, out_dir)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    """Every configuration and the refusals, in one pair of spawned processes."""
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_worker, 2, out_dir)
        out = {name: ([torch.load(os.path.join(out_dir, name, f"rank{r}.pt"), weights_only=False) for r in range(2)],
                      open(os.path.join(out_dir, name, "log.jsonl")).read().splitlines()) for name in CONFIGS}
        out["refusals"] = [torch.load(os.path.join(out_dir, f"refusals{r}.pt"), weights_only=False) for r in range(2)]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pipeline_stages_give_the_whole_models_record(results, name):
    reduction, every = CONFIGS[name][1], CONFIGS[name][3]
    ranks, logged = results[name]
    model0, windows, grad_r, param_r = _problem()
    assert ranks[0][2] == ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    assert ranks[1][2] == ["layers.2.weight", "layers.2.bias", "layers.3.weight", "layers.3.bias"]
    tracked = len(windows) // every
    assert len(logged) == tracked  # rank 0 writes each record once
    records = ranks[0][0]
    assert len(records) == tracked
    for t, (step, n, micro, vals) in enumerate(records):
        theta = copy.deepcopy(model0)  # the whole model at window t: both stages' parameters
        theta.load_state_dict({**ranks[0][1][t], **ranks[1][1][t]})
        x = torch.cat([b[0] for b in windows[t]])
        y = torch.cat([b[1] for b in windows[t]])
        G = flat(per_sample_grads(theta, x, y))
        sizes = [BATCH // M] * (M * len(windows[t]))
        assert (step, n, micro) == (t, len(x), len(sizes))
        assert sorted(vals["sum_grad_squared"]) == sorted(q for q, _ in model0.named_parameters())
        if reduction == "mean":
            _check_window(vals, n, G, theta, None, None, None, sizes, grad_r, param_r, "pipeline")
        else:  # g_n is the same per-sample gradient; the window gradient is the sum
            _close(vals["batch_l2"], G.square().sum(1))
            _close(vals["grad_norm"], G.sum(0).norm())
            for q, g in zip([q for q, _ in model0.named_parameters()], G.split([p.numel() for p in theta.parameters()], 1)):
                _close(vals["sum_grad_squared"][q].flatten(), g.square().sum(0))
        # the same record on every rank
        step1, n1, micro1, vals1 = ranks[1][0][t]
        assert (step1, n1, micro1) == (step, n, micro)
        _close(vals1["batch_l2"], vals["batch_l2"], rtol=0)
        assert vals1["grad_norm"] == vals["grad_norm"]
        for q, v in vals["sum_grad_squared"].items():
            _close(vals1["sum_grad_squared"][q], v, rtol=0)
        assert torch.equal(vals1["grad_hist_1d"].counts, vals["grad_hist_1d"].counts)
        assert torch.equal(vals1["grad_hist_2d"].counts, vals["grad_hist_2d"].counts)
        same = [(vals1[key], vals[key]) for key in ("norm_test", "noise_scale", "mean_gsnr")]
        same += [(v, vals["noise_scale_two_batch"][k]) for k, v in vals1["noise_scale_two_batch"].items()]
        for a, b in same:
            assert a == b or (math.isnan(a) and math.isnan(b))


def _refusals(rank: int, world: int, out_dir: str) -> None:
    seen = {}
    model0, windows, _, _ = _problem()
    module = gradlens.extend(_stage_module(model0, rank))
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, M, loss_fn=gradlens.extend(nn.CrossEntropyLoss()))
    # instruments that pair samples across layers: refused by name, before any collective
    try:
        Lens(schedule, [BatchL2(), BatchDot()])
    except ValueError as err:
        seen["batch_dot"] = str(err)
    # several stages per rank (interleaved): refused, naming what works
    subs = [gradlens.extend(nn.Linear(4, 4).double()) for _ in range(2)]
    stages = [PipelineStage(m, rank + 2 * i, 2 * world, torch.device("cpu")) for i, m in enumerate(subs)]
    try:
        Lens(ScheduleInterleaved1F1B(stages, M, loss_fn=nn.MSELoss()), [BatchL2()])
    except TypeError as err:
        seen["interleaved"] = str(err)
    # the pipeline's group is the stage's: another is refused; False keeps each stage's own
    # records (nothing merged, so any instrument)
    try:
        Lens(schedule, [BatchL2()], process_group=dist.group.WORLD)
    except ValueError as err:
        seen["group"] = str(err)
    Lens(schedule, [BatchDot()], process_group=False).close()
    # a Lens on the stage (no loss_fn known) without a stated reduction: the first stage
    # cannot know its units; refused at the capture, before the step
    lens = Lens(stage, [GradNorm()], optimizer=torch.optim.SGD(module.parameters(), lr=0.1))
    if rank == 0:
        try:
            with lens.capture():
                pass
        except ValueError as err:
            seen["reduction"] = str(err)
    lens.close()
    # stages whose modules use the same parameter names: refused on every rank
    same = gradlens.extend(nn.Sequential(nn.Linear(6, 6)).double())
    twin = PipelineStage(same, rank, world, torch.device("cpu"))
    try:
        Lens(ScheduleGPipe(twin, M, loss_fn=nn.CrossEntropyLoss()), [SumGradSquared()])
    except RuntimeError as err:
        seen["names"] = str(err)
    torch.save(seen, os.path.join(out_dir, f"refusals{rank}.pt"))


def test_pipeline_refusals_name_what_works(results):
    seen = results["refusals"]
    for s in seen:
        assert "['BatchDot'] are not merged across pipeline stages" in s["batch_dot"]
        assert "supported: BatchL2, SumGradSquared, GradNorm" in s["batch_dot"]
        assert "ScheduleInterleaved1F1B runs several pipeline stages per rank" in s["interleaved"]
        assert "ScheduleGPipe or Schedule1F1B" in s["interleaved"]
        assert "track parameters of the same name: '0.weight' (stages 0 and 1)" in s["names"]
        assert "merges over the pipeline's own group" in s["group"] and "pass False" in s["group"]
    assert "pipeline stage 0 computes no loss" in seen[0]["reduction"]
    assert "lens.capture(reduction='mean')" in seen[0]["reduction"]
    assert "reduction" not in seen[1]


# ------------------------------------------------------------------ sequence / context parallel


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-process gloo group and its 1-D CPU mesh (enough to place DTensors and to enter
    context_parallel)."""
    from torch.distributed.device_mesh import init_device_mesh

    own = not dist.is_initialized()
    if own:
        store = tmp_path_factory.mktemp("pipeline") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    if own:
        dist.destroy_process_group()


def _seq_model():
    torch.manual_seed(0)
    return gradlens.extend(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)))


class _Resharded(nn.Module):
    """Linear -> tanh -> (the activation as a DTensor sharded on the sequence dim) -> Linear."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard

        return self.b(DTensor.from_local(torch.tanh(self.a(x)), self.mesh, [Shard(1)], run_check=False))


def test_sequence_parallel_inputs_are_refused(mesh):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = _seq_model()
    lens = Lens(model, [BatchL2()])
    x = torch.randn(2, 6, 3)
    with pytest.raises(RuntimeError, match=r"the input of the model is a DTensor sharded along dim 1 .*sequence "
                                           r"parallelism .*Supported across ranks: data parallelism .*pipelines"):
        model(distribute_tensor(x, mesh, [Shard(1)]))
    lens.close()
    # a layer's own input sharded on the sequence dim (what SequenceParallel hands a norm)
    inner = gradlens.extend(_Resharded(mesh))
    lens = Lens(inner, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"the input of b is a DTensor sharded along dim 1 .*sequence parallelism"):
        inner(x)
    lens.close()
    # the samples' dim and tensor parallelism's feature dim are not sequence sharding
    from gradlens.capture.parallel import check_batch_layout

    check_batch_layout([distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(x, mesh, [Shard(2)]),
                        distribute_tensor(x, mesh, [Replicate()]), x], "the model")


def test_context_parallel_is_refused(mesh):
    from torch.distributed.tensor.experimental import context_parallel

    model = _seq_model()
    lens = Lens(model, [BatchL2()], every=2)
    x = torch.randn(2, 6, 3)
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        with pytest.raises(RuntimeError, match=r"runs under context parallelism \(context_parallel\(\.\.\.\).*not supported \(yet\)"):
            model(x)
    lens.flush()  # window 1 is untracked: nothing is checked, nothing refused
    with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
        model(x).sum().backward()
    lens.close()


class _Sdpa(nn.Module):
    """The attention call on its own (what _ContextParallel wraps)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


def test_context_parallel_module_wrapper_is_refused(mesh):
    """The module-wrapper style of context parallelism (``_ContextParallel`` applied with
    ``parallelize_module``, the mode of ``_context_parallel_shard``)."""
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    class Block(nn.Module):
        """q, k, v projections -> attention (its own module) -> an output projection."""

        def __init__(self, d=4, heads=2):
            super().__init__()
            self.heads, self.qkv, self.sdpa, self.out = heads, nn.Linear(d, 3 * d), _Sdpa(), nn.Linear(d, d)

        def forward(self, x):
            b, t, d = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            return self.out(self.sdpa(q, k, v).transpose(1, 2).reshape(b, t, d))

    torch.manual_seed(0)
    model = gradlens.extend(Block())
    parallelize_module(model.sdpa, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
    lens = Lens(model, [BatchL2()])
    with pytest.raises(RuntimeError, match=r"sdpa is wrapped with _ContextParallel\) runs under context "
                                           r"parallelism .*not supported \(yet\)"):
        model(torch.randn(2, 6, 4))
    lens.close()


# ------------------------------------------------------------------ expert parallel


def _exchange(kind: str):
    """One of the ways a model's forward moves tokens between ranks with all_to_all."""
    def run(h):
        if kind == "c10d":  # the in-place collective (no autograd)
            out = torch.empty_like(h)
            dist.all_to_all_single(out, h.detach())
            return out + 0 * h
        if kind == "list":
            outs = [torch.empty_like(h)]
            dist.all_to_all(outs, [h.detach()])
            return outs[0] + 0 * h
        if kind == "autograd":  # torch.distributed.nn.functional
            import torch.distributed.nn.functional as dnf

            return dnf.all_to_all_single(torch.empty_like(h), h)
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        return all_to_all_single_autograd(h, None, None, dist.group.WORLD)  # torchtitan's dispatch
    return run


class _ExpertParallel(nn.Module):
    """Linear -> (tokens sent to the rank holding their expert) -> this rank's expert -> back."""

    def __init__(self, kind: str):
        super().__init__()
        self.exchange = _exchange(kind)
        self.a, self.expert, self.b = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.exchange(torch.tanh(self.expert(self.exchange(self.a(x))))))


@pytest.mark.parametrize("kind", ["c10d", "list", "autograd", "functional"])
def test_expert_parallel_all_to_all_is_refused(mesh, kind):
    model = gradlens.extend(_ExpertParallel(kind))
    lens = Lens(model, [BatchL2()], every=2)
    x, loss_fn = torch.randn(4, 3), gradlens.extend(nn.MSELoss())
    with pytest.raises(RuntimeError, match=r"calls torch\..*all_to_all.*expert parallelism .*not supported \(yet\)"
                                           r".*Supported across ranks: data parallelism .*keep every expert on each rank"):
        model(x)
    lens.flush()  # window 1 is untracked: the exchange runs, nothing is refused
    loss = loss_fn(model(x), torch.zeros(4, 2))
    with lens.capture():
        loss.backward()
    lens.close()
    # an exchange outside the model's forward (a data loader's) is not the model's
    lens = Lens(gradlens.extend(nn.Linear(3, 2)), [BatchL2()])
    _exchange(kind)(x)
    lens.close()
