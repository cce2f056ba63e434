"""What the library shows on the terminal: its log lines, and log lines under a progress bar.

The library logs under the ``recis_async`` logger and, like any library, adds no handler on
import.  :func:`enable_logging` shows its lines on stderr (own loops call it once); the
``Trainer`` installs the same handler by default only when the application configured no
logging at all (neither the root logger nor ``recis_async`` has a handler), and that default
steps aside as soon as the application configures the root logger, so no line is printed
twice.  While a :class:`~recis_async.hooks.ProgressBarHook` bar is drawn, console handlers
write through tqdm so that every log line lands on its own line above the bar.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import IO, Any

__all__ = ["LOGGER_NAME", "disable_logging", "enable_logging", "log_failure"]

LOGGER_NAME = "recis_async"
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _LibraryHandler(logging.StreamHandler):
    """The handler :func:`enable_logging` (or the Trainer's default) puts on ``recis_async``.

    ``default``: installed by the Trainer because nothing was configured.  Once the root
    logger has a handler (the application configured logging later), it no longer writes
    itself but hands each record to the root's handlers, as propagation would, and with the
    level it set (``own_level``) it passes on only what the root's level lets through.
    """

    def __init__(self, stream: IO[str] | None, *, default: bool, own_level: int | None) -> None:
        super().__init__(stream)
        self.default = default
        self.own_level = own_level
        self.setFormatter(logging.Formatter(_FORMAT, _DATE_FORMAT))

    def handle(self, record: logging.LogRecord) -> bool:
        root = logging.getLogger()
        if self.default and root.handlers:
            library = logging.getLogger(LOGGER_NAME)
            if (
                self.own_level is None
                or library.level != self.own_level
                or (record.levelno >= root.getEffectiveLevel())
            ):
                root.callHandlers(record)
            return True
        return super().handle(record)


# A failure that repeats (on_error="log") is logged with its traceback this many times; after
# that one line at the 10th, 100th, 1000th ... failure.
TRACEBACKS_LOGGED = 3


def log_failure(
    logger: logging.Logger, count: int, exc: BaseException, message: str, *args: object
) -> None:
    """Log the ``count``-th failure of one thing that keeps failing, without flooding.

    The first :data:`TRACEBACKS_LOGGED` failures are logged at ERROR with their traceback,
    then one line (no traceback) at the 10th, 100th, 1000th ... failure.
    """
    if count <= TRACEBACKS_LOGGED:
        note = (
            "; further failures are counted and logged at the 10th, 100th, 1000th ..."
            if count == TRACEBACKS_LOGGED
            else ""
        )
        logger.error(f"{message} (failure {count}){note}", *args, exc_info=exc)
        return
    if _is_power_of_ten(count):
        logger.error(
            f"{message}: %d failures so far, the last %s: %s",
            *args,
            count,
            type(exc).__name__,
            exc,
        )


def _is_power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def _library_handlers(library: logging.Logger) -> list[_LibraryHandler]:
    return [h for h in library.handlers if isinstance(h, _LibraryHandler)]


def enable_logging(level: int | str = "INFO", *, stream: IO[str] | None = None) -> None:
    """Show the library's log lines at ``level`` and above on ``stream`` (default stderr).

    One handler on the ``recis_async`` logger, replaced on every call, with propagation to
    the root logger off so lines are not printed twice when the application logs too.
    :func:`disable_logging` undoes it.  To keep the application's own logging configuration
    instead, set the level only: ``logging.getLogger("recis_async").setLevel("INFO")``.
    """
    if isinstance(level, bool) or not isinstance(level, int | str):
        raise TypeError(f"enable_logging(level=...): expected a level name or int, got {level!r}")
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(
            f"enable_logging(level=...): expected DEBUG, INFO, WARNING, ERROR or CRITICAL, "
            f"got {level!r}"
        )
    if stream is not None and not callable(getattr(stream, "write", None)):
        raise TypeError(f"enable_logging(stream=...): expected a text stream, got {stream!r}")
    disable_logging()
    library = logging.getLogger(LOGGER_NAME)
    library.setLevel(numeric)
    library.addHandler(_LibraryHandler(stream, default=False, own_level=numeric))
    library.propagate = False


def disable_logging() -> None:
    """Remove what :func:`enable_logging` (or the Trainer's default) set up: the handler, the
    level it set and the switched-off propagation."""
    library = logging.getLogger(LOGGER_NAME)
    for handler in _library_handlers(library):
        library.removeHandler(handler)
        if handler.own_level is not None and library.level == handler.own_level:
            library.setLevel(logging.NOTSET)
        library.propagate = True


def default_logging() -> None:
    """The Trainer's default: INFO lines on stderr, only when no logging is configured."""
    library = logging.getLogger(LOGGER_NAME)
    if library.handlers or logging.getLogger().handlers:
        return  # the application decides
    own_level = None
    if library.level == logging.NOTSET:
        own_level = logging.INFO
        library.setLevel(own_level)
    library.addHandler(_LibraryHandler(None, default=True, own_level=own_level))
    library.propagate = False


class _BarSafeStream:
    """A console stream whose writes first clear the progress bars drawn on it, then redraw
    them below the text (tqdm's ``external_write_mode``, which ``tqdm.write`` uses too)."""

    def __init__(self, stream: IO[str], tqdm_class: Any) -> None:
        self.stream = stream
        self._tqdm = tqdm_class

    def write(self, text: str) -> int:
        with self._tqdm.external_write_mode(file=self.stream):
            written = self.stream.write(text)
            self.stream.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def route_logging_through_bar(tqdm_class: Any, bar_file: IO[str] | None) -> Callable[[], None]:
    """Make console log handlers write through tqdm while a bar is shown; returns the undo.

    Console handlers are the ``StreamHandler``s (files excluded) of the root and
    ``recis_async`` loggers writing to stdout, stderr or the bar's own file; their level,
    filters and format stay as they are.
    """
    consoles = {id(s) for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)}
    if bar_file is not None:
        consoles.add(id(bar_file))
    swapped: list[tuple[logging.StreamHandler[Any], IO[str]]] = []
    for logger in (logging.getLogger(), logging.getLogger(LOGGER_NAME)):
        for handler in logger.handlers:
            if (
                isinstance(handler, logging.StreamHandler)
                and not isinstance(handler, logging.FileHandler)
                and id(handler.stream) in consoles
            ):
                original = handler.stream
                handler.setStream(_BarSafeStream(original, tqdm_class))
                swapped.append((handler, original))

    def undo() -> None:
        for handler, original in swapped:
            if isinstance(handler.stream, _BarSafeStream):
                handler.setStream(original)
        swapped.clear()

    return undo


def clear_bars() -> None:
    """Take any tqdm bar off the screen until its next update, so that what C++ code prints
    to the terminal next (torch's profiler and allocator messages) starts on a clean line.

    The tqdm lock is held only while clearing, never around the caller's work: a worker
    thread logging through the bar takes the handler's lock, then tqdm's."""
    tqdm_module = sys.modules.get("tqdm")
    if tqdm_module is None:
        return
    tqdm_class = tqdm_module.tqdm
    with tqdm_class.get_lock():
        for bar in list(getattr(tqdm_class, "_instances", ())):
            bar.clear(nolock=True)
