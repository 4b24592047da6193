"""Step time and collective bytes of gradlens under tensor parallelism (gloo, CPU processes).

Run:  python benchmarks/bench_tp.py [--layout tp|dp_tp|both] [--steps 20] [--batch 64] [--d 256]
                                    [--threads 1]

Layouts: ``tp`` (2 ranks: ``parallelize_module`` with ``up`` column-wise and ``down`` row-wise)
and ``dp_tp`` (4 ranks: the same inside ``fully_shard`` over the data dim of a 2 x 2 mesh). The
model is LayerNorm(d) -> Linear(d, 4d) -> tanh -> Linear(4d, d) (residual) -> Linear(d, 10), its
LayerNorm and head replicated; one step is forward, backward, SGD update, zero_grad, on
``--batch`` samples per data rank. Rows (median step time over ``--steps`` steps after 3 warm-up
steps, rank 0 reports, as a ratio to the plain step):

  tracked window: the norm set BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale (the
      TP fold: one all_reduce over the TP group; dp_tp: then one all_reduce over the data ranks);
  untracked window: a Lens whose schedule skips the step (no collective);

and, for the tracked window, every ``torch.distributed`` collective the Lens issues at the update
(FSDP2's and TP's own run in forward and backward and are not counted), with its bytes.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

warnings.filterwarnings("ignore")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        return self.head(x + self.down(torch.tanh(self.up(self.norm(x)))))


def _build(layout: str, d: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = Block(d)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    if layout == "tp":
        parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
        return model, 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank()


class _Count:
    """Wraps torch.distributed's all_reduce / all_gather_into_tensor while ``on``: (name, bytes)."""

    def __init__(self):
        self.on, self.seen = False, []
        for name in ("all_reduce", "all_gather_into_tensor"):
            orig = getattr(dist, name)

            def wrapped(*args, _orig=orig, _name=name, **kwargs):
                if self.on:
                    t = args[0] if args else kwargs.get("tensor", kwargs.get("output_tensor"))
                    self.seen.append((_name, t.numel() * t.element_size()))
                return _orig(*args, **kwargs)

            setattr(dist, name, wrapped)


def _worker(rank: int, world: int, port: int, layout: str, args) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    count = _Count()
    import gradlens
    from gradlens import Lens
    from gradlens.instruments import BatchL2, GradNorm, NoiseScale, NormTest, SumGradSquared

    model, dp = _build(layout, args.d)
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + dp)
    x = torch.randn(args.batch, args.d, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step():
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def timed(lens=None):
        times = []
        for i in range(args.steps + 3):
            dist.barrier()
            t0 = time.perf_counter()
            if lens is None:
                step()
            else:
                loss = loss_fn(model(x), y)
                with lens.capture():
                    loss.backward()
                count.on = i == 3
                opt.step()
                count.on = False
                opt.zero_grad()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    rows = {"plain": timed()}
    norm_set = [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()]
    lens = Lens(model, norm_set, optimizer=opt)
    rows["tracked window (norm set)"] = timed(lens)
    lens.close()
    seen = list(count.seen)
    lens = Lens(model, [GradNorm()], optimizer=opt, every=10 ** 6)
    lens.flush()  # window 0 (tracked) closed: the timed steps are untracked
    rows["untracked window"] = timed(lens)
    lens.close()
    if rank == 0:
        print(f"\n{layout}: {world} ranks, batch {args.batch} per data rank, d={args.d} "
              f"({sum(p.numel() for p in model.parameters())} parameters)")
        base = rows["plain"]
        for name, t in rows.items():
            print(f"  {name:28s} {1e3 * t:8.2f} ms  x{t / base:.2f}")
        for name, nbytes in seen:
            print(f"  collective at the update: {name} of {nbytes} bytes")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=["tp", "dp_tp", "both"], default="both")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    for layout in (["tp", "dp_tp"] if args.layout == "both" else [args.layout]):
        world = 2 if layout == "tp" else 4
        mp.start_processes(_worker, args=(world, _free_port(), layout, args), nprocs=world, start_method="spawn")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
