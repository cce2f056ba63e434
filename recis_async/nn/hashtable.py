"""HashTable: an embedding table keyed by arbitrary int64 ids, trained by torch optimizers.

Rows live in one growable ``nn.Parameter`` (``weight``, shape ``[capacity, dim]``); a
vectorised :class:`~recis_async.nn.slot_map.SlotMap` maps ids to rows.  A training lookup
gives every unseen id a row (filled by the initializer) unless the admission policy refuses
it; eval lookups never insert and never stamp the filter.  Unknown ids read as zeros.

Eviction is split so the slow part stays off the training step: :meth:`HashTable.scan_eviction`
copies the filter's stamps in short locked chunks and decides on the copy (safe in a worker
thread), :meth:`HashTable.apply_eviction` re-checks each chosen row under the lock, in short
chunks, and frees it.  A row looked up after the scan is never evicted by it.

Devices: the id map, the free list and the filter's stamps stay on the host (ids come from
the loader there; evictions never touch the rows), the rows follow the module:
``table.to("cuda")`` moves ``weight``, its gradient and the row state of every attached
optimizer.  Each lookup's slots go to the rows' device in one non-blocking copy from pinned
memory (:mod:`recis_async.nn._device`); new rows are initialised there; gradients (dense or
sparse) are accumulated there, so the optimizer step runs there too.  Nothing on the step reads
a value from the device.  Ids given on a device are copied to the host first, which waits for
the device: keep them on the host (``Trainer(keep_on_host=...)``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from . import _memory
from ._device import host_to
from ._host import any_set
from .autograd import gather_rows
from .free_slots import FreeSlots
from .policy import AdmitPolicy, FilterPolicy
from .policy_spec import AdmitHook, FilterHook
from .registry import DEFAULT_POLICIES, PolicyRegistry
from .slot_map import new_slot_map

__all__ = ["HashTable", "EvictionPlan", "Initializer", "attach_optimizer"]

logger = logging.getLogger(__name__)

#: Fills a fresh ``[n, *embedding_shape]`` tensor in place (``torch.nn.init.normal_``, ...)
#: or returns the rows to use.
Initializer = Callable[[torch.Tensor], Any]

_SNAPSHOT_CHUNK = 1 << 17  # slots copied per lock hold while scanning
_APPLY_CHUNK = 1 << 13  # slots removed per lock hold while applying
_MIN_CAPACITY = 16


class _Taken(NamedTuple):
    reused: torch.Tensor  # evicted slots handed out again
    start: int  # first fresh slot
    fresh: int  # number of fresh slots


@dataclass(frozen=True, eq=False)
class EvictionPlan:
    """Rows chosen for eviction by :meth:`HashTable.scan_eviction` (immutable)."""

    table: str
    now: int
    slots: torch.Tensor
    generation: int
    scan_s: float
    hold_max_s: float

    @property
    def candidates(self) -> int:
        return int(self.slots.numel())


def _shape(embedding_shape: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(embedding_shape, int) and not isinstance(embedding_shape, bool):
        dims: tuple[Any, ...] = (embedding_shape,)
    elif isinstance(embedding_shape, Sequence) and not isinstance(embedding_shape, str | bytes):
        dims = tuple(embedding_shape)
    else:
        dims = ()
    if not dims or any(type(d) is not int or d <= 0 for d in dims):
        raise ValueError(
            f"HashTable(embedding_shape=...): expected a positive int or a non-empty sequence of "
            f"positive ints, got {type(embedding_shape).__name__} {embedding_shape!r:.60}"
        )
    return dims


def _physical_memory() -> int | None:
    """Bytes of RAM of this machine, when the platform tells."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _check_fits(what: str, rows: int, dim: int, dtype: torch.dtype) -> None:
    """Refuse, before allocating, rows that could never fit in this machine's memory: a
    huge allocation fails with torch's raw message or, worse, gets the process killed."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    need = rows * dim * itemsize
    total = _physical_memory()
    if total is not None and need > total:
        raise ValueError(
            f"{what}: {rows} rows of {dim} {str(dtype).removeprefix('torch.')} values would "
            f"take {_fmt_bytes(need)}, more than this machine's {_fmt_bytes(total)} of memory"
        )


class HashTable(nn.Module):
    """Embedding rows for any int64 id, created on first training lookup.

    Args:
        embedding_shape: shape of one row (``64`` or ``[64]``, or e.g. ``[4, 16]``).
        dtype: floating dtype of the rows.
        initializer: fills new rows; default zeros.
        admit_hook: admission policy (``AdmitHook("ReadOnly")``); default admits all.
        filter_hook: eviction policy (``FilterHook("GlobalStepFilter", {"filter_step": N})``).
        name: used in logs and stats.
        policies: the registry resolving hook names (see :mod:`recis_async.nn.registry`).
        sparse: produce sparse COO gradients (for ``torch.optim.SparseAdam``, ``Adagrad``,
            ``SGD``) instead of dense ones.
        capacity: initial number of row slots (the table grows by half when full).

    Optimizers that keep per-parameter state (Adam, SGD with momentum) must be told about
    the table with :meth:`attach_optimizer` so that growth pads their state and a reused
    row starts from zero state.

    Raises:
        ValueError: an argument of the wrong type or value (a non-floating ``dtype``, a
            non-callable ``initializer``, an empty ``name``, a ``capacity`` below 1), a policy
            the registry does not know.
    """

    def __init__(
        self,
        embedding_shape: int | Sequence[int],
        dtype: torch.dtype = torch.float32,
        initializer: Initializer | None = None,
        admit_hook: AdmitHook | None = None,
        filter_hook: FilterHook | None = None,
        *,
        name: str = "hashtable",
        policies: PolicyRegistry = DEFAULT_POLICIES,
        sparse: bool = False,
        capacity: int = 1024,
    ) -> None:
        super().__init__()
        self.embedding_shape = _shape(embedding_shape)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(
                f"HashTable(dtype=...): expected a floating torch.dtype, got {dtype!r}"
            )
        if initializer is not None and not callable(initializer):
            kind = type(initializer).__name__
            raise ValueError(f"HashTable(initializer=...): expected a callable or None, got {kind}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"HashTable(name=...): expected a non-empty str, got {name!r}")
        if not isinstance(policies, PolicyRegistry):
            raise ValueError(
                f"HashTable(policies=...): expected a PolicyRegistry, got {type(policies).__name__}"
            )
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"HashTable(capacity=...): expected an int >= 1, got {capacity!r}")
        if type(sparse) is not bool:
            raise ValueError(f"HashTable(sparse=...): expected a bool, got {sparse!r}")
        self.name = name
        self.sparse = sparse
        self._dim = math.prod(self.embedding_shape)
        self._initializer = initializer
        self._policies = policies
        self.admit_hook = admit_hook
        self.filter_hook = filter_hook
        self._admit: AdmitPolicy | None = (
            policies.admit_policy(admit_hook) if admit_hook is not None else None
        )
        self._filter: FilterPolicy | None = (
            policies.filter_policy(filter_hook) if filter_hook is not None else None
        )
        self._admit_cache: dict[AdmitHook, AdmitPolicy] = {}
        _check_fits(
            f"HashTable(embedding_shape={embedding_shape!r:.40}, capacity={capacity})",
            capacity,
            self._dim,
            dtype,
        )
        self.weight = nn.Parameter(torch.zeros(capacity, self._dim, dtype=dtype))
        if initializer is not None:
            self._initial_rows(1)  # a broken initializer fails here, not mid-training
        self._map = new_slot_map()
        self._rows = _memory.RowSpace()  # grows weight and row state mostly without copying
        self._free = FreeSlots()
        self._next = 0  # slots below this were handed out at least once
        self._generation = 0  # bumped by load_state_dict: plans from before are void
        self._evicted_total = 0
        self._last_eviction: dict[str, Any] = {}
        self._lookup_wait_max_s = 0.0
        self._warned_device_ids = False
        self._lock = threading.Lock()
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        if self._filter is not None:
            self._filter.resize(capacity)

    # ------------------------------------------------------------------ introspection
    @property
    def capacity(self) -> int:
        return int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        """Where the rows are (follows ``table.to(...)``); the id map stays on the host."""
        return self.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of the rows (follows ``table.double()`` and friends)."""
        return self.weight.dtype

    @property
    def policies(self) -> PolicyRegistry:
        return self._policies

    @property
    def filter(self) -> FilterPolicy | None:
        """This table's own filter policy object (``None`` without a ``filter_hook``)."""
        return self._filter

    @property
    def step(self) -> int | None:
        """The filter clock (``None`` without a filter)."""
        return None if self._filter is None else self._filter.step

    def ids_count(self) -> int:
        """Number of ids holding a row."""
        return len(self._map)

    def memory_bytes(self) -> int:
        """Bytes of the table's own tensors: rows, id map, free list, filter state.

        Gradients and optimizer state are not counted.
        """
        with self._lock:
            extra = self._filter.nbytes if self._filter is not None else 0
            return self.weight.nbytes + self._map.nbytes + self._free.nbytes + extra

    def ids(self) -> torch.Tensor:
        """All ids holding a row, sorted."""
        with self._lock:
            ids, _ = self._map.items()
        return ids.sort().values

    def contains(self, ids: torch.Tensor) -> torch.Tensor:
        """Boolean mask: which ``ids`` hold a row (no insertion, no stamping)."""
        flat = self._check_ids(ids).reshape(-1)
        with self._lock:
            return (self._map.find(flat) >= 0).reshape(ids.shape)

    def extra_repr(self) -> str:
        parts = [f"name={self.name!r}", f"embedding_shape={list(self.embedding_shape)}"]
        parts.append(f"ids={len(self._map)}, capacity={self.capacity}")
        if self.admit_hook is not None:
            parts.append(f"admit_hook={self.admit_hook}")
        if self.filter_hook is not None:
            parts.append(f"filter_hook={self.filter_hook}")
        return ", ".join(parts)

    # ------------------------------------------------------------------ lookups
    def forward(self, ids: torch.Tensor, admit_hook: AdmitHook | None = None) -> torch.Tensor:
        """Rows of ``ids`` (any shape): output shape ``[*ids.shape, *embedding_shape]``.

        In training mode unseen ids are inserted (unless the admission policy refuses) and
        every looked-up id is stamped by the filter; in eval mode nothing changes.  Ids
        without a row read as zeros.  ``admit_hook`` overrides the table's admission policy
        for this call.
        """
        flat = self._check_ids(ids).reshape(-1)
        slots, known = self.lookup_slots(flat, admit_hook)
        device = self.weight.device
        if known is None:
            (on_device,) = host_to(device, slots)
            rows = gather_rows(self.weight, on_device, self)
        else:
            rows = torch.zeros(flat.numel(), self._dim, dtype=self.dtype, device=device)
            hit = known.nonzero().squeeze(1)
            if hit.numel():
                hit_d, slots_d = host_to(device, hit, slots[hit])
                rows = rows.index_put((hit_d,), gather_rows(self.weight, slots_d, self))
        return rows.reshape(*ids.shape, *self.embedding_shape)

    def _check_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise ValueError(f"ids: expected an int64 torch.Tensor, got {type(ids).__name__}")
        if ids.is_meta or ids.layout != torch.strided:
            raise ValueError(
                f"HashTable {self.name!r}: ids: expected a dense tensor holding ids, got one "
                f"on {ids.device} with layout {ids.layout}"
            )
        if ids.device.type != "cpu":
            ids = self._ids_to_host(ids)
        if ids.dtype == torch.int64:
            return ids
        if ids.dtype in (torch.int32, torch.int16, torch.int8, torch.uint8):
            return ids.to(torch.int64)
        raise ValueError(f"ids: expected an integer tensor (int64), got dtype {ids.dtype}")

    def _ids_to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """The id map is on the host: ids on a device are read back, which waits for it."""
        if not self._warned_device_ids:
            self._warned_device_ids = True
            logger.warning(
                "HashTable %r: ids arrived on %s; the id map is on the host, so each lookup "
                "copies them back and waits for the device. Keep ids on the host "
                "(Trainer(keep_on_host=[...]))",
                self.name,
                ids.device,
            )
        return ids.cpu()

    def _admit_policy(self, admit_hook: AdmitHook | None) -> AdmitPolicy | None:
        if admit_hook is None:
            return self._admit
        policy = self._admit_cache.get(admit_hook)
        if policy is None:
            policy = self._admit_cache[admit_hook] = self._policies.admit_policy(admit_hook)
        return policy

    def lookup_slots(
        self, ids: torch.Tensor, admit_hook: AdmitHook | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row slots of ``ids`` (1-D int64), inserting and stamping as :meth:`forward` does.

        Returns ``(slots, known)``: ``known`` is ``None`` when every id has a row, else a
        boolean mask (``slots`` is -1 where it is False).
        """
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise ValueError(
                f"ids: expected a 1-D int64 tensor, got {ids.dtype} of shape {tuple(ids.shape)}"
            )
        train = self.training
        admit = self._admit_policy(admit_hook) if train else None
        self._acquire_for_lookup()
        try:
            if train and admit is None:  # insert everything unseen, in one probing pass
                taken: list[_Taken] = []
                try:
                    slots = self._map.find_or_insert(ids, lambda k: self._take(k, taken))
                finally:
                    for new in taken:
                        self._fill_new(new)
                if self._filter is not None:
                    self._filter.touch(slots)
                return slots, None
            slots = self._map.find(ids)
            miss = slots < 0
            missing = any_set(miss)
            if train and missing:
                assert admit is not None
                slots = self._insert_admitted(ids, slots, miss, admit)
                miss = slots < 0
                missing = any_set(miss)
            if train and self._filter is not None:
                self._filter.touch(slots[~miss] if missing else slots)
        finally:
            self._lock.release()
        return slots, (~miss if missing else None)

    def _acquire_for_lookup(self) -> None:
        """Take the lock, recording how long a lookup had to wait (behind an eviction chunk,
        say) when it was taken."""
        if self._lock.acquire(blocking=False):
            return
        started = time.perf_counter()
        self._lock.acquire()
        waited = time.perf_counter() - started
        if waited > self._lookup_wait_max_s:
            self._lookup_wait_max_s = waited

    def _insert_admitted(
        self, ids: torch.Tensor, slots: torch.Tensor, miss: torch.Tensor, admit: AdmitPolicy
    ) -> torch.Tensor:
        where = miss.nonzero().squeeze(1)
        new_ids, inverse = torch.unique(ids[where], return_inverse=True)
        ok = admit.admit(new_ids)
        if not isinstance(ok, torch.Tensor) or ok.dtype != torch.bool or ok.shape != new_ids.shape:
            raise ValueError(
                f"{type(admit).__name__}.admit: expected a bool mask of shape "
                f"{tuple(new_ids.shape)}, got {ok!r:.80}"
            )
        chosen = ok.nonzero().squeeze(1)
        if chosen.numel() == 0:
            return slots
        new_slots = torch.full_like(new_ids, -1)
        record: list[_Taken] = []
        taken = self._take(int(chosen.numel()), record)
        try:
            self._map.insert(new_ids[chosen], taken)
        except BaseException:
            self._free.push(taken)  # not handed out after all
            raise
        self._fill_new(record[0])
        new_slots[chosen] = taken
        slots = slots.clone()
        slots[where] = new_slots[inverse]
        return slots

    def _take(self, k: int, taken: list[_Taken]) -> torch.Tensor:
        """``k`` slots for new ids: evicted rows first, then fresh ones (recorded in
        ``taken`` for :meth:`_fill_new`)."""
        reused = self._free.pop(k)
        fresh = k - int(reused.numel())
        if self._next + fresh > self.capacity:
            self._grow(self._next + fresh)
        start = self._next
        self._next += fresh
        taken.append(_Taken(reused, start, fresh))
        return torch.cat([reused, torch.arange(start, start + fresh)])

    def _fill_new(self, taken: _Taken) -> None:
        """Initialise the new rows and clear their gradient and optimizer state.

        Fresh rows are one contiguous range, written as a slice (sequential memory).
        """
        reused, start, fresh = taken
        r = int(reused.numel())
        if r + fresh == 0:
            return
        rows = self._initial_rows(r + fresh)
        if r:
            (reused,) = host_to(self.weight.device, reused)
        targets = [self.weight.data]
        grad = self.weight.grad
        if grad is not None and not grad.is_sparse:
            targets.append(grad)
        for state in self._optimizer_states():
            targets.extend(v for v in state.values() if self._is_row_state(v))
        # index_copy_/index_fill_ and slice copy_/zero_ take the value as a kernel argument;
        # ``target[idx] = 0`` would first copy a host scalar to the device, which waits for it
        for i, target in enumerate(targets):
            if r:
                if i == 0:
                    target.index_copy_(0, reused, rows[:r])
                else:
                    target.index_fill_(0, reused, 0)
            if fresh:
                if i == 0:
                    target[start : start + fresh].copy_(rows[r:])
                else:
                    target[start : start + fresh].zero_()

    def _initial_rows(self, k: int) -> torch.Tensor:
        device = self.weight.device
        rows = torch.zeros((k, *self.embedding_shape), dtype=self.dtype, device=device)
        if self._initializer is not None:
            out = self._initializer(rows)
            if isinstance(out, torch.Tensor):
                if out.shape != rows.shape:
                    raise ValueError(
                        f"HashTable.initializer: expected it to fill or return a tensor of "
                        f"shape {tuple(rows.shape)}, it returned shape {tuple(out.shape)}"
                    )
                rows = (out if out.device == device else out.to(device)).to(self.dtype)
        return rows.reshape(k, self._dim)

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(old, _MIN_CAPACITY)
        while new < need:
            new = new * 3 // 2
        if self.weight.device.type == "cpu":  # a device's allocator says so itself
            _check_fits(
                f"HashTable {self.name!r} growing to hold {need} ids", new, self._dim, self.dtype
            )
        self.weight.data = self._padded(self.weight.data, new)
        grad = self.weight.grad
        if grad is not None:
            if grad.is_sparse:
                self.weight.grad = torch.sparse_coo_tensor(
                    grad._indices(), grad._values(), (new, self._dim)
                )
            else:
                self.weight.grad = self._padded(grad, new)
        for state in self._optimizer_states():
            for key, value in list(state.items()):
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() >= 1
                    and value.shape[0] == old
                    and value.shape[1:] == (self._dim,)
                    and not value.is_sparse
                ):
                    state[key] = self._padded(value, new)
        if self._filter is not None:
            self._filter.resize(new)

    def _padded(self, t: torch.Tensor, rows: int) -> torch.Tensor:
        return self._rows.grown(t, rows)

    def _is_row_state(self, value: object) -> bool:
        return (
            isinstance(value, torch.Tensor)
            and not value.is_sparse
            and value.shape == self.weight.shape
        )

    def _optimizer_states(self) -> list[dict[str, Any]]:
        states = []
        for opt in list(self._optimizers):
            state = opt.state.get(self.weight)
            if state:
                states.append(state)
        return states

    def accumulate_grad(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Add ``rows`` to the gradient of ``weight`` at ``slots`` (called by backward)."""
        rows = rows.reshape(-1, self._dim).to(self.dtype)
        with self._lock:
            w = self.weight
            if self.sparse:
                g = torch.sparse_coo_tensor(
                    slots.unsqueeze(0), rows, w.shape, check_invariants=False
                )
                w.grad = g if w.grad is None else w.grad + g
                return
            if w.grad is None:
                w.grad = _memory.zeros(tuple(w.shape), w.dtype, w.device)
            w.grad.index_add_(0, slots, rows)

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> HashTable:
        """``Module._apply`` (``.to()``, ``.cuda()``, ``.double()``...) plus the per-row state
        of the attached optimizers, which a module move would leave behind."""
        before = (self.weight.device, self.weight.dtype)
        super()._apply(fn, recurse)
        if (self.weight.device, self.weight.dtype) != before:
            with self._lock:
                for state in self._optimizer_states():
                    for key, value in list(state.items()):
                        if self._is_row_state(value):
                            state[key] = fn(value)
        return self

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep ``optimizer``'s per-row state in step with the table (held weakly); it also
        follows the table to another device or dtype (``table.to(...)``)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        self._optimizers.add(optimizer)

    # ------------------------------------------------------------------ filtering
    def advance(self, global_step: int) -> None:
        """Set the filter clock: later training lookups stamp ``global_step``."""
        if type(global_step) is not int or global_step < 0:
            raise ValueError(
                f"HashTable.advance(global_step=...): expected an int >= 0, got {global_step!r}"
            )
        if self._filter is not None:
            with self._lock:
                self._filter.advance(global_step)

    def scan_eviction(self, now: int | None = None) -> EvictionPlan:
        """Choose the rows to evict at step ``now`` (default: the filter clock).

        Thread-safe and meant for a worker thread: the filter state is copied in chunks of
        at most ``2**17`` slots per lock hold, the decision runs without the lock.
        """
        if now is not None and (type(now) is not int or now < 0):
            raise ValueError(
                f"HashTable.scan_eviction(now=...): expected an int >= 0 or None, got {now!r}"
            )
        started = time.perf_counter()
        hold = 0.0
        with self._lock:
            generation = self._generation
            stop = self._next
            if now is None:
                now = self._filter.step if self._filter is not None else 0
        found: list[torch.Tensor] = []
        policy = self._filter
        if policy is not None:
            for start in range(0, stop, _SNAPSHOT_CHUNK):
                end = min(stop, start + _SNAPSHOT_CHUNK)
                with self._lock:
                    t0 = time.perf_counter()
                    if self._generation != generation:
                        found.clear()
                        break
                    snap = policy.snapshot(start, end)
                    hold = max(hold, time.perf_counter() - t0)
                hit = policy.expired(snap, now).nonzero().squeeze(1)
                if hit.numel():
                    found.append(hit + start)
                time.sleep(0)  # let a waiting lookup take the lock first
        slots = torch.cat(found) if found else torch.empty(0, dtype=torch.int64)
        return EvictionPlan(self.name, now, slots, generation, time.perf_counter() - started, hold)

    def apply_eviction(self, plan: EvictionPlan) -> int:
        """Evict the rows of ``plan`` that are still expired; returns how many.

        Thread-safe; holds the lock for at most ``2**13`` rows at a time.  A plan made
        before a ``load_state_dict`` is ignored.
        """
        if not isinstance(plan, EvictionPlan) or plan.table != self.name:
            raise ValueError(
                f"plan: expected an EvictionPlan of table {self.name!r}, got {plan!r:.80}"
            )
        policy = self._filter
        evicted = 0
        hold = plan.hold_max_s
        if policy is not None:
            for start in range(0, plan.candidates, _APPLY_CHUNK):
                with self._lock:
                    t0 = time.perf_counter()
                    if self._generation != plan.generation:
                        break
                    chunk = plan.slots[start : start + _APPLY_CHUNK]
                    chunk = chunk[policy.still_expired(chunk, plan.now)]
                    if chunk.numel():
                        self._map.remove(chunk)
                        policy.release(chunk)
                        self._free.push(chunk)
                        evicted += int(chunk.numel())
                    hold = max(hold, time.perf_counter() - t0)
                time.sleep(0)
        with self._lock:
            self._evicted_total += evicted
            self._last_eviction = {
                "now": plan.now,
                "candidates": plan.candidates,
                "evicted": evicted,
                "scan_s": plan.scan_s,
                "hold_max_s": hold,
            }
        return evicted

    def evict(self, now: int | None = None) -> int:
        """Scan and apply in the calling thread; returns the number of evicted ids."""
        return self.apply_eviction(self.scan_eviction(now))

    def eviction_stats(self) -> dict[str, Any]:
        """``evicted_total``, ``ids``, the last eviction's figures (``hold_max_s``: longest
        wall time inside the lock in one chunk), and ``lookup_wait_max_s``: the longest a
        lookup has waited for the lock so far."""
        with self._lock:
            return {
                "evicted_total": self._evicted_total,
                "ids": len(self._map),
                "lookup_wait_max_s": self._lookup_wait_max_s,
                "last": dict(self._last_eviction),
            }

    # ------------------------------------------------------------------ state
    def _state_names(self) -> list[str]:
        names = ["weight", "ids", "slots"]
        if self._filter is not None:
            names += [f"filter_{k}" for k in self._filter.state_keys]
        return names

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        with self._lock:
            ids, slots = self._map.items()
            destination[prefix + "weight"] = self.weight if keep_vars else self.weight.detach()
            destination[prefix + "ids"] = ids
            destination[prefix + "slots"] = slots
            if self._filter is not None:
                for key, value in self._filter.state(slots).items():
                    destination[prefix + f"filter_{key}"] = value

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        names = self._state_names()
        got: dict[str, torch.Tensor] = {}
        for name in names:
            if prefix + name in state_dict:
                got[name] = state_dict[prefix + name]
            else:
                missing_keys.append(prefix + name)
        if strict:
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in names
            )
        if len(got) != len(names):
            return
        try:
            weight, ids, slots = self._checked_state(got)
        except ValueError as exc:
            error_msgs.append(f"{prefix or 'HashTable.'}: {exc}")
            return
        with self._lock:
            cap = int(weight.shape[0])
            if self.weight.grad is not None:
                self.weight.grad = None
            self.weight.data = weight.detach().to(
                device=self.weight.device, dtype=self.dtype, copy=True
            )
            self._map = new_slot_map(4 * int(ids.numel()))
            self._map.insert(ids, slots)
            live = torch.zeros(cap, dtype=torch.bool)
            live[slots] = True
            self._free = FreeSlots()
            self._free.push((~live).nonzero().squeeze(1))
            self._next = cap
            self._generation += 1
            if self._filter is not None:
                self._filter.resize(0)
                self._filter.resize(cap)
                try:
                    self._filter.load_state(
                        slots,
                        {k[len("filter_") :]: v for k, v in got.items() if k.startswith("filter_")},
                    )
                except ValueError as exc:
                    error_msgs.append(f"{prefix or 'HashTable.'}: {exc}")

    def _checked_state(
        self, got: Mapping[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weight, ids, slots = got["weight"], got["ids"], got["slots"]
        for key, value in got.items():
            if not isinstance(value, torch.Tensor):
                raise ValueError(f"{key}: expected a tensor, got {type(value).__name__}")
        if weight.dim() != 2 or weight.shape[1] != self._dim or not weight.is_floating_point():
            raise ValueError(
                f"weight: expected a floating tensor of shape [capacity, {self._dim}], "
                f"got {weight.dtype} {tuple(weight.shape)}"
            )
        for key, value in (("ids", ids), ("slots", slots)):
            if value.dtype != torch.int64 or value.dim() != 1:
                raise ValueError(
                    f"{key}: expected a 1-D int64 tensor, got {value.dtype} {tuple(value.shape)}"
                )
        if ids.numel() != slots.numel():
            raise ValueError(
                f"ids/slots: expected equal lengths, got {ids.numel()} and {slots.numel()}"
            )
        if slots.numel():
            if int(slots.min()) < 0 or int(slots.max()) >= weight.shape[0]:
                raise ValueError(
                    f"slots: expected values in [0, {weight.shape[0]}), got out-of-range slots"
                )
            if torch.unique(slots).numel() != slots.numel():
                raise ValueError("slots: expected distinct values, got duplicates")
            if torch.unique(ids).numel() != ids.numel():
                raise ValueError("ids: expected distinct values, got duplicates")
        return weight, ids, slots

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state["_optimizers"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._lock = threading.Lock()
        self._optimizers = weakref.WeakSet()


def attach_optimizer(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Attach ``optimizer`` to every :class:`HashTable` inside ``module``; returns how many."""
    tables = [m for m in module.modules() if isinstance(m, HashTable)]
    for table in tables:
        table.attach_optimizer(optimizer)
    return len(tables)
