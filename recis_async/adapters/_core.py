"""What the three adapters share: a :class:`~recis_async.syncbus.SyncHookBus` (owned or
given) and the reference order of events, published from a framework's callback points.

A framework's callbacks are plain synchronous calls, so the adapters publish on the
synchronous bus: each ``publish`` returns when the event's subscribers ran, and
``add_metric`` / ``add_to_trace`` / ``add_to_ml_tracker`` work in the user's model code
between two callbacks.  :class:`Driver` keeps where the run is (is a step open, was
``AfterTrain`` published for this epoch) so that each adapter is only the mapping from its
framework's callback points to the driver's methods.

``AfterData``, ``AfterBackward`` and the optimizer-step pair, which the bus itself does not act
on, are built and published only when something subscribes to them (as the ``Trainer``
publishes them): a hook that subscribes receives them in the reference order.  While no hook
receives any event from inside a training step (``BeforeStep`` either), an adapter leaves its
framework's callbacks inside the step unhandled and publishes the step whole at its end
(:meth:`Driver.whole_step`): every callback a framework dispatches costs each of its steps,
published or not.

In a distributed run (a process group of several ranks when the run starts) a stop request
of the bus reaches the framework only as the ranks agreed after a training step
(:mod:`recis_async.agreement`, as the ``Trainer`` does): a rank stopping alone would leave the
others waiting in the next step's gradient collective.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from .. import dist
from .._checks import boolean, positive_number
from ..agreement import CONTINUE, STOP, Agreement
from ..collect import add_metric, current_collector
from ..events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterLoadCheckpoint,
    AfterOptimizerStep,
    AfterStep,
    AfterTrain,
    BeforeEpoch,
    BeforeOptimizerStep,
    BeforeSaveCheckpoint,
    BeforeStep,
    Event,
    OutOfData,
    Start,
)
from ..hook import Hook
from ..syncbus import SyncHookBus

__all__ = ["Adapter", "Driver", "plain_metrics"]

logger = logging.getLogger("recis_async.adapters")

#: Seconds a rank waits for the others in the stop agreement of a distributed run before it
#: names itself and fails (as ``TrainingArguments.collective_timeout``'s default).
COLLECTIVE_TIMEOUT = 300.0


def _place(step: BeforeStep) -> dict[str, Any]:
    """The open step's place, as every step event takes it (``AfterBackward(**_place(step))``)."""
    return {
        "is_train": step.is_train,
        "global_step": step.global_step,
        "local_step": step.local_step,
        "epoch": step.epoch,
    }


class Driver:
    """Publishes the lifecycle events for one adapter, on a bus it owns or was given.

    With ``bus=None`` the driver opens a :class:`SyncHookBus` (``flush_timeout``,
    ``handle_signals``) when the framework's run starts, adds ``hooks``, and closes it when
    the run ends or fails (``End`` once, every service drained).  With a bus, the hooks are
    added to it and the bus is left open: its owner's ``with`` block closes it.
    """

    def __init__(
        self,
        owner: str,
        hooks: Sequence[Hook] | None,
        bus: SyncHookBus | None,
        flush_timeout: float,
        handle_signals: bool,
    ) -> None:
        self.owner = owner
        if hooks is None:
            hooks = ()
        if isinstance(hooks, Hook) or not isinstance(hooks, Sequence):
            raise TypeError(f"{owner}(hooks=...): expected a sequence of Hook, got {hooks!r:.80}")
        for i, hook in enumerate(hooks):
            if not isinstance(hook, Hook):
                raise TypeError(f"{owner}(hooks[{i}]=...): expected a Hook, got {hook!r:.80}")
        if bus is not None and not isinstance(bus, SyncHookBus):
            raise TypeError(f"{owner}(bus=...): expected a SyncHookBus or None, got {bus!r:.80}")
        self.hooks = list(hooks)
        self.flush_timeout = positive_number(owner, "flush_timeout", flush_timeout)
        self.handle_signals = boolean(owner, "handle_signals", handle_signals)
        self._given = bus
        self.bus: SyncHookBus | None = bus
        self._owned = False  # the bus was opened here and is closed here
        self._entered = False  # the user entered the adapter with ``with``
        # the open step (its BeforeStep was published, its end not yet): that event, which
        # holds its place; and whether a BeforeOptimizerStep was reached in it
        self.step: BeforeStep | None = None
        self._optimized = False
        self._trained_epoch: int | None = None  # AfterTrain was published for this epoch
        # which optional step events have subscribers, asked again only when the bus's
        # subscriptions change (its generation) or the bus does (see _receivers)
        self._generation = -1
        self._wants: dict[type[Event], bool] = dict.fromkeys(
            (BeforeStep, AfterData, AfterBackward, BeforeOptimizerStep, AfterOptimizerStep), False
        )
        self._any_inside = False  # whether any of them has
        # a distributed run's stop agreement over the ranks (see _stop_after), while it runs
        self._agreement: Agreement | None = None

    # ------------------------------------------------------------------ the bus
    def __enter__(self) -> SyncHookBus:
        """Open the bus now (``with adapter:`` around the framework's run), so that it is
        closed -- and what the hooks hold delivered -- even when the run raises in a place
        the framework reports to no callback."""
        if self._entered:
            raise RuntimeError(f"{self.owner}: entered twice")
        self._entered = True
        return self._open_bus()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._entered = False
        self.close(exc)

    def _open_bus(self) -> SyncHookBus:
        self._generation = -1  # another bus (or hooks added below): ask it again
        if self.bus is not None:
            if not self._owned:  # given: add the hooks once
                on_bus = self.bus.hooks
                for hook in self.hooks:
                    if not any(h is hook for h in on_bus):
                        self.bus.add_hook(hook)
            return self.bus
        bus = SyncHookBus(flush_timeout=self.flush_timeout, handle_signals=self.handle_signals)
        bus.__enter__()
        self.bus, self._owned = bus, True
        try:
            for hook in self.hooks:
                bus.add_hook(hook)
        except BaseException as exc:
            self.close(exc)
            raise
        return bus

    def start(self, is_train: bool = True) -> SyncHookBus:
        """The framework's run starts: open the bus (unless open) and publish ``Start``."""
        bus = self._open_bus()
        self.step = None
        self._trained_epoch = None
        bus.publish(Start(is_train=is_train))
        if is_train and self._agreement is None and dist.is_initialized():
            if dist.get_world_size() > 1:  # every rank starts its run here: a collective
                self._agreement = Agreement(dist.control_group(), COLLECTIVE_TIMEOUT)
        return bus

    def close(self, exc: BaseException | None = None) -> None:
        """The run ended (``exc``: how it failed): close the bus if this driver opened it;
        idempotent.  Leaving the bus after a stop signal raises ``SystemExit(128 + signal)``
        here, as ``with SyncHookBus()`` does."""
        self._end_agreement()
        bus = self.bus
        if bus is None or not self._owned or self._entered:
            return
        self.bus, self._owned = self._given, False
        self._generation = -1
        if exc is None:
            bus.__exit__(None, None, None)
        else:
            bus.__exit__(type(exc), exc, exc.__traceback__)

    def fail(self, exc: BaseException) -> None:
        """The framework reports that the run failed with ``exc``: close the owned bus with it
        (``Error`` then ``End(status="failed")``; its close errors are logged, the run's own
        exception is what the framework raises).  A ``SystemExit`` of status 0 after the bus's
        stop signal is the framework quitting on that signal: the bus closes as preempted and
        the exit carries the signal's status."""
        self._end_agreement()
        bus = self.bus
        if bus is None or not self._owned or self._entered:
            return
        if isinstance(exc, SystemExit) and not exc.code and bus._bus._signals.signum is not None:
            # The framework quit on the stop signal the bus handled, with an exit status of 0
            # (Lightning raises its SIGTERMException, a bare SystemExit, at the step boundary
            # after a SIGTERM): the run was preempted, not failed -- End("preempted"), and the
            # process exits with the signal's status (128 + signal) as any preempted run
            # does, not 0, which a scheduler would read as a finished job.
            try:
                self.close()  # raises what leaving the bus raises after a signal
            except SystemExit as exit_:
                exc.code = exit_.code
            except KeyboardInterrupt:  # the bus's SIGINT in an interactive session: the
                pass  # framework's own exit ends the cell all the same
            return
        try:
            self.close(exc)
        except BaseException as close_exc:  # the run's exception matters more
            if close_exc is not exc:
                logger.error("%s: closing the bus after %r failed: %s", self.owner, exc, close_exc)

    def _end_agreement(self) -> None:
        """The run ended: release the stop agreement's process group, unless a collective of
        it is still in flight (a rank that failed or stopped apart from the others): that
        one is left to ``destroy_process_group()``."""
        agreement, self._agreement = self._agreement, None
        if agreement is not None and agreement.settled():
            dist.release_group(agreement.group)

    def _stop_after(self, bus: SyncHookBus, is_train: bool, global_step: int) -> bool:
        """Whether the framework should stop after this step.  Alone, what the bus says.  In
        a distributed run, what the ranks agreed (:mod:`recis_async.agreement`): after each
        training step every rank offers whether its bus stops and reads what all offered
        after the previous one, so a stop requested on some ranks (a hook, a signal reaching
        them between different steps) stops every rank after the next step, and one that
        every rank requested at once stops them all at once.  A rank stopping alone would
        leave the others waiting in the next step's gradient collective.  An evaluation step
        does not stop the run there: the request stays, for the next training step."""
        agreement = self._agreement
        if agreement is None:
            return bus.should_stop
        if not is_train:
            return False
        if agreement.pending and bus._call(agreement.result).value != CONTINUE:
            return True  # what every rank offered after the last step: all stop here
        offer = STOP if bus.should_stop else CONTINUE
        agreement.start(offer, global_step)
        if offer == STOP and bus._call(agreement.peek).low == STOP:
            bus._call(agreement.result)  # every rank offered it now: none needs the lag
            return True
        return False

    def _receivers(self, bus: SyncHookBus) -> None:
        """Ask ``bus`` which optional step events have subscribers, when its subscriptions
        changed since it was last asked (a hook added during the run receives them from the
        next callback on): asking at every callback cost each ask ~1k instructions, a step
        several."""
        generation = bus._bus._generation
        if generation == self._generation:
            return
        self._generation = generation
        self._wants = {kind: bus.has_subscribers(kind) for kind in self._wants}
        self._any_inside = True in self._wants.values()

    def inside(self) -> Mapping[type[Event], bool]:
        """Which events from inside a step (``BeforeStep``, ``AfterData``, ``AfterBackward``,
        the optimizer-step pair) a hook receives now; none without a bus.  The same object
        until the bus's subscriptions change, so an adapter asking at each step's end
        compares it with ``is`` and re-routes its framework's callbacks only on a change:
        a callback inside the step is followed only while a hook receives what it publishes
        (a training step nobody watches from inside is published by :meth:`whole_step`)."""
        bus = self.bus
        if bus is None:
            return dict.fromkeys(self._wants, False)
        if bus._bus._generation != self._generation:  # _receivers' test, without its call
            self._receivers(bus)
        return self._wants

    def follows(self) -> bool:
        """Whether a hook receives any event from inside a step now (see :meth:`inside`): an
        adapter begins a training step at its framework's first callback only then, and
        otherwise publishes it with :meth:`whole_step` at its end."""
        bus = self.bus
        if bus is None:
            return False
        if bus._bus._generation != self._generation:
            self._receivers(bus)
        return self._any_inside

    def receives(self, kind: type[Event]) -> bool:
        """Whether the open step's optional ``kind`` event (``BeforeStep``, ``AfterData``,
        ``AfterBackward``, the optimizer-step pair) would reach a subscriber now: an adapter
        skips working out what only that event carries (Lightning's accumulation state)."""
        bus = self.bus
        if self.step is None or bus is None:
            return False
        self._receivers(bus)
        return self._wants[kind]

    @property
    def should_stop(self) -> bool:
        bus = self.bus
        return bus is not None and bus.should_stop

    # ------------------------------------------------------------------ one step
    def begin_step(
        self, is_train: bool, global_step: int, local_step: int, epoch: int, *, data: bool = True
    ) -> None:
        """``BeforeStep`` (and ``AfterData`` when the batch is already there: frameworks call
        back after the batch was fetched)."""
        bus = self.bus
        if bus is None:
            return
        if self.step is not None:  # the framework skipped the end of the last one
            self.out_of_data()
        self.step = step = BeforeStep(
            is_train=is_train, global_step=global_step, local_step=local_step, epoch=epoch
        )
        self._optimized = False
        self._receivers(bus)
        # as the Trainer: a publish nobody receives is not made, unless the bus has something
        # to raise or deliver at this step boundary
        if self._wants[BeforeStep] or not bus._begin_step(is_train):
            bus.publish(step)
        if data:
            self.after_data()

    # The step events the bus does not act on (AfterData, AfterBackward, the optimizer-step
    # pair) are built and published only when something subscribes to them, as the Trainer
    # does: frameworks call back for them on every step, and a publish nobody receives costs
    # the step the bus's whole publish all the same (~12k instructions each).  Whether
    # anyone subscribes is asked again whenever the bus's subscriptions changed
    # (_receivers), so a hook added during the run receives them from its next callback on.
    def after_data(self) -> None:
        step, bus = self.step, self.bus
        if step is None or bus is None:
            return
        self._receivers(bus)
        if self._wants[AfterData]:
            bus.publish(
                AfterData(
                    is_train=step.is_train,
                    global_step=step.global_step,
                    local_step=step.local_step,
                    epoch=step.epoch,
                )
            )

    def after_backward(self, sync: bool) -> None:
        step, bus = self.step, self.bus
        if step is None or bus is None:
            return
        self._receivers(bus)
        if self._wants[AfterBackward]:
            bus.publish(AfterBackward(**_place(step), sync=sync))

    def before_optimizer_step(self, optimizers: tuple[Any, ...], scaler: Any = None) -> None:
        step, bus = self.step, self.bus
        if step is not None and bus is not None:
            self._optimized = True  # AfterOptimizerStep follows, whoever receives this one
            self._receivers(bus)
            if self._wants[BeforeOptimizerStep]:
                bus.publish(
                    BeforeOptimizerStep(**_place(step), optimizers=optimizers, scaler=scaler)
                )

    def after_optimizer_step(self, optimizers: tuple[Any, ...], scaler: Any = None) -> None:
        step, bus = self.step, self.bus
        if step is not None and bus is not None and self._optimized:
            self._optimized = False
            self._receivers(bus)
            if self._wants[AfterOptimizerStep]:
                bus.publish(
                    AfterOptimizerStep(**_place(step), optimizers=optimizers, scaler=scaler)
                )

    def end_step(
        self,
        samples: int,
        loss: Any = None,
        metrics: Mapping[str, Any] | None = None,
        optimizers: tuple[Any, ...] = (),
    ) -> bool:
        """``AfterStep`` of the open step, with ``loss`` (a tensor stays a tensor: the bus
        keeps it on its device) and the framework's ``metrics`` added as metrics (a name the
        step's code already added keeps that value).  Returns whether the bus should stop,
        for the adapter to tell its framework."""
        step, bus = self.step, self.bus
        if step is None or bus is None:
            return self.should_stop
        self.step = None
        if self._optimized:  # frameworks without a callback after the optimizer step
            self._optimized = False
            self._receivers(bus)
            if self._wants[AfterOptimizerStep]:
                bus.publish(AfterOptimizerStep(**_place(step), optimizers=optimizers))
        return self._after_step(
            bus,
            step.is_train,
            step.global_step,
            step.local_step,
            step.epoch,
            samples,
            loss,
            metrics,
        )

    def whole_step(
        self,
        is_train: bool,
        global_step: int,
        local_step: int,
        epoch: int,
        samples: int,
        loss: Any = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> bool:
        """A step the adapter sees only at its end (its callbacks inside the step are not
        followed while no hook receives an event from there, see :meth:`inside`; an Ignite
        run without data has none): its ``AfterStep``, as :meth:`end_step` publishes it,
        after a ``BeforeStep`` if a hook receives one now.  What the bus does for a
        ``BeforeStep`` nobody receives is done all the same: a service's failure is raised
        before the framework runs another step (here, after the step's ``AfterStep``), a stop
        signal is delivered by ``AfterStep``, and values of evaluation steps are kept apart
        (they are always begun by a callback, and :meth:`after_eval` returns the bus to
        training steps)."""
        bus = self.bus
        if bus is None:
            return False
        if bus._bus._generation != self._generation:
            self._receivers(bus)
        if self._wants[BeforeStep]:
            self.begin_step(is_train, global_step, local_step, epoch, data=False)
            return self.end_step(samples, loss, metrics)
        stop = self._after_step(
            bus, is_train, global_step, local_step, epoch, samples, loss, metrics
        )
        failures = bus._bus._failures
        if failures:  # a service failed in the publish: raised before another step runs, as
            raise failures.pop(0)  # the next step's BeforeStep would raise it
        return stop

    def _after_step(
        self,
        bus: SyncHookBus,
        is_train: bool,
        global_step: int,
        local_step: int,
        epoch: int,
        samples: int,
        loss: Any,
        metrics: Mapping[str, Any] | None,
    ) -> bool:
        if loss is not None:
            add_metric("loss", loss)
        if metrics and (len(metrics) > 1 or "loss" not in metrics):  # not the loss alone
            extra = {
                name: value
                for name, value in metrics.items()
                if name != "loss" and isinstance(name, str) and name
            }
            if extra:
                _add_metrics(extra)
        bus.publish(
            AfterStep(
                is_train=is_train,
                global_step=global_step,
                local_step=local_step,
                epoch=epoch,
                samples=samples,
            )
        )
        if self._agreement is None:
            return bus.should_stop
        return self._stop_after(bus, is_train, global_step)

    def out_of_data(self) -> None:
        """The open step has no batch (the data ran out after ``BeforeStep``)."""
        step, bus = self.step, self.bus
        self.step = None
        if step is not None and bus is not None:
            bus.publish(OutOfData(**_place(step)))

    # ------------------------------------------------------------------ epochs, evaluation
    def before_epoch(self, epoch: int) -> None:
        if self.bus is not None:
            self.bus.publish(BeforeEpoch(is_train=True, epoch=epoch))

    def after_train(self, global_step: int, epoch: int) -> None:
        """``AfterTrain`` once per epoch (frameworks evaluating at an epoch's end call back
        for the evaluation before the epoch's end)."""
        if self.step is not None and self.step.is_train:
            self.out_of_data()
        if self.bus is not None and self._trained_epoch != epoch:
            self._trained_epoch = epoch
            self.bus.publish(AfterTrain(is_train=True, global_step=global_step, epoch=epoch))

    def after_epoch(self, epoch: int, global_step: int) -> None:
        self.after_train(global_step, epoch)
        if self.bus is not None:
            self.bus.publish(AfterEpoch(is_train=True, epoch=epoch, global_step=global_step))

    def after_eval(self, global_step: int, steps: int, metrics: Mapping[str, Any]) -> None:
        """``AfterEval`` with the framework's evaluation metrics, read as numbers here (once
        per evaluation, not on a step)."""
        if self.step is not None and not self.step.is_train:
            self.out_of_data()
        bus = self.bus
        if bus is not None:
            bus.publish(
                AfterEval(global_step=global_step, steps=steps, metrics=plain_metrics(metrics))
            )
            # training resumes: what is collected from here on belongs to training steps,
            # which may begin with no callback (whole_step); what evaluation left is dropped
            bus._begin_step(True)

    # ------------------------------------------------------------------ checkpoints
    def hook_states(self, global_step: int, path: str = "") -> dict[str, Any]:
        """``BeforeSaveCheckpoint``, then every hook's ``state_dict()`` by ``state_key``."""
        bus = self.bus
        if bus is None:
            return {}
        bus.publish(BeforeSaveCheckpoint(global_step=global_step, path=path))
        states: dict[str, Any] = {}
        for hook in bus.hooks:
            try:
                states[hook.state_key] = hook.state_dict()
            except Exception as exc:
                raise RuntimeError(f"{hook!r}.state_dict() failed: {exc}") from exc
        return states

    def load_hook_states(self, states: Mapping[str, Any], global_step: int, path: str) -> None:
        """Give each hook its state from a checkpoint, then publish ``AfterLoadCheckpoint``
        (as :func:`~recis_async.checkpoint.restore_checkpoint` does for this library's own
        checkpoints)."""
        bus = self.bus
        if bus is None:
            raise RuntimeError(f"{self.owner}: hook states to restore, but no bus is open")
        if not isinstance(states, Mapping):
            raise TypeError(
                f"{self.owner}: expected the hook states of a checkpoint as a dict, got "
                f"{type(states).__name__}"
            )
        on_bus = {hook.state_key: hook for hook in bus.hooks}
        for key, state in states.items():
            hook = on_bus.get(key)
            if hook is None:
                if state:
                    logger.warning("%s holds state for %r: no such hook on the bus", path, key)
                continue
            hook.load_state_dict(copy.deepcopy(state))
        bus.publish(
            AfterLoadCheckpoint(global_step=global_step, path=path, hook_states=dict(states))
        )


def _add_metrics(values: Mapping[str, Any]) -> None:
    """Add a framework's logged values; one that ``add_metric`` refuses is skipped (logged
    at DEBUG): the framework accepted it, and a step is not the place to fail over it."""
    taken = current_collector("add_metric").metrics
    for name, value in values.items():
        if name in taken:
            continue
        try:
            add_metric(name, value)
        except (TypeError, ValueError) as exc:
            logger.debug("not a metric: %s=%r (%s)", name, value, exc)


def plain_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """Numbers of a framework's evaluation metrics (one-element tensors read here, once per
    evaluation); values of other kinds are left out."""
    out: dict[str, Any] = {}
    torch = sys.modules.get("torch")
    for name, value in metrics.items():
        if not isinstance(name, str):
            continue
        if torch is not None and isinstance(value, torch.Tensor):
            if value.numel() != 1:
                continue
            value = value.detach().reshape(()).item()
        if isinstance(value, bool):
            value = int(value)
        if isinstance(value, int | float):
            out[name] = value
    return out


class Adapter:
    """What every adapter shows the same way: its bus, and ``with adapter:`` to open the bus
    now and close it when the block ends (then a failure the framework reports to no callback
    still drains the hooks)."""

    _driver: Driver

    @property
    def bus(self) -> SyncHookBus | None:
        """The bus events are published on (``None`` outside a run, with no bus given)."""
        return self._driver.bus

    def __enter__(self) -> SyncHookBus:
        return self._driver.__enter__()

    def __exit__(self, *exc_info: Any) -> None:
        self._driver.__exit__(*exc_info)
