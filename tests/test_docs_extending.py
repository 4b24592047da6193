"""docs/extending.md runs: its ```python blocks, in order and in one namespace, are the test.

The blocks assert their own results against float64 ``vmap(grad(...))`` oracles (micro-batches
2, 3, 1). Two more runs check that they can fail: the page with a wrong merge in its instrument,
and with a wrong formula in its kernel, must raise. Kernels the page registers are taken out of
the registry afterwards (other tests iterate it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradlens.capture.registry import _KERNELS

PAGE = Path(__file__).parents[1] / "docs" / "extending.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def _run(text: str) -> dict:
    """Execute the page's python blocks in order in one namespace; the registry restored."""
    n = len(_KERNELS)
    namespace: dict = {"__name__": "docs_extending"}
    try:
        for i, block in enumerate(_blocks(text)):
            code = compile(block, f"{PAGE.name}, python block {i + 1}", "exec")
            exec(code, namespace)  # noqa: S102 - the page's own examples
    finally:
        del _KERNELS[: len(_KERNELS) - n]
    return namespace


def test_the_page_has_its_examples():
    blocks = _blocks(PAGE.read_text())
    assert len(blocks) == 10, len(blocks)
    text = "\n".join(blocks)
    for needed in ("class MaxAbsGrad(Instrument)", "class FeatureScaleKernel(Kernel)", "register_kernel(",
                   "vmap(grad(", "split([2, 3, 1])", "state_dict()", "to_buffers", "check_instrument("):
        assert needed in text, needed


def test_the_examples_run_and_match_the_oracle():
    ns = _run(PAGE.read_text())
    record = ns["record"]  # the window of the last block that made one (the layer without a kernel)
    assert record.num_samples == 6 and record.micro_steps == 3
    assert {"scale.weight", "scale.bias"} <= set(record["sum_grad_squared"])
    assert {"MaxAbsGrad", "FeatureScaleKernel", "per_sample_grads"} <= set(ns)


@pytest.mark.parametrize(
    "wrong, right",
    [
        # the instrument: micro-steps merged by the smaller maximum
        ("torch.maximum(state[name], value)", "torch.minimum(state[name], value)"),
        # its rank-one fast path: the sum of the two factors' maxima instead of their product
        ("(delta.abs().amax(1) * a.abs().amax(1)).amax()", "(delta.abs().amax(1) + a.abs().amax(1)).amax()"),
        # the kernel: a mean over a sample's rows instead of their sum
        ("(rows_d * rows_a).sum(1)", "(rows_d * rows_a).mean(1)"),
        # the kernel's factored sum of squares
        ("{k: g.square().sum(0) for k, g in", "{k: g.abs().sum(0) for k, g in"),
    ],
    ids=["merge", "outer", "per-sample", "sum-of-squares"],
)
def test_a_wrong_example_fails(wrong, right):
    text = PAGE.read_text()
    assert text.count(wrong) >= 1, wrong
    with pytest.raises(AssertionError):
        _run(text.replace(wrong, right))
