"""Step-time ratios of gradlens instruments vs a plain training step, beside the tools it replaces.

Run:  python benchmarks/bench_instruments.py [--steps 20] [--models mlp,cnn] [--device cpu|cuda]
      [--rows "(a),(b)"]   (only the rows whose names contain one of these; the plain step always)

For each model it times (median over ``--steps`` interleaved rounds after warm-up) one training step — forward,
backward, SGD update, zero_grad — with nothing attached ("plain"), and with:
  (a) BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale,
  (b) GradHist1d, (c) GradHist2d, (b+c) both, (b') / (c') the same sampling 1% of the elements,
  (a), (b), (b+c) with ``groups="module"`` (per-group statistics next to the totals),
  an untracked window (a Lens whose schedule skips the step),
  BackPACK's BatchL2Grad / SumGradSquared / BatchGrad alone (references),
and cockpit-for-pytorch's GradHist1d, GradHist2d and its "economy" configuration (``pip install -e
.[bench]``). Ratios are to the plain step of the same process.

``--device cuda`` puts the models, the data and every comparison tool on the GPU and synchronises
the device around every timed step. After the timed rounds one more, untimed step of each
configuration measures its peak memory (the header line says how, on this device), printed with
its ratio to the plain step's. A row whose setup or first step fails (a comparison tool not
installed, or not working on the device) prints ``failed: <reason>``; the other rows still run.
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import (
    BatchL2,
    GradHist1d,
    GradHist2d,
    GradNorm,
    NoiseScale,
    NormTest,
    SumGradSquared,
)

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


MODELS = {
    "mlp": ("MLP 784-512-512-10, batch 128", mlp, (1, 28, 28), 128),
    "cnn": ("CNN conv 3-32-64 + pools, linear 4096-10, batch 64", cnn, (3, 32, 32), 64),
}


def plain_step(model, x, y):
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step, lambda: None


def lens_step(instruments, every=1, groups=None):
    def build(model, x, y):
        model = gradlens.extend(model)
        loss_fn = gradlens.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        lens = Lens(model, instruments(), optimizer=opt, every=every, keep_records=False, groups=groups)

        def step():
            loss = loss_fn(model(x), y)
            with lens.capture():
                loss.backward()
            opt.step()
            opt.zero_grad()

        return step, lens.close

    return build


def backpack_step(ext_name):
    def build(model, x, y):
        import backpack
        from backpack import extensions

        model = backpack.extend(model)
        loss_fn = backpack.extend(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ext = getattr(extensions, ext_name)()

        def step():
            loss = loss_fn(model(x), y)
            with backpack.backpack(ext):
                loss.backward()
            opt.step()
            opt.zero_grad()
            for p in model.parameters():
                for f in ("batch_l2", "sum_grad_squared", "grad_batch"):
                    if hasattr(p, f):
                        delattr(p, f)

        return step, lambda: None

    return build


ECONOMY = 'cockpit "economy"'
NORMS = lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]  # noqa: E731


def configs():
    rows = [
        ("gradlens untracked window", lens_step(NORMS, every=lambda s: False)),
        ("gradlens (a) norms: BatchL2+SGS+GradNorm+NormTest+NoiseScale", lens_step(NORMS)),
        ("gradlens (b) GradHist1d", lens_step(lambda: [GradHist1d()])),
        ("gradlens (c) GradHist2d", lens_step(lambda: [GradHist2d()])),
        ("gradlens (b+c) GradHist1d + GradHist2d", lens_step(lambda: [GradHist1d(), GradHist2d()])),
        ("gradlens (a) norms with groups='module'", lens_step(NORMS, groups="module")),
        ("gradlens (b) GradHist1d with groups='module'", lens_step(lambda: [GradHist1d()], groups="module")),
        ("gradlens (b+c) GradHist1d + GradHist2d with groups='module'",
         lens_step(lambda: [GradHist1d(), GradHist2d()], groups="module")),
        ("gradlens (b') GradHist1d sample=1%", lens_step(lambda: [GradHist1d(sample=0.01)])),
        ("gradlens (c') GradHist2d sample=1%", lens_step(lambda: [GradHist2d(sample=0.01)])),
        ("BackPACK BatchL2Grad", backpack_step("BatchL2Grad")),
        ("BackPACK SumGradSquared", backpack_step("SumGradSquared")),
        ("BackPACK BatchGrad", backpack_step("BatchGrad")),
    ]
    # without cockpit these rows print "failed: ModuleNotFoundError ..." (the script goes on)
    rows += [
        ("cockpit GradHist1d", cockpit_step(["GradHist1d"])),
        ("cockpit GradHist2d", cockpit_step(["GradHist2d"])),
        (ECONOMY, cockpit_step("economy")),
    ]
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--models", default="mlp,cnn")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--rows", default="", help="comma-separated substrings: only the rows that contain one")
    args = p.parse_args(argv)
    wanted = [w for w in args.rows.split(",") if w]
    if args.threads:
        torch.set_num_threads(args.threads)
    cockpit = has_cockpit()
    dev = torch.device(args.device)
    sync = device_sync(dev)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if dev.type == 'cuda' else ''}; "
          f"cockpit {'installed' if cockpit else 'not installed (pip install -e .[bench])'}")
    print(memory_note(dev))
    results = {}
    for key in args.models.split(","):
        title, make, shape, batch = MODELS[key]
        torch.manual_seed(0)
        base = make().to(dev)
        x = torch.randn(batch, *shape, device=dev)
        y = torch.randint(0, 10, (batch,), device=dev)

        builds = [("plain step", plain_step)] + [
            (n, b) for n, b in configs() if not wanted or any(w in n for w in wanted)
        ]
        steps, closers, failed = build_all(builds, lambda: (copy.deepcopy(base), x, y), sync)
        if "plain step" in failed:
            raise RuntimeError(f"the plain step failed on {dev}: {failed['plain step']}")
        slow = {n: s for n, s in steps.items() if "cockpit" in n or n == "BackPACK BatchGrad"}
        fast = {n: s for n, s in steps.items() if n not in slow}
        # the plain step runs twice per round (first and in the middle) so that the position in
        # the round (caches left by the previous configuration) does not bias the baseline
        order = list(fast)
        fast = dict([*[(n, fast[n]) for n in order[: len(order) // 2]], ("plain step #2", steps["plain step"]),
                     *[(n, fast[n]) for n in order[len(order) // 2 :]]])
        ms = interleaved_ms(fast, args.steps, sync=sync)
        ms.update(interleaved_ms(slow, max(3, args.steps // 4), warmup=1, sync=sync))
        mem = peak_memory_all(steps, dev)  # after the timing: one more step each, not timed
        for close in closers:
            close()
        ms["plain step"] = plain = (ms["plain step"] + ms.pop("plain step #2")) / 2
        mem_plain = mem["plain step"]
        rows = [(name, ms.get(name, math.nan), mem.get(name, math.nan)) for name, _ in builds]
        results[key] = rows
        print(f"\n## {title}  (plain step {plain:.2f} ms, peak {fmt_mib(mem_plain)} MiB)")
        print(f"| {'configuration':<62} | {'ms/step':>9} | {'x plain':>8} | {'peak MiB':>9} | {'x plain':>8} |")
        print(f"|{'-' * 64}|{'-' * 11}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
        for name, t, m in rows:
            if name in failed:
                print(f"| {name:<62} | failed: {failed[name]}")
                continue
            mr = f"{m / mem_plain:7.2f}x" if mem_plain > 0 and not math.isnan(m) else f"{'n/a':>8}"
            print(f"| {name:<62} | {t:9.2f} | {t / plain:7.2f}x | {fmt_mib(m):>9} | {mr} |")
        by = {n: t for n, t, _ in rows if n not in failed}
        if "gradlens (b) GradHist1d" in by and "gradlens (c) GradHist2d" in by:
            print(f"\nGradHist2d / GradHist1d: {by['gradlens (c) GradHist2d'] / by['gradlens (b) GradHist1d']:.2f}")
        need = ("cockpit GradHist1d", "gradlens (b) GradHist1d", "cockpit GradHist2d", "gradlens (c) GradHist2d",
                ECONOMY, "gradlens (a) norms: BatchL2+SGS+GradNorm+NormTest+NoiseScale")
        if cockpit and all(n in by for n in need):
            norms = by["gradlens (a) norms: BatchL2+SGS+GradNorm+NormTest+NoiseScale"]
            print(
                f"\ngradlens vs cockpit: GradHist1d "
                f"{by['cockpit GradHist1d'] / by['gradlens (b) GradHist1d']:.1f}x faster, GradHist2d "
                f"{by['cockpit GradHist2d'] / by['gradlens (c) GradHist2d']:.1f}x faster; "
                f"norm set vs cockpit economy {by[ECONOMY] / norms:.1f}x faster"
            )
    return results


if __name__ == "__main__":
    main()
