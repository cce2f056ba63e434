"""Experiment trackers behind one small blocking protocol, fed off the step by a service.

``JsonlTracker`` is the embedded default; ``MlflowTracker`` (its client in a child process;
``MlflowClientTracker`` in this one) and ``TensorBoardTracker`` need
the ``mlflow`` / ``tensorboard`` extras and import them only when built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TrackerError
from .base import RunSpec, StepRecord, Tracker, check_metric_name, flatten_params
from .jsonl import JsonlTracker, read_records
from .service import TrackerService
from .subprocess import SubprocessTracker

if TYPE_CHECKING:
    from .mlflow import MlflowClientTracker, MlflowTracker
    from .tensorboard import TensorBoardTracker

__all__ = [
    "Tracker",
    "RunSpec",
    "StepRecord",
    "JsonlTracker",
    "MlflowTracker",
    "MlflowClientTracker",
    "TensorBoardTracker",
    "SubprocessTracker",
    "TrackerService",
    "TrackerError",
    "read_records",
    "check_metric_name",
    "flatten_params",
]


def __getattr__(name: str) -> Any:
    # The optional backends live in their own modules so importing this package never
    # pulls in mlflow or tensorboard.
    if name in ("MlflowTracker", "MlflowClientTracker"):
        from . import mlflow

        return getattr(mlflow, name)
    if name == "TensorBoardTracker":
        from .tensorboard import TensorBoardTracker

        return TensorBoardTracker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
