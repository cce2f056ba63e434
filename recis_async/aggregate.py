"""MetricAggregator: the metrics of an evaluation pass, combined per metric and over ranks.

Each ``AfterStep`` of the pass contributes its ``metrics``; a metric is combined as its
``reduce`` says (``add_metric(name, value, reduce=...)``, carried in ``AfterStep.reduce``):

- ``"mean"`` (the default): the mean weighted by ``AfterStep.samples`` (a step published
  without ``samples`` weighs 1), so a short last batch counts for what it holds;
- ``"sum"``, ``"max"``, ``"min"``;
- ``"last"``: the value of the pass's last step carrying the metric (any value, not only
  numbers);
- a callable: given every step's value as a 1-D numpy array (2-D for array metrics), in step
  order, returning the result (``numpy.median``, ``lambda v: numpy.percentile(v, 99)``).

Numbers, numeric arrays and tensors (combined element-wise) are aggregated; any other value (a
string, say) needs ``"last"`` and is otherwise left out, with a warning naming it once per
pass.  A tensor is combined on its device (``window.py``: a kernel per step, no read) and the
pass's result is read once, at its end: :meth:`MetricAggregator.compute_all_ranks` reads in a
worker thread, :meth:`MetricAggregator.compute` where it is called.
In a distributed run :meth:`MetricAggregator.compute_all_ranks` combines every rank's partial
results the same way (means weighted by every rank's samples; callables see the values of
rank 0, then rank 1, ...; ``"last"`` takes the highest rank's), so every rank gets the same
result.
"""

from __future__ import annotations

import functools
import logging
import numbers
from collections.abc import Callable
from typing import Any, Literal, TypeAlias

import anyio.to_thread
import numpy as np
import torch

from . import dist
from .events import AfterStep
from .window import larger, plus, read_value, scaled, smaller

__all__ = ["REDUCTIONS", "MetricAggregator", "Reduction", "check_reduction"]

logger = logging.getLogger(__name__)

REDUCTIONS = ("mean", "sum", "max", "min", "last")
"""The reductions known by name; any callable is accepted too."""

Reduction: TypeAlias = Literal["mean", "sum", "max", "min", "last"] | Callable[[np.ndarray], Any]


def check_reduction(where: str, value: object) -> Reduction:
    """``value`` if it is a known reduction name or a callable, else ``ValueError`` naming
    ``where``."""
    if value in REDUCTIONS or (callable(value) and not isinstance(value, str)):
        return value  # type: ignore[return-value]
    raise ValueError(
        f"{where}: expected one of {', '.join(map(repr, REDUCTIONS))} or a callable, got {value!r}"
    )


def _kind(reduce: Reduction) -> str:
    return reduce if isinstance(reduce, str) else "callable"


def _same(a: Reduction, b: Reduction) -> bool:
    if a is b or a == b:
        return True
    # a lambda written in the loop is a new object each step: the same code is the same reduction
    return callable(a) and callable(b) and getattr(a, "__code__", a) is getattr(b, "__code__", b)


def _numeric(value: Any) -> Any:
    """``value`` as an int (sums of counts stay ints), float, float array or tensor (left on
    its device), or ``None`` when it is not numeric."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, numbers.Integral):  # bool, int, numpy integers
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.number):
        return value.astype(np.float64)
    return None


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return float(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


class _Acc:
    """One metric's running state on this rank."""

    __slots__ = ("count", "reduce", "value", "values", "weight")

    def __init__(self, reduce: Reduction) -> None:
        self.reduce = reduce
        self.count = 0
        self.weight = 0.0  # "mean": the summed weights
        self.value: Any = None  # "mean": weighted sum; "sum"; "max"; "min"; "last"
        self.values: list[Any] = []  # a callable's inputs

    def add(self, name: str, value: Any, weight: float) -> bool:
        """Take one step's value; False when it cannot be aggregated this way."""
        kind = _kind(self.reduce)
        if kind == "last":
            self.value = value
            self.count += 1
            return True
        number = _numeric(value)
        if number is None:
            return False
        try:
            if kind == "callable":
                self.values.append(number)
            elif self.count == 0:
                self.value = scaled(number, weight) if kind == "mean" else number
            elif kind == "mean":
                self.value = plus(self.value, scaled(number, weight))
            elif kind == "sum":
                self.value = plus(self.value, number)
            elif kind == "max":
                self.value = larger(self.value, number)
            else:
                self.value = smaller(self.value, number)
        except (ValueError, RuntimeError) as exc:  # arrays / tensors of different shapes
            raise ValueError(
                f"metric {name!r}: cannot combine {value!r} with the earlier steps: {exc}"
            ) from None
        self.weight += weight
        self.count += 1
        return True

    def read(self) -> None:
        """Bring device values to the host (blocking: the one read of the pass)."""
        self.value = read_value(self.value)
        if any(isinstance(v, torch.Tensor) for v in self.values):
            self.values = [read_value(v) for v in self.values]

    def partial(self) -> tuple[Any, ...]:
        """What this rank contributes to the all-rank result (picklable: no callables), once
        :meth:`read`."""
        return (_kind(self.reduce), self.count, self.weight, self.value, self.values)

    def result(self) -> Any:
        self.read()
        kind = _kind(self.reduce)
        if kind == "mean":
            return _plain(self.value / self.weight)
        if kind == "callable":
            assert callable(self.reduce)
            return _plain(self.reduce(np.asarray(self.values)))
        return _plain(self.value)


class MetricAggregator:
    """Combines the ``metrics`` of evaluation steps into one result per metric.

    The ``Trainer`` runs one per evaluation pass and publishes the result as
    ``AfterEval.metrics`` (and returns it from ``evaluate()``).  In an own loop::

        agg = MetricAggregator()
        with bus.subscribe(AfterStep, agg.update, when=lambda e: not e.is_train):
            ...  # the evaluation steps
        metrics = await agg.compute_all_ranks()
        await bus.publish(AfterEval(global_step=step, steps=agg.steps, metrics=metrics))

    ``update`` raises ``ValueError`` naming the metric when a step asks for another reduction
    than the earlier steps of the pass did.  It never reads a tensor: device values are
    combined on their device and read once, by :meth:`compute_all_ranks` (in a worker thread)
    or :meth:`compute` (where it is called: the end of the pass).
    """

    def __init__(self) -> None:
        self._accs: dict[str, _Acc] = {}
        self._skipped: set[str] = set()
        self.steps = 0
        self.samples = 0

    def reset(self) -> None:
        """Forget everything: a new pass starts."""
        self.__init__()  # type: ignore[misc]

    def update(self, event: AfterStep) -> None:
        """Add one step's metrics (subscribe it to ``AfterStep``)."""
        self.steps += 1
        self.samples += event.samples
        weight = float(event.samples) if event.samples > 0 else 1.0
        reduce_of = event.reduce
        for name, value in event.metrics.items():
            reduce: Reduction = reduce_of.get(name, "mean") if reduce_of else "mean"
            acc = self._accs.get(name)
            if acc is None:
                if reduce != "mean":
                    check_reduction(f"AfterStep.reduce[{name!r}]", reduce)
                acc = self._accs[name] = _Acc(reduce)
            elif not _same(acc.reduce, reduce):
                raise ValueError(
                    f"AfterStep(global_step={event.global_step}).reduce[{name!r}]: expected "
                    f"{acc.reduce!r} as in the earlier steps of this pass, got {reduce!r}"
                )
            if not acc.add(name, value, weight) and name not in self._skipped:
                self._skipped.add(name)
                logger.warning(
                    "metric %r is a %s, not a number or numeric array: left out of the "
                    "evaluation result (pass reduce='last' to keep its last value)",
                    name,
                    type(value).__name__,
                )

    def compute(self) -> dict[str, Any]:
        """The result of the steps seen by this process (reads device values here)."""
        return {name: acc.result() for name, acc in self._accs.items() if acc.count}

    def read(self) -> None:
        """Bring every device value to the host (blocking; :meth:`compute_all_ranks` runs it
        in a worker thread)."""
        for acc in self._accs.values():
            acc.read()

    async def compute_all_ranks(self, *, timeout: float = dist.DEFAULT_TIMEOUT) -> dict[str, Any]:
        """The result over every rank's steps (a collective: every rank must call it); the
        same as :meth:`compute` without a process group of more than one rank.  The exchange
        runs in a worker thread and fails with ``TimeoutError`` naming this rank after
        ``timeout`` seconds."""
        await anyio.to_thread.run_sync(self.read)  # the pass's one wait on the device
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return self.compute()
        mine = {name: acc.partial() for name, acc in self._accs.items() if acc.count}
        gathered = await anyio.to_thread.run_sync(
            functools.partial(
                dist.all_gather_object,
                mine,
                device=dist.collective_device(),  # read here, on the loop's thread
                timeout=timeout,
                what="the evaluation metrics' all-gather",
            )
        )
        return self._combine(gathered)

    def _combine(self, per_rank: list[dict[str, tuple[Any, ...]]]) -> dict[str, Any]:
        names: dict[str, None] = {}
        for partials in per_rank:
            names.update(dict.fromkeys(partials))
        result: dict[str, Any] = {}
        for name in names:
            parts = [(rank, p[name]) for rank, p in enumerate(per_rank) if name in p]
            kinds = {p[0] for _, p in parts}
            if len(kinds) > 1:
                seen = ", ".join(f"rank {rank}: {p[0]!r}" for rank, p in parts)
                raise ValueError(f"metric {name!r}: the ranks reduce it differently ({seen})")
            kind = kinds.pop()
            acc = _Acc(self._accs[name].reduce if name in self._accs else kind)
            if kind == "callable" and name not in self._accs:
                raise ValueError(
                    f"metric {name!r}: reduced by a callable on other ranks but never seen on "
                    f"rank {dist.get_rank()}, which has no callable to apply"
                )
            for _, (_, count, weight, value, values) in parts:
                if kind == "last":
                    acc.value = value
                elif kind == "callable":
                    acc.values.extend(values)
                elif acc.count == 0:
                    acc.value = value
                elif kind in ("mean", "sum"):
                    acc.value = acc.value + value
                elif kind == "max":
                    acc.value = np.maximum(acc.value, value)
                else:
                    acc.value = np.minimum(acc.value, value)
                acc.weight += weight
                acc.count += count
            result[name] = acc.result()
        return result

    def __repr__(self) -> str:
        return f"<MetricAggregator steps={self.steps} metrics={list(self._accs)}>"
