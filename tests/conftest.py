import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import torch  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fuse_small_calls(monkeypatch):
    """The tests' models are tiny: their sequence Linear / Conv1D calls run fused (dL/dW from
    the measurement) as a large model's do, so that every test covers that route too; the
    size threshold itself is tested in test_fused_weight_grad.py."""
    from gradlens.capture import fused

    monkeypatch.setattr(fused, "FUSE_MIN", 0)  # (where _fuses reads it)
