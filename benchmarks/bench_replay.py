"""What a planned forward (gradlens/capture/replay.py, docs/design.md "Planned forwards") saves.

Run:  python benchmarks/bench_replay.py [--rounds 41] [--model small|gpt2|both]
(``gpt2`` needs ``transformers``; process CPU time, 1 thread; run from the repository root with
``PYTHONPATH=.`` so that the working tree's gradlens is imported, not an installed one)

Windows of K = 3 micro-batches of 1, 3, 2 samples, BatchL2, each timed as a whole window and as
its three forwards (median over interleaved rounds after warm-up), printed as ratios to the plain
window of the same process:

  * ``general``: every tracked forward under the capture's TorchFunctionMode (``Replay.enabled =
    False``, the default);
  * ``replay``: planned forwards replayed from the site hooks (``Replay.enabled = True``);
  * ``free check``: the same with the replay's check of each site input replaced by the plan's
    own answer (a measuring device, not a mode of gradlens: the bound on what any check, however
    cheap, could gain).

Models: ``small``, a pre-norm transformer written out (d 32, T 12, 2 blocks, 2 heads, loss
outside the model, the one docs/design.md measured); ``gpt2``, Hugging Face GPT-2 of
bench_gpt2.py's d_model 32 (its loss inside the forward, a per-operation use: never planned by
this code, so its ``replay`` row is the general route; commit 40bd712, reverted, planned it, and
docs/benchmarks.md gives what this script measured there). The last line per model says how
many tracked forwards were replayed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

warnings.filterwarnings("ignore")


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = torch.softmax(q @ k.transpose(-2, -1) / (d // self.h) ** 0.5, -1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Small(nn.Module):
    def __init__(self, d: int = 32, vocab: int = 128):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.Sequential(Block(d, 2), Block(d, 2))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x):
        return self.head(self.ln(self.blocks(self.inp(x)))).mean(1)


def rows(which: str, rounds: int) -> None:
    import gradlens
    from gradlens.capture import replay
    from gradlens.instruments import BatchL2

    torch.manual_seed(0)
    if which == "gpt2":
        from bench_gpt2 import gpt2

        base = gpt2(32, 2, 2, 12, 128)
        data = [(ids, None) for ids in (torch.randint(0, 128, (b, 12)) for b in (1, 3, 2))]
    else:
        base = Small()
        data = [(torch.randn(b, 12, 16), torch.randint(0, 128, (b,))) for b in (1, 3, 2)]

    check = replay.Replay.signature
    free = [False]

    def signature(self, x, tap):  # the bound: the plan's own answer for the site it expects
        if free[0] and self.state == "replay" and tap is not None and self.pos < len(self.plan.entries):
            return self.plan.entries[self.pos][1]
        return check(self, x, tap)

    replay.Replay.signature = signature
    times = collections.defaultdict(list)
    clock = time.process_time

    def build(name, tracked, on=False, bound=False):
        model = copy.deepcopy(base)
        loss_fn = nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        lens = None
        if tracked:
            model, loss_fn = gradlens.extend(model), gradlens.extend(loss_fn)
            lens = gradlens.Lens(model, [BatchL2()], optimizer=opt, keep_records=1)

        def step(keep):
            replay.Replay.enabled, free[0] = on, bound
            fwd, t0 = 0.0, clock()
            for x, y in data:
                t = clock()
                loss = model(x, labels=x).loss if y is None else loss_fn(model(x), y)
                fwd += clock() - t
                if lens is not None:
                    with lens.capture():
                        loss.backward()
                else:
                    loss.backward()
            opt.step()
            opt.zero_grad()
            if keep:
                times[name].append(clock() - t0)
                times[name + ", forwards"].append(fwd)

        step.lens = lens
        return step

    steps = [build("plain", False), build("general", True), build("replay", True, True),
             build("free check", True, True, True)]
    try:
        for s in steps:
            for _ in range(3):
                s(False)
        for _ in range(rounds):
            for s in steps:
                s(True)
    finally:
        replay.Replay.signature = check
        replay.Replay.enabled = False
    ref = statistics.median(times["plain"])
    print(f"\n| {which}: BatchL2, ratio to a plain window ({1e3 * ref:.1f} ms) | window | its forwards |")
    print("|---|---|---|")
    for name in ("plain", "general", "replay", "free check"):
        w, f = (statistics.median(times[k]) / ref for k in (name, name + ", forwards"))
        print(f"| {name} | {w:.2f}x | {f:.2f}x |")
    print(f"replayed forwards: {steps[2].lens._tap._replay.replayed} of {3 * (rounds + 3)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--model", choices=("small", "gpt2", "both"), default="both")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import gradlens

    print(f"torch {torch.__version__}, gradlens from {gradlens.__file__}, 1 thread, process CPU time, "
          f"median of {args.rounds} interleaved rounds")
    for which in (("small", "gpt2") if args.model == "both" else (args.model,)):
        rows(which, args.rounds)


if __name__ == "__main__":
    main()
