"""Every private torch, DDP and GradScaler API gradlens relies on, in one place.

Each entry is a small function (or name) that says which torch API it wraps and the torch
releases it was checked on. ``tests/test_compat.py`` exercises every entry against the
installed torch and fails naming the entry when a release changes it, so a torch upgrade shows
at once what to mend here, and nowhere else. Entries that can fall back safely do so at run
time (stated per entry); the guard tests still fail on the change.

Checked on: torch 2.13.0 (CPU). The same attributes exist, with the same meaning, since
torch 2.1 unless an entry says otherwise.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

try:
    from torch.nn.modules.batchnorm import _BatchNorm
except ImportError as err:  # pragma: no cover - guarded by tests/test_compat.py
    raise ImportError(
        f"gradlens.compat.BatchNormBase: torch {torch.__version__} has no "
        "torch.nn.modules.batchnorm._BatchNorm; update BatchNormBase in gradlens/compat.py"
    ) from err

__all__ = [
    "dtensor_local", "BatchNormBase", "LossBase", "ConvTransposeBase", "InstanceNormBase", "run_pre_hooks_added",
    "pre_hook_ids", "register_load_state_dict_pre_hook", "batchnorm_check_input_dim", "set_module_parameter", "sparse_values", "fsdp_module_params", "named_parameters", "conv_forward", "mha_packed_in_proj", "compiled_original",
    "in_functorch_transform", "no_torch_function", "top_function_mode", "add_tensor_hook", "storage_use_count", "queue_backward_callback", "tensor_version",
    "is_view", "view_base", "foreach_mul_", "foreach_add_", "node_name", "node_saved", "is_builtin_node", "embedding_saved", "view_input_sizes", "slice_dim", "is_compiled_node", "compile_stance", "set_compile_stance", "compiled_in_place",
    "active_ddp_module", "ddp_grad_sync", "ddp_comm_hook", "ddp_average_departure",
    "ddp_python_reducer", "ddp_delayed_params", "ddp_static_graph_pending", "ddp_join_enabled",
    "process_group_timeout",
    "grad_scaler_scale", "optimizer_grad_scale",
    "fsdp_params", "fsdp_unsharded_param", "fsdp_param_slots",
    "pipeline_kind", "pipeline_schedule_parts", "PIPELINE_SETUP", "context_parallel_active", "context_parallel_wrapped", "is_dtensor",
]

# ---------------------------------------------------------------------------- modules

#: ``torch.nn.modules.batchnorm._BatchNorm``: the base of BatchNorm1d/2d/3d (and SyncBatchNorm,
#: LazyBatchNorm*); the one class that says "a BatchNorm with running statistics".
BatchNormBase = _BatchNorm

#: ``torch.nn.modules.loss._Loss``: the base of torch's loss modules (``nn.CrossEntropyLoss``,
#: ``nn.MSELoss``, ...), each with a ``reduction`` attribute.
LossBase = nn.modules.loss._Loss

#: ``torch.nn.modules.conv._ConvTransposeNd``: the base of ConvTranspose1d/2d/3d (their weight
#: is ``[C_in, C_out / groups, *k]``, input channels first).
ConvTransposeBase = nn.modules.conv._ConvTransposeNd

#: ``torch.nn.modules.instancenorm._InstanceNorm``: the base of InstanceNorm1d/2d/3d (and their
#: lazy forms).
InstanceNormBase = nn.modules.instancenorm._InstanceNorm


def run_pre_hooks_added(module: nn.Module, before: set[int], args: tuple, kwargs: dict) -> None:
    """Run the forward pre-hooks of ``module`` registered since ``before`` (the hook ids of
    ``module._forward_pre_hooks`` then), with ``kwargs`` where a hook was registered
    ``with_kwargs=True`` (``module._forward_pre_hooks_with_kwargs``). torch runs the hooks of a
    forward as they were when it started; this runs, inside a pre-hook, those added meanwhile.
    Their return values are ignored. Checked on torch 2.1-2.14."""
    for hid, hook in list(module._forward_pre_hooks.items()):
        if hid not in before:
            if hid in module._forward_pre_hooks_with_kwargs:
                hook(module, args, kwargs)
            else:
                hook(module, args)


def pre_hook_ids(module: nn.Module) -> set[int]:
    """The ids of ``module``'s forward pre-hooks (``module._forward_pre_hooks``), for
    :func:`run_pre_hooks_added`."""
    return set(module._forward_pre_hooks)


def register_load_state_dict_pre_hook(module: nn.Module, hook: Callable[..., None]) -> Any:
    """Register ``hook(module, state_dict, prefix, local_metadata, strict, missing_keys,
    unexpected_keys, error_msgs)``, run before ``module``'s own entries of a state dict load
    (it may add or change them): ``nn.Module.register_load_state_dict_pre_hook`` (public since
    torch 2.5), ``_register_load_state_dict_pre_hook(hook, with_module=True)`` before. Returns
    the removable handle."""
    public = getattr(nn.Module, "register_load_state_dict_pre_hook", None)
    if public is not None:
        return public(module, hook)
    return module._register_load_state_dict_pre_hook(hook, with_module=True)  # pragma: no cover - torch < 2.5


def batchnorm_check_input_dim(module: nn.Module, x: Tensor) -> None:
    """A BatchNorm's own check of its input's number of dims (``_BatchNorm._check_input_dim``:
    BatchNorm1d takes 2-D or 3-D input, 2d 4-D, 3d 5-D); raises its ``ValueError``."""
    module._check_input_dim(x)


def set_module_parameter(module: nn.Module, name: str, value: Any) -> Any:
    """Put ``value`` (a parameter, or None) into ``module._parameters[name]`` without
    ``nn.Module.__setattr__``'s checks; returns what was there (None if nothing). For a
    temporary swap that is undone afterwards (FSDP2's unsharded parameters)."""
    before = module._parameters.get(name)
    module._parameters[name] = value
    return before


def sparse_values(t: Tensor) -> Tensor:
    """The stored values of a sparse COO tensor (``t._values()``: no coalescing, so duplicates
    stay separate), or ``t`` itself if it is dense."""
    return t._values() if t.is_sparse else t


def named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """What ``model.named_parameters()`` yields (each parameter once, under its first name, in
    the same order), read from the modules' ``_modules`` and ``_parameters`` dicts: several
    times faster than torch's chain of generators, for a walk done at every tracked window.
    A model with a module class that overrides ``named_parameters`` or ``named_modules`` gets
    torch's own."""
    out: list[tuple[str, nn.Parameter]] = []
    seen: set[int] = set()  # parameters and modules met
    plain = _PLAIN_WALK

    def visit(prefix: str, m: nn.Module) -> bool:
        seen.add(id(m))
        cls = type(m)
        ok = plain.get(cls)
        if ok is None:
            ok = plain[cls] = (cls.named_parameters is nn.Module.named_parameters
                               and cls.named_modules is nn.Module.named_modules)
        if not ok:
            return False
        for k, p in m._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((prefix + k, p))
        for k, c in m._modules.items():
            if c is not None and id(c) not in seen and not visit(prefix + k + ".", c):
                return False
        return True

    return out if visit("", model) else list(model.named_parameters())


#: module class -> whether it walks its parameters as nn.Module does (named_parameters)
_PLAIN_WALK: dict[type, bool] = {}


def conv_forward(module: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``module._conv_forward(x, weight, bias)`` of an ``nn.Conv1d/2d/3d``: the layer's own
    convolution (its padding mode, stride, dilation, groups) with another ``weight``
    (``[C_out', C_in / groups, *kernel]``) and ``bias``; ``x`` ``[B, C_in, *spatial]``."""
    return module._conv_forward(x, weight, bias)


def mha_packed_in_proj(mha: nn.Module) -> bool:
    """True if an ``nn.MultiheadAttention`` keeps q, k, v projections in one packed
    ``in_proj_weight`` ``[3E, E]`` (``mha._qkv_same_embed_dim``: kdim == vdim == embed_dim),
    False if it has ``q_proj_weight``/``k_proj_weight``/``v_proj_weight``."""
    return bool(mha._qkv_same_embed_dim)


def compiled_original(model: nn.Module) -> nn.Module:
    """The module that ``torch.compile(model)`` wraps (``OptimizedModule._orig_mod``), or
    ``model`` itself when it is not a compiled wrapper."""
    return getattr(model, "_orig_mod", model)


def compiled_in_place(model: nn.Module) -> bool:
    """True after ``model.compile()`` (``nn.Module._compiled_call_impl`` is set): calling the
    module itself runs the compiled graph."""
    return getattr(model, "_compiled_call_impl", None) is not None


def compile_stance() -> str:
    """The current ``torch.compiler.set_stance`` stance (``"default"``, ``"force_eager"``,
    ...), read from ``torch._dynamo.eval_frame._stance.stance``; ``"default"`` where torch has
    no stances."""
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # pragma: no cover - a torch build without dynamo
        return "default"
    stance = getattr(eval_frame, "_stance", None)
    return getattr(stance, "stance", "default")


def set_compile_stance(stance: str) -> None:
    """``torch.compiler.set_stance(stance)``, called as a function (it sets the stance at
    once); a no-op on a torch without stances."""
    setter = getattr(torch.compiler, "set_stance", None)
    if setter is not None:
        setter(stance)


# ---------------------------------------------------------------------------- autograd


def in_functorch_transform() -> bool:
    """True inside a ``torch.func`` transform (vmap, grad, jvp, ...):
    ``torch._C._functorch.maybe_current_level()`` is not None there. Falls back to False if
    the function is gone (hooks then behave as outside a transform)."""
    try:
        return torch._C._functorch.maybe_current_level() is not None
    except AttributeError:  # pragma: no cover - guarded by tests/test_compat.py
        return False


#: ``torch._C.DisableTorchFunction``: a context in which torch calls skip ``__torch_function__``
#: (modes and subclasses), so a hook's own bookkeeping (``Tensor.register_hook``) inside a
#: tracked forward does not go through gradlens' mode. Its absence fails at import here.
no_torch_function = torch._C.DisableTorchFunction


def top_function_mode() -> Any:
    """The innermost active ``TorchFunctionMode`` (the one the next torch call goes to), or
    None: ``torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)`` (what
    ``torch.overrides._get_current_function_mode`` reads). Inside a mode's own
    ``__torch_function__`` that mode is popped, so it is not the top there. Falls back to None
    if the API is gone (callers then leave the stack as it is)."""
    try:
        n = _len_function_stack()
        return _function_stack_at(n - 1) if n > 0 else None
    except Exception:  # pragma: no cover - guarded by tests/test_compat.py
        return None


_len_function_stack = getattr(torch._C, "_len_torch_function_stack", None)
_function_stack_at = getattr(torch._C, "_get_function_stack_at", None)


def add_tensor_hook(t: Tensor, hook: Callable[[Tensor], Any]) -> None:
    """``t.register_hook(hook)`` without its handle (the hook stays for ``t``'s lifetime), at a
    fraction of its Python cost: what ``Tensor.register_hook`` does, done directly. ``hook``
    goes last in ``t._backward_hooks`` (the ordered dict of hooks that autograd calls with the
    gradient of ``t``; created and registered on ``t.grad_fn`` with
    ``grad_fn._register_hook_dict(t)`` by the first hook), keyed by itself, so that the keys of
    ``register_hook``'s handles (ints) never meet it. ``t`` must require grad and not be a
    tensor subclass with ``__torch_function__`` (those go through ``register_hook``)."""
    if (type(t) is not Tensor and type(t) is not nn.Parameter) or not t.requires_grad:
        t.register_hook(hook)  # (raises for a tensor that does not require grad)
        return
    hooks = t._backward_hooks
    if hooks is None:
        t._backward_hooks = hooks = OrderedDict()
        if t.grad_fn is not None:
            t.grad_fn._register_hook_dict(t)
    hooks[hook] = hook


def storage_use_count(t: Tensor) -> int | None:
    """How many tensors (views, detached aliases) share ``t``'s memory:
    ``torch._C._storage_Use_Count(t.untyped_storage()._cdata)``. None if the API is gone
    (callers then treat the memory as shared: never reused)."""
    try:
        return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))
    except Exception:  # pragma: no cover - guarded by tests/test_compat.py
        return None


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn()`` when the current backward pass has finished (before ``backward()``
    returns): ``torch.autograd.Variable._execution_engine.queue_callback``. Only valid while a
    backward runs (from a tensor or module hook)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def tensor_version(t: Tensor) -> int:
    """``t._version``: the counter autograd bumps at every in-place change of ``t``'s data
    (shared by all views of the same memory)."""
    return t._version


def is_view(t: Tensor) -> bool:
    """``t._is_view()``: True if ``t`` is a view of another tensor's memory."""
    return t._is_view()


def view_base(t: Tensor) -> Tensor | None:
    """``t._base``: the tensor whose memory the view ``t`` reads (the root of a chain of
    views), None if ``t`` is no view."""
    return t._base


def foreach_mul_(tensors: Sequence[Tensor], factor: Tensor | float) -> None:
    """``torch._foreach_mul_(tensors, factor)``: multiply every tensor in place by ``factor``
    (a number or a 0-d tensor) in one fused call."""
    torch._foreach_mul_(list(tensors), factor)


def foreach_add_(tensors: Sequence[Tensor], others: Sequence[Tensor]) -> None:
    """``torch._foreach_add_(tensors, others)``: ``tensors[i] += others[i]`` in place for every
    i, in one fused call (pairs of equal shapes and dtypes)."""
    torch._foreach_add_(list(tensors), list(others))


def node_name(fn: Any) -> str | None:
    """The class name of an autograd node (``grad_fn``), e.g. ``"AddmmBackward0"``,
    ``"TBackward0"``, ``"EmbeddingBackward0"``; None for no node. These names are generated
    from torch's derivatives.yaml and carry a version suffix (the ``0``)."""
    return None if fn is None else type(fn).__name__


#: per autograd node class: the names of its saved non-tensor arguments and tensors
_SAVED_NAMES: dict = {}


def node_saved(fn: Any, names: tuple | None = None) -> tuple:
    """What autograd node ``fn`` saved for its backward, in a fixed order: ``((name, value),
    ...)`` over its ``_saved_*`` attributes (``_saved_dim``, ``_saved_self_sym_sizes``,
    ``_saved_indices``, ...; ``name`` without the prefix), or over ``names`` only (names as
    returned). Values as torch gives them: ints, tuples, tensors, None."""
    if names is None:
        cls = type(fn)
        names = _SAVED_NAMES.get(cls)
        if names is None:
            names = _SAVED_NAMES[cls] = tuple(sorted(n[7:] for n in dir(fn) if n.startswith("_saved_")))
    return tuple((n, getattr(fn, "_saved_" + n)) for n in names)


def is_builtin_node(fn: Any) -> bool:
    """Whether autograd node ``fn`` is one of torch's generated nodes (its backward formula
    fixed by its name and saved values), not a Python ``autograd.Function``'s or a C++
    extension's ``CppNode``."""
    return type(fn).__module__ == "builtins" and not type(fn).__name__.startswith("CppNode")


def embedding_saved(fn: Any) -> tuple[Tensor, int, bool]:
    """``(indices, padding_idx, scale_grad_by_freq)`` saved by an ``EmbeddingBackward0`` node
    (its ``_saved_indices`` (the looked-up ids, the lookup's shape without the last dim),
    ``_saved_padding_idx`` and ``_saved_scale_grad_by_freq``). ``padding_idx`` is -1 for none
    (torch 2.13 saves it as an unsigned 2**64 - 1)."""
    pad = int(fn._saved_padding_idx)
    if pad >= 1 << 63:
        pad -= 1 << 64
    return fn._saved_indices, pad, bool(fn._saved_scale_grad_by_freq)


def is_compiled_node(fn: Any) -> bool:
    """Whether an autograd node is the backward of a graph ``torch.compile`` made (AOTAutograd's
    ``CompiledFunction``: its node class is ``CompiledFunctionBackward``). Such a backward runs
    a compiled kernel that cannot be batched over samples (``is_grads_batched``)."""
    return (node_name(fn) or "").startswith("CompiledFunction")


def view_input_sizes(fn: Any) -> tuple[int, ...] | None:
    """The shape of the tensor that a ``ViewBackward0`` / ``UnsafeViewBackward0`` node (a
    ``view``/``reshape``/``flatten`` in forward) reshaped (its ``_saved_self_sym_sizes``); None
    for any other node."""
    if node_name(fn) not in ("ViewBackward0", "UnsafeViewBackward0"):
        return None
    return tuple(int(s) for s in fn._saved_self_sym_sizes)


def slice_dim(fn: Any) -> int | None:
    """The dimension a ``SliceBackward0`` node (``x[:, a:b]``, ``narrow``) sliced (its
    ``_saved_dim``), normalised to be non-negative; None for any other node."""
    if node_name(fn) != "SliceBackward0":
        return None
    d = int(fn._saved_dim)
    return d + len(fn._saved_self_sym_sizes) if d < 0 else d


# ---------------------------------------------------------------------------- DDP


def active_ddp_module() -> Any:
    """The ``DistributedDataParallel`` module whose forward is running now
    (``DistributedDataParallel._active_ddp_module``, set in its forward), else None."""
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._active_ddp_module


def ddp_grad_sync(ddp: Any) -> bool:
    """``ddp.require_backward_grad_sync``: False inside ``ddp.no_sync()`` (the backward after
    this forward does not all-reduce)."""
    return bool(ddp.require_backward_grad_sync)


def ddp_comm_hook(ddp: Any) -> str | None:
    """The name of the communication hook of ``ddp`` (``""`` for none; None if unreadable):
    ``ddp._get_ddp_logging_data()["comm_hook"]`` (hooks registered with
    ``register_comm_hook``), or the first of ``ddp._comm_hooks`` (Python hooks)."""
    try:
        hook = ddp._get_ddp_logging_data().get("comm_hook", "")
        extra = ddp._comm_hooks
    except Exception:  # pragma: no cover - guarded by tests/test_compat.py
        return None
    if not hook and extra:
        hook = getattr(extra[0][0], "__name__", "a Python comm hook")
    return str(hook)


def ddp_average_departure(ddp: Any) -> str | None:
    """Why the ``p.grad`` that DistributedDataParallel ``ddp`` all-reduces is not the plain
    average of the ranks' gradients (a comm hook, mixed precision), or None when it is. The
    one plain-DDP check of gradlens (:class:`gradlens.distributed.merge.DDPGradRoute` adds what the Lens needs besides)."""
    hook = ddp_comm_hook(ddp)
    if hook is None:
        return "a comm hook state this torch does not expose (gradlens.compat.ddp_comm_hook)"
    if hook:
        return f"a comm hook ({hook})"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed_precision set"
    return None


def ddp_python_reducer(ddp: Any) -> bool:
    """``ddp._use_python_reducer``: DDP runs its Python reducer (compiled DDP) instead of the
    C++ one; True if unreadable (the safe answer for callers)."""
    return bool(getattr(ddp, "_use_python_reducer", True))


def ddp_delayed_params(ddp: Any) -> list:
    """``ddp._delay_all_reduce_params``: the parameters whose all-reduce DDP delays to the end
    of the backward (``delay_all_reduce_named_params``); empty for none."""
    return list(getattr(ddp, "_delay_all_reduce_params", None) or [])


def ddp_static_graph_pending(ddp: Any) -> bool:
    """True for a ``static_graph=True`` DDP that has not yet queued its delayed all-reduce
    (``ddp.static_graph`` and not ``ddp._static_graph_delay_allreduce_enqueued``): its first
    iteration reduces in a callback queued before the backward's first gradient hook."""
    return bool(getattr(ddp, "static_graph", False)) and not getattr(
        ddp, "_static_graph_delay_allreduce_enqueued", False
    )


def ddp_join_enabled(ddp: Any) -> bool:
    """True while ``ddp`` runs under ``torch.distributed.algorithms.Join``
    (``ddp._join_config.enable``; torch 2.13 leaves it set after the Join block exits)."""
    join = getattr(ddp, "_join_config", None)
    return join is not None and bool(join.enable)


def process_group_timeout(group: Any) -> float | None:
    """The timeout in seconds that process group ``group`` (None: the default group) was made
    with (``init_process_group(timeout=...)`` / ``new_group(timeout=...)``): its backend's
    ``options._timeout``; None where it cannot be read (a backend without options)."""
    import torch.distributed as dist

    pg = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            value = pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # no backend for this device, or one without options
            continue
        return float(value.total_seconds())
    return None


# ---------------------------------------------------------------------------- GradScaler


def grad_scaler_scale(scaler: Any) -> Tensor | None:
    """The scale ``scaler.scale(loss)`` multiplied by, as the scaler's own 0-d float32 tensor
    (no host sync; ``float()`` of it is what ``scaler.get_scale()`` returns), or None for a
    disabled scaler or one that has not scaled anything yet (no gradient carries a scale).
    ``GradScaler._get_scale_async()`` (its ``_scale``)."""
    if not scaler.is_enabled():
        return None
    return scaler._get_scale_async()


def optimizer_grad_scale(optimizer: Any) -> Tensor | None:
    """``optimizer.grad_scale``: the scale tensor ``GradScaler.step`` attaches to an optimizer
    that declares ``_step_supports_amp_scaling = True`` for the duration of its ``step``
    (its gradients are still scaled by it), else None."""
    return getattr(optimizer, "grad_scale", None)


# ---------------------------------------------------------------------------- FSDP2 (fully_shard)


def dtensor_local(t: Any) -> Tensor:
    """The local tensor of a ``DTensor`` ``t`` (``t._local_tensor``: the same object each time,
    the one the DTensor's own ops read and its ``to_local()`` views), without an autograd call
    (``to_local()`` makes a new view each call). Tensor parallelism's activations are DTensors
    built with ``DTensor.from_local`` from tensors the capture has marked. Checked on torch 2.13."""
    return t._local_tensor


def fsdp_params(model: nn.Module) -> dict[int, Any]:
    """``id(sharded parameter) -> FSDPParam`` of every ``fully_shard``-ed module of ``model``
    (``FSDPModule._get_fsdp_state()._fsdp_param_groups[*].fsdp_params``; ``FSDPParam.
    sharded_param`` is the DTensor parameter that ``model.named_parameters()`` returns outside a
    forward). Empty when nothing is sharded. Checked on torch 2.6-2.13."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return {}
    out: dict[int, Any] = {}
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            for fp in fsdp_module_params(mod):
                out[id(fp.sharded_param)] = fp
    return out


def fsdp_module_params(module: nn.Module) -> list[Any]:
    """The ``FSDPParam`` objects of one ``fully_shard``-ed module (its own parameter groups:
    ``module._get_fsdp_state()._fsdp_param_groups[*].fsdp_params``). Checked on torch 2.6-2.14."""
    return [fp for group in module._get_fsdp_state()._fsdp_param_groups for fp in group.fsdp_params]


def fsdp_unsharded_param(fp: Any) -> nn.Parameter | None:
    """The unsharded parameter of an ``FSDPParam`` (``fp._unsharded_param``: a plain
    ``nn.Parameter`` of the full shape in the policy's ``param_dtype``, created at the module's
    first all-gather and kept, its storage freed and refilled, for the module's lifetime; the
    module holds it during its forward and backward), or None before the first all-gather."""
    return getattr(fp, "_unsharded_param", None)


def fsdp_param_slots(fp: Any) -> list[tuple[nn.Module, str]]:
    """Every ``(module, attribute)`` that holds an ``FSDPParam``'s parameter (``fp._module_info``:
    its module and name, then the modules that share it, e.g. a tied embedding)."""
    info = fp._module_info
    return [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]


# ---------------------------------------------------------------------------- pipelines, DTensor


def pipeline_kind(obj: Any) -> str | None:
    """What ``obj`` is in ``torch.distributed.pipelining``: ``"single"`` for a schedule of one
    stage per rank (``ScheduleGPipe``, ``Schedule1F1B``: ``PipelineScheduleSingle``),
    ``"multi"`` for a schedule of several stages per rank (``PipelineScheduleMulti``:
    interleaved, zero-bubble), ``"stage"`` for a stage (``PipelineStage``: the private base
    ``_PipelineStageBase``), None otherwise. Checked on torch 2.6-2.13."""
    if isinstance(obj, nn.Module):
        return None
    try:
        from torch.distributed.pipelining import schedules, stage
    except ImportError:  # pragma: no cover - torch without pipelining
        return None
    if isinstance(obj, schedules.PipelineScheduleSingle):
        return "single"
    if isinstance(obj, schedules.PipelineScheduleMulti):
        return "multi"
    if isinstance(obj, stage._PipelineStageBase):
        return "stage"
    return None


def pipeline_schedule_parts(schedule: Any) -> tuple[Any, Any]:
    """``(stage, loss_fn)`` of a one-stage-per-rank schedule: its private ``_stage`` and
    ``_loss_fn`` (None when the schedule was built without a loss). Checked on torch 2.6-2.13."""
    return schedule._stage, schedule._loss_fn


#: the private methods of a ``PipelineStage`` that a schedule's first ``step()`` calls to infer
#: the shapes its micro-batches will have: they run the stage's forward and an
#: ``autograd.grad`` of its inputs on the first micro-batch (not a training micro-step). Those a
#: stage has are shadowed while a Lens captures (gradlens/distributed/pipeline.py). Checked on
#: torch 2.13 (older releases infer in ``_prepare_forward_infra`` only).
PIPELINE_SETUP = ("_prepare_forward_infra", "_prepare_backward_infra")


#: the module that holds context parallelism's replaced functions (imported only by
#: ``torch.distributed.tensor.experimental.context_parallel``)
_CP_MODULE = "torch.distributed.tensor.experimental._context_parallel._attention"


def context_parallel_active() -> bool:
    """Whether ``torch.distributed.tensor.experimental.context_parallel(...)`` is active in its
    default mode: it replaces ``F.scaled_dot_product_attention`` by a ring-attention wrapper
    noted in its module's private ``_replaced_functions`` (and shards its buffers along the
    sequence dim in place). False when that module was never imported. Checked on torch 2.13."""
    import sys

    module = sys.modules.get(_CP_MODULE)
    if module is None:
        return False
    replaced = getattr(module, "_replaced_functions", {})
    return torch.nn.functional.scaled_dot_product_attention in replaced


def context_parallel_wrapped(module: torch.nn.Module) -> bool:
    """Whether ``module`` was parallelised with context parallelism's module-wrapper style
    (``parallelize_module(attn, mesh, _ContextParallel(seq_dim, attention_type))``, the mode of
    ``_context_parallel_shard``): its forward pre-hooks hold a ``functools.partial`` of a
    ``_ContextParallel`` method (which turns q / k / v into sequence-sharded DTensors, or
    all-gathers k / v along the sequence). False when that module was never imported. Checked
    on torch 2.13."""
    import sys

    cp = sys.modules.get(_CP_MODULE)
    style = getattr(cp, "_ContextParallel", None) if cp is not None else None
    if style is None:
        return False
    for hook in module._forward_pre_hooks.values():
        owner = getattr(getattr(hook, "func", None), "__self__", None)
        if isinstance(owner, style):
            return True
    return False


_DTENSOR: list = []  # the DTensor class, once imported (the check runs at every tracked use)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False when DTensor was never
    imported: nothing can be one then)."""
    if not _DTENSOR:
        import sys

        module = sys.modules.get("torch.distributed.tensor")
        cls = getattr(module, "DTensor", None) if module is not None else None
        if cls is None:
            return False
        _DTENSOR.append(cls)
    return isinstance(t, _DTENSOR[0])
