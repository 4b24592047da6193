"""The ``gradlens`` command line: ``plot`` on logs, one-line errors, and the (guarded) demo."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradlens.cli import main, write_demo_outputs
from gradlens.core.records import Hist1d, Hist2d, Record
from gradlens.output.sinks import JsonlSink, load_log

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_records(n: int = 6) -> list[Record]:
    gen = torch.Generator().manual_seed(1)
    records = []
    for s in range(n):
        g = torch.randn(500, generator=gen, dtype=torch.float64) * (0.5 / (s + 1))
        p = torch.randn(500, generator=gen, dtype=torch.float64) * 0.3
        edges = torch.linspace(-1, 1, 33, dtype=torch.float64)
        idx = ((g + 1) * 16).floor().clamp(0, 31).long()
        h1 = Hist1d(torch.bincount(idx, minlength=32), edges, int((g < -1).sum()), int((g >= 1).sum()))
        pi = ((p + 1) * 5).floor().clamp(0, 9).long()
        h2 = Hist2d(
            torch.bincount(pi * 32 + idx, minlength=320).reshape(10, 32),
            torch.linspace(-1, 1, 11, dtype=torch.float64), edges, 0, h1.clamped_low + h1.clamped_high,
        )
        values = {"loss": 2.0 * math.exp(-s / 3), "grad_norm": 1.0 / (s + 1), "noise_scale": 20.0 + s,
                  "grad_hist_1d": h1, "grad_hist_2d": h2}
        records.append(Record(step=s, num_samples=64, micro_steps=2, values=values))
    return records


@pytest.fixture
def log(tmp_path) -> Path:
    path = tmp_path / "run.jsonl"
    with JsonlSink(path) as sink:
        for r in make_records():
            sink.write(r)
    return path


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert "Traceback" not in text
    return lines[0]


# --------------------------------------------------------------------------- plot


def test_plot_writes_the_dashboard(log, tmp_path, capsys):
    out = tmp_path / "figs" / "dash.png"
    assert main(["plot", str(log), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    captured = capsys.readouterr()
    assert "6 windows" in captured.out and str(out) in captured.out
    assert captured.err == ""


def _grouped_log(tmp_path) -> Path:
    path = tmp_path / "groups.jsonl"
    gen = torch.Generator().manual_seed(2)
    with JsonlSink(path) as sink:
        for r in make_records():
            r.groups = {f"layer{i}": {"batch_l2": torch.rand(8, generator=gen, dtype=torch.float64) * (i + 1),
                                      "grad_norm": float(i + 1) / (r.step + 1)} for i in range(5)}
            sink.write(r)
    return path


def test_plot_layerwise_writes_the_heatmap(tmp_path, capsys):
    log = _grouped_log(tmp_path)
    out = tmp_path / "layers.png"
    assert main(["plot", str(log), "--layerwise", "batch_l2", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC
    assert capsys.readouterr().out.strip() == f"layerwise figure of 6 windows written to {out}"
    assert main(["plot", str(log), "--layerwise", "grad_norm"]) == 0
    assert (tmp_path / "groups-layerwise-grad_norm.png").read_bytes()[:8] == PNG_MAGIC
    # the dashboard of a log with groups draws its layerwise panel too
    assert main(["plot", str(log), "-o", str(tmp_path / "dash.png")]) == 0
    assert (tmp_path / "dash.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_layerwise_errors_give_one_line(log, tmp_path, capsys):
    capsys.readouterr()
    assert main(["plot", str(log), "--layerwise", "batch_l2", "-o", str(tmp_path / "l.png")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("gradlens plot: error: layerwise: no record has groups")
    grouped = _grouped_log(tmp_path)
    assert main(["plot", str(grouped), "--layerwise", "alpha", "-o", str(tmp_path / "l.png")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "no group of any record has 'alpha'" in line and "key='batch_l2'" in line
    assert main(["plot", str(grouped), "--layerwise", "batch_l2", "-o", str(tmp_path / "l.svg")]) == 2
    assert "the layerwise figure can be saved as .png or .pdf" in _one_line(capsys.readouterr().err)
    assert not (tmp_path / "l.png").exists()


def test_plot_default_output_next_to_the_log(log, capsys):
    assert main(["plot", str(log)]) == 0
    assert (log.parent / "run-dashboard.png").read_bytes()[:8] == PNG_MAGIC


def test_plot_truncated_log_warns_in_one_line_and_plots(log, tmp_path, capsys):
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 40])  # killed while writing the last record
    out = tmp_path / "dash.png"
    assert main(["plot", str(log), "-o", str(out)]) == 0
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("gradlens plot: warning:") and "line 6" in line and "run.jsonl" in line
    assert out.exists()


@pytest.mark.parametrize(
    ("argv", "status", "pattern"),
    [
        ([], 2, "gradlens: error: the following arguments are required: COMMAND"),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
        (["plot"], 2, "gradlens plot: error: the following arguments are required: LOG.jsonl"),
        (["plot", "LOG", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (["demo", "--steps", "0"], 2, "--steps: expected a positive integer, got 0"),
        (["demo", "--accum-steps", "two"], 2, "--accum-steps: expected a positive integer, got 'two'"),
        (["demo", "--device", "tpu"], 2, "invalid choice: 'tpu'"),
    ],
)
def test_bad_arguments_give_one_line(argv, status, pattern, capsys):
    assert main(argv) == status
    line = _one_line(capsys.readouterr().err)
    assert pattern in line and "--help" in line


def test_plot_errors_give_one_line(log, tmp_path, capsys):
    missing = tmp_path / "missing.jsonl"
    assert main(["plot", str(missing)]) == 1
    assert "gradlens log not found" in _one_line(capsys.readouterr().err)

    assert main(["plot", str(log), "-o", str(tmp_path / "dash.svg")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "dash.svg" in line and ".png or .pdf" in line
    assert not (tmp_path / "dash.svg").exists()

    lines = log.read_bytes().splitlines(keepends=True)
    corrupt = tmp_path / "corrupt.jsonl"
    corrupt.write_bytes(b'{"step": \n')
    assert main(["plot", str(corrupt)]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "corrupt.jsonl' line 1 is corrupt" in line
    corrupt.write_bytes(lines[0] + b'{"step": \n' + lines[1])  # a damaged middle line: warn, plot
    assert main(["plot", str(corrupt), "-o", str(tmp_path / "d.png")]) == 0
    line = _one_line(capsys.readouterr().err)
    assert "gradlens plot: warning:" in line and "line 2 (invalid JSON" in line

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["plot", str(empty)]) == 1
    assert "holds no records" in _one_line(capsys.readouterr().err)

    assert main(["plot", str(tmp_path)]) == 1  # a folder
    assert "is a folder" in _one_line(capsys.readouterr().err)


def test_traceback_flag_reraises(tmp_path):
    with pytest.raises(FileNotFoundError):
        main(["--traceback", "plot", str(tmp_path / "missing.jsonl")])


def test_help_everywhere(capsys):
    for argv in (["--help"], ["plot", "--help"], ["demo", "--help"]):
        assert main(argv) == 0
        assert "usage: gradlens" in capsys.readouterr().out


def _run_module(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "gradlens", *args], capture_output=True, text=True, cwd=REPO,
        env=env, timeout=120,
    )


def test_python_m_gradlens_plot_and_error(log, tmp_path):
    out = tmp_path / "dash.png"
    done = _run_module("plot", str(log), "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    failed = _run_module("plot", str(tmp_path / "nope.jsonl"))
    assert failed.returncode == 1
    assert failed.stdout == ""
    assert _one_line(failed.stderr).startswith("gradlens plot: error: gradlens log not found")


# --------------------------------------------------------------------------- demo


def test_demo_without_scikit_learn_says_how_to_install(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 1
    line = _one_line(capsys.readouterr().err)
    assert "pip install scikit-learn" in line and "gradlens[demo]" in line


def test_demo_outputs_from_records(tmp_path):
    written = write_demo_outputs(make_records(), tmp_path)
    assert [p.name for p in written] == ["dashboard.png", "hist1d.png", "hist2d.png"]
    for p in written:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_demo_end_to_end(tmp_path, capsys):
    import sklearn  # noqa: F401  (the demo's data: a test dependency, never skipped)

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--steps", "3", "--accum-steps", "2", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed
    for name in ("log.jsonl", "dashboard.png", "hist1d.png", "hist2d.png"):
        assert (out / name).exists(), name
    records = load_log(out / "log.jsonl")
    assert len(records) == 3
    assert all(r.micro_steps == 2 and r.num_samples == 64 for r in records)
    assert {"grad_norm", "grad_hist_1d", "grad_hist_2d", "noise_scale"} <= set(records[-1].keys())
