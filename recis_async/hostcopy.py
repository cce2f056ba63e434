"""Recorded tensors leave the device without blocking: :class:`HostCopy` and its pool.

``add_to_trace`` and ``add_to_ml_tracker`` given a tensor on a device call
:meth:`HostBufferPool.copy`: the tensor is copied into a host buffer taken from the bus's pool
-- ``copy_(src, non_blocking=True)`` on the current stream, then a CUDA event recorded after
it -- and the step goes on at once.  On the CPU the copy is a plain copy and there is no
event; everything else is the same code, so the CPU test suite runs the logic a GPU runs
(``collect.READ_CPU_AT_CALL`` false sends CPU tensors this way).  The value is the one at the
call: stream order puts the copy before any later in-place update.  A CPU tensor traced in an
ordinary run needs no buffer: :func:`held` keeps the caller's clone of it, read when resolved.

A :class:`HostCopy` knows its dtype, shape and size without reading anything.
:meth:`HostCopy.ready` never blocks; :meth:`HostCopy.resolve` waits for the copy (call it in
a worker thread, or once ``ready()``), copies the values out into an owned, read-only numpy
array -- ``bfloat16`` becomes ``float32`` exactly, ``float16`` stays numpy ``float16`` -- and
gives the buffer back to the pool at once.  ``np.asarray(copy)`` resolves too.

The pool (:class:`HostBufferPool`) holds at most ``max_bytes`` of buffers (default
:data:`DEFAULT_HOST_BUFFER_BYTES`), pinned when CUDA is available, reused across steps (a
buffer per dtype, shape and device; free ones of the oldest shapes are dropped for new
ones).  At each ``AfterStep`` the copies of earlier steps are handed over
(:meth:`HostBufferPool.next_step`), every :data:`DEFAULT_COPY_OUT_INTERVAL` seconds in a batch,
to the pool's copy-out thread, which resolves them: the step thread neither waits for the
device nor copies values out, and a buffer is normally back within that interval (a pool made
with ``copy_out_interval=None`` resolves the ready ones on the step instead, one step after
their copy).
When the buffers in use fill the pool, a copy still gets a buffer (over the bound by at
most that step's copies; a tensor larger than the whole pool gets a one-off buffer the same
way), and the step's ``publish(AfterStep)`` then waits in :meth:`HostBufferPool.make_room`,
resolving the oldest copies as the device finishes them, until the pool is back within its
bound: at most ``wait_timeout`` seconds (then ``TimeoutError``), and not past a stop
request.  Buffers given back while the pool is over its bound are freed, not kept.

torch is imported only by the pool's methods: a process that merely reads copies (a
tracker's child process) does not import it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Final

import anyio
import numpy as np

from ._checks import positive_int, positive_number

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_COPY_OUT_INTERVAL",
    "DEFAULT_HOST_BUFFER_BYTES",
    "DEFAULT_WAIT_TIMEOUT",
    "HostBufferPool",
    "HostCopy",
    "held",
    "resolved_dtype",
]

logger = logging.getLogger(__name__)

#: the host buffer pool's bound in bytes unless the bus is given another
#: (``HookBus(host_buffer_bytes=...)``): a few steps of traced and tracked values in flight
DEFAULT_HOST_BUFFER_BYTES: Final = 64 << 20
#: the longest a step waits for the device to finish the copies filling the pool, in seconds
DEFAULT_WAIT_TIMEOUT: Final = 60.0
#: how often, in seconds, the copies of finished steps go to the copy-out thread in a batch:
#: waking a thread every step would cost the step more than the copy-out it spares
#: (benchmarks/README.md, "Host copies out off the step")
DEFAULT_COPY_OUT_INTERVAL: Final = 0.1
_POLL_S: Final = 0.001  # how often a step waiting for room asks the device again

# torch dtype name -> (the dtype resolve() returns, the dtype the buffer is read as)
_DTYPES: Final = {
    "bool": (np.dtype(np.bool_), np.dtype(np.bool_)),
    "uint8": (np.dtype(np.uint8), np.dtype(np.uint8)),
    "int8": (np.dtype(np.int8), np.dtype(np.int8)),
    "int16": (np.dtype(np.int16), np.dtype(np.int16)),
    "int32": (np.dtype(np.int32), np.dtype(np.int32)),
    "int64": (np.dtype(np.int64), np.dtype(np.int64)),
    "uint16": (np.dtype(np.uint16), np.dtype(np.uint16)),
    "uint32": (np.dtype(np.uint32), np.dtype(np.uint32)),
    "uint64": (np.dtype(np.uint64), np.dtype(np.uint64)),
    "float16": (np.dtype(np.float16), np.dtype(np.float16)),
    "float32": (np.dtype(np.float32), np.dtype(np.float32)),
    "float64": (np.dtype(np.float64), np.dtype(np.float64)),
    "complex64": (np.dtype(np.complex64), np.dtype(np.complex64)),
    "complex128": (np.dtype(np.complex128), np.dtype(np.complex128)),
    # no numpy bfloat16: the buffer's bits are read as uint16 and widened to float32
    "bfloat16": (np.dtype(np.float32), np.dtype(np.uint16)),
}


def resolved_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The numpy dtype a :class:`HostCopy` of a ``dtype`` tensor resolves to (``float32`` for
    ``bfloat16``), or None when there is none (float8 types, quantized types...)."""
    pair = _DTYPES.get(str(dtype).removeprefix("torch."))
    return None if pair is None else pair[0]


def _dtype_plan(dtype: torch.dtype, owner: str) -> tuple[np.dtype[Any], np.dtype[Any], int]:
    """How a pool copies ``dtype``: the dtype resolved to, the dtype its buffer is read as,
    and the bytes of one element."""
    pair = _DTYPES.get(str(dtype).removeprefix("torch."))
    if pair is None:
        raise ValueError(f"{owner}: expected a numpy-compatible dtype, got {dtype}")
    return pair[0], pair[1], pair[1].itemsize


class _Slot:
    """One host buffer: the tensor copies land in, its numpy view (made once, when the
    buffer is allocated), its size, and the CUDA event re-recorded after each copy."""

    __slots__ = ("event", "key", "nbytes", "tensor", "view")

    def __init__(self, key: tuple[Any, ...], tensor: Any, view: np.ndarray, nbytes: int) -> None:
        self.key = key
        self.tensor = tensor
        self.view = view
        self.nbytes = nbytes
        self.event: Any = None


class HostCopy:
    """A tensor's values on their way to host memory (made by :meth:`HostBufferPool.copy`).

    ``dtype`` is the numpy dtype :meth:`resolve` returns (``float32`` for a ``bfloat16``
    source, whose dtype is ``source_dtype``), ``shape`` the tensor's shape, ``nbytes`` the
    size of the resolved array; all known without reading a value.  Thread-safe: the event
    loop may check :meth:`ready` while a worker thread resolves.
    """

    __slots__ = (
        "_event",
        "_lock",
        "_pool",
        "_result",
        "_slot",
        "_source",
        "_step",
        "device",
        "dtype",
        "nbytes",
        "shape",
        "size",
        "source_dtype",
    )

    def __init__(
        self,
        pool: HostBufferPool | None,
        slot: _Slot | None,
        event: Any,
        dtype: np.dtype[Any],
        shape: tuple[int, ...],
        size: int,
        source_dtype: torch.dtype,
        device: torch.device,
        step: int,
        source: torch.Tensor | None = None,
    ) -> None:
        self._pool = pool
        self._slot = slot
        self._source = source  # a CPU tensor of its own, read when resolved (see held)
        self._event = event
        self._lock = threading.Lock()
        self._step = step
        self._result: np.ndarray | None = None
        self.dtype = dtype
        self.shape = shape
        self.size = size
        self.nbytes = size * dtype.itemsize
        self.source_dtype = source_dtype
        self.device = device
        if slot is None and source is None:  # nothing to copy (no elements)
            self._result = _readonly(np.empty(shape, dtype))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d HostCopy")
        return self.shape[0]

    @property
    def resolved(self) -> bool:
        """Whether the values were copied out already (:meth:`resolve` returns at once)."""
        return self._result is not None

    def ready(self) -> bool:
        """Whether :meth:`resolve` would return without waiting for the device; never
        blocks (a CUDA event query)."""
        event = self._event
        return self._result is not None or event is None or bool(event.query())

    def resolve(self) -> np.ndarray:
        """The values as an owned, read-only numpy array; the first call waits for the copy
        (on a GPU: for the device to reach it -- call it in a worker thread unless
        :meth:`ready`), copies the values out and gives the buffer back to the pool (a
        :func:`held` clone is read as it is).

        Raises:
            RuntimeError: the copy was :meth:`release` d before it was resolved.
        """
        result = self._result
        if result is not None:
            return result
        event = self._event
        if event is not None:
            event.synchronize()  # this copy only, not the whole device
        with self._lock:
            result = self._result
            if result is None and self._source is not None:  # held: its values are here
                result = self._result = _readonly(self._source.numpy(force=True))
                self._source = None
            elif result is None:
                slot = self._slot
                if slot is None:
                    raise RuntimeError(
                        f"{self!r}: released before it was resolved, its values are gone"
                    )
                result = self._result = _copy_out(slot.view, self.dtype)
                self._slot = None
                if self._pool is not None:  # (a copy with a buffer has its pool)
                    self._pool._give_back(self, slot, None)
        return result

    def release(self) -> None:
        """Give the buffer back to the pool now, resolved or not (an unresolved copy's values
        are then gone).  A copy the device has not finished yet keeps its buffer out of use
        until it has.  Idempotent."""
        with self._lock:
            slot, self._slot = self._slot, None
            self._source = None
        if slot is not None and self._pool is not None:
            self._pool._give_back(self, slot, self._event)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        """``np.asarray(host_copy)``: :meth:`resolve` (waiting for the copy if needed)."""
        array = self.resolve()
        if dtype is not None and np.dtype(dtype) != array.dtype:
            return array.astype(dtype)
        return array.copy() if copy else array

    def __repr__(self) -> str:
        state = "resolved" if self._result is not None else "pending"
        if self._result is None and self._slot is None and self._source is None:
            state = "released"
        return (
            f"<HostCopy {self.source_dtype} {tuple(self.shape)} from {self.device}, "
            f"{self.nbytes} bytes, {state}>"
        )


def held(clone: torch.Tensor, dtype: np.dtype[Any]) -> HostCopy:
    """A :class:`HostCopy` of ``clone``, a CPU tensor nobody else holds (the caller's clone)
    of a dtype that numpy has (``dtype``): resolved by reading it, off the step.  No pool
    buffer and no wait: the step is spared numpy's conversion and copy, whose code a step
    runs cold, right after the model's compute, at a cost above the clone's
    (benchmarks/README.md, "CPU trace columns held as tensors")."""
    return HostCopy(
        None, None, None, dtype, clone.shape, clone.numel(), clone.dtype, clone.device, 0, clone
    )


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _copy_out(view: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    """An owned, read-only copy of a buffer's values as ``dtype``: bfloat16 bits (read as
    uint16) become the float32 of the same value by a 16-bit shift, which is exact."""
    if view.dtype == dtype:
        return _readonly(view.copy())
    out = np.empty(view.shape, np.float32)
    np.left_shift(view, 16, out=out.view(np.uint32), dtype=np.uint32)
    return _readonly(out)


class HostBufferPool:
    """The bounded pool of host buffers a bus's tensors are copied into (see the module).

    Not shared between buses; :meth:`copy`, :meth:`next_step` and :meth:`make_room` run on
    the thread that runs the steps, :meth:`HostCopy.resolve` anywhere.  The copies of finished
    steps are resolved by the pool's copy-out thread (a daemon thread started with the first
    hand-over, ended by :meth:`close`), in batches: every ``copy_out_interval`` seconds, or at
    once when they hold a quarter of ``max_bytes``.  With ``copy_out_interval=None`` there is
    no thread: :meth:`next_step` resolves the ready copies of earlier steps itself.

    Args:
        max_bytes: the bound on the bytes of buffers held (in use, waiting for the device,
            or free for reuse).
        pin_memory: page-locked buffers (needed for copies that do not block the device's
            stream); default: when CUDA is available.
        wait_timeout: the longest a step waits for room, in seconds.
        owner: the name used in messages (the bus's argument).
        copy_out_interval: seconds between hand-overs to the copy-out thread (0: every
            step); ``None``: no thread, the step resolves them.

    Raises:
        TypeError, ValueError: a bound or timeout that is not a positive number, an interval
            that is negative.
    """

    def __init__(
        self,
        max_bytes: int = DEFAULT_HOST_BUFFER_BYTES,
        *,
        pin_memory: bool | None = None,
        wait_timeout: float = DEFAULT_WAIT_TIMEOUT,
        owner: str = "HostBufferPool",
        copy_out_interval: float | None = DEFAULT_COPY_OUT_INTERVAL,
    ) -> None:
        self.max_bytes = positive_int(owner, "max_bytes", max_bytes)
        self.wait_timeout = positive_number(owner, "wait_timeout", wait_timeout)
        self.owner = owner
        if copy_out_interval is not None and (
            isinstance(copy_out_interval, bool)
            or not isinstance(copy_out_interval, int | float)
            or not copy_out_interval >= 0
        ):
            raise ValueError(
                f"{owner}(copy_out_interval=...): expected a number >= 0 or None, "
                f"got {copy_out_interval!r}"
            )
        self.copy_out_interval = copy_out_interval
        # the copy-out thread's side: this step's copies, those of finished steps not handed
        # over yet (and their bytes), the queue to the thread, when the last hand-over was
        self._this_step: list[HostCopy] = []
        self._finished: list[HostCopy] = []
        self._finished_bytes = 0
        self._handover_bytes = max(1, self.max_bytes // 4)
        self._to_thread: queue.SimpleQueue[list[HostCopy] | None] | None = None
        self._thread: threading.Thread | None = None
        self._last_handover = time.perf_counter()
        self._closed = False
        self._pin = pin_memory  # decided on the first buffer: asking CUDA costs at start
        self._lock = threading.Lock()
        self._free: dict[tuple[Any, ...], list[_Slot]] = {}  # per key, in first-use order
        self._outstanding: dict[HostCopy, None] = {}  # copies holding a buffer, oldest first
        self._parked: list[tuple[_Slot, Any]] = []  # released before the device finished
        self._held = 0  # bytes of every buffer above
        self._step = 0
        self._dtypes: dict[Any, tuple[np.dtype[Any], np.dtype[Any], int]] = {}  # seen so far
        self._warned_oversize = False
        # counted on every copy: plain attributes (``copies`` is read on every step: while it
        # is 0, as in a job on the CPU, there is nothing to hand over or wait for)
        self.copies = self._reused = 0
        self._stats = {
            "allocated": 0,
            "over_bound": 0,
            "resolved_on_step": 0,
            "backpressure_waits": 0,
        }
        self._copied_out = 0  # by the copy-out thread (which alone counts them)
        self._wait_s = 0.0

    # ------------------------------------------------------------------ the step's side
    def accepts(self, dtype: torch.dtype) -> bool:
        """Whether tensors of ``dtype`` can be copied (they have a numpy equivalent)."""
        return resolved_dtype(dtype) is not None

    def copy(self, src: torch.Tensor) -> HostCopy:
        """Start copying ``src`` (any device, any layout torch can copy densely) into a host
        buffer and return its :class:`HostCopy`; never waits for the device.

        Raises:
            ValueError: a dtype without a numpy equivalent (see :func:`resolved_dtype`).
        """
        if src.requires_grad:
            src = src.detach()
        dtype = src.dtype
        pair = self._dtypes.get(dtype)
        if pair is None:
            pair = self._dtypes[dtype] = _dtype_plan(dtype, self.owner)
        resolved, view_dtype, itemsize = pair
        shape = tuple(src.shape)
        device = src.device
        size = src.numel()
        step = self._step
        self.copies += 1
        if not size:
            return HostCopy(self, None, None, resolved, shape, 0, dtype, device, step)
        key = (dtype, shape, device)
        with self._lock:
            free = self._free.get(key)
            slot = free.pop() if free else None
        if slot is None:
            slot = self._allocate(key, view_dtype, size * itemsize, src)
        else:
            self._reused += 1
        event = None
        if src.is_cuda:
            import torch

            slot.tensor.copy_(src, non_blocking=True)
            if slot.event is None:
                slot.event = torch.cuda.Event()
            event = slot.event
            event.record(torch.cuda.current_stream(device))
        else:  # the CPU (or a device without events here): a plain copy
            slot.tensor.copy_(src)
        copy = HostCopy(self, slot, event, resolved, shape, size, dtype, device, step)
        with self._lock:
            self._outstanding[copy] = None
        if self.copy_out_interval is not None:
            self._this_step.append(copy)
        return copy

    def _allocate(
        self, key: tuple[Any, ...], view_dtype: np.dtype[Any], nbytes: int, src: Any
    ) -> _Slot:
        """A new buffer of ``nbytes`` for tensors like ``src``; free buffers of other shapes
        make room first, those of the oldest shapes first."""
        import torch

        with self._lock:
            self._evict(self.max_bytes - nbytes)
            self._held += nbytes
            over = self._held > self.max_bytes
        if over:
            self._stats["over_bound"] += 1
            if nbytes > self.max_bytes and not self._warned_oversize:
                self._warned_oversize = True
                logger.warning(
                    "%s: a %s tensor of %d bytes is larger than the host buffer pool (%d "
                    "bytes): it gets a one-off buffer, and its step waits until it has been "
                    "copied out (warned once)",
                    self.owner,
                    tuple(src.shape),
                    nbytes,
                    self.max_bytes,
                )
        if self._pin is None:
            self._pin = bool(torch.cuda.is_available())
        raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        self._stats["allocated"] += 1
        typed = raw.view(src.dtype).view(src.shape)
        return _Slot(key, typed, _host_view(raw, view_dtype, src.shape), nbytes)

    def _evict(self, limit: int) -> None:
        """Drop free buffers, those of the oldest keys first, until at most ``limit`` bytes
        are held (or none is free).  Called with the lock held."""
        free = self._free
        while self._held > limit and free:
            key = next(iter(free))
            slots = free[key]
            if slots:
                self._held -= slots.pop().nbytes
            if not slots:
                del free[key]

    def _give_back(self, copy: HostCopy, slot: _Slot, event: Any) -> None:
        """``copy`` is done with ``slot``: keep it for reuse (or free it, while the pool is
        over its bound); one whose copy the device has not finished waits for it first."""
        with self._lock:
            self._outstanding.pop(copy, None)
            if event is not None and not event.query():
                self._parked.append((slot, event))
                return
            self._keep(slot)

    def _keep(self, slot: _Slot) -> None:
        """Called with the lock held."""
        if self._held > self.max_bytes:
            self._held -= slot.nbytes
        else:
            self._free.setdefault(slot.key, []).append(slot)

    def _reclaim(self) -> None:
        """Buffers released early whose copies the device has finished: back to the pool."""
        with self._lock:
            parked, self._parked = self._parked, []
            for slot, event in parked:
                if event.query():
                    self._keep(slot)
                else:
                    self._parked.append((slot, event))

    def next_step(self) -> None:
        """A step's values are handed to ``AfterStep``: the copies of earlier steps go to the
        copy-out thread (in a batch, every ``copy_out_interval`` seconds or once they hold a
        quarter of the pool), which resolves them so that their buffers come back; this
        step's copies reach the subscribers unresolved.  Without a copy-out thread
        (``copy_out_interval=None``), the copies of earlier steps whose device work is done
        are resolved here (a host memcpy each, no wait)."""
        step = self._step
        self._step = step + 1
        if self._parked:
            self._reclaim()
        if self.copy_out_interval is not None:
            finished = self._this_step
            if finished:
                self._this_step = []
                if self._finished:
                    self._finished += finished
                else:
                    self._finished = finished
                for copy in finished:
                    self._finished_bytes += copy.nbytes
            if self._finished:
                now = time.perf_counter()
                if (
                    now - self._last_handover >= self.copy_out_interval
                    or self._finished_bytes >= self._handover_bytes
                ):
                    self._last_handover = now
                    self._hand_over()
            return
        if not self._outstanding:
            return
        with self._lock:
            older = [c for c in self._outstanding if c._step < step]
        for copy in older:
            if copy.ready():
                copy.resolve()
                self._stats["resolved_on_step"] += 1

    def _hand_over(self) -> None:
        """Send the copies of finished steps to the copy-out thread (started the first time);
        after :meth:`close`, resolve the ready ones here instead."""
        batch, self._finished, self._finished_bytes = self._finished, [], 0
        if self._closed:
            for copy in batch:
                if copy._slot is not None and copy.ready():
                    copy.resolve()
            return
        if self._to_thread is None:
            self._to_thread = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._copy_out,
                args=(self._to_thread,),
                name=f"recis_async copy-out ({self.owner})",
                daemon=True,
            )
            self._thread.start()
        self._to_thread.put(batch)

    def _copy_out(self, batches: queue.SimpleQueue[list[HostCopy] | None]) -> None:
        """The copy-out thread: resolve every copy handed over (waiting for the device where
        its copy is not done), until :meth:`close`.  A copy released meanwhile is skipped; one
        that fails (a device error) is left to whoever resolves it, who gets the error."""
        while True:
            batch = batches.get()
            if batch is None:
                return
            for copy in batch:
                if copy._result is not None or copy._slot is None:
                    continue  # resolved by a consumer already, or released
                try:
                    copy.resolve()
                except Exception:  # released meanwhile, or the device failed
                    logger.debug("%s: a copy was not copied out here", self.owner, exc_info=True)
                    continue
                self._copied_out += 1
            del batch

    def close(self) -> None:
        """Hand the copies of finished steps over a last time and wait, at most
        ``wait_timeout`` seconds, for the copy-out thread to resolve them and end: no thread
        of the pool outlives its bus (one still waiting for a device is named in a warning).
        Later steps resolve their copies on the step.  Idempotent; the bus calls it when it
        closes."""
        if self._closed:
            return
        self._finished += self._this_step
        self._this_step = []
        if self._finished:
            self._hand_over()
        self._closed = True
        if self._to_thread is not None and self._thread is not None:
            self._to_thread.put(None)
            self._thread.join(self.wait_timeout)
            if self._thread.is_alive():
                logger.warning(
                    "%s: the copy-out thread is still waiting for the device after %ss; "
                    "left to end on its own",
                    self.owner,
                    self.wait_timeout,
                )

    @property
    def busy(self) -> bool:
        """Whether any copy holds a buffer or waits to be handed over (else :meth:`next_step`
        has nothing to do)."""
        return bool(self._outstanding or self._this_step or self._finished or self._parked)

    @property
    def full(self) -> bool:
        """Whether the buffers held exceed the bound (the step should :meth:`make_room`)."""
        return self._held > self.max_bytes

    @property
    def held_bytes(self) -> int:
        return self._held

    async def make_room(self, stopping: anyio.Event | None = None) -> None:
        """Back-pressure: wait until the pool is within its bound, resolving the oldest copies
        as the device finishes them (polled; nothing blocks the event loop).  Gives way when
        ``stopping`` is set (the run is ending: one step over the bound is left).

        Raises:
            TimeoutError: still over the bound after ``wait_timeout`` seconds (the device
                has not finished copies queued that long ago).
        """
        if not self.full:
            return
        self._stats["backpressure_waits"] += 1
        start = time.perf_counter()
        deadline = anyio.current_time() + self.wait_timeout
        try:
            while self._free_some():
                if stopping is not None and stopping.is_set():
                    return
                if anyio.current_time() >= deadline:
                    raise self._timeout()
                await anyio.sleep(_POLL_S)
        finally:
            self._wait_s += time.perf_counter() - start

    def make_room_blocking(self) -> None:
        """:meth:`make_room` for a loop without an event loop: waits on the device's events
        in this thread.  Raises ``TimeoutError`` after ``wait_timeout`` seconds."""
        if not self.full:
            return
        self._stats["backpressure_waits"] += 1
        start = time.perf_counter()
        try:
            while self._free_some():
                if time.perf_counter() - start >= self.wait_timeout:
                    raise self._timeout()
                time.sleep(_POLL_S)
        finally:
            self._wait_s += time.perf_counter() - start

    def _free_some(self) -> bool:
        """Resolve every ready copy, oldest first, while over the bound; whether the pool is
        still over it (waiting on the device)."""
        self._reclaim()
        while True:
            with self._lock:
                self._evict(self.max_bytes)
                if self._held <= self.max_bytes:
                    return False
                oldest = [c for c in self._outstanding if c.ready()]
                waiting = bool(self._outstanding or self._parked)
            if not oldest:
                return waiting
            for copy in oldest:
                copy.resolve()
                if self._held <= self.max_bytes:
                    return False

    def _timeout(self) -> TimeoutError:
        return TimeoutError(
            f"{self.owner}: the host buffer pool holds {self._held} bytes, over its bound of "
            f"{self.max_bytes}, and the device has not finished the copies filling it after "
            f"{self.wait_timeout:g}s"
        )

    def stats(self) -> dict[str, Any]:
        """Bytes held and in use, copies made, buffers reused and allocated, steps that went
        over the bound, and the time steps waited for room."""
        with self._lock:
            in_use = sum(c._slot.nbytes for c in self._outstanding if c._slot)
        return {
            "max_bytes": self.max_bytes,
            "held_bytes": self._held,
            "in_use_bytes": in_use,
            "pinned": bool(self._pin),
            "copies": self.copies,
            "reused": self._reused,
            "copied_out_off_step": self._copied_out,
            **self._stats,
            "backpressure_wait_s": self._wait_s,
        }

    def __repr__(self) -> str:
        return f"<HostBufferPool {self._held}/{self.max_bytes} bytes held, pinned={self._pin}>"


def _host_view(raw: torch.Tensor, dtype: np.dtype[Any], shape: Any) -> np.ndarray:
    """A numpy view of a host buffer, made once when it is allocated.  DLPack shares the
    memory without reading it (a pinned buffer is a CUDA-host DLPack device); ``numpy()``
    if this numpy cannot take that."""
    try:
        flat = np.from_dlpack(raw)
    except (RuntimeError, TypeError, ValueError, BufferError):
        flat = raw.numpy()
    return flat.view(dtype).reshape(shape)
