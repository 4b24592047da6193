"""Peak memory beside time: GPT-2 small (124M parameters, random init), each configuration in a
fresh process.

Run:  python benchmarks/bench_memory.py [--windows 3] [--sizes 2,2] [--t 128] [--threads 2]
      [--configs "BatchL2,norm set"] [--against REV] [--small] [--keep-records 1]
(needs ``transformers``: the ``models`` extra, in the environment of the ``frameworks`` tests)

A window is K micro-batches of ``--sizes`` sequences of ``--t`` tokens of ``GPT2LMHeadModel``
(GPT-2 small's config, built without a download; its own token-mean loss from ``labels=``), then
one SGD update and ``zero_grad``. Every configuration runs ``--windows`` windows in its own fresh
Python process (``subprocess``), which prints the process's peak resident set size
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``: what the OS saw, tensors, allocator caches and
Python together) and the median window time. Rows: plain, BatchL2, BatchL2 + SumGradSquared +
GradNorm ("norm set"), the same with ``GradNorm(source="p.grad")`` (the window gradient read from
``p.grad``, no window sum of its own), GradHist1d; ``--against REV`` adds each tracked row again for gradlens as of
git revision REV (a renamed copy, :func:`_common.reference_package`). ``--small`` uses a 2-layer,
d_model 128 GPT-2 (a quick check of the script).

Targets (issue 35): BatchL2 <= 1.10x plain; the norm set <= plain + two parameter-sized tensors
(2 x 4 bytes per parameter) + 10 % of plain.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CONFIGS = {
    "plain": [],
    "BatchL2": ["BatchL2()"],
    "norm set": ["BatchL2()", "SumGradSquared()", "GradNorm()"],
    "norm set (p.grad)": ["BatchL2()", "SumGradSquared()", "GradNorm(source='p.grad')"],
    "GradHist1d": ["GradHist1d(bins=64, range=(-1.0, 1.0))"],
}


def child(args) -> None:
    """One configuration in this process: prints one JSON line (peak RSS in MB, median ms)."""
    import importlib
    import resource
    import statistics
    import time
    import warnings

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    warnings.filterwarnings("ignore")
    torch.set_num_threads(min(args.threads, torch.get_num_threads()))
    if args.small:
        cfg = GPT2Config(n_embd=128, n_layer=2, n_head=2, n_positions=args.t, vocab_size=2048)
    else:
        cfg = GPT2Config(n_positions=max(args.t, 1024))  # GPT-2 small: 12 x 768, vocab 50257
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [torch.randint(0, cfg.vocab_size, (b, args.t)) for b in sizes]
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    lens = None
    if args.child != "plain":
        if args.package != "gradlens":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from _common import reference_package

            pkg = reference_package(args.package)
        else:  # this checkout's gradlens, not an installed one (the script's folder is on sys.path)
            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
            import gradlens as pkg
        ins = importlib.import_module(pkg.__name__ + ".instruments")
        model = pkg.extend(model)
        insts = [eval(src, vars(ins)) for src in CONFIGS[args.child]]  # noqa: S307 - our own table
        lens = pkg.Lens(model, insts, optimizer=opt, keep_records=args.keep_records)
    times = []
    for _ in range(args.windows):
        t0 = time.perf_counter()
        for ids in batches:
            out = model(ids, labels=ids)
            if lens is None:
                out.loss.backward()
            else:
                with lens.capture():
                    out.loss.backward()
            del out
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB -> MiB (Linux)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"rss_mb": rss, "ms": statistics.median(times[1:] or times) * 1e3, "params": params}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--sizes", default="2,2", help="micro-batch sizes of a window (sequences)")
    ap.add_argument("--t", type=int, default=128, help="tokens per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of rows")
    ap.add_argument("--against", metavar="REV", default=None,
                    help="also run each tracked row with gradlens as of this git revision")
    ap.add_argument("--small", action="store_true", help="a 2-layer d_model 128 GPT-2 (quick check)")
    ap.add_argument("--keep-records", type=int, default=1,
                    help="Lens(keep_records=...): 1 holds the last record (and the sums it refers to), 0 none")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--package", default="gradlens", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    rows = []
    for name in args.configs.split(","):
        name = name.strip()
        for pkg in ["gradlens"] + ([args.against] if args.against and name != "plain" else []):
            cmd = [sys.executable, __file__, "--child", name, "--package", pkg, "--windows", str(args.windows),
                   "--sizes", args.sizes, "--t", str(args.t), "--threads", str(args.threads),
                   "--keep-records", str(args.keep_records)]
            cmd += ["--small"] if args.small else []
            done = subprocess.run(cmd, capture_output=True, text=True)
            label = name + ("" if pkg == "gradlens" else f" @{pkg}")
            if done.returncode:
                print(f"{label}: failed: {done.stderr.strip().splitlines()[-1:]}")
                continue
            rows.append((label, json.loads(done.stdout.strip().splitlines()[-1])))
            print(f"{label}: peak RSS {rows[-1][1]['rss_mb']:,.0f} MB, window {rows[-1][1]['ms']:,.0f} ms",
                  flush=True)  # as each process ends (the table follows)
    plain = dict(rows).get("plain")
    params = rows[0][1]["params"] if rows else 0
    print(f"GPT2LMHeadModel{' (small check)' if args.small else ''}, {params / 1e6:.1f}M parameters, windows of "
          f"micro-batches {args.sizes} x {args.t} tokens, {args.windows} windows per fresh process, "
          f"{args.threads} threads, keep_records={args.keep_records}; peak RSS (ru_maxrss) and median window time after the first")
    print("\n| configuration | peak RSS MB | x plain | window ms | x plain |")
    print("|---|---|---|---|---|")
    for label, r in rows:
        rel = (f"{r['rss_mb'] / plain['rss_mb']:.2f}x", f"{r['ms'] / plain['ms']:.2f}x") if plain else ("", "")
        print(f"| {label} | {r['rss_mb']:,.0f} | {rel[0]} | {r['ms']:,.0f} | {rel[1]} |")
    if plain:
        bound = plain["rss_mb"] * 1.10 + 2 * 4 * params / 2**20
        print(f"\nnorm-set bound (plain x 1.10 + two float32 parameter-sized tensors): {bound:,.0f} MB; "
              f"BatchL2 bound (plain x 1.10): {plain['rss_mb'] * 1.10:,.0f} MB")


if __name__ == "__main__":
    main()
