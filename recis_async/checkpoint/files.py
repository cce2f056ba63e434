"""Checkpoint files: their names, listing them, loading the newest into a run.

``checkpoint-<step>.pt`` holds the state after ``step`` completed steps; a write in progress is
a hidden temporary (``.checkpoint-<step>.pt.tmp-<id>``) never listed, and one left by a killed
process is removed when the next writer starts.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import re
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import torch

from .._checks import stateful
from ..events import AfterLoadCheckpoint

if TYPE_CHECKING:
    from ..bus import HookBus

__all__ = [
    "CHECKPOINT_FORMAT",
    "checkpoint_path",
    "latest_checkpoint",
    "latest_checkpoint_step",
    "list_checkpoints",
    "restore_checkpoint",
]

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "recis_async.checkpoint/1"
_FILE = re.compile(r"^checkpoint-(\d+)\.pt$")
TMP_PREFIX = ".checkpoint-"
TMP_MARK = ".pt.tmp-"


def checkpoint_path(output_dir: str, step: int) -> str:
    """Where the checkpoint of ``step`` completed steps lives."""
    return os.path.join(output_dir, f"checkpoint-{step}.pt")


def list_checkpoints(output_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``output_dir``, oldest first.

    Temporary files of unfinished writes are never listed; a missing directory has none.
    """
    root = os.fspath(output_dir)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := _FILE.match(n))]
    return sorted(found)


def latest_checkpoint(output_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """``(step, path)`` of the newest checkpoint in ``output_dir``, or ``None``."""
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def latest_checkpoint_step(output_dir: str | os.PathLike[str]) -> int | None:
    """The step of the newest checkpoint in ``output_dir``, or ``None`` (a step source for
    :class:`~recis_async.hooks.GlobalStepWaiterHook`)."""
    found = latest_checkpoint(output_dir)
    return None if found is None else found[0]


def remove_stale_temporaries(output_dir: str) -> None:
    """Temporary files left by a process killed mid-write."""
    try:
        names = os.listdir(output_dir)
    except OSError:
        return  # the first write will report what is wrong with the directory
    for name in names:
        if name.startswith(TMP_PREFIX) and TMP_MARK in name:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(output_dir, name))
                logger.info("removed unfinished checkpoint file %s", name)


def load(path: str) -> dict[str, Any]:
    """The payload of the checkpoint file at ``path``, read with ``weights_only=True``."""
    with open(path, "rb") as f:
        payload = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise ValueError(
            f"restore_checkpoint: {path} is not a recis_async checkpoint "
            f"(expected format {CHECKPOINT_FORMAT!r}, got {found!r})"
        )
    return payload


async def restore_checkpoint(
    bus: HookBus,
    output_dir: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: Any = None,
    lr_scheduler: Any = None,
) -> int | None:
    """Load the newest checkpoint of ``output_dir``; return its step, or ``None`` if none.

    Loads ``model`` (strictly), ``optimizer`` and ``lr_scheduler`` when given, calls
    ``load_state_dict`` of every hook on ``bus`` whose ``state_key`` the checkpoint holds (each
    with its own copy), then publishes ``AfterLoadCheckpoint(global_step, path, hook_states)``
    so hooks can react with their state already in place.  Reading runs in a worker thread;
    the file is read with ``torch.load(weights_only=True)``.
    """
    stateful("restore_checkpoint", "model", model, optional=False)
    stateful("restore_checkpoint", "optimizer", optimizer, optional=True)
    stateful("restore_checkpoint", "lr_scheduler", lr_scheduler, optional=True)
    found = await anyio.to_thread.run_sync(latest_checkpoint, output_dir)
    if found is None:
        logger.info("no checkpoint in %s: starting from scratch", os.fspath(output_dir))
        return None
    path = found[1]
    payload = await anyio.to_thread.run_sync(load, path)
    step = payload.get("global_step")
    if type(step) is not int:
        raise ValueError(f"restore_checkpoint: {path} has no int global_step, got {step!r}")
    model.load_state_dict(payload["model"])
    for field, target in (("optimizer", optimizer), ("lr_scheduler", lr_scheduler)):
        if target is None:
            continue
        if payload.get(field) is None:
            raise ValueError(
                f"restore_checkpoint({field}=...): {path} holds no {field} state; "
                f"pass {field}=None to restore without it"
            )
        target.load_state_dict(payload[field])
    hook_states: dict[str, Any] = payload.get("hooks") or {}
    on_bus = {hook.state_key: hook for hook in bus.hooks}
    for key, state in hook_states.items():
        hook = on_bus.get(key)
        if hook is None:
            if state:
                logger.warning("%s holds state for %r: no such hook on the bus", path, key)
            continue
        hook.load_state_dict(copy.deepcopy(state))
    logger.info("restored %s (step %d)", path, step)
    await bus.publish(AfterLoadCheckpoint(global_step=step, path=path, hook_states=hook_states))
    return step
