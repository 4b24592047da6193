"""The :class:`Tap`: the hooks of a tracked window (see :mod:`gradlens.capture`). It installs
the module hooks and replaced forwards, opens the mode (:mod:`gradlens.capture.mode`) for each
forward, follows the sample axis of every use, and hooks each use's output gradient so that
backward reports it to the Meter."""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from gradlens import compat
from gradlens.capture.composed import LossChain
from gradlens.capture.dtensor import is_dtensor, tp_use
from gradlens.capture.events import OnUse, OpUse, Site
from gradlens.capture.fused import _elementwise_forward, _TrackedForward, fused_forward_for
from gradlens.capture.marks import (
    _batch_first, _declared, _hints, _input_batch, _outputs, _tensors, _TensorMarks,
)
from gradlens.capture.rows import Rows, packed_owner, rows_axis
from gradlens.capture.replay import DERIVED, Replay
from gradlens.capture.mode import _UseMode
from gradlens.capture.parallel import check_batch_layout, refuse_context_parallel
from gradlens.capture.param_grads import _hook_param_grads
from gradlens.capture.registry import elementwise, forward_for, kernel_for, qualname
from gradlens.capture.tracked import declared_batch_dim
from gradlens.capture.sample_flow import SampleFlow, _in_sample_order
from gradlens.kernels.embedding import bag_rows as _bag_rows

__all__ = ["Tap"]

_NOTHING: frozenset = frozenset()

class Tap(SampleFlow):
    """The hooks of a tracked window (see :mod:`gradlens.capture`). ``install()`` / ``remove()``
    are idempotent; per micro-step state (use counts, parameters that received a gradient,
    parameters whose per-sample gradient is undefined) is read and reset by the Meter.

    The callbacks are the :class:`gradlens.measure.meter.Meter`'s event methods: capture calls down
    into the measurement, never up into the Lens.

    Args:
        model: the extended model.
        params: qualified name -> tracked parameter.
        on_use: receives each closed-form site use in backward (see :data:`OnUse`).
        on_op_use: receives ``(OpUse, output gradient)`` in backward.
        on_weight_grad: optional; receives autograd's own dL/dW of a 2-D ``nn.Linear`` call.
    """

    def __init__(
        self,
        model: nn.Module,
        params: dict[str, nn.Parameter],
        on_use: OnUse,
        on_op_use: Callable[[OpUse, Tensor], None],
        on_weight_grad: Callable[[Site, Tensor], None] | None = None,
    ):
        self.model = model
        self.on_use, self.on_op_use, self.on_weight_grad = on_use, on_op_use, on_weight_grad
        self._handles: list = []
        self._replaced: list[nn.Module] = []
        self._cp_wrapped: str | None = None  # a module wrapped with _ContextParallel (install)
        self._hint = _hints(model)
        self._mode = _UseMode(self)
        self._mode_depth = 0
        #: how deep the forward is inside closed-form sites: their inner calls are theirs
        self._skip = 0
        #: the outermost site being run took the mode off the torch-function stack (it was the
        #: innermost mode): its inner calls and the site hooks' own bookkeeping then pay no
        #: dispatch; its post-hook puts the mode back
        self._mode_out = False
        self._hooks_gen = 0  # bumped by remove(): hooks made before it do nothing (see _module_hooks)
        self._batch: int | None = None
        self._batch_dim = declared_batch_dim(model)
        #: the model runs under torch.compile (set by the Lens): while installed, the compiler's
        #: stance is "force_eager" (back to "default" on remove, or if the Tap is collected)
        self.run_eager = False
        self._eager = None
        self._declared = _declared(model)
        #: what the sample axis of a use could not be found for, this forward (one error lists all)
        self.axis_errors: list[str] = []
        #: the parameters of each of :attr:`axis_errors` (an error about parameters that turn out
        #: undefined anyway gives way to the undefined ones' error)
        self._axis_names: dict[str, frozenset] = {}
        self._axis_origin: dict[str, tuple] = {}
        #: the parameters before a mix are measured (``Lens(undefined="contribution")``, set by
        #: the Meter): their uses' unknown axes are errors of their own
        self.measures_tainted = False
        #: autograd node -> sample axis ((dim, factor) or None) of the data tensors the model's
        #: last forward returned (until the capture ends)
        self.output_nodes: dict = {}
        #: data tensor -> its sample axis (see :mod:`gradlens.capture.axes`)
        self._data = _TensorMarks()
        #: the losses of a tracked forward followed to what it returns (their units)
        self.chain = LossChain()
        self._derived = _TensorMarks()
        #: data tensors reduced over the samples (that require grad): tensor -> (linear, what)
        self._pooled = _TensorMarks()
        #: data tensors whose sample axis was lost: tensor -> where
        self._lost = _TensorMarks()
        #: data tensors without gradient computed across the samples (a capacity count over the
        #: batch's tokens): tensor -> where; what they meet with gradient is undefined
        self._coupled = _TensorMarks()
        #: products pairing the samples of two arguments (``a @ b.T``, a contrastive model's
        #: logits) and what elementwise operations made of them: tensor -> where; a parameter
        #: they meet is undefined (:meth:`_pair`)
        self._pairwise = _TensorMarks()
        self._visited: set = set()
        self._ops = 0
        self.forward_id = 0
        #: qualified names of the layer classes (:data:`gradlens.kernels.linear.LINEAR`,
        #: :data:`~gradlens.kernels.linear.CONV1D`) whose sequence calls take dL/dW from the Meter
        #: (set by the Meter from its plan, before install), where a site's kernel declares its
        #: class (:attr:`gradlens.kernels.base.Kernel.fused_layers`)
        self.fuse_weight_grad: frozenset = frozenset()
        #: ``(site, input, output) -> bool``: a routed use whose dL/dp the Meter forms itself
        #: (small stacked uses, :func:`gradlens.measure.deferred.sums_here`) gets no autograd-node
        #: hook; None: every routed use is hooked (set by the Meter)
        self.sums_here = None
        #: ``(elements, batch, materialised) -> bool``: whether a use of that size may be
        #: stacked (:func:`gradlens.measure.deferred.fits`; a fused Linear call is never stacked, so a
        #: small one runs unfused); None: nothing is stacked (set by the Meter)
        self.stacks_if = None
        #: the plans of this Tap's forwards (:mod:`gradlens.capture.replay`)
        self._replay = Replay()
        self.set_params(params)
        self.reset_micro()

    def set_params(self, params: dict[str, nn.Parameter]) -> None:
        """The tracked parameters (their sites are rebuilt; hooks reinstalled if installed)."""
        was = self.installed
        self.remove()
        self.params = dict(params)
        self._replay.reset()
        self._pid = {id(p): q for q, p in self.params.items()}
        self._single = {q: frozenset((q,)) for q in self.params}
        self.sites: dict[int, tuple[nn.Module, Site | None]] = {}
        self._names = {id(m): n for n, m in self.model.named_modules()}
        for name, mod in self.model.named_modules():
            kernel = kernel_for(mod)
            if kernel is None:
                continue
            own = {
                attr: self._pid[id(p)]
                for attr, p in mod.named_parameters(recurse=False)
                if id(p) in self._pid and p is self.params[self._pid[id(p)]]
            }
            site = Site(name or type(mod).__name__, mod, kernel, own) if own else None
            self.sites[id(mod)] = (mod, site)
        if was:
            self.install()

    #: what :meth:`reset_micro` starts afresh: what the forwards since noted (a pipeline stage
    #: keeps one per micro-batch, gradlens/distributed/pipeline.py)
    MICRO_STATE = ("uses", "received", "tainted", "axis_errors", "_axis_names", "_axis_origin", "output_nodes",
                   "_visited", "_ops")

    def reset_micro(self) -> None:
        self.uses: Counter = Counter()
        self.received: set[str] = set()
        self.tainted: dict[str, str] = {}  # qualified name -> the mixing layer it reaches
        #: site name -> whether each of its uses had the samples on dim 0, one row each (the
        #: compiled route's judgement, :mod:`gradlens.measure.compiled_route`)
        self.layouts: dict[str, bool] = {}
        self.axis_errors = []
        self._axis_names = {}
        self._axis_origin = {}
        self.output_nodes = {}
        self._visited = set()
        self._ops = 0

    @property
    def installed(self) -> bool:
        return bool(self._handles)

    # ------------------------------------------------------------------ install / remove
    def install(self) -> None:
        if self._handles:
            return
        # hooks are closures, not bound methods: copy.deepcopy(model) during a tracked window
        # must not copy the Tap (and the Lens, its sinks, ...)
        root, tap = self.model, self
        self._handles.append(
            # k=None: this hook was removed by an earlier pre-hook of the same forward (the Lens
            # refreshing its parameters, which then opens the forward itself); torch still calls
            # it, without kwargs: nothing to do
            root.register_forward_pre_hook(lambda m, a, k=None: None if k is None else tap._root_pre(m, a, k),
                                           with_kwargs=True)
        )
        for mod in root.modules():
            entry = self.sites.get(id(mod))
            site_mod = entry is not None
            if (mod is not root and not site_mod and elementwise(mod) and "forward" not in mod.__dict__
                    and id(mod) not in self._declared):
                # its forward does what its hooks would (opens the forward when called on its own)
                mod.forward = _TrackedForward(_elementwise_forward, mod, self)
                self._replaced.append(mod)
                continue
            pre, post = self._module_hooks(mod, entry[1] if site_mod else None, site_mod, mod is root)
            self._handles.append(mod.register_forward_pre_hook(pre, with_kwargs=mod is not root))
            self._handles.append(mod.register_forward_hook(post, always_call=True))
            fwd = forward_for(mod)
            if fwd is not None and any(id(p) in self._pid for p in mod.parameters()):
                mod.forward = _TrackedForward(fwd, mod, self)
                self._replaced.append(mod)
            elif site_mod and entry[1] is not None and "weight" in entry[1].params and "forward" not in mod.__dict__ \
                    and (fused := fused_forward_for(mod, entry[1].kernel, self.fuse_weight_grad)) is not None:
                mod.forward = _TrackedForward(fused, mod, self)  # (the class its kernel declares)
                self._replaced.append(mod)
        # context parallelism's module-wrapper style (refused at the model's forward)
        self._cp_wrapped = next((n for n, m in root.named_modules() if compat.context_parallel_wrapped(m)), None)
        # last, so that the module hooks of the root (a model that is one layer) run before it
        self._handles.append(root.register_forward_hook(lambda m, a, o: tap._root_post(m, a, o), always_call=True))
        for q, p in self.params.items():
            self._handles.append(p.register_post_accumulate_grad_hook(self._received(q)))
        self._apply_stance()

    def _apply_stance(self) -> None:
        """A tracked forward follows every operation in Python: under torch.compile it runs
        eagerly while the Tap is installed (no graph break, no recompile; the compiled graphs
        serve the untracked windows)."""
        if self.run_eager and self._handles and self._eager is None and compat.compile_stance() == "default":
            compat.set_compile_stance("force_eager")
            self._eager = weakref.finalize(self, compat.set_compile_stance, "default")

    def eager_from_now(self) -> None:
        """The model turned out to run compiled (a Lens given the plain module): the next
        tracked forwards run eagerly, also while the Tap stays installed across windows."""
        self.run_eager = True
        self._apply_stance()

    def remove(self) -> None:
        if self._eager is not None:
            self._eager()  # the stance back to "default" (once; the finalizer is then dead)
            self._eager = None
        for h in self._handles:
            h.remove()
        self._handles = []
        for mod in self._replaced:
            mod.__dict__.pop("forward", None)
        self._replaced = []
        if self._mode_depth:  # removed inside a tracked forward: the mode is on the stack once
            self._mode_depth = 0
            self.chain.end(None)
            if not self._mode_out and self._replay.state != "replay":
                self._mode.__exit__(None, None, None)
            self._replay.state = None
        self._mode_out = False
        self._skip = 0
        self._hooks_gen += 1  # hooks made before this removal do nothing if torch still runs them

    def _received(self, q: str):
        def hook(p):
            self.received.add(q)

        return hook

    # ------------------------------------------------------------------ forward hooks
    def _root_pre(self, module, args, kwargs):
        if not torch.is_grad_enabled() or compat.in_functorch_transform():
            return None  # no gradients here, or a torch.func transform of the model (an oracle)
        if self._mode_depth == 0:
            inputs = tuple(args) + tuple(kwargs.values())
            packed = [x for x in inputs if isinstance(x, PackedSequence)]
            if packed:  # a sample is a sequence: the rows of its data are the samples' time steps
                inputs = tuple(x for x in inputs if not isinstance(x, PackedSequence))
                self._batch = int(packed[0].batch_sizes[0])
                for p in packed:
                    owner = packed_owner(p.batch_sizes, p.sorted_indices, p.data.device)
                    self._data[p.data] = rows_axis(0, owner, self._batch)
            if self._cp_wrapped is not None:
                refuse_context_parallel(f"the model; {self._cp_wrapped or 'the model'} is wrapped with _ContextParallel")
            check_batch_layout([x for _, x in _tensors(inputs)], "the model")  # sequence / context parallel
            hint = self._batch_dim if self._batch_dim is not None else self._hint.get(id(module), 0)
            found = _input_batch(inputs, hint)
            if found is not None:
                ax, batch = found
                if not packed:
                    self._batch = batch
                for _, x in _tensors(inputs):
                    if x.dim() > ax and x.shape[ax] == self._batch:
                        self._data[x] = (ax, 1)
            self.forward_id += 1
            self.chain.begin()
            if not self._replay.begin(self, inputs, bool(packed) or module is not self.model):  # replayed: its plan's site hooks only
                self._mode.__enter__()
        self._mode_depth += 1
        return None

    def _root_post(self, module, args, output):
        if self._mode_depth:
            self._mode_depth -= 1
            if self._mode_depth == 0:
                if self._mode_out:  # (not reached: a site's post-hook always puts it back)
                    self._mode_out = False
                elif self._replay.state != "replay":
                    self._mode.__exit__(None, None, None)
                outs = list(output.values()) if isinstance(output, dict) else _outputs(output)
                if self._replay.state is not None:
                    self._replay.end(self, outs)  # a plan kept, or a replayed forward's outputs checked
                self.chain.end(output)
                data = self._data
                self.output_nodes = {
                    o.grad_fn: data[o] for o in outs if isinstance(o, Tensor) and o in data and o.grad_fn is not None
                }
        return None

    def _module_hooks(self, mod: nn.Module, site: Site | None, is_site: bool, is_root: bool):
        """The forward pre-hook and (always called) forward hook of ``mod``:

        * a submodule called on its own (``model.encoder(x)``, not inside the model's own
          forward) opens and closes the tracked forward (a root);
        * a module that says where its samples are (``batch_first``) checks its input's axis;
        * a closed-form site (a module with a kernel in the registry): its inner calls are its
          own (the mode steps off the torch-function stack for them, or passes them through),
          and its use is noted in the post-hook (:meth:`_site_use`).
        """
        declared = self._declared.get(id(mod))
        gen = self._hooks_gen
        is_bag = isinstance(mod, nn.EmbeddingBag)
        bag_args: list = [None, None]  # this call's offsets and per-sample weights (keywords too)
        use = self._site_use(mod, site, bag_args) if is_site else None
        entered: list[bool] = []  # per call of a submodule: whether it opened the forward
        # a registered tracked-window forward uses its parameters through the mode: a replayed
        # forward that reaches it leaves its plan
        mode_forward = forward_for(mod) is not None and any(id(p) in self._pid for p in mod.parameters())

        def pre(module, args, kwargs=None):  # kwargs too: hf_model(input_ids=..., labels=...)
            if not is_root:
                first = self._mode_depth == 0 and torch.is_grad_enabled() and not compat.in_functorch_transform()
                entered.append(first)
                if first:
                    self._root_pre(module, args, kwargs)
            if gen != self._hooks_gen or not self._mode_depth:  # (stale: removed earlier in this forward)
                return None
            if mode_forward and self._replay.state == "replay":
                self._replay.leave_now(self)
            if declared is not None and args and isinstance(args[0], Tensor):
                self._check_declared(module, declared, args[0])
            if is_bag and args and isinstance(args[0], Tensor) and args[0].dim() == 1:
                offsets = args[1] if len(args) > 1 else (kwargs or {}).get("offsets")
                self._bags((args[0], None, offsets), {"include_last_offset": module.include_last_offset})
                bag_args[:] = [offsets, args[2] if len(args) > 2 else (kwargs or {}).get("per_sample_weights")]
            if is_site:
                if args and compat.is_dtensor(args[0]):  # (a sequence-parallel layer input is refused)
                    check_batch_layout(args[:1], self._names.get(id(module), type(module).__name__))
                if not self._skip and compat.top_function_mode() is self._mode:
                    self._mode.__exit__(None, None, None)  # back in the site's post-hook
                    self._mode_out = True
                self._skip += 1
            return None

        def site_post(module, args, output):
            if not self._mode_depth:
                return None
            self._skip -= 1
            try:
                return use(module, args, output)
            finally:
                if self._mode_out and not self._skip:  # the outermost site: the mode back on
                    self._mode_out = False
                    self._mode.__enter__()

        if is_root:
            return pre, (site_post if is_site else _no_post)

        def post(module, args, output):
            try:
                return site_post(module, args, output) if is_site else None
            finally:
                if entered and entered.pop():
                    self._root_post(module, args, output)

        return pre, post

    def _site_use(self, mod: nn.Module, site: Site | None, bag_args: list | None = None):
        """The post-hook work of a closed-form site: its output takes the sample axis of its
        input (or its derived names), and its output gradient is hooked for the Meter."""
        routed = site is not None and site.kernel.routes_param_grads(mod)  # (declared by the kernel)
        stacks = routed and site.kernel.stack_key(mod, tuple(site.params)) is not None
        stateful = isinstance(mod, compat.BatchNormBase)  # kernel follows train/eval
        is_bag = isinstance(mod, nn.EmbeddingBag)
        may_fuse = site is not None and qualname(type(mod)) in site.kernel.fused_layers  # (only these run fused)
        data = self._data
        declared = site.kernel if site is not None else kernel_for(mod)
        n_in = declared.inputs if declared is not None else 1  # (a layer of several inputs: Bilinear)

        def use(module, args, output):
            nonlocal site
            if not (isinstance(output, Tensor) and args and isinstance(args[0], Tensor) and torch.is_grad_enabled()):
                return None
            rp = self._replay
            if rp.state is not None and rp.state != "record":  # a replayed forward: the plan's axis
                if n_in > 1 or is_bag:
                    rp.leave(self)
                else:
                    rp.replay_use(self, module, args[0], output)
            if n_in > 1:
                return self._multi_use(module, site, args, output, n_in)
            kernel = kernel_for(module) if stateful else None
            if site is not None and kernel is not None and type(kernel) is not type(site.kernel):
                site = Site(site.name, module, kernel, site.params)
            a = args[0]
            if is_dtensor(a):  # tensor parallelism: measured on the local shards (capture/dtensor.py)
                return tp_use(self, site, module, a, output)
            e = data._d.get(id(a))
            if e is not None and e[0]() is a and e[1] is not None:
                ax = e[1]  # data, with the axis carried to it
            elif self._is_data(a):
                ax = self.axis_of(a)  # the axis unknown, or made where the mode did not see it
            else:
                if rp.rec is not None:
                    rp.note(self, module, a, DERIVED, output, 0)
                if output.requires_grad:  # derived from parameters only (untracked ones: a constant)
                    names = self._derived.get(a, frozenset())
                    self._derived[output] = names if site is None else frozenset(site.params.values()) | names
                return None
            if rp.rec is not None:
                rp.note(self, module, a, ax, output,
                        len(site.params) if site is not None and output.requires_grad and not is_bag else 0)
            if is_bag:
                return self._bag_use(module, site, a, ax, bag_args, output)
            data[output] = ax if output.dim() >= a.dim() else None  # a layer keeps the axis
            if kernel is not None and kernel.mixes_samples:
                self._taint_before(a, f"{site.name if site else type(module).__name__!r} ({type(module).__name__} with batch statistics)")
            if self._pairwise._d and site is not None and (pair := self._pairwise.get(a)) is not None:
                for q in site.params.values():  # a layer applied to a pairwise product of the samples
                    self.tainted.setdefault(q, f"{site.name!r} applied to a pairwise product of the samples ({pair})")
            if site is None or not output.requires_grad:
                return None
            batch = self._batch
            rows = type(ax) is Rows
            what = f"the input of {site.name!r} ({type(module).__name__}, shape {tuple(a.shape)})"
            if ax is None:
                self._refuse_axis(output, what, site.params.values(), self._lost.get(a), detail=self._why_unknown(a))
                return None
            if rows:
                with compat.no_torch_function():
                    owner = ax.owner[ax.owner >= 0]
                    width = int(torch.bincount(owner, minlength=batch).max()) if owner.numel() else 1
                if width > 1 and not site.kernel.rows_per_sample:
                    self._refuse_axis(output, what + f" holds several rows of one sample on dim {ax[0]}",
                                      site.params.values())
                    return None
            elif ax[1] != 1 and not site.kernel.rows_per_sample:
                self._refuse_axis(output, what + f" holds the samples as the leading factor of dim {ax[0]}",
                                  site.params.values())
                return None
            uses = self.uses
            for q in site.params.values():
                uses[q] = uses.get(q, 0) + 1
            self.layouts[site.name] = self.layouts.get(site.name, True) and not rows and tuple(ax) == (0, 1)
            via: frozenset = _NOTHING  # attributes whose dL/dp of this call autograd reports
            if routed and self.on_weight_grad is not None and not (
                    stacks and self.sums_here is not None and self.sums_here(site, a, output)):
                with compat.no_torch_function():
                    via = _hook_param_grads(output, module, site, self.on_weight_grad)
            on_use, fid = self.on_use, self.forward_id
            wg = getattr(output, "_gradlens_weight_grad", None) if may_fuse else None
            if rows:  # the rows put back in sample order in backward (rows of no sample may be claimed later)
                a_rows, name, kernel_rows = a.detach(), site.name, site.kernel.rows_per_sample
                last = site.kernel.rows_last
                if wg is not None:

                    def hook(g):
                        a_b, g_b = _in_sample_order(a_rows, g, ax, batch, name, kernel_rows, rows_last=last)
                        wg.value = on_use(site, a_b, g_b, via, batch, fid, fused=True)

                else:

                    def hook(g):
                        a_b, g_b = _in_sample_order(a_rows, g, ax, batch, name, kernel_rows, rows_last=last)
                        return on_use(site, a_b, g_b, via, batch, fid)

            else:
                ax, factor = ax
                last = site.kernel.rows_last
                a_b = _batch_first(a, ax, factor, batch, last) if ax or factor != 1 else a
                if wg is not None:  # a fused call: the meter returns its dL/dW if it formed it

                    def hook(g):
                        wg.value = on_use(site, a_b, _batch_first(g, ax, factor, batch, last), via, batch, fid,
                                          fused=True)

                else:

                    def hook(g):
                        return on_use(site, a_b, _batch_first(g, ax, factor, batch, last), via, batch, fid)

            with compat.no_torch_function():  # bookkeeping, not a call of the forward
                compat.add_tensor_hook(output, hook)
            return None

        return use

    def _multi_use(self, module: nn.Module, site: Site | None, args: tuple, output: Tensor, n_in: int) -> None:
        """A call of a layer whose kernel reads ``n_in`` tensor inputs (:attr:`Kernel.inputs`,
        ``nn.Bilinear``): each input must carry the samples on the same axis, one row each; the
        kernel gets them batch-first, joined into one tensor (:meth:`Kernel.join_inputs`).
        Inputs that all come from parameters only make a derived output, as for one input."""
        xs = args[:n_in]
        label = site.name if site is not None else type(module).__name__
        if len(xs) < n_in or not all(isinstance(x, Tensor) for x in xs):
            lead = args[0]  # (the output keeps the first input's samples where no use is measured)
            self._data[output] = self.axis_of(lead) if self._is_data(lead) else None
            if site is not None and output.requires_grad:
                self._refuse_axis(output, f"the call of {label!r} ({type(module).__name__}) with {len(xs)} positional "
                                  f"tensor input(s) (it reads {n_in}: call it as module(x1, x2))", site.params.values())
            return None
        is_data = [self._is_data(x) for x in xs]
        if not any(is_data):
            names = frozenset(site.params.values()) if site is not None else frozenset()
            for x in xs:
                names |= self._derived.get(x, frozenset())
            if output.requires_grad:  # (no names: from untracked parameters, a constant)
                self._derived[output] = names
            return None
        axes = [self.axis_of(x) if d else None for x, d in zip(xs, is_data)]
        ok = all(type(ax) is tuple and ax[1] == 1 for ax in axes) and len(set(axes)) == 1
        self._data[output] = axes[0] if ok else None
        if site is None or not output.requires_grad:
            return None
        if not ok:
            what = f"the inputs of {label!r} ({type(module).__name__}, shapes {[tuple(x.shape) for x in xs]})"
            if not all(is_data):
                why = f": input {is_data.index(False) + 1} does not carry the samples (it comes from parameters or constants only)"
            elif any(ax is None for ax in axes):
                why = f": the sample axis of input {axes.index(None) + 1} is unknown" + self._why_unknown(xs[axes.index(None)])
            else:
                why = f": the samples are not one row each on one common axis ({axes})"
            self._refuse_axis(output, what + why, site.params.values())
            return None
        for q in site.params.values():
            self.uses[q] = self.uses.get(q, 0) + 1
        dim, batch = axes[0][0], self._batch
        with compat.no_torch_function(), torch.no_grad():
            a_b = site.kernel.join_inputs(module, tuple(_batch_first(x.detach(), dim, 1, batch) for x in xs))
        on_use, fid = self.on_use, self.forward_id

        def hook(g):
            return on_use(site, a_b, _batch_first(g, dim, 1, batch), _NOTHING, batch, fid)

        with compat.no_torch_function():
            compat.add_tensor_hook(output, hook)
        return None

    def _bag_use(self, module: nn.EmbeddingBag, site: Site | None, ids: Tensor, ax: Any, bag_args: list,
                 output: Tensor) -> None:
        """An ``nn.EmbeddingBag`` call: each bag is a sample (the rows of a 2-D input, or the
        bags its offsets cut a flat input into), and its ids, each weighted by what it adds to
        the bag (1 for ``"sum"``, one over the bag's non-padding count for ``"mean"``, times the
        per-sample weights), are that sample's rows for the embedding kernel."""
        batch = self._batch
        offsets, weights = bag_args
        what = f"the input of {site.name if site else type(module).__name__!r} (EmbeddingBag, shape {tuple(ids.shape)})"
        n = output.shape[0] if output.dim() == 2 else None
        if ids.dim() == 2:
            ok = ax is not None and type(ax) is tuple and ax == (0, 1)
        else:
            ok = ids.dim() == 1 and isinstance(offsets, Tensor) and n == batch
        self._data[output] = (0, 1) if ok else None
        if site is None or not output.requires_grad:
            return None
        names = site.params.values()
        if not ok:
            why = (" holds the bags on another dim than 0" if ids.dim() == 2 else
                   f": its {n} bags are not the micro-batch of {batch} samples")
            self._refuse_axis(output, what + why, names)
            return None
        with compat.no_torch_function(), torch.no_grad():
            ids_b, w_b = _bag_rows(module, ids.detach(), offsets, weights, batch)
        for q in names:
            self.uses[q] = self.uses.get(q, 0) + 1
        on_use, fid = self.on_use, self.forward_id

        def hook(g):
            return on_use(site, ids_b, w_b.to(g.dtype).unsqueeze(-1) * g.unsqueeze(1), _NOTHING, batch, fid)

        with compat.no_torch_function():
            compat.add_tensor_hook(output, hook)
        return None

    def _bags(self, args: tuple, kwargs: dict) -> None:
        """``F.embedding_bag(ids, weight, offsets, ...)`` of flat ids (or an ``nn.EmbeddingBag``
        called so): its bags are the samples. Where the ids are the model's input (their rows
        then made the micro-batch), the micro-batch becomes the number of bags and the ids' rows
        the bags' rows; bags that are not the micro-batch leave the output without a sample
        axis (refused where a parameter meets it)."""
        ids = args[0] if args else None
        offsets = args[2] if len(args) > 2 else kwargs.get("offsets")
        if not isinstance(ids, Tensor) or ids.dim() != 1 or not isinstance(offsets, Tensor):
            return
        last = bool(kwargs.get("include_last_offset", args[9] if len(args) > 9 else False))
        n = offsets.numel() - (1 if last else 0)
        ax = self._data.get(ids)
        if ax is None or type(ax) is not tuple or ax != (0, 1):
            return
        if self._batch != n and self._batch == ids.numel():
            self._batch = n  # the model's input was the flat ids: its samples are the bags
        if self._batch == n:
            with compat.no_torch_function(), torch.no_grad():
                starts = offsets[:n].to(ids.device)
                owner = torch.searchsorted(starts, torch.arange(ids.numel(), device=ids.device), right=True) - 1
            self._data[ids] = Rows(0, owner.clamp_min(0))

    # ------------------------------------------------------------------ the sample axis
    def _check_declared(self, module: nn.Module, declared: tuple[str, int], x: Tensor) -> None:
        """A module that says where its samples are (``batch_first``): an input whose carried
        axis is unknown takes it; one that disagrees is an error (listed with the others)."""
        what, want = declared
        if x.dim() != 3 or x not in self._data:
            return
        ax = self._data[x]
        if ax is None:
            self._data[x] = (want, 1)
        elif ax[0] != want:
            self._refuse_axis(
                x, f"{self.name_of(module)!r} ({type(module).__name__}, {what}) takes its samples on dim "
                f"{want} of its input {tuple(x.shape)}, but the model's input put them on dim {ax[0]}"
            )

    @property
    def batch(self) -> int | None:
        return self._batch


def _no_post(module, args, output) -> None:
    return None
