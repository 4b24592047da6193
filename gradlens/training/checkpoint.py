"""Checkpoints that survive a kill: :func:`save_checkpoint` and :func:`load_checkpoint`.

``torch.save`` straight onto the checkpoint file leaves, when the process is killed during the
save, a file that does not load, and the previous checkpoint is gone with it. Here the state
goes to a temporary file in the same folder, is flushed and ``fsync``-ed, and replaces the
checkpoint with ``os.replace`` (atomic on POSIX and Windows); the folder is ``fsync``-ed too, so
after a crash or a power loss the path holds either the previous checkpoint or the new one,
complete.

What a checkpoint may and may not do: it holds plain data only (tensors, numbers, strings,
bools, None, and lists / tuples / dicts of those), read with ``torch.load(weights_only=True)``,
which refuses any other object before building it; the Lens' state inside it is plain data too
(:mod:`gradlens.lens.state`), rebuilt by constructing gradlens' own state classes, never
unpickled. Loading a checkpoint therefore runs no code named in the file: an altered file is
refused (:class:`~gradlens.core.state_checks.StateDictError`), and what it would have run does
not run. It can still hold wrong numbers: load the checkpoints of your own runs.
"""

from __future__ import annotations

import os
import pickle
import secrets
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradlens.core.state_checks import StateDictError

__all__ = ["save_checkpoint", "load_checkpoint"]

FORMAT = "gradlens-checkpoint"
VERSION = 1


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lens: Any = None,
    **extra: Any,
) -> Path:
    """Save the model's, the optimizer's and the Lens's state atomically to ``path``.

    Args:
        path: the checkpoint file (its folder must exist).
        model: its ``state_dict()`` is saved.
        optimizer: any ``torch.optim.Optimizer``; a :class:`~gradlens.GradientAccumulateOptimizer`
            saves its partial window with it, so a checkpoint taken mid-window resumes exactly.
        lens: a :class:`~gradlens.Lens` (its ``state_dict()``: schedule position, pending record,
            partial window; plain data, see :meth:`gradlens.Lens.state_dict`).
        **extra: more values to keep (the epoch, a data-loader position, an LR scheduler's
            ``state_dict()``): tensors, numbers, strings and lists / dicts of those, so that
            :func:`load_checkpoint` can read them with ``torch.load(weights_only=True)``.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``optimizer`` / ``lens`` lack
            ``state_dict()``.
        FileNotFoundError: the folder of ``path`` does not exist.
    """
    path = Path(path)
    _check(model, optimizer, lens, "save_checkpoint")
    if not path.parent.is_dir():
        raise FileNotFoundError(
            f"save_checkpoint(path={str(path)!r}): the folder {str(path.parent)!r} does not exist; "
            "create it first (os.makedirs(folder, exist_ok=True))"
        )
    state = {
        "format": FORMAT,
        "version": VERSION,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "lens": None if lens is None else lens.state_dict(),
        "extra": extra,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_folder(path.parent)
    return path


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lens: Any = None,
    map_location: Any = None,
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` (and ``optimizer``, ``lens``).

    Build the Lens on the loaded model with the same instruments, schedule and log before
    calling this; the Lens then goes on at the saved step, and its log records replace those
    the stopped run wrote after the checkpoint (see ``Lens(log_mode=...)``). The file is read
    with ``torch.load(weights_only=True)``: it cannot run code (module docstring). The model's,
    then the optimizer's and the Lens' states are loaded, each checked by its own
    ``load_state_dict`` before any of it is applied.

    Args:
        path: the checkpoint file.
        model, optimizer, lens: the objects to restore (``optimizer`` / ``lens`` only if the
            checkpoint holds their state).
        map_location: as for ``torch.load`` (e.g. ``"cpu"``).

    Returns:
        the ``**extra`` values given to :func:`save_checkpoint` (a dict).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a gradlens checkpoint, or lacks the optimizer's or the
            Lens's state asked for.
        gradlens.lens.state.StateDictError (a ValueError): the file holds objects other than
            plain data (it was altered, or not written by :func:`save_checkpoint`; nothing of it
            is loaded or run), or a Lens state that this Lens refuses.
    """
    path = Path(path)
    _check(model, optimizer, lens, "load_checkpoint")
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint(path={str(path)!r}): no such checkpoint file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:  # an object weights_only does not build: refused unbuilt
        lines = [ln.strip() for ln in str(err).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        why = f" ({lines[0]})" if lines else ""
        raise StateDictError(
            f"load_checkpoint(path={str(path)!r}): the file holds objects that "
            f"torch.load(weights_only=True) refuses{why}; a checkpoint of save_checkpoint holds "
            "plain data only, so this file was altered or written by something else: nothing of it "
            "was loaded or run. Resume from another checkpoint"
        ) from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(
            f"load_checkpoint(path={str(path)!r}): not a checkpoint of gradlens.save_checkpoint; "
            "load a plain torch.save file with torch.load and each object's load_state_dict"
        )
    if state.get("version") != VERSION:
        raise ValueError(
            f"load_checkpoint(path={str(path)!r}): checkpoint version {state.get('version')!r}, "
            f"this gradlens reads version {VERSION}"
        )
    for name, obj in (("optimizer", optimizer), ("lens", lens)):
        if obj is not None and state[name] is None:
            raise ValueError(
                f"load_checkpoint(path={str(path)!r}, {name}=...): the checkpoint holds no "
                f"{name} state; save it with save_checkpoint(..., {name}={name}) or leave "
                f"{name}= out here"
            )
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lens is not None:
        lens.load_state_dict(state["lens"])
    return dict(state["extra"])


def _check(model: Any, optimizer: Any, lens: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}(model=...) needs an nn.Module, got {type(model).__name__}")
    for name, obj in (("optimizer", optimizer), ("lens", lens)):
        if obj is not None and not (
            callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
        ):
            raise TypeError(
                f"{fn}({name}=...) needs an object with state_dict() and load_state_dict(), got "
                f"{type(obj).__name__}"
            )


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable (POSIX); a no-op where folders cannot be opened (Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
