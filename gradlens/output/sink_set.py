"""How a :class:`~gradlens.Lens` writes to its sinks: :class:`SinkSet`, in which a sink whose
write fails (a full disk, a file-size limit, a network error) is reported and retried, never
breaks the training loop.

A *sink* is any object with ``write(record)`` and ``close()`` (and optionally
``begin_segment(start)``, as :class:`~gradlens.output.jsonl.JsonlSink`).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

from gradlens.core.records import Record

__all__ = ["SinkSet"]


class SinkSet(list):
    """The sinks of a :class:`~gradlens.Lens`, written so that a failing sink never breaks it.

    :meth:`write` gives a record to every sink. A sink whose ``write`` raises (a full disk, a
    file-size limit, an ``.arrays`` folder that cannot be created, a network error) does not stop
    the Lens: the window still closes and the step advances. The first failure is reported by
    one ``RuntimeWarning`` naming the sink and the error; the records it could not take (at most
    ``max_failures``) are held and written again, in order, before the next record; after
    ``max_failures`` failed writes in a row the sink is closed and dropped, with a warning that
    names the steps it lost. A sink that recovers writes what it held and goes on; :meth:`close`
    tries what a sink still holds once more before closing it.

    Attributes:
        first_window: the first window index the Lens closed (set by the Lens); a sink with
            ``begin_segment`` (:class:`~gradlens.output.jsonl.JsonlSink`) starts its segment at
            the lower of it and the first record's step (a resumed Lens may write a record of
            the window before).
        dropped: ``(sink, error)`` of the sinks given up.
    """

    max_failures = 3

    def __init__(self, sinks: Iterable[Any] = ()) -> None:
        super().__init__(sinks)
        self.first_window: int | None = None
        self.dropped: list[tuple[Any, BaseException]] = []
        self._held: dict[int, list[Record]] = {}  # id(sink) -> records it failed to take
        self._failures: dict[int, int] = {}  # id(sink) -> failed writes in a row
        self._begun: set[int] = set()

    def write(self, record: Record) -> None:
        """Write ``record`` to every sink (after what a sink still holds)."""
        for sink in list(self):
            key = id(sink)
            queue = self._held.pop(key, []) + [record]
            for n, r in enumerate(queue):
                try:
                    if key not in self._begun:
                        begin = getattr(sink, "begin_segment", None)
                        if begin is not None:
                            first = r.step if self.first_window is None else min(self.first_window, r.step)
                            begin(first)
                        self._begun.add(key)
                    sink.write(r)
                except Exception as err:  # noqa: BLE001 - any sink error is reported, not raised
                    self._failed(sink, err, queue[n:])
                    break
            else:
                self._failures.pop(key, None)

    def _failed(self, sink: Any, err: Exception, unwritten: list[Record]) -> None:
        key = id(sink)
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        what = f"{type(err).__name__}: {err}"
        if failures >= self.max_failures:
            self.remove(sink)
            self._failures.pop(key, None)
            self._begun.discard(key)
            self.dropped.append((sink, err))
            try:
                sink.close()
            except Exception:  # noqa: BLE001 - closing a broken sink may fail again
                pass
            steps = [r.step for r in unwritten]
            warnings.warn(
                f"gradlens dropped the sink {sink!r} after {failures} failed writes in a row "
                f"(last: {what}); the records of steps {steps} were not written to it, and no "
                "later record will be. The Lens and its other sinks go on; fix the cause (disk "
                "space, permissions) and give a new sink to a new Lens",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        kept = unwritten[-self.max_failures :]
        lost = [r.step for r in unwritten[: len(unwritten) - len(kept)]]
        self._held[key] = kept
        if failures == 1:
            warnings.warn(
                f"gradlens could not write the record of step {unwritten[0].step} to the sink "
                f"{sink!r} ({what}); training and the Lens go on (the window closed, the step "
                f"advanced). The sink is tried again, with the records it missed, at the next "
                f"record, and dropped after {self.max_failures} failed writes in a row"
                + (f"; records of steps {lost} are lost for it" if lost else ""),
                RuntimeWarning,
                stacklevel=4,
            )

    def close(self) -> None:
        """Write what a sink still holds (once more), then close every sink; a sink that fails
        either way is reported, the others still close."""
        for sink in list(self):
            held = self._held.pop(id(sink), [])
            for n, r in enumerate(held):
                try:
                    sink.write(r)
                except Exception as err:  # noqa: BLE001
                    warnings.warn(
                        f"gradlens could not write the records of steps {[q.step for q in held[n:]]} "
                        f"to the sink {sink!r} before closing it ({type(err).__name__}: {err}); "
                        "they are lost for it",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    break
            try:
                sink.close()
            except Exception as err:  # noqa: BLE001
                warnings.warn(
                    f"gradlens could not close the sink {sink!r} ({type(err).__name__}: {err})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        self._held.clear()
