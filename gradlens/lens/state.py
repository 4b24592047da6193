"""Checkpoints: the Lens' state format, its validation, and the instruments' state contract.

A Lens state (:meth:`gradlens.Lens.state_dict`, format version 2) is a dict of plain data that
``torch.load(..., weights_only=True)`` reads (tensors, dicts, lists, str / int / float / bool /
None)::

    "format":            "gradlens.Lens"
    "version":           2
    "step":              int, the window index (the schedule's position)
    "skipped_windows":   int
    "empty_micro_steps": int, captures of the current window whose backward reached nothing
    "instruments":       [{"type": class name, "key": record key, "state": dict}], in the Lens'
                         order; "state" is :meth:`Instrument.state_dict` (what the instrument
                         keeps BETWEEN windows)
    "parameters":        {"names": [str], "shapes": [[int]], "dtypes": [str]}: the tracked
                         parameters (qualified names as in ``model.named_parameters()``)
    "undefined":         [str]: parameters left out by ``Lens(undefined="exclude")``
    "window":            bool: saved inside a tracked window that captured micro-steps
    "pending":           int or None: the step of the record waiting for the next window (Alpha)
    "blob":              uint8 tensor or None: a pickle of the partial window (its
                         :class:`~gradlens.core.stats.WindowStats`, each instrument's
                         window state and the uses measured so far) and of the pending record
                         with its states, in which parameters, modules and instruments are
                         referred to by name or position

:func:`load_lens_state_dict` checks the header (version, instruments by type, key and order,
parameter names, shapes and dtypes, every instrument's state) before it unpickles the blob: a
state of another Lens is a ``ValueError`` there, naming what differs and the fix, never a crash
at the next capture. The blob is a pickle: load only checkpoints you trust.

Version 1 (gradlens before this format: the instruments' attributes pickled as a whole, with no
names or shapes to check) is not read; its error says so.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch import Tensor

from gradlens.core.stats import WindowStats
from gradlens.core.window import Window
from gradlens.core.records import Record
from gradlens.core.state_checks import *  # noqa: F401,F403 - StateDictError and the validators, re-exported

# (annotations name the instruments' and the Lens' classes without importing them: no cycle)

#: the format version :func:`lens_state_dict` writes and :func:`load_lens_state_dict` reads
LENS_STATE_VERSION = 2

__all__ = ["LENS_STATE_VERSION", "StateDictError", "check_state", "lens_state_dict", "load_lens_state_dict"]

_FORMAT = "gradlens.Lens"
#: the header's keys of the Lens' window counters (:class:`~gradlens.core.counter.WindowCounter`)
_COUNTERS = {"updates": "step", "skipped": "skipped_windows"}
_HEADER = {
    "format", "version", "step", "skipped_windows", "empty_micro_steps", "instruments",
    "parameters", "undefined", "window", "pending", "blob",
}


# =============================================================================== the Lens
def _object_ids(lens: "Lens", by_pid: bool = False):
    """Objects a saved state refers to by name: tracked parameters, the model's modules, the
    instruments and the buffer pools of the window sums (``{id: pid}``, or ``[(obj, pid)]``)."""
    pairs = [(pool, ("pools", name)) for name, pool in lens._pools.items()]
    pairs += [(p, ("p", q)) for q, p in lens._tap.params.items()]
    pairs += [(m, ("m", n)) for n, m in lens.model.named_modules()]
    pairs += [(i, ("i", str(n))) for n, i in enumerate(lens.instruments)]
    if by_pid:
        return pairs
    return {id(obj): pid for obj, pid in pairs}


def _version() -> int:
    return LENS_STATE_VERSION


def _parameters(lens: "Lens") -> dict[str, list]:
    params = lens._tap.params
    return {
        "names": list(params),
        "shapes": [list(p.shape) for p in params.values()],
        "dtypes": [str(p.dtype).replace("torch.", "") for p in params.values()],
    }


def _dumps(payload: Any, lens: "Lens") -> Tensor:
    """``payload`` pickled into a uint8 tensor; the Lens' parameters, modules, instruments and
    buffer pools are written as references (:func:`_object_ids`), not copied."""
    ids = _object_ids(lens)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ids.get(id(obj))

    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(payload)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _loads(blob: Tensor, lens: "Lens") -> Any:
    objs = dict((pid, obj) for obj, pid in _object_ids(lens, by_pid=True))
    kinds = {"p": "parameter", "m": "module", "i": "instrument"}

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid):
            if pid in objs:
                return objs[pid]
            if isinstance(pid, tuple) and pid[:1] == ("pools",):  # buffers reused across windows
                return lens._pools.setdefault(pid[1], {})
            kind = kinds.get(pid[0], pid[0]) if isinstance(pid, tuple) and pid else pid
            name = pid[1] if isinstance(pid, tuple) and len(pid) > 1 else ""
            raise StateDictError(
                f"the Lens state_dict refers to {kind} {name!r}, which this Lens does not have; "
                "build it on the same model with the same instruments (in the same order) and "
                "exclusions"
            )

    try:
        return _Unpickler(io.BytesIO(blob.cpu().numpy().tobytes())).load()
    except StateDictError:
        raise
    except Exception as err:  # a cut or altered file: say so, not a pickle traceback
        raise StateDictError(
            f"the Lens state_dict's blob (the partial window / pending record) does not unpickle "
            f"({type(err).__name__}: {err}); the checkpoint is damaged: resume from an earlier one"
        ) from err


def lens_state_dict(lens: "Lens") -> dict[str, Any]:
    """The state of ``lens`` (format in the module docstring). Call with no merge in flight."""
    window = lens._window
    mid_window = window is not None and window.micro_steps > 0
    payload: dict[str, Any] = {"window": None, "states": None, "sites": None, "pending": None}
    if mid_window:
        payload["window"] = window.stats
        payload["states"] = [window.states.get(id(i)) for i in lens.instruments]
        payload["sites"] = dict(window.sites)  # the uses measured so far (rank merging)
    pending_step = None
    if lens._pending.held is not None:
        record, states = lens._pending.held
        pending_step = int(record.step)
        payload["pending"] = (
            record,
            {n: states[id(i)] for n, i in enumerate(lens.instruments) if id(i) in states},
        )
    instruments = []
    for inst in lens.instruments:
        state = inst.state_dict()
        if not isinstance(state, dict):
            raise TypeError(
                f"{label(inst)}.state_dict() returned {type(state).__name__}; an instrument's "
                "state_dict() returns a dict (of tensors and plain values), {} if it keeps nothing"
            )
        instruments.append({"type": type(inst).__name__, "key": inst.key, "state": state})
    return {
        "format": _FORMAT,
        "version": _version(),
        **lens._counter.state_dict(_COUNTERS),
        "empty_micro_steps": 0 if window is None else int(window.empty_micro_steps),
        "instruments": instruments,
        "parameters": _parameters(lens),
        "undefined": sorted(lens._meter.undefined_params),
        "window": mid_window,
        "pending": pending_step,
        "blob": _dumps(payload, lens) if mid_window or pending_step is not None else None,
    }


def _check_header(state: Any) -> None:
    """The plain part of a Lens state: its kind, version and the types of its entries."""
    if not isinstance(state, dict) or not ({"version", "blob"} <= set(state)):
        got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise StateDictError(
            f"Lens.load_state_dict(state_dict=...) takes the dict from Lens.state_dict(), got {got}"
        )
    version = state["version"]
    if version == 1:
        raise StateDictError(
            "this Lens state_dict has version 1 (written by an earlier gradlens, which pickled the "
            f"instruments' attributes without names or shapes to check); this gradlens reads "
            f"version {_version()} only. Resume it with the gradlens that wrote it, or start this "
            "Lens afresh (do not call load_state_dict; the model and optimizer checkpoints still load)"
        )
    if version != _version():
        raise StateDictError(
            f"Lens state_dict version {version!r}; this gradlens reads version {_version()}: load "
            "it with the gradlens that wrote it, or start this Lens afresh (do not call "
            "load_state_dict)"
        )
    missing = sorted(_HEADER - set(state))
    if missing:
        raise StateDictError(
            f"the Lens state_dict lacks {missing}; pass the dict that Lens.state_dict() returned, "
            "unchanged"
        )
    if state["format"] != _FORMAT:
        raise StateDictError(
            f"the state_dict's format is {state['format']!r}, not {_FORMAT!r}: it is not a Lens "
            "state; pass the dict that Lens.state_dict() returned"
        )
    bad = [
        k for k, ok in (
            ("step", is_count(state["step"])),
            ("skipped_windows", is_count(state["skipped_windows"])),
            ("empty_micro_steps", is_count(state["empty_micro_steps"])),
            ("instruments", isinstance(state["instruments"], list)
             and all(isinstance(e, dict) and {"type", "key", "state"} <= set(e) for e in state["instruments"])),
            ("parameters", _is_parameter_table(state["parameters"])),
            ("undefined", isinstance(state["undefined"], list)),
            ("window", isinstance(state["window"], bool)),
            ("pending", state["pending"] is None or is_count(state["pending"])),
            ("blob", state["blob"] is None
             or (isinstance(state["blob"], Tensor) and state["blob"].dtype == torch.uint8)),
        ) if not ok
    ]
    if not bad and (state["window"] or state["pending"] is not None) and state["blob"] is None:
        bad = ["blob"]
    if bad:
        raise StateDictError(
            f"the Lens state_dict has malformed entries {bad}; the checkpoint is damaged or was "
            "edited: pass the dict that Lens.state_dict() returned, unchanged"
        )


def _is_parameter_table(p: Any) -> bool:
    """``{"names": [str], "shapes": [[int]], "dtypes": [str]}``, three lists of one length."""
    if not (isinstance(p, dict) and set(p) == {"names", "shapes", "dtypes"}):
        return False
    names, shapes, dtypes = p["names"], p["shapes"], p["dtypes"]
    return (
        all(isinstance(v, list) for v in (names, shapes, dtypes))
        and len(names) == len(shapes) == len(dtypes)
        and all(isinstance(n, str) for n in names + dtypes)
        and all(isinstance(s, list) and all(is_count(d) for d in s) for s in shapes)
    )


def _check_instruments(state: dict, lens: "Lens") -> None:
    saved = [(e["type"], e["key"]) for e in state["instruments"]]
    mine = [(type(i).__name__, i.key) for i in lens.instruments]
    if saved == mine:
        return
    show = lambda pairs: "[" + ", ".join(f"{t} ({k!r})" for t, k in pairs) + "]"  # noqa: E731
    if len(saved) != len(mine):
        what = f"the Lens state_dict has {len(saved)} instruments, this Lens {len(mine)}"
    elif sorted(saved) == sorted(mine):
        what = "the Lens state_dict has the same instruments in another order"
    else:
        what = "the Lens state_dict has other instruments"
    raise StateDictError(
        f"{what}: saved {show(saved)}, this Lens {show(mine)}; create the Lens with the same "
        "instruments in the same order"
    )


def _check_parameters(state: dict, lens: "Lens") -> None:
    """The saved tracked parameters (with those ``undefined="exclude"`` left out) against this
    Lens': the same names, shapes and dtypes."""
    p = state["parameters"]
    saved = {n: (list(s), d) for n, s, d in zip(p["names"], p["shapes"], p["dtypes"])}
    now = _parameters(lens)
    mine = {n: (s, d) for n, s, d in zip(now["names"], now["shapes"], now["dtypes"])}
    undefined_saved, undefined_mine = set(state["undefined"]), set(lens._meter.undefined_params)
    names_saved = set(saved) | undefined_saved
    names_mine = set(mine) | undefined_mine
    fix = (
        "build the Lens on the model of the saved run (same layers and sizes) with the same "
        "exclude=, and load the model's own state_dict first"
    )
    if names_saved != names_mine:
        missing, extra = sorted(names_saved - names_mine), sorted(names_mine - names_saved)
        raise StateDictError(
            f"the Lens state_dict tracks other parameters: saved but not tracked here {missing}, "
            f"tracked here but not saved {extra}; {fix}"
        )
    common = [n for n in saved if n in mine]  # in the model's order
    shapes = [n for n in common if saved[n][0] != mine[n][0]]
    if shapes:
        diffs = "; ".join(f"{n!r} {tuple(saved[n][0])} saved, {tuple(mine[n][0])} here" for n in shapes)
        raise StateDictError(f"parameters of other shapes than in the Lens state_dict: {diffs}; {fix}")
    dtypes = [n for n in common if saved[n][1] != mine[n][1]]
    if dtypes:
        diffs = "; ".join(f"{n!r} {saved[n][1]} saved, {mine[n][1]} here" for n in dtypes)
        raise StateDictError(
            f"parameters of other dtypes than in the Lens state_dict: {diffs}; cast the model as in "
            "the saved run (e.g. model.to(torch.float64)), or start this Lens afresh"
        )


def _check_parameter_tensors(state: dict, lens: "Lens") -> None:
    """Instrument states shaped like parameters (Alpha's last update) fit the tracked ones."""
    shapes = {q: tuple(p.shape) for q, p in lens._tap.params.items()}
    for inst, entry in zip(lens.instruments, state["instruments"]):
        for key, tensors in inst.parameter_tensors(entry["state"]).items():
            for q, t in tensors.items():
                if isinstance(t, Tensor) and q in shapes and tuple(t.shape) != shapes[q]:
                    raise StateDictError(
                        f"the state of {label(inst)} has {key}[{q!r}] of shape {tuple(t.shape)}, "
                        f"parameter {q!r} is {shapes[q]}; the checkpoint is damaged or of another "
                        "model: resume from a checkpoint of this model"
                    )


def _load_instruments(state: dict, lens: "Lens") -> list[dict]:
    """Every instrument's state, or none: a failure restores the ones already loaded. Returns
    their states from before (for :func:`_restore`)."""
    before = [i.state_dict() for i in lens.instruments]
    done = 0
    try:
        for inst, entry in zip(lens.instruments, state["instruments"]):
            inst.load_state_dict(entry["state"])
            done += 1
    except BaseException:
        _restore(lens, before[:done])
        raise
    return before


def _restore(lens: "Lens", before: list[dict]) -> None:
    for inst, old in zip(lens.instruments, before):
        inst.load_state_dict(old)


def load_lens_state_dict(lens: "Lens", state: Any) -> None:
    """Resume ``lens`` from :func:`lens_state_dict`'s dict: the header is checked (module
    docstring) before the blob is unpickled; nothing of ``lens`` changes if a check fails.

    Raises:
        StateDictError (a ValueError and a TypeError): not a Lens state, another version, other
            instruments (set, order, keys, settings), other parameters (names, shapes, dtypes),
            a partial window that this Lens' schedule does not track.
    """
    _check_header(state)
    _check_instruments(state, lens)
    _check_parameters(state, lens)
    if state["window"] and not lens.is_tracked(state["step"]):
        raise StateDictError(
            f"the Lens state_dict was saved inside tracked window {state['step']}, which this "
            "Lens's schedule (every=...) does not track; use the same schedule"
        )
    _check_parameter_tensors(state, lens)
    # every instrument checks its state (part of the header) before the blob is unpickled
    before = _load_instruments(state, lens)  # before the window opens: its ranges start the window
    payload = None
    try:
        if state["blob"] is not None:
            payload = _loads(state["blob"], lens)
            _check_payload(payload, state, lens)
    except BaseException:
        _restore(lens, before)
        raise
    lens._counter.load_state_dict(state, _COUNTERS, where="the Lens state_dict")  # checked above
    lens._open_window()
    if state["window"]:
        states = {id(i): st for i, st in zip(lens.instruments, payload["states"])}
        lens._use_window(Window(payload["window"], states, dict(payload["sites"]), coverage=lens._window.coverage))
    if lens._window is not None:
        lens._window.empty_micro_steps = state["empty_micro_steps"]
    lens._pending.held = None
    if state["pending"] is not None:
        record, states = payload["pending"]
        lens._pending.held = (record, {id(lens.instruments[n]): st for n, st in states.items()})


def _check_payload(payload: Any, state: dict, lens: "Lens") -> None:
    n = len(lens.instruments)
    ok = isinstance(payload, dict) and {"window", "states", "sites", "pending"} <= set(payload)
    if ok and state["window"]:
        ok = (
            isinstance(payload["window"], WindowStats) and isinstance(payload["sites"], dict)
            and isinstance(payload["states"], list) and len(payload["states"]) == n
        )
    if ok and state["pending"] is not None:
        pend = payload["pending"]
        ok = (
            isinstance(pend, tuple) and len(pend) == 2 and isinstance(pend[0], Record)
            and isinstance(pend[1], dict) and all(is_int(k) and 0 <= k < n for k in pend[1])
        )
    if not ok:
        raise StateDictError(
            "the Lens state_dict's blob does not hold the partial window or pending record its "
            "header announces; the checkpoint is damaged: resume from an earlier one"
        )
