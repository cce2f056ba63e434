"""Spill files of undelivered trace batches: a re-export of :mod:`recis_async.trace.spill`.

Kept because ``recis_async.spill`` is the documented import path and
``python -m recis_async.spill`` the documented command (see :mod:`.__main__`).
"""

from ..trace import spill as _spill
from ..trace.spill import *  # noqa: F403

__all__ = _spill.__all__
