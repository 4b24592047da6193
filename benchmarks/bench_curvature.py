"""Time and memory per tracked window of the curvature instruments (HessMaxEV, HessTrace,
TICDiag, TICTrace), one at a time, on the MLP and CNN of bench_instruments.py and the GPT-style
model of bench_transformer.py.

Run:  python benchmarks/bench_curvature.py [--steps 3] [--models mlp,cnn,gpt] [--device cpu]
      [--max-iter 20] [--probes 8] [--accum 2] [--batch B]

A window is ``--accum`` micro-steps (the batch split in equal parts) and an SGD update. Rows:
  plain window (backward without a graph),
  create_graph only (the same window with ``loss.backward(create_graph=True)``, no Lens: the
  price of the double-backward graph alone),
  each instrument alone in a Lens (every window tracked, so every window pays), with
  ``HessMaxEV(max_iter=--max-iter)`` and ``--probes`` Rademacher probes for the estimators
  (auto: the MLP and CNN are Sequential models of supported layers, so their trace and diagonal
  are exact by second-order backpropagation; the GPT exceeds the one-hot budget of 4096
  parameters and gets Hutchinson's estimate; one row forces Hutchinson everywhere).
Times are medians over ``--steps`` interleaved rounds after one warm-up; after the rounds one
more, untimed window of each row measures its peak memory (see the header). Each row also
prints the Hessian-vector products of its last window. The GPT runs attention through
``F.scaled_dot_product_attention`` under the math backend (``torch.nn.attention.sdpa_kernel``):
the fused CPU kernel has no double backward.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import warnings

import torch
import torch.nn.functional as F

import gradlens
from gradlens import Lens
from gradlens.instruments import HessMaxEV, HessTrace, TICDiag, TICTrace

from _common import build_all, cnn, device_sync, fmt_mib, interleaved_ms, memory_note, mlp, peak_memory_all

warnings.filterwarnings("ignore")


def _gpt():
    from bench_transformer import GPT

    return GPT()


def _ce(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


MODELS = {
    "mlp": ("MLP 784-512-512-10, batch 128", mlp, lambda b, d: torch.randn(b, 1, 28, 28, device=d), 128, 10),
    "cnn": ("CNN conv 3-32-64 + pools, linear 4096-10, batch 64", cnn,
            lambda b, d: torch.randn(b, 3, 32, 32, device=d), 64, 10),
    "gpt": ("GPT-style, 4 blocks, d 256, T 64, tied embeddings, batch 32 (token-mean CE)", _gpt,
            lambda b, d: torch.randint(0, 512, (b, 64), device=d), 32, 512),
}


def _math_sdpa():
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    except ImportError:  # older torch: the math kernel is what runs on the CPU anyway
        return contextlib.nullcontext()


def plain_window(create_graph: bool):
    def build(model, xs, ys):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step():
            for x, y in zip(xs, ys):
                (_ce(model(x), y) / len(xs)).backward(create_graph=create_graph)
            opt.step()
            opt.zero_grad()

        return step, lambda: None

    return build


def lens_window(make):
    def build(model, xs, ys):
        model = gradlens.extend(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        lens = Lens(model, [make()], optimizer=opt, keep_records=1)
        last = {}

        def step():
            for x, y in zip(xs, ys):
                loss = _ce(model(x), y)
                with lens.capture(reduction="mean", loss=loss):
                    loss.backward(create_graph=lens.create_graph)
            graph = lens._graph
            opt.step()
            last["products"] = graph.products if graph is not None else 0
            rec = lens.records[-1] if lens.records else None
            if rec is not None:
                last["how"] = next((v for k, v in rec.meta.items() if k.endswith("_method")),
                                   rec.meta.get(make().key, ""))
            opt.zero_grad()

        step.last = last
        return step, lens.close

    return build


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn,gpt")
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-iter", type=int, default=20)
    p.add_argument("--probes", type=int, default=8)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--batch", type=int, default=0, help="batch per window (0: the model's default)")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    sync = device_sync(dev)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}; K = {args.accum} "
          f"micro-steps per window; HessMaxEV(max_iter={args.max_iter}), {args.probes} probes")
    print(memory_note(dev))
    rows_by_model = {}
    for key in args.models.split(","):
        title, make, data, batch, classes = MODELS[key]
        if args.batch:
            title, batch = f"{title.rsplit(', batch', 1)[0]}, batch {args.batch}", args.batch
        torch.manual_seed(0)
        base = make().to(dev)
        x = data(batch, dev)
        y = torch.randint(0, classes, (batch, 64) if key == "gpt" else (batch,), device=dev)
        xs, ys = x.chunk(args.accum), y.chunk(args.accum)
        builds = [
            ("plain window", plain_window(False)),
            ("create_graph only (no Lens)", plain_window(True)),
            (f"HessMaxEV(max_iter={args.max_iter})", lens_window(lambda: HessMaxEV(max_iter=args.max_iter))),
            ("HessTrace() (auto)", lens_window(lambda: HessTrace(probes=args.probes, chunk=args.probes))),
            (f"HessTrace(hutchinson, {args.probes} probes)",
             lens_window(lambda: HessTrace(method="hutchinson", probes=args.probes, chunk=args.probes))),
            ("TICDiag() (auto)", lens_window(lambda: TICDiag(probes=args.probes, chunk=args.probes))),
            ("TICTrace() (auto)", lens_window(lambda: TICTrace(probes=args.probes, chunk=args.probes))),
        ]
        with _math_sdpa() if key == "gpt" else contextlib.nullcontext():
            steps, closers, failed = build_all(builds, lambda: (copy.deepcopy(base), xs, ys), sync)
            ms = interleaved_ms(steps, args.steps, warmup=1, sync=sync)
            mem = peak_memory_all(steps, dev)
        for close in closers:
            close()
        plain, mem_plain = ms["plain window"], mem["plain window"]
        print(f"\n## {title}  (plain window {plain:.1f} ms, peak {fmt_mib(mem_plain)} MiB)")
        print(f"| {'configuration':<30} | {'ms/window':>10} | {'x plain':>8} | {'HVPs':>5} | {'peak MiB':>9} | {'x plain':>8} | how")
        print(f"|{'-' * 32}|{'-' * 12}|{'-' * 10}|{'-' * 7}|{'-' * 11}|{'-' * 10}|-----|")
        rows = []
        for name, _ in builds:
            if name in failed:
                print(f"| {name:<30} | failed: {failed[name]}")
                continue
            t, m = ms[name], mem[name]
            last = getattr(steps[name], "last", {})
            hv = last.get("products", "")
            mr = f"{m / mem_plain:7.2f}x" if mem_plain > 0 and not math.isnan(m) else f"{'n/a':>8}"
            how = str(last.get("how", ""))[:34]
            print(f"| {name:<30} | {t:10.1f} | {t / plain:7.2f}x | {hv!s:>5} | {fmt_mib(m):>9} | {mr} | {how}")
            rows.append((name, t, m))
        rows_by_model[key] = rows
    return rows_by_model


if __name__ == "__main__":
    main()
