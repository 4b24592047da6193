"""A Lens that materialises per-sample gradients of sequence ``nn.Linear`` calls anyway (sum of
squares) hands autograd their sum as dL/dW instead of letting it compute the weight-gradient
matmul again (``gradlens.capture.fused._FusedLinear``). Checked here: ``p.grad`` equals a plain
float64 backward on a copy of the model (K unequal micro-steps, mean and sum losses, a shared
Linear and a 2-D Linear that keep autograd's own product), the fused path really ran, and the
statistics equal the float64 per-sample loop."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.capture import fused
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from windows import run_windows

B, T = 7, 5


class _Seq(nn.Module):
    """Sequence Linears (fused), one Linear called twice (shared: autograd's own product), and
    a 2-D head (factor formulas, not fused)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.twice = nn.Linear(6, 6)
        self.mid = nn.Linear(6, 5, bias=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # [B, T, 4]
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.head(torch.tanh(self.mid(h)).mean(1))


def _data():
    torch.manual_seed(1)
    return torch.randn(B, T, 4, dtype=torch.float64), torch.randint(0, 3, (B,))


def _spy_fused(monkeypatch) -> list[bool]:
    """Per fused backward from now on: whether the Lens handed it dL/dW."""
    filled = []
    real = fused._FusedLinear.backward

    def spy(ctx, g):
        filled.append(ctx.holder.value is not None)
        return real(ctx, g)

    monkeypatch.setattr(fused._FusedLinear, "backward", staticmethod(spy))
    return filled


def _lens_then_autograd(model, ref, instruments, micro_batches, loss_of, reduction="mean"):
    """The micro-batches through a Lens on ``model`` and through plain autograd on ``ref`` (its
    float64 copy): ``p.grad`` must agree; returns the window's record."""
    (rec,) = run_windows(model, [micro_batches], instruments, loss=loss_of, capture={"reduction": reduction},
                         pass_loss=True, fresh_copy=False).flushed
    for inp, tgt in micro_batches:
        loss_of(ref(inp), tgt).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)
    return rec


def _per_sample(ref, loss_of_sample) -> torch.Tensor:
    """``[B, D]`` float64 per-sample gradients of ``ref``, one backward per sample."""
    params = list(ref.parameters())
    return torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_of_sample(n), params)]) for n in range(B)
    ])


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("small", ["fused", "stacked"])
@pytest.mark.parametrize("layer", ["Linear", "Conv1D"])
def test_fused_weight_grad_equals_autograd_and_the_oracle(reduction, small, layer, monkeypatch):
    """``small="stacked"``: these calls are small enough to be measured with others like them at
    the window's end (gradlens.measure.deferred), which beats fusing them: they run unfused; "fused":
    nothing is small (the fused path as for larger calls). ``layer``: nn.Linear, or
    transformers' Conv1D (its dL/dW in W's [d_in, d_out] layout)."""
    from gradlens.measure import deferred

    if small == "fused":
        monkeypatch.setattr(deferred, "SMALL_USE", 0)
    torch.manual_seed(0)
    model = (_Seq if layer == "Linear" else _SeqConv1D)().double()
    ref = copy.deepcopy(model)
    x, y = _data()
    splits = (slice(0, 2), slice(2, 3), slice(3, B))
    filled = _spy_fused(monkeypatch)
    rec = _lens_then_autograd(
        model, ref, [BatchL2(), SumGradSquared(), GradNorm()], [(x[sl], y[sl]) for sl in splits],
        lambda out, tgt: F.cross_entropy(out, tgt, reduction=reduction), reduction,
    )
    # fused: inp and mid (a use each, 3 micro-steps); twice is shared (2 uses): its calls fall
    # back to the matmul; the 2-D head is no fused call at all
    if small == "fused":
        assert filled.count(True) == 2 * len(splits) and filled.count(False) == 2 * len(splits)
    else:
        assert filled == []
    # statistics: the float64 per-sample loop
    G = _per_sample(ref, lambda n: F.cross_entropy(ref(x[n:n + 1]), y[n:n + 1]))
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
    sgs = torch.cat([rec["sum_grad_squared"][k].reshape(-1) for k, _ in model.named_parameters()])
    torch.testing.assert_close(sgs, G.square().sum(0), rtol=1e-10, atol=1e-14)
    window = G.mean(0) if reduction == "mean" else G.sum(0)
    assert rec["grad_norm"] == pytest.approx(float(window.norm()), rel=1e-10)


def test_fused_linear_only_inside_tracked_forwards():
    """The fused call is used in a tracked forward of the model; a deep copy taken meanwhile, a
    torch.func oracle and the model after ``lens.close()`` run nn.Linear's own forward."""
    torch.manual_seed(0)
    model = gradlens.extend(_Seq().double())
    x, y = _data()
    seen = []
    model.inp.register_forward_hook(lambda mod, a, out: seen.append(type(out.grad_fn).__name__))
    lens = Lens(model, [SumGradSquared()])
    loss = F.cross_entropy(model(x), y)
    copied = copy.deepcopy(model)
    with lens.capture(reduction="mean", loss=loss):
        loss.backward()
    lens.flush()
    assert seen == ["_FusedLinearBackward"]
    assert type(copied.inp(x).grad_fn).__name__ == "ViewBackward0"
    params = {k: v.detach() for k, v in model.named_parameters()}
    one = lambda p, xi: torch.func.functional_call(model, p, (xi.unsqueeze(0),)).sum()
    torch.func.vmap(torch.func.grad(one), in_dims=(None, 0))(params, x)  # no custom Function inside vmap
    assert all(s != "_FusedLinearBackward" for s in seen[1:])
    lens.close()
    model(x)
    assert seen[-1] != "_FusedLinearBackward"


def test_fused_linear_steps_aside_under_autocast():
    """Under autocast (bfloat16 on the CPU) the call is nn.Linear's own; statistics still run."""
    torch.manual_seed(0)
    model = gradlens.extend(_Seq())
    x, y = _data()
    seen = []
    model.inp.register_forward_hook(lambda mod, a, out: seen.append(type(out.grad_fn).__name__))
    lens = Lens(model, [SumGradSquared()])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x.float()), y)
    with lens.capture(reduction="mean", loss=loss):
        loss.backward()
    rec = lens.flush()
    assert seen and seen[0] != "_FusedLinearBackward"
    assert all(torch.isfinite(v).all() for v in rec["sum_grad_squared"].values())


class _Wide(nn.Module):
    """A sequence Linear whose T is long enough for its width (n T^2 (d_in + d_out) >= d_in d_out
    (T + n)) that BatchDot forms its Gram from materialised weight row blocks (not T x T
    products)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x):  # [B, 4, 8]
        return self.head(torch.tanh(self.inp(x)).mean(1))


@pytest.mark.parametrize("splits", [(slice(0, B),), (slice(0, 2), slice(2, 3), slice(3, B))])
def test_batch_dot_forms_the_micro_step_gram_in_backward_with_the_weight_grad(splits, monkeypatch):
    """BatchDot alone: the fused call takes dL/dW from the Gram's row blocks; a one-micro-step
    window uses that Gram as is, a longer one forms the whole [N, N] at window end. Both equal
    the float64 oracle; p.grad equals plain autograd."""
    from gradlens.instruments import BatchDot
    from gradlens.kernels import LinearKernel

    torch.manual_seed(0)
    model = _Wide().double()
    ref = copy.deepcopy(model)
    torch.manual_seed(2)
    x, y = torch.randn(B, 4, 8, dtype=torch.float64), torch.randint(0, 3, (B,))
    assert not LinearKernel().use_tgram(model.inp, x, torch.zeros(B, 4, 10), B)
    calls = []
    real = LinearKernel.gram_with_sum
    monkeypatch.setattr(LinearKernel, "gram_with_sum", lambda *a: calls.append(1) or real(*a))
    from gradlens.instruments import crosssample

    at_end = []
    real_memo = crosssample._memo_layer_gram
    monkeypatch.setattr(crosssample, "_memo_layer_gram", lambda st, pc: at_end.append(pc[0][0].name) or real_memo(st, pc))
    rec = _lens_then_autograd(model, ref, [BatchDot()], [(x[sl], y[sl]) for sl in splits], F.cross_entropy)
    assert len(calls) == len(splits)  # inp: one fused call per micro-step
    assert ("inp" in at_end) == (len(splits) > 1)  # one micro-step: its backward Gram is the window's
    G = _per_sample(ref, lambda n: F.cross_entropy(ref(x[n:n + 1]), y[n:n + 1]))
    torch.testing.assert_close(rec["batch_dot"], G @ G.T, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("layer", ["Linear", "Conv1D"])
def test_histogram_slices_give_the_fused_weight_grad(layer, monkeypatch):
    """GradHist1d alone materialises the sequence Linear (or Conv1D) slices: the fused call
    takes their sum as dL/dW (p.grad equals plain autograd) and the counts equal the float64
    oracle's."""
    from gradlens.instruments import GradHist1d

    from oracle import hist_oracle

    torch.manual_seed(0)
    model = (_Seq if layer == "Linear" else _SeqConv1D)().double()
    ref = copy.deepcopy(model)
    x, y = _data()
    splits = (slice(0, 3), slice(3, B))
    filled = _spy_fused(monkeypatch)
    rec = _lens_then_autograd(
        model, ref, [GradHist1d(bins=11, range=(-0.2, 0.2))], [(x[sl], y[sl]) for sl in splits], F.cross_entropy
    )
    assert filled.count(True) == 2 * len(splits)
    G = _per_sample(ref, lambda n: F.cross_entropy(ref(x[n:n + 1]), y[n:n + 1]))
    assert torch.equal(rec["grad_hist_1d"].counts, hist_oracle(G, -0.2, 0.2, 11)[0])


class _TiedSeq(nn.Module):
    """Token embedding tied to a sequence output projection (a GPT's wte / lm_head)."""

    def __init__(self, vocab=9, d=6):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.mix = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):  # [B, T] -> [B, T, vocab]
        return self.lm_head(torch.tanh(self.mix(self.wte(tokens))))


def test_tied_sequence_projection_adds_its_uses_in_place(monkeypatch):
    """The tied weight's per-sample gradient is the sum of the lookup's and the projection's,
    the projection's added in place (baddbmm); statistics equal the float64 oracle, p.grad
    equals plain autograd."""
    from gradlens.instruments import BatchDot
    from gradlens.kernels import LinearKernel

    torch.manual_seed(0)
    model = _TiedSeq().double()
    ref = copy.deepcopy(model)
    torch.manual_seed(3)
    tokens, y = torch.randint(0, 9, (B, T)), torch.randint(0, 9, (B, T))
    used = []
    real = LinearKernel.add_per_sample
    monkeypatch.setattr(LinearKernel, "add_per_sample", lambda *a: used.append(1) or real(*a))
    splits = (slice(0, 3), slice(3, B))
    rec = _lens_then_autograd(
        model, ref, [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()], [(tokens[sl], y[sl]) for sl in splits],
        lambda out, tgt: F.cross_entropy(out.flatten(0, 1), tgt.flatten()),
    )
    assert len(used) == len(splits)
    # g_n in the DESIGN units of a token-mean loss: B_k x the gradient of sample n's token mean
    # over its micro-batch, i.e. the gradient of its own token-mean loss
    G = _per_sample(ref, lambda n: F.cross_entropy(ref(tokens[n:n + 1]).flatten(0, 1), y[n].flatten()))
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-14)
    sgs = torch.cat([rec["sum_grad_squared"][k].reshape(-1) for k, _ in model.named_parameters()])
    torch.testing.assert_close(sgs, G.square().sum(0), rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(rec["batch_dot"], G @ G.T, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("transposed", [False, True], ids=["Linear", "Conv1D"])
def test_fused_call_is_twice_differentiable_when_not_measured(transposed):
    """Outside a measured use (no dL/dW handed over) the fused call is F.linear (Conv1D: x W +
    b), first and second derivatives included (create_graph=True takes the differentiable
    formula)."""
    from gradlens.capture.events import WeightGrad
    from gradlens.capture.fused import _FusedLinear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(*((4, 5) if transposed else (5, 4)), dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, generator=g, requires_grad=True)

    def fused(x, w, b):
        return _FusedLinear.apply(x, w, b, WeightGrad(), transposed)

    out = fused(x, w, b)
    torch.testing.assert_close(out, x @ w + b if transposed else F.linear(x, w, b), rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(fused, (x, w, b))
    assert torch.autograd.gradgradcheck(fused, (x, w, b))


class Conv1D(nn.Module):
    """``transformers.pytorch_utils.Conv1D`` as that class computes it (``x W + b``, ``W [d_in,
    d_out]``), named as it so that gradlens' registry and fused forward take it for the real one
    (transformers is not installed in the default test environment; the frameworks test below
    runs the real class)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


Conv1D.__module__ = "transformers.pytorch_utils"


class _SeqConv1D(nn.Module):
    """_Seq with transformers' Conv1D layers: two single-use sequence calls (fused), one called
    twice (shared: its own backward), a 2-D nn.Linear head."""

    def __init__(self):
        super().__init__()
        self.inp = Conv1D(6, 4)
        self.twice = Conv1D(6, 6)
        self.mid = Conv1D(5, 6)
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # [B, T, 4]
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        return self.head(torch.tanh(self.mid(h)).mean(1))


class _WideConv1D(nn.Module):
    """_Wide with a Conv1D input layer: BatchDot's Gram from materialised weight row blocks."""

    def __init__(self):
        super().__init__()
        self.inp = Conv1D(10, 8)
        self.head = nn.Linear(10, 3)

    def forward(self, x):  # [B, 4, 8]
        return self.head(torch.tanh(self.inp(x)).mean(1))


@pytest.mark.parametrize("splits", [(slice(0, B),), (slice(0, 2), slice(2, 3), slice(3, B))])
def test_batch_dot_leaves_conv1d_unfused(splits, monkeypatch):
    """BatchDot measures a use before the slices are formed and would fill a fused call from
    its backward Gram, which costs a window of several micro-steps more than it saves: with
    BatchDot, alone or with GradHist1d, Conv1D runs its own forward and backward; the Gram and
    the counts equal the float64 oracle, p.grad plain autograd."""
    from gradlens.instruments import BatchDot, GradHist1d

    from oracle import hist_oracle

    for make in (lambda: [BatchDot()], lambda: [BatchDot(), GradHist1d(bins=9, range=(-0.3, 0.3))]):
        torch.manual_seed(0)
        model = _WideConv1D().double()
        ref = copy.deepcopy(model)
        torch.manual_seed(2)
        x, y = torch.randn(B, 4, 8, dtype=torch.float64), torch.randint(0, 3, (B,))
        filled = _spy_fused(monkeypatch)
        instruments = make()
        rec = _lens_then_autograd(model, ref, instruments, [(x[sl], y[sl]) for sl in splits], F.cross_entropy)
        assert filled == []
        G = _per_sample(ref, lambda n: F.cross_entropy(ref(x[n:n + 1]), y[n:n + 1]))
        torch.testing.assert_close(rec["batch_dot"], G @ G.T, rtol=1e-10, atol=1e-13)
        if len(instruments) > 1:
            assert torch.equal(rec["grad_hist_1d"].counts, hist_oracle(G, -0.3, 0.3, 9)[0])


def test_only_calls_with_a_large_weight_gradient_run_fused(monkeypatch):
    """At gradlens' own threshold (the suite's conftest lowers it to 0), a call whose weight
    gradient is below FUSE_MIN multiply-adds runs unfused (the Function's cost exceeds the
    product), a larger one fused; both give plain autograd's p.grad."""
    from gradlens.measure import deferred

    monkeypatch.setattr(deferred, "SMALL_USE", 0)
    # the smallest call: inp on the first micro-step, [2, t, 4] -> 6: 48 t multiply-adds
    for t, runs_fused in ((5, False), ((1 << 20) // 48 + 1, True)):
        monkeypatch.setattr(fused, "FUSE_MIN", 1 << 20)  # (where _fuses reads it)
        torch.manual_seed(0)
        model = _SeqConv1D().double()
        ref = copy.deepcopy(model)
        x, y = torch.randn(B, t, 4, dtype=torch.float64), torch.randint(0, 3, (B,))
        filled = _spy_fused(monkeypatch)
        _lens_then_autograd(model, ref, [SumGradSquared()], [(x[:2], y[:2]), (x[2:], y[2:])], F.cross_entropy)
        assert bool(filled) == runs_fused


@pytest.mark.frameworks
def test_fused_hugging_face_conv1d_equals_autograd_and_the_oracle(monkeypatch):
    """The real transformers Conv1D (GPT-2) fused, as the stand-in above: p.grad equals a plain
    float64 backward, the norms and sums of squares the per-sample loop."""
    from oracle_models import hf_gpt2

    from gradlens.measure import deferred

    monkeypatch.setattr(deferred, "SMALL_USE", 0)  # nothing stacked: every single call fused
    torch.manual_seed(0)
    model = hf_gpt2().double()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 50, (5, 8))
    splits = (slice(0, 2), slice(2, 5))
    filled = _spy_fused(monkeypatch)
    # the model's own loss, a token mean: every sample has 7 targets
    (rec,) = run_windows(model, [[(ids[sl], ids[sl]) for sl in splits]], [BatchL2(), SumGradSquared(), GradNorm()],
                         forward=lambda m, mb: m(mb[0], labels=mb[1]).loss, loss=lambda loss, labels: loss,
                         capture={"reduction": "mean"}, pass_loss=True, fresh_copy=False).flushed
    # per micro-step the tied lm_head (an nn.Linear sharing wte's weight: its own product), then
    # the 2 x 4 Conv1D calls (c_attn, c_proj, c_fc, c_proj per layer), given their dL/dW
    assert filled == ([False] + [True] * 8) * len(splits)
    for sl in splits:
        ref(ids[sl], labels=ids[sl]).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=name)
    params = list(ref.parameters())
    G = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        ref(ids[n:n + 1], labels=ids[n:n + 1]).loss, params)]) for n in range(ids.shape[0])])
    # (Hugging Face's loss upcasts the logits to float32: 1e-6, as in test_models_oracle)
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-6, atol=1e-12)
    sgs = torch.cat([rec["sum_grad_squared"][k].reshape(-1) for k, _ in model.named_parameters()])
    torch.testing.assert_close(sgs, G.square().sum(0), rtol=1e-6, atol=1e-12)
    assert rec["grad_norm"] == pytest.approx(float(G.mean(0).norm()), rel=1e-6)
