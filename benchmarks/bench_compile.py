"""The cost of tracked windows under torch.compile (issue 21): a small CNN, torch.compile with
the default (inductor) backend, Lens(..., every=2) with BatchL2 + GradNorm.

Run:  python benchmarks/bench_compile.py [--batch 32] [--windows 6] [--route]

Prints, in seconds of wall time: the first window of the compiled model (compilation included),
an untracked compiled window, the first tracked window (eager: gradlens sets the compiler stance
"force_eager" while its first micro-step runs), a later tracked window (the CNN's Conv2d and Linear
layers take the compiled route: it runs compiled), and the same eager model's plain and tracked
windows; plus the graph breaks counted by dynamo.

``--route`` (issue 35, the compiled route): an MLP, a small GPT (nanoGPT's blocks, untied head, the
loss outside) and, where transformers is installed, Hugging Face GPT-2
(``GPT2ForSequenceClassification``, n_embd 128, 2 layers, T 32, vocab 50257: its ``Conv1D`` layers;
the LM head's tie to the token table would be a shared weight, so the classification head; the
position table, whose ids ``[1, T]`` are broadcast over the samples, left out of tracking),
inductor, windows of K = 3 micro-batches (sizes 2:3:1), BatchL2 + SumGradSquared + GradNorm on the
odd windows: in one run, the median tracked window of the compiled model (after its first, eager
micro-step and the compilations) / its median untracked window, and the same for the eager model;
plus graph breaks and graphs compiled.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradNorm


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 64), nn.ReLU(), nn.Linear(64, 10),
    )


def windows(compiled: bool, batch: int, n: int) -> list[float]:
    model = gradlens.extend(cnn())
    run = torch.compile(model) if compiled else model
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lens = Lens(run, [BatchL2(), GradNorm()], optimizer=opt, every=lambda w: w % 2 == 1)
        for _ in range(n):
            t0 = time.perf_counter()
            loss = loss_fn(run(x), y)
            with lens.capture():
                loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        lens.close()
    return times


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class _GPT(nn.Module):
    """nanoGPT's shape with an untied head (a tied one is a shared weight: eager route)."""

    def __init__(self, vocab: int = 256, t: int = 32, d: int = 128, layers: int = 2):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.h = nn.ModuleList(_Block(d, 4) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _route_windows(name: str, mode: str, n: int, unit: int) -> list[float]:
    """Window times of ``name`` ("mlp" or "gpt") run ``mode``: "tracked" (compiled) or "eager";
    odd windows tracked, even ones not."""
    from gradlens.instruments import SumGradSquared

    torch.manual_seed(0)
    if name == "hf_gpt2":
        model = gradlens.extend(_hf_gpt2())
    else:
        model = gradlens.extend(nn.Sequential(nn.Linear(1024, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(),
                                              nn.Linear(768, 10)) if name == "mlp" else _GPT())
    run = model if mode == "eager" else torch.compile(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    sizes = [2 * unit, 3 * unit, unit]
    if name == "mlp":
        data = [(torch.randn(b, 1024), torch.randint(0, 10, (b,))) for b in sizes]
    elif name == "hf_gpt2":
        data = [(torch.randint(1, 50257, (b, 32)), torch.randint(0, 4, (b,))) for b in sizes]
    else:
        data = [(torch.randint(0, 256, (b, 32)), torch.randint(0, 256, (b, 32))) for b in sizes]
    # alternate: tracked odd windows, untracked even ones, in one run (a busy machine's drift
    # falls on both alike)
    every = (lambda w: w % 2 == 1)
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lens = Lens(run, [BatchL2(), SumGradSquared(), GradNorm()], optimizer=opt, every=every,
                    exclude={"gpt": ["wpe"], "hf_gpt2": ["transformer.wpe"]}.get(name, ()))
        for _ in range(n):
            t0 = time.perf_counter()
            for x, y in data:
                out = run(input_ids=x).logits if name == "hf_gpt2" else run(x)
                loss = loss_fn(out.reshape(-1, out.shape[-1]), y.reshape(-1)) / len(data)
                with lens.capture():
                    loss.backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        routes = [r.meta.get("route") for r in lens.records]
        lens.close()
    if mode == "tracked":
        print(f"  {name}: routes of the tracked compiled windows {routes[:2]} ... {routes[-1]!r}")
    return times


def _hf_gpt2() -> nn.Module:
    """Hugging Face GPT-2, n_embd 128, 2 layers, 4 heads, T 32, GPT-2's vocabulary, a 4-way
    sequence-classification head (untied), no dropout."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    cfg = GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, num_labels=4, pad_token_id=0)
    return GPT2ForSequenceClassification(cfg)


def route_rows(n: int, only: list[str] | None = None) -> None:
    from statistics import median
    from torch._dynamo.utils import counters

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}; median window after {n // 2} warm-up windows")
    rows = [("hf_gpt2", 1), ("gpt", 2), ("mlp", 32)]
    for name, unit in [r for r in rows if only is None or r[0] in only]:
        if name == "hf_gpt2":
            import importlib.util

            if importlib.util.find_spec("transformers") is None:
                print("hf_gpt2: transformers is not installed (pip install transformers): row not run")
                continue
        got = {}
        for mode in ("tracked", "eager"):
            torch._dynamo.reset()
            before, graphs = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
            t = _route_windows(name, mode, n, unit)
            got[mode] = median([x for i, x in enumerate(t) if i >= n // 2 and i % 2 == 1])
            got[mode + "_plain"] = median([x for i, x in enumerate(t) if i >= n // 2 and i % 2 == 0])
            got[mode + "_breaks"] = sum(counters["graph_break"].values()) - before
            got[mode + "_graphs"] = counters["stats"]["unique_graphs"] - graphs
        print(f"{name}: compiled untracked {1e3 * got['tracked_plain']:.1f} ms, compiled tracked "
              f"{1e3 * got['tracked']:.1f} ms ({got['tracked'] / got['tracked_plain']:.2f}x); eager untracked "
              f"{1e3 * got['eager_plain']:.1f} ms, eager tracked {1e3 * got['eager']:.1f} ms "
              f"({got['eager'] / got['eager_plain']:.2f}x); graph breaks {got['tracked_breaks']}, "
              f"graphs compiled {got['tracked_graphs']}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--windows", type=int, default=6)
    p.add_argument("--route", action="store_true", help="the compiled route's ratios (issue 35)")
    p.add_argument("--only", nargs="+", choices=["hf_gpt2", "gpt", "mlp"], help="--route: these rows only")
    a = p.parse_args()
    if a.route:
        route_rows(max(a.windows, 8), a.only)
        return
    from torch._dynamo.utils import counters

    eager = windows(False, a.batch, a.windows)
    torch._dynamo.reset()
    comp = windows(True, a.batch, a.windows)
    breaks = sum(counters["graph_break"].values())
    # windows 0, 2, 4 untracked; 1, 3, 5 tracked (schedule_offset=1)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, batch {a.batch}")
    print(f"compiled: first window (compiles) {comp[0]:.2f} s, untracked {min(comp[2::2]):.3f} s, "
          f"first tracked {comp[1]:.3f} s, later tracked {min(comp[3::2]):.3f} s; graph breaks {breaks}")
    print(f"eager:    plain {min(eager[0::2]):.3f} s, tracked {min(eager[1::2]):.3f} s")


if __name__ == "__main__":
    main()
