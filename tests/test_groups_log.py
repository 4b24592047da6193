"""record.groups through JSON and the JSON-lines log: the same values, and the same summary
rules per group as for the totals."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gradlens import load_log
from gradlens.core.records import Hist1d, Record, TensorSummary, record_from_json, record_to_json
from gradlens.output.sinks import JsonlSink


def _hist(seed: int) -> Hist1d:
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 50, (8,), generator=g)
    return Hist1d(counts, torch.linspace(-1.0, 1.0, 9, dtype=torch.float64), int(counts[0]) // 2, 3)


def _record(step: int = 3) -> Record:
    g = torch.Generator().manual_seed(step)
    groups = {}
    for name, shapes in {"fc1": {"fc1.weight": (9, 12), "fc1.bias": (9,)}, "head": {"head.weight": (4, 9)}}.items():
        groups[name] = {
            "batch_l2": torch.rand(12, dtype=torch.float64, generator=g),
            "grad_norm": float(torch.rand((), generator=g)),
            "mean_gsnr": math.nan,
            "grad_hist_1d": _hist(step + len(name)),
            "sum_grad_squared": {q: torch.rand(s, generator=g) for q, s in shapes.items()},
            "batch_dot": torch.rand(12, 12, dtype=torch.float64, generator=g),
        }
    totals = {
        "batch_l2": sum(v["batch_l2"] for v in groups.values()),
        "grad_norm": 0.5,
        "loss": 1.25,
    }
    return Record(step, 12, 3, totals, {"units": "g_n"}, groups)


def test_record_json_round_trip_keeps_groups():
    record = _record()
    data = json.loads(json.dumps(record_to_json(record), allow_nan=False))
    assert set(data["groups"]) == {"fc1", "head"}
    back = record_from_json(data)
    assert back == record
    assert back.groups["head"]["grad_hist_1d"] == record.groups["head"]["grad_hist_1d"]
    assert math.isnan(back.groups["fc1"]["mean_gsnr"])
    # a different group value is a different record
    other = _record()
    other.groups["fc1"]["grad_norm"] += 1.0
    assert back != other


def test_record_without_groups_writes_no_groups_field():
    record = Record(0, 4, 1, {"loss": 1.0})
    data = record_to_json(record)
    assert "groups" not in data
    assert record_from_json(data).groups == {}


def test_record_from_json_refuses_bad_groups():
    data = record_to_json(_record())
    data["groups"] = {"fc1": [1, 2]}
    with pytest.raises(ValueError, match="'groups' must map group names to dicts of values"):
        record_from_json(data)


def test_log_round_trip_with_groups_summarises_per_group(tmp_path):
    path = tmp_path / "run.jsonl"
    records = [_record(3), _record(4)]
    with JsonlSink(path, max_elements=64) as sink:
        for r in records:
            sink.write(r)
    loaded = load_log(path)
    assert [r.step for r in loaded] == [3, 4]
    for r, back in zip(records, loaded):
        assert torch.equal(back["batch_l2"], r["batch_l2"])  # small totals: in full
        assert (back["grad_norm"], back["loss"]) == (r["grad_norm"], r["loss"])
        assert set(back.groups) == {"fc1", "head"}
        for g, vals in r.groups.items():
            got = back.groups[g]
            assert set(got) == set(vals)
            assert torch.equal(got["batch_l2"], vals["batch_l2"])  # [12] <= max_elements: in full
            assert got["grad_norm"] == vals["grad_norm"]
            assert math.isnan(got["mean_gsnr"])
            assert got["grad_hist_1d"] == vals["grad_hist_1d"]
            # per-parameter dicts and tensors over max_elements: summaries, as for totals
            assert got["sum_grad_squared"] == {q: TensorSummary.of(t) for q, t in vals["sum_grad_squared"].items()}
            assert got["batch_dot"] == TensorSummary.of(vals["batch_dot"])
    # the log stays small: no group tensor of more than max_elements is written in full
    assert max(len(line) for line in path.read_text().splitlines()) < 8000


def test_log_full_keys_of_groups_go_to_the_arrays_file(tmp_path):
    path = tmp_path / "run.jsonl"
    record = _record(5)
    with JsonlSink(path, max_elements=64, full=["batch_dot"]) as sink:
        sink.write(record)
    line = json.loads(path.read_text().splitlines()[0])
    assert line["groups"]["fc1"]["batch_dot"] == {
        "__array__": "run.jsonl.arrays/step-00000005.pt", "key": "groups/fc1/batch_dot"
    }
    (back,) = load_log(path)
    for g in ("fc1", "head"):
        assert torch.equal(back.groups[g]["batch_dot"], record.groups[g]["batch_dot"])
    (refs,) = load_log(path, arrays=False)
    assert refs.groups["head"]["batch_dot"]["key"] == "groups/head/batch_dot"


def test_log_keys_filter_applies_to_groups(tmp_path):
    path = tmp_path / "run.jsonl"
    with JsonlSink(path, keys=["batch_l2"]) as sink:
        sink.write(_record(1))
    (back,) = load_log(path)
    assert set(back.values) == {"batch_l2"}
    assert all(set(v) == {"batch_l2"} for v in back.groups.values())
