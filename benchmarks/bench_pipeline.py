"""Step-time ratios of gradlens on a two-stage pipeline (``torch.distributed.pipelining``, gloo,
CPU processes), and the bytes its collectives move.

Run:  python benchmarks/bench_pipeline.py [--steps 30] [--batch 128] [--micro 4]
                                          [--schedule 1f1b|gpipe] [--threads 1] [--block 3]

The MLP 784-512-512-10 of bench_instruments.py split after its first Linear + ReLU (stage 0:
784-512, stage 1: 512-512-10), one rank per stage; one step is ``schedule.step()`` of ``--batch``
samples in ``--micro`` micro-batches, the SGD update and zero_grad of the stage. Rows, timed in
interleaved rounds of ``--block`` consecutive steps, as ratios to the plain pipeline step:

  (a) the norm set BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale, a Lens per
      stage merged across the stages (one all_reduce of the [N] norms and counts, one
      all_gather of each stage's per-parameter sums);
  NoiseScaleTwoBatch;
  untracked window (a Lens whose schedule skips the step);
and the bytes each tracked window's merge moves per rank (the buffers a rank hands to all_reduce and
to the all_gather, counted by wrapping them).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

warnings.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": nn.Linear(784, 512), "1": nn.Linear(512, 512), "2": nn.Linear(512, 10)})

    def forward(self, x):
        x = x.flatten(1) if x.dim() > 2 else x
        for name, layer in self.layers.items():
            x = layer(x)
            if name != "2":
                x = torch.relu(x)
        return x


def _worker(rank: int, world: int, port: int, args) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    import gradlens
    from gradlens import Lens
    from gradlens.instruments import BatchL2, GradNorm, NoiseScale, NoiseScaleTwoBatch, NormTest, SumGradSquared

    from _common import interleaved_ms

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    keep = []
    try:
        torch.manual_seed(0)
        x = torch.randn(args.batch, 784)
        y = torch.randint(0, 10, (args.batch,))
        sched = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[args.schedule]

        def build(instruments=None, every=1):
            torch.manual_seed(0)
            module = _Layers()
            for name in list(module.layers):
                if (name == "0") != (rank == 0):
                    del module.layers[name]
            loss_fn = nn.CrossEntropyLoss()
            if instruments is not None:
                module, loss_fn = gradlens.extend(module), gradlens.extend(loss_fn)
            stage = PipelineStage(module, rank, world, torch.device("cpu"))
            schedule = sched(stage, args.micro, loss_fn=loss_fn)
            opt = torch.optim.SGD(module.parameters(), lr=1e-3)
            lens = None
            if instruments is not None:
                lens = Lens(schedule, instruments(), optimizer=opt, every=every, keep_records=False)
            keep.append((module, stage, schedule, opt, lens))

            def run():
                if rank == 0:
                    schedule.step(x)
                else:
                    schedule.step(target=y)

            def step():
                if lens is None:
                    run()
                else:
                    with lens.capture():
                        run()
                opt.step()
                opt.zero_grad()

            return step

        norm_set = lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]  # noqa: E731
        steps = {
            "plain": build(),
            "norm_set": build(norm_set),
            "two_batch": build(lambda: [NoiseScaleTwoBatch()]),
            "untracked": build(norm_set, every=lambda s: False),
            "plain_again": build(),
        }
        ms = interleaved_ms(steps, max(1, args.steps // args.block), warmup=3, block=args.block)
        # the bytes of one tracked window's merge (the collectives' buffers, this rank)
        moved = {}
        for key in ("norm_set", "two_batch"):
            counts = {"all_reduce": 0, "all_gather": 0}
            names = [n for n in ("all_reduce", "all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
            originals = {name: getattr(dist, name) for name in names}

            def counting(name):
                def call(tensor, *a, **k):  # all_reduce(tensor), all_gather_*(output, input)
                    t = tensor if name == "all_reduce" else a[0]
                    counts["all_reduce" if name == "all_reduce" else "all_gather"] += t.numel() * t.element_size()
                    return originals[name](tensor, *a, **k)

                return call

            for name in names:
                setattr(dist, name, counting(name))
            try:
                steps[key]()
            finally:
                for name, fn in originals.items():
                    setattr(dist, name, fn)
            moved[key] = dict(counts)
        row = torch.tensor([moved[k][n] for k in moved for n in ("all_reduce", "all_gather")], dtype=torch.float64)
        rows = [torch.zeros_like(row) for _ in range(world)]
        dist.all_gather(rows, row)
        if rank == 0:
            base = 0.5 * (ms["plain"] + ms["plain_again"])
            print(f"pipeline ({args.schedule}), {world} gloo processes x {args.threads} thread(s), MLP 784-512 | "
                  f"512-512-10, batch {args.batch} in {args.micro} micro-batches, torch {torch.__version__}; "
                  f"plain pipeline step {base:.2f} ms")
            print("| configuration | ms | ratio to plain step | bytes per tracked window, stage 0 / stage 1 |")
            print("|---|---|---|---|")
            for i, (key, label) in enumerate((
                ("norm_set", "(a) BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale"),
                ("two_batch", "NoiseScaleTwoBatch"),
                ("untracked", "untracked window"),
            )):
                if key in moved:
                    b = [f"all_reduce {int(r[2 * i])} + all_gather {int(r[2 * i + 1])}" for r in rows]
                    sent = " / ".join(b)
                else:
                    sent = "0 (no collective)"
                print(f"| {label} | {ms[key]:.2f} | {ms[key] / base:.2f}x | {sent} |")
    finally:
        keep.clear()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--block", type=int, default=3)
    args = parser.parse_args()
    mp.start_processes(_worker, args=(2, _free_port(), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
