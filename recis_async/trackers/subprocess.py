"""SubprocessTracker: run any tracker in a child process, out of the training process's GIL.

Tracker clients are mostly Python (MLflow's store does SQL through SQLAlchemy, REST through
requests).  In a worker thread that code still takes the GIL from the training thread; at a
few thousand metrics per second that costs several percent of a small model's step rate.
``SubprocessTracker(factory)`` builds the real tracker in a child process and forwards
``start`` / ``log`` / ``finish`` over a pipe as msgpack (arrays as raw bytes), so the
training process only encodes the batch and waits on the pipe with the GIL released.

``factory`` must be picklable by reference to a module other than the program's
``__main__`` (a class, a module-level function, or a ``functools.partial`` of them), e.g.
``SubprocessTracker(functools.partial(MlflowClientTracker, "sqlite:///runs.db"))``.  The
child is a fresh interpreter (``sys.executable``, the parent's ``sys.path``) that imports only
what the factory needs -- not the program's main module, as multiprocessing's ``spawn`` would,
and not torch -- so it starts in about the time its tracker's own imports take.  Once
``finish`` is answered the child exits at once, without the interpreter's teardown (no
``atexit`` handlers): a tracker's ``finish`` must leave its run stored.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pickle
import pickletools
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from ..events import EndStatus
from .base import RunSpec, StepRecord, Tracker

__all__ = ["SubprocessTracker"]

logger = logging.getLogger(__name__)

_ARRAY_EXT = 1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        arr = np.ascontiguousarray(obj)
        header = msgspec.msgpack.encode((arr.dtype.str, arr.shape))
        return msgspec.msgpack.Ext(
            _ARRAY_EXT, len(header).to_bytes(4, "little") + header + arr.tobytes()
        )
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the tracker process")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _ARRAY_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    size = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4 : 4 + size])
    return np.frombuffer(data[4 + size :], dtype=np.dtype(dtype)).reshape(shape).copy()


class _Call(msgspec.Struct, array_like=True):
    op: str
    run: RunSpec | None = None
    records: list[StepRecord] | None = None
    status: str | None = None


class _Reply(msgspec.Struct, array_like=True):
    ok: bool
    error: str = ""
    run_id: str | None = None  # the child tracker's ``run_id`` after start, if it has one
    # how much of a failed log landed, as the child's error said (see Tracker.log)
    in_doubt: bool = False
    delivered: int = 0


#: What the child runs: argv[1] is its end of the socket pair, argv[2] the parent's sys.path.
_CHILD_CODE = (
    "import json, sys\n"
    "sys.path[:] = json.loads(sys.argv[2])\n"
    "from recis_async.trackers.subprocess import _child_main\n"
    "_child_main(int(sys.argv[1]))\n"
)


def _child_main(fd: int) -> None:
    """Entry point of the child interpreter: the factory arrives as the first message."""
    conn = Connection(fd)
    try:
        factory_pickle = conn.recv_bytes()
    except EOFError:
        return
    if _serve(conn, factory_pickle):
        # finished and answered: the run's data is stored, so skip the interpreter's
        # teardown of mlflow, SQLAlchemy & co. (seconds the parent's close would wait for)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _main_references(data: bytes) -> bool:
    """Whether a pickle refers to anything in the program's ``__main__`` module."""
    strings: list[str] = []
    for opcode, arg, _ in pickletools.genops(data):
        if opcode.name in ("GLOBAL", "INST") and isinstance(arg, str):
            if arg.split(" ", 1)[0] == "__main__":
                return True
        elif isinstance(arg, str):
            strings.append(arg)
        if opcode.name == "STACK_GLOBAL" and len(strings) >= 2 and strings[-2] == "__main__":
            return True
    return False


def _serve(conn: Connection, factory_pickle: bytes) -> bool:
    """Child process: build the tracker, answer calls until ``finish`` (returns True once it
    was answered) or the pipe closes (False).

    Ctrl-C reaches the whole process group; the child ignores it, so the parent's bus can
    still deliver what is buffered and finish the run while it shuts down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    decoder = msgspec.msgpack.Decoder(_Call, ext_hook=_ext_hook)
    encoder = msgspec.msgpack.Encoder()
    tracker: Any = None
    try:
        while True:
            try:
                call = decoder.decode(conn.recv_bytes())
            except EOFError:
                return False
            try:
                if call.op == "start":
                    tracker = pickle.loads(factory_pickle)()
                    tracker.start(call.run)
                elif call.op == "log":
                    tracker.log(call.records or [])
                elif call.op == "discard":
                    discard = getattr(tracker, "discard", None)
                    if callable(discard):
                        discard()
                    else:
                        tracker.finish("cancelled")
                else:
                    tracker.finish(call.status)
            except Exception as exc:
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                delivered = getattr(exc, "delivered", 0)
                reply = _Reply(
                    False,
                    text,
                    in_doubt=getattr(exc, "in_doubt", False) is True,
                    delivered=delivered if type(delivered) is int else 0,
                )
                conn.send_bytes(encoder.encode(reply))
            else:
                run_id = getattr(tracker, "run_id", None)
                reply = _Reply(True, run_id=run_id if isinstance(run_id, str) else None)
                conn.send_bytes(encoder.encode(reply))
            if call.op in ("finish", "discard"):
                return True
    finally:
        conn.close()


def _in_doubt(exc: Exception) -> Exception:
    """Mark a call's failure as leaving its records in doubt: the child may have stored them
    and died (or hung) before it answered."""
    exc.in_doubt = True  # type: ignore[attr-defined]
    return exc


class SubprocessTracker:
    """A :class:`~recis_async.trackers.Tracker` that runs ``factory()`` in a child process.

    A child that died (killed, out of memory) is started again, at most ``max_restarts``
    times, by the next ``log`` or ``finish``, continuing the same run; the call that saw it
    die fails with ``in_doubt`` set on its error: the child may have stored the records
    before it died, so the service spills them apart for the replay to settle.  A failure
    the child's tracker reported keeps what it said of how much landed (``delivered``,
    ``in_doubt``: see :meth:`Tracker.log <recis_async.trackers.Tracker.log>`).
    :meth:`abort` kills the child from any thread (the service does at its close
    deadline), so no call outlives the close.

    Args:
        factory: builds the tracker in the child; a picklable callable defined in an importable
            module (not ``__main__``).
        call_timeout: seconds one call may take before the child is killed.
        max_restarts: how often a dead child is started again.

    Raises:
        TypeError: a ``factory`` that is not callable.
        ValueError: a ``factory`` defined in ``__main__`` or not picklable, a ``call_timeout``
            that is not positive.
    """

    def __init__(
        self,
        factory: Callable[[], Tracker],
        *,
        call_timeout: float = 300.0,
        max_restarts: int = 3,
    ) -> None:
        if not callable(factory):
            raise TypeError(f"SubprocessTracker.factory: expected a callable, got {factory!r}")
        try:
            self._factory = pickle.dumps(factory)
        except Exception as exc:
            raise ValueError(
                "SubprocessTracker.factory: expected a picklable callable (a class, a module-level "
                f"function or functools.partial of one), got {factory!r} ({exc})"
            ) from None
        if _main_references(self._factory):
            raise ValueError(
                "SubprocessTracker.factory: expected a callable importable from a module (the "
                f"child does not run the program's __main__), got {factory!r} from __main__"
            )
        if not call_timeout > 0:
            raise ValueError(
                f"SubprocessTracker.call_timeout: expected seconds > 0, got {call_timeout!r}"
            )
        if type(max_restarts) is not int or max_restarts < 0:
            raise ValueError(
                f"SubprocessTracker.max_restarts: expected an int >= 0, got {max_restarts!r}"
            )
        self.call_timeout = float(call_timeout)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.requested_id: str | None = None  # the run id start was asked to continue
        self._run: RunSpec | None = None  # the run started, for a restart
        self._aborted = False
        target = factory.func if isinstance(factory, functools.partial) else factory
        self._describe = getattr(target, "__qualname__", None) or type(target).__name__
        self.run_id: str | None = None  # the child tracker's run_id once started, if any
        self._proc: Any = None
        self._conn: Connection | None = None
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(_Reply)

    def __repr__(self) -> str:
        return f"SubprocessTracker({self._describe})"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else int(self._proc.pid)

    def start(self, run: RunSpec) -> None:
        self.requested_id, self._aborted = run.run_id, False
        self._spawn(run)
        self._run = run

    def _spawn(self, run: RunSpec) -> None:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD_CODE, str(theirs.fileno()), json.dumps(sys.path)],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
            )
            self._proc, self._conn = proc, Connection(ours.detach())
        try:
            self._conn.send_bytes(self._factory)
            self._call(_Call("start", run=run))
        except BaseException:
            self._stop()  # nothing calls finish on a run that never started: end the child
            raise

    def _revive(self, op: str) -> None:
        """Start a dead child again on the same run, if restarts are left."""
        if self._conn is not None or self._run is None or self._aborted:
            return
        if self.restarts >= self.max_restarts:
            raise RuntimeError(
                f"{self!r}: {op}: the tracker process died {self.restarts + 1} times; "
                f"not started again (max_restarts={self.max_restarts})"
            )
        self.restarts += 1
        logger.warning(
            "%r: the tracker process is gone; starting it again (%d of %d) on run %s",
            self,
            self.restarts,
            self.max_restarts,
            self.run_id,
        )
        self._spawn(msgspec.structs.replace(self._run, run_id=self.run_id or self._run.run_id))

    def log(self, records: Sequence[StepRecord]) -> None:
        self._revive("log")
        self._call(_Call("log", records=list(records)))

    def discard(self) -> None:
        if self._conn is None:
            return
        try:
            self._call(_Call("discard"))
        finally:
            self._stop()
            self._run, self.run_id = None, None

    def finish(self, status: EndStatus) -> None:
        self._revive("finish")
        if self._conn is None:
            return
        try:
            self._call(_Call("finish", status=status))
        finally:
            self._stop()
            self._run = None

    def abort(self) -> None:
        """Kill the child now, from any thread: a call waiting on it fails at once."""
        self._aborted = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()

    def _call(self, call: _Call) -> None:
        conn = self._conn
        if conn is None:
            raise RuntimeError(f"{self!r}: {call.op} before start")
        try:
            conn.send_bytes(self._encoder.encode(call))
            answered = conn.poll(self.call_timeout)
            reply = self._decoder.decode(conn.recv_bytes()) if answered else None
        except (EOFError, OSError) as exc:
            proc = self._proc
            self._stop()
            code = None if proc is None else proc.returncode
            raise _in_doubt(
                RuntimeError(
                    f"{self!r}: the tracker process is gone during {call.op} (exit code {code})"
                )
            ) from exc
        if reply is None:  # the child hangs: kill it now rather than wait for it to exit
            self._stop(kill=True)
            raise _in_doubt(
                TimeoutError(f"{self!r}: {call.op} got no answer in {self.call_timeout}s")
            )
        if not reply.ok:
            error = RuntimeError(
                f"{self!r}: {call.op} failed in the tracker process: {reply.error}"
            )
            if reply.in_doubt:
                _in_doubt(error)
            if reply.delivered:
                error.delivered = reply.delivered  # type: ignore[attr-defined]
            raise error
        if reply.run_id is not None:
            self.run_id = reply.run_id

    def _stop(self, *, kill: bool = False) -> None:
        conn, proc = self._conn, self._proc
        self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if kill:
                proc.kill()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
