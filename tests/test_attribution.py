"""Attribution: ``SampleOrigin`` (``record["sample_origin"]``: rank, micro-step, size per
micro-batch), ``sample_origins`` (one row per sample) and ``top_samples`` (the largest per-sample
norms and their origin), against the float64 torch.func oracle on a copy of the model made
before ``gradlens.extend``: one process with unequal micro-batches, parameter groups, the JSONL
log, a Lens checkpoint saved mid-window; DDP on 2 gloo ranks with unequal per-rank batches and
unequal micro-step counts (window after window with the same sizes: the per-sample vectors
travel inside the all_reduce; new sizes: gathered)."""

from __future__ import annotations

import contextlib
import copy
import io
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens, load_log, top_samples
from gradlens.core.records import Record, TensorSummary
from gradlens.instruments import Alpha, BatchDot, BatchL2, GradNorm, SampleOrigin, sample_origins
from gradlens.output.jsonl import JsonlSink
from oracle import MODELS, flat, make_problem, per_sample_grads
from test_distributed import _init, _spawn
from windows import micro_batches, run_windows

RTOL = dict(rtol=1e-10, atol=1e-13)


def _expected_origin(layout: list[list[int]]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The oracle's origin: ``layout[r]`` rank r's micro-batch sizes; rows (rank, micro-step,
    size) and per sample (rank, micro-step, index), rank-major."""
    rows, per_sample = [], []
    for r, sizes in enumerate(layout):
        for k, b in enumerate(sizes):
            rows.append((r, k, b))
            per_sample += [(r, k, i) for i in range(b)]
    return torch.tensor(rows, dtype=torch.int64), per_sample


def _check_top(got: list[dict], norms: torch.Tensor, per_sample, k: int) -> None:
    """``top_samples`` against the oracle's norms ``[N]`` and origins."""
    order = torch.argsort(norms, descending=True, stable=True)[:k].tolist()
    assert [t["sample"] for t in got] == order
    for t in got:
        n = t["sample"]
        assert (t["rank"], t["micro_step"], t["index"]) == per_sample[n]
        torch.testing.assert_close(torch.tensor(t["value"], dtype=torch.float64), norms[n], **RTOL)
        torch.testing.assert_close(torch.tensor(t["norm"], dtype=torch.float64), norms[n].sqrt(), **RTOL)


# --------------------------------------------------------------------------- one process
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_origin_and_top_samples_one_process_unequal_micro_batches(reduction):
    model, x, y = make_problem(MODELS["cnn"], seed=0)  # the oracle's copy: before extend
    sizes = [2, 3, 1, 4]
    gs = per_sample_grads(model, x[:10], y[:10])
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "log.jsonl")
        run = run_windows(model, [micro_batches(x[:10], y[:10], sizes)], [BatchL2(), SampleOrigin(), GradNorm()],
                          reduction=reduction, groups="param", log=log)
        rec = run.record
        loaded = load_log(log)[0]
    norms = flat(gs).square().sum(1)  # g_n: each sample's own gradient under either reduction
    rows, per_sample = _expected_origin([sizes])
    assert rec["sample_origin"].dtype == torch.int64
    assert torch.equal(rec["sample_origin"], rows)
    assert torch.equal(sample_origins(rec), torch.tensor(per_sample))
    torch.testing.assert_close(rec["batch_l2"], norms, **RTOL)
    _check_top(top_samples(rec, 4), norms, per_sample, 4)
    # every sample, and k beyond N
    _check_top(top_samples(rec, 50), norms, per_sample, 10)
    # a group's own per-sample norms
    for q in ("0.weight", "3.bias"):
        _check_top(top_samples(rec, 3, group=q), gs[q].flatten(1).square().sum(1), per_sample, 3)
    # the log keeps it in full, with its dtype: the same answers from the record read back
    assert torch.equal(loaded["sample_origin"], rows) and loaded["sample_origin"].dtype == torch.int64
    assert top_samples(loaded, 4) == top_samples(rec, 4)
    assert top_samples(loaded, 2, group="0.weight") == top_samples(rec, 2, group="0.weight")


def test_top_samples_refusals_name_the_fix():
    model, x, y = make_problem(MODELS["mlp"], seed=0)
    rec = run_windows(model, [micro_batches(x[:6], y[:6], [4, 2])], [BatchL2(), SampleOrigin(), BatchDot()]).record
    with pytest.raises(ValueError, match=r"k must be an int >= 1"):
        top_samples(rec, 0)
    with pytest.raises(ValueError, match=r"needs a per-sample vector \[N\] = \[6\], got shape \(6, 6\)"):
        top_samples(rec, key="batch_dot")
    with pytest.raises(KeyError, match=r"has no 'grad_hist_1d'; add its instrument"):
        top_samples(rec, key="grad_hist_1d")
    with pytest.raises(KeyError, match=r"group='x'\): the record has groups \[\]"):
        top_samples(rec, group="x")
    with pytest.raises(TypeError, match="expected a gradlens Record"):
        sample_origins({"sample_origin": rec["sample_origin"]})
    bare = run_windows(model, [micro_batches(x[:6], y[:6], [4, 2])], [BatchL2()]).record
    with pytest.raises(KeyError, match=r"no 'sample_origin'; add the instrument: Lens\(model, \[BatchL2\(\), SampleOrigin\(\)\]"):
        top_samples(bare)
    other = Record(rec.step, 5, rec.micro_steps, dict(rec.values))
    with pytest.raises(ValueError, match="counts 6 samples, the record 5"):
        sample_origins(other)
    # a log that summarised the key: the message names JsonlSink(full=...), which works
    summary = Record(rec.step, 6, 2, {**rec.values, "batch_l2": TensorSummary((6,), "float64", 0, 0, 0, 0)})
    with pytest.raises(ValueError, match=r"JsonlSink\(path, full=\['batch_l2'\]\)"):
        top_samples(summary)
    big_x, big_y = make_problem(MODELS["mlp"], seed=1)[1:]
    with tempfile.TemporaryDirectory() as d:
        backs = []
        for i, full in enumerate((["batch_l2"], ["batch_l2", "sample_origin"])):
            log = os.path.join(d, f"log{i}.jsonl")
            with JsonlSink(log, max_elements=4, full=full) as sink:  # both larger than 4 elements
                run = run_windows(model, [micro_batches(big_x, big_y, [5, 7])], [BatchL2(), SampleOrigin()], log=sink)
            backs.append(load_log(log)[0])
    with pytest.raises(ValueError, match=r"written as a summary \(\(2, 3\)\); keep it in full in the log: "
                                         r"Lens\(\.\.\., log=JsonlSink\(path, full=\['sample_origin'\]\)\)"):
        top_samples(backs[0], 3)
    assert torch.equal(backs[1]["batch_l2"], run.record["batch_l2"])  # kept in full, as the messages say
    assert top_samples(backs[1], 3) == top_samples(run.record, 3)


def test_origin_survives_a_checkpoint_saved_mid_window():
    """Window 0 (micro-batches 2, 4) closed, its record pending for Alpha's next window; window 1
    saved after 2 of its 3 micro-steps (3, 5, 1) and finished by another Lens: both records'
    origins, and the top samples of window 1 against the oracle."""
    model0, x, y = make_problem(MODELS["mlp"], seed=0)
    x1, y1 = make_problem(MODELS["mlp"], seed=1)[1:]
    windows = [micro_batches(x[:6], y[:6], [2, 4]), micro_batches(x1[:9], y1[:9], [3, 5, 1])]

    def setup(**kw):
        model = gradlens.extend(copy.deepcopy(model0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, opt, Lens(model, [BatchL2(), SampleOrigin(), Alpha()], optimizer=opt, **kw)

    def micro_step(model, lens, xb, yb):
        out = model(xb)
        loss = loss_fn(out, yb)
        with lens.capture(losses=F.cross_entropy(out, yb, reduction="none").detach()):
            loss.backward()

    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    model, opt, lens = setup()
    for xb, yb in windows[0]:
        micro_step(model, lens, xb, yb)
    opt.step()
    opt.zero_grad()
    theta = copy.deepcopy(model0)
    theta.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    for xb, yb in windows[1][:2]:
        micro_step(model, lens, xb, yb)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "lens": lens.state_dict()}, buf)
    assert lens.state_dict()["pending"] == 0  # record 0 waits for window 1 (Alpha)
    lens.close(write_pending=False)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    with tempfile.TemporaryDirectory() as d:  # the resumed Lens writes both records
        model, opt, lens = setup(log=os.path.join(d, "log.jsonl"))
        model.load_state_dict(ckpt["model"])
        lens.load_state_dict(ckpt["lens"])
        micro_step(model, lens, *windows[1][2])
        opt.step()
        lens.close()
        recs = {r.step: r for r in load_log(os.path.join(d, "log.jsonl"))}
    assert torch.equal(recs[0]["sample_origin"], _expected_origin([[2, 4]])[0])
    assert recs[0]["alpha"] is not None  # the pending record, completed after the restart
    rows, per_sample = _expected_origin([[3, 5, 1]])
    assert torch.equal(recs[1]["sample_origin"], rows)
    gs = flat(per_sample_grads(theta, x1[:9], y1[:9]))
    _check_top(top_samples(recs[1], 4), gs.square().sum(1), per_sample, 4)


# --------------------------------------------------------------------------- DDP, 2 ranks
#: per window, each rank's micro-batch sizes (rank 0: 5 samples, rank 1: 7); windows 0 and 1
#: alike (window 1's per-sample vectors travel inside the all_reduce), window 2 new (gathered)
LAYOUTS = [[[2, 3], [4, 1, 2]], [[2, 3], [4, 1, 2]], [[5], [3, 4]]]


def _ddp_worker(rank, world, port, out_dir):
    _init(rank, world, port)
    try:
        model0, _, _ = make_problem(MODELS["mlp"], seed=0)
        data = [make_problem(MODELS["mlp"], seed=s)[1:] for s in (1, 2, 3)]
        model = gradlens.extend(copy.deepcopy(model0))
        ddp = nn.parallel.DistributedDataParallel(model)
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
        log = os.path.join(out_dir, "log.jsonl")
        lens = Lens(model, [BatchL2(), SampleOrigin(), BatchDot()], optimizer=opt, log=log,
                    groups={"first": ["1.*"]})
        thetas, gathers = [], []
        for name in ("all_gather_single", "all_gather_into_tensor"):  # count the merge's gathers
            if hasattr(dist, name):
                def counted(*a, _orig=getattr(dist, name), **kw):
                    gathers.append(len(thetas))
                    return _orig(*a, **kw)
                setattr(dist, name, counted)
        for (x, y), layout in zip(data, LAYOUTS):
            thetas.append(copy.deepcopy(model.state_dict()))
            lo = sum(sum(s) for s in layout[:rank])
            mine = layout[rank]
            micro = micro_batches(x[lo: lo + sum(mine)], y[lo: lo + sum(mine)], mine)
            for k, (xb, yb) in enumerate(micro):
                with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                    loss = loss_fn(ddp(xb), yb)
                    with lens.capture():
                        loss.backward()
            opt.step()
            opt.zero_grad()
        lens.close()
        recs = [(r.num_samples, r.micro_steps, dict(r.values), {g: dict(v) for g, v in r.groups.items()})
                for r in lens.records]
        # records kept per rank (process_group=False): the rows name this process's rank
        own = Lens(model, [BatchL2(), SampleOrigin()], optimizer=opt, process_group=False)
        for k, (xb, yb) in enumerate(micro):
            with ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext():
                loss = loss_fn(ddp(xb), yb)
                with own.capture():
                    loss.backward()
        opt.step()
        own.close()
        recs.append(own.records[0]["sample_origin"])
        torch.save({"records": recs, "thetas": thetas, "gathers": gathers}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_unequal_micro_batches_origin_and_top_samples():
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_ddp_worker, 2, out_dir)
        outs = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
        logged = load_log(os.path.join(out_dir, "log.jsonl"))
    model0, _, _ = make_problem(MODELS["mlp"], seed=0)
    data = [make_problem(MODELS["mlp"], seed=s)[1:] for s in (1, 2, 3)]
    assert len(logged) == 3  # rank 0 writes each record once
    for r, out in enumerate(outs):  # window 1's vectors came inside the all_reduce, windows 0 and 2 gathered
        assert out["gathers"] == [1, 3], out["gathers"]
        assert out["records"][3].tolist() == [[r, k, b] for k, b in enumerate(LAYOUTS[2][r])]
    for w, ((x, y), layout) in enumerate(zip(data, LAYOUTS)):
        theta = copy.deepcopy(model0)
        theta.load_state_dict(outs[0]["thetas"][w])
        gs = per_sample_grads(theta, x[:12], y[:12])  # rank-major: rank 0's 5 samples, then rank 1's 7
        G = flat(gs)
        norms = G.square().sum(1)
        first = flat({q: gs[q] for q in ("1.weight", "1.bias")}).square().sum(1)
        rows, per_sample = _expected_origin(layout)
        for out in outs:  # the same record on both ranks
            n, micro, vals, groups = out["records"][w]
            assert (n, micro) == (12, sum(len(s) for s in layout))
            assert torch.equal(vals["sample_origin"], rows), (w, vals["sample_origin"])
            torch.testing.assert_close(vals["batch_l2"], norms, **RTOL)
            torch.testing.assert_close(vals["batch_dot"], G @ G.T, **RTOL)
            torch.testing.assert_close(groups["first"]["batch_l2"], first, **RTOL)
            rec = Record(w, n, micro, vals, groups=groups)
            assert torch.equal(sample_origins(rec), torch.tensor(per_sample))
            _check_top(top_samples(rec, 5), norms, per_sample, 5)
            _check_top(top_samples(rec, 3, group="first"), first, per_sample, 3)
        assert top_samples(logged[w], 5) == top_samples(Record(w, 12, 0, outs[1]["records"][w][2]), 5)
