"""The contract between the trace writer and the places traced rows end up.

A sink's methods block and are called from worker threads (``anyio.to_thread``), never on
the event loop.  :meth:`Sink.write` delivers one :class:`~recis_async.trace.buffer.Batch`
atomically -- all of its rows become visible or none do -- and every call uses a fresh file
name, block id or upload session, so the writer may call it again with the same batch after
a failure without duplicating rows.

Each call gets an :class:`Attempt`.  Right before its irreversible step (a commit, a
rename) the sink calls :meth:`Attempt.commit` with a token naming that step; from then
until the sink learns the outcome, the batch is *in doubt*.  If the call fails with the
outcome unknown (a commit whose response was lost), the token stays on the attempt; the
writer passes it to the next attempt of the same batch (or stores it in the spill file) and
the sink settles it -- was that commit applied? -- before sending anything again.  When the
writer gives up on a call still running in its thread (the close deadline passed), it calls
:meth:`Attempt.abandon`: the call will not start a commit any more, and the token returned
tells whether one may already have happened.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from .buffer import Batch
from .schema import OdpsType

__all__ = ["Attempt", "Sink", "parse_partition"]


class Attempt:
    """One call of :meth:`Sink.write`: its in-doubt token and the writer's abandon switch.

    Thread-safe: the sink uses it from a worker thread while the writer may abandon it from
    the event loop.  Whoever runs the ``write`` call :meth:`finish` es the attempt, so a
    writer that abandoned it can wait for a commit already under way to end.

    Args:
        in_doubt: the token of an earlier attempt whose outcome is unknown, for the sink to
            settle first.
    """

    __slots__ = ("_lock", "_token", "_abandoned", "_delivered", "_in_doubt", "_moved", "done")

    def __init__(self, in_doubt: str | None = None) -> None:
        self._lock = threading.Lock()
        self._token = in_doubt
        self._in_doubt = in_doubt
        self._moved = False  # commit() or resolve() was called
        self._abandoned = False
        self._delivered = False
        self.done = threading.Event()

    @property
    def token(self) -> str | None:
        """The step whose outcome is unknown (from an earlier attempt or this one), if any."""
        with self._lock:
            return self._token

    @property
    def abandoned(self) -> bool:
        with self._lock:
            return self._abandoned

    @property
    def settled_present(self) -> bool:
        """Asked once ``write`` returned: whether it found the step in doubt already applied
        (it was given a token and neither resolved it nor committed anything: the rows were
        there, nothing was sent)."""
        with self._lock:
            return self._in_doubt is not None and not self._moved

    @property
    def delivered(self) -> bool:
        """Whether the ``write`` call returned normally (set by :meth:`finish`)."""
        with self._lock:
            return self._delivered

    def commit(self, token: str) -> bool:
        """Declare that the irreversible step named ``token`` is about to run.

        Returns False -- and the sink must not run it -- once the attempt was abandoned.
        Calling it again means the previous step certainly did not happen.
        """
        with self._lock:
            if self._abandoned:
                return False
            self._token = token
            self._moved = True
            return True

    def resolve(self) -> None:
        """The step in doubt is known not to have happened (nothing of it is visible)."""
        with self._lock:
            self._token = None
            self._moved = True

    def abandon(self) -> str | None:
        """Forbid further commits; return the token still in doubt, if any."""
        with self._lock:
            self._abandoned = True
            return self._token

    def finish(self, delivered: bool) -> None:
        """Record that the ``write`` call ended (returned: ``delivered``) and wake waiters."""
        with self._lock:
            self._delivered = delivered
        self.done.set()


@runtime_checkable
class Sink(Protocol):
    """Where sealed trace batches are written; see the module docstring for the rules."""

    @property
    def name(self) -> str:
        """A short description for logs and errors (never containing credentials)."""
        ...

    def open(self, fields: tuple[str, ...], types: tuple[OdpsType, ...]) -> None:
        """Prepare to receive rows of this schema (create tables, directories, clients).

        Called before the first ``write``; called again if it raised.
        """
        ...

    def write(self, batch: Batch, attempt: Attempt) -> None:
        """Deliver every row of ``batch`` exactly once, or raise.

        First settle ``attempt.token`` if set (return at once when that earlier step was
        applied).  Raise :class:`SinkError` for failures; anything else counts as permanent.
        """
        ...

    def close(self) -> None:
        """Release clients and connections; idempotent."""
        ...

    # Optional: ``check_fields(fields, owner)`` raising ``ValueError`` for field names the
    # sink cannot store (ParquetSink: a partition key's name); TraceHook calls it at once.
    # Optional: ``delivered_steps(run) -> [(first, last), ...]``, the step ranges of a traced
    # run the table holds (ParquetSink: from its files' footers); a run resumed from a
    # checkpoint older than its last delivered rows (after a crash) uses it to trace each
    # step once.  A sink without it cannot tell: such steps are written again.


_PARTITION_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# '%': Hive readers (pyarrow, Spark) URL-decode folder names, so "%2F..%2F" would read back
# as "/../" -- a value other than the one written, and a path to somewhere else
_PARTITION_VALUE_FORBIDDEN = frozenset("/\\,='\"\0\n\r%")


def parse_partition(spec: str | Mapping[str, object] | None) -> tuple[tuple[str, str], ...]:
    """Parse an ODPS partition spec (``"dt=20261122"``, ``"dt=20261122,hour=10"`` or a
    mapping) into ``((key, value), ...)``; ``None`` or ``""`` means no partition."""
    if spec is None:
        return ()
    if isinstance(spec, Mapping):
        for k, v in spec.items():
            if v is None:  # str(None) would make a real folder named "None"
                raise ValueError(f"partition: value of {k!r} must be a value, got None")
        items = [(str(k), str(v)) for k, v in spec.items()]
    elif isinstance(spec, str):
        items = []
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise ValueError(f"partition: expected 'key=value' pairs, got {part!r} in {spec!r}")
            items.append((key.strip(), value.strip().strip("'\"")))
    else:
        raise ValueError(
            f"partition: expected a string like 'dt=20261122,hour=10' or a mapping, "
            f"got {type(spec).__name__}"
        )
    seen: set[str] = set()
    for key, value in items:
        if not _PARTITION_KEY.match(key):
            raise ValueError(f"partition: expected an identifier as key, got {key!r}")
        if key.lower() in seen:
            raise ValueError(f"partition: duplicate key {key!r}")
        seen.add(key.lower())
        if not value or value in (".", "..") or _PARTITION_VALUE_FORBIDDEN & set(value):
            raise ValueError(
                f"partition: value of {key!r} must be non-empty without / \\ , = % or quotes, "
                f"got {value!r}"
            )
        if value == "None":  # f"dt={day}" with day None: a folder no reader asks for
            raise ValueError(f"partition: value of {key!r} must be a value, got 'None'")
    return tuple(items)
