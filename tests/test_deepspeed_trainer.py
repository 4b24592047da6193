"""The Hugging Face Trainer with a DeepSpeed config (ZeRO stages 2 and 3, 2 gloo ranks on the
CPU, a float64 model) and :class:`~gradlens.integrations.transformers.LensTrainerCallback`: one
record per update, N over both ranks, ``grad_norm`` equal to the Trainer's own logged value
(DeepSpeed's global gradient norm), for a model whose loss is a per-micro-batch mean (the Trainer
divides it by K) and for a transformers model whose loss the Trainer normalises over the
window's label tokens. The update happens inside ``accelerator.backward`` (DeepSpeed steps the
engine there): the capture of the window's last micro-step ends first.

Marked ``frameworks`` and ``deepspeed``: runs in the frameworks environment with DeepSpeed
installed (``pip install 'gradlens[deepspeed]'``; .ci/run), never skipped when selected.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_deepspeed import _deepspeed_ready  # noqa: F401 - the module fixture: DeepSpeed, its extension
from test_distributed import _free_port

pytestmark = [pytest.mark.frameworks, pytest.mark.deepspeed]

K, B, STEPS, WORLD = 2, 3, 2, 2
DEADLINE_S = 240.0


class TokenClassifier(nn.Module):
    """Embedding -> mean over T -> Linear, float64; integer inputs (the Trainer casts float
    inputs to DeepSpeed's dtype, never token ids); ``forward(input_ids, labels)`` returns the
    mean cross-entropy of the micro-batch."""

    def __init__(self, vocab: int = 11, d: int = 6, classes: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.head = nn.Linear(d, classes)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.emb(input_ids).mean(1))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "classifier":
        return TokenClassifier().double()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg).double()


def _dataset(kind: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    n = WORLD * K * B * STEPS
    if kind == "classifier":
        x = torch.randint(0, 11, (n, 5), generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        return [{"input_ids": x[i], "labels": y[i]} for i in range(n)]
    x = torch.randint(0, 32, (n, 7), generator=g)
    labels = x.clone()
    labels[torch.rand(n, 7, generator=g) < 0.3] = -100  # unequal label tokens per sequence
    return [{"input_ids": x[i], "labels": labels[i]} for i in range(n)]


def _worker(rank: int, world: int, port: int, out_dir: str, stage: int, kind: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    from test_deepspeed import float64_zero3
    from transformers import Trainer, TrainingArguments

    float64_zero3()

    from gradlens.instruments import BatchL2, GradNorm, SumGradSquared
    from gradlens.integrations.transformers import LensTrainerCallback

    config = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, f"run{rank}"), per_device_train_batch_size=B,
        gradient_accumulation_steps=K, max_steps=STEPS, learning_rate=0.05, logging_steps=1, report_to=[],
        save_strategy="no", deepspeed=config, disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )
    trainer = Trainer(model=_model(kind), args=args, train_dataset=_dataset(kind))
    cb = LensTrainerCallback(trainer, [BatchL2(), SumGradSquared(), GradNorm()])
    trainer.train()
    records = [(r.step, r.num_samples, r.micro_steps, float(r["grad_norm"]), r.meta.get("units"))
               for r in cb.records]
    norms = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    torch.save({"records": records, "grad_norm": norms, "window_normalised": cb._units == "window"},
               os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _spawn(stage: int, kind: str, out_dir: str) -> None:
    import time

    import torch.multiprocessing as mp
    from test_distributed import _exit_after

    ctx = mp.start_processes(_exit_after, args=(_worker, WORLD, _free_port(), out_dir, stage, kind), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"the Trainer's workers did not finish within {DEADLINE_S} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


@pytest.mark.parametrize("kind", ["classifier", "gpt2"])
@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_with_deepspeed_one_record_per_update_n_over_ranks_trainer_grad_norm(stage, kind):
    with tempfile.TemporaryDirectory() as out_dir:
        _spawn(stage, kind, out_dir)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for res in results:
        records, norms = res["records"], res["grad_norm"]
        assert res["window_normalised"] == (kind == "gpt2")  # the Trainer's two normalisations
        assert [r[0] for r in records] == list(range(STEPS))  # one record per update
        for step, n, micro_steps, grad_norm, units in records:
            assert n == WORLD * K * B  # the samples of both ranks
            assert micro_steps == WORLD * K
            assert grad_norm == pytest.approx(norms[step + 1], rel=1e-4), (step, grad_norm, norms)
            assert (units is not None and "window" in units) == (kind == "gpt2")
    assert results[0]["records"] == results[1]["records"]
