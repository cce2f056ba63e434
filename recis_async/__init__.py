"""recis_async: an asynchronous event-bus hook engine for PyTorch training loops.

``async with HookBus() as bus:`` around the training code; hooks subscribe to typed lifecycle
events; slow work (trace uploads, experiment tracking, checkpoints) runs in background
services that drain when the block is left.

The names below are imported on first use (PEP 562), so a process that needs only a part of
the package -- a tracker's child process, say -- does not import torch with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .bus import HookBus
    from .collect import add_metric, add_to_ml_tracker, add_to_trace
    from .errors import HookError
    from .hook import Hook
    from .priority import Priority
    from .service import Service
    from .subscription import Subscription
    from .trainer import Trainer, TrainingArguments

_WHERE = {
    "HookBus": ".bus",
    "add_metric": ".collect",
    "add_to_ml_tracker": ".collect",
    "add_to_trace": ".collect",
    "HookError": ".errors",
    "Hook": ".hook",
    "Priority": ".priority",
    "Service": ".service",
    "Subscription": ".subscription",
    "Trainer": ".trainer",
    "TrainingArguments": ".trainer",
}

__all__ = [
    "Hook",
    "HookBus",
    "HookError",
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


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
