"""The compiled route (issue 35 item 1): tracked micro-steps of ``torch.compile(model)`` run the
compiled graph, the statistics coming back as the gradients of probe tensors
(gradlens/measure/compiled_route.py). Records equal those of an eager copy (and a float64
oracle), K unequal micro-batches, the tracked micro-steps run compiled code with no graph break,
and models that do not qualify stay eager with one warning naming why."""

from __future__ import annotations

import copy
import warnings

import pytest

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradNorm, SumGradSquared
from nanogpt import Block, GPT as TiedGPT, VOCAB, T
from oracle import norm_set, per_sample

SIZES = (2, 3, 1)


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class GPT(nn.Module):
    """A small GPT (nanoGPT's blocks) whose head is its own (untied) and whose loss is computed
    outside: every tracked layer is a Linear, LayerNorm or Embedding."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, d), nn.Embedding(T, d)
        self.h = nn.ModuleList(Block(d, 2, 0.0) for _ in range(2))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def cnn() -> nn.Module:
    """Conv2d with padding and dilation, Conv2d with stride and no bias, a Linear with no bias."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=2, dilation=2), nn.Tanh(), nn.Conv2d(3, 4, 3, stride=2, bias=False),
                         nn.Tanh(), nn.Flatten(), nn.Linear(16, 3, bias=False))


class Bag(nn.Module):
    """Token ids [B, 4] -> an embedding, averaged over the tokens -> a Linear."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(6, 4, padding_idx=0), nn.Linear(4, 3)

    def forward(self, ids):
        return self.out(self.emb(ids).mean(1))


def _data(model: str, windows: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(windows):
        if model == "bag":
            out.append([(torch.randint(0, 6, (b, 4), generator=g), torch.randint(0, 3, (b,), generator=g))
                        for b in SIZES])
        elif model == "cnn":
            out.append([(torch.randn(b, 2, 6, 6, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g))
                        for b in SIZES])
        elif model == "gpt":
            out.append([(torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(0, VOCAB, (b, T), generator=g))
                        for b in SIZES])
        else:
            out.append([(torch.randn(b, 5, generator=g, dtype=dtype), torch.randint(0, 3, (b,), generator=g))
                        for b in SIZES])
    return out


def _run(base: nn.Module, data, compile_it: bool, instruments, backend: str = "aot_eager", on_micro=None, **kw):
    """Windows of ``data`` (K micro-steps each) on a copy of ``base``, compiled or not; returns
    the Lens (closed), the warnings said and the copy's parameters at each window's start."""
    model = gradlens.extend(copy.deepcopy(base))
    run = torch.compile(model, backend=backend) if compile_it else model
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    states = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens = Lens(run, instruments(), optimizer=opt, **kw)
        for w, window in enumerate(data):
            states.append(copy.deepcopy(model.state_dict()))
            for k, (x, y) in enumerate(window):
                out = run(x)
                loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)) / len(window)
                with lens.capture():
                    if on_micro is not None:
                        on_micro(w, k, lambda: loss.backward())
                    else:
                        loss.backward()
            opt.step()
            opt.zero_grad()
    lens.close()
    said = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    return lens, said, states


def _norms() -> list:
    return [BatchL2(), SumGradSquared(), GradNorm()]


def _assert_records_equal(got, want, rtol: float, scaled: bool = False) -> None:
    """Equal records; ``scaled``: the sums of squares to ``rtol`` of each tensor's largest entry
    (float32: an entry whose per-sample sums cancel has no relative precision)."""
    assert [r.step for r in got] == [r.step for r in want]
    for c, e in zip(got, want):
        torch.testing.assert_close(c["batch_l2"], e["batch_l2"], rtol=rtol, atol=0)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=rtol)
        assert c["sum_grad_squared"].keys() == e["sum_grad_squared"].keys()
        for q in e["sum_grad_squared"]:
            want_q = e["sum_grad_squared"][q]
            atol = rtol * float(want_q.abs().max()) if scaled else 1e-30
            torch.testing.assert_close(c["sum_grad_squared"][q], want_q, rtol=rtol, atol=atol)


@pytest.mark.parametrize("model", ["mlp", "bag", "cnn", pytest.param("gpt", marks=pytest.mark.slow)])
def test_compiled_tracked_windows_equal_eager_ones_and_the_oracle(model):
    """An MLP (Linear, LayerNorm), an embedding bag (Embedding with repeated ids and a padding id,
    Linear), a CNN (Conv2d with padding and dilation, with stride and no bias; a Linear without
    bias: its one sum-of-squares tensor) and a small GPT (Embedding, LayerNorm, Linear, causal
    attention; the position table excluded; slow: 80 s of compilation), float64, K = 2, 3, 1
    micro-batches, 3 windows: the compiled model's records equal the eager copy's and a per-sample
    float64 oracle; the first micro-step runs eagerly, the rest compiled (record.meta["route"]); no
    graph break."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = {"mlp": mlp, "bag": Bag, "cnn": cnn, "gpt": GPT}[model]().double()
    kw = {"exclude": ["wpe"]} if model == "gpt" else {}
    data = _data(model, 3)
    eager, said_eager, states = _run(base, data, False, _norms, **kw)
    before = _breaks()
    compiled, said, _ = _run(base, data, True, _norms, **kw)
    assert _breaks() == before
    assert said_eager == [] and len(said) == 1 and "then tracked micro-steps run the compiled graph" in said[0]
    _assert_records_equal(compiled.records, eager.records, rtol=1e-9)
    assert [r.meta["route"] for r in compiled.records] == ["eager, then compiled", "compiled", "compiled"]
    assert compiled.records[0].meta["route_reason"].startswith("every tracked parameter is in a probed layer")
    assert "route" not in eager.records[0].meta
    # the float64 oracle: per-sample gradients of each sample's own loss (1/T of its tokens'
    # sum under the token mean: g_n = B dL_n, summed token losses over the micro-step's B*T)
    for w, (window, rec) in enumerate(zip(data, compiled.records)):
        x = torch.cat([mb[0] for mb in window])
        y = torch.cat([mb[1] for mb in window])

        def loss_one(out, t):
            return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), t.reshape(-1))

        gs = per_sample(base, states[w], loss_one, x, y)
        gs = {q: g for q, g in gs.items() if not q.startswith("wpe")}
        want = norm_set(gs)
        torch.testing.assert_close(rec["batch_l2"], want["batch_l2"], rtol=1e-9, atol=1e-12)
        for q, s in want["sum_grad_squared"].items():
            torch.testing.assert_close(rec["sum_grad_squared"][q], s, rtol=1e-9, atol=1e-12)
    torch._dynamo.reset()


def test_the_tracked_micro_steps_run_compiled_code_one_graph_per_batch_size():
    """torch.profiler sees the compiled region in every tracked micro-step after the first;
    dynamo counts no graph break; the tracked route adds at most one graph per micro-batch size
    (micro-batches of 2, 3, 1: 3 graphs for each route), and untracked windows keep theirs."""
    torch._dynamo.reset()
    base = mlp().double()
    data = _data("mlp", 4)
    regions: dict[tuple[int, int], int] = {}

    def on_micro(w, k, backward):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            backward()
        regions[(w, k)] = sum(1 for e in prof.events() if "Compiled" in e.name)

    graphs = _graphs()
    before = _breaks()
    lens, _, _ = _run(base, data, True, _norms, every=2, on_micro=on_micro)
    assert _breaks() == before
    assert [r.step for r in lens.records] == [0, 2]
    assert regions[(0, 0)] == 0  # the eager, judged micro-step
    assert all(regions[(w, k)] > 0 for w in range(4) for k in range(3) if (w, k) != (0, 0)), regions
    assert _graphs() - graphs <= 2 * len(SIZES)
    torch._dynamo.reset()


def _forward_compiled_regions(run, x) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run(x)
    return sum(1 for e in prof.events() if e.name == "Torch-Compiled Region")


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))


class Mixing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.out = nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.out(h - h.mean(0, keepdim=True))  # batch centring: the samples mixed


@pytest.mark.parametrize("case", ["shared", "mixing", "conv", "histogram", "loss_inside"])
def test_models_that_do_not_qualify_stay_eager_and_say_why(case):
    """A weight used twice in one forward, a batch-centring op, a Conv1d, an instrument of the
    per-sample gradients and a loss computed inside the model (nanoGPT, tied too): the tracked
    micro-steps stay eager (one warning naming why, record.meta["route_reason"]) and the
    records equal those of the eager copy."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    kw, instruments = {}, _norms
    if case == "shared":
        base, data = Shared().double(), _data("mlp", 2)
        why = "parameter 'fc.weight' is used 2 times in one forward (shared: its probe would hold cross terms)"
    elif case == "mixing":
        base, data, kw = Mixing().double(), _data("mlp", 2), {"undefined": "exclude"}
        why = "samples are mixed: 'fc.bias' reaches "
    elif case == "conv":
        base = nn.Sequential(nn.Unflatten(1, (1, 5)), nn.Conv1d(1, 2, 3), nn.Flatten(), nn.Linear(6, 3)).double()
        data = _data("mlp", 2)
        why = "parameter '1.weight' is in '1' (Conv1d), which has no probed form"
    elif case == "histogram":
        base, data = mlp().double(), _data("mlp", 2)
        instruments = lambda: [BatchL2(), GradHist1d(bins=8, range=(-1.0, 1.0))]  # noqa: E731
        why = "GradHist1d needs the eager route"
    if case == "loss_inside":
        _tied_gpt_stays_eager()
        return
    eager, _, _ = _run(base, data, False, instruments, **kw)
    compiled, said, _ = _run(base, data, True, instruments, **kw)
    reasons = [r.meta["route_reason"] for r in compiled.records]
    assert reasons[0].startswith(why) and len(set(reasons)) == 1, reasons
    assert [r.meta["route"] for r in compiled.records] == ["eager", "eager"]
    assert len(said) == (1 if case == "histogram" else 2), said  # (histogram: refused before the first micro-step)
    assert reasons[0] in said[-1] and "eagerly" in said[-1]
    for c, e in zip(compiled.records, eager.records):
        torch.testing.assert_close(c["batch_l2"], e["batch_l2"], rtol=1e-9, atol=0)
    torch._dynamo.reset()


def _tied_gpt_stays_eager():
    """nanoGPT (tied embeddings, the loss inside forward): eager, the loss named first."""
    torch.manual_seed(0)
    model = gradlens.extend(TiedGPT().double())
    run = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens = Lens(run, _norms(), optimizer=opt)
        for _ in range(2):
            for b in SIZES:
                idx, tgt = torch.randint(0, VOCAB, (b, T), generator=g), torch.randint(0, VOCAB, (b, T), generator=g)
                _, loss = run(idx, tgt)
                with lens.capture():
                    loss.backward()
            opt.step()
            opt.zero_grad()
    lens.close()
    why = "the loss is computed inside the model's forward (the compiled route needs an extended loss outside it)"
    assert [r.meta["route_reason"] for r in lens.records] == [why, why]
    assert [r.meta["route"] for r in lens.records] == ["eager", "eager"]
    assert sum(why in str(c.message) for c in caught) == 1


def test_untracked_windows_run_the_same_compiled_graph_and_a_changed_parameter_set_is_judged_again():
    """Untracked windows run the model's own compiled graph (no probe, no recompile once both
    routes are compiled); freezing a layer before a tracked window's first forward makes that
    window's first micro-step eager again (judged anew), with exact records."""
    torch._dynamo.reset()
    base = mlp().double()
    data = _data("mlp", 5)

    def on_micro(w, k, backward):
        if w == 2 and k == 2:  # freeze the first layer before window 3 (tracked... every=1)
            backward()
            for p in run_model[0][0].parameters():
                p.requires_grad_(False)
            return
        backward()

    run_model = []
    model = gradlens.extend(copy.deepcopy(base))
    run_model.append(model)
    compiled = torch.compile(model, backend="aot_eager")
    eager_copy = gradlens.extend(copy.deepcopy(base))
    recs = {}
    for name, m, run in (("compiled", model, compiled), ("eager", eager_copy, eager_copy)):
        run_model[:] = [m]
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD([p for p in m.parameters()], lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            lens = Lens(run, _norms(), optimizer=opt)
            for w, window in enumerate(data):
                for k, (x, y) in enumerate(window):
                    loss = loss_fn(run(x), y) / len(window)
                    with lens.capture():
                        on_micro(w, k, loss.backward)
                opt.step()
                opt.zero_grad()
        lens.close()
        recs[name] = lens.records
    routes = [r.meta["route"] for r in recs["compiled"]]
    assert routes == ["eager, then compiled", "compiled", "compiled", "eager, then compiled", "compiled"], routes
    assert "0.weight" not in recs["compiled"][3]["sum_grad_squared"]
    _assert_records_equal(recs["compiled"], recs["eager"], rtol=1e-9)
    torch._dynamo.reset()


def test_compiled_route_refuses_two_forwards_per_capture_and_a_graph_backpropagated_twice():
    """On the compiled route each captured micro-step is one probed forward: two forwards
    before one capture, a second backward through the same graph (``retain_graph=True``), or a
    forward of the module inside the compiled one are refused with the fix, never measured
    with the wrong probes."""
    torch._dynamo.reset()
    model = gradlens.extend(mlp().double())
    run = torch.compile(model, backend="aot_eager")
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    ((x, y), (x2, y2), _), = _data("mlp", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lens = Lens(run, _norms())
        loss = loss_fn(run(x), y)  # the first micro-step: eager, judged for the compiled route
        with lens.capture():
            loss.backward()
        run(x2)
        loss = loss_fn(run(x2), y2)
        with pytest.raises(RuntimeError, match=r"2 forward passes with gradients ran before this lens.capture\(\) "
                                               r"on the compiled route: .*run a forward, then its capture"):
            with lens.capture():
                loss.backward()
        lens.discard_window()
        from torch._functorch import config  # (aot_autograd donates buffers, refusing retain_graph itself)

        with config.patch(donated_buffer=False):
            loss = loss_fn(run(x), y)
            with lens.capture():
                loss.backward(retain_graph=True)
            with pytest.raises(RuntimeError, match=r"reached tracked parameters but no probed layer of a forward "
                                                   r"run since the last lens.capture\(\) .*retain_graph=True"):
                with lens.capture(reduction="mean", loss=loss):  # (the loss call was counted once)
                    loss.backward()
        loss = loss_fn(model(x2), y2)  # the module inside the compiled one: its layers' own ops, no probe
        with pytest.raises(RuntimeError, match=r"no probed layer .*the module inside torch.compile\(model\) "
                                               r"called instead of the compiled model"):
            with lens.capture():
                loss.backward()
    lens.close()
    torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt"])
def test_inductor_float32_equals_eager_within_1e_4(model):
    """The default (inductor) backend, float32: the MLP's, the CNN's and the small GPT's records
    equal the eager copy's within 1e-4 (slow: inductor compiles each graph in seconds, minutes
    on a busy CPU)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    if model == "gpt":
        base, data = GPT(), _data("gpt", 2)
    else:
        base, data = {"mlp": mlp, "cnn": cnn}[model](), _data(model, 2, dtype=torch.float32)
    kw = {"exclude": ["wpe"]} if model == "gpt" else {}
    eager, _, _ = _run(base, data, False, _norms, **kw)
    compiled, _, _ = _run(base, data, True, _norms, backend="inductor", **kw)
    assert [r.meta["route"] for r in compiled.records] == ["eager, then compiled", "compiled"]
    _assert_records_equal(compiled.records, eager.records, rtol=1e-4, scaled=True)
    torch._dynamo.reset()
