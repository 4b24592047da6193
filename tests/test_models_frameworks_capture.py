"""Issue 21 with the real libraries (marker ``frameworks``): timm Swin (window attention, the
samples the leading factor of the windows' axis) with no exclusions against the float64
per-sample oracle of tests/oracle_models.py, and ``torch.compile`` of Hugging Face GPT-2 and
BERT whose tracked windows give the eager records. Tiny configs, CPU, float64.

Run: ``/work/main/.venv-fw/bin/python -m pytest -m frameworks tests/test_models_frameworks_capture.py``.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from windows import run_windows

import oracle_models as OM

pytestmark = pytest.mark.frameworks

SPLIT = [5, 1, 6]  # K = 3 unequal micro-steps, N = 12 (oracle_models.N)


def timm_swin():
    import timm

    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=16, patch_size=2, window_size=2,
        embed_dim=8, depths=(2, 2), num_heads=(2, 2), num_classes=4, drop_path_rate=0.0,
    )


SWIN = OM.ModelCase("timm_swin", timm_swin, OM._image_data(3, 16), OM._ce_call, oracle="loop", frameworks=True)
LEVIT = OM.ModelCase("timm_levit", OM.timm_levit, OM._image_data(3, 64), OM._ce_call, oracle="loop", frameworks=True,
                     train_mode=False)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_timm_swin_with_no_exclusions_matches_the_oracle(reduction):
    """Both W-MSA and shifted SW-MSA blocks (with their masks), the patch merging between
    stages: every parameter tracked, batch_l2 / sum_grad_squared / grad_norm == oracle."""
    model = OM.build_model(SWIN)
    batch = OM.make_data(SWIN, 0)
    gs = OM.per_sample_grads(SWIN, model, batch, SPLIT)
    G = OM.flat(gs)
    (rec,) = run_windows(model, [OM.split_batch(SWIN, batch, SPLIT)], [BatchL2(), SumGradSquared(), GradNorm()],
                         reduction=reduction, forward=lambda m, mb: m(mb["x"]), target=lambda mb: mb["y"],
                         close=False).flushed
    assert rec.meta["coverage"] == 1.0 and rec.num_samples == OM.N
    scale = float(G.square().sum(1).max())
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12 * scale)
    window = G.mean(0) if reduction == "mean" else G.sum(0)
    assert rec["grad_norm"] == pytest.approx(float(window.norm()), rel=1e-10)
    for k, g in gs.items():
        ref = g.square().sum(0)
        torch.testing.assert_close(rec["sum_grad_squared"][k], ref, rtol=1e-9, atol=1e-12 * float(ref.abs().max() + 1e-300))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_timm_levit_eval_with_no_exclusions_matches_the_oracle(reduction):
    """Issue 43: LeViT's LinearNorm (an eval-mode BatchNorm1d on the ``[B * N, C]`` flattening
    of ``[B, N, C]``, the samples the leading factor of the rows) measured, not refused: every
    parameter tracked, batch_l2 / sum_grad_squared / grad_norm == oracle (micro-batches 5, 1, 6;
    running statistics away from 0 and 1)."""
    model = OM.build_model(LEVIT)
    assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    batch = OM.make_data(LEVIT, 0)
    gs = OM.per_sample_grads(LEVIT, model, batch, SPLIT)
    G = OM.flat(gs)
    (rec,) = run_windows(model, [OM.split_batch(LEVIT, batch, SPLIT)], [BatchL2(), SumGradSquared(), GradNorm()],
                         reduction=reduction, forward=lambda m, mb: m(mb["x"]), target=lambda mb: mb["y"],
                         close=False).flushed
    assert rec.meta["coverage"] == 1.0 and rec.num_samples == OM.N
    scale = float(G.square().sum(1).max())
    torch.testing.assert_close(rec["batch_l2"], G.square().sum(1), rtol=1e-10, atol=1e-12 * scale)
    window = G.mean(0) if reduction == "mean" else G.sum(0)
    assert rec["grad_norm"] == pytest.approx(float(window.norm()), rel=1e-10)
    for k, g in gs.items():  # (the keys' biases get round-off gradients only: softmax is shift-invariant)
        torch.testing.assert_close(rec["sum_grad_squared"][k], g.square().sum(0), rtol=1e-9, atol=1e-12 * scale)


def _hf_windows(case, model, run, batches):
    """Three windows (0 and 2 tracked, 1 untracked) of K = 3 unequal micro-steps through
    ``run`` (the model, or torch.compile of it); SGD updates. Returns the records."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lm = case.kind == "hf_lm"  # the model's own loss; else an extended CrossEntropyLoss on the logits
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lens = Lens(run, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt, every=2)
        run_windows(run, [OM.split_batch(case, batch, SPLIT) for batch in batches], lens=lens, optimizer=opt,
                    fresh_copy=False,
                    forward=lambda m, mb: run(**mb) if lm else run(**{k: v for k, v in mb.items() if k != "y"}).logits,
                    loss=(lambda out, mb: out.loss) if lm else "ce", target=(lambda mb: mb) if lm else (lambda mb: mb["y"]))
    return list(lens.records)


def _plain_windows(case, model, run, batches):
    """The same three windows without gradlens (the compiled model's own graph breaks)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in batches:
        for mb in OM.split_batch(case, batch, SPLIT):
            if case.kind == "hf_lm":
                loss = run(**mb).loss
            else:
                loss = F.cross_entropy(run(**{k: v for k, v in mb.items() if k != "y"}).logits, mb["y"])
            loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", ["hf_gpt2", "hf_bert"])
def test_torch_compile_of_hugging_face_models_gives_the_eager_records(name):
    """torch.compile (aot_eager: AOT autograd's graphs, where tensors without storage stood in
    the way before) of GPT-2 (its own token-mean loss, tied embeddings) and BERT (external CE,
    padding masks): the tracked windows' records equal the eager model's, and gradlens adds no
    graph break to those of the compiled model alone (transformers' own logging breaks)."""
    from torch._dynamo.utils import counters

    case = OM.CASES[name]
    base = OM.build_model(case)
    batches = [OM.make_data(case, s) for s in range(3)]
    eager_model = gradlens.extend(copy.deepcopy(base))
    eager = _hf_windows(case, eager_model, eager_model, batches)
    # the graph breaks of the model itself (transformers' logging): a compiled copy, no Lens
    torch._dynamo.reset()
    counters.clear()
    plain = copy.deepcopy(base)
    _plain_windows(case, plain, torch.compile(plain, backend="aot_eager"), batches)
    plain_breaks = sum(counters["graph_break"].values())
    torch._dynamo.reset()
    counters.clear()
    model = gradlens.extend(copy.deepcopy(base))
    compiled = _hf_windows(case, model, torch.compile(model, backend="aot_eager"), batches)
    assert sum(counters["graph_break"].values()) == plain_breaks, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1  # the untracked window ran compiled
    torch._dynamo.reset()
    assert [r.step for r in compiled] == [r.step for r in eager] == [0, 2]
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c["batch_l2"], e["batch_l2"], rtol=1e-9, atol=0)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=1e-9)
        for k, v in e["sum_grad_squared"].items():
            torch.testing.assert_close(c["sum_grad_squared"][k], v, rtol=1e-9, atol=1e-300)
    for pe, pc in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-9, atol=1e-12)  # the same training
