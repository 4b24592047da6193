"""The autograd-node hooks of single-use layer calls: where a layer's forward is one torch call
of its input and parameters (torch's Linear, LayerNorm and Embedding, transformers' Conv1D:
what their kernels declare, :meth:`gradlens.kernels.base.Kernel.routes_param_grads`), that
call's autograd node sees exactly the call's dL/dp, which the Meter takes as the call's sum of
per-sample gradients (times the per-sample scale) instead of computing it again."""

from __future__ import annotations

from torch import Tensor, nn

from gradlens import compat
from gradlens.capture.events import Site

#: autograd nodes of one-call layer forwards whose inputs include the layer's parameters
#: directly (``F.linear``/``Conv1D``'s addmm or mm, ``F.layer_norm``, ``F.embedding``)
_ROUTED_NODES = ("AddmmBackward0", "MmBackward0", "NativeLayerNormBackward0", "EmbeddingBackward0")


def _hook_param_grads(output: Tensor, module: nn.Module, site: Site, on_grad) -> frozenset:
    """Hook the autograd node(s) of one layer call (``output`` its result) so that
    ``on_grad(site, dL/dp of this call, attr)`` receives each tracked parameter's gradient from
    this call alone (before other uses, regularisers or DDP add to it): a parameter that is a
    direct input of the call's node (:data:`_ROUTED_NODES`; ``weight.t()`` of ``F.linear``
    through its transpose node). Returns the attributes so hooked."""
    fn = output.grad_fn
    if compat.node_name(fn) in ("ViewBackward0", "UnsafeViewBackward0"):
        fn = fn.next_functions[0][0]  # a [B, T, d] input: the 2-D product under a view
    if compat.node_name(fn) not in _ROUTED_NODES:
        return frozenset()
    ids = {id(getattr(module, attr)): attr for attr in site.params}
    direct, hooked = [], []
    for i, (nxt, _) in enumerate(fn.next_functions):
        if nxt is None:
            continue
        attr = ids.get(id(getattr(nxt, "variable", None)))
        if attr is not None:
            direct.append((i, attr))
        elif compat.node_name(nxt) == "TBackward0" and nxt.next_functions:
            attr = ids.get(id(getattr(nxt.next_functions[0][0], "variable", None)))
            if attr is not None:
                hooked.append(attr)
                nxt.register_hook(_node_hook(on_grad, site, ((0, attr),)))
    if direct:
        fn.register_hook(_node_hook(on_grad, site, tuple(direct)))
    return frozenset(hooked) | frozenset(attr for _, attr in direct)


def _node_hook(on_grad, site: Site, slots: tuple):
    """A node hook giving ``on_grad(site, grad_inputs[i], attr)`` for each ``(i, attr)`` of
    ``slots``; it returns None, so the gradients flow on unchanged."""

    def hook(grad_inputs, grad_outputs) -> None:
        for i, attr in slots:
            on_grad(site, grad_inputs[i], attr)

    return hook
