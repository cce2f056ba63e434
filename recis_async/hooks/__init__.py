"""Built-in hooks.  Slow work (file writes, uploads, scans) runs in background services."""

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
