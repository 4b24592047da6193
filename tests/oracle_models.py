"""Float64 oracle for the models people train: transformers, RNNs, norms, tied weights, timm / HF.

The oracle never runs gradlens code. Per-sample gradients come from
``vmap(grad(functional_call))`` over samples on a deep copy of the model taken before
``gradlens.extend`` or, where vmap cannot go through a model (RNN kernels, Hugging Face
internals), from a per-sample loop of ordinary autograd; for a model with a training-mode
BatchNorm, from a loop over the samples of each micro-batch forwarded together (the parameters
whose gradient that defines are listed by the case).

Units (DESIGN.md): for an external loss module g_n = grad of sample n's own loss l_n, whatever
the reduction. For a loss computed inside a Hugging Face model (token-mean cross-entropy with
``ignore_index=-100``) in a micro-step of B samples and V valid tokens,
L = sum_n L_n with L_n = (sum of sample n's token losses) / V, and g_n = B * grad L_n;
equivalently g_n = (B v_n / V) * grad(sample n's own token-mean loss), v_n its valid tokens.

Models needing ``transformers`` / ``timm`` import them only when built, so this module imports
in an environment without them (the default test suite).
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad, vmap

N = 12
SPLITS = {"K3-unequal": [5, 1, 6], "K1": [12]}


# ----------------------------------------------------------------------------- torch.nn models
class EncoderClassifier(nn.Module):
    """Embedding -> nn.TransformerEncoder (2 layers, dropout 0) -> mean over T -> Linear.

    ``batch_first=False`` (torch's default): tokens are [T, B] and every inner layer sees the
    sample axis at dim 1. ``norm_first=True`` adds the encoder's final LayerNorm.
    """

    def __init__(self, batch_first: bool, norm_first: bool, vocab=20, d=16, classes=4):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, nhead=2, dim_feedforward=24, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(
            layer, num_layers=2, norm=nn.LayerNorm(d) if norm_first else None, enable_nested_tensor=False
        )
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.encoder(self.emb(tokens))
        return self.head(h.mean(1 if self.batch_first else 0))


class RNNClassifier(nn.Module):
    """Embedding -> nn.LSTM / nn.GRU (2 layers, bidirectional) -> mean over T -> Linear."""

    def __init__(self, cell: str, batch_first: bool, vocab=13, d=6, hidden=5, classes=4):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, d)
        rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[cell]
        self.rnn = rnn(d, hidden, num_layers=2, bidirectional=True, batch_first=batch_first)
        self.head = nn.Linear(2 * hidden, classes)

    def forward(self, tokens):
        out, _ = self.rnn(self.emb(tokens))
        return self.head(out.mean(1 if self.batch_first else 0))


class Attention(nn.Module):
    """Multi-head self-attention: nn.Linear qkv / proj and F.scaled_dot_product_attention."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class ViTBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """A ViT written here: ``cls_token`` and ``pos_embed`` are parameters of the root module,
    the class token is broadcast over the batch with ``expand``."""

    def __init__(self, img=16, patch=8, d=16, depth=2, heads=2, classes=4):
        super().__init__()
        n = (img // patch) ** 2
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        self.cls_token = nn.Parameter(0.5 * torch.randn(1, 1, d))
        self.pos_embed = nn.Parameter(0.5 * torch.randn(1, n + 1, d))
        self.blocks = nn.Sequential(*[ViTBlock(d, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout else None
        )

    def forward(self, x):
        short = x if self.downsample is None else self.downsample(x)
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + short)


class SmallResNet(nn.Module):
    """stem conv-BN-ReLU, a downsampling block, an identity block, pool, Linear; BatchNorms in
    training mode. Only ``layer2.bn2`` (the last BatchNorm) and ``fc`` have defined per-sample
    gradients: every other parameter's output reaches a training-mode BatchNorm."""

    TRACKABLE = ("layer2.bn2.weight", "layer2.bn2.bias", "fc.weight", "fc.bias")

    def __init__(self, classes=4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(6)
        self.layer1 = BasicBlock(6, 8, stride=2)
        self.layer2 = BasicBlock(8, 8, stride=1)
        self.fc = nn.Linear(8, classes)
        with torch.no_grad():  # non-trivial affine parameters
            for m in self.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(x.mean((2, 3)))


class TiedLM(nn.Module):
    """Input embedding weight reused as the output projection through F.linear."""

    def __init__(self, vocab=11, d=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.proj = nn.Linear(d, d)
        self.out_bias = nn.Parameter(0.1 * torch.randn(vocab))

    def forward(self, tokens):
        h = torch.tanh(self.proj(self.emb(tokens))).mean(1)
        return F.linear(h, self.emb.weight, self.out_bias)


class HandRMSNorm(nn.Module):
    """An RMSNorm written by hand: its weight is used through a plain multiplication."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LayerScale(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.gamma = nn.Parameter(0.5 + 0.2 * torch.randn(d))

    def forward(self, x):
        return x * self.gamma


class RelPosAttention(nn.Module):
    """Attention with a learned relative-position bias table [2T-1, heads], indexed in forward."""

    def __init__(self, d, heads, t):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d, bias=False)
        self.out = nn.Linear(d, d)
        self.rel_table = nn.Parameter(0.5 * torch.randn(2 * t - 1, heads))
        idx = torch.arange(t)
        self.register_buffer("rel_index", idx[:, None] - idx[None, :] + t - 1, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q = self.q(x).view(b, t, h, d // h).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, h, d // h).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
        scores = scores + self.rel_table[self.rel_index[:t, :t]].permute(2, 0, 1)
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class CustomParamsModel(nn.Module):
    """Custom modules that use their own parameters directly (hand RMSNorm, layer-scale gammas
    on a module and on the root, a relative-position table) and a Linear called twice."""

    def __init__(self, vocab=13, d=8, heads=2, t=6, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.norm = HandRMSNorm(d)
        self.attn = RelPosAttention(d, heads, t)
        self.ls = LayerScale(d)
        self.shared = nn.Linear(d, d)
        self.gamma = nn.Parameter(0.5 + 0.2 * torch.randn(d))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.ls(self.attn(self.norm(h)))
        h = h + self.gamma * torch.tanh(self.shared(torch.tanh(self.shared(h))))
        return self.head(h.mean(1))


class SharedPartsMLP(nn.Module):
    """Linear layers on 2-D inputs (no sequence axis) that share parts across modules: ``b``
    uses ``a``'s weight with a bias of its own, ``c`` uses ``a``'s bias with a weight of its own,
    so no layer's (weight, bias) pair is a group of its own (the mixed path of shared uses)."""

    def __init__(self, d_in=6, d=5, classes=4):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, d)
        self.b.weight = self.a.weight
        self.c.bias = self.a.bias
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.a(h))
        h = torch.tanh(self.b(h))
        h = torch.tanh(self.c(h))
        return self.head(h)


class BilinearNet(nn.Module):
    """``nn.Bilinear``, a layer of two inputs: on two branches of the input (no sequence axis),
    the same layer called a second time (a shared use: g_n sums both calls), and a second layer
    over positions (``[B, T, d]`` inputs, one reversed)."""

    def __init__(self, d_in=6, d=5, classes=4):
        super().__init__()
        self.inp1 = nn.Linear(d_in, d)
        self.inp2 = nn.Linear(d_in, 3)
        self.bil = nn.Bilinear(d, 3, d)
        self.seq = nn.Bilinear(2, 2, 3)
        self.head = nn.Linear(d + 3, classes)

    def forward(self, x):
        h1, h2 = torch.tanh(self.inp1(x)), torch.tanh(self.inp2(x))
        h = torch.tanh(self.bil(h1, h2))
        h = torch.tanh(self.bil(h, h2))
        s = x.reshape(x.shape[0], 3, 2)
        z = self.seq(s, s.flip(1)).sum(1)
        return self.head(torch.cat([h, z], 1))


class NormsConvNet(nn.Module):
    """GroupNorm, a depthwise and a grouped convolution, affine InstanceNorm2d, nn.RMSNorm."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.inorm = nn.InstanceNorm2d(8, affine=True)
        self.pw = nn.Conv2d(8, 8, 1, groups=2)
        self.rms = nn.RMSNorm(8)
        self.head = nn.Linear(8, classes)
        with torch.no_grad():
            for m in (self.gn, self.inorm, self.rms):
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        x = F.gelu(self.gn(self.conv(x)))
        x = F.gelu(self.inorm(self.dw(x)))
        return self.head(self.rms(self.pw(x).mean((2, 3))))


class LeviNet(nn.Module):
    """Eval-mode BatchNorms over flattenings that keep the samples as the leading factor of the
    rows: LeViT's ``LinearNorm`` (timm levit.py: ``bn(x.flatten(0, 1)).reshape_as(x)``, a
    BatchNorm1d on ``[B * N, C]``) and a BatchNorm2d on ``[B * 2, C, H / 2, W]`` (each image cut
    into two halves). Running statistics away from 0 and 1, affine maps away from identity."""

    def __init__(self, classes=4, c=6):
        super().__init__()
        self.patch = nn.Conv2d(3, c, 2, stride=2)
        self.halves = nn.BatchNorm2d(c)
        self.lin = nn.Linear(c, c, bias=False)
        self.bn = nn.BatchNorm1d(c)
        self.head = nn.Linear(c, classes)
        with torch.no_grad():
            for m in (self.halves, self.bn):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        h = self.patch(x)  # [B, C, H, W]
        b, c, hh, ww = h.shape
        halves = h.view(b, c, 2, hh // 2, ww).transpose(1, 2).reshape(b * 2, c, hh // 2, ww)
        h = self.halves(halves).view(b, 2, c, hh // 2, ww).transpose(1, 2).reshape(b, c, hh, ww)
        t = F.gelu(h).flatten(2).transpose(1, 2)  # [B, N, C]
        t = self.lin(t)
        t = self.bn(t.flatten(0, 1)).reshape_as(t)
        return self.head(F.gelu(t).mean(1))


class ScalarParamsModel(nn.Module):
    """Small parameters (issue 42): a 0-dim temperature multiplying the logits (CLIP's
    ``logit_scale``), a 0-dim bias added to the features (added to the logits it would get no
    gradient: cross-entropy is shift-invariant), a ``[1]``-shaped scale of the embeddings, and a
    0-dim gate used twice (a shared 0-dim parameter) on a sequence axis."""

    def __init__(self, vocab=13, d=6, classes=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.scale = nn.Parameter(torch.tensor([0.8]))
        self.proj = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.tensor(0.6))
        self.head = nn.Linear(d, classes)
        self.temperature = nn.Parameter(torch.tensor(1.7))
        self.offset = nn.Parameter(torch.tensor(0.3))

    def forward(self, tokens):
        h = self.emb(tokens) * self.scale
        h = h + self.gate * torch.tanh(self.proj(h))
        h = torch.tanh(h * self.gate + self.offset).mean(1)
        return self.temperature * self.head(h)


# ----------------------------------------------------------------------------- framework models
def hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
    )
    cfg._attn_implementation = "eager"
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    return model


def hf_bert():
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=37, max_position_embeddings=16, type_vocab_size=2,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=4,
    )
    cfg._attn_implementation = "eager"
    return BertForSequenceClassification(cfg)


def timm_vit():
    import timm

    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2, embed_dim=32,
        num_heads=2, num_classes=4, drop_rate=0.0, drop_path_rate=0.0,
    )


def timm_convnext():
    import timm

    return timm.create_model(
        "convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 16, 16, 16), num_classes=4,
        ls_init_value=0.5, conv_mlp=False, drop_path_rate=0.0,
    )


class _ContiguousGrad(nn.Module):
    """``module``, its output's gradient made contiguous (same values). Works around a torch CPU
    bug (2.13, 2.14): an eval-mode BatchNorm2d's input gradient is wrong for a batch of 1 when
    the output gradient has channels-last strides with a batch stride of C (LeViT's stem
    output, read back through ``flatten(2).transpose(1, 2)``): ``x [1, 16, 4, 4]``, ``go =
    torch.randn(256).as_strided((1, 16, 4, 4), (16, 1, 64, 16))`` gives ``dx != go * w /
    sqrt(var + eps)``. The per-sample oracle (batches of 1) would be wrong, not gradlens."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x):
        y = self.module(x)
        if y.requires_grad:
            y.register_hook(lambda g: g.contiguous())
        return y


class _LevitEval(nn.Module):
    """A timm LeViT whose attention layers keep ``training=True`` in eval mode (only themselves,
    not their BatchNorms): in eval they cache their bias table for inference, and a second
    backward through the cached tensor fails (with or without gradlens)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        model.stem = _ContiguousGrad(model.stem)
        self.model = model

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.modules():
            if hasattr(m, "attention_bias_cache"):
                m.training = True
                m.attention_bias_cache = {}
        return self

    def forward(self, x):
        return self.model(x)


def timm_levit():
    """levit_128s' layout (16x stem, LinearNorm = BatchNorm1d on ``[B * N, C]``, subsampling
    attention between stages), tiny; for eval mode, running statistics away from 0 and 1."""
    from timm.models.levit import Levit

    model = Levit(img_size=64, num_classes=4, embed_dim=(16, 24), key_dim=8, depth=(1, 1), num_heads=(2, 2),
                  attn_ratio=2.0, mlp_ratio=2.0, down_op="subsample")
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return _LevitEval(model)


# ----------------------------------------------------------------------------- the case table
def _tokens(g, vocab, *shape):
    return torch.randint(0, vocab, shape, generator=g)


def _padded_mask(g, t, lo):
    """[N, t] right-padding mask with lengths in [lo, t]."""
    lengths = torch.randint(lo, t + 1, (N,), generator=g)
    return (torch.arange(t)[None, :] < lengths[:, None]).long()


@dataclass
class ModelCase:
    """One model of the table.

    ``make`` builds the model (float32, seeded by the caller; the table converts to float64).
    ``data(g)`` gives a dict of N samples: model inputs and ``"y"`` (external-loss cases) or
    ``"labels"`` (``kind="hf_lm"``: the model computes its loss). ``batch_dims`` gives an input's
    sample axis where it is not 0. ``call(model, batch)`` returns the logits [B, C] (``"ce"``) or
    the model output with ``.loss`` / ``.logits`` (``"hf_lm"``).
    """

    name: str
    make: Callable[[], nn.Module]
    data: Callable[[torch.Generator], dict[str, Tensor]]
    call: Callable[[nn.Module, dict], object]
    kind: str = "ce"  # "ce": external CrossEntropyLoss on call(); "hf_lm": model's own loss
    batch_dims: dict[str, int] = field(default_factory=dict)
    oracle: str = "vmap"  # "vmap", "loop", or "batch-loop" (training-mode BatchNorm)
    frameworks: bool = False  # needs transformers / timm
    trackable: tuple[str, ...] | None = None  # None: every trainable parameter
    train_mode: bool = True
    split_invariant: bool = True  # K micro-steps == one batch (False: the model mixes samples
    # within a micro-batch, or the loss normalises by the micro-batch's token count)
    rtol: float = 1e-10  # Hugging Face's loss upcasts the logits to float32 (1e-6 there)

    def bdim(self, key: str) -> int:
        return self.batch_dims.get(key, 0)


def _ce_call(model, batch):
    return model(batch["x"])


def _hf_seq_call(model, batch):
    return model(**{k: v for k, v in batch.items() if k != "y"}).logits


def _hf_lm_call(model, batch):
    return model(**batch)


def _token_data(vocab, t, classes=4, seq_first=False):
    def data(g):
        x = _tokens(g, vocab, N, t)
        return {"x": x.T.contiguous() if seq_first else x, "y": _tokens(g, classes, N)}

    return data


def _vector_data(d, classes=4):
    def data(g):
        return {"x": torch.randn(N, d, generator=g, dtype=torch.float64), "y": _tokens(g, classes, N)}

    return data


def _image_data(c, hw, classes=4):
    def data(g):
        return {"x": torch.randn(N, c, hw, hw, generator=g, dtype=torch.float64), "y": _tokens(g, classes, N)}

    return data


def _gpt2_data(padded: bool):
    def data(g):
        ids = _tokens(g, 50, N, 8)
        if not padded:
            return {"input_ids": ids, "labels": ids.clone()}
        mask = _padded_mask(g, 8, 3)
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return data


def _bert_data(g):
    ids = _tokens(g, 50, N, 9)
    mask = _padded_mask(g, 9, 4)
    types = (torch.arange(9)[None, :] >= 4).long().expand(N, 9).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types, "y": _tokens(g, 4, N)}


CASES: dict[str, ModelCase] = {
    c.name: c
    for c in [
        ModelCase("encoder_seqfirst", lambda: EncoderClassifier(False, False), _token_data(20, 5, seq_first=True),
                  _ce_call, batch_dims={"x": 1}),
        ModelCase("encoder_batchfirst", lambda: EncoderClassifier(True, True), _token_data(20, 5), _ce_call),
        ModelCase("lstm_batchfirst", lambda: RNNClassifier("lstm", True), _token_data(13, 5), _ce_call, oracle="loop"),
        ModelCase("lstm_seqfirst", lambda: RNNClassifier("lstm", False), _token_data(13, 5, seq_first=True),
                  _ce_call, batch_dims={"x": 1}, oracle="loop"),
        ModelCase("gru_batchfirst", lambda: RNNClassifier("gru", True), _token_data(13, 5), _ce_call, oracle="loop"),
        ModelCase("gru_seqfirst", lambda: RNNClassifier("gru", False), _token_data(13, 5, seq_first=True),
                  _ce_call, batch_dims={"x": 1}, oracle="loop"),
        ModelCase("vit_local", TinyViT, _image_data(3, 16), _ce_call),
        ModelCase("resnet_bn_train", SmallResNet, _image_data(3, 8), _ce_call, oracle="batch-loop",
                  trackable=SmallResNet.TRACKABLE, split_invariant=False),
        ModelCase("tied_embeddings", TiedLM, _token_data(11, 5, classes=11), _ce_call),
        ModelCase("custom_params", CustomParamsModel, _token_data(13, 6), _ce_call),
        ModelCase("norms_conv", NormsConvNet, _image_data(3, 6), _ce_call),
        ModelCase("shared_parts", SharedPartsMLP, _vector_data(6), _ce_call),
        ModelCase("bilinear", BilinearNet, _vector_data(6), _ce_call),
        ModelCase("levit_bn_eval", LeviNet, _image_data(3, 8), _ce_call, train_mode=False),
        ModelCase("scalar_params", ScalarParamsModel, _token_data(13, 5), _ce_call),
        ModelCase("hf_gpt2", hf_gpt2, _gpt2_data(False), _hf_lm_call, kind="hf_lm", oracle="loop", frameworks=True,
                  rtol=1e-6),
        ModelCase("hf_gpt2_padded", hf_gpt2, _gpt2_data(True), _hf_lm_call, kind="hf_lm", oracle="loop",
                  frameworks=True, split_invariant=False, rtol=1e-6),
        ModelCase("hf_bert", hf_bert, _bert_data, _hf_seq_call, oracle="loop", frameworks=True),
        ModelCase("timm_vit", timm_vit, _image_data(3, 32), _ce_call, frameworks=True),
        ModelCase("timm_convnext", timm_convnext, _image_data(3, 32), _ce_call, frameworks=True),
    ]
}


def build_model(case: ModelCase, seed: int = 0) -> nn.Module:
    """The case's model in float64 with fixed weights (train mode unless the case says so)."""
    torch.manual_seed(seed)
    model = case.make().double()
    model.train(case.train_mode)
    return model


def make_data(case: ModelCase, seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return case.data(g)


def slice_batch(case: ModelCase, batch: dict[str, Tensor], start: int, stop: int) -> dict[str, Tensor]:
    return {k: v.narrow(case.bdim(k), start, stop - start) for k, v in batch.items()}


def split_batch(case: ModelCase, batch: dict[str, Tensor], sizes) -> list[dict[str, Tensor]]:
    out, start = [], 0
    for b in sizes:
        out.append(slice_batch(case, batch, start, start + b))
        start += b
    return out


def trainable_names(model: nn.Module) -> list[str]:
    """Trainable parameter names, each parameter once (the first name of a tied one)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def tracked_names(case: ModelCase, model: nn.Module) -> list[str]:
    names = trainable_names(model)
    return names if case.trackable is None else [n for n in names if n in case.trackable]


def _valid_tokens(labels: Tensor) -> Tensor:
    """[B] tokens that count in a causal LM loss: labels shifted by one, != -100."""
    return (labels[:, 1:] != -100).sum(1)


def _scales(case: ModelCase, batch: dict[str, Tensor], sizes) -> Tensor:
    """[N] factor s_n with g_n = s_n * grad(sample n's own loss): 1 for per-sample losses,
    B v_n / V for a token-mean loss (B, V of the micro-batch holding sample n)."""
    if case.kind != "hf_lm":
        return torch.ones(sum(sizes), dtype=torch.float64)
    parts = []
    for mb in split_batch(case, batch, sizes):
        v = _valid_tokens(mb["labels"]).double()
        parts.append(len(v) * v / v.sum())
    return torch.cat(parts)


def own_loss(case: ModelCase, model: nn.Module, sample: dict[str, Tensor]) -> Tensor:
    """Scalar loss of the samples in ``sample`` as the model sees them alone: mean cross-entropy
    (``"ce"``) or the model's own token-mean loss (``"hf_lm"``)."""
    if case.kind == "hf_lm":
        return case.call(model, sample).loss
    return F.cross_entropy(case.call(model, sample), sample["y"])


def losses_of_output(case: ModelCase, out, mb: dict[str, Tensor]) -> Tensor:
    """[B] per-sample losses of one micro-batch in the units of g_n (their mean is the
    micro-step's loss): l_n for ``"ce"``, B L_n = B (sum of sample n's token losses) / V for
    ``"hf_lm"`` (computed here in float64 from the logits, not by the model)."""
    with torch.no_grad():
        if case.kind == "hf_lm":
            logits = out.logits[:, :-1]
            labels = mb["labels"][:, 1:]
            tok = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none", ignore_index=-100)
            return len(labels) * tok.sum(1) / (labels != -100).sum()
        return F.cross_entropy(out, mb["y"], reduction="none")


def per_sample_losses(case: ModelCase, model: nn.Module, batch: dict[str, Tensor], sizes) -> Tensor:
    """[N] per-sample losses (see :func:`losses_of_output`), one forward per micro-batch (so a
    training-mode BatchNorm sees the micro-batch)."""
    with torch.no_grad():
        return torch.cat([losses_of_output(case, case.call(model, mb), mb) for mb in split_batch(case, batch, sizes)])


def _clean_copy(model: nn.Module) -> nn.Module:
    model = copy.deepcopy(model)
    for m in model.modules():  # a copy taken while a Lens watches carries its hooks: drop them
        m._forward_hooks.clear()
        m._forward_pre_hooks.clear()
        m._backward_hooks.clear()
    return model


def per_sample_grads(case: ModelCase, model: nn.Module, batch: dict[str, Tensor], sizes=(N,),
                     method: str | None = None) -> dict[str, Tensor]:
    """name -> [N, *param] float64 per-sample gradients g_n (DESIGN.md units) of the case's
    tracked parameters, on a clean deep copy of ``model``. ``sizes``: the micro-batch sizes (they
    matter for a token-mean loss and for a training-mode BatchNorm only)."""
    method = method or case.oracle
    model = _clean_copy(model)
    names = tracked_names(case, model)
    params = dict(model.named_parameters())
    if method == "vmap":
        p0 = {k: params[k].detach() for k in names}
        buffers = {k: v.detach() for k, v in model.named_buffers()}
        keys = sorted(batch)

        def loss_one(p, *xs):
            sample = {k: x.unsqueeze(case.bdim(k)) for k, x in zip(keys, xs)}
            return own_loss(case, _Functional(model, p, buffers), sample)

        in_dims = (None, *[case.bdim(k) for k in keys])
        gs = vmap(grad(loss_one), in_dims=in_dims)(p0, *[batch[k] for k in keys])
    elif method == "loop":
        rows = {k: [] for k in names}
        for n in range(N):
            sample = slice_batch(case, batch, n, n + 1)
            gl = torch.autograd.grad(own_loss(case, model, sample), [params[k] for k in names])
            for k, g in zip(names, gl):
                rows[k].append(g)
        gs = {k: torch.stack(v) for k, v in rows.items()}
    elif method == "batch-loop":
        rows = {k: [] for k in names}
        for mb in split_batch(case, batch, sizes):
            losses = F.cross_entropy(case.call(model, mb), mb["y"], reduction="none")
            for n in range(len(losses)):
                gl = torch.autograd.grad(losses[n], [params[k] for k in names], retain_graph=True)
                for k, g in zip(names, gl):
                    rows[k].append(g)
        gs = {k: torch.stack(v) for k, v in rows.items()}
    else:
        raise ValueError(f"unknown oracle method {method!r}")
    s = _scales(case, batch, sizes)
    return {k: g * s.view(-1, *[1] * (g.dim() - 1)) for k, g in gs.items()}


class _Functional:
    """Calls ``model`` through ``functional_call`` with the given parameters (tied parameters
    follow their first name: ``tie_weights=True``)."""

    def __init__(self, model, params, buffers):
        self.model, self.params, self.buffers = model, params, buffers

    def __call__(self, *args, **kwargs):
        return functional_call(self.model, (self.params, self.buffers), args, kwargs)


def batch_grad_sum(case: ModelCase, model: nn.Module, batch: dict[str, Tensor], sizes=(N,)) -> dict[str, Tensor]:
    """sum_n g_n from autograd on whole micro-batches (one forward per micro-batch; the check of
    the oracle): for ``"ce"``, grad of sum_n l_n; for ``"hf_lm"``, B_k * grad of the model's loss."""
    model = _clean_copy(model)
    names = tracked_names(case, model)
    params = dict(model.named_parameters())
    total = {k: torch.zeros_like(params[k]) for k in names}
    for mb in split_batch(case, batch, sizes):
        if case.kind == "hf_lm":
            loss = len(mb["labels"]) * case.call(model, mb).loss
        else:
            loss = F.cross_entropy(case.call(model, mb), mb["y"], reduction="sum")
        for k, g in zip(names, torch.autograd.grad(loss, [params[k] for k in names])):
            total[k] += g
    return total


def flat(gs: dict[str, Tensor]) -> Tensor:
    """[N, D] per-sample gradients over the given parameters, in the dict's order."""
    return torch.cat([g.reshape(g.shape[0], -1) for g in gs.values()], dim=1)


@functools.lru_cache(maxsize=None)
def problem(name: str):
    """(case, model float64, [window 0 batch, window 1 batch]) with fixed seeds, cached."""
    case = CASES[name]
    return case, build_model(case), [make_data(case, 0), make_data(case, 1)]
