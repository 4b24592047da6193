"""JsonlSink, load_log and TensorBoardSink: round trips, streaming, truncated and corrupt logs."""

from __future__ import annotations

import json
import math
import warnings
import sys

import pytest
import torch

from gradlens.core.records import Hist1d, Hist2d, Record
from gradlens.output.sinks import JsonlSink, TensorBoardSink, load_log


def _hist1d(x: torch.Tensor, bins: int = 16, lo: float = -1.0, hi: float = 1.0) -> Hist1d:
    edges = torch.linspace(lo, hi, bins + 1, dtype=torch.float64)
    idx = ((x - lo) * bins / (hi - lo)).floor().clamp(0, bins - 1).long()
    return Hist1d(torch.bincount(idx, minlength=bins), edges, int((x < lo).sum()), int((x >= hi).sum()))


def _hist2d(p: torch.Tensor, g: torch.Tensor, bins=(6, 8)) -> Hist2d:
    pe = torch.linspace(-1, 1, bins[0] + 1, dtype=torch.float64)
    ge = torch.linspace(-2, 2, bins[1] + 1, dtype=torch.float64)
    pi = ((p + 1) * bins[0] / 2).floor().clamp(0, bins[0] - 1).long()
    gi = ((g + 2) * bins[1] / 4).floor().clamp(0, bins[1] - 1).long()
    counts = torch.bincount(pi * bins[1] + gi, minlength=bins[0] * bins[1]).reshape(bins)
    return Hist2d(counts, pe, ge, int((p.abs() >= 1).sum()), int((g.abs() >= 2).sum()))


def make_records(n: int = 5, seed: int = 0) -> list[Record]:
    gen = torch.Generator().manual_seed(seed)
    records = []
    for s in range(n):
        g = torch.randn(300, generator=gen, dtype=torch.float64) * 0.7
        p = torch.randn(300, generator=gen, dtype=torch.float64) * 0.5
        values = {
            "loss": 2.0 / (s + 1),
            "grad_norm": 0.5 + 0.1 * s,
            "noise_scale": float("nan") if s == 0 else 10.0 * s,
            "batch_l2": torch.rand(8, generator=gen, dtype=torch.float64),
            "sum_grad_squared": {
                "0.weight": torch.rand(3, 2, generator=gen, dtype=torch.float64),
                "0.bias": torch.tensor([float("inf"), 1.0], dtype=torch.float64),
            },
            "mean_gsnr": torch.tensor(0.25 * s, dtype=torch.float64),
            "grad_hist_1d": _hist1d(g),
            "grad_hist_2d": _hist2d(p, g * 2),
        }
        records.append(
            Record(step=3 * s, num_samples=96, micro_steps=3, values=values, meta={"note": "synthetic"})
        )
    return records


# --------------------------------------------------------------------------- JsonlSink + load_log


def test_jsonl_round_trip_equal(tmp_path):
    records = make_records()
    path = tmp_path / "sub" / "log.jsonl"  # parent folder is created
    with JsonlSink(path, full=["sum_grad_squared"]) as sink:  # full tensors in log.jsonl.arrays
        for r in records:
            sink.write(r)
    assert sink.closed
    loaded = load_log(path)
    assert loaded == records
    assert math.isnan(loaded[0]["noise_scale"])
    assert loaded[1]["sum_grad_squared"]["0.bias"][0] == float("inf")
    assert len(path.read_text().splitlines()) == len(records)
    assert sorted(p.name for p in (tmp_path / "sub" / "log.jsonl.arrays").iterdir()) == [
        f"step-{r.step:08d}.pt" for r in records
    ]


def test_jsonl_streams_each_line_before_close(tmp_path):
    path = tmp_path / "log.jsonl"
    sink = JsonlSink(path)
    records = [_no_dicts(r) for r in make_records(2)]
    sink.write(records[0])
    assert load_log(path) == records[:1]  # flushed while the sink is still open
    sink.write(records[1])
    assert load_log(path) == records
    sink.close()
    sink.close()  # harmless


def test_jsonl_new_file_or_append(tmp_path):
    path = tmp_path / "log.jsonl"
    records = make_records(3)
    records = [_no_dicts(r) for r in records]
    with JsonlSink(path) as sink:
        sink.write(records[0])
    with JsonlSink(path, mode="overwrite") as sink:  # asked: a new log replaces the old one
        sink.write(records[1])
    assert load_log(path) == [records[1]]
    with JsonlSink(path) as sink:  # default: append, never truncate
        assert sink.next_step == records[1].step + 1
        sink.write(records[2])
    assert load_log(path) == records[1:]
    with JsonlSink(path, append=False) as sink:  # the older spelling
        sink.write(records[0])
    assert load_log(path) == records[:1]
    with pytest.raises(ValueError, match=r"mode='truncate'.*'append', 'overwrite'"):
        JsonlSink(path, mode="truncate")


def _no_dicts(record):
    values = {k: v for k, v in record.values.items() if not isinstance(v, dict)}
    return Record(record.step, record.num_samples, record.micro_steps, values, record.meta)


def test_jsonl_summarises_per_parameter_tensors_by_default(tmp_path):
    from gradlens.core.records import TensorSummary

    records = make_records(2)
    path = tmp_path / "log.jsonl"
    with JsonlSink(path) as sink:
        for r in records:
            sink.write(r)
    loaded = load_log(path)
    assert not (tmp_path / "log.jsonl.arrays").exists()
    for r, back in zip(records, loaded):
        assert torch.equal(back["batch_l2"], r["batch_l2"])  # small tensors stay in full
        assert back["grad_hist_1d"] == r["grad_hist_1d"]
        for name, t in r["sum_grad_squared"].items():
            s = back["sum_grad_squared"][name]
            assert isinstance(s, TensorSummary) and s.shape == tuple(t.shape)
            assert s.sum == float(t.sum()) and s.max == float(t.max()) and s.min == float(t.min())
            assert s.norm == float(t.norm())
    # a choice of keys; a large tensor is summarised, kept in full only where asked
    big = Record(9, 4, 1, {"loss": 1.0, "batch_dot": torch.arange(100.0).reshape(10, 10), "x": 2.0})
    with JsonlSink(path, mode="overwrite", keys=["loss", "batch_dot"], max_elements=50) as sink:
        sink.write(big)
    (back,) = load_log(path)
    assert set(back.keys()) == {"loss", "batch_dot"}
    assert back["batch_dot"] == TensorSummary((10, 10), "float32", 4950.0, float(big["batch_dot"].double().norm()), 0.0, 99.0)
    with JsonlSink(path, mode="overwrite", full=True, max_elements=50) as sink:
        sink.write(big)
    assert load_log(path) == [big]
    raw = load_log(path, arrays=False)[0]["batch_dot"]
    assert raw == {"__array__": "log.jsonl.arrays/step-00000009.pt", "key": "batch_dot"}


def test_append_after_a_killed_writer_starts_a_fresh_line(tmp_path):
    path = tmp_path / "run.jsonl"
    records = [_no_dicts(r) for r in make_records(4)]
    lines = _write_lines(path, records[:3])
    path.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # killed mid-line
    with JsonlSink(path) as sink:
        assert sink.next_step == records[1].step + 1  # the last complete record
        sink.write(records[3])
    with pytest.warns(UserWarning, match=r"1 truncated or corrupt line\(s\) skipped: line 3 "):
        assert load_log(path) == [records[0], records[1], records[3]]


def test_jsonl_bad_use(tmp_path):
    with pytest.raises(TypeError, match="file path"):
        JsonlSink(42)
    with pytest.raises(IsADirectoryError, match="folder"):
        JsonlSink(tmp_path)
    sink = JsonlSink(tmp_path / "log.jsonl")
    with pytest.raises(TypeError, match="needs a gradlens Record, got dict"):
        sink.write({"step": 0})
    with pytest.raises(TypeError, match="step 7 cannot be written as JSON"):
        sink.write(Record(7, 1, 1, values={"x": object()}))
    sink.close()
    with pytest.raises(ValueError, match="closed"):
        sink.write(make_records(1)[0])


def _write_lines(path, records):
    with JsonlSink(path, mode="overwrite", full=True) as sink:
        for r in records:
            sink.write(r)
    return path.read_bytes().splitlines(keepends=True)


def test_load_log_truncated_last_line_warns_and_keeps_the_rest(tmp_path):
    path = tmp_path / "run.jsonl"
    records = make_records(4)
    lines = _write_lines(path, records)
    path.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])  # killed mid-line
    with pytest.warns(UserWarning, match=r"run\.jsonl': 1 truncated or corrupt line\(s\) skipped: line 4 "):
        loaded = load_log(path)
    assert loaded == records[:3]


def test_load_log_last_line_not_a_record_warns(tmp_path):
    path = tmp_path / "run.jsonl"
    records = make_records(2)
    lines = _write_lines(path, records)
    path.write_bytes(b"".join(lines) + b'{"step": 1}\n\n')  # trailing blank line is ignored
    with pytest.warns(UserWarning, match=r"line 3 \(not a gradlens record"):
        assert load_log(path) == records


def test_load_log_damaged_lines_anywhere_warn_once_and_keep_every_record(tmp_path):
    path = tmp_path / "run.jsonl"
    records = make_records(3)
    lines = _write_lines(path, records)
    path.write_bytes(
        lines[0] + b"\n" + b"{not json\n" + lines[1] + b"\xff\xfe\n" + b"[1, 2]\n" + lines[2]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = load_log(path)
    assert [r.step for r in loaded] == [r.step for r in records]
    assert len(caught) == 1
    msg = str(caught[0].message)
    assert "3 truncated or corrupt line(s) skipped: line 3 (invalid JSON" in msg
    assert "line 5 (not UTF-8" in msg and "line 6 (expected a JSON object" in msg
    path.write_bytes(b"{not json\n[1]\n")
    with pytest.raises(ValueError, match=r"run\.jsonl' line 1 is corrupt .*no line of the file"):
        load_log(path)


def test_load_log_missing_and_empty(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_log(missing)
    with pytest.raises(IsADirectoryError, match="folder"):
        load_log(tmp_path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert load_log(empty) == []


def test_lazy_name_from_package():
    import gradlens

    assert gradlens.load_log is load_log


# --------------------------------------------------------------------------- TensorBoard


def test_tensorboard_sink_writes_scalars_and_raw_histograms(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = make_records(3)
    with TensorBoardSink(tmp_path / "tb") as sink:
        for r in records:
            sink.write(r)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"gradlens/grad_norm", "gradlens/loss", "gradlens/mean_gsnr"} <= set(tags["scalars"])
    assert "gradlens/batch_l2" not in tags["scalars"]  # [N] tensors are not scalars
    events = acc.Scalars("gradlens/grad_norm")
    assert [e.step for e in events] == [r.step for r in records]
    assert [e.value for e in events] == pytest.approx([r["grad_norm"] for r in records])
    assert acc.Scalars("gradlens/mean_gsnr")[2].value == pytest.approx(0.5)
    assert acc.Scalars("gradlens/grad_hist_1d/clamped_high")[1].value == records[1]["grad_hist_1d"].clamped_high

    assert {"gradlens/grad_hist_1d", "gradlens/grad_hist_2d/grad", "gradlens/grad_hist_2d/param"} <= set(
        tags["histograms"]
    )
    for event, r in zip(acc.Histograms("gradlens/grad_hist_1d"), records):
        h, hv = r["grad_hist_1d"], event.histogram_value
        assert event.step == r.step
        # our counts and edges, unchanged: one empty leading bucket keeps the left edge
        assert list(hv.bucket) == [0.0] + h.counts.double().tolist()
        assert list(hv.bucket_limit) == pytest.approx(h.edges.tolist())
        assert hv.num == h.total
    h2 = records[0]["grad_hist_2d"]
    hv = acc.Histograms("gradlens/grad_hist_2d/grad")[0].histogram_value
    assert list(hv.bucket)[1:] == h2.counts.sum(0).double().tolist()


def test_tensorboard_sink_leaves_a_given_writer_open(tmp_path):
    pytest.importorskip("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path / "tb"))
    sink = TensorBoardSink(writer)
    sink.write(make_records(1)[0])
    sink.close()
    writer.add_scalar("still/open", 1.0, 0)  # the caller's writer was only flushed
    writer.close()
    with pytest.raises(ValueError, match="closed"):
        sink.write(make_records(1)[0])
    with pytest.raises(TypeError, match="SummaryWriter or a log folder"):
        TensorBoardSink(3.5)


def test_tensorboard_missing_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardSink("unused")


def test_records_are_json_lines(tmp_path):
    path = tmp_path / "log.jsonl"
    _write_lines(path, make_records(2))
    for line in path.read_text().splitlines():
        assert json.loads(line)["num_samples"] == 96


# --------------------------------------------------------------------------- runs, segments, the lock


def test_segments_replace_the_records_after_a_resume_and_new_runs_are_told_apart(tmp_path):
    from gradlens.output.log_format import last_run

    path = tmp_path / "run.jsonl"
    records = [_no_dicts(r) for r in make_records(5)]  # steps 0, 3, 6, 9, 12

    def moved(r, **kw):
        values = {**r.values, **kw}
        return Record(r.step, r.num_samples, r.micro_steps, values, r.meta)

    with JsonlSink(path) as sink:
        sink.begin_segment(0)  # an empty file: no header line
        for r in records:
            sink.write(r)
    assert b"__gradlens_segment__" not in path.read_bytes() and load_log(path) == records
    resumed = [moved(r, loss=-1.0) for r in records[2:4]]  # resumed at step 6: replaces 6, 9, 12
    with JsonlSink(path) as sink:
        sink.begin_segment(6)
        for r in resumed:
            sink.write(r)
    assert load_log(path) == records[:2] + resumed  # step 12 of the stopped run is gone
    fresh = [moved(r, loss=-2.0) for r in records[:2]]
    with JsonlSink(path) as sink:
        sink.begin_segment(0)  # a fresh run on a non-empty log: run 1
        for r in fresh:
            sink.write(r)
        with pytest.raises(ValueError, match=r"begin_segment\(start=-1\) must be a step"):
            sink.begin_segment(-1)
    with pytest.warns(UserWarning, match=r"holds 2 runs"):
        assert load_log(path) == fresh
    assert load_log(path, run=0) == records[:2] + resumed == load_log(path, run=-2)
    assert [r.meta["run"] for r in load_log(path, run="all")] == [0] * 4 + [1] * 2
    for chunk in (7, 64, 1 << 22):  # the last header is found reading backwards in blocks
        assert last_run(path, chunk=chunk) == (1, False)
    assert last_run(tmp_path / "missing.jsonl") == (0, True)
    lines = path.read_text().splitlines()
    assert [('"start":6' in x, '"start":0' in x) for x in lines if "__gradlens_segment__" in x] == [
        (True, False), (False, True)
    ]
    # a write cut inside the header line: the header goes again with the retried record
    with JsonlSink(path) as sink:
        sink.begin_segment(0)
        real = sink._file

        class Cut:
            closed = False

            def write(self, data):
                real.write(bytes(data[:30]))
                raise OSError(28, "No space left on device")

        sink._file = Cut()
        with pytest.raises(OSError, match="No space left"):
            sink.write(records[0])
        sink._file = real
        sink.write(records[0])
    tail = path.read_bytes().split(b"\n")[-4:]
    assert tail[0] == b'{"__gradlens_segment__":1,"run' and tail[1].startswith(b'{"__gradlens_segment__":1,"run":2,"start":0,')
    assert tail[2].startswith(b'{"step":0,') and tail[3] == b""
    with pytest.warns(UserWarning) as caught:
        assert load_log(path) == records[:1]
    assert "1 truncated or corrupt line(s) skipped: line 12 " in str(caught[0].message)
    assert "holds 3 runs" in str(caught[1].message)


def test_a_full_arrays_run_after_the_first_keeps_its_own_files(tmp_path):
    path = tmp_path / "run.jsonl"
    big = Record(0, 4, 1, {"batch_dot": torch.arange(100.0).reshape(10, 10)})
    other = Record(0, 4, 1, {"batch_dot": -torch.arange(100.0).reshape(10, 10)})
    with JsonlSink(path, full=True, max_elements=50) as sink:
        sink.write(big)
    with JsonlSink(path, full=True, max_elements=50) as sink:
        sink.begin_segment(0)
        sink.write(other)
    assert sorted(p.name for p in (tmp_path / "run.jsonl.arrays").iterdir()) == [
        "step-00000000-run1.pt", "step-00000000.pt"
    ]
    assert load_log(path, run=0) == [big]
    with pytest.warns(UserWarning, match="holds 2 runs"):
        assert load_log(path) == [other]


def test_one_writer_per_log_and_the_lock_goes_with_the_sink(tmp_path):
    import gc

    path = tmp_path / "run.jsonl"
    sink = JsonlSink(path)
    with pytest.raises(RuntimeError, match=r"run\.jsonl' is being written by another Lens or JsonlSink"):
        JsonlSink(path)
    sink.close()
    again = JsonlSink(path)  # released by close
    del again
    gc.collect()
    JsonlSink(path).close()  # and by a sink that was dropped without close

# --------------------------------------------------------------------------- one flattening


class _FakeWriter:
    """A SummaryWriter stand-in recording every tag written."""

    def __init__(self):
        self.scalars: dict[str, float] = {}
        self.histograms: dict[str, list[float]] = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = value

    def add_histogram_raw(self, tag, bucket_counts, **kw):
        self.histograms[tag] = bucket_counts[1:]

    def flush(self):
        pass


def _record_of_every_instrument() -> Record:
    """The second record of a Lens run with every instrument (Alpha's value needs two windows)."""
    from torch import nn

    from windows import all_instruments, run_windows

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    instruments = all_instruments(0.05, 0.5, bins=8, bins_2d=(3, 4))
    records: list[Record] = []
    gen = torch.Generator().manual_seed(1)
    windows = [[(torch.randn(b, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (b,), generator=gen))
                for b in (4, 2, 3)] for _ in range(3)]
    run_windows(model, windows, instruments, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1), losses=True,
                sinks=[type("S", (), {"write": lambda s, r: records.append(r), "close": lambda s: None})()])
    rec = records[1]
    for inst in instruments:
        assert inst.key in rec, f"{type(inst).__name__}'s {inst.key!r} is missing from the record"
    return rec


def test_every_sink_and_logger_gets_the_same_flat_names(monkeypatch):
    """TensorBoard, W&B and the helpers that Lightning's and the Trainer's callbacks log get the
    same scalar and histogram names and values from one record of every instrument."""
    from gradlens.integrations import record_histograms, record_scalars
    from gradlens.core.records import flatten, flatten_histograms

    rec = _record_of_every_instrument()
    scalars, hists = flatten(rec), flatten_histograms(rec)
    # what the flattening must contain, from the record itself
    assert scalars["gradlens/grad_norm"] == float(rec["grad_norm"]) and scalars["gradlens/alpha"] == float(rec["alpha"])
    for key in ("grad_hist_2d/clamped_param", "grad_hist_2d/clamped_grad", "grad_hist_1d/clamped_low", "grad_hist_1d/clamped_high"):
        h, attr = rec[key.split("/")[0]], key.split("/")[1]
        assert scalars[f"gradlens/{key}"] == float(getattr(h, attr))
    assert rec["grad_hist_2d"].clamped_grad > 0 and rec["grad_hist_1d"].clamped_high > 0  # narrow ranges: counts clamped
    assert not any(k.startswith(("gradlens/batch_l2", "gradlens/sum_grad_squared")) for k in scalars)
    assert sorted(hists) == ["gradlens/grad_hist_1d", "gradlens/grad_hist_2d/grad", "gradlens/grad_hist_2d/param"]

    writer = _FakeWriter()
    TensorBoardSink(writer).write(rec)
    assert writer.scalars == scalars
    assert {t: c for t, c in writer.histograms.items()} == {t: c.double().tolist() for t, (c, e) in hists.items()}

    logged = []

    class _Histogram:
        MAX_LENGTH = 512

        def __init__(self, np_histogram):
            self.counts, self.edges = np_histogram

    class _Run:
        def log(self, data):
            logged.append(data)

        def define_metric(self, *a, **k):
            pass

    monkeypatch.setitem(sys.modules, "wandb", type(sys)("wandb"))
    sys.modules["wandb"].Histogram, sys.modules["wandb"].run = _Histogram, None
    from gradlens.integrations.wandb import WandbSink

    WandbSink(_Run()).write(rec)
    (data,) = logged
    assert {k: v for k, v in data.items() if not isinstance(v, _Histogram)} == {"gradlens/step": rec.step, **scalars}
    assert {k: v.counts.tolist() for k, v in data.items() if isinstance(v, _Histogram)} == {t: c.tolist() for t, (c, e) in hists.items()}

    # what LensCallback (Lightning) and LensTrainerCallback log: gradlens.core.records.flatten
    assert record_scalars(rec) == scalars
    assert record_histograms(rec).keys() == hists.keys()
    with pytest.raises(TypeError, match=r"TensorBoardSink.write\(record=\.\.\.\) needs a gradlens Record, got dict"):
        TensorBoardSink(writer).write({"loss": 1.0})
    with pytest.raises(TypeError, match=r"flatten\(record=\.\.\.\) needs a gradlens Record, got dict"):
        flatten({"loss": 1.0})
