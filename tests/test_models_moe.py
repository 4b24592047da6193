"""Issue 42, mixture-of-experts models of transformers 5.x from tiny configs (no downloads):
every parameter tracked (coverage 1.0: routers, routed experts' 3-D weights, shared experts) and
exact against a per-sample loop of each sample's own loss on a copy taken before
``gradlens.extend``, the model's own ``.loss`` (labels = input_ids), K = 3 micro-batches of
2, 3, 1, instruments BatchL2 + SumGradSquared + GradNorm. The experts run in the form the
config names (``config._experts_implementation``): ``"eager"`` (a loop over the experts hit:
``torch.where`` + ``x[token_idx]`` + ``F.linear(x, w[e])`` + ``index_add_``), ``"batched_mm"``
(``w[expert_ids]`` + ``bmm``) in float64, and ``"grouped_mm"`` (the default of
transformers 5.x, ``F.grouped_mm`` with offsets) in float32 only: torch's CPU grouped_mm takes
no float64. A router's load-balancing loss (``output_router_logits=True``) couples the samples
and is refused by the mixing rule, or left out with ``undefined="exclude"`` (the rest exact).

The breadth table :data:`BREADTH` lists every MoE architecture run, each exact with coverage 1.0
or refused with the reason given there (README's supported-models list)."""

from __future__ import annotations

import copy

import pytest
import torch

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
from oracle import per_sample_loop

pytestmark = pytest.mark.frameworks

SIZES = [2, 3, 1]
N, L, V = sum(SIZES), 7, 40
_COMMON = dict(vocab_size=V, hidden_size=16, intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=32)


def _make(arch: str, impl: str = "eager", **extra):
    """A tiny causal LM of ``arch`` (float32, seeded), experts run as ``impl``."""
    import transformers as T

    table = {
        "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
        "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                           shared_expert_intermediate_size=12, decoder_sparse_step=1)),
        "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                      dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, head_dim=8)),
        "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                        dict(moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=8, kv_lora_rank=8,
                             qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)),
        "phimoe": (T.PhimoeConfig, T.PhimoeForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    }
    cfg_cls, model_cls, kw = table[arch]
    cfg = cfg_cls(**{**_COMMON, **kw, **extra})
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = impl
    torch.manual_seed(0)
    return model_cls(cfg)


def _ids():
    return torch.randint(0, V, (N, L), generator=torch.Generator().manual_seed(1))


def _oracle(model, ids, dtype):
    """name -> [N, *param] per-sample gradients g_n of the model's own token-mean loss (equal
    lengths: g_n is the gradient of sample n's own loss), by a loop on a copy: float64 where
    the experts' form runs in it, else (grouped_mm) in ``dtype`` and widened."""
    def loss_n(m, i):
        x = ids[i:i + 1]
        return m(input_ids=x, labels=x).loss

    if dtype == torch.float64:
        return per_sample_loop(model, model.state_dict(), loss_n, N)
    m = copy.deepcopy(model)
    params = dict(m.named_parameters())
    rows = [torch.autograd.grad(loss_n(m, i), list(params.values()), allow_unused=True) for i in range(N)]
    return {k: torch.stack([torch.zeros_like(params[k]) if r[j] is None else r[j] for r in rows]).double()
            for j, k in enumerate(params)}


def _run(model, ids, **lens_kwargs):
    model = gradlens.extend(model)
    lens = Lens(model, [BatchL2(), SumGradSquared(), GradNorm()], **lens_kwargs)
    s = 0
    for b in SIZES:
        x = ids[s:s + b]
        s += b
        out = model(input_ids=x, labels=x)
        with lens.capture(reduction="mean", loss=out.loss):
            out.loss.backward()
    rec = lens.flush()
    return lens, rec


def _close(a, b, rtol):
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= rtol * max(scale, 1e-30), (a, b)


def check_exact(rec, G, names, rtol):
    """batch_l2, sum_grad_squared of each parameter, grad_norm == the oracle's (the model's
    routers upcast their logits to float32: 1e-5 relative to each quantity's largest)."""
    flat = torch.cat([G[k].flatten(1) for k in names], 1)
    _close(rec["batch_l2"], (flat ** 2).sum(1), rtol)
    assert set(rec["sum_grad_squared"]) == set(names)
    for k in names:
        _close(rec["sum_grad_squared"][k], (G[k] ** 2).sum(0), rtol)
    _close(rec["grad_norm"], flat.mean(0).norm(), rtol)


def _exact_full_coverage(arch, impl="eager", dtype=torch.float64, rtol=1e-5, **extra):
    model = _make(arch, impl, **extra).to(dtype)
    ids = _ids()
    G = _oracle(copy.deepcopy(model), ids, dtype)
    lens, rec = _run(model, ids)
    assert lens.coverage == 1.0 and rec.meta["coverage"] == 1.0
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    assert set(lens.tracked) == set(names)
    assert any(G[k].dim() == 4 for k in names)  # the experts' [E, out, in] weights, per sample
    check_exact(rec, G, names, rtol)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v3", "phimoe"])
def test_moe_family_eager_experts_exact_full_coverage(arch):
    """Eager experts (the loop over the experts hit), float64; Qwen2-MoE and DeepSeek-V3 with
    shared experts (Qwen2-MoE's gated by a sigmoid of its own router)."""
    _exact_full_coverage(arch)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v3"])
def test_moe_batched_experts_exact_full_coverage(arch):
    """Batched experts: ``gate_up_proj[expert_ids]`` (one weight per routed token) and ``bmm``,
    float64."""
    _exact_full_coverage(arch, "batched_mm")


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_grouped_experts_exact_full_coverage(arch):
    """Grouped experts (transformers 5.x's default): ``F.grouped_mm`` over the tokens sorted by
    expert with offsets, float32 (torch's CPU grouped_mm takes no float64), to float32
    precision against a float32 loop (the dims are multiples of 4: grouped_mm's strides)."""
    _exact_full_coverage(arch, "grouped_mm", torch.float32, rtol=2e-4)


def test_moe_router_aux_loss_refused_or_excluded():
    """``output_router_logits=True`` adds the load-balancing loss, whose expert fractions are
    statistics of the whole batch: refused by default (the operation, the statistic and the
    parameters named, with the fix); ``undefined="exclude"`` leaves out what reaches a router
    (embedding, attention, routers, the first layer's experts), says so in the record's meta,
    and the rest (the last layer's experts, the final norm, the head) is exact."""
    kw = dict(output_router_logits=True, router_aux_loss_coef=0.1)
    model = _make("mixtral", **kw).double()
    ids = _ids()
    with pytest.raises(RuntimeError, match=r"mul of a value pooled over the samples .* by a statistic of the whole "
                                           r"batch .*'model.layers.0.mlp.gate.weight'.*undefined='exclude'"):
        _run(copy.deepcopy(model), ids)
    G = _oracle(copy.deepcopy(model), ids, torch.float64)
    lens, rec = _run(model, ids, undefined="exclude")
    left = set(rec.meta["undefined"])
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.gate.weight",
            "model.embed_tokens.weight"} <= left
    assert rec.meta["coverage"] < 1.0
    names = [k for k, _ in model.named_parameters() if k not in left]
    assert "model.layers.1.mlp.experts.down_proj" in names and "lm_head.weight" in names
    check_exact(rec, G, names, 1e-5)


# ------------------------------------------------------------------------------ breadth
_H = dict(_COMMON)
_SEQ2SEQ = ("switch_transformers", "nllb_moe")
_NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
_CAPACITY = (r"undefined: their output reaches .* a tensor computed across the samples without gradient "
             r"\(torch.cumsum along the samples .*expert capacity counted over the batch")

#: every MoE architecture the suite runs: name -> (config class, tiny config, expected). Expected
#: ``"exact"``: every parameter tracked (coverage 1.0), exact against the per-sample loop;
#: otherwise the pattern of the refusal, with its reason:
#: - ``nllb_moe``: its router cuts each expert's tokens at a capacity counted by a cumsum over
#:   all the batch's tokens (``locations = cumsum(mask, dim=0)``), so a sample's routing depends
#:   on the samples before it: refused by the mixing rule (no gradient flows through the count,
#:   what it selects is marked; ``undefined="exclude"`` keeps the rest).
BREADTH: dict[str, tuple[str, dict, str]] = {
    "granitemoe": ("GraniteMoeConfig", dict(_H, num_local_experts=4, num_experts_per_tok=2), "exact"),
    "granitemoeshared": ("GraniteMoeSharedConfig", dict(_H, num_local_experts=4, num_experts_per_tok=2,
                                                        shared_intermediate_size=12), "exact"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", dict(_H, num_local_experts=4, num_experts_per_tok=2,
                                                        shared_intermediate_size=12, layer_types=["mamba", "attention"],
                                                        mamba_n_heads=4, mamba_n_groups=1, mamba_chunk_size=4,
                                                        mamba_d_state=8, mamba_d_head=8), "exact"),
    "jetmoe": ("JetMoeConfig", dict(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_key_value_heads=2,
                                    kv_channels=8, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2,
                                    max_position_embeddings=32), "exact"),
    "dbrx": ("DbrxConfig", dict(d_model=16, n_heads=2, n_layers=2, vocab_size=V, max_seq_len=32,
                                attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
                                ffn_config=dict(ffn_hidden_size=12, moe_num_experts=4, moe_top_k=2)), "exact"),
    "gpt_oss": ("GptOssConfig", dict(_H, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=4), "exact"),
    "deepseek_v2": ("DeepseekV2Config", dict(_H, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=2,
                                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                             q_lora_rank=8, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4,
                                             v_head_dim=4), "exact"),
    "minimax": ("MiniMaxConfig", dict(_H, num_local_experts=4, num_experts_per_tok=2, head_dim=8,
                                      layer_types=["linear_attention", "full_attention"], block_size=4), "exact"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(_H, moe_intermediate_size=8, moe_k=2, moe_num_experts=4,
                                                moe_num_shared_experts=1, moe_layer_start_index=0), "exact"),
    "glm4_moe": ("Glm4MoeConfig", dict(_H, moe_intermediate_size=8, num_experts_per_tok=2, n_shared_experts=1,
                                       n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1,
                                       head_dim=8), "exact"),
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", dict(_H, num_experts=4, moe_topk=2, head_dim=8), "exact"),
    "dots1": ("Dots1Config", dict(_H, moe_intermediate_size=8, n_shared_experts=1, n_routed_experts=4, n_group=1,
                                  topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, head_dim=8), "exact"),
    "flex_olmo": ("FlexOlmoConfig", dict(_H, pad_token_id=0, num_experts=4, num_experts_per_tok=2), "exact"),
    "qwen3_next": ("Qwen3NextConfig", dict(_H, initializer_range=0.3, head_dim=8, linear_conv_kernel_dim=2,
                                           linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                           linear_num_value_heads=2, moe_intermediate_size=8,
                                           shared_expert_intermediate_size=12, num_experts_per_tok=2, num_experts=4,
                                           layer_types=["linear_attention", "full_attention"]), "exact"),
    "lfm2_moe": ("Lfm2MoeConfig", dict(_H, moe_intermediate_size=8, num_dense_layers=1, num_experts_per_tok=2,
                                       num_experts=4, layer_types=["conv", "full_attention"]), "exact"),
    "exaone_moe": ("ExaoneMoeConfig", dict(_H, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2,
                                           num_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                                           head_dim=8), "exact"),
    "afmoe": ("AfmoeConfig", dict(_H, moe_intermediate_size=8, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
                                  num_shared_experts=1, head_dim=8), "exact"),
    "jamba": ("JambaConfig", dict(_H, num_experts=4, num_experts_per_tok=2, expert_layer_period=1,
                                  expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
                                  mamba_dt_rank=4, use_mamba_kernels=False), "exact"),
    "cohere2_moe": ("Cohere2MoeConfig", dict(_H, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                             num_shared_experts=1), "exact"),
    "llama4": ("Llama4TextConfig", dict(_H, head_dim=8, intermediate_size_mlp=12, num_local_experts=4,
                                        num_experts_per_tok=1, interleave_moe_layer_step=1), "exact"),
    "switch_transformers": ("SwitchTransformersConfig", dict(vocab_size=V, d_model=16, d_kv=8, d_ff=12,
                                                             expert_capacity=64, num_layers=2,
                                                             num_sparse_encoder_layers=1, num_decoder_layers=2,
                                                             num_sparse_decoder_layers=1, num_heads=2, num_experts=4,
                                                             decoder_start_token_id=0, pad_token_id=0,
                                                             eos_token_id=1, dropout_rate=0.0,
                                                             router_jitter_noise=0.0), "exact"),
    "nllb_moe": ("NllbMoeConfig", dict(vocab_size=V, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=12,
                                       decoder_ffn_dim=12, encoder_attention_heads=2, decoder_attention_heads=2,
                                       num_experts=4, expert_capacity=64, encoder_sparse_step=1, decoder_sparse_step=1,
                                       max_position_embeddings=32, decoder_start_token_id=2, pad_token_id=1,
                                       moe_token_dropout=0.0, **_NO_DROPOUT), _CAPACITY),
}


@pytest.mark.parametrize("name", sorted(BREADTH))
def test_moe_breadth(name):
    """Each MoE architecture of :data:`BREADTH` (eager experts, float64, K = 3 micro-batches of
    2, 3, 1, the model's own loss): exact with every parameter tracked, or refused as documented
    there."""
    import transformers as T

    cls, kw, expected = BREADTH[name]
    cfg = getattr(T, cls)(**kw)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    auto = T.AutoModelForSeq2SeqLM if name in _SEQ2SEQ else T.AutoModelForCausalLM
    model = auto.from_config(cfg).double()
    ids = _ids()
    if expected != "exact":
        with pytest.raises(RuntimeError, match=expected):
            _run(model, ids)
        return
    G = _oracle(copy.deepcopy(model), ids, torch.float64)
    lens, rec = _run(model, ids)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    assert lens.coverage == 1.0 and set(lens.tracked) == set(names)
    check_exact(rec, G, names, 1e-5)
