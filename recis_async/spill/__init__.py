"""Spill files of undelivered trace batches: a re-export of :mod:`recis_async.trace.spill`.

Kept because ``recis_async.spill`` is the documented import path and
``python -m recis_async.spill`` the documented command (see :mod:`.__main__`).
"""

from ..trace.spill import (
    ReplayReport,
    SpillEntry,
    SpillFile,
    journal_path,
    read_journal,
    read_spill,
    replay_spill,
    write_spill,
)

__all__ = [
    "ReplayReport",
    "SpillEntry",
    "SpillFile",
    "journal_path",
    "read_journal",
    "read_spill",
    "replay_spill",
    "write_spill",
]
