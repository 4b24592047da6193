"""Checkpoints: the Lens' state format, its validation, and the instruments' state contract.

A Lens state (:meth:`gradlens.Lens.state_dict`, format version 3) is a dict of plain data that
``torch.load(..., weights_only=True)`` reads (tensors, dicts, lists, tuples, str / int / float /
bool / None), and nothing else::

    "format":            "gradlens.Lens"
    "version":           3
    "step":              int, the window index (the schedule's position)
    "skipped_windows":   int
    "empty_micro_steps": int, captures of the current window whose backward reached nothing
    "instruments":       [{"type": class name, "key": record key, "state": dict}], in the Lens'
                         order; "state" is :meth:`Instrument.state_dict` (what the instrument
                         keeps BETWEEN windows: plain data)
    "parameters":        {"names": [str], "shapes": [[int]], "dtypes": [str]}: the tracked
                         parameters (qualified names as in ``model.named_parameters()``)
    "undefined":         [str]: parameters left out by ``Lens(undefined="exclude")``
    "window":            bool: saved inside a tracked window that captured micro-steps
    "pending":           int or None: the step of the record waiting for the next window (Alpha)
    "partial_window":    None, or (``"window"`` true) the :class:`~gradlens.core.window.Window`
                         so far: {"stats": its WindowStats, "states": [each instrument's window
                         state, in the Lens' order], "sites": {use name: Site}, "coverage": float,
                         and, where the window measured contributions, "contribution": {name:
                         str}, its ``Window.contribution`` (absent: none)}
                         (its stacked uses are measured into "stats" first, its empty
                         micro-steps are "empty_micro_steps", its ``sum_blocks`` a cache)
    "pending_record":    None, or (``"pending"`` set) {"record": the Record, "states":
                         [[instrument position, its window state], ...] of the instruments that
                         complete it}

The values inside "partial_window" and "pending_record" are written by
:mod:`gradlens.lens.state_codec`: plain data, in which gradlens' own state classes are
``("obj", class name, index, {field: value})`` and the Lens' parameters, modules, instruments
and buffer pools are referred to by name or position. Loading one constructs those classes
only; nothing is unpickled, so a checkpoint cannot run code.

:func:`load_lens_state_dict` checks the header (version, entries, instruments by type, key and
order, parameter names, shapes and dtypes, that every instrument's state is plain data) and
rebuilds the partial window and the pending record before anything of ``lens`` changes: a state
of another Lens, or one that holds what a Lens state does not, is a :class:`StateDictError`
naming what differs and the fix, never a crash at the next capture.

Earlier versions are not read, and their errors say so: version 2 (an earlier gradlens: the
partial window and the pending record were a pickle inside a uint8 tensor, which could name code
to run when loaded) and version 1 (the instruments' attributes pickled as a whole, with no names or
shapes to check).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from gradlens.capture.events import Site
from gradlens.core.stats import WindowStats
from gradlens.core.window import Window
from gradlens.core.param_shapes import full_shape
from gradlens.core.records import Record
from gradlens.core.state_checks import *  # noqa: F401,F403 - StateDictError and the validators, re-exported
from gradlens.lens.state_codec import Decoder, Encoder, is_plain

# (annotations name the instruments' and the Lens' classes without importing them: no cycle)

#: the format version :func:`lens_state_dict` writes and :func:`load_lens_state_dict` reads
LENS_STATE_VERSION = 3

__all__ = ["LENS_STATE_VERSION", "StateDictError", "check_state", "lens_state_dict", "load_lens_state_dict"]

_FORMAT = "gradlens.Lens"
#: the header's keys of the Lens' window counters (:class:`~gradlens.core.counter.WindowCounter`)
_COUNTERS = {"updates": "step", "skipped": "skipped_windows"}
_HEADER = {
    "format", "version", "step", "skipped_windows", "empty_micro_steps", "instruments",
    "parameters", "undefined", "window", "pending", "partial_window", "pending_record",
}
_WINDOW_KEYS = {"stats", "states", "sites", "coverage"}
_WINDOW_OPTIONAL = {"contribution"}
_PENDING_KEYS = {"record", "states"}


# =============================================================================== the Lens
def _version() -> int:
    return LENS_STATE_VERSION


def _parameters(lens: "Lens") -> dict[str, list]:
    params = lens._tap.params
    return {
        "names": list(params),
        "shapes": [list(full_shape(p)) for p in params.values()],  # (ZeRO-3: the model's shape)
        "dtypes": [str(p.dtype).replace("torch.", "") for p in params.values()],
    }


def lens_state_dict(lens: "Lens") -> dict[str, Any]:
    """The state of ``lens`` (format in the module docstring). Call with no merge in flight and
    the window's stacked uses settled. The tensors of the partial window and of the pending
    record are copies (on their devices): the state does not change as the Lens goes on."""
    window = lens._window
    mid_window = window is not None and window.micro_steps > 0
    encode = Encoder(lens)
    partial = None
    if mid_window:
        if window.carried:
            raise RuntimeError("Lens.state_dict(): the window's stacked uses were not settled (a gradlens bug)")
        partial = {
            "stats": encode(window.stats, "partial window's stats"),
            "states": [encode(window.states.get(id(i)), f"partial window's state of {label(i)}")
                       for i in lens.instruments],
            "sites": encode(dict(window.sites), "partial window's sites"),  # the uses measured so far
            "coverage": float(window.coverage),
        }
        if window.contribution:  # Lens(undefined="contribution") measured some as contributions
            partial["contribution"] = dict(window.contribution)
    pending = None
    if lens._pending.held is not None:
        record, states = lens._pending.held
        pending = {
            "record": encode(record, "pending record"),
            "states": [[n, encode(states[id(i)], f"pending record's state of {label(i)}")]
                       for n, i in enumerate(lens.instruments) if id(i) in states],
        }
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
        "pending": None if pending is None else int(lens._pending.held[0].step),
        "partial_window": partial,
        "pending_record": pending,
    }


def _check_header(state: Any) -> None:
    """The plain part of a Lens state: its kind, version, entries and their types."""
    if not isinstance(state, dict) or "version" not in state:
        got = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, dict) else type(state).__name__
        raise StateDictError(
            f"Lens.load_state_dict(state_dict=...) takes the dict from Lens.state_dict(), got {got}"
        )
    version = state["version"]
    restart = ("start this Lens afresh (do not call load_state_dict; the model and optimizer checkpoints "
               "still load)")
    if type(version) is int and version == 1:
        raise StateDictError(
            "this Lens state_dict has version 1 (written by an earlier gradlens, which pickled the "
            f"instruments' attributes without names or shapes to check); this gradlens reads "
            f"version {_version()} only. Resume it with the gradlens that wrote it, or {restart}"
        )
    if type(version) is int and version == 2:
        raise StateDictError(
            "this Lens state_dict has version 2 (written by an earlier gradlens, which kept the partial "
            "window and the pending record as a pickle: loading it could run code named in the "
            f"file); this gradlens reads version {_version()} only and never unpickles a checkpoint. "
            f"Resume it with the gradlens that wrote it if you trust the file, or {restart}"
        )
    if not (type(version) is int and version == _version()):
        raise StateDictError(
            f"Lens state_dict version {version!r}; this gradlens reads version {_version()}: load "
            "it with the gradlens that wrote it, or start this Lens afresh (do not call "
            "load_state_dict)"
        )
    missing, extra = sorted(_HEADER - set(state)), sorted(map(repr, set(state) - _HEADER))
    if missing:
        raise StateDictError(
            f"the Lens state_dict lacks {missing}; pass the dict that Lens.state_dict() returned, "
            "unchanged"
        )
    if extra:
        raise StateDictError(
            f"the Lens state_dict has entries [{', '.join(extra)}] that a version {_version()} Lens "
            "state does not have; the checkpoint was altered: pass the dict that Lens.state_dict() "
            "returned, unchanged"
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
             and all(type(e) is dict and set(e) == {"type", "key", "state"} and type(e["type"]) is str
                     and type(e["key"]) is str for e in state["instruments"])),
            ("parameters", _is_parameter_table(state["parameters"])),
            ("undefined", type(state["undefined"]) is list and all(type(q) is str for q in state["undefined"])),
            ("window", isinstance(state["window"], bool)),
            ("pending", state["pending"] is None or is_count(state["pending"])),
            ("partial_window", state["partial_window"] is None if not state["window"] is True else (
                type(state["partial_window"]) is dict
                and _WINDOW_KEYS <= set(state["partial_window"]) <= _WINDOW_KEYS | _WINDOW_OPTIONAL
                and _is_names(state["partial_window"].get("contribution", {}))
                and type(state["partial_window"]["states"]) is list
                and isinstance(state["instruments"], list)
                and len(state["partial_window"]["states"]) == len(state["instruments"])
                and is_float(state["partial_window"]["coverage"]))),
            ("pending_record", state["pending_record"] is None if state["pending"] is None else (
                type(state["pending_record"]) is dict and set(state["pending_record"]) == _PENDING_KEYS
                and type(state["pending_record"]["states"]) is list
                and all(type(e) is list and len(e) == 2 and is_count(e[0])
                        for e in state["pending_record"]["states"]))),
        ) if not ok
    ]
    if bad:
        raise StateDictError(
            f"the Lens state_dict has malformed entries {bad}; the checkpoint is damaged or was "
            "edited: pass the dict that Lens.state_dict() returned, unchanged"
        )
    for n, e in enumerate(state["instruments"]):
        if not is_plain(e["state"]):
            raise StateDictError(
                f"the Lens state_dict's state of instrument {n} ({e['type']}, record key {e['key']!r}) "
                "holds objects other than plain data (tensors, numbers, strings, bools, None, lists / "
                "tuples / dicts of those); the checkpoint is damaged or was altered: resume from an "
                "earlier one"
            )


def _is_names(d: Any) -> bool:
    """``{str: str}`` (a window's ``contribution``: parameter -> the layer that mixed samples)."""
    return type(d) is dict and all(type(k) is str and type(v) is str for k, v in d.items())


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
    shapes = {q: tuple(full_shape(p)) for q, p in lens._tap.params.items()}
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
    docstring) and the partial window and the pending record are rebuilt before anything of
    ``lens`` changes; nothing of ``lens`` changes if a check fails.

    Raises:
        StateDictError (a ValueError and a TypeError): not a Lens state, another version, other
            instruments (set, order, keys, settings), other parameters (names, shapes, dtypes),
            a partial window that this Lens' schedule does not track, or an entry that holds
            what a Lens state does not (a damaged or altered checkpoint).
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
    # every instrument checks its state (part of the header) before the window is rebuilt; and
    # before the window opens: its ranges start the window
    before = _load_instruments(state, lens)
    try:
        window, pending = _decode(state, lens)  # plain data -> gradlens' own state classes, or refused
    except BaseException:
        _restore(lens, before)
        raise
    lens._counter.load_state_dict(state, _COUNTERS, where="the Lens state_dict")  # checked above
    lens._open_window()
    if window is not None:
        lens._use_window(Window(window["stats"], {id(i): st for i, st in zip(lens.instruments, window["states"])},
                                window["sites"], coverage=window["coverage"],
                                contribution=dict(state["partial_window"].get("contribution", {}))))
    if lens._window is not None:
        lens._window.empty_micro_steps = state["empty_micro_steps"]
    lens._pending.held = pending


def _decode(state: dict, lens: "Lens") -> tuple[dict | None, tuple | None]:
    """The partial window (``{"stats", "states", "sites", "coverage"}``, or None) and the
    pending record (``(record, {id(instrument): state})``, or None) of ``state``, rebuilt
    (:class:`gradlens.lens.state_codec.Decoder`) and checked; changes nothing of ``lens``."""
    decode = Decoder(lens)
    window = pending = None
    n = len(lens.instruments)
    if state["partial_window"] is not None:
        raw = state["partial_window"]
        window = {
            "stats": decode(raw["stats"], "partial window's stats"),
            "states": [decode(st, f"partial window's state {k}") for k, st in enumerate(raw["states"])],
            "sites": decode(raw["sites"], "partial window's sites"),
            "coverage": float(raw["coverage"]),
        }
        if not (isinstance(window["stats"], WindowStats) and type(window["sites"]) is dict
                and all(type(s) is Site and s.name == name for name, s in window["sites"].items())):
            raise StateDictError(
                "the Lens state_dict's partial window does not hold window statistics and the sites "
                "of its uses; the checkpoint is damaged or was altered: resume from an earlier one"
            )
    if state["pending_record"] is not None:
        raw = state["pending_record"]
        record = decode(raw["record"], "pending record")
        positions = [k for k, _ in raw["states"]]
        if not (isinstance(record, Record) and record.step == state["pending"]
                and all(k < n for k in positions) and len(set(positions)) == len(positions)):
            raise StateDictError(
                f"the Lens state_dict's pending record is not the record of window {state['pending']} "
                "with the states of this Lens' instruments that complete it; the checkpoint is damaged "
                "or was altered: resume from an earlier one"
            )
        states = {id(lens.instruments[k]): decode(st, f"pending record's state {k}") for k, st in raw["states"]}
        pending = (record, states)
    return window, pending
