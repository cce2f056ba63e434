"""recis_async: an asynchronous event-bus hook engine for PyTorch training loops.

``async with HookBus() as bus:`` around the training code; hooks subscribe to typed lifecycle
events; slow work (trace uploads, experiment tracking, checkpoints) runs in background
services that drain when the block is left.
"""

from .aggregate import MetricAggregator
from .bus import HookBus
from .collect import add_metric, add_to_ml_tracker, add_to_trace
from .errors import HookError
from .hook import Hook
from .priority import Priority
from .service import Service
from .subscription import Subscription
from .trainer import Trainer, TrainingArguments

__all__ = [
    "Hook",
    "HookBus",
    "HookError",
    "MetricAggregator",
    "Priority",
    "Service",
    "Subscription",
    "Trainer",
    "TrainingArguments",
    "add_metric",
    "add_to_ml_tracker",
    "add_to_trace",
]

__version__ = "0.1.0"
