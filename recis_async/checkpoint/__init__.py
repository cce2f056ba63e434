"""Checkpoint files and the machinery behind :class:`~recis_async.hooks.CheckpointSaverHook`.

* :mod:`.files` -- ``checkpoint-<step>.pt`` names, listing, loading, :func:`restore_checkpoint`;
* :mod:`.snapshot` -- copying a state tree to reused host buffers on the step;
* :mod:`.writer` -- the background service that writes snapshots atomically.
* :mod:`.position` -- the trainer's place in its data, saved so a resume continues there.

The hook (when to save, what a checkpoint holds) is :mod:`recis_async.hooks.checkpoint`.
``CHECKPOINT_FORMAT`` is the format tag a checkpoint file carries.
"""

from . import files as _files
from .files import *  # noqa: F403

__all__ = _files.__all__
