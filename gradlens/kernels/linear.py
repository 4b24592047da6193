"""Kernels of affine maps on the last axis: ``nn.Linear`` and ``F.linear`` calls
(:class:`LinearKernel`, :class:`OpLinear`), Hugging Face's transposed ``Conv1D``
(:class:`TransposedLinearKernel`). g_n = sum_t delta_nt a_nt^T over the positions t of an input
``[B, *, d_in]``: the sums, norms and cross-micro-step maths come from these factors (the
identities of docs/design.md), without a ``[B, *param]`` tensor where the maths allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens.core.param_shapes import full_shape
from gradlens.core.sync import device_paths
from gradlens.kernels.base import (
    CHUNK_ELEMENTS, Kernel, _by_columns, _cat, _with_bias_column, add_into, qualname, sample_chunks, tgram_cheaper,
)

__all__ = ["LinearKernel", "TransposedLinearKernel", "OpLinear", "LINEAR", "CONV1D"]

#: qualified names of the layer classes whose calls may run fused (:attr:`Kernel.fused_layers`):
#: torch's ``nn.Linear`` and transformers' ``Conv1D`` (``y = x W + b``, ``W [d_in, d_out]``)
LINEAR, CONV1D = "torch.nn.modules.linear.Linear", "transformers.pytorch_utils.Conv1D"


def _add_row_sum(acc: Tensor, ones: Tensor, f: Tensor) -> None:
    """``acc += sum_n f_n`` (``f [b, numel]``, ``ones [1, b]``) as one ``1^T f`` product
    written into ``acc`` (any accumulator layout or dtype: then through a temporary)."""
    if acc.dtype == f.dtype and acc.is_contiguous():
        acc.view(1, -1).addmm_(ones, f)
    else:
        acc.add_((ones @ f).view(acc.shape))


def _zeros_into(acc: dict[str, Tensor], key: str, shape: tuple[int, ...], like: Tensor) -> None:
    """acc[key] = zeros of ``shape`` (in the buffer the accumulator dict offers for ``key``,
    see :func:`_addmm_into`), for sums that many in-place adds then build."""
    buffer = getattr(acc, "buffer", None)
    out = buffer(key, shape, like) if buffer else None
    acc[key] = like.new_zeros(shape) if out is None else out.zero_()


def _addmm_into(acc: dict[str, Tensor], key: str, m1: Tensor, m2: Tensor) -> None:
    """acc[key] += m1 @ m2. The first product of a window is written into the buffer the
    accumulator dict offers for ``key`` (``acc.buffer(key, shape, like)``, see
    :class:`gradlens.core.stats.Accumulators`) so that large sums reuse memory across
    windows instead of faulting in fresh pages every step."""
    if key in acc:
        acc[key].addmm_(m1, m2)
        return
    buffer = getattr(acc, "buffer", None)
    out = buffer(key, (m1.shape[0], m2.shape[1]), m1) if buffer else None
    acc[key] = m1 @ m2 if out is None else torch.mm(m1, m2, out=out)


class _LinearSums(Kernel):
    """The per-sample sums of an affine map with input ``[B, *, d_in]`` and output gradient
    ``[B, *, d_out]``: g_n = sum_t delta_nt a_nt^T (``[d_out, d_in]`` layout), from the
    factors. :class:`LinearKernel` adds the cross-micro-step factor forms; Hugging Face's
    transposed ``Conv1D`` (:class:`TransposedLinearKernel`) keeps the materialising ones."""

    factored = True
    #: the weight is ``[d_in, d_out]`` (transformers' ``Conv1D``), not ``[d_out, d_in]``
    _transposed = False

    @staticmethod
    def _flat(module, a, delta):
        b = delta.shape[0]
        return a.reshape(b, -1, a.shape[-1]), delta.reshape(b, -1, delta.shape[-1])

    def stack_key(self, module, attrs):
        return ()  # the norms read the input and output gradient only

    def sum_cost(self, module, a, out):
        return a.numel() * out.shape[-1]  # the weight's product

    def stacked_grad_sum(self, module, a, delta, k, attrs):
        x = a.reshape(k, -1, a.shape[-1])  # [k, b * T, d_in]: block i is use i's positions
        d = delta.reshape(k, -1, delta.shape[-1])
        out = {}
        if "weight" in attrs:  # one batched product for the k uses
            out["weight"] = torch.bmm(x.transpose(1, 2), d) if self._transposed else torch.bmm(d.transpose(1, 2), x)
        if "bias" in attrs:
            out["bias"] = d.sum(1)
        return out

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        attrs = self.params(module) if attrs is None else attrs
        out = {}
        if delta.dim() == 2:
            d, x = delta[start:stop], a[start:stop]
            if "weight" in attrs:
                out["weight"] = torch.einsum("no,ni->noi", d, x)
            if "bias" in attrs:
                out["bias"] = d
        else:
            x, d = self._flat(module, a[start:stop], delta[start:stop])
            if "weight" in attrs:
                out["weight"] = torch.bmm(d.transpose(1, 2), x)
            if "bias" in attrs:
                out["bias"] = d.sum(1)
        return out

    def entries(self, module, a, delta, attr, j):
        # (index_select: several times faster than advanced indexing for column gathers)
        if delta.dim() == 2:  # no sequence axis: g_n[o, i] = delta_no a_ni
            if attr == "bias":
                return delta.index_select(1, j)
            o, i = self._weight_index(module, j)
            return delta.index_select(1, o).mul_(a.index_select(1, i))
        x, d = self._flat(module, a, delta)  # [B, T, I], [B, T, O]
        width = d.shape[0] * d.shape[1]
        if attr == "bias":
            return _by_columns(lambda jk: d.index_select(2, jk).sum(1), j, width=width)
        o, i = self._weight_index(module, j)
        return _by_columns(lambda ok, ik: (d.index_select(2, ok) * x.index_select(2, ik)).sum(1),
                           o, i, width=width)

    @staticmethod
    def _weight_index(module, j: Tensor) -> tuple[Tensor, Tensor]:
        """(output row, input column) of flat weight index j (``[O, I]`` layout)."""
        width = module.in_features
        return j // width, j % width

    def outer_factors(self, module, a, delta):
        if delta.dim() != 2 or "weight" not in self.params(module) or device_paths(delta):
            return {}  # (the factor fast paths are CPU shortcuts with host reads)
        if not (torch.isfinite(a).all() and torch.isfinite(delta).all()):
            return {}  # inf * 0 = nan: let the materialised path see what autograd would
        return {"weight": (delta, a)}

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        if delta.dim() != 2:
            return self._reduce_seq(module, a, delta, want, names, acc, skip)
        # one pass over the factors; the two weight sums are addmm's into the accumulators
        d2 = a2 = None
        if "sum_grad_squared" in want or "batch_l2" in want:
            scratch = getattr(acc["sum_grad_squared"], "scratch", lambda tag, like: None)
            d2 = torch.square(delta, out=scratch("d2", delta))
            a2 = torch.square(a, out=scratch("a2", a))
        w, b = names.get("weight"), names.get("bias")
        if "sum_grad_squared" in want:
            if w:
                _addmm_into(acc["sum_grad_squared"], w, d2.t(), a2)
            if b:
                add_into(acc["sum_grad_squared"], b, d2.sum(0))
        if "grad_sum" in want:
            if w and ("grad_sum", "weight") not in skip:
                _addmm_into(acc["grad_sum"], w, delta.t(), a)
            if b and ("grad_sum", "bias") not in skip:
                add_into(acc["grad_sum"], b, delta.sum(0))
        if "batch_l2" not in want:
            return []
        d2n = d2.sum(1)
        out = []
        if w:
            out.append(d2n * a2.sum(1))
        if b:
            out.append(d2n)
        return out

    def _reduce_seq(self, module, a, delta, want, names, acc, skip, transposed: bool = False):
        """Inputs with a sequence axis ``[B, T, d]``. The sum of squares needs g_n itself: one
        materialising pass then gives the norms and the weight sum too. Each chunk of samples
        (:func:`sample_chunks`) is formed into one reused buffer and reduced in place, with no
        allocation per chunk: the norms as vector norms, the sums as ``1^T G`` products added
        into the window's accumulators, the squares in place. Without it, norms come from
        T x T Gram products and the sum from one matmul. ``transposed``: the weight is
        ``[d_in, d_out]`` (transformers' ``Conv1D``), g_n = sum_t a_nt delta_nt^T is formed in
        that layout."""
        w, b = names.get("weight"), names.get("bias")
        x, d = self._flat(module, a, delta)
        out = []
        b_l2 = True  # the bias' ||g_n||^2 still to add (not in the weight's Gram sum)
        if "sum_grad_squared" in want and w:
            n, shape = d.shape[0], tuple(full_shape(module.weight))
            numel = shape[0] * shape[1]
            sgs = acc["sum_grad_squared"]
            gsum = "grad_sum" in want and ("grad_sum", "weight") not in skip
            # a fused Linear call (gradlens.capture.events.WeightGrad, per-sample scale): dL/dW of this
            # call is sum_n g_n / scale, summed here instead of by autograd's own matmul
            fused = acc.get("weight_grad")
            wsum = d.new_zeros(shape) if fused is not None else None
            for q, on in (("sum_grad_squared", True), ("grad_sum", gsum and wsum is None)):
                if on and w not in acc[q]:  # zeros (in the pool's buffer): every chunk adds in
                    _zeros_into(acc[q], w, shape, d)
            chunks = list(sample_chunks(numel, n))
            c = chunks[0][1]
            scratch = getattr(sgs, "scratch", None)
            like = d[0, :1, :1].expand(c, numel)
            buf = scratch("g_n", like) if scratch is not None else None
            if buf is None:
                buf = d.new_empty(c, numel)
            ones = d.new_ones(1, c)
            l2w = d.new_empty(n) if "batch_l2" in want else None
            left, right = (x.transpose(1, 2), d) if transposed else (d.transpose(1, 2), x)  # [B, *, T], [B, T, *]
            for s, e in chunks:
                f = buf[: e - s]  # [b, numel] in the weight's layout
                torch.bmm(left[s:e], right[s:e], out=f.view(e - s, *shape))
                if l2w is not None:  # (one pass over f; a batched dot through bmm is 4x slower)
                    torch.linalg.vector_norm(f, dim=1, out=l2w[s:e])
                if wsum is not None:
                    _add_row_sum(wsum, ones[:, : e - s], f)
                elif gsum:
                    _add_row_sum(acc["grad_sum"][w], ones[:, : e - s], f)
                f.square_()
                _add_row_sum(sgs[w], ones[:, : e - s], f)
            if l2w is not None:
                out.append(l2w.square_())
            if wsum is not None:
                holder, scale = fused
                holder.value = (wsum / scale).to(module.weight.dtype)
                if gsum:
                    add_into(acc["grad_sum"], w, wsum)
        else:
            if "grad_sum" in want and w and ("grad_sum", "weight") not in skip:
                xf, df = x.reshape(-1, x.shape[-1]), d.reshape(-1, d.shape[-1])
                _addmm_into(acc["grad_sum"], w, *((xf.t(), df) if transposed else (df.t(), xf)))
            if "batch_l2" in want and w:
                t = d.shape[1]
                if 2 * t * t <= x.shape[-1] * d.shape[-1]:  # T x T Grams: ||g_n||^2 = <A A^T, D D^T>
                    gd = torch.bmm(d, d.transpose(1, 2))
                    gx = torch.bmm(x, x.transpose(1, 2))
                    if b:  # + the bias: ||sum_t d_nt||^2 = 1^T D D^T 1, in the same sum
                        out.append(gx.add_(1).mul_(gd).sum((1, 2)))
                        b_l2 = False
                    else:
                        out.append(gx.mul_(gd).sum((1, 2)))
                else:
                    out.append(self.batch_l2(module, a, delta)["weight"])
        # the bias' quantities still to form (its norms may already be in the Gram sum)
        squares, total, norms = ("sum_grad_squared" in want, "grad_sum" in want and ("grad_sum", "bias") not in skip,
                                 "batch_l2" in want and b_l2)
        if b and (squares or total or norms):
            db = d.sum(1)  # [B, O]: the bias gradient of each sample
            if squares:
                add_into(acc["sum_grad_squared"], b, db.square().sum(0))
            if total:
                add_into(acc["grad_sum"], b, db.sum(0))
            if norms:
                out.append(db.square().sum(1))
        return out if "batch_l2" in want else []

    def _use_gram(self, module, t: int) -> bool:
        return 2 * t * t <= module.in_features * module.out_features

    def batch_l2(self, module, a, delta):
        if delta.dim() == 2:
            d2 = delta.square().sum(1)
            out = {"weight": d2 * a.square().sum(1), "bias": d2}
        else:
            x, d = self._flat(module, a, delta)
            if not self._use_gram(module, d.shape[1]):
                return super().batch_l2(module, a, delta)
            gram = torch.bmm(x, x.transpose(1, 2)) * torch.bmm(d, d.transpose(1, 2))
            out = {"weight": gram.sum((1, 2)), "bias": d.sum(1).square().sum(1)}
        return {n: out[n] for n in self.params(module)}

    def sum_grad_squared(self, module, a, delta):
        if delta.dim() != 2:
            return super().sum_grad_squared(module, a, delta)
        d2 = delta.square()
        out = {"weight": d2.t() @ a.square(), "bias": d2.sum(0)}
        return {n: out[n] for n in self.params(module)}

    def grad_sum(self, module, a, delta):
        x = a.reshape(-1, a.shape[-1])
        d = delta.reshape(-1, delta.shape[-1])
        out = {"weight": d.t() @ x, "bias": d.sum(0)}
        return {n: out[n] for n in self.params(module)}


class LinearKernel(_LinearSums):
    """``nn.Linear`` (and ``F.linear`` calls, :class:`OpLinear`) with input ``[B, *, d_in]``;
    g_n = sum_t delta_nt a_nt^T. The sums come from the factors (:class:`_LinearSums`); the
    cross-micro-step maths (Gram, projections, sketches) too."""

    kind = "linear"
    rows_per_sample = True  # a sample's rows are more positions t
    fused_layers = {LINEAR: False}

    def routes_param_grads(self, module):
        return type(module) is nn.Linear  # one addmm / mm of the input, W^T and the bias

    def add_per_sample(self, module, a, delta, attr, out):
        x, d = self._flat(module, a, delta)
        if (attr == "weight" and delta.dim() != 2 and out.is_contiguous()
                and out.dtype == delta.dtype and out.shape == (d.shape[0], d.shape[-1], x.shape[-1])):
            out.view(d.shape[0], d.shape[-1], x.shape[-1]).baddbmm_(d.transpose(1, 2), x)
            return
        super().add_per_sample(module, a, delta, attr, out)

    # ---- cross-micro-step maths: the factor forms
    def matrix_dims(self, module):
        return module.out_features, module.in_features

    def positions(self, module, a, delta):
        return delta[0].numel() // delta.shape[-1]

    def seq_factors(self, module, a, delta, attrs):
        x, d = self._flat(module, a, delta)
        return _with_bias_column(x, attrs), d

    def use_tgram(self, module, a, delta, n=None):
        d_out, d_in = self.matrix_dims(module)
        return tgram_cheaper(d_out, d_in, self.positions(module, a, delta), n)

    def directional(self, module, a, delta, direction, attrs):
        b = delta.shape[0]
        D = {key: v.to(delta.dtype) for key, v in direction.items()}
        out = delta.new_zeros(b)
        d = delta.reshape(b, -1, delta.shape[-1])
        if "weight" in D:
            x = a.reshape(b, -1, a.shape[-1])
            out = out + (d * F.linear(x, D["weight"])).sum((1, 2))
        if "bias" in D:
            out = out + d.sum(1) @ D["bias"]
        return out

    def gram(self, module, pieces, attrs):
        """Without a sequence axis: ``(A A^T + 1[bias]) * (Delta Delta^T)``. With one: ``T x T``
        factor products where :func:`tgram_cheaper`, else :meth:`_gram_row_blocks`."""
        if pieces[0][1].dim() != 2:
            n = sum(d.shape[0] for _, d in pieces)
            same_t = len({self.positions(module, a, d) for a, d in pieces}) == 1
            if same_t and self.use_tgram(module, pieces[0][0], pieces[0][1], n):
                return super().gram(module, pieces, attrs)
            return self._gram_row_blocks(module, pieces, attrs)
        A = torch.cat([p[0] for p in pieces])
        Dl = torch.cat([p[1] for p in pieces])
        k = Dl @ Dl.T
        if "weight" in attrs:
            ka = A @ A.T
            k = k * (ka + 1) if "bias" in attrs else k * ka
        return k

    def gram_with_sum(self, module, a, delta, attrs) -> tuple[Tensor, Tensor | None]:
        """``([B, B] Gram, [d_out, d_in] sum_n g_n of the weight or None)`` of one micro-step's
        sequence input: the Gram of :meth:`gram`; where that materialises weight row blocks
        (:meth:`_gram_row_blocks`), the weight sum comes from the same blocks (what a fused
        Linear call takes as its dL/dW), else None."""
        if delta.dim() == 2 or "weight" not in attrs or self.use_tgram(module, a, delta, delta.shape[0]):
            return self.gram(module, [(a, delta)], attrs), None
        d_out, d_in = self.matrix_dims(module)
        wsum = delta.new_empty(d_out, d_in)  # every row block writes its rows once
        return self._gram_row_blocks(module, [(a, delta)], attrs, wsum, write_sum=True), wsum

    def _gram_row_blocks(self, module, pieces, attrs, wsum: Tensor | None = None, write_sum: bool = False):
        """``[n, n]`` Gram of a sequence Linear from materialised per-sample gradients, one block
        of weight rows at a time: ``K = sum_blocks G_r G_r^T + Db Db^T`` with ``G_r [n, rows,
        d_in]`` the rows ``r`` of every g_n (``Dl_n[:, r]^T X_n``, written into one reused
        buffer of at most :data:`CHUNK_ELEMENTS` elements, or one row when ``n d_in`` is more)
        and ``Db [n, d_out]`` the bias gradients. Memory stays bounded: nothing of size
        ``[n, D_l]`` is formed. ``wsum`` (``[d_out, d_in]``, optional): the blocks' sum over
        samples is added into it (``write_sum``: written, its old contents ignored)."""
        flats = [self._flat(module, a, d) for a, d in pieces]  # (X [b, T, d_in], Dl [b, T, d_out])
        n = sum(d.shape[0] for _, d in flats)
        d_out, d_in = self.matrix_dims(module)
        K = None
        if "weight" in attrs:
            rows = max(1, min(d_out, CHUNK_ELEMENTS // max(n * d_in, 1)))
            buf = flats[0][1].new_empty(n * rows * d_in)
            ones = buf.new_ones(1, n)
            for r0 in range(0, d_out, rows):
                r1 = min(d_out, r0 + rows)
                blk = buf[: n * (r1 - r0) * d_in].view(n, r1 - r0, d_in)
                s = 0
                for x, d in flats:
                    torch.bmm(d[:, :, r0:r1].transpose(1, 2), x, out=blk[s : s + d.shape[0]])
                    s += d.shape[0]
                f = blk.view(n, -1)
                K = f @ f.T if K is None else K.addmm_(f, f.T)
                if wsum is not None and write_sum and wsum.is_contiguous() and wsum.dtype == f.dtype:
                    torch.mm(ones, f, out=wsum[r0:r1].view(1, -1))
                elif wsum is not None:
                    if write_sum:
                        wsum[r0:r1].zero_()
                    _add_row_sum(wsum[r0:r1], ones, f)
        if "bias" in attrs:
            db = _cat([d.sum(1) for _, d in flats])
            K = db @ db.T if K is None else K.addmm_(db, db.T)
        return K

    def gram_materialises(self, module, a, delta):
        return False  # factor forms, T x T blocks or bounded row blocks: never [n, D_l]

    def mean_via_gram(self, module, a, delta, n):
        if delta.dim() != 2:
            return super().mean_via_gram(module, a, delta, n)
        d_out, d_in = self.matrix_dims(module)
        return n * (d_out + d_in) < d_out * d_in

    def sketch_factors(self, module, a, delta, attrs, u, vw, vb):
        b = delta.shape[0]
        ud = delta.reshape(b, -1, u.shape[1]) @ u.T  # [B, T, k]
        va = 0
        if "weight" in attrs:
            va = a.reshape(b, -1, vw.shape[1]) @ vw.T
        if "bias" in attrs:
            va = va + vb
        return (ud * va).sum(1)


class TransposedLinearKernel(_LinearSums):
    """Hugging Face ``transformers``' ``Conv1D``: ``y = x @ W + b`` with ``W [d_in, d_out]``;
    g_n(W) = sum_t a_nt delta_nt^T (the transpose of ``nn.Linear``'s). The sums come from the
    factors; projections and Grams from ``nn.Linear``'s factor forms on W^T; sketches from
    materialised slices. ``kind = "other"``: shared uses are summed as ``[B, *param]``, not
    concatenated as ``F.linear`` factors."""

    _transposed = True
    fused_layers = {CONV1D: True}

    def routes_param_grads(self, module):
        return qualname(type(module)) == CONV1D  # one addmm of the rows, W and the bias

    class _AsLinear:
        """The module as the ``nn.Linear`` of W^T: ``in_features``, ``out_features``, its
        parameters."""

        def __init__(self, module):
            self.in_features, self.out_features = full_shape(module.weight)
            self._m = module

        def named_parameters(self, recurse=False):
            return self._m.named_parameters(recurse=False)

    def per_sample(self, module, a, delta, start, stop, attrs=None):
        attrs = self.params(module) if attrs is None else attrs
        out = {}
        x, d = self._flat(module, a[start:stop], delta[start:stop])
        if "weight" in attrs:  # [b, d_in, d_out], contiguous in W's layout
            out["weight"] = torch.bmm(x.transpose(1, 2), d) if delta.dim() != 2 else torch.einsum("ni,no->nio", a[start:stop], delta[start:stop])
        if "bias" in attrs:
            out["bias"] = d.sum(1) if delta.dim() != 2 else delta[start:stop]
        return out

    def entries(self, module, a, delta, attr, j):
        return super().entries(self._AsLinear(module), a, delta, attr, j)

    @staticmethod
    def _weight_index(module, j: Tensor) -> tuple[Tensor, Tensor]:
        width = module.out_features  # W is [d_in, d_out]: j = i * d_out + o
        return j % width, j // width

    def outer_factors(self, module, a, delta):
        got = super().outer_factors(module, a, delta)
        return {"weight": (a, delta)} if got else {}

    # ---- cross-micro-step maths: nn.Linear's factor forms on W^T (g_n . g_m does not depend
    # on the layout; a direction's weight is transposed). The sketch keeps the per-attribute
    # blocks of materialised slices (no matrix_dims): its random blocks follow W's own layout.
    def directional(self, module, a, delta, direction, attrs):
        D = dict(direction)
        if "weight" in D:
            D["weight"] = D["weight"].t()
        return _AS_LINEAR.directional(self._AsLinear(module), a, delta, D, attrs)

    def gram(self, module, pieces, attrs):
        return _AS_LINEAR.gram(self._AsLinear(module), pieces, attrs)

    def gram_materialises(self, module, a, delta):
        return False  # T x T blocks or bounded row blocks, as nn.Linear's

    def mean_via_gram(self, module, a, delta, n):
        return _AS_LINEAR.mean_via_gram(self._AsLinear(module), a, delta, n)

    def reduce(self, module, a, delta, want, names, acc, skip=()):
        if delta.dim() != 2:
            # in W's [d_in, d_out] layout, as nn.Linear's: one materialising pass gives the sum
            # of squares, the norms and the sums, not a transposed slice per quantity; without
            # the sum of squares the norms come from T x T Grams
            return self._reduce_seq(module, a, delta, want, names, acc, skip, transposed=True)
        return Kernel.reduce(self, module, a, delta, want, names, acc, skip)

    def batch_l2(self, module, a, delta):
        lin = self._AsLinear(module)  # ||g_n||^2 is the same for the transposed weight
        if delta.dim() != 2 and not self._use_gram(lin, delta[0].numel() // delta.shape[-1]):
            return Kernel.batch_l2(self, module, a, delta)  # long sequences: materialised slices
        return super().batch_l2(lin, a, delta)

    def sum_grad_squared(self, module, a, delta):
        if delta.dim() != 2:
            return Kernel.sum_grad_squared(self, module, a, delta)
        out = {"weight": a.square().t() @ delta.square(), "bias": delta.square().sum(0)}
        return {n: out[n] for n in self.params(module)}

    def grad_sum(self, module, a, delta):
        x = a.reshape(-1, a.shape[-1])
        d = delta.reshape(-1, delta.shape[-1])
        out = {"weight": x.t() @ d, "bias": d.sum(0)}
        return {n: out[n] for n in self.params(module)}


#: nn.Linear's maths, for layers that present themselves as one (TransposedLinearKernel)
_AS_LINEAR = LinearKernel()


class OpLinear:
    """A functional ``F.linear(x, weight, bias)`` call seen during a tracked forward, presented
    to :class:`LinearKernel` as if it were an ``nn.Linear`` (only the tracked parameters count).
    Also the union of several calls of the same weight, their positions concatenated."""

    def __init__(self, weight: Tensor, bias: Tensor | None, tracked: tuple[str, ...]):
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self._tracked = tracked

    def named_parameters(self, recurse: bool = False):
        return [(n, getattr(self, n)) for n in self._tracked]

    def parameters(self, recurse: bool = False):
        return [p for _, p in self.named_parameters()]
