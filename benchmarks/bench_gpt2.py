"""Per-use cost on Hugging Face GPT-2: windows of K small micro-batches, ratio to a plain window.

Run:  python benchmarks/bench_gpt2.py [--rounds 7] [--sizes 1,3,2] [--model both|256|32] [--threads 2]
      [--clock wall|cpu] [--against REV]
(needs ``transformers``: the ``models`` extra, in the environment of the ``frameworks`` tests)

How accumulation is used in practice: micro-batches small enough to fit. Each window is K = 3
micro-batches of 1-3 sequences (``--sizes``) of ``GPT2LMHeadModel`` built from a config (no
download; the model's own token-mean loss from ``labels=``), then one SGD update and
``zero_grad``. Two sizes:

  * d_model 256, 4 layers, 4 heads, T 64, vocab 512 (where the instruments' own work counts);
  * d_model 32, 2 layers, 2 heads, T 12, vocab 128 (where gradlens' Python per use counts).

Rows: the instrument sets of issue 19 (BatchL2; + GradNorm; + SumGradSquared; GradHist1d;
BatchDot; BatchL2, SumGradSquared, GradNorm, GradHist1d, BatchDot and Alpha together), each timed
as a whole window (median over ``--rounds`` interleaved rounds after warm-up, the plain window
twice per round) and printed as its ratio to the plain window of the same process. ``--against
REV`` adds each row again for gradlens as of git revision REV (imported beside the working tree's
as a renamed copy), timed in the same rounds: on a shared machine two runs drift apart by more
than most changes move a row, rows of one run do not.

A second table: the narrow-range histograms of issue 19 on a GELU MLP 256-512-512-10 (batch 128
as 4 micro-batches of 32) whose per-sample gradients spread over many bins of a +-0.1 range with
64 bins: GradHist1d and GradHist2d against the plain window, and their ratio.

Targets (issue 19): BatchL2 <= 1.25x at d_model 256 and <= 1.8x at d_model 32; GradNorm adds at most
0.05x; BatchL2 + SumGradSquared + GradNorm <= 1.6x; all six <= 3.5x; GradHist1d <= 12x and
GradHist2d <= 1.3x GradHist1d on the narrow-range MLP.
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from _common import interleaved_ms, reference_package

warnings.filterwarnings("ignore")


def gpt2(d: int, layers: int, heads: int, t: int, vocab: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_embd=d, n_layer=layers, n_head=heads, n_positions=t, vocab_size=vocab,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "eager"
    return GPT2LMHeadModel(cfg)


def per_sequence_losses(logits, ids):
    """Mean token cross-entropy of each sequence ``[B]`` (Alpha's per-sample losses)."""
    lg = logits[:, :-1].detach()
    return F.cross_entropy(lg.transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


def _packages(against):
    """``[(row suffix, gradlens package)]``: the working tree's, and with ``--against REV`` that
    revision's (:func:`_common.reference_package`), timed in the same interleaved rounds."""
    import gradlens

    pkgs = [("", gradlens)]
    if against:
        pkgs.append((f" @{against}", reference_package(against)))
    return pkgs


def gpt2_rows(d, layers, heads, t, vocab, sizes, rounds, clock, against=None):
    import importlib

    torch.manual_seed(0)
    base = gpt2(d, layers, heads, t, vocab)
    batches = [torch.randint(0, vocab, (b, t)) for b in sizes]

    def plain():
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            for ids in batches:
                model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    def tracked(pkg, make):
        ins = importlib.import_module(pkg.__name__ + ".instruments")
        model = pkg.extend(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        insts = make(ins)
        lens = pkg.Lens(model, insts, optimizer=opt, keep_records=1)
        alpha = any(isinstance(i, ins.Alpha) for i in insts)

        def step():
            for ids in batches:
                out = model(ids, labels=ids)
                losses = per_sequence_losses(out.logits, ids) if alpha else None
                with lens.capture(losses=losses):
                    out.loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    hist = lambda I: I.GradHist1d(bins=64, range=(-1.0, 1.0))  # noqa: E731
    configs = {
        "BatchL2": lambda I: [I.BatchL2()],
        "BatchL2 + GradNorm": lambda I: [I.BatchL2(), I.GradNorm()],
        "BatchL2 + SumGradSquared + GradNorm": lambda I: [I.BatchL2(), I.SumGradSquared(), I.GradNorm()],
        "GradHist1d": lambda I: [hist(I)],
        "BatchDot": lambda I: [I.BatchDot()],
        "all six": lambda I: [I.BatchL2(), I.SumGradSquared(), I.GradNorm(), hist(I), I.BatchDot(), I.Alpha()],
    }
    steps = {"plain": plain(), "plain (again)": plain()}
    pkgs = _packages(against)
    for name, make in configs.items():
        for suffix, pkg in pkgs:
            steps[name + suffix] = tracked(pkg, make)
    ms = interleaved_ms(steps, rounds=rounds, warmup=2, clock=clock)
    ref = (ms["plain"] + ms["plain (again)"]) / 2
    return ref, {k: v / ref for k, v in ms.items()}


def narrow_hist_rows(rounds, clock, against=None):
    import importlib

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 10))
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    parts = list(zip(x.split(32), y.split(32)))

    def build(pkg, make):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        loss_fn = nn.CrossEntropyLoss()
        lens = None
        if make is not None:
            ins = importlib.import_module(pkg.__name__ + ".instruments")
            model = pkg.extend(model)
            loss_fn = pkg.extend(loss_fn)
            lens = pkg.Lens(model, make(ins), optimizer=opt, keep_records=1)

        def step():
            for xb, yb in parts:
                loss = loss_fn(model(xb), yb)
                if lens is None:
                    loss.backward()
                else:
                    with lens.capture():
                        loss.backward()
            opt.step()
            opt.zero_grad()

        return step

    steps = {"plain": build(None, None), "plain (again)": build(None, None)}
    for suffix, pkg in _packages(against):
        steps[HIST1D + suffix] = build(pkg, lambda I: [I.GradHist1d(bins=64, range=(-0.1, 0.1))])
        steps[HIST2D + suffix] = build(pkg, lambda I: [I.GradHist2d(bins=(40, 64), range=((-0.2, 0.2), (-0.1, 0.1)))])
    ms = interleaved_ms(steps, rounds=rounds, warmup=2, clock=clock)
    ref = (ms["plain"] + ms["plain (again)"]) / 2
    return ref, {k: v / ref for k, v in ms.items()}


HIST1D, HIST2D = "GradHist1d +-0.1, 64 bins", "GradHist2d +-0.1, 64 grad bins"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="1,3,2", help="micro-batch sizes of a window (sequences)")
    ap.add_argument("--model", choices=("both", "256", "32"), default="both")
    ap.add_argument("--skip-mlp", action="store_true", help="leave out the narrow-range histogram table")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (at most the machine's)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall time, or this process's CPU time (steadier on a shared machine; use --threads 1)")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also time gradlens as of this git revision, in the same interleaved rounds "
                         "(rows marked @REV): a change's before / after without the drift between runs")
    args = ap.parse_args()
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} time; windows of "
          f"micro-batches {sizes}; median of {args.rounds} interleaved rounds")
    shapes = {"256": (256, 4, 4, 64, 512), "32": (32, 2, 2, 12, 128)}
    chosen = ["256", "32"] if args.model == "both" else [args.model]
    suffixes = [""] + ([f" @{args.against}"] if args.against else [])
    results = {}
    for key in chosen:
        results[key] = gpt2_rows(*shapes[key], sizes, args.rounds, clock, args.against)
    names = [k for k in next(iter(results.values()))[1] if not k.startswith("plain")]
    head = " | ".join(f"d_model {k} (plain window {results[k][0]:.1f} ms)" for k in chosen)
    print(f"\n| GPT2LMHeadModel, ratio to a plain window | {head} |")
    print("|---|" + "---|" * len(chosen))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{results[k][1][name]:.2f}x" for k in chosen) + " |")
    for k in chosen:
        r = results[k][1]
        for sfx in suffixes:
            print(f"GradNorm adds {r['BatchL2 + GradNorm' + sfx] - r['BatchL2' + sfx]:+.2f}x to BatchL2 "
                  f"at d_model {k}" + (f" ({sfx.strip()})" if sfx else ""))
    if not args.skip_mlp:
        ref, r = narrow_hist_rows(args.rounds, clock, args.against)
        print(f"\n| GELU MLP 256-512-512-10, 128 = 4 x 32 (plain window {ref:.1f} ms) | ratio |")
        print("|---|---|")
        for name, v in r.items():
            if not name.startswith("plain"):
                print(f"| {name} | {v:.2f}x |")
        for sfx in suffixes:
            print(f"| GradHist2d / GradHist1d{sfx} | {r[HIST2D + sfx] / r[HIST1D + sfx]:.2f} |")


if __name__ == "__main__":
    main()
