"""Rank helpers: torch.distributed when initialised, else the torchrun environment, else 0/1."""

from __future__ import annotations

import os

__all__ = ["get_rank", "get_world_size", "is_initialized"]


def is_initialized() -> bool:
    """Whether a torch.distributed process group is up."""
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized()


def get_rank() -> int:
    """This process's rank."""
    if is_initialized():
        import torch.distributed as tdist

        return int(tdist.get_rank())
    return _env_int("RANK", 0)


def get_world_size() -> int:
    """The number of ranks in the job."""
    if is_initialized():
        import torch.distributed as tdist

        return int(tdist.get_world_size())
    return _env_int("WORLD_SIZE", 1)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected an int, got {raw!r}") from None
