"""recis_async: an asynchronous event-bus hook engine for PyTorch training loops.

``async with HookBus() as bus:`` around the training code (``with SyncHookBus() as bus:``
around synchronous code); hooks subscribe to typed lifecycle
events; slow work (trace uploads, experiment tracking, checkpoints) runs in background
services that drain when the block is left.

The hooks and sinks most runs use are importable from here; every hook is in
``recis_async.hooks``, every sink in ``recis_async.sinks``, trackers in
``recis_async.trackers``, embedding tables in ``recis_async.nn``.  The names below are
imported on first use (PEP 562), so a process that needs only a part of the package -- a
tracker's child process, say -- does not import torch with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _lazy

if TYPE_CHECKING:
    from .aggregate import MetricAggregator
    from .bus import HookBus
    from .collect import add_metric, add_to_ml_tracker, add_to_trace
    from .console import disable_logging, enable_logging
    from .errors import (
        HookError,
        NanLossError,
        RecisAsyncError,
        SinkError,
        TraceDeliveryError,
        TrackerError,
    )
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
    from .subscription import Subscription
    from .syncbus import SyncHookBus
    from .trace import OdpsSink, ParquetSink
    from .trainer import Trainer, TrainingArguments

_WHERE = {
    "MetricAggregator": ".aggregate",
    "HookBus": ".bus",
    "add_metric": ".collect",
    "add_to_ml_tracker": ".collect",
    "add_to_trace": ".collect",
    "disable_logging": ".console",
    "enable_logging": ".console",
    "HookError": ".errors",
    "NanLossError": ".errors",
    "RecisAsyncError": ".errors",
    "SinkError": ".errors",
    "TraceDeliveryError": ".errors",
    "TrackerError": ".errors",
    "Hook": ".hook",
    "CheckpointSaverHook": ".hooks",
    "LoggerHook": ".hooks",
    "MetricReportHook": ".hooks",
    "MLTrackerHook": ".hooks",
    "ProfilerHook": ".hooks",
    "ProgressBarHook": ".hooks",
    "ReportArguments": ".hooks",
    "TraceHook": ".hooks",
    "TraceToOdpsHook": ".hooks",
    "Priority": ".priority",
    "Service": ".service",
    "OdpsSink": ".trace",
    "ParquetSink": ".trace",
    "Subscription": ".subscription",
    "SyncHookBus": ".syncbus",
    "Trainer": ".trainer",
    "TrainingArguments": ".trainer",
}

__all__ = [
    "CheckpointSaverHook",
    "Hook",
    "HookBus",
    "HookError",
    "LoggerHook",
    "MLTrackerHook",
    "MetricAggregator",
    "MetricReportHook",
    "NanLossError",
    "OdpsSink",
    "ParquetSink",
    "Priority",
    "ProfilerHook",
    "ProgressBarHook",
    "RecisAsyncError",
    "ReportArguments",
    "Service",
    "SinkError",
    "Subscription",
    "SyncHookBus",
    "TraceDeliveryError",
    "TraceHook",
    "TraceToOdpsHook",
    "TrackerError",
    "Trainer",
    "TrainingArguments",
    "add_metric",
    "add_to_ml_tracker",
    "add_to_trace",
    "disable_logging",
    "enable_logging",
]

__version__ = "0.1.0"


__getattr__, __dir__ = _lazy.attach(__name__, _WHERE, [*__all__, "__version__"])
