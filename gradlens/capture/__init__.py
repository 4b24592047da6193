"""Capture: which parameters are tracked, and how one micro-step's backward reaches the
instruments.

``extend(model)`` marks a model (and remembers exclusions); ``extend(loss_fn)`` makes a loss
module report its reduction and batch size (:mod:`gradlens.capture.tracked`; the losses a forward
computes: :mod:`gradlens.capture.losses`). A :class:`~gradlens.capture.tap.Tap` is installed
*only while a tracked window is open* (untracked steps cost what a plain step costs). During a
tracked forward it follows every use of a tracked parameter:

- a module with a closed-form kernel in :mod:`gradlens.capture.registry` (Linear, Conv, Embedding, the
  norms, ...) is one *site*: its input is kept and its output hooked;
- modules with a registered tracked-window forward (``nn.MultiheadAttention``, RNNs:
  :mod:`gradlens.kernels.attention`, :mod:`gradlens.kernels.recurrent`) run it, so that their
  parameters are used through batch-first ``F.linear`` calls;
- every other operation is seen by a ``TorchFunctionMode`` (:mod:`gradlens.capture.mode`):
  tensors computed from the batch ("data") and from parameters only ("derived") are told apart,
  and the operation where a parameter (or a derived tensor) meets the batch is hooked;
  ``F.linear`` there is a site, the rest follows the exact per-operation rules of
  :mod:`gradlens.capture.ops`.

In backward each hooked output hands its gradient down to the Meter
(:mod:`gradlens.measure.meter`), which rescales it to per-sample units and measures it (the
events it receives: :mod:`gradlens.capture.events`). Where the Meter materialises a sequence
``nn.Linear``'s per-sample weight gradients anyway (sum of squares, exact histograms, BatchDot),
that call runs as a ``_FusedLinear`` (:mod:`gradlens.capture.fused`) whose backward takes dL/dW
from their sum instead of a second matmul. For single-use Linear, Conv1D, LayerNorm and
Embedding calls the call's own autograd node gives its dL/dp
(:mod:`gradlens.capture.param_grads`). Which layers may take these fast paths, and whether a
use's samples may hold several rows, each kernel declares on its class
(:class:`gradlens.kernels.base.Kernel`: ``fused_layers``, ``routes_param_grads``,
``rows_per_sample``); the capture holds no list of kernel types. The sample axis of a use is
followed from the model's input (dim 0, the ``batch_dim`` given to :func:`extend`, or dim 1
where the model says ``batch_first=False``) through every data operation
(:mod:`gradlens.capture.axes`; rows of the batch reordered, selected, repeated or mixed:
:mod:`gradlens.capture.rows`, :mod:`gradlens.capture.samples`), never guessed from sizes; an
operation that mixes the samples of a micro-batch makes the parameters before it undefined. A tracked
window runs a compiled model eagerly (compiler stance ``force_eager``).

What the mode costs is Python per torch call (its dispatch, then the lookups and marks here), so
it sees only the calls whose capture needs it: a site's own inner calls, and the calls inside a
parameter-free elementwise module (dropout, activations: :func:`gradlens.capture.registry.elementwise`),
run with the mode off the torch-function stack (when it is the innermost mode; a user's own mode
inside the forward keeps it on, the site's calls then passed through); their outputs get the
marks that following those calls gives. The marks are tensor -> value maps read and written in
place by the mode (:class:`gradlens.capture.marks._TensorMarks`), and the common operation (one
output of its data argument's shape, no axis rule) is marked without the rules of
:mod:`gradlens.capture.axes`.

A window whose instruments need only the window gradient and each micro-step's norm runs a
:class:`~gradlens.capture.light.ParamTap` instead: parameter hooks only, on any model.

Why not BackPACK's own module hooks: ``backpack.extend`` installs full backward hooks that stay
on the model and cost ~1.6x a plain step on a 784-512-512-10 MLP even outside a ``backpack``
context. gradlens uses BackPACK's derivatives (see :mod:`gradlens.kernels`) but attaches its own
light hooks for tracked windows only.
"""

from __future__ import annotations

from gradlens.capture.events import OnUse, OpUse, Site, WeightGrad
from gradlens.capture.light import ParamTap
from gradlens.capture.losses import LossCall, pending_loss_calls, settle_rows, take_loss_calls
from gradlens.capture.tap import Tap
from gradlens.capture.tracked import (
    declared_batch_dim, extend, is_extended, model_exclusions, tracked_parameters, trainable_split,
)
from gradlens.kernels.linear import CONV1D, LINEAR  # the layer classes a plan may fuse (Meter)

__all__ = [
    "extend", "declared_batch_dim", "is_extended", "model_exclusions", "tracked_parameters", "trainable_split",
    "LossCall", "pending_loss_calls", "take_loss_calls", "settle_rows", "Tap", "ParamTap", "Site", "OnUse", "OpUse",
    "WeightGrad", "LINEAR", "CONV1D",
]
