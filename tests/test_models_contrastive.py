"""Issue 42, contrastive image-text models of transformers from tiny configs (no downloads):
``CLIPModel`` and ``SiglipModel`` with ``return_loss=True``, float64, K = 3 micro-batches of
2, 3, 1. Their losses couple the samples: the logit matrix ``text @ image.T`` pairs every text
with every image, so no sample has a loss, or a gradient, of its own. gradlens refuses them by
the mixing rule (docs/conformance.md): every tower parameter reaches the pairwise product, and
the learned temperature (``logit_scale``) and SigLIP's ``logit_bias``, applied to the pairwise
matrix after it, are undefined too (not measured as if a row of the matrix were a sample's).
``undefined="exclude"`` leaves nothing, so it says so; the fix it names, instruments of the
window gradient alone (``GradNorm``), is exact against a float64 oracle of the window's mean
gradient."""

from __future__ import annotations

import copy

import pytest
import torch

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

pytestmark = pytest.mark.frameworks

SIZES = [2, 3, 1]
N, L, V = sum(SIZES), 5, 40


def _make(name: str):
    import transformers as T

    text = dict(vocab_size=V, hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)
    vision = dict(hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                  patch_size=4, num_channels=3)
    torch.manual_seed(0)
    if name == "clip":
        cfg = T.CLIPConfig(text_config=dict(text, projection_dim=8), vision_config=dict(vision, projection_dim=8),
                           projection_dim=8)
        return T.CLIPModel(cfg).double()
    return T.SiglipModel(T.SiglipConfig(text_config=text, vision_config=vision)).double()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, V, (N, L), generator=g), torch.randn(N, 3, 8, 8, generator=g, dtype=torch.float64)


def _run(model, lens):
    ids, px = _batch()
    s = 0
    for b in SIZES:
        out = model(input_ids=ids[s:s + b], pixel_values=px[s:s + b], return_loss=True)
        s += b
        with lens.capture(reduction="mean", loss=out.loss):
            out.loss.backward()
    return lens.flush()


#: what each model's refusal names: the pairwise product, and its learned scalars
SCALARS = {"clip": ["logit_scale"], "siglip": ["logit_scale", "logit_bias"]}


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_contrastive_loss_is_refused_naming_the_pairwise_product_and_every_parameter(name):
    model = gradlens.extend(_make(name))
    lens = Lens(model, [BatchL2(), SumGradSquared(), GradNorm()])
    with pytest.raises(RuntimeError, match=r"undefined: their output reaches .*matmul of tensors \[2, \d+\], "
                                           r"\[\d+, 2\].*mixes the samples of a micro-batch") as err:
        _run(model, lens)
    msg = str(err.value)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    assert all(repr(k) in msg for k in names)  # every parameter, the towers' and the scalars'
    assert "pairwise product of the samples" in msg and all(repr(k) in msg for k in SCALARS[name])
    assert "GradNorm" in msg  # nothing would be left to exclude: the fix that works is named
    lens.close()


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_contrastive_exclude_leaves_nothing_and_says_what_works(name):
    model = gradlens.extend(_make(name))
    lens = Lens(model, [BatchL2()], undefined="exclude")
    with pytest.raises(RuntimeError, match=r"nothing is left to track: use only instruments of the window "
                                           r"gradient \(e\.g\. GradNorm\)"):
        _run(model, lens)
    lens.close()


@pytest.mark.parametrize("name", ["clip", "siglip"])
def test_contrastive_window_gradient_instruments_are_exact(name):
    """The fix as written: GradNorm alone (no per-sample gradients) equals the norm of the
    window's mean gradient, sum_k B_k grad(loss_k) / N, from a float64 copy taken before
    ``extend``."""
    base = _make(name)
    oracle = copy.deepcopy(base)
    model = gradlens.extend(base)
    lens = Lens(model, [GradNorm()])
    rec = _run(model, lens)
    ids, px = _batch()
    params = [p for p in oracle.parameters() if p.requires_grad]
    total, s = None, 0
    for b in SIZES:
        loss = oracle(input_ids=ids[s:s + b], pixel_values=px[s:s + b], return_loss=True).loss
        s += b
        g = torch.autograd.grad(loss * b, params, allow_unused=True)
        flat = torch.cat([(torch.zeros_like(p) if v is None else v).reshape(-1) for p, v in zip(params, g)])
        total = flat if total is None else total + flat
    assert rec["grad_norm"] == pytest.approx(float((total / N).norm()), rel=1e-10)
    lens.close()
