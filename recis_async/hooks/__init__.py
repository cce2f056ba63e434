"""Built-in hooks.  Slow work (file writes, uploads, scans) runs in background services.

Each hook's module is imported on first use (PEP 562), as in :mod:`recis_async`: a job that
logs and checkpoints does not import what tracing needs (pyarrow, the writer), which would
add ~0.2 s to its start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _lazy

if TYPE_CHECKING:
    # The checkpoint file functions live in recis_async.checkpoint; they are re-exported here
    # because users import them from recis_async.hooks beside CheckpointSaverHook.
    from ..checkpoint import (
        latest_checkpoint,
        latest_checkpoint_step,
        list_checkpoints,
        restore_checkpoint,
    )
    from ..errors import NanLossError
    from .anomaly_profiler import AnomalyProfilerHook
    from .checkpoint import CheckpointSaverHook
    from .device_stats import DeviceStatsHook, OOMObserverHook
    from .early_stopping import EarlyStoppingHook
    from .global_step_waiter import GlobalStepWaiterHook
    from .hashtable_filter import HashTableFilterHook
    from .history import HistorySaverHook
    from .logger import LoggerHook
    from .logging_tensor import LoggingTensorHook
    from .metric_report import MetricReportHook, ReportArguments
    from .ml_tracker import MLTrackerHook
    from .nan import NanTensorHook
    from .nvtx import NvtxHook
    from .optim import ClipGradNormHook, GradNormHook, LearningRateHook
    from .profiler import ProfilerHook
    from .progress import ProgressBarHook
    from .step_counter import StepCounterHook
    from .stop_at_step import StopAtStepHook
    from .summary import SummarySaverHook
    from .timer import TimerHook
    from .trace import TraceHook, TraceToOdpsHook

#: Where each public name lives (a module relative to this package).
_WHERE: dict[str, str] = {
    "latest_checkpoint": "..checkpoint",
    "latest_checkpoint_step": "..checkpoint",
    "list_checkpoints": "..checkpoint",
    "restore_checkpoint": "..checkpoint",
    "NanLossError": "..errors",
    "AnomalyProfilerHook": ".anomaly_profiler",
    "CheckpointSaverHook": ".checkpoint",
    "DeviceStatsHook": ".device_stats",
    "OOMObserverHook": ".device_stats",
    "EarlyStoppingHook": ".early_stopping",
    "GlobalStepWaiterHook": ".global_step_waiter",
    "HashTableFilterHook": ".hashtable_filter",
    "HistorySaverHook": ".history",
    "LoggerHook": ".logger",
    "LoggingTensorHook": ".logging_tensor",
    "MetricReportHook": ".metric_report",
    "ReportArguments": ".metric_report",
    "MLTrackerHook": ".ml_tracker",
    "NanTensorHook": ".nan",
    "NvtxHook": ".nvtx",
    "ClipGradNormHook": ".optim",
    "GradNormHook": ".optim",
    "LearningRateHook": ".optim",
    "ProfilerHook": ".profiler",
    "ProgressBarHook": ".progress",
    "StepCounterHook": ".step_counter",
    "StopAtStepHook": ".stop_at_step",
    "SummarySaverHook": ".summary",
    "TimerHook": ".timer",
    "TraceHook": ".trace",
    "TraceToOdpsHook": ".trace",
}

__all__ = [
    "AnomalyProfilerHook",
    "CheckpointSaverHook",
    "ClipGradNormHook",
    "DeviceStatsHook",
    "EarlyStoppingHook",
    "GlobalStepWaiterHook",
    "GradNormHook",
    "HashTableFilterHook",
    "HistorySaverHook",
    "LearningRateHook",
    "LoggerHook",
    "LoggingTensorHook",
    "MLTrackerHook",
    "MetricReportHook",
    "NanLossError",
    "NanTensorHook",
    "NvtxHook",
    "OOMObserverHook",
    "ProfilerHook",
    "ProgressBarHook",
    "ReportArguments",
    "StepCounterHook",
    "StopAtStepHook",
    "SummarySaverHook",
    "TimerHook",
    "TraceHook",
    "TraceToOdpsHook",
    "latest_checkpoint",
    "latest_checkpoint_step",
    "list_checkpoints",
    "restore_checkpoint",
]


__getattr__, __dir__ = _lazy.attach(__name__, _WHERE, [*__all__])
