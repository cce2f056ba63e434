"""Built-in hooks; each does its slow work in background services, off the step."""

from __future__ import annotations

from .logger import LoggerHook
from .metric_report import MetricReportHook, ReportArguments
from .ml_tracker import MLTrackerHook
from .profiler import ProfilerHook
from .summary import SummarySaverHook

__all__ = [
    "LoggerHook",
    "MLTrackerHook",
    "MetricReportHook",
    "ProfilerHook",
    "ReportArguments",
    "SummarySaverHook",
]
