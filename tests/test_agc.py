"""Adaptive gradient clipping: the paper's formula, unit-wise norms, exclusion by name."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.functional import mse_loss

from gradlens import GradientAccumulateOptimizer, adaptive_clip_grad, compute_norm, unitwise_norm
from gradlens.training.agc import adaptive_clip_grad_

from oracle import make_data, make_mlp, rel_err


def _dense(values):
    return torch.tensor(values, dtype=torch.float64)


def test_hand_computed_linear_rows():
    # rows: clipped (||g||=10 > 0.1*5), eps floor (||w||=0), untouched (||g||=0.01 < 0.1*1)
    w = _dense([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
    g = _dense([[6.0, 8.0], [1.0, 0.0], [0.01, 0.0]])
    (out,) = adaptive_clip_grad([w], [g], clip_factor=0.1, eps=1e-3)
    expected = _dense([[0.3, 0.4], [1e-4, 0.0], [0.01, 0.0]])
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)


def test_hand_computed_bias_and_scalar_are_one_unit():
    b = _dense([0.0, 3.0, 4.0])  # ||b|| = 5
    gb = _dense([2.0, 0.0, 0.0])  # ||g|| = 2 > 0.2 * 5 = 1 -> scaled by 1/2
    s = _dense(2.0)
    gs = _dense(-1.0)  # |g| = 1 > 0.2 * 2 = 0.4 -> -0.4
    out_b, out_s = adaptive_clip_grad([b, s], [gb, gs], clip_factor=0.2, eps=1e-3)
    torch.testing.assert_close(out_b, _dense([1.0, 0.0, 0.0]), rtol=1e-15, atol=0)
    torch.testing.assert_close(out_s, _dense(-0.4), rtol=1e-15, atol=0)


def test_unitwise_norm_layouts():
    conv_w = torch.randn(4, 3, 2, 2, dtype=torch.float64)
    n = unitwise_norm(conv_w)
    assert n.shape == (4, 1, 1, 1)
    for i in range(4):
        torch.testing.assert_close(n[i, 0, 0, 0], conv_w[i].norm())
    assert unitwise_norm(torch.randn(5)).shape == (1,)
    assert unitwise_norm(torch.tensor(3.0)).shape == ()
    # ConvTranspose [in, out, k, k]: output unit on dim 1
    tw = torch.randn(3, 4, 2, 2, dtype=torch.float64)
    nt = unitwise_norm(tw, dim=(0, 2, 3))
    assert nt.shape == (1, 4, 1, 1)
    torch.testing.assert_close(nt[0, 2, 0, 0], tw[:, 2].norm())
    torch.testing.assert_close(compute_norm(tw, dim=(0, 2, 3), keepdim=False), nt.flatten())
    assert compute_norm(torch.ones(2, 3, dtype=torch.bfloat16)).dtype == torch.float32


def test_conv_transpose_units_found_from_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 2), nn.Conv2d(4, 2, 1)).double()
    grads = [torch.randn_like(p) * 10 for p in model.parameters()]
    out = adaptive_clip_grad(model, grads, clip_factor=0.05)
    w = model[0].weight
    coef = (0.05 * unitwise_norm(w, (0, 2, 3)).clamp(min=1e-3) / unitwise_norm(grads[0], (0, 2, 3))).clamp(max=1)
    torch.testing.assert_close(out[0], grads[0] * coef)
    # the plain-tensor form uses dim 0, which is wrong for ConvTranspose: the results differ
    out_plain = adaptive_clip_grad(list(model.parameters()), grads, clip_factor=0.05)
    assert not torch.allclose(out_plain[0], out[0])
    out_override = adaptive_clip_grad(
        list(model.named_parameters()), grads, clip_factor=0.05, dims={"0.weight": (0, 2, 3)}
    )
    torch.testing.assert_close(out_override[0], out[0])


def test_exclusion_by_name_and_in_place_form():
    model = make_mlp(0)
    x, y = make_data(6)
    mse_loss(model(x), y).mul(100).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    out = adaptive_clip_grad(model.named_parameters(), clip_factor=0.01, exclude=("2.weight",))
    names = [n for n, _ in model.named_parameters()]
    for name, o, g in zip(names, out, grads):
        if name == "2.weight":
            assert torch.equal(o, g)
        else:
            assert not torch.equal(o, g)
    adaptive_clip_grad_(model, clip_factor=0.01, exclude=("2.weight",))
    for p, o in zip(model.parameters(), out):
        torch.testing.assert_close(p.grad, o, rtol=1e-15, atol=0)


def test_clip_window_once_differs_from_clipping_each_micro_step():
    """Clipping is nonlinear: the window must be clipped once, after accumulation."""
    model = make_mlp(0)
    x, y = make_data(8)
    micro_grads = []
    for sl in (slice(0, 4), slice(4, 8)):
        model.zero_grad()
        mse_loss(model(x[sl]), y[sl]).backward()
        micro_grads.append([p.grad.clone() for p in model.parameters()])
    params = list(model.parameters())
    window = [(a + b) / 2 for a, b in zip(*micro_grads)]
    once = adaptive_clip_grad(params, window, clip_factor=0.01)
    each = [
        (a + b) / 2
        for a, b in zip(*(adaptive_clip_grad(params, g, clip_factor=0.01) for g in micro_grads))
    ]
    assert max(rel_err(o, e) for o, e in zip(once, each)) > 1e-3

    # the accumulating optimizer with clip=adaptive_clip_grad_ applies exactly "once"
    seen = []
    opt = GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        accum_steps=2,
        clip=lambda ps: (adaptive_clip_grad_(ps, clip_factor=0.01), seen.append([p.grad.clone() for p in ps])),
    )
    for sl in (slice(0, 4), slice(4, 8)):
        opt.zero_grad()
        mse_loss(model(x[sl]), y[sl]).backward()
        opt.step(num_samples=4)
    assert len(seen) == 1
    for got, want in zip(seen[0], once):
        assert rel_err(got, want) < 1e-14


@settings(max_examples=30, deadline=None)
@given(
    shape=st.sampled_from([(3,), (4, 5), (2, 3, 2, 2), ()]),
    clip_factor=st.floats(1e-3, 1.0),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_property_bounded_and_direction_preserved(shape, clip_factor, scale, seed):
    g_ = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g_, dtype=torch.float64)
    g = torch.randn(shape, generator=g_, dtype=torch.float64) * scale
    (out,) = adaptive_clip_grad([w], [g], clip_factor=clip_factor, eps=1e-3)
    bound = clip_factor * unitwise_norm(w).clamp(min=1e-3)
    g_norm, o_norm = unitwise_norm(g), unitwise_norm(out)
    # each unit's norm becomes min(||g_i||, clip_factor * max(||w_i||, eps))
    torch.testing.assert_close(o_norm, torch.minimum(g_norm, bound), rtol=1e-12, atol=0)
    # the unit coefficient is min(1, bound / ||g||), and out is a non-negative multiple of g
    coef = torch.clamp(bound / g_norm, max=1.0)
    torch.testing.assert_close(out, g * coef, rtol=1e-13, atol=0)


def test_bad_input():
    model = make_mlp(0)
    with pytest.raises(ValueError, match=r"clip_factor must be a positive number, got 0"):
        adaptive_clip_grad(model, clip_factor=0)
    with pytest.raises(ValueError, match=r"eps must be a positive number, got -1"):
        adaptive_clip_grad_(model, eps=-1)
    with pytest.raises(ValueError, match=r"\['fc.weight'\] that are not among the parameters"):
        adaptive_clip_grad(model, exclude=("fc.weight",))
    with pytest.raises(TypeError, match=r"select parameters by name, but parameters has no names"):
        adaptive_clip_grad(model.parameters(), exclude=("0.weight",))
    with pytest.raises(ValueError, match=r"gradients has 1 entries but there are 4 parameters"):
        adaptive_clip_grad(model, [torch.zeros(1)])
    with pytest.raises(TypeError, match=r"parameters\[0\] must be a tensor or a \(name, tensor\) pair"):
        adaptive_clip_grad([3.0])


# ---------------------------------------------------------------- misuse (issue 20)
def test_parameters_none_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"parameters must be the model.*got None.*adaptive_clip_grad_\(model"):
        adaptive_clip_grad_(None, clip_factor=0.01)
    with pytest.raises(TypeError, match=r"parameters must be the model.*got None"):
        adaptive_clip_grad(None)


def test_dims_not_a_mapping_and_dims_out_of_range_are_clear():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model(torch.randn(2, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(TypeError, match=r"dims must map parameter names.*got \(5,\).*dims=\{'deconv.weight'"):
        adaptive_clip_grad_(model, dims=(5,))
    with pytest.raises(ValueError, match=r"dims\['0.weight'\]=\(5,\) is out of range for a tensor of 2 dim.*\[-2, 1\]"):
        adaptive_clip_grad_(model, dims={"0.weight": (5,)})
    with pytest.raises(ValueError, match=r"dims\['1.bias'\]=\(0, 1\) is out of range for a tensor of 1 dim"):
        adaptive_clip_grad(model, dims={"1.bias": (0, 1)})
    # nothing was clipped by the refused calls
    for p, g in zip(model.parameters(), before):
        assert torch.equal(p.grad, g)
    # the fix as written works: a valid override is accepted and clips
    adaptive_clip_grad_(model, clip_factor=1e-6, dims={"0.weight": (1,)})
    w, g0 = model[0].weight, before[0]
    expected = g0 * (1e-6 * w.norm(dim=1, keepdim=True).clamp(min=1e-3) / g0.norm(dim=1, keepdim=True)).clamp(max=1)
    torch.testing.assert_close(model[0].weight.grad, expected, rtol=1e-6, atol=0)


def test_unitwise_norm_dim_out_of_range():
    with pytest.raises(ValueError, match=r"unitwise_norm\(dim=...\)=3 is out of range for a tensor of 2 dim"):
        unitwise_norm(torch.ones(2, 3), dim=3)
    torch.testing.assert_close(unitwise_norm(torch.ones(2, 3), dim=-1), torch.full((2, 1), 3.0).sqrt())
