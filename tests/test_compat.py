"""Guard tests of gradlens.compat: each private torch / DDP / GradScaler API that gradlens uses is
exercised against the installed torch, and a change (an attribute gone, another value or type)
fails naming the compat entry to mend."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradlens import compat


def _fail(entry: str, what: str) -> None:
    pytest.fail(
        f"gradlens.compat.{entry}: {what} (torch {torch.__version__}); the private torch API it "
        f"wraps changed: update {entry} in gradlens/compat.py"
    )


def _check(entry: str, ok: bool, what: str) -> None:
    if not ok:
        _fail(entry, what)


@contextlib.contextmanager
def _entry(entry: str):
    """Any error raised while exercising ``entry`` becomes a failure naming it."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - the point is to name the entry
        _fail(entry, f"raised {type(err).__name__}: {err}")


def test_every_entry_has_a_guard():
    import pathlib
    import re

    source = pathlib.Path(__file__).read_text()
    guarded = set(re.findall(r'_(?:check|entry)\(\s*"(\w+)"', source))
    missing = sorted(set(compat.__all__) - guarded)
    assert not missing, f"gradlens.compat entries without a guard test here: {missing}"
    assert guarded <= set(compat.__all__), f"guards of names compat does not export: {sorted(guarded - set(compat.__all__))}"


def test_guard_message_names_the_entry():
    with pytest.raises(pytest.fail.Exception, match=r"gradlens\.compat\.tensor_version: raised AttributeError.*update tensor_version in gradlens/compat.py"):
        with _entry("tensor_version"):
            compat.tensor_version(object())


# ---------------------------------------------------------------------------- modules


def test_batchnorm_base():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d):
        _check("BatchNormBase", issubclass(cls, compat.BatchNormBase), f"{cls.__name__} is not a subclass")
    for cls in (nn.InstanceNorm1d, nn.LayerNorm, nn.GroupNorm):
        _check("BatchNormBase", not issubclass(cls, compat.BatchNormBase), f"{cls.__name__} is a subclass")


def test_loss_conv_transpose_and_instance_norm_bases():
    for cls in (nn.CrossEntropyLoss, nn.MSELoss, nn.NLLLoss, nn.BCEWithLogitsLoss, nn.L1Loss):
        _check("LossBase", issubclass(cls, compat.LossBase) and hasattr(cls(), "reduction"),
               f"{cls.__name__} is not a subclass with a reduction")
    _check("LossBase", not issubclass(nn.Linear, compat.LossBase), "nn.Linear is a subclass")
    for cls in (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d):
        _check("ConvTransposeBase", issubclass(cls, compat.ConvTransposeBase), f"{cls.__name__} is not a subclass")
    for cls in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        _check("ConvTransposeBase", not issubclass(cls, compat.ConvTransposeBase), f"{cls.__name__} is a subclass")
    for cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
        _check("InstanceNormBase", issubclass(cls, compat.InstanceNormBase), f"{cls.__name__} is not a subclass")
    for cls in (nn.BatchNorm2d, nn.GroupNorm, nn.LayerNorm):
        _check("InstanceNormBase", not issubclass(cls, compat.InstanceNormBase), f"{cls.__name__} is a subclass")


def test_pre_hooks_added_run_inside_a_pre_hook():
    m = nn.Linear(2, 2)
    ran = []

    def first(module, args, kwargs):
        with _entry("pre_hook_ids"):
            before = compat.pre_hook_ids(module)
        module.register_forward_pre_hook(lambda mod, a: ran.append(("plain", a[0].shape)))
        module.register_forward_pre_hook(lambda mod, a, k: ran.append(("kwargs", sorted(k))), with_kwargs=True)
        with _entry("run_pre_hooks_added"):
            compat.run_pre_hooks_added(module, before, args, kwargs)

    m.register_forward_pre_hook(first, with_kwargs=True)
    m(torch.randn(3, 2))
    _check("run_pre_hooks_added", ran == [("plain", torch.Size([3, 2])), ("kwargs", [])],
           f"ran {ran} (the hooks added inside the pre-hook, each with its own signature)")
    _check("pre_hook_ids", isinstance(compat.pre_hook_ids(m), set) and len(compat.pre_hook_ids(m)) == 3,
           "not the ids of the module's three pre-hooks")


def test_register_load_state_dict_pre_hook():
    m = nn.Linear(2, 2)
    seen = []

    def hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        seen.append((module, prefix))
        state_dict[prefix + "bias"] = torch.full((2,), 7.0)  # a hook may fill in an entry

    with _entry("register_load_state_dict_pre_hook"):
        handle = compat.register_load_state_dict_pre_hook(m, hook)
        outer = nn.Sequential(m)
        outer.load_state_dict({"0.weight": torch.zeros(2, 2)})
    _check("register_load_state_dict_pre_hook", seen == [(m, "0.")], f"called with {seen}")
    _check("register_load_state_dict_pre_hook", m.bias.tolist() == [7.0, 7.0], "an entry the hook added did not load")
    handle.remove()
    m.load_state_dict({"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    _check("register_load_state_dict_pre_hook", len(seen) == 1, "the handle did not remove the hook")


def test_batchnorm_check_input_dim():
    with _entry("batchnorm_check_input_dim"):
        compat.batchnorm_check_input_dim(nn.BatchNorm2d(3), torch.zeros(2, 3, 4, 4))
        compat.batchnorm_check_input_dim(nn.BatchNorm1d(3), torch.zeros(2, 3))
    for bn, x in ((nn.BatchNorm2d(3), torch.zeros(2, 3)), (nn.BatchNorm1d(3), torch.zeros(2, 3, 4, 4))):
        try:
            compat.batchnorm_check_input_dim(bn, x)
        except ValueError:
            continue
        _fail("batchnorm_check_input_dim", f"{type(bn).__name__} accepted a {x.dim()}-D input")


def test_set_module_parameter():
    m = nn.Linear(2, 2)
    w = m.weight
    other = nn.Parameter(torch.zeros(5))  # a shape nn.Module.__setattr__ would not check either
    with _entry("set_module_parameter"):
        before = compat.set_module_parameter(m, "weight", other)
    _check("set_module_parameter", before is w and m.weight is other, "the slot was not swapped")
    _check("set_module_parameter", dict(m.named_parameters())["weight"] is other, "named_parameters() does not see it")
    compat.set_module_parameter(m, "weight", before)
    _check("set_module_parameter", m.weight is w, "not restored")
    _check("set_module_parameter", compat.set_module_parameter(m, "extra", None) is None, "a missing slot gave a value")


def test_sparse_values():
    i = torch.tensor([[0, 0, 2], [1, 1, 0]])
    t = torch.sparse_coo_tensor(i, torch.tensor([1.0, float("inf"), 3.0]), (3, 3))
    with _entry("sparse_values"):
        v = compat.sparse_values(t)
        d = compat.sparse_values(torch.ones(2))
    _check("sparse_values", v.tolist() == [1.0, float("inf"), 3.0], f"gave {v.tolist()} (stored values, uncoalesced)")
    _check("sparse_values", d.tolist() == [1.0, 1.0], "a dense tensor is not returned as it is")


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("padding_mode", ["zeros", "circular", "reflect"])
def test_conv_forward(dim, padding_mode):
    torch.manual_seed(0)
    conv = getattr(nn, f"Conv{dim}d")(4, 6, 3, stride=2, padding=1, dilation=1, groups=2, padding_mode=padding_mode).double()
    x = torch.randn(2, 4, *([7] * dim), dtype=torch.float64)
    with _entry("conv_forward"):
        same = compat.conv_forward(conv, x, conv.weight, conv.bias)
        w = torch.randn(10, *conv.weight.shape[1:], dtype=torch.float64)
        other = compat.conv_forward(conv, x, w, None)
    _check("conv_forward", torch.allclose(same, conv(x), rtol=0, atol=1e-12), "differs from the layer's own forward")
    conv2 = getattr(nn, f"Conv{dim}d")(4, 10, 3, stride=2, padding=1, groups=2, bias=False, padding_mode=padding_mode).double()
    with torch.no_grad():
        conv2.weight.copy_(w)
    _check("conv_forward", torch.allclose(other, conv2(x), rtol=0, atol=1e-12), "ignores the weight passed")


def test_mha_packed_in_proj():
    with _entry("mha_packed_in_proj"):
        packed = nn.MultiheadAttention(8, 2)
        apart = nn.MultiheadAttention(8, 2, kdim=5, vdim=3)
        got = (compat.mha_packed_in_proj(packed), compat.mha_packed_in_proj(apart))
    _check("mha_packed_in_proj", got == (True, False), f"(kdim == vdim == embed_dim, kdim=5 vdim=3) gave {got}")
    _check("mha_packed_in_proj", packed.in_proj_weight.shape == (24, 8) and apart.in_proj_weight is None
           and apart.k_proj_weight.shape == (8, 5), "the projection weights are laid out otherwise")


def test_compiled_original():
    model = nn.Linear(3, 2)
    with _entry("compiled_original"):
        compiled = torch.compile(model)  # nothing is compiled before the first call
        got = compat.compiled_original(compiled)
    _check("compiled_original", got is model, f"torch.compile's wrapper gave {type(got).__name__}, not the model")
    _check("compiled_original", compat.compiled_original(model) is model, "a plain module is not returned as is")


# ---------------------------------------------------------------------------- autograd


def test_in_functorch_transform():
    seen = []

    def f(x):
        seen.append(compat.in_functorch_transform())
        return (x * x).sum()

    with _entry("in_functorch_transform"):
        outside = compat.in_functorch_transform()
        torch.func.vmap(f)(torch.ones(3, 2))
        torch.func.grad(f)(torch.ones(2))
    _check("in_functorch_transform", outside is False, f"True outside any transform ({outside!r})")
    _check("in_functorch_transform", seen == [True, True], f"inside vmap and grad it gave {seen}")


def test_no_torch_function():
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    t = torch.ones(2, requires_grad=True)
    with Mode():
        with _entry("no_torch_function"):
            with compat.no_torch_function():
                inside = (t * 2).sum()
        outside = t * 2
    _check("no_torch_function", len(seen) == 1, f"the mode saw {len(seen)} calls (expected only the one outside)")
    _check("no_torch_function", inside.requires_grad and outside.requires_grad, "results lost their autograd graph")


def test_top_function_mode():
    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append((self, compat.top_function_mode()))
            return func(*args, **(kwargs or {}))

    seen = []
    outer, inner = Mode(), Mode()
    with _entry("top_function_mode"):
        before = compat.top_function_mode()
        with outer:
            in_outer = compat.top_function_mode()
            with inner:
                in_inner = compat.top_function_mode()
                torch.ones(1) + 1  # inner's __torch_function__ runs with inner popped
            after_inner = compat.top_function_mode()
        after = compat.top_function_mode()
    _check("top_function_mode", before is None and after is None, f"outside any mode it gave {before!r}, {after!r}")
    _check("top_function_mode", in_outer is outer and after_inner is outer, "not the one mode entered")
    _check("top_function_mode", in_inner is inner, "not the innermost of two modes")
    below = {inner: outer, outer: None}
    _check("top_function_mode", seen and all(top is below[m] for m, top in seen),
           f"inside a mode's own __torch_function__ it gave {seen!r} (expected the mode below it)")


def test_add_tensor_hook():
    seen = []
    x = torch.randn(3, requires_grad=True)
    with _entry("add_tensor_hook"):
        y = x * 2
        compat.add_tensor_hook(y, lambda g: seen.append(("first", g.clone())))
        handle = y.register_hook(lambda g: seen.append(("public", g.clone())) or g * 10)
        compat.add_tensor_hook(y, lambda g: seen.append(("last", g.clone())))
        other = y.register_hook(lambda g: seen.append(("removed", g)))
        other.remove()  # a handle's removal leaves the hooks added here
        compat.add_tensor_hook(x, lambda g: seen.append(("leaf", g.clone())))
        (y * torch.arange(3.0)).sum().backward()
    order = [name for name, _ in seen]
    _check("add_tensor_hook", order == ["first", "public", "last", "leaf"],
           f"hooks ran as {order} (expected in the order added, a removed handle's hook gone)")
    g = dict(seen)
    _check("add_tensor_hook", torch.equal(g["first"], torch.arange(3.0)) and torch.equal(g["last"], 10 * torch.arange(3.0)),
           "a hook did not get the gradient as register_hook's hooks do (each after the ones before)")
    _check("add_tensor_hook", torch.equal(x.grad, 20 * torch.arange(3.0)) and torch.equal(g["leaf"], x.grad),
           "the gradient that flowed on is not the one the hooks returned")
    del handle


def test_storage_use_count():
    t = torch.empty(6)
    with _entry("storage_use_count"):
        base = compat.storage_use_count(t)
        view = t.view(2, 3)
        alias = t.detach()
        shared = compat.storage_use_count(t)
        del view, alias
        after = compat.storage_use_count(t)
        other = compat.storage_use_count(t.clone())
    _check("storage_use_count", isinstance(base, int), f"returned {base!r}, not an int")
    _check("storage_use_count", shared == base + 2, f"{base} users, {shared} with a view and an alias (expected {base + 2})")
    _check("storage_use_count", after == base and other == base, f"{after} / {other} users after freeing / for a clone")


def test_queue_backward_callback():
    log = []
    w = torch.ones(3, requires_grad=True)
    v = torch.ones(3, requires_grad=True)

    def hook(g):
        compat.queue_backward_callback(lambda: log.append(("callback", w.grad is not None, v.grad is not None)))
        log.append("hook")

    y = w * 2.0
    y.register_hook(hook)
    with _entry("queue_backward_callback"):
        ((y + v) ** 2).sum().backward()
    _check(
        "queue_backward_callback", log == ["hook", ("callback", True, True)],
        f"the callback did not run once after every gradient was accumulated, before backward returned: {log}",
    )


def test_tensor_version():
    t = torch.zeros(4)
    with _entry("tensor_version"):
        v0 = compat.tensor_version(t)
        t.add_(1.0)
        v1 = compat.tensor_version(t)
        view = t[:2]
        view.mul_(2.0)
        v2, vv = compat.tensor_version(t), compat.tensor_version(view)
        _ = t + 1.0
        v3 = compat.tensor_version(t)
    _check("tensor_version", isinstance(v0, int), f"returned {v0!r}, not an int")
    _check("tensor_version", v1 > v0 and v2 > v1 and vv == v2, f"in-place changes gave versions {v0}, {v1}, {v2} (view {vv})")
    _check("tensor_version", v3 == v2, "an out-of-place op changed the version")


def test_is_view():
    t = torch.zeros(2, 3)
    with _entry("is_view"):
        got = (compat.is_view(t), compat.is_view(t.view(3, 2)), compat.is_view(t[0]), compat.is_view(t.clone()))
    _check("is_view", got == (False, True, True, False), f"(tensor, view, slice, clone) gave {got}")


def test_named_parameters():
    class Odd(nn.Module):  # overrides named_parameters: torch's own is used
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def named_parameters(self, *args, **kwargs):
            yield from super().named_parameters(*args, **kwargs)

    shared = nn.Linear(3, 3)
    inner = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), shared, nn.BatchNorm1d(3))
    model = nn.Sequential(inner, nn.Linear(3, 3, bias=False), shared, inner)  # shared layer, shared module
    model[1].register_parameter("extra", None)
    model.add_module("none", None)
    model.register_parameter("top", nn.Parameter(torch.zeros(1)))
    model[1].tied = model[0][0].weight  # one parameter under two names
    with_odd = nn.ModuleDict({"model": model, "odd": Odd()})
    for m in (model, with_odd):
        with _entry("named_parameters"):
            got = [(n, id(p)) for n, p in compat.named_parameters(m)]
        want = [(n, id(p)) for n, p in m.named_parameters()]
        _check("named_parameters", got == want, f"gave {[n for n, _ in got]}, named_parameters() gives {[n for n, _ in want]}")


def test_view_base():
    t = torch.zeros(2, 3)
    with _entry("view_base"):
        got = (compat.view_base(t), compat.view_base(t.view(3, 2)), compat.view_base(t.view(6)[1:]),
               compat.view_base(t.clone()))
    _check("view_base", got[0] is None and got[1] is t and got[2] is t and got[3] is None,
           f"(tensor, view, view of a view, clone) gave bases {[None if b is None else tuple(b.shape) for b in got]}")


def test_foreach_mul_():
    a, b = torch.ones(3), torch.full((2, 2), 2.0)
    with _entry("foreach_mul_"):
        compat.foreach_mul_([a, b], 3.0)
        compat.foreach_mul_((a, b), torch.tensor(0.5))
    _check("foreach_mul_", torch.equal(a, torch.full((3,), 1.5)) and torch.equal(b, torch.full((2, 2), 3.0)),
           f"in place by 3 then 0.5 gave {a.tolist()}, {b.tolist()}")


def test_foreach_add_():
    a, b = torch.ones(3), torch.full((2, 2), 2.0, dtype=torch.float64)
    with _entry("foreach_add_"):
        compat.foreach_add_([a, b], (torch.full((3,), 0.5), torch.ones(2, 2, dtype=torch.float64)))
    _check("foreach_add_", torch.equal(a, torch.full((3,), 1.5)) and torch.equal(b, torch.full((2, 2), 3.0, dtype=torch.float64)),
           f"adding 0.5 and 1 in place gave {a.tolist()}, {b.tolist()}")


def test_node_name():
    w = torch.randn(4, 3, requires_grad=True)
    b = torch.randn(4, requires_grad=True)
    with _entry("node_name"):
        addmm = F.linear(torch.randn(2, 3), w, b).grad_fn
        mm = F.linear(torch.randn(2, 3), w).grad_fn
        view = F.linear(torch.randn(2, 5, 3), w, b).grad_fn
        under = view.next_functions[0][0]
        t_nodes = [n for n, _ in addmm.next_functions if compat.node_name(n) == "TBackward0"]
        emb = F.embedding(torch.tensor([[0, 1]]), torch.randn(3, 2, requires_grad=True)).grad_fn
        names = (compat.node_name(addmm), compat.node_name(mm), compat.node_name(view), compat.node_name(under),
                 compat.node_name(emb), compat.node_name(None))
    _check("node_name", names[:2] == ("AddmmBackward0", "MmBackward0"), f"F.linear's nodes are {names[:2]}")
    _check("node_name", names[2] in ("ViewBackward0", "UnsafeViewBackward0") and names[3] in ("AddmmBackward0", "MmBackward0"),
           f"a 3-D F.linear's nodes are {names[2:4]}")
    _check("node_name", len(t_nodes) == 1 and t_nodes[0].next_functions[0][0].variable is w,
           "F.linear's weight is not reached through one TBackward0 node to its AccumulateGrad")
    _check("node_name", names[4:] == ("EmbeddingBackward0", None), f"F.embedding's node / no node gave {names[4:]}")


def test_embedding_saved():
    ids = torch.tensor([[0, 2, 1], [2, 2, 0]])
    table = torch.randn(4, 3, requires_grad=True)
    with _entry("embedding_saved"):
        plain = compat.embedding_saved(F.embedding(ids, table).grad_fn)
        padded = compat.embedding_saved(F.embedding(ids, table, padding_idx=2, scale_grad_by_freq=True).grad_fn)
    _check("embedding_saved", torch.equal(plain[0], ids) and plain[1:] == (-1, False), f"a plain lookup gave {plain}")
    _check("embedding_saved", torch.equal(padded[0], ids) and padded[1:] == (2, True), f"padding_idx=2, scale_grad_by_freq gave {padded}")


def test_compiled_in_place():
    plain, compiled = nn.Linear(2, 2), nn.Linear(2, 2)
    with _entry("compiled_in_place"):
        compiled.compile(backend="eager")
        got = (compat.compiled_in_place(plain), compat.compiled_in_place(compiled))
    _check("compiled_in_place", got == (False, True), f"a plain / a model.compile()'d Linear gave {got}")


def test_compile_stance():
    before = compat.compile_stance()
    with _entry("compile_stance"), _entry("set_compile_stance"):
        compat.set_compile_stance("force_eager")
        during = compat.compile_stance()
        compat.set_compile_stance(before)
        after = compat.compile_stance()
    _check("compile_stance", before == "default", f"the stance outside any set_stance is {before!r}")
    _check("set_compile_stance", during == "force_eager" and after == "default",
           f"set_compile_stance('force_eager') then back gave {during!r}, {after!r}")


def test_is_compiled_node():
    torch._dynamo.reset()
    w = nn.Parameter(torch.randn(3, 2))
    with _entry("is_compiled_node"):
        t = torch.compile(lambda w: (w * 2).sin(), backend="aot_eager")(w)
        got = (compat.is_compiled_node(t.grad_fn), compat.is_compiled_node((w * 2).grad_fn), compat.is_compiled_node(None))
    torch._dynamo.reset()
    _check("is_compiled_node", got == (True, False, False),
           f"a compiled graph's output / an eager mul / no node gave {got} (node {compat.node_name(t.grad_fn)})")


def test_view_input_sizes():
    x = torch.randn(2, 3, 5, requires_grad=True) * 1
    with _entry("view_input_sizes"):
        viewed = compat.view_input_sizes(x.view(-1, 5).grad_fn)
        copied = compat.view_input_sizes(x[:, 1:].reshape(-1, 5).grad_fn)  # a copy, then a view
        other = compat.view_input_sizes((x * 2).grad_fn)
    _check("view_input_sizes", viewed == (2, 3, 5), f"x.view(-1, 5) of a [2, 3, 5] tensor gave {viewed}")
    _check("view_input_sizes", copied == (2, 2, 5), f"x[:, 1:].reshape(-1, 5) gave {copied}")
    _check("view_input_sizes", other is None, f"a MulBackward0 node gave {other}")


def test_slice_dim():
    x = torch.randn(2, 3, 5, requires_grad=True) * 1
    with _entry("slice_dim"):
        dims = (compat.slice_dim(x[:, 1:].grad_fn), compat.slice_dim(x[..., :-1].grad_fn),
                compat.slice_dim((x * 2).grad_fn))
    _check("slice_dim", dims == (1, 2, None), f"x[:, 1:], x[..., :-1], x * 2 gave {dims}")


# ---------------------------------------------------------------------------- DDP


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    if not dist.is_available():  # pragma: no cover - every torch build gradlens supports has it
        pytest.fail("torch.distributed is not available: the DDP entries of gradlens.compat cannot be checked")
    own = not dist.is_initialized()
    if own:
        store = tmp_path_factory.mktemp("compat") / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    if own:
        dist.destroy_process_group()


def _ddp(**kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def test_active_ddp_module_and_grad_sync(group):
    ddp = _ddp()
    seen = []
    ddp.module[0].register_forward_pre_hook(lambda m, a: seen.append((compat.active_ddp_module(), compat.ddp_grad_sync(ddp))))
    x = torch.randn(2, 3)
    with _entry("active_ddp_module"):
        outside = compat.active_ddp_module()
        ddp(x).sum().backward()
        with ddp.no_sync():
            ddp(x).sum().backward()
        after = compat.active_ddp_module()
    _check("active_ddp_module", outside is None and after is None, "not None outside a DDP forward")
    _check("active_ddp_module", [s[0] is ddp for s in seen] == [True, True], "not the DDP module inside its forward")
    _check("ddp_grad_sync", [s[1] for s in seen] == [True, False], f"(synced, no_sync()) forwards gave {[s[1] for s in seen]}")


def test_ddp_comm_hook_and_average_departure(group):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    plain, hooked = _ddp(), _ddp()
    hooked.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with _entry("ddp_comm_hook"):
        names = (compat.ddp_comm_hook(plain), compat.ddp_comm_hook(hooked))
    _check("ddp_comm_hook", names[0] == "", f"a DDP without a comm hook gave {names[0]!r}")
    _check("ddp_comm_hook", isinstance(names[1], str) and "fp16_compress_hook" in names[1], f"fp16_compress_hook gave {names[1]!r}")
    _check("ddp_average_departure", hasattr(plain, "mixed_precision") and plain.mixed_precision is None,
           "DistributedDataParallel.mixed_precision is gone or set by default")
    with _entry("ddp_average_departure"):
        why = (compat.ddp_average_departure(plain), compat.ddp_average_departure(hooked))
    _check("ddp_average_departure", why[0] is None and why[1] == f"a comm hook ({names[1]})", f"gave {why}")


def test_ddp_python_reducer(group):
    ddp = _ddp()
    _check("ddp_python_reducer", hasattr(ddp, "_use_python_reducer"), "DistributedDataParallel._use_python_reducer is gone")
    _check("ddp_python_reducer", compat.ddp_python_reducer(ddp) is False, "True for an eager DDP")


def test_ddp_delayed_params(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    with _entry("ddp_delayed_params"):
        delayed = nn.parallel.DistributedDataParallel(
            model, delay_all_reduce_named_params=[("0.weight", model[0].weight)], param_to_hook_all_reduce=model[2].weight
        )
        got = (compat.ddp_delayed_params(_ddp()), compat.ddp_delayed_params(delayed))
    _check("ddp_delayed_params", got[0] == [], f"a plain DDP gave {got[0]}")
    _check("ddp_delayed_params", len(got[1]) == 1 and got[1][0] is model[0].weight, f"one delayed parameter gave {len(got[1])}")


def test_ddp_static_graph_pending(group):
    static = _ddp(static_graph=True)
    x = torch.randn(2, 3)
    with _entry("ddp_static_graph_pending"):
        before = compat.ddp_static_graph_pending(static)
        static(x).sum().backward()
        static(x).sum().backward()
        after = compat.ddp_static_graph_pending(static)
        plain = compat.ddp_static_graph_pending(_ddp())
    _check("ddp_static_graph_pending", before is True and after is False and plain is False,
           f"static graph before / after its first iterations, plain DDP: {before}, {after}, {plain}")


def test_ddp_join_enabled(group):
    from torch.distributed.algorithms.join import Join

    ddp = _ddp()
    seen = []
    ddp.module[0].register_forward_pre_hook(lambda m, a: seen.append(compat.ddp_join_enabled(ddp)))
    x = torch.randn(2, 3)
    with _entry("ddp_join_enabled"):
        ddp(x).sum().backward()
        with Join([ddp]):
            ddp(x).sum().backward()
        ddp(x).sum().backward()
    # torch leaves the Join config in place when the block exits (gradlens then stays careful)
    _check("ddp_join_enabled", seen[:2] == [False, True], f"forwards before / inside Join gave {seen[:2]}")


def test_process_group_timeout(group):
    from datetime import timedelta

    with _entry("process_group_timeout"):
        default = compat.process_group_timeout(None)
        own = dist.new_group([0], timeout=timedelta(seconds=7))
        got = compat.process_group_timeout(own)
    _check("process_group_timeout", got == 7.0, f"a group made with timeout=7 s gave {got!r}")
    _check("process_group_timeout", isinstance(default, float) and default > 0,
           f"the default group gave {default!r}, not its timeout in seconds")


# ---------------------------------------------------------------------------- GradScaler


def test_grad_scaler_scale():
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    loss = (torch.ones(2, requires_grad=True) * 3.0).sum()
    with _entry("grad_scaler_scale"):
        before = compat.grad_scaler_scale(scaler)
        scaled = scaler.scale(loss)
        after = compat.grad_scaler_scale(scaler)
        off = compat.grad_scaler_scale(torch.amp.GradScaler("cpu", enabled=False))
    _check("grad_scaler_scale", before is None, f"before the first scale() it gave {before!r}")
    _check("grad_scaler_scale", isinstance(after, torch.Tensor) and after.dim() == 0 and float(after) == scaler.get_scale() == 8.0,
           f"after scale() gave {after!r}, get_scale() {scaler.get_scale()}")
    _check("grad_scaler_scale", torch.equal(scaled, loss * after), "is not the tensor scale() multiplied by")
    _check("grad_scaler_scale", off is None, f"a disabled scaler gave {off!r}")


def test_optimizer_grad_scale():
    class _Seen(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            self.seen.append(compat.optimizer_grad_scale(self))
            return None

    p = nn.Parameter(torch.ones(2))
    opt = _Seen([p], lr=0.1)
    opt.seen = []
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    with _entry("optimizer_grad_scale"):
        scaler.scale((p * p).sum()).backward()
        scaler.step(opt)
        outside = compat.optimizer_grad_scale(opt)
    _check("optimizer_grad_scale", len(opt.seen) == 1 and isinstance(opt.seen[0], torch.Tensor) and float(opt.seen[0]) == 4.0,
           f"GradScaler.step gave a _step_supports_amp_scaling optimizer the scale {opt.seen}")
    _check("optimizer_grad_scale", outside is None, f"outside step it gave {outside!r}")


# ---------------------------------------------------------------------------- FSDP2


def test_fsdp_params_unsharded_param_and_slots(group):
    import torch.distributed.fsdp as fsdp  # FSDP2 support is gradlens' own: no skip
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    fsdp.fully_shard(model[0])
    fsdp.fully_shard(model)
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m._parameters["weight"]))
    with _entry("fsdp_params"):
        fps = compat.fsdp_params(model)
        names = dict(model.named_parameters())
    _check("fsdp_params", set(fps) == {id(p) for p in names.values()}, "not keyed by every sharded parameter")
    _check("fsdp_params", all(isinstance(p, DTensor) for p in names.values()), "parameters are not DTensors")
    _check("fsdp_params", compat.fsdp_params(nn.Linear(2, 2)) == {}, "not empty for a plain module")
    fp = fps[id(names["0.weight"])]
    with _entry("fsdp_unsharded_param"):
        before = compat.fsdp_unsharded_param(fp)
        model(torch.randn(2, 3)).sum().backward()
        full = compat.fsdp_unsharded_param(fp)
        model(torch.randn(2, 3)).sum().backward()
        again = compat.fsdp_unsharded_param(fp)
    _check("fsdp_unsharded_param", before is None, "exists before the first all-gather")
    _check("fsdp_unsharded_param", isinstance(full, nn.Parameter) and not isinstance(full, DTensor)
           and tuple(full.shape) == (4, 3), "not a plain full-shape Parameter")
    _check("fsdp_unsharded_param", again is full, "a new object at the next all-gather")
    _check("fsdp_unsharded_param", seen == [full, full], "not what the module holds during its forward")
    with _entry("fsdp_module_params"):
        own = compat.fsdp_module_params(model[0])
        root = compat.fsdp_module_params(model)
    _check("fsdp_module_params", [id(p.sharded_param) for p in own] == [id(names["0.weight"]), id(names["0.bias"])],
           "not the FSDPParams of model[0]'s own parameters")
    _check("fsdp_module_params", {id(p.sharded_param) for p in root} == {id(names["2.weight"]), id(names["2.bias"])},
           "the root's list holds parameters of its fully_shard-ed child")
    with _entry("fsdp_param_slots"):
        slots = compat.fsdp_param_slots(fp)
    _check("fsdp_param_slots", slots == [(model[0], "weight")], f"gave {slots}")
    _check("fsdp_param_slots", model[0]._parameters["weight"] is names["0.weight"], "slot not the sharded parameter outside forward")
    del model, fps, fp, names, full, again, seen


def test_node_saved():
    x = torch.randn(3, 4, requires_grad=True)
    with _entry("node_saved"):
        vals, idx = (x * 2).max(1)
        got = dict(compat.node_saved(vals.grad_fn))
        flip = dict(compat.node_saved(x.flip(0).grad_fn))
    _check("node_saved", got.get("dim") == 1 and got.get("keepdim") is False,
           f"max(dim=1) saved {sorted(got)} ({got.get('dim')!r}, {got.get('keepdim')!r}), not dim 1, keepdim False")
    _check("node_saved", isinstance(got.get("indices"), torch.Tensor) and torch.equal(got["indices"], idx),
           "max(dim=1)'s saved indices are not the indices it returned")
    _check("node_saved", tuple(flip.get("dims", ())) == (0,), f"flip(0) saved {flip}, not dims (0,)")


def test_is_builtin_node():
    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = torch.randn(3, requires_grad=True)
    with _entry("is_builtin_node"):
        got = (compat.is_builtin_node((x * 2).grad_fn), compat.is_builtin_node(Twice.apply(x).grad_fn))
    _check("is_builtin_node", got == (True, False), f"(x * 2, a Python autograd.Function) gave {got}")

# ---------------------------------------------------------------------------- pipelines, DTensor


def test_pipeline_kind_parts_and_setup(group):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 2))
    stage = PipelineStage(model, 0, 1, torch.device("cpu"))
    loss_fn = nn.CrossEntropyLoss()
    schedule = ScheduleGPipe(stage, 2, loss_fn=loss_fn)
    with _entry("pipeline_kind"):
        kinds = [compat.pipeline_kind(x) for x in (schedule, stage, model, object())]
        multi = compat.pipeline_kind(ScheduleInterleaved1F1B([stage], 2, loss_fn=loss_fn))
    _check("pipeline_kind", kinds == ["single", "stage", None, None] and multi == "multi", f"gave {kinds}, {multi}")
    with _entry("pipeline_schedule_parts"):
        parts = compat.pipeline_schedule_parts(schedule)
    _check("pipeline_schedule_parts", parts[0] is stage and parts[1] is loss_fn, f"gave {parts}")
    # the first step infers the micro-batches' shapes in PIPELINE_SETUP, a forward and a
    # backward of its own, before the micro-batches' backward_one_chunk calls
    calls = []
    with _entry("PIPELINE_SETUP"):
        names = [n for n in compat.PIPELINE_SETUP if hasattr(stage, n)]
        for name in [*names, "backward_one_chunk"]:
            method = getattr(stage, name)
            setattr(stage, name, lambda *a, _m=method, _n=name, **k: (calls.append(_n), _m(*a, **k))[1])
        schedule.step(torch.randn(4, 3), target=torch.tensor([0, 1, 1, 0]))
    _check("PIPELINE_SETUP", names == list(compat.PIPELINE_SETUP), f"the stage has only {names}")
    _check("PIPELINE_SETUP", calls == [*names, "backward_one_chunk", "backward_one_chunk"], f"calls {calls}")
    _check("PIPELINE_SETUP", all(p.grad is not None for p in model.parameters()), "no gradient after the step")


def test_context_parallel_active_and_is_dtensor(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (1,))
    with _entry("is_dtensor"):
        flags = [compat.is_dtensor(distribute_tensor(torch.zeros(2, 2), mesh, [Replicate()])),
                 compat.is_dtensor(torch.zeros(2)), compat.is_dtensor(None)]
    _check("is_dtensor", flags == [True, False, False], f"gave {flags}")
    x = torch.randn(2, 4, 3)
    with _entry("context_parallel_active"):
        before = compat.context_parallel_active()
        with context_parallel(mesh, buffers=[x], buffer_seq_dims=[1]):
            inside = compat.context_parallel_active()
        after = compat.context_parallel_active()
    _check("context_parallel_active", (before, inside, after) == (False, True, False), f"gave {(before, inside, after)}")
    from torch.distributed.tensor.experimental._attention import _ContextParallel
    from torch.distributed.tensor.parallel import parallelize_module

    wrapped, plain = torch.nn.Identity(), torch.nn.Identity()
    plain.register_forward_pre_hook(lambda m, a: None)
    with _entry("context_parallel_wrapped"):
        parallelize_module(wrapped, mesh, _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA))
        flags = [compat.context_parallel_wrapped(wrapped), compat.context_parallel_wrapped(plain)]
    _check("context_parallel_wrapped", flags == [True, False], f"gave {flags}")


def test_dtensor_local(group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(2, 3)
    with _entry("dtensor_local"):
        d = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        loc = compat.dtensor_local(d)
        again = compat.dtensor_local(d)
    _check("dtensor_local", isinstance(loc, torch.Tensor) and not isinstance(loc, DTensor), "not a plain tensor")
    _check("dtensor_local", loc is again, "not the same object each time")
    _check("dtensor_local", loc.data_ptr() == x.data_ptr() and torch.equal(loc, x), "not the local data")
