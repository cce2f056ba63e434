"""Constructor argument checks shared by hooks and trackers: each error names the argument,
what was expected and what arrived."""

from __future__ import annotations

import logging
import math
import os
import tempfile
from typing import Any, cast, get_args

from .errors import OnError

__all__ = [
    "stateful",
    "boolean",
    "creatable_dir",
    "dir_path",
    "exactly_one",
    "logger_or",
    "non_negative_int",
    "non_negative_number",
    "nonempty_str",
    "on_error",
    "positive_int",
    "positive_number",
    "one_of",
    "writable_dir",
]


def boolean(owner: str, field: str, value: Any) -> bool:
    """``value`` if it is ``True`` or ``False``: ``"no"``, ``0`` or ``None`` are refused, not
    read by their truth value."""
    if value is not True and value is not False:
        raise TypeError(f"{owner}({field}=...): expected a bool, got {value!r}")
    return value


def logger_or(owner: str, value: Any, default: str) -> logging.Logger:
    """``value`` if it is a logger, the logger named ``default`` for ``None``."""
    if value is None:
        return logging.getLogger(default)
    if not isinstance(value, logging.Logger | logging.LoggerAdapter):
        raise TypeError(f"{owner}(logger=...): expected a logging.Logger or None, got {value!r}")
    return cast(logging.Logger, value)


def on_error(owner: str, field: str, value: Any) -> OnError:
    """``value`` if it is one of the :data:`~recis_async.errors.OnError` policies."""
    return cast(OnError, one_of(owner, field, value, get_args(OnError)))


def stateful(owner: str, field: str, value: Any, *, optional: bool) -> None:
    """Refuse ``value`` unless it has ``state_dict()`` and ``load_state_dict()`` (or is ``None``
    when ``optional``): a ``TypeError`` naming the owner and the field."""
    if value is None and optional:
        return
    if not all(callable(getattr(value, m, None)) for m in ("state_dict", "load_state_dict")):
        expected = "an object with state_dict() and load_state_dict()"
        expected += " or None" if optional else ""
        raise TypeError(f"{owner}({field}=...): expected {expected}, got {value!r}")


def _at_least(owner: str, field: str, value: Any, minimum: int, expected: str) -> int:
    """An int >= ``minimum``: ``TypeError`` for another type (``True`` and ``2.0`` included),
    ``ValueError`` for a smaller one."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}({field}=...): expected {expected}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{owner}({field}=...): expected {expected}, got {value!r}")
    return value


def _finite(owner: str, field: str, value: Any, positive: bool, expected: str) -> float:
    """A finite number, > 0 or >= 0: ``TypeError`` for a non-number, else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{owner}({field}=...): expected {expected}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{owner}({field}=...): expected {expected}, got {value!r}")
    return float(value)


def positive_int(owner: str, field: str, value: Any) -> int:
    """``value`` as an int > 0; errors say ``Owner(field=...): expected ..., got ...``."""
    return _at_least(owner, field, value, 1, "a positive int")


def non_negative_int(owner: str, field: str, value: Any) -> int:
    """``value`` as an int >= 0."""
    return _at_least(owner, field, value, 0, "an int >= 0")


def positive_number(owner: str, field: str, value: Any) -> float:
    """``value`` as a finite float > 0."""
    return _finite(owner, field, value, True, "a positive number")


def non_negative_number(owner: str, field: str, value: Any) -> float:
    """``value`` as a finite float >= 0."""
    return _finite(owner, field, value, False, "a number >= 0")


def one_of(owner: str, field: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``."""
    if value not in choices:
        expected = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}({field}=...): expected one of {expected}, got {value!r}")
    return cast(str, value)


def nonempty_str(owner: str, field: str, value: Any) -> str:
    """``value`` if it is a non-empty str."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}({field}=...): expected a non-empty str, got {value!r}")
    if not value:
        raise ValueError(f"{owner}({field}=...): expected a non-empty str, got ''")
    return value


def exactly_one(owner: str, **given: Any) -> str:
    """The name of the one argument that is not ``None``; both or neither is an error."""
    set_ = [name for name, value in given.items() if value is not None]
    if len(set_) != 1:
        names = " or ".join(given)
        got = ", ".join(f"{name}={value!r}" for name, value in given.items())
        raise ValueError(f"{owner}: expected exactly one of {names}, got {got}")
    return set_[0]


def writable_dir(owner: str, field: str, value: Any) -> str:
    """Create ``value`` if missing and prove it writable by creating and removing a file.

    ``os.access`` is not enough: it says yes to root on a read-only directory and knows
    nothing of full or read-only file systems.
    """
    path = _dir_path(owner, field, value)
    try:
        os.makedirs(path, exist_ok=True)
        _probe(path)
    except OSError as exc:
        raise _unwritable(owner, field, value, exc) from exc
    return path


def creatable_dir(owner: str, field: str, value: Any) -> str:
    """Like :func:`writable_dir`, but create nothing: prove writable the directory itself if
    it exists, else the nearest existing one above it, which the writer creates it in when
    it first writes.  For outputs only rank 0 writes: other ranks leave no empty folders."""
    path = _dir_path(owner, field, value)
    existing = path
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(20, "Not a directory", existing)
        _probe(existing)
    except OSError as exc:
        raise _unwritable(owner, field, value, exc) from exc
    return path


def dir_path(owner: str, field: str, value: Any) -> str:
    """``value`` as an absolute directory path, checked for type only (a directory that is
    checked for writing where it is used)."""
    return _dir_path(owner, field, value)


def _dir_path(owner: str, field: str, value: Any) -> str:
    if not isinstance(value, str | os.PathLike) or not os.fspath(value):
        raise ValueError(f"{owner}({field}=...): expected a directory path, got {value!r}")
    return os.path.abspath(os.fspath(value))


def _probe(directory: str) -> None:
    fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
    os.close(fd)
    os.unlink(probe)


def _unwritable(owner: str, field: str, value: Any, exc: OSError) -> ValueError:
    return ValueError(
        f"{owner}({field}=...): expected a writable directory, got {value!r} "
        f"({type(exc).__name__}: {exc.strerror or exc})"
    )
