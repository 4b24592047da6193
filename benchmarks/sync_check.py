"""Host-device synchronisations in gradlens' tracked micro-steps, found with CUDA's sync debug mode.

Run:  python benchmarks/sync_check.py [--device cuda] [--windows 3]

For the MLP and the CNN of ``_common`` and each instrument set (GradHist1d; GradHist2d; the norm
set BatchL2 + SumGradSquared + GradNorm + NormTest + NoiseScale), a Lens tracks ``--windows``
windows of K = 3 unequal micro-steps. Each micro-step, its forward and its backward inside
``lens.capture()``, runs under ``torch.cuda.set_sync_debug_mode``; the optimizer step that closes
the window (where one sync is allowed) runs with the mode off. Two passes per configuration:

  warn:  every synchronising call made from Python is recorded with the Python stack that made
         it; the distinct stacks are printed with the micro-steps where they occurred;
  error: the first synchronising call raises; its traceback is printed (this pass also stops at a
         sync made by C++ code with no Python frame, which the warn pass cannot attribute; such
         a call shows in the warn pass only as a line "called a synchronizing CUDA operation" on
         stderr).

Any other error of a configuration (gradlens failing on the device) is printed as ``error:`` with
its traceback. The exit status is 0 when no configuration synchronised or failed, 1 otherwise.
On a device other than CUDA the same loop runs as a smoke test and nothing is checked (the sync
debug mode exists for CUDA only); the exit status is then 0 unless the loop failed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import traceback
import warnings

import torch
from torch import nn

import gradlens
from gradlens import Lens
from gradlens.instruments import BatchL2, GradHist1d, GradHist2d, GradNorm, NoiseScale, NormTest, SumGradSquared

from _common import cnn, mlp

# name -> (constructor, input shape, unequal micro-batch sizes of one window)
MODELS = {
    "mlp": (mlp, (1, 28, 28), (48, 32, 16)),
    "cnn": (cnn, (3, 32, 32), (24, 16, 8)),
}
INSTRUMENTS = {
    "GradHist1d": lambda: [GradHist1d()],
    "GradHist2d": lambda: [GradHist2d()],
    "norm set (BatchL2+SGS+GradNorm+NormTest+NoiseScale)":
        lambda: [BatchL2(), SumGradSquared(), GradNorm(), NormTest(), NoiseScale()],
}
STACK_FRAMES = 14  # innermost frames kept of each recorded stack


class Found(Exception):
    """Raised inside a configuration to stop it after the error pass caught a sync."""


@contextlib.contextmanager
def sync_debug(mode: str, dev: torch.device):
    """``torch.cuda.set_sync_debug_mode(mode)`` inside the block (CUDA only), off again after it."""
    if dev.type != "cuda":
        yield
        return
    torch.cuda.synchronize(dev)  # before the mode: this explicit sync is not what is looked for
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@contextlib.contextmanager
def recording(found: list, where: dict):
    """Record every "synchronizing" warning raised in the block as ``(where, message, stack)``;
    other warnings go to the usual handler."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchroniz" in str(message).lower():
                frames = [f for f in traceback.extract_stack()[:-1] if f.filename != warnings.__file__]
                stack = "".join(traceback.format_list(frames[-STACK_FRAMES:]))
                found.append((where["at"], str(message).strip(), stack))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        yield


def run_config(model_key: str, inst_key: str, mode: str, dev: torch.device, windows: int) -> list:
    """Train ``windows`` tracked windows; returns the findings ``[(where, message, stack)]``."""
    make, shape, sizes = MODELS[model_key]
    torch.manual_seed(0)
    model = gradlens.extend(make().to(dev))
    loss_fn = gradlens.extend(nn.CrossEntropyLoss())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    lens = Lens(model, INSTRUMENTS[inst_key](), optimizer=opt, keep_records=False)
    n = sum(sizes)
    data = [(torch.randn(n, *shape, device=dev).split(list(sizes)),
             torch.randint(0, 10, (n,), device=dev).split(list(sizes))) for _ in range(windows)]
    found, where = [], {"at": ""}
    try:
        for w, (xs, ys) in enumerate(data):
            for k, (xb, yb) in enumerate(zip(xs, ys)):
                where["at"] = f"window {w}, micro-step {k} (B={len(xb)})"
                try:
                    with recording(found, where), sync_debug(mode, dev):
                        loss = loss_fn(model(xb), yb)
                        with lens.capture():
                            loss.backward()
                except RuntimeError as e:
                    if mode == "error" and "synchroniz" in str(e).lower():
                        found.append((where["at"], str(e).strip().splitlines()[0], traceback.format_exc()))
                        raise Found from None
                    raise
            opt.step()  # closes the window: a sync is allowed here
            opt.zero_grad()
    except Found:
        pass
    finally:
        with contextlib.suppress(Exception):
            lens.close(write_pending=False)
    return found


def report(found: list) -> None:
    """Print the findings grouped by stack (distinct call sites), with where each occurred."""
    by_stack: dict = {}
    for at, msg, stack in found:
        by_stack.setdefault((msg, stack), []).append(at)
    for i, ((msg, stack), ats) in enumerate(by_stack.items(), 1):
        more = f" and {len(ats) - 3} more" if len(ats) > 3 else ""
        print(f"    [{i}] {msg}  -- {len(ats)}x: {'; '.join(ats[:3])}{more}")
        print("        " + stack.rstrip().replace("\n", "\n        "))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--windows", type=int, default=3)
    p.add_argument("--models", default="mlp,cnn")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    print(f"torch {torch.__version__}, gradlens {gradlens.__version__}, device {dev}"
          f"{' (' + torch.cuda.get_device_name(dev) + ')' if cuda else ''}; {args.windows} windows of K = 3 "
          "unequal micro-steps per configuration; sync debug mode around each micro-step's forward and "
          "backward (lens.capture), off at the optimizer step that closes the window")
    if not cuda:
        print(f"note: device {dev}: torch.cuda.set_sync_debug_mode checks CUDA only; the loop runs as a smoke "
              "test and finds nothing")
    bad = 0
    for model_key in args.models.split(","):
        for inst_key in INSTRUMENTS:
            print(f"\n## {model_key} / {inst_key}")
            for mode in ("warn", "error") if cuda else ("warn",):
                try:
                    found = run_config(model_key, inst_key, mode, dev, args.windows)
                except Exception:  # noqa: BLE001 - report and go on with the next configuration
                    bad += 1
                    print(f"  {mode} pass: error (not a sync):")
                    print("    " + traceback.format_exc().rstrip().replace("\n", "\n    "))
                    break
                if not found:
                    print(f"  {mode} pass: no sync" + ("" if cuda else " (not checked off CUDA)"))
                    continue
                bad += 1
                print(f"  {mode} pass: {len(found)} synchronising call(s)")
                report(found)
    print(f"\n{'no configuration synchronised or failed' if not bad else f'{bad} finding(s), see above'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
