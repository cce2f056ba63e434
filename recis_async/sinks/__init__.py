"""Where traced rows go: the :class:`Sink` contract and its implementations."""

from .base import Attempt, Sink, SinkError
from .odps import OdpsSink
from .parquet import ParquetSink

__all__ = ["Attempt", "Sink", "SinkError", "OdpsSink", "ParquetSink"]
