"""The hooks of this library in a Hugging Face ``Trainer`` job.

::

    from recis_async.adapters.transformers import RecisTrainerCallback

    trainer = transformers.Trainer(model, args, train_dataset=data,
                                   callbacks=[RecisTrainerCallback([LoggerHook(), ...])])
    trainer.train()

A step here is one of the ``Trainer``'s steps: one optimizer update (``state.global_step``
counts them), over ``gradient_accumulation_steps`` micro-batches.  The callback points, and
what each publishes (reference order):

=============================  ===============================================================
``on_train_begin``             the bus opens (unless one was given); ``Start``; on a resumed
                               run the hook states saved beside the checkpoint are restored
                               (``AfterLoadCheckpoint``)
``on_epoch_begin``             ``BeforeEpoch``
``on_step_begin``              ``BeforeStep``, ``AfterData`` (the batches are fetched already).
                               While no hook receives an event from inside a step (these,
                               ``AfterBackward``, the optimizer-step pair), the step is
                               published whole at its end instead (with a ``BeforeStep`` if
                               one is received by then) and the three callbacks below
                               publish nothing
``on_substep_end``             ``AfterBackward(sync=False)`` (a micro-batch without an update)
``on_pre_optimizer_step``      ``AfterBackward(sync=True)``, ``BeforeOptimizerStep``
                               (gradients final and clipped)
``on_optimizer_step``          ``AfterOptimizerStep``
``on_step_end`` / ``on_log``   ``AfterStep``; on a logging step it waits for ``on_log`` so the
                               values the ``Trainer`` logs are in its metrics.  A stop request
                               of the bus sets ``control.should_training_stop``
``on_prediction_step``         an eval step (``is_train=False``)
``on_evaluate``                ``AfterEval`` with the ``Trainer``'s metrics
``on_epoch_end``               ``AfterTrain``, ``AfterEpoch``
``on_save``                    ``BeforeSaveCheckpoint``; every hook's state written into the
                               checkpoint folder (``recis_async_hooks.pt``)
``on_train_end``               the owned bus closes: ``End`` once, services drained
=============================  ===============================================================

``AfterStep.metrics``: ``loss`` -- the mean over the step's micro-batches of the loss the
model returned (a ``"loss"`` entry of its output, as Hugging Face models return it;
summed on its device, never read on the step) -- and what the ``Trainer`` logged at that
step (``learning_rate``, ``grad_norm``, ...; its own ``loss`` there is an average since the
last log, so the step's ``loss`` is kept).  The loss is taken by a forward hook on the model
(callbacks are not given it): a loss computed outside the model (a custom
``compute_loss``) is recorded there with ``add_metric("loss", loss)``.

The ``Trainer`` reports a failure to no callback: open the bus around the run,
``with RecisTrainerCallback(...) as bus: trainer.train()`` (or pass a bus), so that a
failing run still drains its hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transformers

from .._files import atomic_path
from ..hook import Hook
from ..syncbus import SyncHookBus
from ..trainer import batch_size
from ._core import Adapter, Driver, logger

__all__ = ["HOOK_STATES_FILE", "RecisTrainerCallback"]

HOOK_STATES_FILE = "recis_async_hooks.pt"
"""The file in a ``Trainer`` checkpoint folder that holds the hooks' states."""


class RecisTrainerCallback(Adapter, transformers.TrainerCallback):
    """A ``TrainerCallback`` publishing this library's events, so its hooks run in the job.

    Args:
        hooks: the hooks to add to the bus.
        bus: an open :class:`~recis_async.syncbus.SyncHookBus` to publish on (its ``with``
            block closes it); ``None``: the callback opens one when training starts and closes
            it when training ends.
        flush_timeout: seconds the owned bus may take to drain its services when it closes.
        handle_signals: the owned bus turns SIGINT/SIGTERM into a stop at the next step
            (``control.should_training_stop``), closes, and the process exits with
            ``128 + signal``.

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
        self._driver = Driver("RecisTrainerCallback", hooks, bus, flush_timeout, handle_signals)
        self._forward: list[Any] = []  # the model's forward hooks' handles
        self._loss: torch.Tensor | None = None  # summed over the step's micro-batches
        self._micro = 0
        self._samples = 0
        self._eval_loss: torch.Tensor | None = None
        self._eval_samples = 0
        self._eval_steps = 0
        self._epoch = 0
        self._local = 0
        self._pending = False  # on_step_end came; AfterStep waits for on_log
        # where the training step under way is: (global_step, local_step, epoch)
        self._place: tuple[int, int, int] = (0, 0, 0)
        self._state: transformers.TrainerState | None = None
        self._control: transformers.TrainerControl | None = None

    # ------------------------------------------------------------------ run
    def on_train_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._driver.start(is_train=True)
        self._state = state
        model = kwargs.get("model")
        if isinstance(model, torch.nn.Module):
            self._forward = [
                model.register_forward_pre_hook(self._before_forward),
                model.register_forward_hook(self._took_forward, with_kwargs=True),
            ]
        self._loss, self._micro, self._samples, self._pending = None, 0, 0, False
        self._epoch = _whole(state.epoch)
        if state.global_step > 0:
            self._restore(args, state)

    def on_train_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._flush(control)
        for handle in self._forward:
            handle.remove()
        self._forward = []
        self._driver.close()

    def _before_forward(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        """An evaluation batch is about to run: its step begins (training steps begin at
        ``on_step_begin``), so that what the model records for it lands in that step."""
        if not module.training and self._driver.bus is not None:
            if self._pending and self._control is not None:
                self._flush(self._control)
            state = self._state
            step = state.global_step if state is not None else 0
            self._driver.begin_step(False, step, self._eval_steps, self._epoch)

    def _took_forward(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        """The model ran on a micro-batch: keep its loss (on its device) and batch size."""
        # (a dict -- a model's ModelOutput is one -- is told apart without the Mapping ABC's
        # check, which is Python code the step would run cold)
        mapping = isinstance(output, dict) or isinstance(output, Mapping)
        loss = output.get("loss") if mapping else None
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach()
        else:
            loss = None
        rows = batch_size(kwargs) if kwargs else batch_size(args)
        if module.training:
            if loss is not None:
                self._loss = loss if self._loss is None else self._loss + loss
                self._micro += 1
            self._samples += rows
        else:
            self._eval_loss = loss
            self._eval_samples = rows

    # ------------------------------------------------------------------ training
    def on_epoch_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._flush(control)
        self._epoch = _whole(state.epoch)
        self._local = 0
        self._driver.before_epoch(self._epoch)

    def on_step_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._pending:  # (_flush's test, without its call on every step)
            self._flush(control)
        self._loss, self._micro, self._samples = None, 0, 0
        self._place = place = (state.global_step, self._local, self._epoch)
        if self._driver.follows():
            self._driver.begin_step(True, *place)
        # else: nothing inside the step is received; _flush publishes it whole at its end

    def on_substep_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._driver.step is not None:  # (none while nothing inside a step is received)
            self._driver.after_backward(sync=False)

    def on_pre_optimizer_step(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._driver.step is not None:
            self._driver.after_backward(sync=True)
            self._driver.before_optimizer_step(_optimizers(kwargs))

    def on_optimizer_step(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self._driver.step is not None:
            self._driver.after_optimizer_step(_optimizers(kwargs))

    def on_step_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._local += 1
        self._pending, self._control = True, control
        if not control.should_log:  # no on_log follows for this step
            self._flush(control)

    def on_log(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._flush(control, logs)

    def _flush(
        self, control: transformers.TrainerControl, logs: Mapping[str, Any] | None = None
    ) -> None:
        """Publish the ended step's ``AfterStep`` (if one waits), with ``logs``."""
        if not self._pending:
            return
        self._pending = False
        loss = self._loss
        if loss is not None and self._micro > 1:
            loss = loss / self._micro
        self._loss = None
        driver = self._driver
        if driver.step is not None:
            stop = driver.end_step(self._samples, loss, logs)
        else:  # a training step on_step_begin did not begin (see on_step_begin)
            stop = driver.whole_step(True, *self._place, self._samples, loss, logs)
        if stop:
            control.should_training_stop = True

    def on_epoch_end(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._flush(control)
        self._driver.after_epoch(self._epoch, state.global_step)

    # ------------------------------------------------------------------ evaluation
    def on_prediction_step(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        self._flush(control)
        if self._driver.step is None or self._driver.step.is_train:
            return  # a prediction step without a forward of the model
        self._eval_steps += 1
        loss, self._eval_loss = self._eval_loss, None
        self._driver.end_step(self._eval_samples, loss)

    def on_evaluate(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        metrics: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self._flush(control)
        if self._driver.bus is not None:
            self._driver.after_eval(state.global_step, self._eval_steps, metrics or {})
        self._eval_steps = 0

    # ------------------------------------------------------------------ checkpoints
    def on_save(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        **kwargs: Any,
    ) -> None:
        """``BeforeSaveCheckpoint``, then the hooks' states into the checkpoint just written."""
        self._flush(control)
        if self._driver.bus is None or not args.should_save:
            return
        folder = _checkpoint_folder(args, state.global_step)
        if not os.path.isdir(folder):
            logger.warning(
                "RecisTrainerCallback: no checkpoint folder %s to save the hooks' states in", folder
            )
            return
        states = self._driver.hook_states(state.global_step, folder)
        final = os.path.join(folder, HOOK_STATES_FILE)
        with atomic_path(final, final + ".tmp") as tmp:
            torch.save(states, tmp)

    def _restore(
        self, args: transformers.TrainingArguments, state: transformers.TrainerState
    ) -> None:
        """The run resumed at ``state.global_step``: give the hooks the states saved in that
        checkpoint's folder."""
        folder = _checkpoint_folder(args, state.global_step)
        path = os.path.join(folder, HOOK_STATES_FILE)
        if not os.path.isfile(path):
            logger.info("RecisTrainerCallback: no hook states in %s: hooks start afresh", folder)
            return
        states = torch.load(path, weights_only=True)
        self._driver.load_hook_states(states, state.global_step, folder)


def _checkpoint_folder(args: transformers.TrainingArguments, step: int) -> str:
    return os.path.join(
        str(args.output_dir), f"{transformers.trainer_utils.PREFIX_CHECKPOINT_DIR}-{step}"
    )


def _optimizers(kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    optimizer = kwargs.get("optimizer")
    return () if optimizer is None else (optimizer,)


def _whole(epoch: float | None) -> int:
    """The ``Trainer``'s fractional epoch as the epoch under way."""
    return int((epoch or 0.0) + 1e-6)
