"""The per-layer registry: which kernel computes the per-sample gradients of a module's own
parameters, and which modules get a tracked-window forward that exposes their inner operations.

Every trainable parameter is tracked, whatever module or function uses it (see
:mod:`gradlens.capture`). This registry only decides *how*:

- **closed form** (:func:`register_kernel`): a :class:`~gradlens.kernels.Kernel` computes the
  layer's per-sample quantities from its input and output gradient (Linear, Conv, Embedding,
  the norms, transformers' ``Conv1D``);
- **tracked forward** (:func:`register_forward`): modules whose inner layout hides the sample
  axis (``nn.MultiheadAttention`` merges batch and heads, RNNs loop over time) run an
  equivalent batch-first forward during tracked windows, so that their parameters are used
  through ``F.linear`` calls on ``[B, T, d]`` inputs (closed form again);
- **per operation** (everything else): the capture follows each parameter to the operations
  that consume it and applies the exact per-operation rule (see :mod:`gradlens.capture.ops`).

Parameter-free elementwise modules (dropout, activations; :func:`elementwise`) are a shortcut
of the capture, not a kind of layer: their outputs are marked as following their operations
would mark them, without the calls.

Users register kernels for their own layers::

    class MyKernel(gradlens.kernels.Kernel):
        def per_sample(self, module, a, delta, start, stop, attrs=None): ...
    gradlens.register_kernel(MyLayer, MyKernel())

A kernel declares what it offers beyond the materialising defaults in class attributes
(``kind``, ``factored``, ``mixes_samples``, ``per_micro_batch``: see
:class:`~gradlens.kernels.Kernel`); :func:`register_kernel` checks them
(:func:`gradlens.kernels.check_kernel`).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from gradlens import compat
from gradlens.kernels.backpack import _backpack_kernels
from gradlens.kernels.base import Kernel, check_kernel, qualname
from gradlens.kernels.bilinear import BilinearKernel
from gradlens.kernels.conv import Conv2dKernel, VmapConvKernel
from gradlens.kernels.embedding import EmbeddingBagKernel, EmbeddingKernel
from gradlens.kernels.linear import LinearKernel, TransposedLinearKernel
from gradlens.kernels.norms import (
    BatchNormBatchStatsKernel, BatchNormEvalKernel, GroupNormKernel, InstanceNormKernel, LayerNormKernel, RMSNormKernel,
)

__all__ = ["register_kernel", "register_forward", "kernel_for", "forward_for", "supported_layers", "layer_table"]

KernelFactory = Callable[[nn.Module], "Kernel | None"]

#: (module class or "module.QualName", factory, description of the kernel)
_KERNELS: list[tuple[type | str, KernelFactory, str]] = []
_FORWARDS: dict[type, tuple[Callable, str]] = {}


def register_kernel(module_type: type | str, kernel: "Kernel | KernelFactory", description: str = "") -> None:
    """Use ``kernel`` for the parameters of modules of ``module_type`` (and of subclasses that
    keep its ``forward``).

    Args:
        module_type: a module class, or its dotted name (``"transformers.pytorch_utils.Conv1D"``)
            so that the library defining it need not be imported.
        kernel: a :class:`~gradlens.kernels.Kernel` instance, or a callable ``module -> Kernel |
            None`` (None: this configuration has no closed form; the module's parameters are then
            captured per operation, exactly, at the cost of materialising them). What the kernel
            declares is checked (:func:`gradlens.kernels.check_kernel`): an instance here, a
            factory's kernels when :func:`kernel_for` first hands one out.
        description: one line for the supported-layer table.
    """
    if not (isinstance(module_type, (type, str))):
        raise TypeError(f"register_kernel(module_type=...) takes a class or a dotted name, got {module_type!r}")
    if isinstance(kernel, type) or not callable(kernel) or isinstance(kernel, Kernel):
        check_kernel(kernel)  # a factory's kernels are checked when kernel_for hands them out
    factory = kernel if callable(kernel) and not isinstance(kernel, Kernel) else (lambda m, k=kernel: k)
    _KERNELS.insert(0, (module_type, factory, description or type(kernel).__name__))


def register_forward(module_type: type, forward: Callable, description: str = "") -> None:
    """During tracked windows, run ``forward(module, tap, *args, **kwargs)`` instead of
    ``module.forward``: an equivalent computation whose parameter uses the capture can follow
    (batch-first ``F.linear`` calls; ``tap.mark_data(t)`` declares a tensor made inside, such
    as a zero initial state, part of the batch). Untracked windows keep the module's own
    forward."""
    _FORWARDS[module_type] = (forward, description)


def kernel_for(module: nn.Module) -> "Kernel | None":
    """The closed-form kernel of ``module``'s own parameters, or None (captured per operation).

    A subclass is matched by its nearest registered base class, unless it overrides that base's
    ``forward`` (then its operations are followed instead)."""
    for cls in type(module).__mro__:
        for key, factory, _ in _KERNELS:
            if key is cls or (isinstance(key, str) and key == qualname(cls)):
                if type(module).forward is not cls.forward:
                    return None
                return _checked(factory(module))
    return None


#: kernel classes that passed :func:`gradlens.kernels.check_kernel` (a factory makes a fresh
#: kernel per module: each class is checked once, on the first module built; an instance that
#: sets a declared attribute itself, e.g. a kind given to its constructor, is checked each time)
_CHECKED: set[type] = set()
_DECLARED = frozenset({"kind", "factored", "mixes_samples", "per_micro_batch", "rows_per_sample", "rows_last", "fused_layers",
                       "routes_param_grads"})


def _checked(kernel: "Kernel | None") -> "Kernel | None":
    if kernel is None:
        return None
    own = not _DECLARED.isdisjoint(getattr(kernel, "__dict__", ()))
    if own or type(kernel) not in _CHECKED:
        check_kernel(kernel)
        if not own:
            _CHECKED.add(type(kernel))
    return kernel


def forward_for(module: nn.Module) -> Callable | None:
    """The tracked-window forward registered for ``type(module)`` (exact class), or None."""
    got = _FORWARDS.get(type(module))
    return got[0] if got else None


#: parameter-free modules whose forward is elementwise in its one tensor argument (dropout,
#: activations), by class or dotted name, exact class only: during tracked windows the mode
#: steps aside for their forward and the output takes the input's sample axis (or its derived
#: names): what following their operations one by one gives, without the calls. Not part of
#: :func:`supported_layers` (their outputs are captured as before; only cheaper).
_ELEMENTWISE: frozenset = frozenset(
    [nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout,
     nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardswish,
     nn.Hardsigmoid, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.Softplus, nn.Softsign, nn.Tanhshrink,
     nn.LogSigmoid, nn.Hardshrink, nn.Softshrink, nn.Threshold]
    + [f"transformers.activations.{n}" for n in (
        "GELUTanh", "NewGELUActivation", "GELUActivation", "SiLUActivation", "FastGELUActivation",
        "QuickGELUActivation", "ClippedGELUActivation", "AccurateGELUActivation", "MishActivation",
        "ReLUSquaredActivation", "SqrtSoftplusActivation", "PytorchGELUTanh")]
)


def elementwise(module: nn.Module) -> bool:
    """Whether ``module`` is a parameter-free elementwise module of :data:`_ELEMENTWISE` (its
    exact class; no parameters of its own)."""
    cls = type(module)
    if cls not in _ELEMENTWISE and qualname(cls) not in _ELEMENTWISE:
        return False
    return next(module.parameters(), None) is None


def _display(key: type | str) -> str:
    if isinstance(key, str):
        return key
    if key.__module__.startswith("torch.nn"):  # a private base class stands for its family
        return f"nn.{key.__name__[1:]}*" if key.__name__.startswith("_") else f"nn.{key.__name__}"
    return qualname(key)


def supported_layers() -> list[tuple[str, str]]:
    """``(layer, how)`` rows, most recently registered first: the README's supported-layer
    table, generated from the registry. Everything else is captured per operation."""
    rows = [(_display(k), d) for k, _, d in _KERNELS]
    rows += [(_display(t), d) for t, (_, d) in _FORWARDS.items()]
    return rows


#: the last row of :func:`layer_table`: what no registered layer covers
PER_OPERATION = (
    "per operation: a `TorchFunctionMode` follows each parameter (and tensors computed from "
    "parameters only) to the operation where it meets the batch; `F.linear`, `add`, `mul` in "
    "closed form, any other operation by an exact VJP of that one operation per sample"
)


def layer_table() -> str:
    """The README's supported-layer table (markdown), generated from gradlens' own
    registrations (:func:`supported_layers` without the user's): consecutive layers of one
    description share a row; the last row is everything else (:data:`PER_OPERATION`)."""
    rows: list[tuple[list[str], str]] = []
    builtin = [(_display(k), d) for k, _, d in _BUILTIN[0]] + [(_display(t), d) for t, (_, d) in _BUILTIN[1].items()]
    for layer, how in builtin:
        if rows and rows[-1][1] == how:
            rows[-1][0].append(layer)
        else:
            rows.append(([layer], how))
    lines = ["| layer | per-sample gradients |", "|---|---|"]
    lines += ["| " + ", ".join(f"`{name}`" for name in names) + f" | {how} |" for names, how in rows]
    lines.append(f"| anything else: custom modules using their own parameters, functional calls | {PER_OPERATION} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- built-ins
def _string_padding(m) -> bool:
    return isinstance(getattr(m, "padding", 0), str)


def _conv(m: nn.Module) -> "Kernel | None":
    if m.padding_mode != "zeros":
        return None  # the padding is an operation of its own: captured per operation
    if isinstance(m, nn.Conv2d) and m.groups == 1:
        return Conv2dKernel()  # string padding as explicit, possibly asymmetric, pads
    if _string_padding(m) or any(getattr(m, "output_padding", (0,))):
        return VmapConvKernel()  # BackPACK swaps string padding's roles, fails on output_padding
    makers = _backpack_kernels()  # the convolutions' kernel has kind "conv", transposed "other"
    return makers[next(c for c in type(m).__mro__ if c in makers)]()


def _batchnorm(m: nn.Module) -> "Kernel":
    if not m.training and m.track_running_stats and m.running_mean is not None:
        return BatchNormEvalKernel()
    return BatchNormBatchStatsKernel()


for _t in (nn.ConvTranspose3d, nn.ConvTranspose2d, nn.ConvTranspose1d, nn.Conv3d, nn.Conv2d, nn.Conv1d):
    register_kernel(_t, _conv, "closed form (unfold + bmm for ungrouped Conv2d, BackPACK's derivatives otherwise); "
                    "padding modes other than zeros per operation")
register_kernel(
    nn.Embedding,
    lambda m: None if m.scale_grad_by_freq else EmbeddingKernel(),
    "closed form (scatter of the output gradients); `scale_grad_by_freq` per operation",
)
register_kernel(
    nn.EmbeddingBag,
    lambda m: None if m.mode == "max" or m.scale_grad_by_freq else EmbeddingBagKernel(),
    "closed form (a bag is a sample: scatter of its weighted output gradient; `\"sum\"`, `\"mean\"`, offsets, "
    "per-sample weights); `\"max\"` per operation",
)
_NORMS = "closed form (`delta * x_hat`, statistics recomputed from the input; BatchNorm: running or batch statistics)"
register_kernel(compat.BatchNormBase, _batchnorm, _NORMS)
register_kernel(compat.InstanceNormBase, lambda m: InstanceNormKernel() if m.affine else None, _NORMS)
register_kernel(nn.GroupNorm, lambda m: GroupNormKernel() if m.affine else None, _NORMS)
if hasattr(nn, "RMSNorm"):
    register_kernel(nn.RMSNorm, lambda m: RMSNormKernel() if m.elementwise_affine else None, _NORMS)
register_kernel(nn.LayerNorm, lambda m: LayerNormKernel() if m.elementwise_affine else None, _NORMS)
register_kernel("transformers.pytorch_utils.Conv1D", TransposedLinearKernel(), "closed form (the Linear factors, weight `[d_in, d_out]`)")
register_kernel(nn.Bilinear, BilinearKernel(),
                "closed form from its two inputs and output gradient (three factors; no `[B, *param]` tensor)")
register_kernel(nn.Linear, LinearKernel(), "closed form from the layer's input and output gradient, any leading axes "
                "(factors; no `[B, *param]` tensor for norms and sums)")


def _register_forwards() -> None:
    from gradlens.kernels.attention import mha_forward
    from gradlens.kernels.recurrent import rnn_forward

    register_forward(nn.MultiheadAttention, mha_forward,
                     "a tracked-window forward with batch-first `F.linear` projections (`batch_first` or not), then closed form")
    for t in (nn.LSTM, nn.GRU, nn.RNN):
        register_forward(t, rnn_forward, "a tracked-window loop over time (layers, bidirectional, `batch_first` or not), "
                         "then closed form; the recurrent weight's uses are concatenated over time")


_register_forwards()
_BUILTIN = (list(_KERNELS), dict(_FORWARDS))  # what layer_table shows (not the user's registrations)
