"""Issue 36, rows of the batch moved, selected or repeated, and the sample axis never guessed:
the capture follows which sample each row holds (gradlens.capture.rows.Rows) through
permutations with a known index (``index_select``, ``h[p]``, ``gather``, ``flip``, ``roll``, a
sort by length and the unsort after), selections (slices and ``split`` / ``chunk`` of the batch,
boolean masks, indexed writes back), repetitions (``repeat_interleave``, ``repeat``) and
flattenings in which the samples do not lead (``[T, B, d] -> [T * B, d]``); where it cannot, it
refuses, naming the place and the fix. Each row's loss is its sample's (a row that holds sample
p[j] reports to p[j]). Oracle: per-row gradients through the micro-batch's forward on a float64
deep copy taken before ``gradlens.extend``, K unequal micro-batches; sizes where B equals another
dim (T, d) so that nothing can be read from sizes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.capture.axes import carry
from gradlens.capture.rows import Rows
from gradlens.capture.samples import follow
from gradlens.instruments import BatchDot, BatchL2, SumGradSquared

SPLIT = [6, 2, 4]
N = sum(SPLIT)
D = 6  # == the first micro-batch: sizes tell nothing


def _perm(n):
    return torch.arange(n - 1, -1, -1).roll(1)


def _inv(p):
    return torch.argsort(p)


def _inv_perm_owner(n):
    return _inv(_perm(n))


def _setitem(c, h):
    out = torch.zeros_like(h)
    out[_perm(len(h))] = c(h)  # row p[j] holds sample j
    return out


def _sort_unsort(c, h):
    lengths = h[:, 0].detach().abs()
    _, order = lengths.sort(descending=True)
    return c(h[order])[torch.argsort(order)]


#: name -> (forward of h [B, 6] through the layer c, the sample of each output row given B: None
#: means row j is sample j)
ROUTES = {
    "index_select": (lambda c, h: c(h.index_select(0, _perm(len(h)))).index_select(0, _inv(_perm(len(h)))), None),
    "getitem": (lambda c, h: c(h[_perm(len(h))])[_inv(_perm(len(h)))], None),
    "getitem_list": (lambda c, h: c(h[_perm(len(h)).tolist()])[_inv(_perm(len(h))).tolist()], None),
    "kept_permuted": (lambda c, h: c(h[_perm(len(h))]), _perm),
    "gather": (lambda c, h: torch.gather(c(torch.gather(h, 0, _perm(len(h))[:, None].expand(-1, D))), 0,
                                         _inv(_perm(len(h)))[:, None].expand(-1, D)), None),
    "flip": (lambda c, h: c(h.flip(0)).flip(0), None),
    "flipud": (lambda c, h: torch.flipud(c(torch.flipud(h))), None),
    "roll": (lambda c, h: torch.roll(c(torch.roll(h, 2, 0)), -2, 0), None),
    "halves": (lambda c, h: torch.cat([c(h[: len(h) // 2]), c(h[len(h) // 2:])]), None),
    "split": (lambda c, h: torch.cat([c(t) for t in h.split(1)]), None),
    "chunk": (lambda c, h: torch.cat([c(t) for t in h.chunk(2)]), None),
    "narrow": (lambda c, h: torch.cat([c(h.narrow(0, 0, 1)), c(h.narrow(0, 1, len(h) - 1))]), None),
    "mask": (lambda c, h: torch.zeros_like(h).index_put((torch.arange(len(h)) % 2 == 0,), c(h[torch.arange(len(h)) % 2 == 0]))
             + h * (torch.arange(len(h)) % 2 == 1)[:, None], None),
    "setitem": (_setitem, _inv_perm_owner),
    "index_copy": (lambda c, h: torch.zeros_like(h).index_copy(0, _perm(len(h)), c(h)), _inv_perm_owner),
    "repeat_interleave": (lambda c, h: c(h.repeat_interleave(3, 0)).view(len(h), 3, D).sum(1), None),
    "repeat": (lambda c, h: c(h.repeat(2, 1)).view(2, len(h), D).sum(0), None),
    "time_major": (lambda c, h: c((h.unsqueeze(1) * torch.linspace(0.5, 1.5, 3, dtype=h.dtype)[None, :, None])
                                  .transpose(0, 1).reshape(-1, D)).view(3, len(h), D).mean(0), None),
    "sort_by_length": (_sort_unsort, None),
}




class Rowed(nn.Module):
    def __init__(self, route):
        super().__init__()
        self.route = route
        self.a = nn.Linear(5, D)
        self.c = nn.Linear(D, D)
        self.b = nn.Linear(D, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(torch.tanh(ROUTES[self.route][0](self.c, h)))


def _data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (N,), generator=g)


def _oracle(model, x, y, owner_of):
    """[N, D] per-sample gradients: row j's loss belongs to sample owner(B)[j] of its micro-batch."""
    params = list(model.parameters())
    rows, start = [], 0
    for b in SPLIT:
        losses = F.cross_entropy(model(x[start:start + b]), y[start:start + b], reduction="none")
        owner = torch.arange(b) if owner_of is None else owner_of(b)
        for n in range(b):
            j = int((owner == n).nonzero()[0])
            g = torch.autograd.grad(losses[j], params, retain_graph=True)
            rows.append(torch.cat([v.reshape(-1) for v in g]))
        start += b
    return torch.stack(rows)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_rows_moved_selected_or_repeated_are_measured_as_their_samples(route):
    torch.manual_seed(0)
    base = Rowed(route).double()
    oracle = copy.deepcopy(base)
    model = gradlens.extend(base)
    x, y = _data()
    lens = Lens(model, [BatchL2(), SumGradSquared(), BatchDot()])
    start = 0
    for b in SPLIT:
        loss = F.cross_entropy(model(x[start:start + b]), y[start:start + b], reduction="sum")
        with lens.capture(reduction="sum", loss=loss):
            loss.backward()
        start += b
    rec = lens.flush()
    G = _oracle(oracle, x, y, ROUTES[route][1])
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-13)
    total = torch.cat([rec["sum_grad_squared"][q].reshape(-1) for q, _ in oracle.named_parameters()])
    torch.testing.assert_close(total, G.square().sum(0), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(rec["batch_dot"], G @ G.T, rtol=1e-10, atol=1e-13)
    lens.close()


def test_the_rules_follow_rows_and_read_nothing_from_sizes():
    """The answers of the rows rules, B == T == d == 4: a permutation, a slice and a mask of the
    samples, a flattening where they do not lead, its inverse (back to a plain axis)."""
    b = 4
    x = torch.randn(b, b, b)
    p = torch.tensor([2, 0, 3, 1])

    def run(func, args, ax, **kw):
        out = func(*args, **kw)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        got = carry(func, args, kw, args[0], ax, outs, b)
        return follow(func, args, kw, args[0], ax, outs, b, got)

    got = run(torch.Tensor.__getitem__, (x, p), (0, 1))[0]
    assert type(got) is Rows and got[0] == 0 and got.owner.tolist() == [2, 0, 3, 1]
    got = run(torch.Tensor.__getitem__, (x, (slice(None), p)), (0, 1))[0]
    assert got == (0, 1)  # a permutation of another dim: the samples' rows stay
    got = run(torch.Tensor.__getitem__, (x, slice(1, 3)), (0, 1))[0]
    assert got.owner.tolist() == [1, 2]
    got = run(torch.Tensor.__getitem__, (x, torch.tensor([True, False, True, True])), (0, 1))[0]
    assert got.owner.tolist() == [0, 2, 3]
    got = run(torch.Tensor.reshape, (x.transpose(0, 1), (b * b, b)), (1, 1))[0]  # [T, B, d] -> [T * B, d]
    assert got[0] == 0 and got.owner.tolist() == list(range(b)) * b
    flat = x.transpose(0, 1).reshape(b * b, b)
    assert run(torch.Tensor.view, (flat, (b, b, b)), got)[0] == (1, 1)  # back: the samples on dim 1
    assert run(torch.flip, (x, [0]), (0, 1))[0].owner.tolist() == [3, 2, 1, 0]
    assert run(torch.flip, (x, [1]), (0, 1))[0] == (0, 1)
    assert run(torch.roll, (x, 1, 0), (0, 1))[0].owner.tolist() == [3, 0, 1, 2]
    assert run(torch.index_select, (x, 0, p), (0, 1))[0].owner.tolist() == [2, 0, 3, 1]
    assert run(torch.index_select, (x, 0, torch.argsort(p)), Rows(0, p))[0] == (0, 1)  # undone
    parts = run(torch.split, (x, [1, 3], 0), (0, 1))
    assert [q.owner.tolist() for q in parts] == [[0], [1, 2, 3]]


class Unknown(nn.Module):
    """The samples lost on the way to a layer: ``x[0]`` picks one sample, a reshape spreads them
    over two dims, ``torch.cat`` with a parameter's rows."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.extra = nn.Parameter(torch.zeros(1, 4))

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.how == "pick":
            h = h[0].expand_as(h)
        elif self.how == "spread":
            h = h.reshape(2, -1, 4).transpose(0, 1).reshape(-1, 4)
        elif self.how == "padded_rows":  # rows of a parameter among the samples' (a constant's are followed)
            h = torch.cat([h, self.extra])[: len(x)]
        return self.b(h)


@pytest.mark.parametrize("how, where", [
    ("pick", r"__getitem__ of a \[4, 4\] tensor into \[4\]"),
    ("spread", r"transpose of a \[2, 2, 4\] tensor into \[2, 2, 4\]|reshape of a \[4, 4\] tensor into \[2, 2, 4\]"),
    ("padded_rows", r"cat of a \[4, 4\] tensor into \[5, 4\]"),
])
def test_where_the_samples_cannot_be_followed_the_use_is_refused_naming_the_place(how, where):
    """B == d == 4: the micro-batch's size is on every dim, and nothing is guessed from it."""
    torch.manual_seed(0)
    model = gradlens.extend(Unknown(how).double())
    lens = Lens(model, [BatchL2()])
    x = torch.randn(4, 4, dtype=torch.float64)
    loss = F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"cannot tell the sample axis at [12] place\(s\) of the forward \(micro-batch "
                                           r"of 4\): .*the input of 'b' \(Linear, shape \(4, 4\)\) \(its sample axis was "
                                           rf"lost at ({where})\)\..*Lens\(\.\.\., exclude=\[\.\.\.\]\)"):
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()
    lens.close()
    lens = Lens(model, [BatchL2()], exclude=["b", "extra"])  # the fix, as written: the layer left out
    loss = F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    with lens.capture(reduction="mean", loss=loss):
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (4,)
    lens.close()


def test_a_backward_that_measured_nothing_says_why_not_that_it_did_not_run():
    """Every use refused: the error is the refusal (the backward ran); a capture without a
    backward still says that."""
    torch.manual_seed(0)

    class Spread(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Linear(4, 3)

        def forward(self, x):
            return self.b(x.reshape(2, -1, 4).transpose(0, 1).reshape(-1, 4) * 2)

    model = gradlens.extend(Spread().double())
    lens = Lens(model, [BatchL2()])
    x = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    out = model(x)
    loss = F.cross_entropy(out, torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"cannot tell the sample axis at 1 place\(s\).*the input of 'b'"):
        with lens.capture(reduction="mean", loss=loss):
            loss.backward()
    loss = F.cross_entropy(model(x), torch.zeros(4, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"exited without a backward pass"):
        with lens.capture(reduction="mean", loss=loss):
            pass
    lens.close()
