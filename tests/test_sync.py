"""No host-device synchronisation in the hot path (issue 10).

During a tracked micro-step (forward, loss, backward inside ``lens.capture()``) gradlens must not
read a value back to the host: on a GPU that stalls the device once per layer. The CPU has no
device, so the test runs gradlens' device paths on the CPU (:func:`gradlens.core.sync.forced_device_paths`)
and patches every torch entry point that syncs: ``Tensor.item``, ``__bool__``, ``__int__``,
``__float__``, ``__index__``, ``tolist``, ``nonzero`` / ``argwhere`` / ``masked_select``, boolean
mask indexing, ``unique``, ``bincount`` (its output length is read back), ``repeat_interleave``
without ``output_size``, ``.cpu()``, ``.numpy()``, ``equal`` / ``allclose``. A call from gradlens'
own code is recorded with its file and line and the test names it. Window close (flush, the
optimizer step) may sync and is not counted.
"""

from __future__ import annotations

import collections
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    Alpha,
    BatchDot,
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    InnerTest,
    MeanGSNR,
    NoiseScale,
    NoiseScaleTwoBatch,
    NormTest,
    OrthoTest,
    SumGradSquared,
)
from gradlens.core.sync import device_paths, forced_device_paths

#: gradlens' own source folder: host reads are counted in frames from files under it only (not
#: from a virtual environment or a checkout that happens to sit in a folder named gradlens)
_PACKAGE = os.path.dirname(os.path.abspath(gradlens.__file__)) + os.sep


class HostReads:
    """Within the block, records every host-syncing torch call made from gradlens' code."""

    METHODS = ["item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero",
               "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "cpu",
               "numpy", "equal", "allclose", "is_nonzero", "repeat_interleave", "__getitem__",
               "__setitem__", "index_put_"]
    FUNCS = ["nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
             "equal", "allclose", "is_nonzero", "repeat_interleave"]

    def __init__(self):
        self.calls: collections.Counter = collections.Counter()
        self.active = False
        self._saved = []

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            if self.active and self._syncs(name, args, kwargs):
                frames = [f for f in traceback.extract_stack()[:-1]
                          if os.path.abspath(f.filename).startswith(_PACKAGE)]
                if frames:
                    f = frames[-1]
                    where = os.path.relpath(os.path.abspath(f.filename), _PACKAGE)
                    self.calls[f"{name} at {where}:{f.lineno}"] += 1
            return fn(*args, **kwargs)

        return wrapper

    @staticmethod
    def _syncs(name, args, kwargs) -> bool:
        if name == "repeat_interleave":
            return "output_size" not in kwargs
        if name in ("__getitem__", "__setitem__", "index_put_"):
            idx = args[1] if len(args) > 1 else None
            items = idx if isinstance(idx, (tuple, list)) else (idx,)
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
        return True

    def __enter__(self):
        for owner, names in ((torch.Tensor, self.METHODS), (torch, self.FUNCS)):
            for n in names:
                if hasattr(owner, n):
                    old = getattr(owner, n)
                    self._saved.append((owner, n, owner.__dict__.get(n, None), old))
                    setattr(owner, n, self._wrap(n, old))
        return self

    def __exit__(self, *exc):
        for owner, n, own, old in reversed(self._saved):
            if own is None:
                delattr(owner, n)  # it was inherited: restore the lookup
            else:
                setattr(owner, n, own)
        self._saved = []


class TinyGPT(nn.Module):
    def __init__(self, vocab=11, d=8, t=5):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, t, d) * 0.1)
        self.ln = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 16), nn.GELU(), nn.Linear(16, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, ids):
        h = self.tok(ids) + self.pos
        z = self.ln(h)
        h = h + self.attn(z, z, z, need_weights=False)[0]
        h = h + self.mlp(h)
        return self.head(h).mean(1)


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(4, 6, batch_first=True)
        self.gn = nn.GroupNorm(2, 6)
        self.out = nn.Linear(6, 11)

    def forward(self, x):
        h = self.rnn(x)[0][:, -1]
        return self.out(self.gn(h))


def _mlp():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 11))


def _cnn():
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4).eval(), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 4 * 4, 11))


MODELS = {
    "mlp": (_mlp, lambda b: torch.randn(b, 12)),
    "cnn": (_cnn, lambda b: torch.randn(b, 1, 8, 8)),
    "gpt": (TinyGPT, lambda b: torch.randint(0, 11, (b, 5))),
    "lstm": (Recurrent, lambda b: torch.randn(b, 3, 4)),
}

SETS = {
    "norms": lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale(), MeanGSNR(),
                      NoiseScaleTwoBatch()],
    "hist": lambda: [GradHist1d(), GradHist2d()],
    "hist_adapt": lambda: [GradHist1d(adapt="abs_max"), GradHist2d(adapt="min_max")],
    "cross": lambda: [BatchDot(), InnerTest(), OrthoTest(), Alpha()],
    "sketch": lambda: [BatchDot(mode="sketch", k=8)],
    "sampled": lambda: [GradHist1d(sample=0.3), GradHist2d(sample=0.3, adapt="abs_max")],
}


def _train(make, data, insts, reads: HostReads | None, windows=3, splits=(3, 5), **lens_kwargs):
    """The probe's loop: ``reads`` active from each tracked micro-step's forward to the end of its
    backward (a second forward gives the per-sample losses inside it). Returns the records."""
    torch.manual_seed(0)
    model = gradlens.extend(make())
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lens = Lens(model, insts(), optimizer=opt, **lens_kwargs)
    torch.manual_seed(1)
    for _ in range(windows):
        for b in splits:
            x, y = data(b), torch.randint(0, 11, (b,))
            if reads is not None:
                reads.active = True
            loss = loss_fn(model(x), y)
            with lens.capture(losses=F.cross_entropy(model(x), y, reduction="none").detach()):
                loss.backward()
            if reads is not None:
                reads.active = False
        opt.step()  # closes the window
        opt.zero_grad()
    records = list(lens.records)
    lens.close()
    return records


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("what", sorted(SETS))
def test_tracked_micro_steps_make_no_host_read(model, what):
    make, data = MODELS[model]
    with forced_device_paths(), HostReads() as reads:
        _train(make, data, SETS[what], reads)
    assert not reads.calls, (
        f"host reads in the hot path ({model}, {what}): " + ", ".join(f"{k} x{v}" for k, v in reads.calls.items())
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_device_paths_give_the_same_records(model):
    """The CPU shortcuts and the device paths are both exact: same histograms, same sums."""
    make, data = MODELS[model]
    insts = lambda: [GradHist1d(bins=30, range=(-0.5, 0.5)), GradHist2d(bins=(6, 20)), BatchL2(),  # noqa: E731
                     SumGradSquared()]
    cpu = _train(make, data, insts, None)
    with forced_device_paths():
        dev = _train(make, data, insts, None)
    assert len(cpu) == len(dev) == 3
    for a, b in zip(cpu, dev):
        assert a["grad_hist_1d"] == b["grad_hist_1d"]
        assert torch.equal(a["grad_hist_2d"].counts, b["grad_hist_2d"].counts)
        torch.testing.assert_close(a["batch_l2"], b["batch_l2"])


def test_the_probe_sees_a_host_read():
    """The patching works: an int() inside gradlens' hot path would be caught."""
    with forced_device_paths(), HostReads() as reads:
        reads.active = True
        x = torch.ones(3)
        assert device_paths(x)
        from gradlens.instruments.binning import tally

        tally(torch.zeros(4, dtype=torch.int64), torch.tensor([1, 2]))  # device path: clean
        assert not reads.calls
        torch.Tensor.item(x.sum())  # from the test itself: not gradlens' code
        assert not reads.calls
        from gradlens.instruments.outer_hist import outer_hist1d

        outer_hist1d(torch.randn(4, 40), torch.randn(4, 30), -1.0, 1.0, 10)  # a CPU shortcut
    assert any("outer_hist.py" in k for k in reads.calls), reads.calls
