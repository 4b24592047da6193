"""Why the optimizer's gradient differs from the window's (:class:`~gradlens.instruments.accumulation.AccumulationCheck`),
told from the window's own units, and a fix that works in that loop.

Micro-step k backpropagated c_k times its objective (c_k: what multiplied it on its way to
``backward``, a GradScaler's scale s included), a mean over its B_k samples (or T_k counted
targets of a token-mean loss). What reaches ``p.grad`` from it, unscaled, weighs each of its
samples (targets) by w_k = c_k / (s B_k) (c_k / (s T_k)); one batch of the window weighs each by
1 / N (1 / T). Equal c_k over unequal B_k (T_k) is the "loss / K" recipe; a ratio
<g_opt, g> / ||g||^2 away from 1 with nothing else is a factor applied twice or not at all.
Host reads only (the record is being made).
"""

from __future__ import annotations

import math
from typing import Any

from gradlens.training.accum_optimizer import GradientAccumulateOptimizer

__all__ = ["cause_and_fix"]

_FIX_SAMPLES = (
    "weigh each micro-step's mean loss by its share of the window, (loss * B_k / N).backward() with "
    "N the window's sample count (instead of loss / K), or accumulate with "
    "GradientAccumulateOptimizer(opt, accum_steps=K) and opt.step(num_samples=len(x))"
)
_FIX_TOKENS = (
    "backpropagate each micro-step's summed token losses over the window's counted tokens, "
    "(F.cross_entropy(logits, y, ignore_index=..., reduction='sum') / T).backward() with T the "
    "number of targets of the whole window that are not ignored (counted before its first "
    "micro-step, as the Hugging Face Trainer's num_items_in_batch), not divided by K"
)


def _spread(values: list[float]) -> bool:
    """Whether positive ``values`` differ beyond round-off."""
    return bool(values) and max(values) > min(values) * (1 + 1e-6)


def _near(a: float, b: float) -> bool:
    return b > 0 and abs(a / b - 1) < 1e-3


def cause_and_fix(state: Any, out: dict, optimizer: Any, tolerance: float, told: bool = True) -> tuple[str, str]:
    """``(cause, fix)`` for a window whose ``rel_error`` exceeds ``tolerance``: ``state`` the
    :class:`~gradlens.instruments.accumulation.CheckState` (this rank's micro-steps), ``out`` the
    record value so far (``ratio``, ``rel_error``, ``grad_scale``, ``clip_factor``); ``told``:
    the GradScaler scale (or its absence) was known, not inferred."""
    cause, fix = _cause_and_fix(state, out, optimizer, tolerance)
    ratio, clip = out.get("ratio") or 0.0, out.get("clip_factor") or 1.0
    if not told and clip < 1 and ratio > 1.5:  # a scaler's unscale and a clip look alike
        cause += (f" (or a GradScaler the Lens does not know: p.grad was multiplied by {clip:.4g} after the "
                  "last backward, taken as clipping; a scale unscaled together with a clip cannot be told apart)")
        fix += "; with a GradScaler, give the Lens the scaler: Lens(..., grad_scaler=scaler)"
    return cause, fix


def _cause_and_fix(state: Any, out: dict, optimizer: Any, tolerance: float) -> tuple[str, str]:
    sizes = list(state.sizes)
    k = len(sizes)
    s = out.get("grad_scale") or 1.0
    mults = [float(m) / s for m in state.mults]
    tokens = [float(t) for t in state.tokens] if state.reference == "tokens" else []
    if tokens and (len(tokens) != k or not _spread([t / b for t, b in zip(tokens, sizes)])):
        tokens = []  # as many counted targets per sample in every micro-step: the samples tell
    counts = tokens if tokens else [float(b) for b in sizes]
    what = "token counts" if tokens else "micro-batches"
    if state.where == "wrapper" and isinstance(optimizer, GradientAccumulateOptimizer):
        if not state.wrapper_weighted and _spread(counts):
            return (
                f"unequal {what} ({_show(counts)}) weighted equally by GradientAccumulateOptimizer: "
                "step() without num_samples gives every micro-step the weight 1/K",
                "pass each micro-batch's size to every step: opt.step(num_samples=len(x))" + (
                    "; for a token-mean loss, " + _FIX_TOKENS if tokens else ""),
            )
    elif k > 1 and _spread(counts) and not _spread(mults):
        if tokens:
            return (
                f"unequal token counts under a per-micro-step token mean: the window's {k} micro-steps "
                f"counted {_show(counts)} targets, each averaged over its own and weighted alike "
                f"(the loss divided by K), so a token of a short micro-step weighs more",
                _FIX_TOKENS,
            )
        return (
            f"unequal micro-batches under loss / K: the window's {k} micro-batches of {_show(counts)} "
            "samples are each averaged over their own samples and weighted alike, so a sample of a small "
            "micro-batch weighs more than one of a large one",
            _FIX_SAMPLES,
        )
    ratio, rel = out.get("ratio"), out.get("rel_error")
    if ratio is not None and math.isfinite(ratio) and rel is not None:
        off_scale = math.sqrt(max(rel * rel - (ratio - 1) ** 2, 0.0))  # the part a factor cannot explain
        if off_scale <= max(tolerance, 1e-3 * abs(ratio - 1)):
            return _factor(ratio, k)
    return (
        "p.grad holds more than (or other than) what the captured backwards gave the window: a "
        "backward outside lens.capture(), a regulariser added to the loss, micro-steps weighted "
        "unequally, or gradients changed before the step other than by one factor "
        "(clip_grad_value_, per-parameter clipping)",
        "capture every micro-step's backward (with lens.capture(): loss.backward()), weigh micro-steps "
        "by their samples (" + _FIX_SAMPLES + "), and clip with clip_grad_norm_ over all parameters",
    )


def _factor(ratio: float, k: int) -> tuple[str, str]:
    """A pure factor: the optimizer got ``ratio`` times the window gradient."""
    cause = f"a factor applied twice or not at all: the optimizer got {ratio:.6g} x the window gradient"
    if k > 1 and _near(ratio, 1 / k):
        cause += f" (1/K with K = {k}: the loss divided by K twice?)"
        fix = "divide the loss by K once (not in the model and again in the loop); with "
    elif k > 1 and _near(ratio, k):
        cause += f" (K = {k}: a 1/K that the backward did not carry?)"
        fix = "state only the factors the backward carries; with "
    elif ratio > 1.5 and _near(ratio, 2.0 ** round(math.log2(ratio))):
        cause += " (a power of two: a GradScaler's scale that was not divided out?)"
        fix = ("let scaler.step(opt) unscale (or call scaler.unscale_(opt) before clipping), and "
               "give the Lens the scaler (Lens(..., grad_scaler=scaler)); with ")
    else:
        fix = "multiply the loss by each factor once; with "
    fix += ("lens.capture(reduction='mean', loss=loss) gradlens measures what multiplies loss on its way "
            "to backward, and multiplier= states only a factor inside loss (a declared window objective)")
    return cause, fix


def _show(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:g}" for v in values[:8]) + (", ...]" if len(values) > 8 else "]")
