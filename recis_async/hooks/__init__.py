"""Built-in hooks.  Slow work (file writes, uploads, scans) runs in background services."""

from .checkpoint import (
    CheckpointSaverHook,
    latest_checkpoint,
    latest_checkpoint_step,
    list_checkpoints,
    restore_checkpoint,
)
from .early_stopping import EarlyStoppingHook
from .global_step_waiter import GlobalStepWaiterHook
from .hash_table_filter import HashTableFilterHook
from .history import HistorySaverHook
from .logging_tensor import LoggingTensorHook
from .nan import NanLossError, NanTensorHook
from .progress import ProgressBarHook
from .step_counter import StepCounterHook
from .stop_at_step import StopAtStepHook
from .trace import TraceHook, TraceToOdpsHook

__all__ = [
    "CheckpointSaverHook",
    "EarlyStoppingHook",
    "GlobalStepWaiterHook",
    "HashTableFilterHook",
    "HistorySaverHook",
    "LoggingTensorHook",
    "NanLossError",
    "NanTensorHook",
    "ProgressBarHook",
    "StepCounterHook",
    "StopAtStepHook",
    "TraceHook",
    "TraceToOdpsHook",
    "latest_checkpoint",
    "latest_checkpoint_step",
    "list_checkpoints",
    "restore_checkpoint",
]
