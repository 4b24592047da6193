"""AccumulationCheck (issue 39): ||g_opt - g|| / ||g|| of what the optimizer got against the
window's exact gradient, against the float64 oracle.

g comes from the oracle (per-sample gradients by ``torch.func`` on a copy of the model taken
before ``gradlens.extend``: their mean, or the token mean of a token-mean loss); g_opt is what
the loop's backwards left in ``p.grad`` (cloned by the test before any clipping, unscaled by the
test) or, for a GradientAccumulateOptimizer, the oracle's weighted micro-batch means. Cases:
equal micro-batches under ``loss / K`` (round-off), unequal ones (the value, the warning and its
fix), GradientAccumulateOptimizer with and without ``num_samples``, a token-mean LM loss with
unequal counted tokens (and its fix), a GradScaler (told and inferred), clipping, groups, a
flushed window without an optimizer, DDP, no host read before the window closes.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import GradientAccumulateOptimizer, Lens
from gradlens.core.sync import forced_device_paths
from gradlens.instruments import AccumulationCheck, BatchL2, GradNorm

import oracle as O
import nanogpt

KEY = "accumulation_check"


def _mse_one(out, y):
    return F.mse_loss(out, y)


def _grads(model: nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {q: p.grad.detach().clone() / scale for q, p in model.named_parameters() if p.grad is not None}


def _rel(g_opt: dict, g: dict, names=None) -> float:
    names = list(g) if names is None else names
    num = sum(float((g_opt[q].double() - g[q].double()).square().sum()) for q in names)
    den = sum(float(g[q].double().square().sum()) for q in names)
    return math.sqrt(num / den)


def _mean(gs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {q: v.mean(0) for q, v in gs.items()}


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "AccumulationCheck" in str(w.message)]


def _loop(sizes, windows=1, *, scaler=None, tell=False, clip=None, groups=None, fix=False, seed=0):
    """A plain loop of ``loss / K`` (or, ``fix``, ``loss * B_k / N``) over micro-batches
    ``sizes``: per window the record, g_opt (the loop's own p.grad, unscaled, before clipping),
    the oracle's g and the clip coefficient clip_grad_norm_ applied."""
    model0 = O.make_mlp(seed)
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt, grad_scaler=scaler if tell else None,
                groups=groups)
    n, k = sum(sizes), len(sizes)
    out, caught_all = [], []
    for w in range(windows):
        x, y = O.make_data(n, seed=10 + w)
        state = _state(model)
        i = 0
        for b in sizes:
            loss = loss_fn(model(x[i:i + b]), y[i:i + b])
            i += b
            objective = loss * b / n if fix else loss / k
            with lens.capture():
                (scaler.scale(objective) if scaler is not None else objective).backward()
        g_opt = _grads(model, scaler.get_scale() if scaler is not None else 1.0)
        coef = 1.0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if scaler is not None:
                scaler.unscale_(opt)
            if clip is not None:
                total = math.sqrt(sum(float(v.double().square().sum()) for v in g_opt.values()))
                coef = min(1.0, clip / (total + 1e-6))
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
        caught_all.append(_check_warnings(caught))
        opt.zero_grad()
        g = _mean(O.per_sample(model0, state, _mse_one, x, y))
        out.append((lens.records[-1], g_opt, g, coef))
    lens.close()
    return out, caught_all


def test_equal_micro_batches_under_loss_over_k_are_round_off():
    (rec, g_opt, g, _), = _loop([4, 4, 4])[0]
    v = rec[KEY]
    assert v["rel_error"] < 1e-14 and _rel(g_opt, g) < 1e-14
    assert v["cause"] is None and v["reference"] == "samples"
    assert v["clip_factor"] == 1.0 and v["grad_scale"] == 1.0 and v["ratio"] == pytest.approx(1.0, abs=1e-14)
    O.close(v["grad_norm_window"], rec["grad_norm"], rtol=1e-13)
    O.close(v["grad_norm_window"], math.sqrt(sum(float(t.square().sum()) for t in g.values())), rtol=1e-12)
    assert KEY not in rec.meta


def test_unequal_micro_batches_under_loss_over_k_value_warning_and_its_fix():
    runs, caught = _loop([5, 1, 6], windows=2)
    for rec, g_opt, g, _ in runs:
        v = rec[KEY]
        O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-10)
        assert v["rel_error"] > 0.05
        O.close(v["grad_norm_optimizer"], math.sqrt(sum(float(t.double().square().sum()) for t in g_opt.values())),
                rtol=1e-12)
        assert v["cause"].startswith("unequal micro-batches under loss / K: the window's 3 micro-batches of [5, 1, 6] samples")
        assert "(loss * B_k / N).backward()" in v["cause"] and "num_samples=len(x)" in v["cause"]
    assert len(caught[0]) == 1 and caught[1] == []  # once per run
    msg = caught[0][0]
    assert msg.startswith("AccumulationCheck: the optimizer stepped with a gradient")
    assert "unequal micro-batches under loss / K" in msg and "Fix: weigh each micro-step's mean loss by its share" in msg
    # the fix, as written: round-off, no warning
    runs, caught = _loop([5, 1, 6], windows=2, fix=True)
    for rec, g_opt, g, _ in runs:
        assert rec[KEY]["rel_error"] < 1e-14 and _rel(g_opt, g) < 1e-14 and rec[KEY]["cause"] is None
    assert caught == [[], []]


def test_clipping_is_told_apart():
    for sizes in ([4, 4, 4], [5, 1, 6]):
        (rec, g_opt, g, coef), = _loop(sizes, clip=0.05)[0]
        v = rec[KEY]
        assert coef < 0.5
        O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-10, atol=1e-14)
        O.close(v["clip_factor"], coef, rtol=1e-9)
    assert _loop([4, 4, 4], clip=0.05)[0][0][0][KEY]["rel_error"] < 1e-14


@pytest.mark.parametrize("tell, clip", [(True, None), (True, 0.05), (False, None)])
def test_a_grad_scaler_is_divided_out(tell, clip):
    """Told (``Lens(grad_scaler=)``), or inferred from the exact power-of-two unscale; with
    clipping the scaler must be told (the next test)."""
    for sizes in ([4, 4, 4], [5, 1, 6]):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
        (rec, g_opt, g, coef), = _loop(sizes, scaler=scaler, tell=tell, clip=clip)[0]
        v = rec[KEY]
        O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-10, atol=1e-14)
        assert v["grad_scale"] == 1024.0
        O.close(v["clip_factor"], coef, rtol=1e-9)
        if tell:
            assert KEY not in rec.meta
        else:
            assert rec.meta[KEY].startswith("the GradScaler scale 1024 was inferred")
            assert "Lens(..., grad_scaler=scaler)" in rec.meta[KEY]


def test_an_unknown_grad_scaler_with_clipping_is_named_as_a_possible_cause():
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    (rec, g_opt, g, coef), = _loop([5, 1, 6], scaler=scaler, tell=False, clip=0.05)[0]
    v = rec[KEY]
    assert v["rel_error"] > 100  # the scale was taken for clipping
    assert "or a GradScaler the Lens does not know" in v["cause"]
    assert "give the Lens the scaler: Lens(..., grad_scaler=scaler)" in v["cause"]


def test_groups_get_their_own_value():
    (rec, g_opt, g, _), = _loop([5, 1, 6], groups="module")[0]
    assert set(rec.groups) == {"0", "2"}
    for group in ("0", "2"):
        names = [q for q in g if q.startswith(group + ".")]
        v = rec.groups[group][KEY]
        O.close(v["rel_error"], _rel(g_opt, g, names), rtol=1e-10)
        assert set(v) == {"rel_error", "grad_norm_optimizer", "grad_norm_window", "ratio"}


def _accumulate(sizes, num_samples: bool, clip=None):
    model0 = O.make_mlp(0)
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), len(sizes), clip=clip)
    lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt)
    x, y = O.make_data(sum(sizes))
    state = _state(model)
    i = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in sizes:
            loss = loss_fn(model(x[i:i + b]), y[i:i + b])
            i += b
            with lens.capture():
                loss.backward()
            opt.step(num_samples=b if num_samples else None)
            opt.zero_grad()
    gs = O.per_sample(model0, state, _mse_one, x, y)
    g = _mean(gs)
    bounds = torch.tensor([0] + sizes).cumsum(0).tolist()
    means = [{q: v[bounds[k]:bounds[k + 1]].mean(0) for q, v in gs.items()} for k in range(len(sizes))]
    weights = [b / sum(sizes) for b in sizes] if num_samples else [1 / len(sizes)] * len(sizes)
    g_opt = {q: sum(w * m[q] for w, m in zip(weights, means)) for q in g}
    return lens.records[-1], g_opt, g, _check_warnings(caught)


@pytest.mark.parametrize("clip", [None, 0.05])
def test_gradient_accumulate_optimizer_with_num_samples_is_round_off(clip):
    clip_fn = None if clip is None else (lambda ps: nn.utils.clip_grad_norm_(ps, clip))
    rec, g_opt, g, caught = _accumulate([5, 1, 6], num_samples=True, clip=clip_fn)
    assert rec[KEY]["rel_error"] < 1e-14 and _rel(g_opt, g) < 1e-14 and caught == []
    assert (rec[KEY]["clip_factor"] < 1) == (clip is not None)


def test_gradient_accumulate_optimizer_without_num_samples_names_it():
    rec, g_opt, g, caught = _accumulate([5, 1, 6], num_samples=False)
    v = rec[KEY]
    O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-10)
    assert v["cause"].startswith("unequal micro-batches ([5, 1, 6]) weighted equally by GradientAccumulateOptimizer")
    assert "opt.step(num_samples=len(x))" in v["cause"] and len(caught) == 1


# ---------------------------------------------------------------- a token-mean LM loss
def _token_oracle(model0, state, data):
    """(g_tok, g_opt of loss / K): g_tok the mean over the window's counted targets of their
    gradients (per-sample loop of each sequence's summed token losses), g_opt the mean of the
    micro-steps' token means."""
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])

    def seq_loss(m, i):
        logits, _ = m(x[i:i + 1])
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y[i].view(-1), ignore_index=-1, reduction="sum")

    gs = O.per_sample_loop(model0, state, seq_loss, x.shape[0])
    counted = int((y != -1).sum())
    g_tok = {q: v.sum(0) / counted for q, v in gs.items()}
    m = copy.deepcopy(model0).double()
    m.load_state_dict(state)
    params = dict(m.named_parameters())
    total = sum(m(a, b)[1] for a, b in data) / len(data)
    g_opt = dict(zip(params, torch.autograd.grad(total, list(params.values()))))
    return g_tok, g_opt


def test_token_mean_lm_loss_with_unequal_counted_tokens_and_its_fix():
    torch.manual_seed(0)
    model0 = nanogpt.GPT().double()
    data = nanogpt.batches([2, 2, 2], ignored=[3, 11, 0])
    for insts in ([AccumulationCheck(), GradNorm()], [AccumulationCheck(), BatchL2()]):  # light and full capture
        model = gradlens.extend(copy.deepcopy(model0))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        lens = Lens(model, insts, optimizer=opt)
        state = _state(model)
        for x, y in data:
            _, loss = model(x, y)
            with lens.capture():
                (loss / len(data)).backward()
        own = _grads(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        g_tok, g_opt = _token_oracle(model0, state, data)
        assert _rel(own, g_opt) < 1e-13  # the oracle's g_opt is the loop's
        v = lens.records[-1][KEY]
        assert v["reference"] == "tokens"
        O.close(v["rel_error"], _rel(g_opt, g_tok), rtol=1e-10)
        assert v["rel_error"] > 0.05
        assert v["cause"].startswith("unequal token counts under a per-micro-step token mean: the window's 3 "
                                     "micro-steps counted [13, 5, 16] targets")
        assert "reduction='sum') / T).backward()" in v["cause"]
        assert len(_check_warnings(caught)) == 1
        lens.close()
    # the fix as the cause words it: summed token losses over the window's counted targets
    model = gradlens.extend(copy.deepcopy(model0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt)
    counted = sum(int((y != -1).sum()) for _, y in data)
    for x, y in data:
        logits, _ = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1, reduction="sum") / counted
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    v = lens.records[-1][KEY]
    assert v["rel_error"] < 1e-13 and v["cause"] is None and _check_warnings(caught) == []


def test_equal_counted_tokens_are_round_off():
    torch.manual_seed(0)
    model = gradlens.extend(nanogpt.GPT().double())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [AccumulationCheck()], optimizer=opt)
    data = nanogpt.batches([2, 2], ignored=[4, 4])
    for x, y in data:
        _, loss = model(x, y)
        with lens.capture():
            (loss / 2).backward()
    opt.step()
    assert lens.records[-1][KEY]["rel_error"] < 1e-13 and lens.records[-1][KEY]["reference"] == "tokens"


# ---------------------------------------------------------------- without an optimizer, refusals
def test_a_flushed_window_is_measured_unless_p_grad_changed():
    model0 = O.make_mlp(0)
    model = gradlens.extend(copy.deepcopy(model0))
    loss_fn = gradlens.extend(nn.MSELoss())
    lens = Lens(model, [AccumulationCheck()])
    x, y = O.make_data(6)
    state = _state(model)
    for i, b in ((0, 2), (2, 4)):
        loss = loss_fn(model(x[i:i + b]), y[i:i + b])
        with lens.capture():
            (loss / 2).backward()
    g_opt = _grads(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        rec = lens.flush()
    O.close(rec[KEY]["rel_error"], _rel(g_opt, _mean(O.per_sample(model0, state, _mse_one, x, y))), rtol=1e-10)
    loss = loss_fn(model(x), y)
    with lens.capture():
        loss.backward()
    model.zero_grad()  # p.grad gone before the flush: nothing to compare
    rec = lens.flush()
    assert rec[KEY]["rel_error"] is None
    assert rec.meta[KEY].startswith("not measured: no optimizer step hook saw this window's update")


def test_arguments_and_deferred_merge_refused():
    with pytest.raises(ValueError, match=r"AccumulationCheck\(tolerance=\.\.\.\) must be a positive number .* got -1"):
        AccumulationCheck(tolerance=-1)
    model = gradlens.extend(O.make_mlp(0))
    with pytest.raises(ValueError, match=r"merge='deferred'.*\['AccumulationCheck'\].*merged window at the update"):
        Lens(model, [GradNorm(), AccumulationCheck()], merge="deferred")


def test_no_host_read_before_the_window_closes():
    from test_sync import HostReads

    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [AccumulationCheck(), BatchL2()], optimizer=opt)
    x, y = O.make_data(6)
    with forced_device_paths(), HostReads() as reads:
        reads.active = True
        for i, b in ((0, 2), (2, 4)):
            loss = loss_fn(model(x[i:i + b]), y[i:i + b])
            with lens.capture():
                (loss / 2).backward()
        reads.active = False
    assert not reads.calls, dict(reads.calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        opt.step()
    assert lens.records[-1][KEY]["rel_error"] > 0


# ---------------------------------------------------------------- DDP
def _ddp_worker(rank: int, world: int, port: int, out_dir: str, sizes_of_rank: list) -> None:
    from test_distributed import _init

    _init(rank, world, port)
    try:
        model0 = O.make_mlp(0)
        model = gradlens.extend(copy.deepcopy(model0))
        ddp = nn.parallel.DistributedDataParallel(model)
        loss_fn = gradlens.extend(nn.MSELoss())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt)
        sizes = sizes_of_rank[rank]
        out = []
        for w in range(3):
            x, y = O.make_data(sum(sum(s) for s in sizes_of_rank), seed=20 + w)
            start = sum(sum(s) for s in sizes_of_rank[:rank])
            state = _state(model)
            i = start
            for k, b in enumerate(sizes):
                sync = k == len(sizes) - 1
                with (ddp.no_sync() if not sync else torch.enable_grad()):
                    loss = loss_fn(ddp(x[i:i + b]), y[i:i + b])
                    i += b
                    with lens.capture():
                        (loss / len(sizes)).backward()
            g_opt = _grads(model)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
            opt.zero_grad()
            out.append((lens.records[-1][KEY], g_opt, state, x, y))
        if rank == 0:
            torch.save(out, os.path.join(out_dir, "rank0.pt"))
        lens.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes_of_rank", [[[3, 3], [3, 3]], [[2, 5], [4, 1]]], ids=["equal", "unequal"])
def test_ddp_checks_the_all_reduced_gradient_against_the_global_window(sizes_of_rank):
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_ddp_worker, 2, out_dir, sizes_of_rank)
        out = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    model0 = O.make_mlp(0)
    for v, g_opt, state, x, y in out:
        gs = O.per_sample(model0, state, _mse_one, x, y)
        g = _mean(gs)
        # DDP's update: the ranks' (1/K) sum_k micro-batch means, averaged over ranks
        bounds, i, parts = [], 0, []
        for sizes in sizes_of_rank:
            rank_part = {q: 0 for q in g}
            for b in sizes:
                for q in g:
                    rank_part[q] = rank_part[q] + gs[q][i:i + b].mean(0) / len(sizes)
                i += b
            parts.append(rank_part)
        expect = {q: sum(p[q] for p in parts) / len(parts) for q in g}
        assert _rel(g_opt, expect) < 1e-13
        if sizes_of_rank[0] == [3, 3]:
            assert v["rel_error"] < 1e-13
        else:
            O.close(v["rel_error"], _rel(g_opt, g), rtol=1e-9)
            assert v["cause"] is not None


# ---------------------------------------------------------------- FSDP2: the record says why not
def _fsdp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from test_distributed import _init
    from test_fsdp import _shard

    _init(rank, world, port)
    try:
        model = gradlens.extend(_shard(O.make_mlp(0), "mlp"))
        loss_fn = gradlens.extend(nn.MSELoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        lens = Lens(model, [AccumulationCheck(), GradNorm()], optimizer=opt)
        x, y = O.make_data(4, seed=rank)
        loss = loss_fn(model(x), y)
        with lens.capture():
            loss.backward()
        opt.step()
        rec = lens.records[-1]
        if rank == 0:
            torch.save((rec[KEY], dict(rec.meta), rec["grad_norm"]), os.path.join(out_dir, "rank0.pt"))
        lens.close()
        del lens, opt, model
    finally:
        dist.destroy_process_group()


def test_fsdp2_says_why_it_is_not_measured():
    from test_distributed import _spawn

    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(_fsdp_worker, 2, out_dir)
        value, meta, grad_norm = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    assert value["rel_error"] is None and grad_norm > 0
    assert meta[KEY].startswith("not measured: under FSDP2 (fully_shard) the gradient the optimizer steps with "
                                "lives in the sharded parameters' .grad")


# ---------------------------------------------------------------- a factor twice; the example
def test_the_loss_divided_by_k_twice_is_a_factor_applied_twice():
    model = gradlens.extend(O.make_mlp(0))
    loss_fn = gradlens.extend(nn.MSELoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lens = Lens(model, [AccumulationCheck()], optimizer=opt)
    x, y = O.make_data(12)
    for i in range(3):
        loss = loss_fn(model(x[4 * i:4 * i + 4]), y[4 * i:4 * i + 4]) / 3  # divided in the "model"
        with lens.capture():
            (loss / 3).backward()  # and again in the loop
    with pytest.warns(RuntimeWarning, match=r"a factor applied twice or not at all: the optimizer got 0\.333333 x "
                                             r"the window gradient \(1/K with K = 3: the loss divided by K twice\?\)"):
        opt.step()
    v = lens.records[-1][KEY]
    O.close(v["ratio"], 1 / 3, rtol=1e-12)
    O.close(v["rel_error"], 2 / 3, rtol=1e-12)


def test_the_example_runs_as_the_readme_shows(capsys):
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "examples", "accumulation_check.py"),
                   run_name="__main__")
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "loss / K:        rel_error 0.526, ratio 1.030"
    assert out[1].startswith("  cause: unequal micro-batches under loss / K: the window's 3 micro-batches of "
                             "[3, 1, 4] samples")
    assert out[2].startswith("loss * B_k / N:  rel_error ") and out[2].endswith("cause None")
    assert float(out[2].split("rel_error ")[1].split(",")[0]) < 1e-6
