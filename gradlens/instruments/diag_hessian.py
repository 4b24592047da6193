"""The exact Hessian diagonal by second-order backpropagation (the idea of BackPACK's exact
``DiagHessian``, Dangel et al. 2020), per micro-step, for ``nn.Sequential`` models of Linear,
Conv2d, elementwise activations, pooling and flattening, under any per-sample loss of the model
output (cross-entropy, MSE, ...).

For one sample n with output z_n and per-sample loss l_n (gradlens' units: the micro-step's
backpropagated objective times its per-sample scale s_k), the Hessian w.r.t. a layer's output,
H_z, is backpropagated as signed symmetric factors, H_z = sum_f sign_f S_f S_f^T (``S_f``:
``[B, C_f, *z]``, C_f columns per sample):

* at the model output: H_z = s_k d(dL_k/dz)/dz from the micro-step's own create_graph gradient
  (``[B, O, O]``, O autograd products through the loss alone), factorised by ``eigh`` into a
  positive and a negative set;
* through a module with input u: S_u = J_u^T S (a vector-Jacobian product of the module for each
  column); an elementwise activation f adds the residual diag(f''(u) * delta), delta = dl_n/d out,
  split by sign into two diagonal factors (``[B, D_u, D_u]``);
* a Linear / Conv2d layer's parameter diagonal is sum_f sign_f sum_{n, c} (J_theta^T S_f[n, c])^2,
  its output being linear in its parameters (no residual).

The window's diagonal is the sum over micro-steps (and ranks), normalised like the products
(1/N for a mean objective). Cost per micro-step: about C backward passes of each layer for C the
columns alive (O at the output, plus D_u per Tanh / Sigmoid input below it); memory
``[B, C, *z]`` per factor. Anything else (another layer type, a parameter outside Linear /
Conv2d, a model that is not a flat ``nn.Sequential``, several forwards in one micro-step) is
reported as unsupported and the instruments fall back to Hessian-vector products.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.core.sync import device_paths

__all__ = ["DiagHessianBackprop"]

#: modules whose output is piecewise linear in their input (zero second derivative a.e.)
_LINEAR_IN_INPUT = (nn.Flatten, nn.Identity, nn.ReLU, nn.LeakyReLU, nn.MaxPool1d, nn.MaxPool2d,
                    nn.AvgPool1d, nn.AvgPool2d, nn.Dropout)
_SMOOTH = (nn.Tanh, nn.Sigmoid)
_PARAM = (nn.Linear, nn.Conv2d)


def _second_derivative(module: nn.Module, u: Tensor) -> Tensor:
    """f''(u) of an elementwise activation, like ``u``."""
    if isinstance(module, nn.Tanh):
        t = torch.tanh(u)
        return -2.0 * t * (1.0 - t * t)
    s = torch.sigmoid(u)
    return s * (1.0 - s) * (1.0 - 2.0 * s)


class DiagHessianBackprop:
    """Per-micro-step recorder and second-order backpropagation for one tracked window.

    Args:
        model: the watched model.
        params: qualified name -> tracked parameter (the diagonal's order).
    """

    def __init__(self, model: nn.Module, params: dict[str, Tensor]):
        self.model = model
        self.params = params
        self.why_not = self._check(model, params)
        self.diag: dict[str, Tensor] = {}
        self._handles: list = []
        self._forwards: list = []

    @staticmethod
    def _check(model: nn.Module, params: dict[str, Tensor]) -> str | None:
        if type(model) is not nn.Sequential:
            return f"the model is a {type(model).__name__}, not a flat nn.Sequential"
        owned, uses = {}, 0
        for i, m in enumerate(model):
            if isinstance(m, nn.Dropout) and m.training:
                return f"layer {i} is a training-mode Dropout"
            if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str)):
                return f"layer {i} is a Conv2d with groups, a padding mode or string padding"
            if not isinstance(m, _LINEAR_IN_INPUT + _SMOOTH + _PARAM):
                return f"layer {i} is a {type(m).__name__}"
            for name, p in m.named_parameters(recurse=False):
                owned[id(p)] = f"{i}.{name}"
                uses += 1
        if uses != len(owned):
            return "a parameter is used by several layers"
        if {id(p) for p in params.values()} != set(owned) or any(owned[id(p)] != q for q, p in params.items()):
            return "the tracked parameters are not exactly those of its Linear / Conv2d layers"
        return None

    @property
    def supported(self) -> bool:
        return self.why_not is None

    # ---- recording -----------------------------------------------------------------------
    def install(self) -> None:
        """Forward hooks of a tracked window: each layer's input, the smooth activations' output
        gradients and the model output with its gradient (kept with its graph)."""
        if not self.supported or self._handles:
            return
        self._handles.append(self.model.register_forward_pre_hook(self._start))
        for i, m in enumerate(self.model):
            self._handles.append(m.register_forward_hook(self._layer(i)))
        self._handles.append(self.model.register_forward_hook(self._end))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._forwards = []
        self._cur = None

    _cur: dict | None = None

    def _start(self, model, args) -> None:
        self._cur = {"inputs": {}, "grad": {}, "z": None, "dz": None} if torch.is_grad_enabled() else None

    def _layer(self, i: int):
        def hook(m, args, out) -> None:
            cur = self._cur
            if cur is None or not args or not isinstance(args[0], Tensor):
                return
            cur["inputs"][i] = args[0].detach()
            if isinstance(m, _SMOOTH) and isinstance(out, Tensor) and out.requires_grad:
                out.register_hook(lambda g: cur["grad"].__setitem__(i, g.detach()))

        return hook

    def _end(self, model, args, output) -> None:
        cur, self._cur = self._cur, None
        if cur is None or not isinstance(output, Tensor) or not output.requires_grad:
            return
        cur["z"] = output
        output.register_hook(lambda g: cur.__setitem__("dz", g) if cur["dz"] is None else None)
        self._forwards.append(cur)

    def end_micro(self, scale: float | Tensor) -> None:
        """After a micro-step's backward: its forward's contribution to :attr:`diag`, or the
        reason the window cannot have one (:attr:`why_not`)."""
        forwards, self._forwards = self._forwards, []
        if not self.supported:
            return
        hit = [f for f in forwards if f["dz"] is not None]
        if len(hit) != 1:
            self.why_not = f"a micro-step's backward reached {len(hit)} forward passes of the model, not one"
            return
        f = hit[0]
        if not f["dz"].requires_grad:
            self.why_not = "the model output's gradient has no graph"
            return
        n = len(self.model)
        if len(f["inputs"]) != n or any(isinstance(m, _SMOOTH) and i not in f["grad"] for i, m in enumerate(self.model)):
            self.why_not = "a layer's input or output gradient was not seen"
            return
        self.micro_step(f["grad"], [f["inputs"][i] for i in range(n)], f["z"], f["dz"], scale)

    # ---- one micro-step ------------------------------------------------------------------
    def micro_step(self, grad_out: dict[int, Tensor], inputs: list[Tensor], z: Tensor, dz: Tensor,
                   scale: float | Tensor) -> None:
        """Add this micro-step's sum_n diag(H_n) (``scale`` = s_k) into :attr:`diag`.

        ``inputs[i]``: the input of layer i ``[B, ...]``; ``grad_out[i]``: dL_k/d(output of
        layer i) for the smooth activations; ``z`` the model output and ``dz`` dL_k/dz with its
        graph (create_graph)."""
        B = z.shape[0]
        zf = z.reshape(B, -1)
        O = zf.shape[1]
        dzf = dz.reshape(B, -1)
        cols = []
        for o in range(O):  # H_n[:, o] for every sample at once (the loss treats samples apart)
            (h,) = torch.autograd.grad(dzf[:, o].sum(), z, retain_graph=True, allow_unused=True)
            cols.append(torch.zeros_like(zf) if h is None else h.reshape(B, -1))
        Hz = torch.stack(cols, dim=2).detach() * scale  # [B, O, O]
        Hz = 0.5 * (Hz + Hz.transpose(1, 2))
        evals, evecs = torch.linalg.eigh(Hz)
        factors = []
        for sign in (1.0, -1.0):
            w = (sign * evals).clamp(min=0).sqrt()  # [B, O]
            if device_paths(w) or bool((w > 0).any()):  # CPU: skip an empty (e.g. negative) set
                S = (evecs * w.unsqueeze(1)).transpose(1, 2)  # [B, C=O, O]: columns as rows
                factors.append((sign, S.reshape(B, O, *z.shape[1:])))
        layers = list(self.model)
        for i in range(len(layers) - 1, -1, -1):
            m, u = layers[i], inputs[i]
            if isinstance(m, _PARAM):
                for sign, S in factors:
                    self._add_param_diag(i, m, u, S, sign)
            new = [(sign, self._vjp(m, u, S)) for sign, S in factors]
            if isinstance(m, _SMOOTH):
                r = (_second_derivative(m, u) * grad_out[i] * scale).reshape(B, -1)  # [B, D_u]
                eye = torch.eye(r.shape[1], dtype=r.dtype, device=r.device)
                for sign in (1.0, -1.0):
                    w = (sign * r).clamp(min=0).sqrt()
                    if device_paths(w) or bool((w > 0).any()):
                        new.append((sign, (eye * w.unsqueeze(1)).reshape(B, r.shape[1], *u.shape[1:])))
            factors = new

    @staticmethod
    def _vjp(m: nn.Module, u: Tensor, S: Tensor) -> Tensor:
        """``[B, C, *out] -> [B, C, *in]``: J_u^T of module ``m`` at input ``u``, per column."""
        B, C = S.shape[0], S.shape[1]
        if isinstance(m, nn.Linear):
            return S.matmul(m.weight.detach())
        with torch.enable_grad():
            v = u.detach().unsqueeze(1).expand(B, C, *u.shape[1:]).reshape(B * C, *u.shape[1:]).requires_grad_(True)
            out = m.forward(v)  # not m(v): no module hooks (the Lens' own) may run here
            (g,) = torch.autograd.grad(out, v, S.reshape(B * C, *S.shape[2:]))
        return g.reshape(B, C, *u.shape[1:])

    def _add_param_diag(self, i: int, m: nn.Module, u: Tensor, S: Tensor, sign: float) -> None:
        B, C = S.shape[0], S.shape[1]
        if isinstance(m, nn.Linear):
            S2 = S.square().sum(1)  # [B, out]
            w = S2.t().matmul(u.detach().square())
            b = S2.sum(0) if m.bias is not None else None
        else:  # Conv2d: per column, the weight gradient of <S_c, conv(u)>, squared
            cols = F.unfold(u.detach(), m.kernel_size, dilation=m.dilation, padding=m.padding, stride=m.stride)
            Sf = S.reshape(B, C, S.shape[2], -1)  # [B, C, O, T]
            g = torch.einsum("bcot,bit->bcoi", Sf, cols)
            w = g.square().sum((0, 1)).reshape(m.weight.shape)
            b = Sf.sum(3).square().sum((0, 1)) if m.bias is not None else None
        for name, val in (("weight", w), ("bias", b)):
            if val is None:
                continue
            key = f"{i}.{name}"
            val = sign * val.double()
            self.diag[key] = val if key not in self.diag else self.diag[key] + val
