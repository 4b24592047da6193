"""``nn.Bilinear``, a layer of two inputs (issue 34): its uses carry both inputs to a factored
kernel. Exactness on a model against the float64 oracle runs in tests/test_models_oracle.py
(case ``bilinear``) and the kernel's every method in tests/test_kernel_contract.py; here: the
kernel is what measures it, a tracked window's peak memory stays far below the per-sample weight
gradients it would otherwise form, and inputs the capture cannot follow are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from gradlens.kernels import BilinearKernel, Kernel, check_kernel
from oracle import per_sample_loop


class _Pair(nn.Module):
    def __init__(self, d=4, o=3, classes=3):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.bil = nn.Bilinear(d, d, o)
        self.head = nn.Linear(o, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.bil(torch.tanh(self.a(x)), x)))


def test_bilinear_is_measured_by_its_kernel_exactly(monkeypatch):
    torch.manual_seed(0)
    model = _Pair().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    want = per_sample_loop(model, model.state_dict(),
                           lambda m, i: nn.functional.cross_entropy(m(x[i:i + 1]), y[i:i + 1]), 6)
    calls = []
    real = BilinearKernel.batch_l2
    monkeypatch.setattr(BilinearKernel, "batch_l2", lambda self, *a: calls.append(1) or real(self, *a))
    m = gradlens.extend(model)
    lens = Lens(m, [BatchL2(), SumGradSquared(), GradNorm()])
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    for s, e in ((0, 2), (2, 5), (5, 6)):
        loss = loss_fn(m(x[s:e]), y[s:e]) * (e - s) / 6
        with lens.capture():
            loss.backward()
    rec = lens.flush()
    assert len(calls) == 3  # one factored call per micro-step, no per-operation rule
    torch.testing.assert_close(rec["batch_l2"], sum(g.flatten(1).square().sum(1) for g in want.values()),
                               rtol=1e-10, atol=1e-12)
    for q in ("bil.weight", "bil.bias"):
        torch.testing.assert_close(rec["sum_grad_squared"][q], want[q].square().sum(0), rtol=1e-10, atol=1e-12)
    G = torch.cat([g.flatten(1) for g in want.values()], 1)
    torch.testing.assert_close(torch.as_tensor(rec["grad_norm"], dtype=torch.float64), G.mean(0).norm(),
                               rtol=1e-10, atol=1e-12)
    lens.close()


_PEAK = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torch import nn
    import gradlens
    from gradlens import Lens
    from gradlens.instruments import BatchDot, BatchL2, GradNorm, SumGradSquared
    torch.set_num_threads(1)
    B, I1, I2, O = 48, 96, 96, 48
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(I1, I1)
            self.bil = nn.Bilinear(I1, I2, O)
        def forward(self, x1, x2):
            return self.bil(torch.tanh(self.a(x1)), x2).sum(1)

    model = gradlens.extend(Net().double())
    loss_fn = gradlens.extend(nn.MSELoss())
    data = [(torch.randn(B, I1, dtype=torch.float64), torch.randn(B, I2, dtype=torch.float64),
             torch.randn(B, dtype=torch.float64)) for _ in range(2)]
    lens, got = None, []

    def window():
        for x1, x2, y in data:
            loss = loss_fn(model(x1, x2), y) / 2
            if lens is None:
                loss.backward()
                continue
            with lens.capture():
                loss.backward()
        if lens is not None:
            got.append(lens.flush())
        model.zero_grad()

    def maxrss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    window()
    window()  # warm-up: untracked windows, no Lens
    base = maxrss()
    window()
    untracked = maxrss() - base
    lens = Lens(model, [BatchL2(), SumGradSquared(), GradNorm(), BatchDot()])
    full, data = data, [tuple(t[:2] for t in mb) for mb in data]
    window()  # a tracked window of 2 samples per micro-step: what is allocated once (imports, buffers)
    data = full
    base = maxrss()
    window()  # a tracked window of B samples per micro-step
    tracked = maxrss() - base
    assert len(got) == 2 and got[-1]["batch_l2"].shape == (2 * B,), got[-1]["batch_l2"].shape
    print(json.dumps({"untracked": untracked, "tracked": tracked,
                      "per_sample_bytes": B * O * I1 * I2 * 8, "weight_bytes": O * I1 * I2 * 8}))
    """
)


def test_bilinear_tracked_window_peak_stays_below_per_sample_weight_gradients():
    """The peak resident memory of a tracked window (BatchL2, SumGradSquared, GradNorm,
    BatchDot) over an untracked one's, in a fresh process: well below the ``[B, O, I1, I2]``
    per-sample weight gradients (here 170 MB) that the per-operation rule would form."""
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    extra = got["tracked"]
    assert extra < got["per_sample_bytes"] / 8, got
    assert extra < 8 * got["weight_bytes"], got  # a few copies of the weight (its sums), no more


class _OneFromParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.z = nn.Parameter(torch.randn(1, 3))
        self.bil = nn.Bilinear(4, 3, 2)

    def forward(self, x):
        return self.bil(self.a(x), self.z.expand(x.shape[0], 3))


class _Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.bil = nn.Bilinear(4, 4, 2)

    def forward(self, x):
        h = self.a(x)
        return self.bil(h, input2=h)


@pytest.mark.parametrize("net, says, exclude", [
    (_OneFromParams, "input 2 does not carry the samples", ["bil", "z"]),
    (_Keyword, "call it as module(x1, x2)", ["bil"]),
])
def test_bilinear_inputs_the_capture_cannot_follow_are_refused(net, says, exclude):
    m = gradlens.extend(net().double())
    lens = Lens(m, [BatchL2()])
    x, y = torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 2, (3,))
    with pytest.raises(RuntimeError, match="cannot tell the sample axis") as err:
        loss = gradlens.extend(nn.CrossEntropyLoss())(m(x), y)
        with lens.capture():
            loss.backward()
    assert says in str(err.value) and "exclude=" in str(err.value)
    lens.close()
    # the fix the error names works: the layer left out, the rest tracked
    m2 = gradlens.extend(net().double())
    lens = Lens(m2, [BatchL2()], exclude=exclude)
    loss = gradlens.extend(nn.CrossEntropyLoss())(m2(x), y)
    with lens.capture():
        loss.backward()
    assert lens.flush()["batch_l2"].shape == (3,)
    lens.close()


def test_check_kernel_reads_the_inputs_declaration():
    class NoJoin(Kernel):
        inputs = 2

        def per_sample(self, module, a, delta, start, stop, attrs=None):
            return {}

    class Zero(NoJoin):
        inputs = 0

    with pytest.raises(TypeError, match="does not define join_inputs"):
        check_kernel(NoJoin())
    with pytest.raises(TypeError, match="positive int"):
        check_kernel(Zero())
    check_kernel(BilinearKernel())
