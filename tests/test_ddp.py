"""DistributedDataParallel (gloo, CPU): 2 ranks x K micro-steps == one process on the full batch."""

from __future__ import annotations

import os
import socket
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.functional import mse_loss

from gradlens import GradientAccumulateModel, GradientAccumulateOptimizer

from test_distributed import _exit_after
from oracle import OPTIMIZERS, assert_params_close, make_data, make_mlp

WORLD = 2
ACCUM = 3
PER_RANK = 7  # split into micro-batches of 3, 2, 2
WINDOWS = 3
OPT = "adamw"
DEADLINE_S = 60.0



def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _window_batch(window: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(WORLD * PER_RANK, seed=100 + window)


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=30),
    )
    try:
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

        # GradientAccumulateModel: no_sync on all but the last micro-step
        ddp = torch.nn.parallel.DistributedDataParallel(make_mlp(0))
        no_sync_calls = []
        original_no_sync = ddp.no_sync

        def counting_no_sync():
            no_sync_calls.append(1)
            return original_no_sync()

        ddp.no_sync = counting_no_sync
        trainer = GradientAccumulateModel(
            ddp, OPTIMIZERS[OPT](list(ddp.parameters())), mse_loss, ACCUM
        )
        losses = []
        for w in range(WINDOWS):
            x, y = _window_batch(w)
            losses.append(trainer.train_step((x[mine], y[mine])))

        # GradientAccumulateOptimizer in a hand-written loop (every micro-step all-reduces)
        ddp2 = torch.nn.parallel.DistributedDataParallel(make_mlp(0))
        opt = GradientAccumulateOptimizer(OPTIMIZERS[OPT](list(ddp2.parameters())), ACCUM)
        for w in range(WINDOWS):
            x, y = _window_batch(w)
            for xs, ys in zip(torch.tensor_split(x[mine], ACCUM), torch.tensor_split(y[mine], ACCUM)):
                mse_loss(ddp2(xs), ys).backward()
                opt.step(num_samples=len(xs))
                opt.zero_grad()

        torch.save(
            {
                "model": ddp.module.state_dict(),
                "model2": ddp2.module.state_dict(),
                "no_sync_calls": len(no_sync_calls),
                "losses": torch.stack(losses),
            },
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_ddp_two_ranks_equal_one_process_full_batch():
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(  # _exit_after: no interpreter teardown (see there)
            _exit_after, args=(_worker, _free_port(), out_dir), nprocs=WORLD, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + DEADLINE_S
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    pytest.fail(f"DDP workers did not finish within {DEADLINE_S} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD)]

    ref = make_mlp(0)
    ref_opt = OPTIMIZERS[OPT](list(ref.parameters()))
    ref_losses = []
    for w in range(WINDOWS):
        x, y = _window_batch(w)
        ref_opt.zero_grad()
        loss = mse_loss(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.detach())

    for result in results:
        assert result["no_sync_calls"] == WINDOWS * (ACCUM - 1)
        for key in ("model", "model2"):
            model = make_mlp(0)
            model.load_state_dict(result[key])
            assert_params_close(model, ref, 1e-10)
    # each rank's window loss is the mean over its own samples; their mean is the global one
    mean_loss = (results[0]["losses"] + results[1]["losses"]) / WORLD
    torch.testing.assert_close(mean_loss, torch.stack(ref_losses), rtol=1e-12, atol=0)
