"""What one tracked window produces: :class:`Record`, and the histogram value types.

A record holds, for one optimizer update (a *window* of K micro-steps with N samples), the
finalized value of every instrument under its record key (``record["batch_l2"]``, ...). Values
are tensors (on the CPU, float64 for floats), Python floats, dicts of parameter name -> tensor,
or the histogram types below. :func:`record_to_json` / :func:`record_from_json` turn a record
into plain JSON data and back (tensors as nested lists with dtype and shape).
``record.groups`` holds the same kinds of values per layer group (``Lens(groups=...)``).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import torch
from torch import Tensor

__all__ = [
    "Hist1d", "Hist2d", "Record", "TensorSummary", "record_to_json", "record_from_json", "as_number", "flatten",
    "flatten_histograms",
]


@dataclass
class Hist1d:
    """A histogram of per-sample gradient elements over one window.

    Attributes:
        counts: ``[bins]`` int64. Element ``x`` falls in bin ``floor((x - lo) * bins / (hi - lo))``
            clamped to ``[0, bins - 1]``: values below ``lo`` are counted in the first bin, values
            at or above ``hi`` in the last. ``0`` on a symmetric range with an even number of
            bins is the left edge of bin ``bins // 2`` and is counted there.
        edges: ``[bins + 1]`` float64, ``linspace(lo, hi, bins + 1)``.
        clamped_low: how many elements were below ``lo`` (included in ``counts[0]``).
        clamped_high: how many elements were above ``hi`` (included in ``counts[-1]``).
        stderr: sampled histograms (``GradHist1d(sample=...)``) only: ``[bins]`` float64
            standard error of each estimated count; ``counts`` and the clamped numbers are then
            float64 unbiased estimates. None for exact counts.
        sample: the fraction of elements drawn (None: exact).
    """

    counts: Tensor
    edges: Tensor
    clamped_low: int | float = 0
    clamped_high: int | float = 0
    stderr: Tensor | None = None
    sample: float | None = None

    @property
    def range(self) -> tuple[float, float]:
        return float(self.edges[0]), float(self.edges[-1])

    @property
    def total(self) -> int | float:
        """Number of elements binned (``N * D`` for D tracked parameter entries; an estimate,
        float, for a sampled histogram)."""
        return _total(self.counts)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Hist1d)
            and torch.equal(self.counts, other.counts)
            and torch.equal(self.edges, other.edges)
            and self.clamped_low == other.clamped_low
            and self.clamped_high == other.clamped_high
            and _same(self.stderr, other.stderr)
            and self.sample == other.sample
        )


@dataclass
class Hist2d:
    """A joint histogram of (parameter value theta_j, per-sample gradient element g_n,j).

    Attributes:
        counts: ``[param_bins, grad_bins]`` int64, over all samples n and entries j; binning and
            clamping in each axis as in :class:`Hist1d`.
        param_edges: ``[param_bins + 1]`` float64.
        grad_edges: ``[grad_bins + 1]`` float64.
        clamped_param: elements whose parameter value was outside the parameter range.
        clamped_grad: elements whose gradient value was outside the gradient range.
        stderr, sample: as in :class:`Hist1d` (``stderr`` ``[param_bins, grad_bins]``).
    """

    counts: Tensor
    param_edges: Tensor
    grad_edges: Tensor
    clamped_param: int = 0
    clamped_grad: int | float = 0
    stderr: Tensor | None = None
    sample: float | None = None

    @property
    def total(self) -> int | float:
        return _total(self.counts)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Hist2d)
            and torch.equal(self.counts, other.counts)
            and torch.equal(self.param_edges, other.param_edges)
            and torch.equal(self.grad_edges, other.grad_edges)
            and self.clamped_param == other.clamped_param
            and self.clamped_grad == other.clamped_grad
            and _same(self.stderr, other.stderr)
            and self.sample == other.sample
        )


def _total(counts: Tensor) -> int | float:
    return float(counts.sum()) if counts.is_floating_point() else int(counts.sum())


def _same(a: Tensor | None, b: Tensor | None) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


@dataclass
class TensorSummary:
    """What a log keeps of a large tensor by default (see :class:`gradlens.output.sinks.JsonlSink`):
    its shape and dtype and five float64 numbers over all its elements.

    Attributes:
        shape: the tensor's shape.
        dtype: its dtype name (``"float32"``).
        sum: sum of the elements.
        norm: L2 norm, sqrt(sum of squares) (e.g. for ``sum_grad_squared[name]``:
            sqrt(sum_j (sum_n g_n,j^2)^2); the per-parameter total sum_n ||g_n||^2 is ``sum``).
        min, max: the smallest and largest element (NaN for an empty tensor).
    """

    shape: tuple[int, ...]
    dtype: str
    sum: float
    norm: float
    min: float
    max: float

    @classmethod
    def of(cls, t: Tensor) -> "TensorSummary":
        t = t.detach()
        d = t.double()
        empty = d.numel() == 0
        return cls(
            shape=tuple(t.shape),
            dtype=str(t.dtype).removeprefix("torch."),
            sum=float(d.sum()),
            norm=float(d.norm()) if not empty else 0.0,
            min=float(d.min()) if not empty else math.nan,
            max=float(d.max()) if not empty else math.nan,
        )

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorSummary):
            return NotImplemented
        return (self.shape, self.dtype) == (other.shape, other.dtype) and all(
            _values_equal(float(getattr(self, k)), float(getattr(other, k)))
            for k in ("sum", "norm", "min", "max")
        )


@dataclass
class Record:
    """The statistics of one tracked window.

    Attributes:
        step: index of the optimizer update that closed the window (0-based, counts every
            real update of the watched optimizer, tracked or not).
        num_samples: N, the samples seen in the window.
        micro_steps: K, the captured backward passes in the window.
        values: record key -> value; also reachable as ``record[key]``.
        meta: how values were produced (e.g. ``{"batch_dot": "exact"}``) and notes such as why a
            value is missing.
        groups: group name -> {record key -> value}, the values of the instruments that
            decompose over parameters restricted to one group of parameters
            (``Lens(groups=...)``; e.g. ``record.groups["fc1"]["batch_l2"]`` ``[N]``); the same
            kinds of values as :attr:`values`. Empty without groups.
    """

    step: int
    num_samples: int
    micro_steps: int
    values: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    groups: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        try:
            return self.values[key]
        except KeyError:
            raise KeyError(
                f"record of step {self.step} has no entry {key!r}; it has {sorted(self.values)}"
            ) from None

    def __contains__(self, key: object) -> bool:
        return key in self.values

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def keys(self):
        return self.values.keys()

    def items(self):
        return self.values.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Record):
            return NotImplemented
        return (
            (self.step, self.num_samples, self.micro_steps)
            == (other.step, other.num_samples, other.micro_steps)
            and self.meta == other.meta
            and _values_equal(self.values, other.values)
            and _values_equal(self.groups, other.groups)
        )


def _values_equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b) or (a.isnan() == b.isnan()).all() and torch.equal(a.nan_to_num(), b.nan_to_num()))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


# --------------------------------------------------------------------------- JSON encoding


def _encode(value: Any) -> Any:
    if isinstance(value, Tensor):
        t = value.detach().cpu()
        data = t.tolist()
        if t.is_floating_point():
            data = _encode_floats(data)
        return {"__tensor__": data, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
    if isinstance(value, Hist1d):
        return {
            "__hist1d__": True,
            "counts": _encode(value.counts),
            "edges": _encode(value.edges),
            "clamped_low": value.clamped_low,
            "clamped_high": value.clamped_high,
            **_sampled_fields(value),
        }
    if isinstance(value, Hist2d):
        return {
            "__hist2d__": True,
            "counts": _encode(value.counts),
            "param_edges": _encode(value.param_edges),
            "grad_edges": _encode(value.grad_edges),
            "clamped_param": value.clamped_param,
            "clamped_grad": value.clamped_grad,
            **_sampled_fields(value),
        }
    if isinstance(value, TensorSummary):
        return {
            "__summary__": True,
            "shape": list(value.shape),
            "dtype": value.dtype,
            **{k: _encode(float(getattr(value, k))) for k in ("sum", "norm", "min", "max")},
        }
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"__float__": repr(value)}
    return value


def _sampled_fields(h) -> dict:
    if h.stderr is None and h.sample is None:
        return {}
    return {"stderr": _encode(h.stderr), "sample": h.sample}


def _count(v, sampled: bool):
    return float(v) if sampled else int(v)


def _encode_floats(data: Any) -> Any:
    # JSON has no inf/nan: write them as strings inside tensor data.
    if isinstance(data, list):
        return [_encode_floats(v) for v in data]
    if isinstance(data, float) and not math.isfinite(data):
        return repr(data)
    return data


def _decode_floats(data: Any) -> Any:
    if isinstance(data, list):
        return [_decode_floats(v) for v in data]
    if isinstance(data, str):
        return float(data)
    return data


def _decode(value: Any) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, value["dtype"])
            data = _decode_floats(value["__tensor__"])
            return torch.tensor(data, dtype=dtype).reshape(value["shape"])
        if value.get("__hist1d__"):
            sampled = value.get("sample") is not None
            return Hist1d(
                _decode(value["counts"]),
                _decode(value["edges"]),
                _count(value["clamped_low"], sampled),
                _count(value["clamped_high"], sampled),
                _decode(value.get("stderr")),
                value.get("sample"),
            )
        if value.get("__hist2d__"):
            sampled = value.get("sample") is not None
            return Hist2d(
                _decode(value["counts"]),
                _decode(value["param_edges"]),
                _decode(value["grad_edges"]),
                int(value["clamped_param"]),
                _count(value["clamped_grad"], sampled),
                _decode(value.get("stderr")),
                value.get("sample"),
            )
        if value.get("__summary__") is True:
            return TensorSummary(
                tuple(value["shape"]),
                str(value["dtype"]),
                *(float(_decode(value[k])) for k in ("sum", "norm", "min", "max")),
            )
        if "__float__" in value:
            return float(value["__float__"])
        return {k: _decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


def record_to_json(record: Record) -> dict[str, Any]:
    """Plain JSON data for ``record`` (``json.dumps`` accepts it); inverse of
    :func:`record_from_json`. ``"groups"`` is written only when the record has groups."""
    data = {
        "step": record.step,
        "num_samples": record.num_samples,
        "micro_steps": record.micro_steps,
        "values": _encode(record.values),
        "meta": _encode(record.meta),
    }
    if record.groups:
        data["groups"] = {str(g): _encode(v) for g, v in record.groups.items()}
    return data


#: the fields every record line has (:func:`record_to_json`)
_RECORD_FIELDS = ("step", "num_samples", "micro_steps", "values")


def record_from_json(data: Mapping[str, Any]) -> Record:
    """Rebuild a :class:`Record` from :func:`record_to_json` output.

    Raises:
        ValueError: if ``data`` lacks a record's fields, or its ``"groups"`` is not a mapping of
            group name -> mapping of values.
    """
    if isinstance(data, Mapping):
        missing = [k for k in _RECORD_FIELDS if k not in data]
        if missing:
            raise ValueError(
                f"not a gradlens record: no {', '.join(repr(k) for k in missing)} (a record line holds "
                f"{', '.join(repr(k) for k in _RECORD_FIELDS)}; this one holds "
                f"{', '.join(repr(str(k)) for k in list(data)[:8]) or 'nothing'}"
                f"{', ...' if len(data) > 8 else ''}): a line some other program wrote into the log?"
            )
    groups = data.get("groups", {}) if isinstance(data, Mapping) else {}
    if not isinstance(groups, Mapping) or not all(isinstance(v, Mapping) for v in groups.values()):
        raise ValueError(
            f"not a gradlens record: 'groups' must map group names to dicts of values, got "
            f"{type(groups).__name__}"
        )
    try:
        return Record(
            step=int(data["step"]),
            num_samples=int(data["num_samples"]),
            micro_steps=int(data["micro_steps"]),
            values=_decode(data["values"]),
            meta=_decode(data.get("meta", {})),
            groups={str(g): _decode(dict(v)) for g, v in groups.items()},
        )
    except (KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"not a gradlens record: {err!r}") from err


# --------------------------------------------------------------------------- flat names


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number or a 0-d real tensor (one host read), else
    None: the one rule for what counts as a scalar of a record."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, Tensor) and value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
        return float(value)
    return None


def flatten(record: Record, prefix: str = "gradlens/", who: str = "flatten") -> dict[str, float]:
    """The scalars of ``record`` by flat name (host floats; one read per value), the same for
    every sink and logger (TensorBoard, W&B, Lightning, the Hugging Face Trainer):

    - ``<prefix><key>`` for a value that is a real number or a 0-d tensor (``loss``,
      ``grad_norm``, ``noise_scale``, ``alpha``, ...; a missing value (None) is left out);
    - ``<prefix><key>/<name>`` for such numbers inside a dict value (e.g. per parameter,
      ``search_dir_projections/update_sq_norm``);
    - ``<prefix><key>/clamped_low`` and ``.../clamped_high`` for a :class:`Hist1d`,
      ``<prefix><key>/clamped_param`` and ``.../clamped_grad`` for a :class:`Hist2d`
      (elements outside the range, counted into the end bins).

    Tensors with samples or parameter shapes (``batch_l2`` ``[N]``, ``sum_grad_squared``
    ``[*param]``) are not scalars and are left out; ``who`` names the caller in the error.
    Per parameter group (:attr:`Record.groups`) the same names under ``<prefix><group>/``,
    e.g. ``gradlens/layer1.0.conv1/grad_norm``.
    """
    if not isinstance(record, Record):
        raise TypeError(f"{who}(record=...) needs a gradlens Record, got {type(record).__name__}")
    out: dict[str, float] = {}
    _flat_scalars(record.items(), prefix, out)
    for group, values in record.groups.items():
        _flat_scalars(values.items(), f"{prefix}{group}/", out)
    return out


def _flat_scalars(items, prefix: str, out: dict[str, float]) -> None:
    for key, value in items:
        tag = f"{prefix}{key}"
        if isinstance(value, Hist1d):
            out[f"{tag}/clamped_low"] = float(value.clamped_low)
            out[f"{tag}/clamped_high"] = float(value.clamped_high)
        elif isinstance(value, Hist2d):
            out[f"{tag}/clamped_param"] = float(value.clamped_param)
            out[f"{tag}/clamped_grad"] = float(value.clamped_grad)
        elif isinstance(value, Mapping):
            for name, inner in value.items():
                number = as_number(inner)
                if number is not None:
                    out[f"{tag}/{name}"] = number
        else:
            number = as_number(value)
            if number is not None:
                out[tag] = number


def flatten_histograms(
    record: Record, prefix: str = "gradlens/", who: str = "flatten_histograms"
) -> dict[str, tuple[Tensor, Tensor]]:
    """The histograms of ``record`` by flat name, as ``(counts [bins], edges [bins + 1]
    float64)`` on the CPU, straight from gradlens' own counts (never re-binned):

    - ``<prefix><key>`` for a :class:`Hist1d` (``grad_hist_1d``);
    - ``<prefix><key>/grad`` and ``<prefix><key>/param`` for a :class:`Hist2d`: its marginals
      over the parameter axis and over the gradient axis (sums of its counts);
    - per parameter group (:attr:`Record.groups`) the same under ``<prefix><group>/``.
    """
    if not isinstance(record, Record):
        raise TypeError(f"{who}(record=...) needs a gradlens Record, got {type(record).__name__}")
    out: dict[str, tuple[Tensor, Tensor]] = {}
    _flat_histograms(record.items(), prefix, out)
    for group, values in record.groups.items():
        _flat_histograms(values.items(), f"{prefix}{group}/", out)
    return out


def _flat_histograms(items, prefix: str, out: dict[str, tuple[Tensor, Tensor]]) -> None:
    for key, value in items:
        tag = f"{prefix}{key}"
        if isinstance(value, Hist1d):
            out[tag] = (value.counts.detach().cpu(), value.edges.detach().cpu().double())
        elif isinstance(value, Hist2d):
            counts = value.counts.detach().cpu()
            out[f"{tag}/grad"] = (counts.sum(0), value.grad_edges.detach().cpu().double())
            out[f"{tag}/param"] = (counts.sum(1), value.param_edges.detach().cpu().double())
