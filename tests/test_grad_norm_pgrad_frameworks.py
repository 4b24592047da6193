"""GradNorm(source="p.grad") on Hugging Face GPT-2 (its own token-mean loss from ``labels=``, a
tied embedding, K = 2 equal micro-batches): the same values as GradNorm()'s window sum, in
float64. Run with the frameworks environment: ``pytest -m frameworks``."""

from __future__ import annotations

import copy

import pytest
import torch

import gradlens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared

try:
    from transformers import GPT2Config, GPT2LMHeadModel

    _IMPORT_ERROR = None
except ImportError as err:  # collected (and deselected) by the default run
    _IMPORT_ERROR = err

pytestmark = pytest.mark.frameworks


def _records(base, batches, source):
    model = gradlens.extend(copy.deepcopy(base))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    lens = gradlens.Lens(model, [BatchL2(), SumGradSquared(), GradNorm(source=source)], optimizer=opt)
    for _ in range(3):
        for ids in batches:
            out = model(ids, labels=ids)
            with lens.capture():
                out.loss.backward()
        opt.step()
        opt.zero_grad()
    assert ("grad_sum" in lens._meter.plan.needs) == (source == "sums")
    return lens.records


def test_hf_gpt2_grad_norm_from_p_grad_equals_the_window_sum():
    if _IMPORT_ERROR is not None:
        raise _IMPORT_ERROR
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, vocab_size=97,
                     bos_token_id=0, eos_token_id=0)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg).double()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 97, (3, 16), generator=g) for _ in range(2)]
    sums, grads = _records(base, batches, "sums"), _records(base, batches, "p.grad")
    for a, b in zip(sums, grads):
        assert "grad_norm" not in b.meta
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-10 * a["grad_norm"]
