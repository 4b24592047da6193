"""The ``gradlens`` command line: ``gradlens demo`` and ``gradlens plot``.

``gradlens demo`` trains a small CNN on scikit-learn's bundled 8x8 handwritten digits (no
download) with gradient accumulation and the gradlens instruments attached, and writes the
JSON-lines log, the dashboard and the latest window's histograms. ``gradlens plot LOG.jsonl``
draws the dashboard of a saved log; ``gradlens plot LOG.jsonl --layerwise batch_l2`` one row per
parameter group over the steps.

Errors a user can cause (bad arguments, a missing or corrupt log, a missing optional package)
are reported as one line on stderr with a non-zero exit status (2 for usage errors, 1 for the
rest); ``--traceback`` (before the command) shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "build_demo_model", "train_demo", "write_demo_outputs"]

DEMO_FILES = {
    "log": "log.jsonl",
    "dashboard": "dashboard.png",
    "hist1d": "hist1d.png",
    "hist2d": "hist2d.png",
}


class CliError(Exception):
    """An error reported to the user as one line (exit status 1)."""


class _UsageError(Exception):
    """A command-line usage error (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors become one line instead of usage + message."""

    def error(self, message: str):  # type: ignore[override]
        raise _UsageError(f"{self.prog}: error: {message} (see '{self.prog} --help')")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="gradlens",
        description="Per-sample gradient statistics for PyTorch training: a demo run, and "
        "plots of saved logs.",
    )
    parser.add_argument(
        "--traceback", action="store_true",
        help="show the full Python traceback on errors instead of one line",
    )
    from gradlens import __version__

    parser.add_argument("--version", action="version", version=f"gradlens {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a small CNN on the scikit-learn digits and plot its gradient statistics",
        description="Train a small CNN (input AccumBatchNorm, two conv layers, two linear "
        "layers) on scikit-learn's bundled 8x8 handwritten digits with gradient accumulation "
        "and the gradlens instruments attached; write the JSON-lines log, the dashboard and the "
        "latest window's 1D/2D histograms as PNG files. Needs scikit-learn.",
    )
    demo.add_argument(
        "--out", type=Path, default=Path("gradlens-demo"), metavar="DIR",
        help="output folder (default: ./gradlens-demo)",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=150, metavar="N",
        help="optimizer updates (windows) to train (default: 150)",
    )
    demo.add_argument(
        "--accum-steps", type=_positive_int, default=4, metavar="K",
        help="micro-batches accumulated per optimizer update (default: 4)",
    )
    demo.add_argument(
        "--micro-batch", type=_positive_int, default=32, metavar="B",
        help="samples per micro-batch (default: 32)",
    )
    demo.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default: cpu")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.set_defaults(run=_cmd_demo)

    plot = commands.add_parser(
        "plot",
        help="draw the dashboard (or a layerwise heatmap) of a saved JSON-lines log",
        description="Draw the dashboard (what the log tracked: loss, gradient norm, noise scale, "
        "norm test, alpha, mean GSNR, ..., latest histograms and their evolution, the layerwise "
        "panel when the records have groups) of a log written by gradlens, or with --layerwise "
        "KEY one row per parameter group over the steps.",
    )
    plot.add_argument("log", type=Path, metavar="LOG.jsonl", help="the log to plot")
    plot.add_argument(
        "-o", "--output", type=Path, default=None, metavar="OUT.png",
        help="where to save the figure, .png or .pdf (default: LOG-dashboard.png, or "
        "LOG-layerwise-KEY.png with --layerwise, next to the log)",
    )
    plot.add_argument(
        "--layerwise", default=None, metavar="KEY",
        help="draw the layerwise heatmap of record.groups[...][KEY] (one row per parameter group "
        "over the steps, e.g. batch_l2, grad_norm, mean_gsnr) instead of the dashboard; the log "
        "needs groups (Lens(..., groups='module'))",
    )
    plot.set_defaults(run=_cmd_plot)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradlens`` command line with ``argv`` (default ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 1 on an error, 2 on a usage error, 130 if interrupted.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help / --version
        return exit_.code if isinstance(exit_.code, int) else 0
    prog = f"gradlens {args.command}"
    try:
        args.run(args)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2
    except (CliError, OSError, ValueError, TypeError, ImportError) as err:
        if args.traceback:
            raise
        message = str(err) or type(err).__name__
        print(f"{prog}: error: {' '.join(message.split())}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------- plot


def _cmd_plot(args: argparse.Namespace) -> None:
    from gradlens.output.plot import SAVE_SUFFIXES

    output, key = args.output, args.layerwise
    what = "dashboard" if key is None else "layerwise figure"
    if output is None:
        tail = "dashboard" if key is None else f"layerwise-{key}"
        output = args.log.with_name(f"{args.log.stem}-{tail}.png")
    if output.suffix.lower() not in SAVE_SUFFIXES:
        raise _UsageError(
            f"gradlens plot: error: -o {str(output)!r}: the {what} can be saved as {' or '.join(SAVE_SUFFIXES)}; "
            "give a file name ending in one of them"
        )
    records = _load_log_reporting_warnings(args.log, "gradlens plot")
    if not records:
        raise CliError(f"{str(args.log)!r} holds no records; nothing to plot")
    from gradlens.output.plot import dashboard, layerwise

    if key is None:
        dashboard(records, path=output)
    else:
        layerwise(records, key, path=output)
    print(f"{what} of {len(records)} windows written to {output}")


def _load_log_reporting_warnings(path: Path, prog: str) -> list:
    from gradlens.output.sinks import load_log

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records = load_log(path)
    for w in caught:
        print(f"{prog}: warning: {w.message}", file=sys.stderr)
    return records


# --------------------------------------------------------------------------- demo


def _cmd_demo(args: argparse.Namespace) -> None:
    try:
        import sklearn.datasets  # noqa: F401
    except ImportError:
        raise CliError(
            "the demo needs scikit-learn: pip install scikit-learn (or pip install gradlens[demo])"
        ) from None
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available; use --device cpu")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {str(out)!r} is a file; give a folder")
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    records = train_demo(
        out / DEMO_FILES["log"],
        steps=args.steps,
        accum_steps=args.accum_steps,
        micro_batch=args.micro_batch,
        device=args.device,
        seed=args.seed,
        progress=not args.no_progress,
    )
    written = write_demo_outputs(records, out)
    print(f"trained {args.steps} updates in {time.perf_counter() - start:.1f} s; files in {out}:")
    for path in written:
        print(f"  {path}")


def _digits(device: str):
    """The 1797 scikit-learn digits as ``x [1797, 1, 8, 8]`` float32 in [0, 1] and ``y [1797]``."""
    import torch
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    return x.to(device), y.to(device)


def build_demo_model(accum_steps: int):
    """The demo CNN for ``[B, 1, 8, 8]`` digits -> ``[B, 10]`` logits.

    The batch normalisation is the *first* layer (an input standardisation without affine
    parameters), converted to an accumulation-aware ``AccumBatchNorm2d``. In training mode
    BatchNorm mixes the samples of a micro-batch, so the per-sample gradient of any parameter
    *before* it is not defined; placed first, every parameter comes after it, and sample n's
    loss depends on those parameters through sample n alone (the batch statistics are
    constants for them), so every tracked per-sample gradient is well-defined.
    """
    from torch import nn

    from gradlens import convert_accum_batchnorm

    model = nn.Sequential(
        nn.BatchNorm2d(1, affine=False),  # input standardisation, see the docstring
        nn.Conv2d(1, 8, kernel_size=3, padding=1),  # [8, 8, 8]
        nn.ReLU(),
        nn.MaxPool2d(2),  # [8, 4, 4]
        nn.Conv2d(8, 16, kernel_size=3, padding=1),  # [16, 4, 4]
        nn.ReLU(),
        nn.MaxPool2d(2),  # [16, 2, 2]
        nn.Flatten(),  # [64]
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
    )
    converted = convert_accum_batchnorm(model, accum_steps)
    return model if converted is None else converted


def train_demo(
    log_path: Path,
    *,
    steps: int,
    accum_steps: int,
    micro_batch: int = 32,
    device: str = "cpu",
    seed: int = 0,
    progress: bool = True,
) -> list:
    """Train the demo CNN for ``steps`` optimizer updates of ``accum_steps`` micro-batches each.

    Micro-batches of ``micro_batch`` samples are drawn from a reshuffled pass over the digits;
    the last micro-batch of a pass is smaller (1797 is not a multiple), so windows have unequal
    micro-batches, which gradlens handles exactly. The instruments' records are streamed to
    ``log_path`` and returned.
    """
    import torch
    from torch import nn
    from tqdm.auto import tqdm

    import gradlens
    from gradlens import instruments as ins

    torch.manual_seed(seed)
    x, y = _digits(device)
    model = build_demo_model(accum_steps).to(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = gradlens.GradientAccumulateOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), accum_steps=accum_steps
    )

    # The only BatchNorm is the parameter-free input layer (see build_demo_model), so nothing
    # needs `exclude=`; the Lens reads the loss value and reduction from the extended loss_fn.
    model = gradlens.extend(model)
    loss_fn = gradlens.extend(loss_fn)
    lens = gradlens.Lens(
        model,
        [
            ins.GradNorm(),
            ins.BatchL2(),
            ins.SumGradSquared(),
            ins.GradHist1d(bins=64, range=(-1.0, 1.0), adapt="abs_max"),
            ins.GradHist2d(bins=(40, 50), range=((-1.0, 1.0), (-2.0, 2.0)), adapt="abs_max"),
            ins.NormTest(),
            ins.MeanGSNR(),
            ins.NoiseScale(),
            ins.Alpha(),
            ins.InnerTest(),
            ins.OrthoTest(),
        ],
        optimizer=optimizer,
        every=1,
        log=log_path,
        log_mode="overwrite",  # a new demo run replaces the old demo log
    )

    generator = torch.Generator().manual_seed(seed)
    order = torch.empty(0, dtype=torch.long)
    bar = tqdm(total=steps, desc="gradlens demo", unit="update", disable=not progress)
    updates, window_loss, window_samples = 0, 0.0, 0
    try:
        model.train()
        while updates < steps:
            if order.numel() == 0:  # a new pass over the data
                order = torch.randperm(len(x), generator=generator)
            idx, order = order[:micro_batch], order[micro_batch:]
            xb, yb = x[idx.to(device)], y[idx.to(device)]
            out = model(xb)
            loss = loss_fn(out, yb)
            # capture this micro-step's backward (with the per-sample losses Alpha fits); the
            # optimizer's real update (every accum_steps-th step call) closes the window
            with lens.capture(losses=nn.functional.cross_entropy(out.detach(), yb, reduction="none")):
                loss.backward()
            optimizer.step(num_samples=len(idx))
            optimizer.zero_grad()
            window_loss += float(loss.detach()) * len(idx)
            window_samples += len(idx)
            if optimizer.has_updated:
                updates += 1
                postfix = {"loss": f"{window_loss / window_samples:.3f}"}
                noise = lens.records[-1].get("noise_scale") if lens.records else None
                if noise is not None:
                    postfix["noise scale"] = f"{float(noise):.3g}"
                bar.set_postfix(postfix, refresh=False)
                bar.update(1)
                window_loss, window_samples = 0.0, 0
    finally:
        bar.close()
        lens.close()
    return list(lens.records)


def write_demo_outputs(records: Sequence[Any], out: Path) -> list[Path]:
    """Write the dashboard and the latest window's 1D/2D histogram PNGs into ``out``.

    Returns the paths written, the log (written during training) first when it exists.
    """
    from gradlens.output.plot import dashboard, hist1d, hist2d
    from gradlens.core.records import Hist1d, Hist2d

    out = Path(out)
    written = [out / DEMO_FILES["log"]] if (out / DEMO_FILES["log"]).exists() else []
    if not records:
        raise CliError("the demo produced no records; nothing to plot")
    dashboard(records, path=out / DEMO_FILES["dashboard"])
    written.append(out / DEMO_FILES["dashboard"])
    last1 = next((r for r in reversed(records) if isinstance(r.get("grad_hist_1d"), Hist1d)), None)
    if last1 is not None:
        hist1d(last1).figure.savefig(out / DEMO_FILES["hist1d"], dpi=100)
        written.append(out / DEMO_FILES["hist1d"])
    last2 = next((r for r in reversed(records) if isinstance(r.get("grad_hist_2d"), Hist2d)), None)
    if last2 is not None:
        hist2d(last2).figure.savefig(out / DEMO_FILES["hist2d"], dpi=100)
        written.append(out / DEMO_FILES["hist2d"])
    return written
