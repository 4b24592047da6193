"""Issue 42, mixture-of-experts routing without transformers: a hand-written routed block in
the three forms transformers 5.x runs (an eager loop over the experts hit, ``torch.where`` +
``x[token_idx]`` + ``F.linear(x, w[e])`` + ``index_add_``; batched ``w[expert_ids]`` + ``bmm``;
``F.grouped_mm`` with offsets over tokens sorted by expert), 3-D expert weights ``[E, out, in]``,
a top-k router and a shared expert. The capture follows each routed token's sample through the
routing (gradlens.capture.samples: the 0-dim expert index picks a slice of the parameter, the
joint index ``w[token_idx, top_k_pos]``, the write back by ``index_add_``), so every parameter
is tracked (coverage 1.0) and exact against a per-sample loop on a float64 copy taken before
``gradlens.extend``, K = 3 micro-batches of 2, 3, 1. A load-balancing loss weighted by the
batch's expert fractions couples the samples: refused by the mixing rule (``undefined="error"``
names the operation and the parameters, ``"exclude"`` leaves them out and says so)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gradlens.instruments import BatchDot, BatchL2, GradNorm, SumGradSquared
from oracle import per_sample_loop
from windows import run_windows

SIZES = [2, 3, 1]
N = sum(SIZES)
T, D_IN, D, HID, E, K, C = 5, 4, 8, 8, 4, 2, 3


class TinyMoE(nn.Module):
    """``[B, T, D_IN]`` -> ``[B, C]``: a Linear in, a routed block of E experts (top-K, gate
    weights renormalised, 3-D weights ``w_up [E, HID, D]``, ``w_down [E, D, HID]``) plus a
    shared expert (gated by a sigmoid), residual, a mean over the tokens and a head. ``form``:
    how the experts run (``"loop"``, ``"batched"``, ``"grouped"``: the last in float32 only, as
    torch's CPU grouped_mm). ``aux``: the forward also returns a load-balancing loss."""

    def __init__(self, form: str = "loop", aux: bool = False):
        super().__init__()
        self.form, self.aux = form, aux
        self.inp = nn.Linear(D_IN, D)
        self.gate = nn.Linear(D, E, bias=False)
        self.w_up = nn.Parameter(torch.randn(E, HID, D) / D ** 0.5)
        self.w_down = nn.Parameter(torch.randn(E, D, HID) / HID ** 0.5)
        self.shared = nn.Sequential(nn.Linear(D, HID), nn.SiLU(), nn.Linear(HID, D))
        self.shared_gate = nn.Linear(D, 1, bias=False)
        self.head = nn.Linear(D, C)

    def experts(self, h, idx, w):
        if self.form == "loop":
            out = torch.zeros_like(h)
            with torch.no_grad():
                mask = F.one_hot(idx, E).permute(2, 1, 0)  # [E, K, rows]
                hit = (mask.sum((-1, -2)) > 0).nonzero()
            for e in hit:
                e = e[0]
                pos, tok = torch.where(mask[e])
                y = F.linear(F.silu(F.linear(h[tok], self.w_up[e])), self.w_down[e])
                out.index_add_(0, tok, y * w[tok, pos, None])
            return out
        if self.form == "batched":
            ids = idx.reshape(-1)
            x = h.repeat_interleave(K, dim=0)
            y = torch.bmm(self.w_up[ids], x.unsqueeze(-1)).squeeze(-1)
            y = torch.bmm(self.w_down[ids], F.silu(y).unsqueeze(-1)).squeeze(-1)
            return (y * w.reshape(-1, 1)).view(h.shape[0], K, D).sum(1)
        ids, perm = torch.sort(idx.reshape(-1))  # "grouped"
        offs = torch.cumsum(torch.bincount(ids, minlength=E), 0).to(torch.int32)
        x = h[perm // K]
        y = F.grouped_mm(F.silu(F.grouped_mm(x, self.w_up.transpose(-2, -1), offs=offs)),
                         self.w_down.transpose(-2, -1), offs=offs)
        y = y * w.reshape(-1)[perm].unsqueeze(-1)
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel())
        return y[back].view(h.shape[0], K, D).sum(1)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.inp(x).reshape(-1, D)  # [B * T, D]: the samples the leading factor
        probs = F.softmax(self.gate(h), dim=-1)
        w, idx = torch.topk(probs, K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        routed = self.experts(h, idx, w)
        shared = torch.sigmoid(self.shared_gate(h)) * self.shared(h)
        out = self.head((h + routed + shared).view(b, t, D).mean(1))
        if not self.aux:
            return out
        with torch.no_grad():
            frac = F.one_hot(idx, E).sum((0, 1)).to(probs.dtype) / idx.numel()  # the batch's expert fractions
        return out, E * (frac * probs.sum(0) / probs.shape[0]).sum()


def _data(g):
    x = torch.randn(N, T, D_IN, generator=g, dtype=torch.float64)
    return x, torch.randint(0, C, (N,), generator=g)


def _oracle(model, x, y, aux=0.0):
    """name -> [N, *param] per-sample gradients of each sample's own loss (float64 loop form)."""
    ref = copy.deepcopy(model).double()
    ref.form = "loop"

    def loss_n(m, i):
        out = m(x[i:i + 1])
        if m.aux:
            return F.cross_entropy(out[0], y[i:i + 1]) + aux * out[1]
        return F.cross_entropy(out, y[i:i + 1])

    return per_sample_loop(ref, ref.state_dict(), loss_n, N)


def _check(rec, G, names, rtol):
    flat = torch.cat([G[k].flatten(1) for k in names], 1)
    torch.testing.assert_close(torch.as_tensor(rec["batch_l2"]).double(), (flat ** 2).sum(1), rtol=rtol, atol=1e-12)
    for k in names:
        torch.testing.assert_close(torch.as_tensor(rec["sum_grad_squared"][k]).double(), (G[k] ** 2).sum(0),
                                   rtol=rtol, atol=1e-12)
    assert float(rec["grad_norm"]) == pytest.approx(float(flat.mean(0).norm()), rel=rtol)
    if "batch_dot" in rec.values:
        torch.testing.assert_close(torch.as_tensor(rec["batch_dot"]).double(), flat @ flat.T, rtol=rtol, atol=1e-12)


@pytest.mark.parametrize("form", ["loop", "batched", "grouped"])
def test_routed_experts_exact_with_full_coverage(form):
    """Every parameter tracked (router, experts, shared expert and its gate): coverage 1.0 and
    batch_l2, sum_grad_squared, grad_norm, batch_dot == the per-sample loop, K = 3 unequal
    micro-batches; the grouped form (float32, torch's CPU grouped_mm) to float32 precision."""
    torch.manual_seed(0)
    model = TinyMoE(form).double()
    x, y = _data(torch.Generator().manual_seed(1))
    G = _oracle(model, x, y)
    dtype = torch.float32 if form == "grouped" else torch.float64
    run_model = model.to(dtype)
    run = run_windows(run_model, [list(zip(x.to(dtype).split(SIZES), y.split(SIZES)))],
                      [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()], close=False)
    assert run.lens.coverage == 1.0
    names = [k for k, _ in model.named_parameters()]
    assert set(run.lens.tracked) == set(names)
    _check(run.record, G, names, 1e-4 if form == "grouped" else 1e-10)
    run.lens.close()


def test_routed_experts_every_token_to_one_expert():
    """All tokens routed to one expert (the router's bias forces it): the loop runs one
    expert, the others' slices get zero per-sample gradients, still exact."""
    torch.manual_seed(3)
    model = TinyMoE("loop").double()
    with torch.no_grad():
        model.gate.weight.zero_()
        model.gate.weight[0, 0] = 50.0
        model.gate.weight[1, 0] = 40.0
        model.inp.bias.fill_(1.0)
        model.inp.weight[0].zero_()
    x, y = _data(torch.Generator().manual_seed(4))
    G = _oracle(model, x, y)
    assert float(G["w_up"][:, 2:].abs().max()) == 0.0
    run = run_windows(model, [list(zip(x.split(SIZES), y.split(SIZES)))], [BatchL2(), SumGradSquared(), GradNorm()])
    _check(run.record, G, [k for k, _ in model.named_parameters()], 1e-10)


def _aux_run(undefined):
    torch.manual_seed(0)
    model = TinyMoE("loop", aux=True).double()
    x, y = _data(torch.Generator().manual_seed(1))
    loss = lambda out, t: F.cross_entropy(out[0], t) + 0.1 * out[1]  # noqa: E731
    kw = {} if undefined is None else {"undefined": undefined}
    return model, x, y, lambda: run_windows(model, [list(zip(x.split(SIZES), y.split(SIZES)))],
                                             [BatchL2(), SumGradSquared(), GradNorm()], loss=loss,
                                             capture={"reduction": "mean"}, pass_loss=True, **kw)


def test_load_balancing_loss_refused_naming_op_and_parameters():
    """The load-balancing term weights the router's pooled probabilities by the batch's expert
    fractions: a sample's share depends on the others. The default refuses, naming the
    operation, the statistic and the parameters before it, and the fix."""
    _, _, _, go = _aux_run(None)
    with pytest.raises(RuntimeError, match=r"undefined: their output reaches mul of a value pooled over the samples "
                                           r"\(.*\) by a statistic of the whole batch .*'gate.weight'.*undefined='exclude'"):
        go()


def test_load_balancing_loss_excluded_rest_exact():
    """``undefined="exclude"``: the parameters before the router (input Linear, router) are left
    out and named in the record's meta; the others (experts, shared expert, head) stay exact
    against the loop of each sample's own loss with the term (which does not reach them)."""
    model, x, y, go = _aux_run("exclude")
    run = go()
    rec = run.record
    left = set(rec.meta["undefined"])
    assert left == {"inp.weight", "inp.bias", "gate.weight"}
    assert all("statistic of the whole batch" in why for why in rec.meta["undefined"].values())
    names = [k for k, _ in model.named_parameters() if k not in left]
    assert rec.meta["coverage"] < 1.0
    _check(rec, _oracle(model, x, y, aux=0.1), names, 1e-10)
