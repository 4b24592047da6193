"""Step-time ratios of gradlens under FSDP2 (``fully_shard``; gloo, CPU processes).

Run:  python benchmarks/bench_fsdp.py [--world 2] [--steps 30] [--batch 128] [--threads 1]
                                      [--model mlp|cnn] [--block 3] [--repeats 1]

The sibling of bench_ddp.py. Every rank trains the MLP 784-512-512-10 (``--model cnn``: the CNN)
of bench_instruments.py, sharded with ``fully_shard`` per Linear / Conv2d layer and at the root,
on its own batch of ``--batch`` samples; one step is forward (FSDP2 all-gathers each layer),
backward (all-gathers again, reduce-scatters the gradient), SGD update, zero_grad. Rows, timed in
interleaved rounds of ``--block`` consecutive steps of each configuration, as ratios to the plain
FSDP2 step:

  (a) the norm set BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale, merged across
      ranks (one all_reduce of the sums, batch_l2 inline, per step; under FSDP2 grad_sum
      travels too: p.grad is sharded);
  NoiseScaleTwoBatch (light capture);
  untracked window (a Lens whose schedule skips the step);
  a Lens with no instrument (the floor under every Lens row);
and, on each rank without FSDP2 (no collective, both ranks timing at once as above), the
single-process ratio of the norm set, which (a) is compared with.
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
    from torch.distributed.fsdp import fully_shard

    import gradlens
    from gradlens import Lens
    from gradlens.instruments import BatchL2, GradNorm, NoiseScale, NoiseScaleTwoBatch, NormTest, SumGradSquared

    from _common import cnn, interleaved_ms, mlp

    net = {"mlp": mlp, "cnn": cnn}[args.model]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    keep = []  # the models, freed before destroy_process_group
    try:
        torch.manual_seed(rank)
        x = torch.randn(args.batch, *((1, 28, 28) if args.model == "mlp" else (3, 32, 32)))
        y = torch.randint(0, 10, (args.batch,))

        def build(instruments=None, every=1, sharded=True):
            torch.manual_seed(0)
            model = net()
            if sharded:
                for m in model:
                    if isinstance(m, (nn.Linear, nn.Conv2d)):
                        fully_shard(m)
                fully_shard(model)
            loss_fn = nn.CrossEntropyLoss()
            lens = None
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            if instruments is not None:
                model, loss_fn = gradlens.extend(model), gradlens.extend(loss_fn)
                lens = Lens(model, instruments(), optimizer=opt, every=every, keep_records=False,
                            process_group=None if sharded else False)
            keep.append((model, opt, lens))

            def step():
                loss = loss_fn(model(x), y)
                if lens is None:
                    loss.backward()
                else:
                    with lens.capture():
                        loss.backward()
                opt.step()
                opt.zero_grad()

            return step

        norm_set = lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]  # noqa: E731
        steps = {
            "plain": build(),
            "norm_set": build(norm_set),
            "two_batch": build(lambda: [NoiseScaleTwoBatch()]),
            "untracked": build(norm_set, every=lambda s: False),
            "lens_floor": build(lambda: []),
            "plain_again": build(),
        }
        local = {"local_plain": build(sharded=False), "local_norm_set": build(norm_set, sharded=False)}
        runs = []
        for rep in range(args.repeats):
            warm = 3 if rep == 0 else 1
            ms = interleaved_ms(steps, max(1, args.steps // args.block), warmup=warm, block=args.block)
            ms.update(interleaved_ms(local, max(1, args.steps // args.block), warmup=warm, block=args.block))
            base = 0.5 * (ms["plain"] + ms["plain_again"])
            ratios = {k: ms[k] / base for k in ("norm_set", "two_batch", "untracked", "lens_floor")}
            ratios["local_norm_set"] = ms["local_norm_set"] / ms["local_plain"]
            runs.append((ms, base, ratios))
        if rank == 0:
            med = statistics.median
            ms = {k: med(r[0][k] for r in runs) for k in runs[0][0]}
            base = med(r[1] for r in runs)

            def ratio(key):
                vals = [r[2][key] for r in runs]
                spread = f" (runs {min(vals):.2f}-{max(vals):.2f})" if len(vals) > 1 else ""
                return f"{med(vals):.2f}x{spread}"

            print(f"FSDP2 {world} gloo processes x {args.threads} thread(s), {_MODEL_NAMES[args.model]}, "
                  f"batch {args.batch} per rank, torch {torch.__version__}; plain FSDP2 step {base:.2f} ms"
                  + (f"; median of {args.repeats} runs" if args.repeats > 1 else ""))
            print("| configuration | ms | ratio to plain FSDP2 step |")
            print("|---|---|---|")
            for key, label in (
                ("norm_set", "(a) BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale"),
                ("two_batch", "NoiseScaleTwoBatch (rank-local vs global)"),
                ("untracked", "untracked window"),
                ("lens_floor", "Lens with no instrument (capture + merge floor)"),
            ):
                print(f"| {label} | {ms[key]:.2f} | {ratio(key)} |")
            print(f"| (a) on each rank without FSDP2 (plain {ms['local_plain']:.2f} ms) | "
                  f"{ms['local_norm_set']:.2f} | {ratio('local_norm_set')} |")
    finally:
        keep.clear()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=1, help="timing runs; medians over them")
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    mp.start_processes(_worker, args=(args.world, _free_port(), args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
