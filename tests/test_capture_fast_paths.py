"""The tracked forward's shortcuts (gradlens/capture/) give what following every operation
gives: closed-form sites and parameter-free elementwise modules (dropout, activations) run with
the mode off the torch-function stack; a user's own TorchFunctionMode inside the forward, an
exception inside a site, and hooks registered on those modules after the Tap keep every use
followed. Oracle: float64 per-sample gradients from a per-sample loop on a deep copy taken
before gradlens sees the model, K unequal micro-steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

import gradlens
from gradlens import Lens, compat
from gradlens.instruments import BatchL2, SumGradSquared
from windows import micro_batches, run_windows

SPLIT = [3, 1, 4]
D = 5


class Elementwise(nn.Module):
    """Activation and dropout modules on data, on a parameter (derived), in place, on a
    [T, B, d] input (``batch_dim=1``), and inside a user's own TorchFunctionMode."""

    def __init__(self, inner_mode: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.act = nn.GELU()
        self.relu = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.0)
        self.tanh = nn.Tanh()
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, D))  # through an activation module
        self.fc2 = nn.Linear(D, 3)
        self.inner_mode = inner_mode

    def body(self, x):  # x [T, B, d]
        h = self.drop(self.act(self.fc1(x)))
        h = self.relu(h * 1.5) + 0.1 * h
        h = h * self.tanh(self.gate)  # the derived gate meets the batch
        return self.fc2(self.tanh(h)).sum(0)  # [B, 3]

    def forward(self, x):
        if self.inner_mode:
            with _Passing():
                return self.body(x)
        return self.body(x)


class _Passing(TorchFunctionMode):
    """A user's mode: it sees the calls and changes nothing."""

    calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        _Passing.calls += 1
        return func(*args, **(kwargs or {}))


def _oracle(model, x, y):
    """[N, P] float64 per-sample gradients of ||model(x_n) - y_n||^2 (x [T, N, d])."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for n in range(x.shape[1]):
        out = model(x[:, n:n + 1])
        g = torch.autograd.grad((out - y[n:n + 1]).square().sum(), params)
        rows.append(torch.cat([v.reshape(-1) for v in g]))
    return torch.stack(rows)


def _oracle_batch_first(model, x, y):
    """[N, P] float64 per-sample gradients of ||model(x_n) - y_n||^2 (x [N, ...]), one sample at a time."""
    params = list(model.parameters())
    rows = []
    for n in range(x.shape[0]):
        g = torch.autograd.grad((model(x[n:n + 1]) - y[n:n + 1]).square().sum(), params)
        rows.append(torch.cat([v.reshape(-1) for v in g]))
    return torch.stack(rows)


def _seq_first(x, y):
    """The window of micro-batches SPLIT of ``x [T, N, d]`` (samples on dim 1) and ``y [N, 3]``."""
    return list(zip(x.split(SPLIT, dim=1), y.split(SPLIT)))


def _assert_norms(rec, oracle):
    """The window's ||g_n||^2 equal the oracle's ([N, P] per-sample gradients)."""
    torch.testing.assert_close(rec["batch_l2"], oracle.square().sum(1), rtol=1e-10, atol=1e-14)


def _run(model0, x, y):
    oracle = _oracle(copy.deepcopy(model0), x, y)
    model = gradlens.extend(copy.deepcopy(model0), batch_dim=1)
    (rec,) = run_windows(model, [_seq_first(x, y)], [BatchL2(), SumGradSquared()], loss=nn.MSELoss(reduction="sum"),
                         fresh_copy=False, close=False).flushed
    _assert_norms(rec, oracle)
    names = [n for n, _ in model0.named_parameters()]
    sizes = [p.numel() for p in model0.parameters()]
    for name, block in zip(names, oracle.split(sizes, dim=1)):
        torch.testing.assert_close(rec["sum_grad_squared"][name].reshape(-1), block.square().sum(0),
                                   rtol=1e-10, atol=1e-14)
    return rec


def _problem(**kw):
    torch.manual_seed(0)
    model = Elementwise(**kw).double()
    x = torch.randn(4, sum(SPLIT), D, dtype=torch.float64)  # [T, N, d]
    y = torch.randn(sum(SPLIT), 3, dtype=torch.float64)
    return model, x, y


@pytest.mark.parametrize("inner_mode", [False, True])
def test_elementwise_modules_and_sites_are_exact_with_or_without_a_user_mode(inner_mode):
    model, x, y = _problem(inner_mode=inner_mode)
    before = _Passing.calls
    _run(model, x, y)
    assert (_Passing.calls > before) == inner_mode
    assert compat.top_function_mode() is None


def test_a_hook_added_on_an_elementwise_module_after_the_tap_is_followed():
    """A forward hook that uses a tracked parameter on an activation's output, registered
    while the Tap is installed (it runs after the Tap's hooks): its use is captured."""
    model, x, y = _problem()
    extra = nn.Parameter(torch.full((D,), 0.5, dtype=torch.float64))
    model.register_parameter("extra", extra)

    def add_hook(m):
        m.act.register_forward_hook(lambda mod, args, out: out * m.extra)
        m.act.register_forward_pre_hook(lambda mod, args: (args[0] + m.extra,))

    oracle_model = copy.deepcopy(model)
    add_hook(oracle_model)  # the oracle sees the hooks in every micro-step
    oracle = _oracle(oracle_model, x, y)
    lens_model = gradlens.extend(copy.deepcopy(model), batch_dim=1)
    add_hook(lens_model)
    loss_fn = gradlens.extend(nn.MSELoss(reduction="sum"))
    (rec,) = run_windows(lens_model, [_seq_first(x, y)], [BatchL2()], loss=loss_fn, fresh_copy=False,
                         close=False).flushed
    _assert_norms(rec, oracle)

    # hooks added while the Tap is installed (after its own): the same uses followed
    model2 = copy.deepcopy(model)
    m = gradlens.extend(model2, batch_dim=1)
    lens = Lens(m, [BatchL2()])
    start = 0
    for k, b in enumerate(SPLIT):
        out = m(x[:, start:start + b])
        if k == 0:
            add_hook(m)  # the Tap is installed now; the next micro-steps' forwards see the hooks
            out = m(x[:, start:start + b])
        loss = loss_fn(out, y[start:start + b])
        with lens.capture():
            loss.backward()
        start += b
    _assert_norms(lens.flush(), oracle)


class _Fails(Exception):
    pass


def test_an_exception_inside_a_site_leaves_the_mode_stack_as_it_was():
    model, x, y = _problem()
    m = gradlens.extend(copy.deepcopy(model), batch_dim=1)
    lens = Lens(m, [BatchL2(), SumGradSquared()])
    loss_fn = gradlens.extend(nn.MSELoss(reduction="sum"))
    depth = torch._C._len_torch_function_stack()

    def boom(mod, args, out):
        raise _Fails()

    h = m.fc2.register_forward_hook(boom)  # after the Tap's post-hook of this site
    with pytest.raises(_Fails):
        m(x[:, :2])
    assert torch._C._len_torch_function_stack() == depth
    h.remove()
    h = m.act.register_forward_pre_hook(lambda mod, args: (_ for _ in ()).throw(_Fails()))
    with pytest.raises(_Fails):
        m(x[:, :2])
    assert torch._C._len_torch_function_stack() == depth
    h.remove()
    # the next micro-steps are exact
    oracle = _oracle(copy.deepcopy(model), x, y)
    (rec,) = run_windows(m, [_seq_first(x, y)], lens=lens, loss=loss_fn, fresh_copy=False, close=False).flushed
    _assert_norms(rec, oracle)


def test_elementwise_forwards_are_removed_with_the_tap():
    model, x, y = _problem()
    m = gradlens.extend(model, batch_dim=1)
    lens = Lens(m, [BatchL2()])
    out = m(x[:, :2])  # the Lens opens its window: the Tap is installed
    assert "forward" in m.act.__dict__ and "forward" in m.drop.__dict__
    copied = copy.deepcopy(m)  # a copy taken meanwhile runs its own forward
    assert "forward" not in copied.act.__dict__ or copied.act.forward.__self__ is copied.act
    lens.close()
    assert "forward" not in m.act.__dict__ and "forward" not in m.drop.__dict__
    del out


def test_the_axis_through_an_activation_is_followed_not_read_from_sizes():
    """A square [B, B, d] input transposed before an activation module: the samples move to
    dim 1 and stay there through it (the sizes alone could not tell)."""

    class Square(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x):  # x [B, 4, 4]: B == 4, the samples on dim 0
            h = self.act(x.transpose(0, 1))  # now on dim 1: followed, not read from sizes
            return self.fc(h).transpose(0, 1).sum(1)

    torch.manual_seed(0)
    model0 = Square().double()
    x = torch.randn(4, 4, 4, dtype=torch.float64)
    y = torch.randn(4, 4, dtype=torch.float64)
    oracle = _oracle_batch_first(model0, x, y)
    (rec,) = run_windows(model0, [[(x, y)]], [BatchL2()], loss=nn.MSELoss(reduction="sum"), close=False).flushed
    _assert_norms(rec, oracle)


def test_submodules_called_on_their_own_open_the_tracked_forward():
    """The training step calls the model's parts, not the model (``model.head(model.body(x))``):
    each part opens and closes the tracked forward itself; a site (``head``) and a module
    with sites and elementwise modules inside (``body``)."""

    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(D, D), nn.GELU(), nn.Dropout(0.0), nn.Linear(D, D), nn.Tanh())
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            return self.head(self.body(x))

    torch.manual_seed(0)
    model0 = Parts().double()
    x = torch.randn(sum(SPLIT), D, dtype=torch.float64)
    y = torch.randn(sum(SPLIT), 3, dtype=torch.float64)
    oracle = _oracle_batch_first(model0, x, y)

    def forward(m, mb):
        out = m.head(m.body(mb[0]))
        assert compat.top_function_mode() is None  # each part closed what it opened
        return out

    (rec,) = run_windows(model0, [micro_batches(x, y, SPLIT)], [BatchL2()], loss=nn.MSELoss(reduction="sum"),
                         forward=forward, close=False).flushed
    _assert_norms(rec, oracle)


def test_an_elementwise_module_called_on_its_own_opens_the_tracked_forward():
    """``head(act(x))`` where ``act`` (an activation module of the model) is called first,
    on its own: it opens and closes a tracked forward like any other part (the mode stack as
    it was after it), and the records stay exact."""

    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            self.act = nn.Tanh()
            self.head = nn.Linear(D, 3)

        def forward(self, x):
            return self.head(self.act(x))

    torch.manual_seed(0)
    model0 = Parts().double()
    x = torch.randn(sum(SPLIT), D, dtype=torch.float64)
    y = torch.randn(sum(SPLIT), 3, dtype=torch.float64)
    oracle = _oracle_batch_first(model0, x, y)

    def forward(m, mb):
        xb = mb[0].clone().requires_grad_(True)  # data the act's forward must mark
        h = m.act(xb)
        assert compat.top_function_mode() is None
        with pytest.raises(TypeError):
            m.act("not a tensor")  # an exception inside its forward: the forward closed again
        assert compat.top_function_mode() is None
        return m.head(h)

    (rec,) = run_windows(model0, [micro_batches(x, y, SPLIT)], [BatchL2()], loss=nn.MSELoss(reduction="sum"),
                         forward=forward, close=False).flushed
    _assert_norms(rec, oracle)

