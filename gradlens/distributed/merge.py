"""Merging one window's statistics across data-parallel ranks (``torch.distributed``).

Under DDP every rank captures its own micro-batches; when the window closes the Lens calls
:func:`merge_window`, after which every rank holds the window statistics of the *global* batch
(all N = sum_r N_r samples of all ranks, samples in rank-major order: rank 0's samples in the
order its micro-steps saw them, then rank 1's, ...), and every instrument finalizes the record
one process would give on that concatenated batch.

What travels (one window, R ranks):

1. **One ``all_reduce`` (SUM)** of a single flat buffer holding every sum and count (float32
   for a float32 model, counts as exact 16-bit limbs; float64 otherwise):
   N, K, the loss sum, ``sum_grad_squared`` and ``grad_sum`` of every tracked parameter (fixed
   layout, zeros where a rank saw nothing), the micro-step norms of the two-batch noise scale,
   histogram counts, and a small ``[R, M]`` block in which rank r writes only row r: its
   per-rank values (sample counts, histogram extremes, the shapes of what it will gather, ...),
   so after the sum every rank knows every rank's row.
2. **One ``all_gather``** of one flat buffer per rank (padded to the longest), only when some
   instrument keeps per-sample vectors: ``batch_l2`` ``[N_r]``, the exact-mode layer factors
   ``a``/``delta`` of BatchDot / InnerTest / OrthoTest / Alpha, or their sketches ``[N_r, k]``,
   Alpha's per-sample losses and end-point projections.

Untracked windows call nothing. Without ``torch.distributed`` initialised (or with
``Lens(process_group=False)``) nothing of this runs.

**Checks.** When a Lens is built under torch.distributed, :func:`check_ranks_agree` compares,
in one small all_reduce, what every rank must share for the windows to pair up: the
instruments (types, keys, public settings such as histogram bins and range or the sketch k),
the schedule (``every`` as an int with the phase of the Lens's first step, or a callable's
values on the 64 windows from it) with the merge mode, and the tracked parameters (names,
shapes, dtypes); a difference is a RuntimeError on every rank naming it. Every collective of the
Lens waits at most ``Lens(timeout=...)`` seconds (default :data:`DEFAULT_TIMEOUT_S`; ``None``:
the process group's own timeout, 30 min by default), then raises a RuntimeError naming the
window, instead of hanging while another rank stalls.

**The global gradient sum from DDP** (:class:`DDPGradRoute`). ``grad_sum`` (D floats) need not
travel when DistributedDataParallel has already all-reduced the gradient: after its backward,
``p.grad = (1/R) sum_r U_r`` with U_r rank r's own dL/dp, and when every micro-step of every
rank has the same per-sample scale c (g_n = c * dL_n/dp: equal micro-batch sizes, the same
loss multiplier), the global ``sum_n g_n = c * R * p.grad`` exactly (up to rounding). The Lens
checks, on every rank, everything this needs (the tracked model ran inside a plain DDP over the
same ranks: no comm hook, no mixed precision, no ignored parameter, no join; the window's last
backward was synchronised; ``p.grad`` was None when the window's first backward started and
nothing but the captured backwards changed it until the last one: tensor versions, and what the
merge reads from ``p.grad`` is taken when a synchronised captured backward ends, so clipping
before the update is fine; floating dtype of the sums) and
sends a verdict and its scale range with the other per-rank values. A window merged this way
drops ``grad_sum`` from the all_reduce, which is decided from the previous window's verdict (the
same on every rank); if this window's verdict is negative, ``grad_sum`` follows in a second
all_reduce (exact, once), and the next window goes back to sending it.

Per-sample units. Each rank rescales its output gradients with its own micro-batch size (its
loss is a mean over its own B_{r,k} samples), so every g_n is the gradient of sample n's own
loss whatever the rank; sums then add, and the window gradient of a mean objective is
G = (1/N) sum over all ranks' g_n. Note that DDP's own update averages the ranks' gradients with
equal weights 1/R, which is the sample-weighted mean only when every rank has the same number
of samples: the records describe the global batch of per-sample gradients, not DDP's update.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from gradlens import compat
from gradlens.core.stats import DistParts
from gradlens.core.window import Window
from gradlens.core.sq_norms import sum_sq
from gradlens.core.limits import INLINE_GATHER_MAX
from gradlens.distributed.waits import DEFAULT_TIMEOUT_S, check_timeout, wait  # re-exported
from gradlens.core.param_shapes import full_shape

__all__ = [
    "DistParts", "DDPGradRoute", "Pending", "resolve_group", "check_not_sharded", "merge_window",
    "merge_window_start", "exchange", "exchange_start", "is_writer", "DEFAULT_TIMEOUT_S",
    "check_timeout", "lens_fingerprint", "check_ranks_agree",
]

#: windows of a callable schedule compared across ranks (from the Lens's first step)
SCHEDULE_PROBE = 64

#: dimensions of a gathered piece described in the per-rank block (shapes with more dims refused)
_MAX_DIMS = 6


def _dist():
    import torch.distributed as dist

    return dist


def resolve_group(process_group: Any) -> Any:
    """The process group to merge over, or None for local (single-process) records.

    ``None`` (the default): the default group when ``torch.distributed`` is available and
    initialised with more than one process, else None. ``False``: None (records of this rank
    only). A ``ProcessGroup``: that group (None if it has one member).
    """
    if process_group is False:
        return None
    try:
        dist = _dist()
        ready = dist.is_available() and dist.is_initialized()
    except Exception:  # pragma: no cover - torch without distributed support
        ready = False
    if process_group is None:
        if not ready:
            return None
        group = dist.group.WORLD
    else:
        if not ready:
            raise RuntimeError(
                f"Lens(process_group={process_group!r}) but torch.distributed is not initialised; "
                "call torch.distributed.init_process_group(...) first, or drop process_group"
            )
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(
                "process_group must be a torch.distributed ProcessGroup, None (the default group "
                f"when torch.distributed is initialised) or False (local records), got "
                f"{type(process_group).__name__}"
            )
        group = process_group
    return group if dist.get_world_size(group) > 1 else None


def _settings(inst: Any) -> str:
    """An instrument's type, key and public scalar settings, as text (the same on every rank)."""
    plain = (bool, int, float, str, type(None))
    parts = []
    for name, value in sorted(vars(inst).items()):
        if name.startswith("_"):
            continue
        if isinstance(value, (tuple, list)):
            flat = [v for item in value for v in (item if isinstance(item, (tuple, list)) else (item,))]
            if not all(isinstance(v, plain) for v in flat):
                continue
        elif not isinstance(value, plain):
            continue
        parts.append(f"{name}={value!r}")
    cls = type(inst)
    return f"{cls.__module__}.{cls.__qualname__}({', '.join([f'key={inst.key!r}', *parts])})"


def lens_fingerprint(instruments: Sequence[Any], every: Any, step: int, merge: str,
                     params: dict[str, Tensor]) -> dict[str, str]:
    """What every rank's Lens must share, by part: ``instruments``, ``schedule``, ``parameters``
    (each a short text; :func:`check_ranks_agree` compares their hashes)."""
    # what decides which windows pair up: the tracked windows counted from each rank's first
    # window (whose step may differ, e.g. rank 0 resumed from its log), not the step numbers
    if callable(every):
        offsets = [s - step for s in range(step, step + SCHEDULE_PROBE) if every(s)]
        schedule = f"every=<callable> tracking windows first + {offsets} of the next {SCHEDULE_PROBE}"
    else:
        schedule = f"every={every} with the first window at phase {step % every}"
    return {
        "instruments": "[" + "; ".join(_settings(i) for i in instruments) + "]",
        "schedule": f"{schedule}, merge={merge!r}",
        "parameters": "; ".join(f"{n}:{tuple(full_shape(p))}:{p.dtype}" for n, p in params.items()),
    }


def _hash52(text: str) -> float:
    """52 bits of sha256 of ``text``, as an exactly representable float64 integer."""
    return float(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 12)


def check_ranks_agree(group: Any, fingerprint: dict[str, str], timeout: float | None) -> None:
    """Once, when a Lens is built: every rank of ``group`` has the same ``fingerprint``
    (:func:`lens_fingerprint`). One all_reduce of ``[R, parts]`` float64 hashes (rank r writes
    row r); a difference raises on every rank a RuntimeError naming the parts that differ, the
    ranks, and this rank's own value."""
    dist = _dist()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    names = list(fingerprint)
    buf = torch.zeros(world, len(names), dtype=torch.float64, device=device)
    buf[rank] = torch.tensor([_hash52(fingerprint[n]) for n in names], dtype=torch.float64)
    wait(dist.all_reduce(buf, group=group, async_op=True), timeout, "the Lens configuration check", group)
    rows = buf.cpu()
    differ = []
    for j, name in enumerate(names):
        other = [r for r in range(world) if rows[r, j] != rows[0, j]]
        if other:
            shown = fingerprint[name]
            shown = shown if len(shown) <= 300 else shown[:300] + "..."
            differ.append(f"{name}: ranks {other} differ from rank 0 (this rank, {rank}: {shown})")
    if differ:
        raise RuntimeError(
            "the Lens differs across ranks, so its windows would not pair up: "
            + "; ".join(differ)
            + ". Build the Lens with the same instruments (and settings), the same every= and "
            "tracked parameters on every rank (and start every rank at the same step: resume "
            "with Lens.load_state_dict on every rank rather than from rank 0's log)"
        )


def is_writer(group: Any) -> bool:
    """Whether this process writes records to the sinks: rank 0 of ``group`` (always without one)."""
    return group is None or _dist().get_rank(group) == 0


def check_not_sharded(model: torch.nn.Module, who: str = "Lens") -> None:
    """Refuse ``DTensor`` parameters that neither FSDP2 (``fully_shard``) manages nor tensor
    parallelism made: a module whose parameters are partly DTensors and partly plain tensors
    (a hand-made ``distribute_tensor``; ``parallelize_module`` makes every parameter of a
    parallelized layer a DTensor, gradlens/distributed/tensor_parallel.py)."""
    from gradlens.distributed.fsdp import unmanaged_dtensors

    sharded = set(unmanaged_dtensors(model))
    mixed: list[str] = []
    if sharded:
        for mname, mod in model.named_modules():
            own = [f"{mname}.{n}" if mname else n for n, _ in mod.named_parameters(recurse=False)]
            dts = [q for q in own if q in sharded]
            if dts and len(dts) != len(own):
                mixed += dts
    if mixed:
        shown = ", ".join(mixed[:3]) + (", ..." if len(mixed) > 3 else "")
        raise RuntimeError(
            f"{who}: parameters {shown} are DTensors beside plain parameters of the same module, "
            "which neither FSDP2 nor tensor parallelism makes (a hand-made distribute_tensor); "
            "gradlens needs each parameter whole during its module's forward and backward, or "
            "sharded as parallelize_module(model, mesh, {name: ColwiseParallel() / "
            "RowwiseParallel()}) shards it: shard the model with FSDP2 "
            "(torch.distributed.fsdp.fully_shard), parallelize it with parallelize_module, or "
            "wrap it in DistributedDataParallel"
        )


def _meta_len(parts: Sequence[DistParts]) -> int:
    n = 0
    for p in parts:
        n += sum(t.numel() for t in p.per_rank)
        n += len(p.pieces) * (1 + _MAX_DIMS)
    return n


def _device(parts: Sequence[DistParts], default: torch.device) -> torch.device:
    for p in parts:
        for t in (*p.sums, *p.per_rank, *p.pieces):
            return t.device
    return default




def exchange(
    parts: Sequence[DistParts], group: Any, device: torch.device | None = None, memo: dict | None = None,
    timeout: float | None = None, what: str = "a gradlens collective",
):
    """:func:`exchange_start` and, at once, its ``finish()`` (the results below)."""
    return exchange_start(parts, group, device, memo, timeout, what).finish()


class Pending:
    """A collective in flight: ``finish()`` waits for it and returns the result (once)."""

    def __init__(self, steps):
        self._steps = steps
        self._done = False
        self._value: Any = None

    def finish(self) -> Any:
        if not self._done:
            try:
                next(self._steps)
            except StopIteration as stop:
                self._value = stop.value
            else:  # pragma: no cover - each generator below yields once
                raise RuntimeError("a gradlens collective yielded twice")
            self._done = True
            self._steps = None
        return self._value


def _started(steps) -> Pending:
    next(steps)  # runs up to the issued collective
    return Pending(steps)


def exchange_start(
    parts: Sequence[DistParts], group: Any, device: torch.device | None = None, memo: dict | None = None,
    timeout: float | None = None, what: str = "a gradlens collective",
) -> Pending:
    """Issue :func:`exchange`'s all_reduce without waiting (the buffers are built now; the
    collective runs in the background); ``.finish()`` completes it, waiting at most ``timeout``
    seconds per collective (None: the process group's timeout; see :func:`wait`)."""
    return _started(_exchange(parts, group, device, memo, timeout, what))


def _exchange(
    parts: Sequence[DistParts], group: Any, device: torch.device | None = None, memo: dict | None = None,
    timeout: float | None = None, what: str = "a gradlens collective",
):
    """All-reduce every ``sums``, share every ``per_rank``, gather every ``pieces``.

    Returns one ``(sums, per_rank, pieces)`` triple per participant, in the same order: summed
    tensors (original shapes and dtypes), ``[R, *shape]`` per-rank tensors (float64), and per
    piece a list of R tensors (original dtype; rank order). At most two collectives: one
    ``all_reduce`` always, one ``all_gather_into_tensor`` only if any piece exists.

    ``memo`` (a dict kept by the caller across calls with the same participants): the shapes
    every rank gathered last time. When they predict this call's (the usual case: the same
    batch sizes window after window) and the pieces are small (at most
    :data:`INLINE_GATHER_MAX` elements over all ranks), the pieces travel inside the all_reduce
    instead (every rank writes its own rows of a zeroed block, float64 values exactly), and the
    all_gather is skipped; a wrong prediction (seen in the shared shapes) falls back to it.
    """
    dist = _dist()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if device is None:
        device = _device(parts, torch.device("cpu"))
        backend = dist.get_backend(group)
        if backend == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
    f64 = torch.float64

    # The wire dtype: float32 when every floating sum of a real size is float32 or narrower
    # (a float32 model: halves the bytes), else float64. In a float32 buffer, integer counts
    # travel as 16-bit limbs (exact while R < 256) and float64 scalars as a (hi, lo) pair.
    big = [t for p in parts for t in p.sums if t.is_floating_point() and t.numel() > 64]
    wire = torch.float32 if big and all(t.element_size() <= 4 for t in big) else f64
    sum_len = sum(_slots(t, wire) for p in parts for t in p.sums)
    meta_len = _meta_len(parts)
    # pieces inside the all_reduce, where last call's shapes predict them
    structure = tuple(len(p.pieces) for p in parts)
    predicted = memo.get("shapes") if memo is not None and memo.get("structure") == structure else None
    inline_len, inline_at = 0, []
    if predicted is not None:
        unique_pred = _unique_flags(parts)
        per_rank_len = [
            sum(_numel(s[r]) for sp, fl in zip(predicted, unique_pred) for s, u in zip(sp, fl) if u)
            for r in range(world)
        ]
        f64_slots = 1 if wire == torch.float64 else 2
        if sum(per_rank_len) * f64_slots <= INLINE_GATHER_MAX:
            inline_at = [0]
            for n in per_rank_len:
                inline_at.append(inline_at[-1] + n * f64_slots)
            inline_len = inline_at[-1]
        else:
            predicted = None
    buf = torch.zeros(sum_len + world * meta_len + inline_len, dtype=wire, device=device)
    off = 0
    for p in parts:
        for t in p.sums:
            k = _slots(t, wire)
            buf[off : off + k] = _encode(t.detach().reshape(-1).to(device), wire)
            off += k
    row = buf[sum_len + rank * meta_len : sum_len + (rank + 1) * meta_len]
    moff = 0
    for p in parts:
        for t in p.per_rank:
            row[moff : moff + t.numel()] = t.detach().reshape(-1).to(device=device, dtype=f64)
            moff += t.numel()
        for t in p.pieces:
            if t.dim() > _MAX_DIMS:
                raise RuntimeError(
                    f"a per-sample tensor of shape {tuple(t.shape)} has more than {_MAX_DIMS} "
                    "dimensions and cannot be gathered across ranks; use the sketch mode"
                )
            row[moff] = t.dim()
            row[moff + 1 : moff + 1 + t.dim()] = torch.tensor(t.shape, dtype=f64)
            moff += 1 + _MAX_DIMS
    if inline_len:
        mine = [
            t.detach().reshape(-1).to(device=device, dtype=f64)
            for p, fl in zip(parts, _unique_flags(parts)) for t, u in zip(p.pieces, fl) if u
        ]
        flat = torch.cat(mine) if mine else torch.zeros(0, dtype=f64, device=device)
        lo, hi = sum_len + world * meta_len + inline_at[rank], sum_len + world * meta_len + inline_at[rank + 1]
        if _slots(flat, wire) == hi - lo:
            buf[lo:hi] = _encode(flat, wire)
        # else: this rank's shapes differ from the prediction; seen by every rank below
    work = dist.all_reduce(buf, group=group, async_op=True)
    yield
    wait(work, timeout, what, group)

    meta_end = sum_len + world * meta_len
    meta = buf[sum_len:meta_end].view(world, meta_len).cpu().double() if meta_len else torch.zeros(world, 0, dtype=f64)
    # shapes of every rank's pieces, and the flat gather layout
    shapes: list[list[list[tuple[int, ...]]]] = []  # participant -> piece -> rank -> shape
    moff = 0
    for p in parts:
        moff += sum(t.numel() for t in p.per_rank)
        mine = []
        for _ in p.pieces:
            per = []
            for r in range(world):
                nd = int(meta[r, moff])
                per.append(tuple(int(v) for v in meta[r, moff + 1 : moff + 1 + nd]))
            mine.append(per)
            moff += 1 + _MAX_DIMS
        shapes.append(mine)
    # a tensor given by several participants (factors shared by instruments) travels once
    unique = _unique_flags(parts)
    lengths = [
        sum(_numel(s[r]) for sp, fl in zip(shapes, unique) for s, u in zip(sp, fl) if u)
        for r in range(world)
    ]
    if memo is not None:
        memo["structure"], memo["shapes"] = structure, shapes
    gathered = None
    if predicted is not None and shapes == predicted:  # the pieces came with the all_reduce
        gathered = torch.zeros(world, max(lengths, default=0), dtype=f64, device=device)
        for r in range(world):
            chunk = buf[meta_end + inline_at[r] : meta_end + inline_at[r + 1]]
            like = torch.empty(lengths[r], dtype=f64)
            gathered[r, : lengths[r]] = _decode(chunk, like, wire).to(device)
    elif any(p.pieces for p in parts):
        longest = max(lengths)
        send = torch.zeros(longest, dtype=f64, device=device)
        goff = 0
        for p, fl in zip(parts, unique):
            for t, u in zip(p.pieces, fl):
                if u:
                    send[goff : goff + t.numel()] = t.detach().reshape(-1).to(device=device, dtype=f64)
                    goff += t.numel()
        gathered = torch.empty(world * longest, dtype=f64, device=device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        wait(gather(gathered, send, group=group, async_op=True), timeout, what, group)
        gathered = gathered.view(world, longest)

    out = []
    off = 0
    moff = 0
    goffs = [0] * world
    received: dict[int, list[Tensor]] = {}
    for p, pshapes, fl in zip(parts, shapes, unique):
        sums = []
        for t in p.sums:
            k = _slots(t, wire)
            sums.append(_decode(buf[off : off + k], t, wire))
            off += k
        per_rank = []
        for t in p.per_rank:
            per_rank.append(meta[:, moff : moff + t.numel()].reshape(world, *t.shape).clone())
            moff += t.numel()
        moff += len(p.pieces) * (1 + _MAX_DIMS)
        pieces = []
        for t, per, u in zip(p.pieces, pshapes, fl):
            if not u:
                pieces.append(received[id(t)])
                continue
            got = received[id(t)] = []
            for r in range(world):
                k = _numel(per[r])
                got.append(gathered[r, goffs[r] : goffs[r] + k].view(per[r]).to(dtype=t.dtype, device=t.device))
                goffs[r] += k
            pieces.append(got)
        out.append((sums, per_rank, pieces))
    return out


def _unique_flags(parts: Sequence[DistParts]) -> list[list[bool]]:
    """Per participant and piece: whether it is the first occurrence of that tensor (a tensor
    given by several participants, e.g. factors shared by instruments, travels once)."""
    seen: set[int] = set()
    unique = []
    for p in parts:
        flags = []
        for t in p.pieces:
            flags.append(id(t) not in seen)
            seen.add(id(t))
        unique.append(flags)
    return unique


_LIMBS = 4  # 16-bit limbs of an int64 count in a float32 buffer


def _slots(t: Tensor, wire: torch.dtype) -> int:
    if wire == torch.float64 or (t.is_floating_point() and t.element_size() <= 4):
        return t.numel()
    return t.numel() * (_LIMBS if not t.is_floating_point() else 2)


def _encode(flat: Tensor, wire: torch.dtype) -> Tensor:
    if wire == torch.float64 or (flat.is_floating_point() and flat.element_size() <= 4):
        return flat.to(wire)
    if flat.is_floating_point():  # float64 -> (hi, lo) float32
        hi = flat.to(torch.float32)
        lo = (flat - hi.to(flat.dtype)).to(torch.float32)
        return torch.cat([hi, lo])
    x = flat.to(torch.int64)  # counts >= 0
    return torch.cat([((x >> (16 * i)) & 0xFFFF).to(torch.float32) for i in range(_LIMBS)])


def _decode(chunk: Tensor, like: Tensor, wire: torch.dtype) -> Tensor:
    n = like.numel()
    if wire == torch.float64 or (like.is_floating_point() and like.element_size() <= 4):
        out = chunk
    elif like.is_floating_point():
        out = chunk[:n].to(like.dtype) + chunk[n:].to(like.dtype)
    else:
        limbs = chunk.to(torch.int64).view(_LIMBS, n)
        out = sum(limbs[i] << (16 * i) for i in range(_LIMBS))
    return out.view(like.shape).to(dtype=like.dtype, device=like.device)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class MergeContext:
    """What the Lens knows that shapes the fixed layout: the tracked parameters (qualified name
    -> parameter, in a fixed order), the watched modules, the quantities the instruments need."""

    params: dict[str, Tensor]
    watched: list[Any]
    needs: frozenset[str]
    world: int = 1
    rank: int = 0
    cache: dict = field(default_factory=dict)  # per merge: shared concatenations
    #: the DDP route of ``grad_sum`` (:class:`DDPGradRoute`), or None
    route: Any = None
    #: kept by the Lens across windows: last window's gathered shapes (see :func:`exchange`)
    memo: dict | None = None
    #: seconds each collective waits (``Lens(timeout=...)``; None: the process group's)
    timeout: float | None = None
    #: the window's step (for messages)
    step: int | None = None
    #: the parameter groups of ``Lens(groups=...)`` in a fixed order (their ``batch_l2`` parts
    #: travel as one more gathered piece ``[G, N_r]``)
    groups: tuple = ()


def merge_window(window: Window, instruments, group: Any, ctx: MergeContext) -> Window:
    """The window of the global batch of all ranks.

    ``window`` is this rank's :class:`~gradlens.core.window.Window` (its stacked uses settled):
    its statistics (:class:`~gradlens.core.stats.WindowStats`) and instrument window states
    (``id(instrument)`` -> state) are merged. Every rank must call this for the same windows
    with the same instruments. Returns the merged window (a new object, samples rank-major,
    with this rank's sites, coverage and empty micro-steps).
    """
    return merge_window_start(window, instruments, group, ctx).finish()


def merge_window_start(window: Window, instruments, group: Any, ctx: MergeContext) -> Pending:
    """:func:`merge_window` with its all_reduce issued and not waited for: what depends on the
    gradients (``p.grad`` under DDP) is read now, before the update; ``.finish()`` returns the
    merged window. Collectives of one group run in the order they were issued."""
    return _started(_merge_window(window, instruments, group, ctx))


def _merge_window(whole: Window, instruments, group: Any, ctx: MergeContext):
    window, states = whole.stats, whole.states
    dist = _dist()
    ctx.world = dist.get_world_size(group)
    ctx.rank = dist.get_rank(group)
    route = ctx.route if "grad_sum" in ctx.needs else None
    fast = route is not None and route.fast
    wctx = dataclasses.replace(ctx, needs=ctx.needs - {"grad_sum"}) if fast else ctx
    parts = [window.to_buffers(wctx)]
    for inst in instruments:
        parts.append(inst.to_buffers(states[id(inst)], ctx))
    light_sq = None
    if route is not None:
        verdict = route.verdict(window, ctx.params)
        parts.append(DistParts(per_rank=[verdict]))
        if fast and route.light and route.local_ok and not ctx.groups:
            # the instruments read ||sum g_n||^2 only (and no group needs its own part):
            # ||p.grad||^2 now, before the update
            light_sq = route.light_grad_sq(ctx.params)
    own_scale = route.cmin if route is not None else None  # the route moves on to the next window
    what = "the merge of window " + (str(ctx.step) if ctx.step is not None else "(this one)")
    pending = exchange_start(parts, group, memo=ctx.memo, timeout=ctx.timeout, what=what)
    yield
    got = pending.finish()
    merged = window.from_buffers(wctx, *got[0])
    new_states = dict(states)
    for inst, g in zip(instruments, got[1 : 1 + len(instruments)]):
        new_states[id(inst)] = inst.from_buffers(states[id(inst)], ctx, *g)
    if route is not None:
        scale = route.agreed(got[-1][1][0])
        if fast and scale is not None:
            # this rank's own scale (float64; equal to every rank's, as the wire just showed)
            factor = float(own_scale) * ctx.world
            if light_sq is not None:
                merged.grad_sum_sq = light_sq * (factor * factor)
            else:
                merged.grad_sum = route.global_grad_sum(window, ctx.params, factor)
        elif fast:  # the verdict fell through: grad_sum travels after all (exact)
            gctx = dataclasses.replace(ctx, needs=frozenset({"grad_sum"}))
            merged.grad_sum = window.from_buffers(gctx, *exchange([window.to_buffers(gctx)], group, timeout=ctx.timeout, what=what)[0]).grad_sum
        route.fast = scale is not None
    return whole.merged(merged, new_states)


class DDPGradRoute:
    """Whether the global ``grad_sum`` of a window can be read from DDP's all-reduced
    ``p.grad`` (module docstring), for one Lens. The Lens calls :meth:`on_forward` (a forward
    pre-hook of the tracked model), :meth:`start_micro` / :meth:`end_micro` around each captured
    backward, :meth:`reset` when a window opens; :func:`merge_window` the rest.

    ``p.grad`` changed between the window's last captured backward and the update (gradient
    clipping, a GradScaler's unscale) does not spoil the route: what the merge needs from it is
    taken at the end of every synchronised captured backward, after DDP's all-reduce: its
    squared norm when the instruments read only ``||sum g_n||^2`` (``light``: a few dot products,
    the same as at the update), or, after a window whose ``p.grad`` was changed that way (so the
    next is expected to be too), a copy of it (one pass, instead of the second all_reduce of D
    numbers the change would otherwise cost).

    Attributes:
        fast: the next merge leaves ``grad_sum`` out of the all_reduce (the previous window's
            verdict, the same on every rank).
        light: the instruments read only ``||sum g_n||^2`` of the window (GradNorm,
            NoiseScaleTwoBatch).
    """

    def __init__(self, group: Any, light: bool = False):
        self.group = group
        self.light = light
        self.fast = False
        self.touched = False  # p.grad changed after the last captured backward of the last window
        self._plain: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
        self.reset()

    def reset(self) -> None:
        self.ok = True
        self.ddp: Any = None  # weakref of the DDP that ran the last forward (None: not under DDP)
        self.synced = False  # that forward prepares DDP's all-reduce of the backward that follows
        self.micro_ddp: Any = None
        self.micro_synced = False
        self.versions: list | None = None  # (id, version) of every p.grad after the last capture
        self.cmin: Any = None
        self.cmax: Any = None
        self._ddp_of_window: Any = None
        self.last_synced = False
        self.local_ok = False  # this rank's part of the last verdict
        self.snap_sq: Tensor | None = None  # light: ||p.grad||^2 after the last synced capture
        self.snap: dict[str, Tensor] | None = None  # p.grad copies after it (touched predicted)

    # ---- the Lens's calls ---------------------------------------------------------------
    def on_forward(self) -> None:
        """In a forward pre-hook of the tracked model: note the DDP module running it."""
        ddp = compat.active_ddp_module()
        if ddp is None or not torch.is_grad_enabled():
            self.ddp, self.synced = None, False
            return
        self.ddp = weakref.ref(ddp)
        self.synced = compat.ddp_grad_sync(ddp)

    @staticmethod
    def _versions(params: dict[str, Tensor]) -> list:
        return [None if p.grad is None else (id(p.grad), compat.tensor_version(p.grad)) for p in params.values()]

    def start_micro(self, params: dict[str, Tensor]) -> None:
        """Before a captured backward: ``p.grad`` must be None (the window's first) or as the
        previous captured backward left it."""
        if not self.ok:
            return
        if self.versions is None:
            self.ok = all(p.grad is None for p in params.values())
        else:
            self.ok = self.versions == self._versions(params)
        self.micro_ddp, self.micro_synced = self.ddp, self.synced

    def end_micro(self, params: dict[str, Tensor], scale: float | Tensor) -> None:
        """After a captured backward (all of DDP's work done) with per-sample scale ``scale``."""
        if not self.ok:
            return
        if self.micro_ddp is None or (self.versions is not None and self.micro_ddp() is not self._last()):
            self.ok = False
            return
        self._ddp_of_window = self.micro_ddp
        self.last_synced = self.micro_synced
        self.versions = self._versions(params)
        self.snap_sq = self.snap = None
        if self.micro_synced:  # p.grad: the all-reduced gradient, as the merge may need it
            if self.light:
                self.snap_sq = self.global_grad_sq(params, 1.0)
            elif self.touched:
                self.snap = {q: p.grad.detach().clone() for q, p in params.items() if p.grad is not None}
        c = scale if isinstance(scale, Tensor) else torch.tensor(float(scale), dtype=torch.float64)
        c = c.detach().reshape(()).double()
        self.cmin = c if self.cmin is None else torch.minimum(self.cmin, c)
        self.cmax = c if self.cmax is None else torch.maximum(self.cmax, c)

    def _last(self):
        ref = self._ddp_of_window
        return None if ref is None else ref()

    # ---- merge ----------------------------------------------------------------------------
    def _is_plain(self, ddp: Any, params: dict[str, Tensor]) -> bool:
        """A DDP that averages every tracked parameter's gradient over the Lens's ranks and
        nothing else (cached per DDP module; join is checked each time)."""
        known = self._plain.get(ddp)
        if known is None:
            dist = _dist()
            owned = {id(p) for p in ddp.module.parameters()}
            known = (
                compat.ddp_average_departure(ddp) is None
                and not compat.ddp_python_reducer(ddp)
                and not getattr(ddp, "parameters_to_ignore", [None])
                and not compat.ddp_delayed_params(ddp)
                and dist.get_process_group_ranks(ddp.process_group) == dist.get_process_group_ranks(self.group)
                and all(id(p) in owned for p in params.values())
            )
            self._plain[ddp] = known
        return known and not compat.ddp_join_enabled(ddp)

    def verdict(self, window: Any, params: dict[str, Tensor]) -> Tensor:
        """``[3]`` float64 (ok, smallest and largest per-sample scale) of this rank's window."""
        ok = self.ok and self.versions is not None and self.last_synced
        if ok:
            self.touched = self.versions != self._versions(params)
            if self.touched:  # changed since the last capture: the snapshot taken then serves
                ok = self.snap_sq is not None if self.light else self.snap is not None
        ddp = self._last() if ok else None
        ok = ddp is not None and self._is_plain(ddp, params)
        if ok:
            grads = self.snap if self.snap is not None else {q: p.grad for q, p in params.items()}
            for q in params:
                acc, g = window.grad_sum.get(q), grads.get(q)
                if acc is None or g is None or g.dtype != acc.dtype or g.is_sparse:
                    ok = False
                    break
        self.local_ok = ok
        if not ok:
            return torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
        return torch.stack([self.cmin.new_ones(()), self.cmin, self.cmax])

    @staticmethod
    def agreed(rows: Tensor) -> float | None:
        """From every rank's verdict ``[R, 3]``: the common per-sample scale c if every rank
        may read the global gradient from ``p.grad`` and all scales are equal, else None."""
        if not bool((rows[:, 0] == 1).all()):
            return None
        lo, hi = float(rows[:, 1].min()), float(rows[:, 2].max())
        return lo if lo == hi and lo > 0 else None

    @staticmethod
    def global_grad_sq(params: dict[str, Tensor], factor: float) -> Tensor:
        """||sum_n g_n||^2 of all ranks = factor^2 ||p.grad||^2 (0-d float64; nothing copied)."""
        with torch.no_grad():
            total = sum_sq([p.grad for p in params.values()])
            if total is None:
                total = torch.zeros((), dtype=torch.float64, device=next(iter(params.values())).device)
        return total * (factor * factor)

    def light_grad_sq(self, params: dict[str, Tensor]) -> Tensor:
        """||p.grad||^2 of the window's last synchronised captured backward (its snapshot, or
        p.grad now when none was taken)."""
        return self.snap_sq if self.snap_sq is not None else self.global_grad_sq(params, 1.0)

    def global_grad_sum(self, window: Any, params: dict[str, Tensor], factor: float) -> dict[str, Tensor]:
        """sum_n g_n of all ranks = factor * p.grad (of the last synchronised captured
        backward: the snapshot when one was taken), written over this rank's own sums (their
        buffers; this rank's values are no longer needed)."""
        out = type(window.grad_sum)(getattr(window.grad_sum, "pool", None))
        with torch.no_grad():
            for q, p in params.items():
                acc = window.grad_sum[q]
                g = self.snap[q] if self.snap is not None else p.grad
                out[q] = torch.mul(g.detach(), factor, out=acc)
        return out
