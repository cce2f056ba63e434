"""Batches on their way to the model: moved to its device without making the step wait, and
read ahead where the trainer must know early that the data ends.

:func:`to_device` moves the tensors of a batch (nested dicts, lists, tuples) to a device the
way RecIS's ``data_to_cuda`` does: each host tensor is copied into page-locked memory (a no-op
for one a ``DataLoader(pin_memory=True)`` pinned already) and from there with
``non_blocking=True``, so the copy is queued on the current stream and the Python thread goes
on.  A copy from ordinary (pageable) memory would wait for the device's queue to drain.  To
the CPU nothing is copied: the same call returns the batch as it is.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

__all__ = ["Lookahead", "batch_size", "model_device", "mover", "resolve_device", "to_device"]


def batch_size(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor/array (dicts, lists, tuples)."""
    if type(batch) is dict:  # the common batch, first: a plain dict has no ``shape``
        for value in batch.values():
            if type(value) is torch.Tensor:  # its first tensor, without another call
                shape = value.shape
                return shape[0] if shape else 1
            return batch_size(value)
        return 0
    if isinstance(batch, torch.Tensor) or hasattr(batch, "shape"):
        shape = batch.shape
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, dict):
        for value in batch.values():
            return batch_size(value)
        return 0
    if isinstance(batch, list | tuple):
        if batch and (isinstance(batch[0], torch.Tensor) or hasattr(batch[0], "shape")):
            return batch_size(batch[0])
        return len(batch)
    return 1


def model_device(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (else first buffer); the CPU without any."""
    for getter in ("parameters", "buffers"):
        tensors = getattr(model, getter, None)
        if callable(tensors):
            for t in tensors():
                return torch.device(t.device)
    return torch.device("cpu")


def to_device(batch: Any, device: torch.device, keep_on_host: Collection[str] = ()) -> Any:
    """``batch`` with its tensors on ``device`` (dicts, lists, tuples and named tuples walked;
    other values as they are).  A dict entry whose key is in ``keep_on_host`` stays where it
    is (ids for an embedding table's host-side id map).  Host tensors travel through pinned
    memory with non-blocking copies; tensors already on ``device`` are returned as they are,
    and a dict in which nothing moves comes back itself, not a copy (on the CPU, the step's
    batch costs no dict).
    """
    return _to(batch, device, device.type == "cpu", keep_on_host)


def mover(device: torch.device, keep_on_host: Collection[str] = ()) -> Callable[[Any], Any]:
    """:func:`to_device` for ``device`` as a one-argument function, for a loop that moves
    every batch: what depends only on the device is worked out once, here."""
    to_cpu = device.type == "cpu"

    def move(batch: Any) -> Any:
        return _to(batch, device, to_cpu, keep_on_host)

    return move


def _to(batch: Any, device: torch.device, to_cpu: bool, keep: Collection[str]) -> Any:
    """:func:`to_device`, with whether ``device`` is the CPU worked out once (a
    ``device.type`` read costs more than the check it feeds)."""
    if type(batch) is dict or isinstance(batch, dict):
        out = None  # a copy only when something moves (on the CPU, nothing does)
        for k, v in batch.items():
            if to_cpu and type(v) is torch.Tensor and v.is_cpu or k in keep:
                continue  # the common case on the CPU decided here, without a call
            moved = _to(v, device, to_cpu, keep)
            if moved is not v:
                if out is None:
                    out = batch.copy()  # the same kind of dict (OrderedDict, defaultdict...)
                out[k] = moved
        return batch if out is None else out
    if isinstance(batch, torch.Tensor):
        if to_cpu:
            return batch if batch.is_cpu else batch.to(device)
        return _tensor_to(batch, device)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_to(v, device, to_cpu, keep) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_to(v, device, to_cpu, keep) for v in batch)
    return batch


def _tensor_to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()  # from pageable memory the copy would wait for the device's queue
    return t.to(device, non_blocking=True)


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with the index of the current device filled in (``"cuda"`` -> ``cuda:0``), so
    that a tensor already there compares equal and is not copied again."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class Lookahead:
    """An iterator read up to a few batches ahead: :meth:`has` says whether the ``n``-th next
    batch exists (reading up to it), :meth:`take` hands out the next one.  Each batch read is
    passed through ``prepare`` once (the device copy starts as soon as it is read)."""

    def __init__(self, it: Iterator[Any], prepare: Any = None) -> None:
        self._it = it
        self._prepare = prepare
        self._ready: deque[Any] = deque()
        self._ended = False

    def has(self, n: int) -> bool:
        """Whether at least ``n`` more batches exist (reads ahead to find out)."""
        while len(self._ready) < n:
            if not self._read():
                return False
        return True

    def take(self) -> Any:
        """The next batch; ``StopIteration`` when the data ended."""
        if self._ready or self._read():
            return self._ready.popleft()
        raise StopIteration

    def _read(self) -> bool:
        """Read one more batch into the queue; false once the data has ended."""
        if self._ended:
            return False
        try:
            batch = next(self._it)
        except StopIteration:
            self._ended = True
            return False
        self._ready.append(batch if self._prepare is None else self._prepare(batch))
        return True
