"""The trace pipeline: rows a step traces, on their way to a table.

One step's data flows through these modules in order:

* :mod:`.schema` -- the declared ODPS column types; ``convert`` turns each traced value into a
  read-only columnar chunk (or refuses it, naming the field) at the ``add_to_trace`` call;
* :mod:`.buffer` -- :class:`ColumnBuffer` appends chunks and seals an immutable :class:`Batch`
  at the byte-size threshold;
* :mod:`.service` -- :class:`TraceWriter`, the bus service that hands sealed batches to
  ``worker_num`` threads, retries transient sink failures and spills the rest;
* :mod:`.base` -- the :class:`Sink` contract, with :mod:`.parquet` and :mod:`.odps` its
  implementations;
* :mod:`.spill` -- the replayable files a batch lands in when the sink cannot take it
  (``python -m recis_async.spill`` inspects and replays them).

The hooks that feed it (``TraceHook``, ``TraceToOdpsHook``) are in :mod:`recis_async.hooks`.
"""

from ..errors import SinkError, TraceDeliveryError
from .base import Attempt, Sink
from .buffer import Batch, ColumnBuffer
from .odps import OdpsSink
from .parquet import ParquetSink
from .service import BatchSource, TraceWriter

__all__ = [
    "Attempt",
    "Batch",
    "BatchSource",
    "ColumnBuffer",
    "OdpsSink",
    "ParquetSink",
    "Sink",
    "SinkError",
    "TraceDeliveryError",
    "TraceWriter",
]
