"""Where traced rows go: the :class:`Sink` contract and its implementations.

A re-export of the sinks that live in :mod:`recis_async.trace` (the trace pipeline's package),
kept because ``from recis_async.sinks import ParquetSink`` is how users import them.
"""

from ..errors import SinkError
from ..trace.base import Attempt, Sink
from ..trace.odps import OdpsSink
from ..trace.parquet import ParquetSink

__all__ = ["Attempt", "Sink", "SinkError", "OdpsSink", "ParquetSink"]
