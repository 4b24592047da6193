"""A GPT of the kind most training scripts copy (nanoGPT's shape), for the accumulation check and
the slips of issue 39: its own model file (SDPA causal attention, tied embeddings, position
embeddings of ``arange(T)``, dropout), the loss computed inside ``forward`` as a token-mean
``F.cross_entropy(logits.view(-1, V), targets.view(-1), ignore_index=-1)``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, T = 32, 8


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads, self.dropout = heads, dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        return x + self.drop(self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)))))


class GPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, block: int = T, d: int = 16, heads: int = 2, layers: int = 2,
                 dropout: float = 0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.h = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.drop = nn.Dropout(dropout)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(t, device=idx.device)))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def batches(sizes, ignored=(), seed: int = 0):
    """Micro-batches ``(idx, targets)`` of ``sizes`` sequences; ``ignored[k]`` leading targets of
    micro-batch k set to -1 (not counted: unequal counted tokens)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, b in enumerate(sizes):
        idx = torch.randint(0, VOCAB, (b, T), generator=g)
        targets = torch.randint(0, VOCAB, (b, T), generator=g)
        if k < len(ignored):
            targets.view(-1)[: ignored[k]] = -1
        out.append((idx, targets))
    return out
