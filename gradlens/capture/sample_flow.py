"""How the samples' axis flows through a tracked forward: :class:`SampleFlow`, the part of the
:class:`~gradlens.capture.tap.Tap` that the mode (:mod:`gradlens.capture.mode`) calls for each
operation. An operation's output is given the axis its data arguments carry (``_carry``), rows
moved with a known index keep which sample each holds (:mod:`gradlens.capture.rows`), arguments
that meet with their samples in different places are settled or found to mix them
(``_settle``, ``_several``, ``_meet``: :mod:`gradlens.capture.samples`), and an axis never
guessed from sizes is refused with where it was lost (``axis_of``, ``axis_error``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradlens import compat
from gradlens.capture import axes, samples
from gradlens.capture.events import OpUse, Site
from gradlens.capture.losses import _LOSS_FUNCTIONS
from gradlens.capture.marks import _batch_first, _outputs
from gradlens.capture.rows import EVENTS, Mix, Pool, Rows, rows_axis, samples_first
from gradlens.capture.mode import _IS_SAMPLES
from gradlens.kernels.linear import LinearKernel, OpLinear


__all__ = ["SampleFlow"]

#: (func, einsum equation, output shape, data arguments' (position, shape, axis, requires grad))
#: -> (aligned, output axis): :meth:`SampleFlow._several`'s answers for plain axes (no tensor kept)
_SEVERAL: dict = {}


class SampleFlow:
    """The sample-axis methods of the :class:`~gradlens.capture.tap.Tap` (a base class: they
    read and write the Tap's marks ``_data``, ``_batch``, ``tainted`` and its sites)."""

    def _unary(self, x: Tensor, out: Any) -> None:
        """The marks the mode gives ``out``, computed from ``x`` alone by elementwise operations
        (an output of ``x``'s shape; see :func:`_elementwise_forward`): ``x``'s sample axis if
        ``x`` is data (None for data the mode did not see made), its names if ``x`` is a
        tracked parameter or derived from parameters only (with grad enabled), else nothing."""
        if not isinstance(out, Tensor):
            return
        e = self._data._d.get(id(x))
        if e is not None and e[0]() is x:
            self._data[out] = e[1] if out.shape == x.shape else None
            return
        got = self._not_data(0, x)
        if got is True:
            self._data[out] = None
        elif got is not None and torch.is_grad_enabled() and out.requires_grad:
            self._derived[out] = got[2]

    def _not_data(self, pos, x: Tensor):
        """A tensor argument without a data mark, at ``pos``: ``(pos, x, names)`` for a tracked
        parameter or a tensor derived from parameters only, True for a tensor that requires
        grad without either (computed by something the mode did not see, e.g. a custom kernel:
        data), else None (a constant)."""
        q = self._pid.get(id(x))
        if q is not None and x is self.params[q]:
            return (pos, x, self._single[q])
        e = self._derived._d.get(id(x))
        if e is not None and e[0]() is x:  # (no names: a slice of an untracked parameter, a constant here)
            return (pos, x, e[1]) if e[1] else None
        if x.requires_grad and not isinstance(x, nn.Parameter):
            return True
        return None

    def _carry(self, func, args, kwargs, first: Tensor | None, ax: Any, out, kind: int = 0,
               several: bool = False) -> None:
        """Every output of a data operation is data, with the sample axis its rule gives
        (``first`` the operation's first data argument, ``ax`` its axis; ``kind`` the mode's
        flags of ``func``; ``several``: its data arguments hold their samples in different places,
        or it is a product of several, to be checked)."""
        if out is None and args and isinstance(args[0], Tensor) and getattr(func, "__name__", "") == "__setitem__":
            out = args[0]  # written in place: the target's rows now hold what was written into them
        outs = [out] if isinstance(out, Tensor) else _outputs(out)
        data = self._data
        if first is None or ax is None or self._batch is None:
            if len(outs) == 1 and self._batch is not None:
                data[outs[0]] = self._unknown(func, args, kwargs, outs[0])
            else:
                place = self._lost.get(first) if first is not None else None
                for o in outs:
                    data[o] = None
                    if place is not None and o.requires_grad:
                        self._lost[o] = place
            return
        if several:
            if len(outs) == 1:
                data[outs[0]] = self._several(func, args, kwargs, outs[0])
            else:
                for o in outs:
                    data[o] = self._several(func, args, kwargs, o)
            return
        axs = self._axes(func, args, kwargs, first, ax, outs, kind)
        for o, got in zip(outs, axs):
            if got is None or got.__class__ in EVENTS:
                got = self._settle(got, func, args, kwargs, first, ax, o)
            data[o] = got

    def _axes(self, func, args, kwargs, first: Tensor, ax: Any, outs: list, kind: int) -> list:
        """The answers of the axis rules for the outputs ``outs`` (axes, or the events of
        :mod:`gradlens.capture.rows`), before :meth:`_settle`."""
        batch = self._batch
        if type(ax) is Rows:  # the rule moves the rows' dim as it would a sample axis of R rows
            r = first.shape[ax[0]]
            got = []
            for g in axes.carry(func, args, kwargs, first, (ax[0], 1), outs, r):
                if g is None:
                    got.append(None)
                elif g[1] == 1:
                    got.append(ax.at(g[0]))
                elif r == 1 and any(o.shape[k] == 1 for o in outs[:1] for k in range(min(ax[0] + 1, o.dim()))):
                    # one row merged into others ([1, 1, d] -> [1, d]): it stays a dim of one row
                    o = outs[0]
                    got.append(ax.at(max(k for k in range(min(ax[0] + 1, o.dim())) if o.shape[k] == 1)))
                else:  # the rows lead a merged dim of g[1] elements each
                    got.append(Rows(g[0], ax.owner.repeat_interleave(g[1])))
        else:
            got = axes.carry(func, args, kwargs, first, ax, outs, batch)
        if kind & _IS_SAMPLES:  # (called from the mode's handler: torch calls in the rules are not seen)
            got = samples.follow(func, args, kwargs, first, ax, outs, batch, got, self._data)
        return got

    def _settle(self, got: Any, func, args, kwargs, first: Tensor, ax: Any, out: Tensor) -> Any:
        """The axis an output keeps from an answer of the rules: a :class:`Mix` marks the
        parameters before the operation's data arguments undefined, a :class:`Pool` marks the
        output pooled (undefined before it unless it is a sum or mean); an axis lost is noted
        (where, for the error of a use that meets it)."""
        if got.__class__ is Mix:
            self._taint_args(args, kwargs, self._place(got.what))
            if not out.requires_grad:  # no gradient through it, but what it weights or selects
                self._coupled[out] = got.what  # depends on the other samples
            return got.axis
        if got.__class__ is Pool:
            if out.requires_grad:
                self._pooled[out] = (got.linear, got.what)
                if not got.linear:
                    self._taint_args(args, kwargs, self._place(got.what))
            return None
        if got is None and ax is not None and out.requires_grad:
            if func in _LOSS_FUNCTIONS and (kwargs or {}).get("reduction", "mean") in ("mean", "sum"):
                self._pooled[out] = (True, f"F.{func.__name__}")  # a sum (or mean) of the rows' losses
                return None
            self._lost[out] = self._place(
                f"{getattr(func, '__name__', func)} of a {list(first.shape)} tensor into {list(out.shape)}")
        return got

    def _couple(self, func, args, kwargs, out) -> None:
        """An operation on a tensor computed across the samples without gradient (a routing
        mask cut at an expert capacity counted over the batch's tokens): its outputs are such
        tensors too, and the parameters before its arguments with gradient are undefined (a
        sample's gradient depends on the other samples through it). Called only while some
        tensor is so marked."""
        coupled = self._coupled
        what = None
        for x in list(args) + list(kwargs.values()):
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(y, Tensor):
                    what = coupled.get(y)
                    if what is not None:
                        break
            if what is not None:
                break
        if what is None:
            return
        outs = [out] if isinstance(out, Tensor) else _outputs(out)
        for o in outs:
            coupled[o] = what
        if any(o.requires_grad for o in outs):
            fname = getattr(func, "__name__", str(func))
            self._taint_args(args, kwargs, self._place(
                f"{fname} of a tensor computed across the samples without gradient ({what}): a sample's "
                "routing or weights depend on the other samples (e.g. an expert capacity counted over the batch)"))

    def _pair(self, func, args, kwargs, out) -> None:
        """An operation on a pairwise product of the samples (``a @ b.T``: one argument's
        samples on its rows, another's on its columns; a CLIP or SigLIP logit matrix).
        Elementwise operations and transposes keep it pairwise; a contraction or a reduction
        ends it (rows of samples again: attention across the batch, ``softmax(h @ h.T) @ v``),
        as does a loss (fewer dims). A parameter it meets on the way (a learned temperature or
        bias of the logits) is undefined: no row of the matrix is one sample's own, so its share
        of the loss is no per-sample gradient. Called only while some tensor is so marked."""
        pairs = self._pairwise
        src = what = None
        for x in list(args) + list(kwargs.values()):
            for y in (x if isinstance(x, (list, tuple)) else (x,)):
                if isinstance(y, Tensor) and (got := pairs.get(y)) is not None:
                    src, what = y, got
                    break
            if src is not None:
                break
        name = getattr(func, "__name__", "")
        if src is None or name in samples.CONTRACTIONS or name in samples.REDUCTIONS:
            return
        outs = [out] if isinstance(out, Tensor) else _outputs(out)
        kept = [o for o in outs if isinstance(o, Tensor) and o.dim() >= src.dim() and o.requires_grad]
        for o in kept:
            pairs[o] = what
        if kept:
            for x in list(args) + list(kwargs.values()):
                if isinstance(x, Tensor) and x.requires_grad and pairs.get(x) is None:
                    why = self._place(
                        f"{name} of a pairwise product of the samples ({what}): an entry pairs two samples, "
                        "so a parameter applied to it has no per-sample gradient (a contrastive loss's "
                        "temperature or bias)")
                    self._taint_before(x, why)

    def _place(self, what: str) -> str:
        return what

    def _data_args(self, args, kwargs) -> list:
        """``[(position, tensor, axis)]``: the data arguments of a call (axis None where unknown;
        a tensor that requires grad without a mark is data the mode did not see made)."""
        out = []
        data = self._data._d
        items = []
        for i, x in enumerate(args):
            if isinstance(x, Tensor):
                items.append((i, x))
            elif isinstance(x, (list, tuple)):
                items.extend(((i, j), y) for j, y in enumerate(x) if isinstance(y, Tensor))
        if kwargs:
            items.extend((k, v) for k, v in kwargs.items() if isinstance(v, Tensor))
        for pos, x in items:
            e = data.get(id(x))
            if e is not None and e[0]() is x:
                out.append((pos, x, e[1]))
            elif self._not_data(pos, x) is True:
                out.append((pos, x, None))
        return out

    def _taint_args(self, args, kwargs, why: str, only=None) -> None:
        """Every tracked parameter before the data arguments (that require grad) of a call that
        mixes samples is undefined (``why``: the call)."""
        for _, t, _ in (only if only is not None else self._data_args(args, kwargs)):
            if t.requires_grad:
                self._taint_before(t, why)

    def _unknown(self, func, args, kwargs, out: Tensor) -> Any:
        """The axis of the one output of a call whose first data argument has no known sample
        axis: another argument's (checked with :meth:`_several`), or none; a pooled value (a
        sum over samples) stays pooled through linear operations, and any other operation on
        one makes the parameters before it undefined."""
        entries = self._data_args(args, kwargs)
        if getattr(func, "__name__", "") in samples.SHAPE_ONLY:
            entries = entries[:1]  # (the other tensor gives a shape or a dtype only)
        if getattr(func, "__name__", "") in samples.ROWS:  # rows moved by an index of no sample axis
            for _, t, ax in entries:  # (``zeros.index_add(0, sorted_ids, rows)``): the rows' rule
                if ax is not None:
                    got = self._axes(func, args, kwargs, t, ax, [out], _IS_SAMPLES)[0]
                    return got if got is not None and got.__class__ not in EVENTS else \
                        self._settle(got, func, args, kwargs, t, ax, out)
        if any(ax is not None for _, _, ax in entries):
            return self._several(func, args, kwargs, out, entries)
        if out.requires_grad:
            grads = [(pos, t) for pos, t, _ in entries if t.requires_grad]
            pooled = [self._pooled.get(t) for _, t in grads]
            if any(p is not None for p in pooled):
                what = next(p[1] for p in pooled if p is not None)
                fname = getattr(func, "__name__", str(func))
                if any(p is None for p in pooled):  # with a tensor whose samples are not followed
                    lost = next(t for (_, t), p in zip(grads, pooled) if p is None)
                    origin = self._lost.get(lost) or fname
                    self._refuse_axis(out, self._place(
                        f"{fname} combines a value pooled over the samples ({what}) with a tensor whose sample "
                        f"axis is unknown{self._why_unknown(lost)}"), origin=origin, fallback=True)
                    self._lost[out] = origin
                    return None
                op_linear = samples.linear_in_pooled(func, grads)
                stat = samples.batch_statistic(func, entries, self._pooled)
                if stat is not None:  # weighted by a statistic of the batch (a MoE router's expert fractions)
                    op_linear = False
                    self._taint_args(args, kwargs, self._place(
                        f"{fname} of a value pooled over the samples ({what}) by a statistic of the whole batch "
                        f"(a {list(stat.shape)} tensor computed from it without gradient, e.g. a MoE load-balancing "
                        f"loss's expert fractions: a sample's share depends on the other samples)"), only=entries)
                elif not op_linear:  # a loss term that is no sum over samples: undefined before it
                    self._taint_args(args, kwargs, self._place(
                        f"{fname} of a value pooled over the samples ({what})"), only=entries)
                self._pooled[out] = (op_linear and all(p[0] for p in pooled), what)
        for _, t, _ in entries:
            place = self._lost.get(t)
            if place is not None:
                self._lost[out] = place
                break
        return None

    def _several(self, func, args, kwargs, out: Tensor, entries: list | None = None) -> Any:
        """The axis of the one output of a call with several data arguments whose samples may sit
        in different places (or a product of them): its samples' axis when every argument that
        requires grad holds them on one output dim in the same rows (see
        :func:`gradlens.capture.samples.aligned`); otherwise the call mixes samples, and the
        parameters before its arguments are undefined."""
        if entries is None:
            entries = self._data_args(args, kwargs)
        key = None
        if all(type(ax) is tuple for _, _, ax in entries):
            key = (func, args[0] if args and isinstance(args[0], str) else None, out.shape,
                   tuple((pos, t.shape, ax, t.requires_grad) for pos, t, ax in entries))
            got = _SEVERAL.get(key)
            if got is not None and got[0] is True:
                return got[1]  # (the answers that mark something are worked out again)
        known = [(pos, t, ax) for pos, t, ax in entries if ax is not None]
        ok, axis = samples.aligned(func, args, kwargs, known, out)
        blind = [t for _, t, ax in entries if ax is None and t.requires_grad]
        if key is not None:
            if len(_SEVERAL) > 4096:
                _SEVERAL.clear()
            _SEVERAL[key] = (ok, axis)
        lost = [t for t in blind if t not in self._pooled]
        if lost:  # whether it mixes samples cannot be told: refused (where the axis was lost, and the fix)
            origin = self._lost.get(lost[0]) or samples.describe(func, entries)
            self._refuse_axis(out, self._place(
                f"{samples.describe(func, entries)} combines the samples with a tensor whose sample axis "
                f"is unknown{self._why_unknown(lost[0])}"), origin=origin, fallback=True)
            self._lost[out] = origin
            return None  # unknown poisons
        if blind or not ok:
            why = (f"combines the samples with a value pooled over them ({self._pooled.get(blind[0])[1]})" if blind
                   else "takes the samples from different places of its arguments")
            self._taint_args(args, kwargs, self._place(f"{samples.describe(func, entries)}, which {why}"),
                             only=entries)
            if not blind and out.requires_grad and samples.pairwise(func, args, entries, out):
                self._pairwise[out] = self._place(samples.describe(func, entries))
        elif ok == "pooled" and out.requires_grad:  # a sum over the samples of per-sample products
            self._pooled[out] = (True, f"{samples.describe(func, entries)}, summed over the samples")
        return axis

    def _why_unknown(self, x: Tensor) -> str:
        """Where the sample axis of data tensor ``x`` was lost, for an error."""
        p = self._pooled.get(x)
        if p is not None:
            return f", a value pooled over the samples ({p[1]})"
        place = self._lost.get(x)
        if place is not None:
            return f" (its sample axis was lost at {place})"
        if x not in self._data:
            return " (made by an operation gradlens did not see, e.g. inside torch.no_grad() or a custom kernel)"
        return ""

    def axis_of(self, x: Tensor) -> tuple[int, int] | None:
        """The sample axis ``(dim, factor)`` (or :class:`~gradlens.capture.rows.Rows`) of data
        tensor ``x``, as carried from the model's input; None where it is unknown (never read
        from sizes)."""
        return self._data[x] if x in self._data else None

    def _refuse_axis(self, t: Tensor, what: str, names=(), origin: str | None = None,
                     fallback: bool = False, detail: str = "") -> None:
        """A use whose sample axis is unknown: the micro-step's first use in backward raises
        ONE error naming every such use (:meth:`axis_error`), each ``what`` once (with the
        ``detail`` of its first time: where its axis was lost); ``names``: its parameters.
        ``origin``: where the axis was lost; ``fallback``: an operation (not a use) that combines
        such a tensor with the samples, named only if no use names the same origin."""
        if what in self._axis_names:
            return
        self._axis_names[what] = frozenset(names)
        self.axis_errors.append(what + detail)
        if origin is None and t is not None:
            origin = self._lost.get(t)
        self._axis_origin[what + detail] = (origin, fallback)
        self._axis_names[what + detail] = self._axis_names[what]

    def axis_error(self) -> RuntimeError | None:
        """The error for the uses of this micro-step's forwards whose sample axis is unknown
        (uses whose parameters are all undefined anyway, reaching an operation that mixes
        samples, are left to that error, unless they are measured as contributions)."""
        tainted = {} if self.measures_tainted else self.tainted
        errors = [w for w in self.axis_errors
                  if not (self._axis_names.get(w) and all(q in tainted for q in self._axis_names[w]))]
        origins = self._axis_origin
        named = {origins[w][0] for w in errors if w in origins and not origins[w][1]}
        errors = [w for w in errors if not (w in origins and origins[w][1] and origins[w][0] in named)]
        if not errors:
            return None
        return RuntimeError(
            f"gradlens cannot tell the sample axis at {len(errors)} place(s) of the forward "
            f"(micro-batch of {self._batch}): " + "; ".join(errors) + ". Declare the sample axis "
            "of the model's input once (gradlens.extend(model, batch_dim=1) for [T, B, ...] "
            "inputs), keep the samples on one axis (or as the leading factor of one axis) through "
            "views, reshapes and permutes, or leave these modules out with Lens(..., exclude=[...])"
        )

    def _is_data(self, x: Tensor) -> bool:
        """``x`` carries samples: computed from the model's inputs, or (made by an operation the
        mode cannot see, e.g. a custom kernel) requiring grad without being derived from
        parameters only."""
        if x in self._data:
            return True
        return x.requires_grad and x not in self._derived and id(x) not in self._pid

    # ------------------------------------------------------------------ operations
    def _meet(self, func, args, kwargs, tracked, out) -> None:
        """An operation combining tracked parameters (or derived tensors) with the batch."""
        outs = _outputs(out)
        if not outs or not outs[0].requires_grad:
            return
        fname = getattr(func, "__name__", str(func))
        if len(outs) != 1:
            raise NotImplementedError(
                f"gradlens: {fname} combines the parameters {sorted(set().union(*(t[2] for t in tracked)))} "
                "with the batch and returns several tensors; per-sample gradients of such "
                "operations are not supported: exclude these parameters (Lens(..., exclude=[...]))"
            )
        out = outs[0]
        batch = self._batch
        ax = self.axis_of(out)
        if ax is None:
            names = set().union(*(t[2] for t in tracked))
            data = next((a for a in args if isinstance(a, Tensor) and a in self._data), None)
            self._refuse_axis(
                out,
                f"the output of {fname} (shape {tuple(out.shape)}), which uses the parameters {sorted(names)}",
                names,
                self._lost.get(data) if data is not None else None,
                detail=self._why_unknown(data) if data is not None else "",
            )
            return
        rows = ax.owner if type(ax) is Rows else None
        ax, factor = ax
        k = self._ops
        self._ops += 1
        positions = {t[0] for t in tracked}
        if func is F.linear and positions <= {1, 2} and 1 in positions and isinstance(args[0], Tensor):
            w = args[1]
            bias = args[2] if len(args) > 2 else None
            direct = all(t[1] is self.params.get(next(iter(t[2]))) for t in tracked)
            if direct and (bias is None or 2 in positions or not bias.requires_grad):
                names = {"weight": next(iter(tracked[[t[0] for t in tracked].index(1)][2]))}
                if 2 in positions:
                    names["bias"] = next(iter(tracked[[t[0] for t in tracked].index(2)][2]))
                site = Site(f"op{k}:{names['weight']}", OpLinear(w, bias, tuple(names)), LinearKernel(), names)
                for q in names.values():
                    self.uses[q] += 1
                on_use, fid = self.on_use, self.forward_id
                if rows is not None:  # the rows put back in sample order in backward (Linear: several per sample too)
                    rax, a_rows, name = self._data[out], args[0].detach(), site.name

                    def hook(g):
                        a_b, g_b = _in_sample_order(a_rows, g, rax, batch, name, True, a_axis=rax.at(ax))
                        return on_use(site, a_b, g_b, False, batch, fid)

                    compat.add_tensor_hook(out, hook)
                    return
                a_b = _batch_first(args[0], ax, factor, batch)
                compat.add_tensor_hook(out, lambda g: on_use(site, a_b, _batch_first(g, ax, factor, batch), False, batch, fid))
                return
        detached = tuple(
            a.detach() if isinstance(a, Tensor) else
            (type(a)(x.detach() if isinstance(x, Tensor) else x for x in a) if isinstance(a, (list, tuple)) else a)
            for a in args
        )
        kw = {n: (v.detach() if isinstance(v, Tensor) else v) for n, v in kwargs.items()}
        use = OpUse(f"op{k}:{fname}", func, detached, kw, list(tracked), ax, batch, self.forward_id, factor, rows)
        for _, _, names in tracked:
            for q in names:
                self.uses[q] += 1
        on_op_use = self.on_op_use
        compat.add_tensor_hook(out, lambda g: on_op_use(use, g))

    def _taint_before(self, x: Tensor, layer: str) -> None:
        """Every tracked parameter whose output reaches ``x`` (the input of a layer that mixes
        samples) has an undefined per-sample gradient."""
        if x.grad_fn is None:  # a tracked parameter itself (a leaf: no graph to walk)
            q = self._pid.get(id(x))
            if q is not None and x is self.params[q]:
                self.tainted.setdefault(q, layer)
            return
        stack = [x.grad_fn]
        visited = self._visited
        while stack:
            node = stack.pop()
            if node is None or node in visited:
                continue
            visited.add(node)
            var = getattr(node, "variable", None)
            if var is not None:
                q = self._pid.get(id(var))
                if q is not None:
                    self.tainted.setdefault(q, layer)
                continue
            stack.extend(n for n, _ in node.next_functions)

    def name_of(self, module: nn.Module) -> str:
        """The qualified name of a module of the model (``""`` for the root)."""
        return self._names.get(id(module), type(module).__name__)

    def mark_data(self, x: Tensor, axis: int = 0) -> None:
        """Declare ``x`` (made inside a tracked forward, e.g. an RNN's zero initial state) part
        of the batch, its samples on dim ``axis``. A dim that does not have the micro-batch size
        leaves ``x``'s axis unknown (a use that meets it is refused, naming this place)."""
        if self._batch is not None and not (-x.dim() <= axis < x.dim() and x.shape[axis] == self._batch):
            self._data[x] = None
            self._lost[x] = (f"a tensor of shape {list(x.shape)} declared with its samples on dim {axis}, "
                             f"not of the micro-batch size {self._batch}")
            return
        self._data[x] = (axis % x.dim(), 1)

    def mark_rows(self, x: Tensor, axis: int, owner: Tensor | None) -> None:
        """Declare ``x`` part of the batch, row ``r`` of its dim ``axis`` holding sample
        ``owner[r]`` (None: the samples in order), e.g. a hidden state in the order of
        sequences sorted by length."""
        if owner is None:
            self.mark_data(x, axis)
        else:
            with compat.no_torch_function():
                self._data[x] = rows_axis(axis % x.dim(), owner.to(x.device), self._batch)


def _in_sample_order(a: Tensor, g: Tensor, ax: Rows, batch: int, name: str, rows_per_sample: bool,
                     a_axis: Rows | None = None, rows_last: bool = False) -> tuple[Tensor, Tensor]:
    """A use's input and output gradient with rows on a :class:`Rows` axis, put in sample order
    (:func:`gradlens.capture.rows.samples_first`), in backward: rows that were of no sample in
    the forward (a constant joined to the batch) have been claimed by then. Rows still of no
    sample, or several rows of one sample for a kernel that takes one, are refused. A sample's
    rows come on dim 1, or last with ``rows_last`` (:attr:`gradlens.kernels.Kernel.rows_last`)."""
    try:
        with torch.no_grad():
            _, pos, width = ax.layout(batch)
            if width > 1 and not rows_per_sample:
                raise ValueError(f"several rows of one sample on dim {ax[0]}")
            a_b, g_b = samples_first(a, a_axis or ax, batch), samples_first(g, ax, batch)
            if rows_last and pos is not None:  # [B, R, ...] -> [B, ..., R]
                a_b, g_b = a_b.movedim(1, -1), g_b.movedim(1, -1)
            return a_b, g_b
    except ValueError as err:
        raise RuntimeError(
            f"gradlens cannot measure the use {name!r}: its input's rows on dim {ax[0]} are not one sample "
            f"each ({err}); make a constant joined to the batch's rows from the batch's own tensor (an "
            "initial state as torch.zeros_like(h[:k]) rather than torch.zeros(k, ...)), or leave the module out: "
            "Lens(..., exclude=[...])"
        ) from None
