"""HashTableFilterHook: periodic eviction of stale ids from dynamic embedding tables.

The hook keeps each table's filter clock on the training step (training ``BeforeStep`` and
``AfterStep``; eval steps leave it alone) and, every ``filter_interval`` training steps, hands
an eviction request to a background service.  The service scans each table in a worker
thread (:meth:`HashTable.scan_eviction` copies the filter stamps in short locked chunks) and
applies the result there too (:meth:`HashTable.apply_eviction` removes rows under the table's
lock in short chunks, re-checking each), so the step is never held by the scan and a lookup
never races the removal.  At most one request waits while another runs; a request arriving
when one is already waiting is skipped and counted, since the next one covers it.

There is no global registry of tables: pass them (``tables=``) or a model containing them
(``model=``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import anyio
from torch import nn

from ..bus import HookBus
from ..events import AfterStep, BeforeStep
from ..hook import Hook
from ..jobs import JobQueue
from ..nn.hashtable import HashTable

__all__ = ["HashTableFilterHook"]

logger = logging.getLogger(__name__)


def _check_interval(value: object, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError(f"{field}: expected an int >= 1 or None (never filter), got {value!r}")


def _filtered_tables(
    tables: Iterable[HashTable] | None, model: nn.Module | None
) -> list[HashTable]:
    found: list[HashTable] = []
    if tables is not None:
        if isinstance(tables, (nn.Module, str, bytes)) or not isinstance(tables, Iterable):
            raise ValueError(
                f"HashTableFilterHook.tables: expected an iterable of HashTable, "
                f"got {type(tables).__name__}"
            )
        for i, table in enumerate(tables):
            if not isinstance(table, HashTable):
                raise ValueError(
                    f"HashTableFilterHook.tables[{i}]: expected a HashTable, "
                    f"got {type(table).__name__}"
                )
            if table.filter is None:
                raise ValueError(
                    f"HashTableFilterHook.tables[{i}]: table {table.name!r} has no filter_hook, "
                    "so there is nothing to evict"
                )
            found.append(table)
    if model is not None:
        if not isinstance(model, nn.Module):
            raise ValueError(
                f"HashTableFilterHook.model: expected a torch.nn.Module, got {type(model).__name__}"
            )
        in_model = [m for m in model.modules() if isinstance(m, HashTable) and m.filter is not None]
        if not in_model:
            raise ValueError(
                f"HashTableFilterHook.model: expected a module containing HashTables with a "
                f"filter_hook, found none in {type(model).__name__}"
            )
        found.extend(in_model)
    unique: dict[int, HashTable] = {id(t): t for t in found}
    return list(unique.values())


class _EvictionService(JobQueue[int]):
    """Runs eviction requests one at a time (a :class:`~recis_async.jobs.JobQueue` that skips
    a request when one already waits): scan and apply in a worker thread per table."""

    def __init__(self, name: str, tables: list[HashTable]) -> None:
        super().__init__(name, self._evict, capacity=1, overflow="skip")
        self._tables = tables
        self._tally: dict[str, Any] = {
            "requests": 0,
            "evictions": 0,
            "evicted": 0,
            "last_step": None,
            "last_evicted": 0,
            "scan_s_max": 0.0,
            "hold_s_max": 0.0,
            "lookup_wait_s_max": 0.0,
        }
        self._by_table: dict[str, int] = {}
        for table in tables:
            self._by_table[self._label(table)] = 0

    def _label(self, table: HashTable) -> str:
        same = [t for t in self._tables if t.name == table.name]
        return table.name if len(same) == 1 else f"{table.name}#{same.index(table)}"

    def request(self, step: int) -> bool:
        """Queue an eviction at ``step``; False (counted as skipped) when one already waits."""
        if self.closing:
            return False
        if not self.put_nowait(step):
            logger.debug(
                "%s: eviction at step %d skipped, the previous one is still running",
                self.name,
                step,
            )
            return False
        self._tally["requests"] += 1
        return True

    async def _evict(self, step: int) -> None:
        if self.closing:
            return  # a request still queued at close: eviction only saves memory
        total = 0
        by_table: list[str] = []
        started = time.perf_counter()
        for table in self._tables:
            plan = await anyio.to_thread.run_sync(table.scan_eviction, step)
            evicted = await anyio.to_thread.run_sync(table.apply_eviction, plan)
            table_stats = table.eviction_stats()
            last = table_stats["last"]
            total += evicted
            self._by_table[self._label(table)] += evicted
            self._tally["scan_s_max"] = max(self._tally["scan_s_max"], plan.scan_s)
            self._tally["hold_s_max"] = max(self._tally["hold_s_max"], last.get("hold_max_s", 0.0))
            self._tally["lookup_wait_s_max"] = max(
                self._tally["lookup_wait_s_max"], table_stats["lookup_wait_max_s"]
            )
            if evicted:
                by_table.append(f"{table.name} {evicted}")
            logger.debug(
                "%s: step %d evicted %d of %d candidate ids from %r (%d ids left)",
                self.name,
                step,
                evicted,
                plan.candidates,
                table.name,
                table.ids_count(),
            )
        self._tally["evictions"] += 1
        self._tally["evicted"] += total
        self._tally["last_step"] = step
        self._tally["last_evicted"] = total
        if total:
            logger.info(
                "%s: step %d evicted %d ids (%s), %d ids left",
                self.name,
                step,
                total,
                ", ".join(by_table),
                sum(t.ids_count() for t in self._tables),
            )
        logger.debug(
            "%s: eviction at step %d took %.3fs", self.name, step, time.perf_counter() - started
        )

    async def aclose(self, deadline: float) -> None:
        # Stop intake; a queued request is dropped (eviction only saves memory, and the
        # process is ending), the running one finishes: its worker threads cannot be
        # interrupted and each lock hold is short.
        try:
            await super().aclose(deadline)
        except TimeoutError as exc:
            logger.warning("%s", exc)  # nothing is lost: the tables just keep the stale ids
        counts = {**self._tally, "skipped": super().stats()["skipped"]}
        if counts["evictions"] or counts["skipped"]:
            evicted = ", ".join(f"{name} {n}" for name, n in self._by_table.items())
            logger.info(
                "%s: %d evictions removed %d ids (%s); %d requests skipped while one ran",
                self.name,
                counts["evictions"],
                counts["evicted"],
                evicted,
                counts["skipped"],
            )

    def stats(self) -> Mapping[str, Any]:
        queue = super().stats()
        return {
            **self._tally,
            "skipped": queue["skipped"],
            "pending": queue["queued"] + queue["running"],
            "tables": len(self._tables),
            "evicted_by_table": dict(self._by_table),
            "ids_by_table": {self._label(t): t.ids_count() for t in self._tables},
        }


class HashTableFilterHook(Hook):
    """Evict ids that a table's filter policy marks stale, every ``filter_interval`` steps.

    Args:
        filter_interval: training steps between evictions; ``None`` never evicts (the
            clocks still advance).  The first training ``AfterStep`` seen is the anchor:
            with steps 0, 1, 2, ... and ``filter_interval=10`` evictions run at steps 10,
            20, ...; each uses that step as ``global_step`` in the policy's rule.
        tables: the :class:`~recis_async.nn.HashTable` objects to filter (each with a
            ``filter_hook``).
        model: a module whose ``HashTable`` submodules with a ``filter_hook`` are filtered.
        name: the service name in ``bus.stats()["services"]`` and the hook's ``state_key``.

    Logged at INFO: each eviction that removed ids (one line for all tables) and a summary
    when the bus closes; evictions that removed nothing, per-table counts and skipped requests
    at DEBUG.  Every count is in ``bus.stats()["services"][name]``.

    Raises:
        TypeError: ``tables`` or ``model`` of the wrong type.
        ValueError: neither or both of ``tables``/``model``, a table without a ``filter_hook``,
            a ``filter_interval`` that is not a positive int or ``None``.
    """

    def __init__(
        self,
        filter_interval: int | None = 100,
        *,
        tables: Iterable[HashTable] | None = None,
        model: nn.Module | None = None,
        name: str = "HashTableFilterHook",
    ) -> None:
        self.filter_interval = _check_interval(
            filter_interval, "HashTableFilterHook.filter_interval"
        )
        if not isinstance(name, str) or not name:
            raise ValueError(f"HashTableFilterHook.name: expected a non-empty str, got {name!r}")
        self._tables = _filtered_tables(tables, model)
        if not self._tables:
            raise ValueError(
                "HashTableFilterHook: expected tables=[...] or model=... naming the hash tables "
                "to filter, got neither (there is no global table registry)"
            )
        self._name = name
        self._service: _EvictionService | None = None
        self.last_filter_step: int | None = None
        logger.debug(
            "%s: filtering %s every %s steps",
            name,
            [t.name for t in self._tables],
            filter_interval,
        )

    @property
    def tables(self) -> tuple[HashTable, ...]:
        return tuple(self._tables)

    @property
    def state_key(self) -> str:
        """``name``: two filter hooks on one bus need distinct names."""
        return self._name

    def reset_filter_interval(self, interval: int | None = 100) -> None:
        """Change the number of training steps between evictions."""
        self.filter_interval = _check_interval(interval, "reset_filter_interval(interval)")

    def attach(self, bus: HookBus) -> None:
        self._service = _EvictionService(self._name, self._tables)
        bus.start_service(self._service)

    async def wait_idle(self) -> None:
        """Wait until every eviction requested so far has been applied."""
        if self._service is not None:
            await self._service.wait_idle()

    def before_step(self, event: BeforeStep) -> None:
        if event.is_train:
            for table in self._tables:
                table.advance(event.global_step)

    def after_step(self, event: AfterStep) -> None:
        if not event.is_train:
            return
        step = event.global_step
        for table in self._tables:
            table.advance(step)
        if self.last_filter_step is None:
            self.last_filter_step = step
        elif (
            self.filter_interval is not None
            and step - self.last_filter_step >= self.filter_interval
        ):
            self.last_filter_step = step
            if self._service is not None:
                self._service.request(step)
            else:  # used without a bus: evict right here, in the caller's thread
                for table in self._tables:
                    table.evict(step)
        for table in self._tables:  # lookups until the next step belong to the next step
            table.advance(step + 1)

    def state_dict(self) -> dict[str, Any]:
        # The tables checkpoint their own ids and stamps (they are model state); the
        # interval is configuration.  Only the eviction anchor is this hook's state.
        return {"last_filter_step": self.last_filter_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        last = state.get("last_filter_step")
        if last is not None and type(last) is not int:
            raise ValueError(f"last_filter_step: expected an int or None, got {last!r}")
        self.last_filter_step = last

    def __repr__(self) -> str:
        return (
            f"<HashTableFilterHook filter_interval={self.filter_interval} "
            f"tables={[t.name for t in self._tables]}>"
        )
