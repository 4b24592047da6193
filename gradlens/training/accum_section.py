"""The ``"gradlens_accumulate"`` section of a
:class:`~gradlens.training.accumulate.GradientAccumulateOptimizer` state dict: its format, its
versions, and the checks a saved section passes before a wrapper takes it.

The section sits beside the inner optimizer's own keys (``state``, ``param_groups``) and holds::

    {"version": 2, "accum_steps": K, "reduction": "mean" | "sum",
     "micro_step": int, "iterations": int, "skipped_windows": int, "has_updated": bool,
     "weight": float,                      # the open window's sum of micro-step weights
     "weighted": bool | None, "via_scaler": bool | None,
     "accumulators": {i: Tensor [*param_i]},   # i: flat index in param_groups order
     "last_weight": {i: float}}

Version 2 keeps the accumulators as the wrapper holds them (under ``"mean"`` the running
weighted mean ``sum_k w_k grad_k / W_i`` with W_i = ``last_weight[i]``, under ``"sum"`` the
running sum); version 1 (no ``last_weight``) kept sums, and is read by dividing them by the
window's weight under ``"mean"``. A section without ``skipped_windows`` (older files) loads it as 0.

This module writes and reads the section into an
:class:`~gradlens.training.accum_state.AccumulationState` it is given (``st`` below); it does not
import that class, whose ``section`` / ``from_section`` call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from gradlens import compat

__all__ = ["READS_VERSIONS", "SECTION_COUNTERS", "STATE_KEY", "STATE_VERSION", "load_section", "write_section"]

#: the key of the section in the wrapper's state dict
STATE_KEY = "gradlens_accumulate"
#: the version written: 2, accumulators as kept (running means) + ``last_weight``; 1: sums
STATE_VERSION = 2
#: the versions read
READS_VERSIONS = (1, 2)
#: the section's keys of the window counters (:class:`~gradlens.core.counter.WindowCounter`), in order
SECTION_COUNTERS = {"micro_steps": "micro_step", "updates": "iterations", "skipped": "skipped_windows",
                    "has_updated": "has_updated", "samples": "weight"}


def write_section(st: Any, params: Sequence[Tensor], accum_steps: int,
                  reduction: str) -> dict[str, Any]:
    """The section of the state ``st``: the counters, the window's weight and its accumulators
    keyed by the parameter's flat index in ``params`` (copies: later windows are written into
    the same buffers)."""
    return {
        "version": STATE_VERSION,
        "accum_steps": accum_steps,
        "reduction": reduction,
        **st.counter.state_dict(SECTION_COUNTERS),
        "weighted": st.weighted,
        "via_scaler": st.via_scaler,
        "accumulators": {  # as kept (copies): running means under "mean", sums under "sum"
            i: st.accumulators[p].clone() for i, p in enumerate(params) if p in st.accumulators
        },
        "last_weight": {i: st.last_weight[p] for i, p in enumerate(params) if p in st.accumulators},
    }


def load_section(st: Any, section: dict[str, Any], params: Sequence[Tensor],
                 accum_steps: int, reduction: str, accum_dtype: torch.dtype) -> Any:
    """Fill the fresh state ``st`` from ``section`` (from :func:`write_section`, any version of
    :data:`READS_VERSIONS`), checked against the wrapper that loads it, and return it.

    Every check runs before anything of a wrapper changes (``st`` is new and not yet the
    wrapper's). The accumulators are copied onto each parameter's device, in the wider of
    ``accum_dtype`` and the parameter's dtype.

    Raises:
        ValueError: wrong section version, another ``reduction``, a saved mid-window micro-step
            count not below ``accum_steps``, or accumulators whose index or shape does not
            match ``params``.
    """
    accumulators: dict[Tensor, Tensor] = {}
    version = section.get("version")
    if version not in READS_VERSIONS:
        raise ValueError(
            f"state_dict['{STATE_KEY}']['version'] is {version!r}, this gradlens reads "
            f"version {' or '.join(map(str, READS_VERSIONS))}; save it again with a "
            "matching gradlens version."
        )
    if section["reduction"] != reduction:
        raise ValueError(
            f"the state_dict was saved with reduction={section['reduction']!r}, this "
            f"optimizer has reduction={reduction!r}; construct it with the same "
            f"reduction."
        )
    st.counter.load_state_dict(section, SECTION_COUNTERS, where=f"state_dict['{STATE_KEY}']",
                               defaults={"skipped_windows": 0})  # checked, as the rest, before anything changes
    if section["micro_step"] >= accum_steps:
        raise ValueError(
            f"the state_dict was saved at micro_step={section['micro_step']} (accum_steps="
            f"{section['accum_steps']}), which does not fit accum_steps={accum_steps}; "
            f"construct the optimizer with accum_steps={section['accum_steps']}."
        )
    for index, acc in section["accumulators"].items():
        if not (0 <= index < len(params)) or acc.shape != params[index].shape:
            got = "no parameter" if not 0 <= index < len(params) else tuple(params[index].shape)
            raise ValueError(
                f"the state_dict holds an accumulator of shape {tuple(acc.shape)} for "
                f"parameter {index}, but this optimizer's parameter {index} has {got}; "
                f"load it into an optimizer over the same model."
            )
        p = params[index]
        dtype = torch.promote_types(accum_dtype, p.dtype)
        accumulators[p] = acc.detach().to(device=p.device, dtype=dtype, copy=True)
    saved_weight = section.get("last_weight", {})
    index = {p: i for i, p in enumerate(params)}
    for p, acc in accumulators.items():
        if section["version"] == 1:  # sums: the running mean under "mean"
            if reduction == "mean":
                acc.div_(st.weight)
            st.last_weight[p] = st.weight
        else:
            st.last_weight[p] = float(saved_weight[index[p]])
        st.versions[p] = compat.tensor_version(acc)
    st.accumulators = accumulators
    st.weighted = section["weighted"]
    st.via_scaler = section.get("via_scaler")
    return st
