"""Durable file writes: a file appears whole under its final name or not at all.

Every writer that must survive a crash (checkpoints, spill files, tracker run files, Parquet
parts) writes a temporary beside the final name, ``fsync`` s it, renames it, and ``fsync`` s
the directory so the rename itself survives a power loss.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_path", "fsync_path"]


def fsync_path(path: str | os.PathLike[str]) -> None:
    """``fsync`` the file or directory at ``path`` (a directory: the entries it holds)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(final: str | os.PathLike[str], tmp: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield ``tmp`` to write; on a clean exit make it durable and rename it to ``final``.

    ``tmp`` must be in ``final``'s directory (a rename is atomic only within one file
    system).  An existing ``final`` is replaced.  On any exception, ``BaseException``
    included, ``tmp`` is removed and nothing appears under ``final``.
    """
    tmp_path, final_path = Path(tmp), Path(final)
    try:
        yield tmp_path
        fsync_path(tmp_path)
        os.replace(tmp_path, final_path)
    finally:
        tmp_path.unlink(missing_ok=True)  # gone after the rename; removed after a failure
    fsync_path(final_path.parent)
