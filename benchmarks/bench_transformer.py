"""Step-time ratios on a GPT-style transformer: gradlens beside Opacus and torch.func vmap(grad).

Run:  python benchmarks/bench_transformer.py [--steps 8] [--batch 32] [--device cpu]

The model (torch.nn only): token + position embeddings, 4 pre-norm blocks (nn.LayerNorm,
attention with nn.Linear q / k / v / out projections and causal
F.scaled_dot_product_attention, GELU MLP 256-1024-256), a final LayerNorm and an output
projection tied to the token embedding; d_model 256, 4 heads, T 64, vocab 512, batch 32. The loss
is the token-mean cross-entropy over the batch (``lens.capture(reduction="mean")``).

Each row times one training step (forward, backward, SGD update, zero_grad; median over
``--steps`` interleaved rounds after warm-up, the plain step twice per round) and gives its ratio
to the plain step of the same process:
  gradlens norm set (BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale),
  gradlens GradHist1d, gradlens BatchDot, a gradlens untracked window,
  and for each gradlens configuration the same statistic built by hand from the per-sample
  gradients of Opacus GradSampleModule and of torch.func vmap(grad): per-sample norms and the
  per-parameter sum of squares over samples (norm set),
  ``torch.histc`` of every element with GradHist1d's bins and range (GradHist1d), the [B, B] Gram
  matrix of the flattened per-sample gradients (BatchDot).
Targets (issue 8): norm set <= 2.5x plain; every gradlens row faster than Opacus and vmap on the
same statistic (one summary line per configuration).
A row whose setup or first step fails prints ``failed: <error>`` and the other rows still run.
After the timed rounds one more, untimed step of each row measures its peak memory (the header
line says how, on this device), printed with its ratio to the plain step's.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from _common import fmt_mib, interleaved_ms, memory_note, peak_memory_all

warnings.filterwarnings("ignore")

VOCAB, D, HEADS, LAYERS, T = 512, 256, 4, 4, 64


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):  # [B, T, d]
        b, t, d = x.shape
        h = self.heads

        def split(y):
            return y.view(b, t, h, d // h).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """tokens [B, T] -> logits [B, T, vocab]; ``lm_head.weight`` is ``wte.weight`` (tied)."""

    def __init__(self, vocab=VOCAB, d=D, heads=HEADS, layers=LAYERS, t=T):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(t, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(t), persistent=False)

    def forward(self, tokens):
        b, t = tokens.shape
        # positions [B, T] (expanded, not broadcast: Opacus' Embedding sampler needs the batch axis)
        x = self.wte(tokens) + self.wpe(self.pos[:t].expand(b, t))
        return self.lm_head(self.ln_f(self.blocks(x)))


def lm_loss(logits, targets):
    """Token-mean cross-entropy over the micro-batch (what a language model backpropagates)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def plain_step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()

    return step, lambda: None


def lens_step(instruments, every=1):
    def build(model, x, y):
        import gradlens
        from gradlens import Lens

        model = gradlens.extend(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        lens = Lens(model, instruments(), optimizer=opt, every=every, keep_records=False)

        def step():
            loss = lm_loss(model(x), y)
            with lens.capture(reduction="mean", loss=loss):
                loss.backward()
            opt.step()
            opt.zero_grad()

        return step, lens.close

    return build


def _stat_norms(gs):
    """What the norm set records beyond the batch gradient (which ``.grad`` holds): the ``[B]``
    per-sample gradient norms (BatchL2, GradNorm, NormTest, NoiseScale) and each parameter's
    sum over samples of g_n * g_n (SumGradSquared), from one square per parameter."""
    l2, sgs = 0, []
    for g in gs:
        sq = g.square()
        l2 = l2 + sq.flatten(1).sum(1)
        sgs.append(sq.sum(0))
    return l2.sqrt(), sgs


def _stat_hist(gs):
    """``[bins]`` counts of every per-sample gradient element, with GradHist1d's default bins and
    range: one ``torch.histc`` per parameter (values outside the range are dropped, which makes
    this baseline, if anything, cheaper than GradHist1d, which counts them in the end bins)."""
    from gradlens.instruments import GradHist1d

    h = GradHist1d()
    lo, hi = h.range
    counts = torch.zeros(h.bins)
    for g in gs:
        counts += torch.histc(g, h.bins, lo, hi)  # each g has < 2**24 elements: float32-exact
    return counts


def _stat_gram(gs):
    """``[B, B]`` Gram matrix g_n . g_m of the flattened per-sample gradients (what BatchDot
    records): one ``G_p G_p^T`` per parameter accumulated in place, no ``[B, P]`` concatenation."""
    b = gs[0].shape[0]
    k = gs[0].new_zeros(b, b)
    for g in gs:
        f = g.reshape(b, -1)
        k.addmm_(f, f.T)
    return k


STATS = {"norms": _stat_norms, "hist": _stat_hist, "gram": _stat_gram}


def opacus_step(stat):
    """Opacus GradSampleModule (hooks; a tied weight accumulates its uses' grad_sample), then
    ``STATS[stat]`` of the per-sample gradients."""

    def build(model, x, y):
        from opacus import GradSampleModule

        gsm = GradSampleModule(model, batch_first=True, loss_reduction="mean")
        params = [p for p in gsm.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=1e-3)
        fn, out = STATS[stat], {}

        def step():
            lm_loss(gsm(x), y).backward()
            with torch.no_grad():
                out[stat] = fn([p.grad_sample for p in params])
            opt.step()
            opt.zero_grad()
            for p in params:
                p.grad_sample = None

        return step, lambda: gsm._close() if hasattr(gsm, "_close") else None

    return build


def vmap_step(stat):
    """torch.func: vmap(grad) of one sample's token-mean loss -> per-sample gradients
    {name: [B, *param]}, then ``STATS[stat]`` of them; the update uses their mean (the batch
    gradient)."""

    def build(model, x, y):
        from torch.func import functional_call, grad, vmap

        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        names = [n for n, p in model.named_parameters()]
        fn, out = STATS[stat], {}

        def loss_one(params, xi, yi):
            logits = functional_call(model, params, (xi.unsqueeze(0),))
            return lm_loss(logits, yi.unsqueeze(0))

        per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def step():
            params = {n: p.detach() for n, p in model.named_parameters()}
            gs = per_sample(params, x, y)
            out[stat] = fn(list(gs.values()))
            for n, p in zip(names, model.parameters()):
                p.grad = gs[n].mean(0)
            opt.step()
            opt.zero_grad()

        return step, lambda: None

    return build


def _norm_set():
    from gradlens.instruments import BatchL2, GradNorm, NoiseScale, NormTest, SumGradSquared

    return [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]


def _hist():
    from gradlens.instruments import GradHist1d

    return [GradHist1d()]


def _dot():
    from gradlens.instruments import BatchDot

    return [BatchDot()]


NORMS = "gradlens norm set: BatchL2+SGS+GradNorm+NormTest+NoiseScale"
HIST = "gradlens GradHist1d"
DOT = "gradlens BatchDot"
UNTRACKED = "gradlens untracked window"
OPACUS = {"norms": "Opacus GradSampleModule + norms, sum of squares",
          "hist": "Opacus GradSampleModule + histc of all elements",
          "gram": "Opacus GradSampleModule + [B, B] Gram"}
VMAP = {"norms": "torch.func vmap(grad) + norms, sum of squares",
        "hist": "torch.func vmap(grad) + histc of all elements",
        "gram": "torch.func vmap(grad) + [B, B] Gram"}
#: each gradlens row and the statistic its baselines compute
GRADLENS_ROWS = {NORMS: "norms", HIST: "hist", DOT: "gram"}


def configs():
    return [
        (NORMS, lens_step(_norm_set)),
        (HIST, lens_step(_hist)),
        (DOT, lens_step(_dot)),
        (UNTRACKED, lens_step(_norm_set, every=lambda s: False)),
        *[(OPACUS[k], opacus_step(k)) for k in STATS],
        *[(VMAP[k], vmap_step(k)) for k in STATS],
    ]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=8, help="timed interleaved rounds")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--only", default="", help="comma-separated row names to run (substring match)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    base = GPT().to(dev)
    x = torch.randint(0, VOCAB, (args.batch, T), device=dev)
    y = torch.randint(0, VOCAB, (args.batch, T), device=dev)
    n_params = sum(q.numel() for q in base.parameters())
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}; GPT {LAYERS} pre-norm "
          f"blocks, d_model {D}, {HEADS} heads, T {T}, vocab {VOCAB}, batch {args.batch}, tied embeddings, "
          f"{n_params / 1e6:.2f} M parameters")
    print(memory_note(dev))

    rows = configs()
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        rows = [(n, b) for n, b in rows if any(k in n for k in keys)]
    steps, closers, failed = {}, [], {}
    step, close = plain_step(copy.deepcopy(base), x, y)
    steps["plain step"] = lambda step=step: (step(), sync())
    closers.append(close)
    for name, build in rows:
        try:
            step, close = build(copy.deepcopy(base), x, y)
            step()  # the first step runs here: a failure shows now, not inside the timing
            sync()
        except Exception as e:  # noqa: BLE001 - every row must print
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            continue
        steps[name] = lambda step=step: (step(), sync())
        closers.append(close)
    # the plain step runs twice per round (first and in the middle) so that the position in the
    # round (caches left by the previous configuration) does not bias the baseline
    order = [n for n in steps if n != "plain step"]
    timed = dict([("plain step", steps["plain step"]), *[(n, steps[n]) for n in order[: len(order) // 2]],
                  ("plain step #2", steps["plain step"]), *[(n, steps[n]) for n in order[len(order) // 2:]]])
    ms = interleaved_ms(timed, args.steps, warmup=1, sync=sync)
    mem = peak_memory_all(steps, dev)  # after the timing: one more step each, not timed
    mem_plain = mem["plain step"]

    def mem_cols(name):
        m = mem.get(name, math.nan)
        r = f"{m / mem_plain:7.2f}x" if mem_plain > 0 and not math.isnan(m) else f"{'n/a':>8}"
        return f" {fmt_mib(m):>9} | {r} |"

    for close in closers:
        close()
    plain = (ms.pop("plain step") + ms.pop("plain step #2")) / 2

    print(f"\n## GPT-style transformer  (plain step {plain:.1f} ms, peak {fmt_mib(mem_plain)} MiB)")
    print(f"| {'configuration':<62} | {'ms/step':>9} | {'x plain':>8} | {'peak MiB':>9} | {'x plain':>8} |")
    print(f"|{'-' * 64}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    print(f"| {'plain step':<62} | {plain:9.1f} | {1.0:7.2f}x |" + mem_cols("plain step"))
    for name, _ in rows:
        if name in failed:
            print(f"| {name:<62} | failed: {failed[name]}")
        else:
            print(f"| {name:<62} | {ms[name]:9.1f} | {ms[name] / plain:7.2f}x |" + mem_cols(name))

    print()
    if NORMS in ms:
        r = ms[NORMS] / plain
        print(f"target norm set <= 2.5x plain: {r:.2f}x -> {'met' if r <= 2.5 else 'NOT met'}")
    print("per configuration, x plain (gradlens | Opacus | vmap) and the speed-up of gradlens over each:")
    for name, stat in GRADLENS_ROWS.items():
        refs = [(tool, ms.get(rows_[stat])) for tool, rows_ in (("Opacus", OPACUS), ("vmap", VMAP))]
        if name not in ms or any(v is None for _, v in refs):
            print(f"  {stat:<5}: not measured (a row failed or was left out)")
            continue
        ok = all(ms[name] < v for _, v in refs)
        cells = " | ".join(f"{tool} {v / plain:.2f}x" for tool, v in refs)
        gains = ", ".join(f"{v / ms[name]:.2f}x faster than {tool}" for tool, v in refs)
        print(f"  {stat:<5}: gradlens {ms[name] / plain:.2f}x | {cells}  ->  {gains} -> "
              f"{'met' if ok else 'NOT met'}")
    return {"plain": plain, **ms, **{n: math.nan for n in failed}}


if __name__ == "__main__":
    main()
