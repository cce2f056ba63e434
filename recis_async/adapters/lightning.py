"""The hooks of this library in a Lightning job: ``Trainer(callbacks=[RecisCallback(hooks)])``.

::

    from recis_async.adapters.lightning import RecisCallback

    trainer = lightning.Trainer(max_epochs=3, callbacks=[RecisCallback([LoggerHook(), ...])])
    trainer.fit(model, loader)

Lightning's callback points, and what each publishes (reference order):

=================================  ===========================================================
``setup``                          the bus opens (unless one was given); ``Start``
``load_state_dict``                hook states restored from Lightning's checkpoint;
                                   ``AfterLoadCheckpoint``
``on_train_epoch_start``           ``BeforeEpoch``
``on_train_batch_start``           ``BeforeStep``, ``AfterData`` (Lightning calls back with
                                   the batch already fetched)
``on_after_backward``              ``AfterBackward`` (``sync``: an optimizer step follows)
``on_before_optimizer_step``       ``BeforeOptimizerStep`` (gradients final, unscaled)
``on_train_batch_end``             ``AfterOptimizerStep``, ``AfterStep``; a stop request of
                                   the bus sets ``trainer.should_stop``
``on_validation_*``                eval steps (``is_train=False``) and ``AfterEval`` with
                                   Lightning's computed metrics; ``AfterTrain`` first when the
                                   validation ends an epoch
``on_train_epoch_end``             ``AfterTrain`` (unless published), ``AfterEpoch``
``state_dict``                     ``BeforeSaveCheckpoint``; every hook's state, saved in
                                   Lightning's checkpoint under this callback's state key
``teardown`` / ``on_exception``    the owned bus closes: ``End`` once, services drained
                                   (Lightning's own quit on a SIGTERM, a ``SystemExit`` of
                                   status 0, after the bus's stop on that signal: closed as
                                   preempted, the exit given status 128 + signal)
=================================  ===========================================================

``AfterStep.metrics``: ``loss`` (the training step's loss tensor, as the training step
returned it: the bus keeps it on its device), the other one-element entries of a dict the
training step returned, and what the step logged with ``self.log(..., on_step=True)``.
``global_step`` counts training batches over the run (Lightning's ``global_step`` counts
optimizer steps: the two are equal without gradient accumulation), ``local_step`` is the
batch index in the epoch, ``epoch`` Lightning's ``current_epoch``.

Lightning calls every callback object at every callback point of a step, each call inside a
profiler context, whether the callback overrides the point or not; it skips an attribute that
is not callable.  So the callback hides from Lightning the points of a training step that
publish nothing now: ``on_before_backward`` and ``on_before_zero_grad`` always;
``on_train_batch_start``, ``on_after_backward`` and ``on_before_optimizer_step`` while no hook
receives what they publish (``on_train_batch_end`` then publishes the step whole).  A hook
subscribing during the run receives them from the next step on.  A subclass's own override of
one of them is always called.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from ..events import AfterBackward, AfterOptimizerStep, BeforeOptimizerStep, Event
from ..hook import Hook
from ..syncbus import SyncHookBus
from ..trainer import batch_size
from ._core import Adapter, Driver

__all__ = ["RecisCallback"]


class RecisCallback(Adapter, pl.Callback):
    """A Lightning callback publishing this library's events, so its hooks run in the job.

    Args:
        hooks: the hooks to add to the bus.
        bus: an open :class:`~recis_async.syncbus.SyncHookBus` to publish on (its ``with``
            block closes it); ``None``: the callback opens one when the run starts and closes
            it when the run ends or fails.
        flush_timeout: seconds the owned bus may take to drain its services when it closes.
        handle_signals: the owned bus turns SIGINT/SIGTERM into a stop at the next step
            (``trainer.should_stop``), closes, and the process exits with ``128 + signal``.

    ``with RecisCallback(...) as bus:`` around ``trainer.fit`` opens the bus at once and
    closes it when the block ends: the hooks are then on the bus before the run, and a
    failure Lightning reports to no callback still drains them.

    Raises:
        TypeError: ``hooks`` not a sequence of :class:`~recis_async.Hook`, ``bus`` not a
            ``SyncHookBus``, ``handle_signals`` not a bool.
        ValueError: ``flush_timeout`` not a positive number.
    """

    def __init__(
        self,
        hooks: Sequence[Hook] | None = None,
        *,
        bus: SyncHookBus | None = None,
        flush_timeout: float = 60.0,
        handle_signals: bool = True,
    ) -> None:
        super().__init__()
        self._driver = Driver("RecisCallback", hooks, bus, flush_timeout, handle_signals)
        self._eval_steps = 0
        self._stage: str | None = None
        self._trainer: pl.Trainer | None = None  # of the stage under way (state_dict has none)
        self._ckpt_path = ""
        self._followed: Mapping[type[Event], bool] | None = None  # see _follow
        for name in ("on_before_backward", "on_before_zero_grad"):  # nothing to publish
            if getattr(type(self), name) is getattr(pl.Callback, name):
                setattr(self, name, None)

    # ------------------------------------------------------------------ run
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._stage is not None:
            return  # a stage inside another (validate within fit's bus)
        self._stage, self._trainer = stage, trainer
        self._driver.start(is_train=stage == "fit")
        self._follow()

    def _follow(self) -> None:
        """Hide from Lightning the callbacks inside a training step that publish nothing now
        (an attribute that is not callable shadows the method), and show them again when a
        hook subscribes: Lightning's call of each costs every step a profiler context and the
        hook's name formatted, whether the callback publishes anything or not.  Called when
        the stage starts and after each step's ``AfterStep`` (where hooks subscribe)."""
        wants = self._driver.inside()
        if wants is self._followed:
            return
        self._followed = wants
        for name, wanted in (
            ("on_train_batch_start", any(wants.values())),
            ("on_after_backward", wants[AfterBackward]),
            ("on_before_optimizer_step", wants[BeforeOptimizerStep] or wants[AfterOptimizerStep]),
        ):
            if getattr(type(self), name) is not getattr(RecisCallback, name):
                continue  # a subclass's own: always called
            if wanted:
                self.__dict__.pop(name, None)
            else:
                setattr(self, name, None)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != self._stage:
            return
        self._stage = self._trainer = None
        self._driver.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._stage = self._trainer = None
        self._driver.fail(exception)

    # ------------------------------------------------------------------ training
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._driver.before_epoch(trainer.current_epoch)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._driver.begin_step(
            True, _batches_before(trainer), batch_idx, trainer.current_epoch, data=True
        )

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._driver.receives(AfterBackward):  # (Lightning's accumulation state is not free)
            self._driver.after_backward(sync=not trainer.fit_loop._should_accumulate())

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._driver.before_optimizer_step((optimizer,))

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss, metrics = _loss_and_metrics(outputs)
        metrics.update(_logged_on_step(trainer))
        driver = self._driver
        if driver.step is not None:  # begun by on_train_batch_start
            # the optimizers only for an AfterOptimizerStep that is received (Lightning calls
            # back before the optimizer's step, not after it: end_step publishes that event)
            optimizers = tuple(trainer.optimizers) if driver.receives(AfterOptimizerStep) else ()
            stop = driver.end_step(batch_size(batch), loss, metrics, optimizers)
        else:  # nothing received from inside the step: on_train_batch_start is hidden
            stop = driver.whole_step(
                True,
                _batches_before(trainer),
                batch_idx,
                trainer.current_epoch,
                batch_size(batch),
                loss,
                metrics,
            )
        if driver.inside() is not self._followed:  # a hook (un)subscribed: re-route
            self._follow()
        if stop:
            trainer.should_stop = True

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._driver.after_epoch(trainer.current_epoch, _batches_done(trainer))

    # ------------------------------------------------------------------ validation
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._eval_steps = 0
        if self._stage == "fit" and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._driver.after_train(_batches_done(trainer), trainer.current_epoch)

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if not trainer.sanity_checking:
            step = _batches_done(trainer)
            self._driver.begin_step(False, step, self._eval_steps, trainer.current_epoch)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if trainer.sanity_checking:
            return
        self._eval_steps += 1
        loss, metrics = _loss_and_metrics(outputs)
        self._driver.end_step(batch_size(batch), loss, metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = {
            name: value
            for name, value in trainer.callback_metrics.items()
            if not name.startswith("train")
        }
        self._driver.after_eval(_batches_done(trainer), self._eval_steps, metrics)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """``BeforeSaveCheckpoint``, then the hooks' states, saved into Lightning's checkpoint
        (Lightning calls this while it builds one)."""
        if self._driver.bus is None or self._trainer is None:
            return {}
        step = _batches_done(self._trainer)
        return {"global_step": step, "hooks": self._driver.hook_states(step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the hooks' states from Lightning's checkpoint; ``AfterLoadCheckpoint``."""
        hooks = state_dict.get("hooks")
        if hooks is None:
            return
        step = state_dict.get("global_step", 0)
        self._driver.load_hook_states(hooks, step, self._ckpt_path)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._ckpt_path = str(trainer.ckpt_path or "")  # load_state_dict follows


def _batches_before(trainer: pl.Trainer) -> int:
    """Index of the training batch under way, over the run (restored on resume)."""
    return max(trainer.fit_loop.epoch_loop.total_batch_idx, 0)


def _batches_done(trainer: pl.Trainer) -> int:
    """Training batches done over the run (``processed``: counted before the callbacks of
    the batch's end, where checkpoints are saved; ``completed`` after them)."""
    total = trainer.fit_loop.epoch_loop.batch_progress.total
    return int(getattr(total, "processed", total.completed))


def _loss_and_metrics(outputs: Any) -> tuple[Any, dict[str, Any]]:
    """The loss and the other one-element entries of what a step returned."""
    if type(outputs) is dict and len(outputs) == 1 and "loss" in outputs:
        return outputs["loss"], {}  # Lightning's own {"loss": loss}, without the ABC's check
    if isinstance(outputs, torch.Tensor):
        return (outputs if outputs.numel() == 1 else None), {}
    if isinstance(outputs, Mapping):
        metrics = {
            name: value
            for name, value in outputs.items()
            if name != "loss"
            and isinstance(name, str)
            and (
                (isinstance(value, torch.Tensor) and value.numel() == 1)
                or isinstance(value, int | float)
            )
        }
        return outputs.get("loss"), metrics
    return None, {}


def _logged_on_step(trainer: pl.Trainer) -> dict[str, Any]:
    """What the training step logged with ``self.log(..., on_step=True)``, as Lightning holds
    it for this step (tensors, not read).  Lightning's public ``callback_metrics`` converts
    progress-bar values to numbers (a device read), so its result collection is read
    instead: the training loop's own (``trainer._results`` works out which loop is active by
    comparing enums, on every step); an unknown layout of it gives nothing rather than
    failing the step."""
    try:
        results = trainer.fit_loop.epoch_loop._results
    except AttributeError:
        return {}
    logged: dict[str, Any] = {}
    try:
        loader = results.dataloader_idx
        for metric in results.values():  # its valid_items(), written out: no generator
            meta = metric.meta
            if metric.has_reset or meta.dataloader_idx != loader or not meta.on_step:
                continue
            value = metric._forward_cache
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                logged[meta.name] = value
    except AttributeError:
        return {}
    return logged
