"""Checkpoint files and the machinery behind :class:`~recis_async.hooks.CheckpointSaverHook`.

* :mod:`.files` -- ``checkpoint-<step>.pt`` names, listing, loading, :func:`restore_checkpoint`;
* :mod:`.snapshot` -- copying a state tree to reused host buffers on the step;
* :mod:`.writer` -- the background service that writes snapshots atomically.

The hook (when to save, what a checkpoint holds) is :mod:`recis_async.hooks.checkpoint`.
``CHECKPOINT_FORMAT`` is the format tag a checkpoint file carries.
"""

from .files import (
    CHECKPOINT_FORMAT,
    checkpoint_path,
    latest_checkpoint,
    latest_checkpoint_step,
    list_checkpoints,
    restore_checkpoint,
)

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_path",
    "latest_checkpoint",
    "latest_checkpoint_step",
    "list_checkpoints",
    "restore_checkpoint",
]
