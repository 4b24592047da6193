"""Step-time ratios of the cross-micro-step instruments (BatchDot, Alpha, InnerTest, OrthoTest)
vs a plain training step, exact and sketch mode, beside cockpit-for-pytorch's InnerTest,
OrthoTest and Alpha.

Run:  python benchmarks/bench_dots.py [--steps 15] [--models mlp,cnn] [--k 256] [--device cpu|cuda]

One "step" is one window: K micro-steps (forward, backward) and one SGD update, zero_grad.
"plain" is the same window with nothing attached; every ratio is to the plain window of the
same model in the same process (median over ``--steps`` timed windows after warm-up, timed in
interleaved rounds so that load from other processes affects every row alike).
gradlens rows run with accumulation by hand, like the plain window (MLP: batch 128 as K = 4
micro-steps of 32; CNN: batch 64 as K = 2 micro-steps of 32), and pass per-sample losses to
``lens.capture(losses=...)``.
cockpit cannot accumulate: its rows run the whole batch as one micro-step (K = 1), on plain SGD
(the only optimizer for which its Alpha is right); without cockpit they print ``failed: <reason>``.

``--device cuda`` puts the models, the data and cockpit on the GPU and synchronises the device
around every timed window. After the timed rounds one more, untimed window of each configuration
measures its peak memory (the header line says how), printed with its ratio to the plain
window's. A row whose setup or first window fails prints ``failed: <reason>``; the others run.

Target (issue 4): BatchDot + Alpha + InnerTest + OrthoTest in exact mode <= 3x a plain step on
the MLP at batch 128, K = 4.
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import Alpha, BatchDot, InnerTest, OrthoTest

from _common import (
    build_all,
    cnn,
    cockpit_step,
    device_sync,
    fmt_mib,
    has_cockpit,
    interleaved_ms,
    memory_note,
    mlp,
    peak_memory_all,
)

warnings.filterwarnings("ignore")


# name -> (description, constructor, input shape, batch N, micro-steps K)
MODELS = {
    "mlp": ("MLP 784-512-512-10, batch 128 = 4 x 32", mlp, (1, 28, 28), 128, 4),
    "cnn": ("CNN conv 3-32-64 + pools, linear 4096-10, batch 64 = 2 x 32", cnn, (3, 32, 32), 64, 2),
}


def plain_window(model, x, y, k):
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ys = x.chunk(k), y.chunk(k)

    def step():
        for xb, yb in zip(xs, ys):
            (loss_fn(model(xb), yb) * (len(xb) / len(x))).backward()
        opt.step()
        opt.zero_grad()

    return step, lambda: None


def lens_window(instruments):
    def build(model, x, y, k):
        model = gradlens.extend(model)
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        # hand accumulation as in the plain window (equal micro-batches: the summed micro-batch
        # means are K times the window mean, absorbed in lr), so rows differ only by gradlens
        opt = torch.optim.SGD(model.parameters(), lr=1e-3 / k)
        lens = Lens(model, instruments(), optimizer=opt, keep_records=False)
        xs, ys = x.chunk(k), y.chunk(k)

        def step():
            for xb, yb in zip(xs, ys):
                out = model(xb)
                loss = loss_fn(out, yb)
                with lens.capture(losses=F.cross_entropy(out.detach(), yb, reduction="none")):
                    loss.backward()
            opt.step()
            opt.zero_grad()

        return step, lens.close

    return build


def cockpit_window(names):
    """cockpit cannot accumulate: one step on the whole batch (K = 1) per window."""
    build_step = cockpit_step(names)

    def build(model, x, y, k):
        return build_step(model, x, y)

    return build


def configs(k_sketch: int):
    ALL = (BatchDot, Alpha, InnerTest, OrthoTest)
    rows = [
        ("gradlens BatchDot exact", lens_window(lambda: [BatchDot()])),
        ("gradlens Alpha exact", lens_window(lambda: [Alpha()])),
        ("gradlens InnerTest + OrthoTest exact", lens_window(lambda: [InnerTest(), OrthoTest()])),
        ("gradlens all four exact (target <= 3x on MLP)", lens_window(lambda: [c() for c in ALL])),
        (f"gradlens BatchDot sketch k={k_sketch}", lens_window(lambda: [BatchDot("sketch", k=k_sketch)])),
        (f"gradlens Alpha sketch k={k_sketch}", lens_window(lambda: [Alpha("sketch", k=k_sketch)])),
        (f"gradlens all four sketch k={k_sketch}",
         lens_window(lambda: [c("sketch", k=k_sketch) for c in ALL])),
    ]
    # without cockpit these rows print "failed: ModuleNotFoundError ..." (the script goes on)
    rows += [
        ("cockpit InnerTest (K=1)", cockpit_window(["InnerTest"])),
        ("cockpit OrthoTest (K=1)", cockpit_window(["OrthoTest"])),
        ("cockpit Alpha (K=1, SGD)", cockpit_window(["Alpha"])),
        ("cockpit InnerTest + OrthoTest + Alpha (K=1)",
         cockpit_window(["InnerTest", "OrthoTest", "Alpha"])),
    ]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--k", type=int, default=256, help="sketch dimension")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cockpit = has_cockpit()
    dev = torch.device(args.device)
    sync = device_sync(dev)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}, "
          f"median of {args.steps} windows")
    print(memory_note(dev))
    if not cockpit:
        print("note: cockpit-for-pytorch not importable (pip install -e .[bench]): its rows print failed")
    results = {}
    for name in args.models.split(","):
        desc, make, shape, n, k = MODELS[name]
        torch.manual_seed(0)
        base = make()
        x, y = torch.randn(n, *shape, device=dev), torch.randint(0, 10, (n,), device=dev)

        def fresh():
            m = make()
            m.load_state_dict(base.state_dict())
            return m.to(dev)

        rows = [("plain (K micro-steps + SGD update)", plain_window)] + configs(args.k)
        steps, closers, failed = build_all(rows, lambda: (fresh(), x, y, k), sync)
        if rows[0][0] in failed:
            raise RuntimeError(f"the plain window failed on {dev}: {failed[rows[0][0]]}")
        ms = interleaved_ms(steps, args.steps, sync=sync)
        mem = peak_memory_all(steps, dev)  # after the timing: one more window each, not timed
        for close in closers:
            close()
        plain, mem_plain = ms[rows[0][0]], mem[rows[0][0]]
        print(f"\n{desc}  (plain window {plain:.2f} ms, peak {fmt_mib(mem_plain)} MiB)")
        print(f"{'configuration':<52} {'ms/window':>10} {'x plain':>8} {'peak MiB':>9} {'x plain':>8}")
        for label, _ in rows:
            if label in failed:
                print(f"{label:<52} failed: {failed[label]}")
                continue
            m = mem[label]
            mr = f"{m / mem_plain:>8.2f}" if mem_plain > 0 and not math.isnan(m) else f"{'n/a':>8}"
            print(f"{label:<52} {ms[label]:>10.2f} {ms[label] / plain:>8.2f} {fmt_mib(m):>9} {mr}")
        results[name] = {label: (ms.get(label, math.nan), mem.get(label, math.nan)) for label, _ in rows}
    return results


if __name__ == "__main__":
    main()
