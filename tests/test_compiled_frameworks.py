"""The compiled route (issue 35) on the model families of the frameworks suite (marker
``frameworks``): Hugging Face GPT-2 (its ``Conv1D`` layers) and BERT, a timm ViT and a CNN under
``torch.compile`` (``aot_eager``, float64), K = 2, 3, 1 micro-batches, three windows (0 and 2
tracked). Where a model can take the compiled route it does (``record.meta["route"]``; the
profiler sees compiled regions in the tracked micro-steps after the first) and its records equal
an eager copy's; where it cannot (a tied embedding, a broadcast position table, a raw parameter,
a convolution) the reason is the right one and the records equal the eager copy's too.

Run: ``/work/main/.venv-fw/bin/python -m pytest -m frameworks tests/test_compiled_frameworks.py``.
"""

from __future__ import annotations

import copy
import warnings
from typing import Callable

import pytest
import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

pytestmark = pytest.mark.frameworks

SIZES = (2, 3, 1)
WINDOWS = 3  # every=2: windows 0 and 2 tracked, 1 untracked


def _gpt2(cls_name: str) -> nn.Module:
    import transformers

    cfg = transformers.GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, num_labels=4, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )
    cfg._attn_implementation = "eager"
    return getattr(transformers, cls_name)(cfg)


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
        max_position_embeddings=16, type_vocab_size=2, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, num_labels=4,
    )
    cfg._attn_implementation = "eager"
    return BertForSequenceClassification(cfg)


def _vit(**kw) -> nn.Module:
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=32,
        num_heads=2, num_classes=4, drop_rate=0.0, drop_path_rate=0.0, **kw,
    )


def _convnext() -> nn.Module:
    import timm

    return timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), num_classes=4,
        ls_init_value=0.5, conv_mlp=False, drop_path_rate=0.0,
    )


def _cnn() -> nn.Module:
    """A plain CNN: Conv2d (padding; stride, no bias), ReLU, max pooling, a Linear head."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, stride=2, bias=False), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4),
    )


def _tokens(g, b: int, t: int = 8) -> dict:
    return {"input_ids": torch.randint(1, 50, (b, t), generator=g)}


def _bert_inputs(g, b: int, t: int = 9) -> dict:
    lengths = torch.randint(4, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    types = (torch.arange(t)[None, :] >= 4).long().expand(b, t).contiguous()
    return {"input_ids": torch.randint(1, 50, (b, t), generator=g), "attention_mask": mask, "token_type_ids": types}


def _images(hw: int) -> Callable:
    return lambda g, b: {"x": torch.randn(b, 3, hw, hw, generator=g, dtype=torch.float64)}


def _hf(model, inputs):
    return model(**inputs).logits


def _plain(model, inputs):
    return model(inputs["x"])


#: name -> (model, inputs of b samples, forward giving the logits [b, 4] (or [b, T, V]))
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable, Callable]] = {
    "gpt2_cls": (lambda: _gpt2("GPT2ForSequenceClassification"), _tokens, _hf),
    "gpt2_lm_tied": (lambda: _gpt2("GPT2LMHeadModel"), _tokens, _hf),
    "bert": (_bert, _bert_inputs, _hf),
    "vit": (_vit, _images(32), _plain),  # timm's LayerNorm (its own F.layer_norm call)
    "vit_torch_norm": (lambda: _vit(norm_layer=nn.LayerNorm), _images(32), _plain),
    "convnext": (_convnext, _images(32), _plain),
    "cnn": (_cnn, _images(16), _plain),
}


def _data(name: str) -> list:
    make_inputs = MODELS[name][1]
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(WINDOWS):
        window = []
        for b in SIZES:
            inputs = make_inputs(g, b)
            classes = 50 if name == "gpt2_lm_tied" else 4
            y = torch.randint(0, classes, (b, 8) if name == "gpt2_lm_tied" else (b,), generator=g)
            window.append((inputs, y))
        out.append(window)
    return out


def _base(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().double()


def _run(name: str, base: nn.Module, data, compile_it: bool, exclude=(), regions: dict | None = None):
    """The windows of ``data`` on a copy of ``base`` (compiled with aot_eager or not), every=2,
    an extended CrossEntropyLoss outside the model, SGD. Returns the records, the RuntimeWarnings
    said and the copy. ``regions``: (window, micro-step) -> the "Torch-Compiled Region" events
    the profiler saw in that micro-step's forward and backward."""
    call = MODELS[name][2]
    model = gradlens.extend(copy.deepcopy(base))
    run = torch.compile(model, backend="aot_eager") if compile_it else model
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lens = Lens(run, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt, every=2, exclude=list(exclude))
        for w, window in enumerate(data):
            for k, (inputs, y) in enumerate(window):
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    out = call(run, inputs)
                    loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)) / len(window)
                    with lens.capture():
                        loss.backward()
                if regions is not None:
                    regions[(w, k)] = sum(1 for e in prof.events() if e.name.startswith("Torch-Compiled Region"))
            opt.step()
            opt.zero_grad()
    lens.close()
    said = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
    return list(lens.records), said, model


def _assert_equal(got, want, rtol: float = 1e-9) -> None:
    """Equal records; the sums of squares to ``rtol``, plus ``1e-12`` of the record's largest
    entry (an attention key's bias gets round-off gradients only: softmax is shift-invariant)."""
    assert [r.step for r in got] == [r.step for r in want] == [0, 2]
    for c, e in zip(got, want):
        assert c.num_samples == e.num_samples == sum(SIZES)
        torch.testing.assert_close(c["batch_l2"], e["batch_l2"], rtol=rtol, atol=0)
        assert c["grad_norm"] == pytest.approx(e["grad_norm"], rel=rtol)
        assert c["sum_grad_squared"].keys() == e["sum_grad_squared"].keys()
        scale = max(float(v.abs().max()) for v in e["sum_grad_squared"].values())
        for q, v in e["sum_grad_squared"].items():
            torch.testing.assert_close(c["sum_grad_squared"][q], v, rtol=rtol, atol=1e-12 * scale)


def _breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


#: models whose tracked layers all have a probed form once the parameters outside them are left
#: out: name -> (the exclusions, the probed layer classes the reason names)
COMPILED = {
    # the position table's ids are [1, T], broadcast over the samples (see FALLBACK)
    "gpt2_cls": (["transformer.wpe"], "Conv1D, Embedding, LayerNorm, Linear"),
    "bert": (["bert.embeddings.position_embeddings"], "Embedding, LayerNorm, Linear"),
    # the raw class token and position parameters left out (operations on them)
    "vit_torch_norm": (["cls_token", "pos_embed"], "Conv2d, LayerNorm, Linear"),
    "cnn": ([], "Conv2d, Linear"),
}


@pytest.mark.parametrize("name", sorted(COMPILED))
def test_compiled_route_runs_compiled_and_equals_the_eager_records(name):
    """GPT-2 (Conv1D attention and MLP, its sequence-classification head), BERT (padding masks,
    token types, the pooler), a timm ViT built with torch's LayerNorm (its Conv2d patch embedding)
    and a plain CNN (Conv2d with padding, with stride and no bias): the first tracked micro-step
    runs eagerly, the later ones run the compiled graph (compiled regions in the profile, the route
    in the record's meta), no graph break, and both tracked windows equal the eager copy's records,
    float64; the trained parameters equal too."""
    exclude, layers = COMPILED[name]
    base, data = _base(name), _data(name)
    eager, said_eager, eager_model = _run(name, base, data, False, exclude)
    torch._dynamo.reset()
    before = _breaks()
    regions: dict = {}
    compiled, said, model = _run(name, base, data, True, exclude, regions)
    assert _breaks() == before
    torch._dynamo.reset()
    assert said_eager == [] and len(said) == 1 and "then tracked micro-steps run the compiled graph" in said[0], said
    assert [r.meta["route"] for r in compiled] == ["eager, then compiled", "compiled"]
    assert compiled[0].meta["route_reason"] == (
        f"every tracked parameter is in a probed layer ({layers}) used once per forward, samples on dim 0")
    assert regions[(0, 0)] == 0, regions  # the judged micro-step: eager
    assert all(regions[(w, k)] > 0 for w in range(WINDOWS) for k in range(len(SIZES)) if (w, k) != (0, 0)), regions
    _assert_equal(compiled, eager)
    for pe, pc in zip(eager_model.parameters(), model.parameters()):
        torch.testing.assert_close(pc, pe, rtol=1e-9, atol=1e-12)


#: models that keep the eager route: name -> (the exclusions, the reason)
FALLBACK = {
    "gpt2_cls": ([], "the input of 'transformer.wpe' does not hold the samples on dim 0, one row each"),
    "gpt2_lm_tied": (["transformer.wpe"], "parameter 'transformer.wte.weight' is used 2 times in one forward "
                     "(shared: its probe would hold cross terms)"),
    "vit": (["patch_embed", "cls_token", "pos_embed"],
            "parameter 'blocks.0.norm1.weight' is not used by a layer of its own module (an operation on it)"),
    # (its stem's Conv2d qualifies; timm's LayerNorm2d, the depthwise convolutions do not)
    "convnext": ([], "parameter 'stem.1.weight' is not used by a layer of its own module (an operation on it)"),
}


@pytest.mark.parametrize("name", sorted(FALLBACK))
def test_models_that_cannot_take_the_compiled_route_say_why_and_equal_the_eager_records(name):
    """GPT-2 with its position table tracked (ids [1, T] broadcast over the samples), GPT-2's
    LM head tied to the token table (one weight used twice), a timm ViT with timm's LayerNorm
    (a subclass calling F.layer_norm itself: an operation on the weight, not a layer of the
    route), a timm ConvNeXt (timm's LayerNorm2d after its Conv2d stem): the tracked windows
    stay eager (one warning, the reason in the record's meta, no compiled region in a tracked
    micro-step) and equal the eager copy's records."""
    exclude, reason = FALLBACK[name]
    base, data = _base(name), _data(name)
    eager, _, _ = _run(name, base, data, False, exclude)
    torch._dynamo.reset()
    regions: dict = {}
    compiled, said, _ = _run(name, base, data, True, exclude, regions)
    torch._dynamo.reset()
    assert len(said) == 2 and f"compiled route is not taken: {reason};" in said[1], said
    assert [r.meta["route"] for r in compiled] == ["eager", "eager"]
    assert all(r.meta["route_reason"] == reason for r in compiled)
    assert all(regions[(w, k)] == 0 for w in (0, 2) for k in range(len(SIZES))), regions
    assert all(regions[(1, k)] > 0 for k in range(len(SIZES))), regions  # the untracked window: compiled
    _assert_equal(compiled, eager)
