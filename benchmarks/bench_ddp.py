"""Step-time ratios of gradlens under DistributedDataParallel (gloo, CPU processes).

Run:  python benchmarks/bench_ddp.py [--world 2] [--steps 30] [--batch 128] [--threads 1] [--repeats 1]
                                     [--model mlp|cnn] [--block 5]

Every rank trains the 784-512-512-10 MLP (``--model cnn``: the CNN) of bench_instruments.py on
its own batch (``--batch`` samples per rank); one step is forward, backward (DDP all-reduces the gradient), SGD update,
zero_grad. Rows, timed in interleaved rounds of ``--block`` consecutive steps of each configuration
(median of about ``--steps`` steps each; both ranks run the same sequence, rank 0 reports; the
blocks keep a deferred collective charged to its own row), as ratios to the plain DDP step:

  (a) the norm set BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale, merged across
      ranks (one all_reduce of the sums, one all_gather of batch_l2 per step);
  two-batch noise scale: NoiseScaleTwoBatch (rank-local vs global gradients: the sums it needs
      are merged by one all_reduce), with the default merge and with Lens(merge="deferred"),
      whose all_reduce runs in the background during the next step;
  NoiseScaleDDP (no Lens: each rank's ||p.grad||^2 before DDP's all-reduce and its 1/R share of
      the averaged one after it; the numbers of 10 windows travel in one small all_reduce);
  untracked window (a Lens whose schedule skips the step);
  a Lens with no instrument (capture hooks + the window's merge of its counts: the floor under
      every Lens row, a diagnostic added beside the rows above);
and the optimizer route: DDP + GradientAccumulateOptimizer (2 micro-batches per rank, each
all-reduced by DDP) with NoiseScaleMonitor(ranks=R), as a ratio to the same accumulating step
and to that step written in plain torch (no gradlens at all).

CPU only: the ranks are gloo processes on this machine's cores; ``--device`` other than ``cpu``
is refused with a message (the GPU benchmarks are the other scripts' ``--device cuda``).
With ``--repeats n`` the whole interleaved timing runs n times and every column is the median
over the n runs (ratios: the median of the per-run ratios, with their range), which steadies
the ratios on a loaded machine.

Under DDP with equal batch sizes the Lens reads the global gradient sum from DDP's all-reduced
``p.grad`` (see :class:`gradlens.distributed.merge.DDPGradRoute`), so the merge all-reduces only the
other sums (the norm set: ``sum_grad_squared``; the two-batch noise scale: a few scalars).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

warnings.filterwarnings("ignore")


_MODEL_NAMES = {"mlp": "MLP 784-512-512-10", "cnn": "CNN conv 3-32-64 + linear 4096-10"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, args) -> None:
    import gradlens
    from gradlens import Lens
    from gradlens.instruments import (
        BatchL2, GradNorm, NoiseScale, NoiseScaleDDP, NoiseScaleTwoBatch, NormTest, SumGradSquared,
    )

    from _common import cnn, interleaved_ms, mlp

    net = {"mlp": mlp, "cnn": cnn}[args.model]

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        torch.manual_seed(rank)
        x = torch.randn(args.batch, *((1, 28, 28) if args.model == "mlp" else (3, 32, 32)))
        y = torch.randint(0, 10, (args.batch,))

        def build(instruments=None, every=1, merge="sync", noise_ddp=False):
            torch.manual_seed(0)
            model = net()
            if instruments is not None:
                model = gradlens.extend(model)
            ddp = nn.parallel.DistributedDataParallel(model)
            if noise_ddp:
                monitors.append(NoiseScaleDDP(ddp, batch_size=args.batch))
            loss_fn = nn.CrossEntropyLoss()
            if instruments is not None:
                loss_fn = gradlens.extend(loss_fn)
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            lens = None
            if instruments is not None:
                lens = Lens(model, instruments(), optimizer=opt, every=every, keep_records=False, merge=merge)

            def step():
                loss = loss_fn(ddp(x), y)
                if lens is None:
                    loss.backward()
                else:
                    with lens.capture():
                        loss.backward()
                opt.step()
                opt.zero_grad()

            return step

        def build_accum(monitor: bool):
            """DDP + GradientAccumulateOptimizer, 2 micro-batches of batch/2 per rank (each
            micro-step all-reduces, as DDP does without no_sync), optionally NoiseScaleMonitor."""
            from gradlens import GradientAccumulateOptimizer
            from gradlens.instruments import NoiseScaleMonitor

            torch.manual_seed(0)
            ddp = nn.parallel.DistributedDataParallel(net())
            loss_fn = nn.CrossEntropyLoss()
            opt = GradientAccumulateOptimizer(torch.optim.SGD(ddp.parameters(), lr=1e-3), accum_steps=2)
            if monitor:
                NoiseScaleMonitor(opt, ranks=world)
            parts = list(zip(x.chunk(2), y.chunk(2)))

            def step():
                for xb, yb in parts:
                    loss_fn(ddp(xb), yb).backward()
                    opt.step(num_samples=len(xb))
                    opt.zero_grad()

            return step

        def build_accum_torch():
            """The same accumulating DDP step in plain torch: 2 micro-batches of batch/2, each
            all-reduced by DDP, the loss weighted by its share of the batch; no gradlens."""
            torch.manual_seed(0)
            ddp = nn.parallel.DistributedDataParallel(net())
            loss_fn = nn.CrossEntropyLoss()
            opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
            parts = list(zip(x.chunk(2), y.chunk(2)))

            def step():
                for xb, yb in parts:
                    (loss_fn(ddp(xb), yb) * (len(xb) / len(x))).backward()
                opt.step()
                opt.zero_grad()

            return step

        monitors: list = []
        norm_set = lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]  # noqa: E731
        steps = {
            "plain": build(),
            "noise_ddp": build(noise_ddp=True),
            "norm_set": build(norm_set),
            "two_batch": build(lambda: [NoiseScaleTwoBatch()]),
            "two_batch_deferred": build(lambda: [NoiseScaleTwoBatch()], merge="deferred"),
            "untracked": build(norm_set, every=lambda s: False),
            "lens_floor": build(lambda: []),
            "plain_again": build(),
            "accum": build_accum(False),
            "accum_monitor": build_accum(True),
            "accum_again": build_accum(False),
            "accum_torch": build_accum_torch(),
        }
        runs = []
        for rep in range(args.repeats):
            ms = interleaved_ms(steps, max(1, args.steps // args.block), warmup=3 if rep == 0 else 1, block=args.block)
            base = 0.5 * (ms["plain"] + ms["plain_again"])
            acc = 0.5 * (ms["accum"] + ms["accum_again"])
            ratios = {k: ms[k] / base for k in ("norm_set", "two_batch", "two_batch_deferred", "noise_ddp", "untracked", "lens_floor")}
            ratios["accum_monitor"] = ms["accum_monitor"] / acc
            ratios["accum_monitor_torch"] = ms["accum_monitor"] / ms["accum_torch"]
            ratios["accum_plain_torch"] = acc / ms["accum_torch"]
            runs.append((ms, base, acc, ratios))
        monitors[0].flush()  # on every rank (a collective): the windows since the last batch
        if rank == 0:
            med = statistics.median
            ms = {k: med(r[0][k] for r in runs) for k in runs[0][0]}
            base, acc = med(r[1] for r in runs), med(r[2] for r in runs)

            def ratio(key):
                vals = [r[3][key] for r in runs]
                spread = f" (runs {min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else ""
                return f"{med(vals):.2f}x{spread}"

            print(f"DDP {world} gloo processes x {args.threads} thread(s), {_MODEL_NAMES[args.model]}, "
                  f"batch {args.batch} per rank, torch {torch.__version__}; plain step {base:.2f} ms "
                  f"(two plain timings: {ms['plain']:.2f}, {ms['plain_again']:.2f} ms)"
                  + (f"; median of {args.repeats} runs" if args.repeats > 1 else ""))
            print("| configuration | ms | ratio to plain DDP step |")
            print("|---|---|---|")
            for key, label in (
                ("norm_set", "(a) BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale"),
                ("two_batch", "NoiseScaleTwoBatch (rank-local vs global)"),
                ("two_batch_deferred", "same, Lens(merge='deferred') (the collective overlaps the next step)"),
                ("noise_ddp", "NoiseScaleDDP (rank-local vs global, no Lens; one all_reduce per 10 windows)"),
                ("untracked", "untracked window"),
                ("lens_floor", "Lens with no instrument (capture + merge floor)"),
            ):
                print(f"| {label} | {ms[key]:.2f} | {ratio(key)} |")
            print(f"(NoiseScaleDDP recorded {monitors[0].values[-1]['window'] + 1} windows)")
            print()
            print(f"Accumulating DDP step, 2 micro-batches of {args.batch // 2} per rank (each all-reduced):")
            print("| configuration | ms | ratio to the GradientAccumulateOptimizer step | ratio to the plain-torch step |")
            print("|---|---|---|---|")
            print(f"| plain torch (loss weighted by B_k / B, one update) | {ms['accum_torch']:.2f} | | 1.00x |")
            print(f"| DDP + GradientAccumulateOptimizer | {acc:.2f} | 1.00x | {ratio('accum_plain_torch')} |")
            print(f"| same + NoiseScaleMonitor (micro-batch of all ranks vs window) | "
                  f"{ms['accum_monitor']:.2f} | {ratio('accum_monitor')} | {ratio('accum_monitor_torch')} |")
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                        help="mlp: 784-512-512-10; cnn: conv 3-32-64 + linear 4096-10 (bench_instruments.py)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="only 'cpu': this benchmark runs gloo processes on CPU")
    parser.add_argument("--repeats", type=int, default=1, help="timing runs; medians over them")
    parser.add_argument("--block", type=int, default=5,
                        help="consecutive steps of a configuration per interleaved round (keeps a deferred "
                             "collective charged to its own row; see _common.interleaved_ms)")
    args = parser.parse_args()
    if torch.device(args.device).type != "cpu":
        parser.error(f"--device {args.device}: bench_ddp.py is CPU-only (gloo processes on CPU cores, no "
                     "nccl); run it with --device cpu or without --device. The GPU benchmarks are "
                     "bench_instruments.py, bench_dots.py and bench_transformer.py with --device cuda.")
    mp.start_processes(_worker, args=(args.world, _free_port(), args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
