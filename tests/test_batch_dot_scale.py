"""BatchDot alone keeps each use's output gradient as autograd delivered it, with its
micro-step's per-sample scale (no ``g * scale`` copy per use; see
``gradlens.instruments.crosssample._Layer``): its Gram blocks scale by ``s_k s_l``, a fused
Linear call's dL/dW is the unscaled blocks' sum. Checked against the float64 per-sample loop with
K unequal micro-steps == one batch, on a GPT-style model (LayerNorm, fused sequence Linears,
attention, a position parameter, tied embeddings), with mean and sum losses, a loss divided by
K (a tensor scale), a Lens state saved and reloaded mid-window, and beside other instruments
(which read per-sample units: no carried scale there)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchDot, BatchL2, InnerTest, SumGradSquared
from windows import run_windows

B, T, V, D = 7, 5, 11, 8


class _TinyGPT(nn.Module):
    """Token + position embeddings, one pre-norm block (LayerNorm, q/k/v/out Linears, causal
    attention, a GELU MLP), a final LayerNorm, an output projection tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.wpe = nn.Parameter(0.1 * torch.randn(T, D))
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D), nn.LayerNorm(D)
        self.q, self.k, self.v, self.out = (nn.Linear(D, D) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(D, 3 * D), nn.Linear(3 * D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens):  # [B, T] -> [B, T, V]
        b, t = tokens.shape
        x = self.wte(tokens) + self.wpe[:t]
        h = self.ln1(x)
        split = lambda y: y.view(b, t, 2, D // 2).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)), is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, D))
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return self.lm_head(self.ln_f(x))


def _lm_loss(logits, targets, reduction="mean"):
    """Token-mean (or token-sum) cross-entropy of the micro-batch."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)


def _problem():
    torch.manual_seed(0)
    model = _TinyGPT().double()
    torch.manual_seed(1)
    return model, torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))


def _oracle_gram(model, tokens, targets) -> torch.Tensor:
    """``[B, B]`` float64 g_n . g_m, g_n the gradient of sample n's own token-mean loss (the
    per-sample units of a token-mean objective), one backward per sample on a copy."""
    ref = copy.deepcopy(model)
    params = list(ref.parameters())  # the tied weight once
    G = torch.stack([
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            _lm_loss(ref(tokens[n:n + 1]), targets[n:n + 1]), params)])
        for n in range(B)
    ])
    return G @ G.T


def _run(model, tokens, targets, splits, instruments, reduction="mean", divide=1.0, reload_after=None):
    """The micro-batches ``splits`` through a Lens (``loss / divide`` backpropagated); returns
    (record, p.grad per parameter, the Lens). ``reload_after``: after that many micro-steps the
    Lens state goes through ``state_dict`` / ``torch.save`` into a fresh Lens on the same model."""
    m = gradlens.extend(model)
    make = lambda: Lens(m, [type(i)() for i in instruments])  # noqa: E731

    def reload(run, w, k, loss):
        if reload_after == k + 1:
            buf = io.BytesIO()
            torch.save(run.lens.state_dict(), buf)
            run.lens.close(write_pending=False)
            run.lens = make()
            buf.seek(0)
            run.lens.load_state_dict(torch.load(buf, weights_only=False))

    run = run_windows(m, [[(tokens[sl], targets[sl]) for sl in splits]], lens=make(), fresh_copy=False,
                      loss=lambda out, y: _lm_loss(out, y, reduction), capture={"reduction": reduction}, pass_loss=True,
                      objective=lambda loss, run, w, k: loss / divide, on_micro=reload)
    return run.flushed[0], {k: p.grad.clone() for k, p in m.named_parameters()}, run.lens


def _autograd_grads(model, tokens, targets, splits, reduction="mean", divide=1.0):
    ref = copy.deepcopy(model)
    for sl in splits:
        (_lm_loss(ref(tokens[sl]), targets[sl], reduction) / divide).backward()
    return {k: p.grad for k, p in ref.named_parameters()}


SPLITS = {"K1": (slice(0, B),), "K3-unequal": (slice(0, 3), slice(3, 4), slice(4, B))}


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_batch_dot_alone_carries_the_scale_and_matches_the_oracle(split, reduction, monkeypatch):
    from gradlens.instruments import crosssample

    model, tokens, targets = _problem()
    splits = SPLITS[split]
    kept = []
    real = crosssample._CrossSample.update_layer

    def spy(self, state, module, a, delta, weight_grad=None, scale=None):
        kept.append(scale)
        return real(self, state, module, a, delta, weight_grad=weight_grad, scale=scale)

    monkeypatch.setattr(crosssample._CrossSample, "update_layer", spy)
    copies = []
    real_units = crosssample._Layer.units
    monkeypatch.setattr(crosssample._Layer, "units", lambda lay: copies.append(lay.scale) or real_units(lay))
    rec, grads, lens = _run(copy.deepcopy(model), tokens, targets, splits, [BatchDot()], reduction)
    assert lens._meter.plan.carry_scale
    # the window's Gram scales its blocks: no delta * scale copy, one micro-step or several
    assert not [c for c in copies if c is not None]
    # every closed-form use (3 LayerNorms, 6 fused Linears) came unscaled, with its scale
    assert sum(s is not None for s in kept) == 9 * len(splits)
    want = _oracle_gram(model, tokens, targets)
    if reduction == "sum":  # units of a token sum: T x those of the token mean
        want = want * T * T
    torch.testing.assert_close(rec["batch_dot"], want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))
    for k, g in _autograd_grads(model, tokens, targets, splits, reduction).items():
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-15, msg=k)


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_tensor_scale_of_a_divided_loss(split):
    """``(loss / 3).backward()``: the scale B / c is a 0-d tensor (c seen in backward); the
    carried Gram blocks and dL/dW stay in their units."""
    model, tokens, targets = _problem()
    splits = SPLITS[split]
    rec, grads, lens = _run(copy.deepcopy(model), tokens, targets, splits, [BatchDot()], divide=3.0)
    assert lens._meter.plan.carry_scale
    want = _oracle_gram(model, tokens, targets)
    torch.testing.assert_close(rec["batch_dot"], want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))
    for k, g in _autograd_grads(model, tokens, targets, splits, divide=3.0).items():
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-15, msg=k)


def test_state_saved_mid_window_keeps_the_scale():
    """A window's unscaled factors and their scales survive ``Lens.state_dict`` (reloaded after
    the first of three micro-steps): the record still equals the oracle."""
    model, tokens, targets = _problem()
    rec, _, _ = _run(copy.deepcopy(model), tokens, targets, SPLITS["K3-unequal"], [BatchDot()], reload_after=1)
    want = _oracle_gram(model, tokens, targets)
    torch.testing.assert_close(rec["batch_dot"], want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize("others", [[InnerTest()], [BatchL2(), SumGradSquared()]])
def test_beside_other_instruments_no_scale_is_carried(others):
    """Instruments that read per-sample units share the Lens: every use is scaled once, as
    before, and BatchDot's record is the same as alone (and the oracle's)."""
    model, tokens, targets = _problem()
    splits = SPLITS["K3-unequal"]
    rec, grads, lens = _run(copy.deepcopy(model), tokens, targets, splits, [BatchDot(), *others])
    assert not lens._meter.plan.carry_scale
    alone, _, _ = _run(copy.deepcopy(model), tokens, targets, splits, [BatchDot()])
    torch.testing.assert_close(rec["batch_dot"], alone["batch_dot"], rtol=1e-12, atol=0)
    want = _oracle_gram(model, tokens, targets)
    torch.testing.assert_close(rec["batch_dot"], want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))
    for k, g in _autograd_grads(model, tokens, targets, splits).items():
        torch.testing.assert_close(grads[k], g, rtol=1e-12, atol=1e-15, msg=k)


def test_sketch_mode_does_not_carry_the_scale():
    """Sketch mode reduces each use at once: it sees per-sample units (no carried scale)."""
    model, _, _ = _problem()
    lens = Lens(gradlens.extend(model), [BatchDot(mode="sketch", k=16)])
    assert not lens._meter.plan.carry_scale
    lens.close()
