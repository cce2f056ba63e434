"""recis_async: an asynchronous event-bus hook engine for PyTorch training loops.

``async with HookBus() as bus:`` around the training code; hooks subscribe to typed lifecycle
events; slow work (trace uploads, experiment tracking, checkpoints) runs in background
services that drain when the block is left.

The hooks and sinks most runs use are importable from here; every hook is in
``recis_async.hooks``, every sink in ``recis_async.sinks``, trackers in
``recis_async.trackers``, embedding tables in ``recis_async.nn``.
"""

from .aggregate import MetricAggregator
from .bus import HookBus
from .collect import add_metric, add_to_ml_tracker, add_to_trace
from .console import disable_logging, enable_logging
from .errors import HookError
from .hook import Hook
from .hooks import (
    CheckpointSaverHook,
    LoggerHook,
    MetricReportHook,
    MLTrackerHook,
    ProfilerHook,
    ProgressBarHook,
    ReportArguments,
    TraceHook,
    TraceToOdpsHook,
)
from .priority import Priority
from .service import Service
from .sinks import OdpsSink, ParquetSink
from .subscription import Subscription
from .trainer import Trainer, TrainingArguments

__all__ = [
    "CheckpointSaverHook",
    "Hook",
    "HookBus",
    "HookError",
    "LoggerHook",
    "MLTrackerHook",
    "MetricAggregator",
    "MetricReportHook",
    "OdpsSink",
    "ParquetSink",
    "Priority",
    "ProfilerHook",
    "ProgressBarHook",
    "ReportArguments",
    "Service",
    "Subscription",
    "TraceHook",
    "TraceToOdpsHook",
    "Trainer",
    "TrainingArguments",
    "add_metric",
    "add_to_ml_tracker",
    "add_to_trace",
    "disable_logging",
    "enable_logging",
]

__version__ = "0.1.0"
