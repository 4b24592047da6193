"""Plot a gradlens JSON-lines log: the dashboard, and the histograms of one chosen window.

    python examples/plot_from_log.py LOG.jsonl [--step S] [--out DIR]

A log comes from ``Lens(..., log="run.jsonl")`` (or ``gradlens demo``, which writes
``gradlens-demo/log.jsonl``). The log may still be growing: every line is flushed as it is
written, and a half-written last line is skipped with a warning.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gradlens.output.plot import dashboard, hist1d, hist2d
from gradlens.output.sinks import load_log


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="a .jsonl log written by gradlens")
    parser.add_argument("--step", type=int, default=None, help="window to draw (default: the last)")
    parser.add_argument("--out", type=Path, default=Path("."), help="output folder (default: .)")
    args = parser.parse_args()

    records = load_log(args.log)  # list[gradlens.Record], in file order
    print(f"{len(records)} windows, steps {records[0].step}..{records[-1].step}")
    print("keys of the last record:", ", ".join(sorted(records[-1].keys())))

    args.out.mkdir(parents=True, exist_ok=True)
    dashboard(records, path=args.out / "dashboard.png")  # or the path: dashboard(args.log, ...)

    # One window's histograms. Each function draws into a new figure (or into `ax=` of yours)
    # and returns its axes; save through the figure.
    chosen = records[-1] if args.step is None else next(r for r in records if r.step == args.step)
    if "grad_hist_1d" in chosen:
        ax = hist1d(chosen)
        ax.figure.savefig(args.out / f"hist1d-step{chosen.step}.png", dpi=120)
    if "grad_hist_2d" in chosen:
        axes = hist2d(chosen)  # Hist2dAxes(main, param_marginal, grad_marginal, colorbar)
        axes.figure.savefig(args.out / f"hist2d-step{chosen.step}.pdf")

    # Scalars over training, e.g. for your own plot:
    noise = [(r.step, float(r["noise_scale"])) for r in records if "noise_scale" in r]
    if noise:
        print(f"noise scale at the last tracked window: {noise[-1][1]:.3g} samples")
    print(f"figures written to {args.out.resolve()}")


if __name__ == "__main__":
    main()
