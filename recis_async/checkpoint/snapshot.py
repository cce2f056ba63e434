"""Snapshots: a state tree copied to host memory on the step, into buffers reused between
saves, so training may mutate its tensors at once and the writer works on a stable copy.

Tensors on an accelerator are copied without the step waiting for them: into page-locked
buffers with ``non_blocking=True``, on the current stream (so the copy holds the values as of
the save, whatever later kernels do to them), followed by an event the writer waits for in its
worker thread (:attr:`Snapshot.ready`).  Host tensors are copied on the step, split over a few
threads.  On a machine without an accelerator there is no event: the same code, host copies
only."""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

__all__ = ["Buffers", "Copier", "Layout", "Snapshot", "allocate", "layout_of"]

_PLAIN = (type(None), bool, int, float, str, bytes)
_COPY_THREADS = 4  # at most this many threads copy a snapshot (memory bandwidth caps the gain)
_COPY_MIN_BYTES = 4 << 20  # a thread per this many bytes: smaller copies are not worth one

Buffers = dict[str, torch.Tensor]  # a snapshot's CPU tensors by their place in the state


def _storage_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identifies a view of memory: tied weights appear under several names, copied once."""
    return (
        t.untyped_storage().data_ptr(),
        t.device,
        t.dtype,
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
    )


class Snapshot(NamedTuple):
    step: int
    path: str
    payload: dict[str, Any]
    nbytes: int
    buffers: Buffers
    ready: tuple[Any, ...] = ()  # events recorded after the device copies: wait before reading

    def wait_ready(self) -> None:
        """Block until the device copies into :attr:`buffers` are done (a worker thread's
        job: the step never calls this)."""
        for event in self.ready:
            event.synchronize()


class Copier:
    """Deep copy of a state tree with tensors copied to CPU (shared storage stays shared),
    refusing what ``torch.load(weights_only=True)`` could not read back.

    ``spare`` holds the CPU tensors of a snapshot that is no longer needed (written or
    superseded): a tensor of the same place, shape and dtype is overwritten in place instead
    of allocated, which spares the step the page faults of fresh memory.

    Strided tensors are copied by :meth:`finish`, not during the walk: the copies are split
    by size over the calling thread and helper threads (``Tensor.copy_`` releases the GIL),
    so the step waits for a fraction of one thread's memory copy.
    """

    def __init__(self, spare: Buffers | None = None) -> None:
        self.nbytes = 0
        self.buffers: Buffers = {}
        self._spare = spare or {}
        self._tensors: dict[tuple[Any, ...], torch.Tensor] = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, source)
        self.ready: tuple[Any, ...] = ()  # set by finish(): events after the device copies

    def copy(self, obj: Any, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, where)
        if type(obj) in _PLAIN:  # exact: numpy.float64 is a float but not loadable
            return obj
        if type(obj) in (dict, OrderedDict):
            out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
            for k, v in obj.items():
                out[k] = self.copy(v, f"{where}[{k!r}]")
            metadata = getattr(obj, "_metadata", None)  # module versions in a state_dict
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)  # type: ignore[attr-defined]
            return out
        if type(obj) in (list, tuple, torch.Size):
            return type(obj)(self.copy(v, f"{where}[{i}]") for i, v in enumerate(obj))
        raise TypeError(
            f"CheckpointSaverHook: {where} is a {type(obj).__module__}.{type(obj).__qualname__}; "
            "expected tensors, numbers, strings, bytes, None, or dicts/lists/tuples of those "
            "(what torch.load(weights_only=True) reads back)"
        )

    def _tensor(self, t: torch.Tensor, where: str) -> torch.Tensor:
        t = t.detach()
        if t.layout != torch.strided:  # sparse and friends: a plain copy, no reuse
            return t.to("cpu", copy=True)
        key = _storage_key(t)
        done = self._tensors.get(key)
        if done is not None:  # the same view seen under another name (tied weights)
            return done
        spare = self._spare.pop(where, None)
        pinned = _pinned_for(t)
        if (
            spare is not None
            and spare.shape == t.shape
            and spare.dtype == t.dtype
            and (not pinned or spare.is_pinned())
        ):
            done = spare
        elif pinned:  # page-locked: the copy from the device need not wait for it
            done = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        else:
            done = torch.empty_like(t, device="cpu")
        self._copies.append((done, t))
        self._tensors[key] = self.buffers[where] = done
        self.nbytes += done.numel() * done.element_size()
        return done

    def finish(self) -> None:
        """Copy every tensor the walk met: from a device, queued without waiting (then
        :attr:`ready` holds an event per device); from the host, using up to
        :data:`_COPY_THREADS` threads."""
        copies, self._copies = self._copies, []
        devices: dict[torch.device, None] = {}
        for dst, src in copies:
            if src.device.type != "cpu":
                dst.copy_(src, non_blocking=dst.is_pinned())  # this thread's current stream
                devices[src.device] = None
        self.ready = tuple(_record_event(device) for device in devices)
        copies = [(dst, src) for dst, src in copies if src.device.type == "cpu"]
        nbytes = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        threads = max(1, min(_COPY_THREADS, os.cpu_count() or 1, nbytes // _COPY_MIN_BYTES))
        shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
        loads = [0] * threads
        by_size = sorted(copies, key=lambda c: c[0].numel() * c[0].element_size(), reverse=True)
        for dst, src in by_size:
            i = loads.index(min(loads))  # largest first, each to the least loaded share
            shares[i].append((dst, src))
            loads[i] += dst.numel() * dst.element_size()
        errors: list[BaseException] = []

        def run(share: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
            try:
                for dst, src in share:
                    dst.copy_(src)
            except BaseException as exc:
                errors.append(exc)

        helpers = [
            threading.Thread(target=run, args=(share,), name="recis-checkpoint-copy")
            for share in shares[1:]
        ]
        for helper in helpers:
            helper.start()
        run(shares[0])
        for helper in helpers:
            helper.join()
        if errors:
            raise errors[0]


def _pinned_for(t: torch.Tensor) -> bool:
    """Whether the host copy of ``t`` goes to page-locked memory: for CUDA tensors."""
    return t.device.type == "cuda"


def _record_event(device: torch.device) -> Any:
    """An event recorded on ``device``'s current stream (after the copies queued there)."""
    if device.type != "cuda":  # another accelerator: its copies were synchronous
        return _Done()
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class _Done:
    """An event that has already happened."""

    def synchronize(self) -> None:
        return None


Layout = dict[str, tuple[torch.Size, torch.dtype, bool]]  # place: shape, dtype, pinned


def layout_of(obj: Any, where: str, out: Layout, seen: set[tuple[Any, ...]]) -> None:
    """Shapes and dtypes of the strided tensors :class:`Copier` would copy, by place."""
    if isinstance(obj, torch.Tensor):
        if obj.layout == torch.strided:
            key = _storage_key(obj)
            if key not in seen:
                seen.add(key)
                out[where] = (obj.shape, obj.dtype, _pinned_for(obj))
    elif type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            layout_of(v, f"{where}[{k!r}]", out, seen)
    elif type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            layout_of(v, f"{where}[{i}]", out, seen)


def allocate(layout: Layout) -> Buffers:
    """Host buffers for a snapshot, their pages touched now rather than on the step."""
    return {
        where: torch.zeros(shape, dtype=dtype, pin_memory=pinned)
        for where, (shape, dtype, pinned) in layout.items()
    }
