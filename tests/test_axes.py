"""The sample-axis rules of gradlens/axes.py, each against the axis worked out by hand from the
operation's definition (B = 4 samples; an axis is (dim, factor))."""

from __future__ import annotations

import pytest
import torch

from gradlens.capture.axes import carry, reshaped

B = 4


def _run(func, x, ax, *args, **kwargs):
    out = func(x, *args, **kwargs)
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return carry(func, (x, *args), kwargs, x, ax, outs, B)


@pytest.mark.parametrize("old, new, ax, want", [
    ((4, 14, 14, 8), (4, 2, 7, 2, 7, 8), (0, 1), (0, 1)),  # split spatial dims
    ((4, 2, 2, 7, 7, 8), (16, 49, 8), (0, 1), (0, 4)),  # window partition: samples lead the windows
    ((16, 7, 7, 8), (4, 2, 2, 7, 7, 8), (0, 4), (0, 1)),  # window reverse
    ((5, 4, 8), (20, 8), (1, 1), None),  # [T, B] flattened: the samples do not lead
    ((4, 5, 8), (20, 8), (0, 1), (0, 5)),
    ((4, 6), (24,), (0, 1), (0, 6)),
    ((1, 4), (4,), (1, 1), (0, 1)),  # squeeze
    ((4,), (1, 4, 1), (0, 1), (1, 1)),  # unsqueeze
    ((3, 4, 8), (3, 2, 2, 8), (1, 1), None),  # the samples split over two dims
])
def test_reshape_groups(old, new, ax, want):
    assert reshaped(old, new, ax, B) == want


def test_moves_and_views():
    x = torch.randn(5, 4, 3)  # [T, B, d]
    ax = (1, 1)
    assert _run(torch.Tensor.transpose, x, ax, 0, 1) == [(0, 1)]
    assert _run(torch.Tensor.permute, x, ax, 2, 0, 1) == [(2, 1)]
    assert _run(torch.movedim, x, ax, 1, 0) == [(0, 1)]
    assert _run(torch.Tensor.view, x, ax, 5, 12) == [(1, 3)]  # [T, B * d]: rows n * 3 + j
    assert _run(torch.Tensor.view, x, ax, 5, 2, 2, 3) == [None]  # the samples split over two dims
    assert _run(torch.Tensor.permute, x, ax, 2, 1, 0) == [(1, 1)]
    assert _run(torch.Tensor.mT.__get__, x, ax) == [(2, 1)]
    assert _run(torch.Tensor.mT.__get__, x, (0, 1)) == [(0, 1)]
    y = torch.randn(4, 4)  # B == d: a transpose is followed, not read from sizes
    assert _run(torch.Tensor.T.__get__, y, (0, 1)) == [(1, 1)]
    assert _run(torch.Tensor.t, y, (0, 1)) == [(1, 1)]
    assert carry(torch.einsum, ("tbd->btd", x), {}, x, ax, [torch.einsum("tbd->btd", x)], B) == [(0, 1)]
    assert carry(torch.einsum, ("tbd->td", x), {}, x, ax, [torch.einsum("tbd->td", x)], B) == [None]


def test_indexing_splits_and_reductions():
    x = torch.randn(4, 5, 6)
    ax = (0, 1)
    assert _run(torch.Tensor.__getitem__, x, ax, (slice(None), 0)) == [(0, 1)]
    assert _run(torch.Tensor.__getitem__, x, ax, (None, Ellipsis, 2)) == [(1, 1)]
    assert _run(torch.Tensor.__getitem__, x, ax, 0) == [None]  # one sample picked
    assert _run(torch.Tensor.__getitem__, x, ax, slice(0, 2)) == [None]  # some samples
    assert _run(torch.Tensor.chunk, x, ax, 2, 2) == [(0, 1)] * 2
    assert _run(torch.Tensor.unbind, x, ax, 1) == [(0, 1)] * 5
    assert _run(torch.Tensor.sum, x, ax, -1) == [(0, 1)]
    assert _run(torch.Tensor.sum, x, ax, 0) == [None]  # summed over the samples
    assert _run(torch.Tensor.mean, x, (1, 1), 0) == [(0, 1)]
    assert _run(torch.Tensor.mean, x, (1, 1), 0, keepdim=True) == [(1, 1)]
    z = torch.randn(4, 4)  # B == T: a reduction over dim 0 is not mistaken for keeping it
    assert _run(torch.Tensor.sum, z, (0, 1), 0) == [None]
    assert carry(torch.cat, ([x, x], 1), {}, x, ax, [torch.cat([x, x], 1)], B) == [(0, 1)]
    assert carry(torch.cat, ([x, x], 0), {}, x, ax, [torch.cat([x, x], 0)], B) == [None]
    assert carry(torch.stack, ([x, x], 0), {}, x, ax, [torch.stack([x, x], 0)], B) == [(1, 1)]


def test_other_operations_keep_an_unambiguous_axis_only():
    x = torch.randn(4, 5, 6)
    assert _run(torch.softmax, x, (0, 1), -1) == [(0, 1)]
    w = torch.randn(6, 7)
    assert carry(torch.matmul, (x, w), {}, x, (0, 1), [x @ w], B) == [(0, 1)]
    sq = torch.randn(4, 4)  # B == T: operations that move dims have their rule
    assert _run(torch.rot90, sq, (0, 1)) == [(1, 1)]
    assert _run(torch.rot90, sq, (0, 1), 2) == [(0, 1)]
    assert _run(torch.flip, sq, (0, 1), [1]) == [(0, 1)]


def test_the_modes_memo_of_rule_answers_matches_the_rules_and_keeps_no_tensor():
    """The mode keeps the answer of a rule per (function, axis, batch, shapes, plain arguments)
    (gradlens.capture.mode._carried): the same answers as the rules, a distinct entry wherever any of those
    differ, and only plain values in its keys and answers."""
    from gradlens.capture import mode

    mode._AXES.clear()
    x = torch.randn(4, 6, 8)
    calls = [
        (torch.Tensor.view, (x, 4, 48), (0, 1), 4),
        (torch.Tensor.view, (x, 24, 8), (0, 1), 4),  # the samples lead a merged dim
        (torch.Tensor.view, (x, 24, 8), (1, 1), 6),  # the same call, another axis
        (torch.Tensor.transpose, (x, 0, 2), (0, 1), 4),
        (torch.Tensor.transpose, (x, 0, 2), (0, 1), 2),  # another batch size
        (torch.Tensor.reshape, (x, (2, 2, 48)), (0, 1), 4),
        (torch.Tensor.__getitem__, (x, (slice(None), 0)), (0, 1), 4),  # a slice: hashable from 3.12
    ]
    for _ in range(2):  # the second pass reads the memo
        for func, args, ax, batch in calls:
            out = func(*args)
            assert mode._carried(func, args, x, ax, out, batch) == carry(func, args, {}, x, ax, [out], batch)[0]
    kept = [v for key, got in mode._AXES.items() for v in (*key, got)]
    assert len(mode._AXES) >= 6
    assert not any(isinstance(v, torch.Tensor) for v in kept)
    assert not any(isinstance(a, torch.Tensor) for key in mode._AXES for a in key[5])
