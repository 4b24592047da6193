"""gradlens.core.counter.WindowCounter: the window lifecycle shared by the Lens, the accumulating
optimizer, AccumBatchNorm and NoiseScaleMonitor (small behavioural specs)."""

from __future__ import annotations

import pytest
import torch

from gradlens import GradientAccumulateOptimizer
from gradlens.lens.state import StateDictError
from gradlens.core.counter import WindowCounter


def test_micro_steps_samples_close_skip_reset():
    c = WindowCounter()
    assert not c.is_open
    c.note_micro(3)
    c.note_micro(2.5)
    assert (c.micro_steps, c.samples, c.is_open) == (2, 5.5, True)
    c.close(updated=True)
    assert (c.micro_steps, c.samples, c.updates, c.skipped, c.has_updated) == (0, 0.0, 1, 0, True)
    c.note_micro()
    c.close(updated=False)  # skipped: counted, contents dropped
    assert (c.micro_steps, c.samples, c.updates, c.skipped, c.has_updated) == (0, 0.0, 1, 1, False)
    c.note_micro(4)
    c.reset()  # dropped: nothing counted
    assert (c.micro_steps, c.samples, c.updates, c.skipped, c.has_updated) == (0, 0.0, 1, 1, False)


def test_state_dict_round_trip_and_names():
    c = WindowCounter()
    c.note_micro(2)
    c.close(True)
    c.note_micro(5)
    assert c.state_dict() == {"micro_steps": 1, "samples": 5.0, "updates": 1, "skipped": 0, "has_updated": True}
    names = {"updates": "step", "skipped": "skipped_windows"}
    assert c.state_dict(names) == {"step": 1, "skipped_windows": 0}
    d = WindowCounter()
    d.load_state_dict(c.state_dict())
    assert d == c
    d.load_state_dict({"step": 7}, names, defaults={"skipped_windows": 0})
    assert (d.updates, d.skipped, d.micro_steps) == (7, 0, 1)


@pytest.mark.parametrize("key, value", [("micro_steps", -1), ("updates", 1.5), ("samples", float("nan")),
                                        ("has_updated", 1), ("skipped", True)])
def test_load_state_dict_checks_every_value_before_any_changes(key, value):
    c = WindowCounter()
    state = {**WindowCounter(micro_steps=2, samples=4.0, updates=3).state_dict(), key: value}
    with pytest.raises(StateDictError, match=rf"opt\['{key}'\] must be"):
        c.load_state_dict(state, where="opt")
    assert c == WindowCounter()
    with pytest.raises(StateDictError, match=r"lacks 'updates'"):
        c.load_state_dict({"micro_steps": 0, "samples": 1.0})


def test_optimizer_section_keeps_its_keys_and_checks_them():
    model = torch.nn.Linear(3, 2)
    opt = GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3)
    model(torch.randn(4, 3)).sum().backward()
    opt.step(num_samples=4)
    section = opt.state_dict()["gradlens_accumulate"]
    assert [k for k in section if k in ("micro_step", "iterations", "skipped_windows", "has_updated", "weight")] == [
        "micro_step", "iterations", "skipped_windows", "has_updated", "weight"]
    assert (section["micro_step"], section["weight"], opt.accum_state.counter.micro_steps) == (1, 4.0, 1)
    state = opt.state_dict()
    state["gradlens_accumulate"]["iterations"] = -2
    with pytest.raises(ValueError, match=r"\['gradlens_accumulate'\]\['iterations'\] must be an int >= 0, got -2"):
        GradientAccumulateOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), 3).load_state_dict(state)
