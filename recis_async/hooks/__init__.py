"""Built-in hooks.  Slow work (file writes, uploads) runs in background services."""

from .checkpoint import CheckpointSaverHook, latest_checkpoint, list_checkpoints, restore_checkpoint

__all__ = [
    "CheckpointSaverHook",
    "latest_checkpoint",
    "list_checkpoints",
    "restore_checkpoint",
]
