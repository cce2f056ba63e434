"""The hooks of this library in an Ignite job: ``attach(engine, hooks)``.

::

    from recis_async.adapters.ignite import attach

    trainer = ignite.engine.Engine(update)           # update(engine, batch) -> the loss tensor
    adapter = attach(trainer, [LoggerHook(), ...])
    trainer.run(loader, max_epochs=3)

The engine's events, and what each publishes (reference order):

=========================  ===================================================================
``STARTED``                the bus opens (unless one was given); ``Start``; hook states loaded
                           with :meth:`IgniteAdapter.load_state_dict` are given to the hooks
                           (``AfterLoadCheckpoint``)
``EPOCH_STARTED``          ``BeforeEpoch``
``GET_BATCH_STARTED``      ``BeforeStep`` (the wait for data follows); handled only while a
                           hook receives an event from inside the step
``GET_BATCH_COMPLETED``    ``AfterData`` (handled only while a hook subscribes to it)
``ITERATION_COMPLETED``    ``AfterStep``; a stop request of the bus calls ``engine.terminate()``
``EPOCH_COMPLETED``        ``AfterTrain`` (unless an attached evaluator published it), then
                           ``AfterEpoch`` (an epoch that ran out of data after ``BeforeStep``:
                           ``OutOfData`` first)
``COMPLETED``              the owned bus closes: ``End`` once, services drained
``EXCEPTION_RAISED``       the owned bus closes with the error (``Error``, ``End("failed")``);
                           the exception propagates as without the adapter
=========================  ===================================================================

``AfterStep.metrics``: what the process function returned: a one-element tensor or a number
is ``loss``; a dict gives its ``"loss"`` and its other one-element entries; a tuple or list
its first item as ``loss``.  Return the loss tensor itself (``loss``, not ``loss.item()``,
which waits for the device on every step): the bus keeps it on its device.  ``global_step`` is
the engine's iteration count before the step (0-based), ``epoch`` the engine's epoch - 1.

Checkpoints: Ignite's ``Checkpoint`` saves and loads objects with ``state_dict`` /
``load_state_dict``; put the adapter among them (``to_save={"model": model, "hooks":
adapter}``) and the hooks' states travel with the checkpoint (``BeforeSaveCheckpoint`` is
published when it is taken).  Evaluation runs on an engine of its own:
:meth:`IgniteAdapter.attach_evaluator` publishes its steps and ``AfterEval``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from ignite.engine import Engine, Events

from ..events import AfterData, Event
from ..hook import Hook
from ..syncbus import SyncHookBus
from ..trainer import batch_size
from ._core import Adapter, Driver

__all__ = ["IgniteAdapter", "attach"]


def attach(
    engine: Engine,
    hooks: Sequence[Hook] | None = None,
    *,
    bus: SyncHookBus | None = None,
    flush_timeout: float = 60.0,
    handle_signals: bool = True,
) -> IgniteAdapter:
    """Publish this library's events from ``engine``'s events so that ``hooks`` run in its
    job; returns the adapter (its ``bus``, its state for Ignite's ``Checkpoint``).

    Args:
        engine: the training engine.
        hooks: the hooks to add to the bus.
        bus: an open :class:`~recis_async.syncbus.SyncHookBus` to publish on (its ``with``
            block closes it); ``None``: the adapter opens one when the run starts and closes
            it when the run ends or fails.
        flush_timeout: seconds the owned bus may take to drain its services when it closes.
        handle_signals: the owned bus turns SIGINT/SIGTERM into a stop at the next step
            (``engine.terminate()``), closes, and the process exits with ``128 + signal``.

    Raises:
        TypeError: ``engine`` not an Ignite ``Engine``, ``hooks`` not a sequence of
            :class:`~recis_async.Hook`, ``bus`` not a ``SyncHookBus``.
        ValueError: ``flush_timeout`` not a positive number.
    """
    if not isinstance(engine, Engine):
        raise TypeError(f"attach(engine=...): expected an ignite Engine, got {engine!r:.80}")
    adapter = IgniteAdapter(engine, hooks, bus, flush_timeout, handle_signals)
    adapter._attach()
    return adapter


class IgniteAdapter(Adapter):
    """What :func:`attach` returns: the adapter of one training engine."""

    def __init__(
        self,
        engine: Engine,
        hooks: Sequence[Hook] | None,
        bus: SyncHookBus | None,
        flush_timeout: float,
        handle_signals: bool,
    ) -> None:
        self.engine = engine
        self._driver = Driver("attach", hooks, bus, flush_timeout, handle_signals)
        self._to_load: Mapping[str, Any] | None = None  # hook states waiting for STARTED
        self._handles: list[Any] = []
        # the GET_BATCH handlers, there while a hook receives what they publish (_follow)
        self._followed: Mapping[type[Event], bool] | None = None
        self._batch_handles: dict[Any, Any] = {}  # by Ignite event
        self._eval_steps = 0

    def _attach(self) -> None:
        engine = self.engine
        for event, handler in (
            (Events.STARTED, self._started),
            (Events.EPOCH_STARTED, self._epoch_started),
            (Events.ITERATION_COMPLETED, self._iteration_completed),
            (Events.EPOCH_COMPLETED, self._epoch_completed),
            (Events.TERMINATE, self._terminated),
            (Events.COMPLETED, self._completed),
            (Events.EXCEPTION_RAISED, self._failed),
        ):
            self._handles.append(engine.add_event_handler(event, handler))

    def detach(self) -> None:
        """Remove the adapter's handlers from the engine (and from attached evaluators)."""
        for handle in [*self._handles, *self._batch_handles.values()]:
            handle.remove()
        self._handles.clear()
        self._batch_handles.clear()
        self._followed = None

    # ------------------------------------------------------------------ training
    def _started(self, engine: Engine) -> None:
        self._driver.start(is_train=True)
        states, self._to_load = self._to_load, None
        if states is not None:
            self._driver.load_hook_states(states, engine.state.iteration, "")
        self._follow(engine)

    def _epoch_started(self, engine: Engine) -> None:
        self._driver.before_epoch(engine.state.epoch - 1)

    def _follow(self, engine: Engine) -> None:
        """Handle ``GET_BATCH_STARTED`` / ``GET_BATCH_COMPLETED`` only while a hook receives
        an event from inside the step / ``AfterData``: every handler costs each of Ignite's
        steps its dispatch and call (~4k instructions) even when it publishes nothing, and
        without them ``ITERATION_COMPLETED`` publishes the step whole.  Called when the run
        starts and at each step's end, after its ``AfterStep`` (where hooks subscribe): a
        hook subscribing during the run receives them from the next step on."""
        wants = self._driver.inside()
        if wants is self._followed:
            return
        self._followed = wants
        handles = self._batch_handles
        for event, handler, wanted in (
            (Events.GET_BATCH_STARTED, self._batch_started, any(wants.values())),
            (Events.GET_BATCH_COMPLETED, self._batch_completed, wants[AfterData]),
        ):
            if wanted and event not in handles:
                handles[event] = engine.add_event_handler(event, handler)
            elif not wanted and event in handles:
                handles.pop(event).remove()

    def _batch_started(self, engine: Engine) -> None:
        state = engine.state
        global_step, local_step, epoch = _place(state, state.iteration)
        self._driver.begin_step(True, global_step, local_step, epoch, data=False)

    def _batch_completed(self, engine: Engine) -> None:
        self._driver.after_data()

    def _iteration_completed(self, engine: Engine) -> None:
        state = engine.state
        output = state.output
        metrics: dict[str, Any] | None = None
        if type(output) is torch.Tensor:  # the common return, the loss tensor: no metrics
            loss = output if output.numel() == 1 else None
        else:
            loss, metrics = _loss_and_metrics(output)
        driver = self._driver
        if driver.step is not None:  # begun at GET_BATCH_STARTED
            stop = driver.end_step(batch_size(state.batch), loss, metrics)
        else:  # not followed (or an engine run without data, which has no GET_BATCH events)
            # _place(state, state.iteration - 1), inlined: every call on the step runs cold
            iteration, length, epoch = state.iteration - 1, state.epoch_length, state.epoch - 1
            local = max(iteration - epoch * length, 0) if length else 0
            stop = driver.whole_step(
                True, iteration, local, epoch, batch_size(state.batch), loss, metrics
            )
        if driver.inside() is not self._followed:  # a hook (un)subscribed: re-route
            self._follow(engine)
        if stop:
            engine.terminate()

    def _epoch_completed(self, engine: Engine) -> None:
        if self._driver.step is not None:
            self._driver.out_of_data()
        self._driver.after_epoch(engine.state.epoch - 1, engine.state.iteration)

    def _terminated(self, engine: Engine) -> None:
        if engine.should_terminate == "skip_completed":  # no COMPLETED follows
            self._completed(engine)

    def _completed(self, engine: Engine) -> None:
        self._driver.close()

    def _failed(self, engine: Engine, exc: BaseException) -> None:
        """Close the owned bus with the run's exception, then let the exception go on as
        Ignite would without the adapter: raised, unless another handler takes it."""
        self._driver.fail(exc)
        others = len(getattr(engine, "_event_handlers", {}).get(Events.EXCEPTION_RAISED, ()))
        if others <= 1:
            raise exc

    # ------------------------------------------------------------------ evaluation
    def attach_evaluator(self, evaluator: Engine) -> None:
        """Publish ``evaluator``'s batches as eval steps (``is_train=False``) and, when it
        completes, ``AfterEval`` with its ``state.metrics`` (at the training engine's step)."""
        if not isinstance(evaluator, Engine):
            raise TypeError(
                f"attach_evaluator(evaluator=...): expected an ignite Engine, got {evaluator!r:.80}"
            )
        for event, handler in (
            (Events.STARTED, self._eval_started),
            (Events.GET_BATCH_STARTED, self._eval_batch_started),
            (Events.ITERATION_COMPLETED, self._eval_iteration_completed),
            (Events.COMPLETED, self._eval_completed),
        ):
            self._handles.append(evaluator.add_event_handler(event, handler))

    def _eval_started(self, evaluator: Engine) -> None:
        self._eval_steps = 0
        state = self.engine.state
        length = state.epoch_length
        if length and state.iteration and state.iteration % length == 0:  # at an epoch's end
            self._driver.after_train(state.iteration, state.epoch - 1)

    def _eval_batch_started(self, evaluator: Engine) -> None:
        state = self.engine.state
        self._driver.begin_step(False, state.iteration, self._eval_steps, max(state.epoch - 1, 0))

    def _eval_iteration_completed(self, evaluator: Engine) -> None:
        if self._driver.step is None or self._driver.step.is_train:
            return
        self._eval_steps += 1
        loss, metrics = _loss_and_metrics(evaluator.state.output)
        self._driver.end_step(batch_size(evaluator.state.batch), loss, metrics)

    def _eval_completed(self, evaluator: Engine) -> None:
        self._driver.after_eval(
            self.engine.state.iteration, self._eval_steps, evaluator.state.metrics
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``BeforeSaveCheckpoint``, then every hook's state (for Ignite's ``Checkpoint``)."""
        if self._driver.bus is None:
            return {}
        step = self.engine.state.iteration
        return {"global_step": step, "hooks": self._driver.hook_states(step)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Hook states from a checkpoint: given to the hooks when the run starts (or now, if
        it runs), then ``AfterLoadCheckpoint``."""
        hooks = state_dict.get("hooks")
        if hooks is None:
            return
        if self._driver.bus is not None and self.engine.state.iteration:
            self._driver.load_hook_states(hooks, self.engine.state.iteration, "")
        else:
            self._to_load = hooks


def _place(state: Any, iteration: int) -> tuple[int, int, int]:
    """``global_step``, ``local_step`` and ``epoch`` of the step that is the engine's
    ``iteration`` (0-based): ``local_step`` counts from the epoch's start when the epoch's
    length is known, else 0."""
    length = state.epoch_length
    local = iteration - (state.epoch - 1) * length if length else 0
    return iteration, max(local, 0), state.epoch - 1


def _loss_and_metrics(output: Any) -> tuple[Any, dict[str, Any]]:
    """The loss and the other one-element values of what a process function returned."""
    if isinstance(output, torch.Tensor):
        return (output if output.numel() == 1 else None), {}
    if isinstance(output, int | float) and not isinstance(output, bool):
        return output, {}
    if isinstance(output, Mapping):
        metrics = {
            name: value
            for name, value in output.items()
            if name != "loss" and isinstance(name, str) and _scalar(value)
        }
        loss = output.get("loss")
        return (loss if _scalar(loss) else None), metrics
    if isinstance(output, tuple | list) and output and _scalar(output[0]):
        return output[0], {}
    return None, {}


def _scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)
