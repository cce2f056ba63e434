"""Trainer: drives a PyTorch model through the reference event order of a RecIS run.

::

    Start -> [WindowMode] -> per epoch: BeforeEpoch -> per window: [BeforeWindow] ->
      per step: BeforeStep -> AfterData -> AfterBackward
                [-> BeforeOptimizerStep -> AfterOptimizerStep] -> AfterStep
                (or BeforeStep -> OutOfData)
      -> AfterTrain -> [eval steps -> AfterEval] -> [AfterWindow] -> AfterEpoch ... -> End

With ``gradient_accumulation_steps = k`` the optimizer steps after every ``k``-th backward
(``AfterBackward.sync`` says which), and once more for gradients left when the data ends
mid-accumulation (those two events then carry the last step's ``global_step``, before
``AfterTrain``).  ``AfterData``, ``AfterBackward`` and the optimizer-step events are built and
published only when something subscribes to them (``bus.has_subscribers``): nobody sees the
difference, and an ordinary step spares four events.

The trainer owns ``global_step`` (0-based index of a step; after ``AfterStep`` ``global_step + 1``
steps are done) and ``epoch``; hooks never advance them.  ``bus.should_stop`` is honoured at the
step boundary.  ``End`` comes from the bus when it closes, once.

A job's life across processes: every checkpoint holds the trainer's place in its data
(:mod:`recis_async.checkpoint.position`), so ``train(resume_from_checkpoint=True)`` continues
at the next batch the interrupted run would have read; a rerun without it refuses to start in an
``output_dir`` that holds an earlier run's checkpoints (``overwrite_output_dir=True`` starts
again, removing them), so one folder holds one run's checkpoints and its traces are not written
twice.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import time
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
    Sized,
)
from typing import Any, NamedTuple, Protocol, TypeVar

import anyio
import msgspec
import torch

from . import dist
from ._checks import boolean, nonempty_str, positive_int, positive_number
from .aggregate import MetricAggregator
from .agreement import CONTINUE, END_PASS, STOP, Agreement
from .batches import Lookahead, batch_size, model_device, mover, resolve_device
from .bus import HookBus
from .checkpoint import list_checkpoints, restore_checkpoint
from .checkpoint.position import DataPosition, Restored
from .collect import add_metric
from .console import default_logging
from .events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterOptimizerStep,
    AfterStep,
    AfterTrain,
    AfterWindow,
    BeforeEpoch,
    BeforeOptimizerStep,
    BeforeStep,
    BeforeWindow,
    OutOfData,
    Start,
    StepEvent,
    WindowMode,
)
from .hook import Hook
from .hooks.checkpoint import CheckpointSaverHook
from .hooks.logger import LoggerHook
from .hooks.progress import ProgressBarHook
from .priority import Priority

__all__ = ["Trainer", "TrainingArguments", "WindowedDataset"]

logger = logging.getLogger(__name__)


class TrainingArguments(msgspec.Struct, kw_only=True, frozen=True):
    """What the trainer runs; names follow RecIS's ``TrainingArguments``.

    ``train_steps`` caps the total number of steps (exactly that many run when the data lasts);
    ``train_epoch`` is the number of passes over the data; ``eval_steps`` caps each evaluation;
    ``save_steps`` / ``max_to_keep`` configure checkpoints into ``output_dir`` (``None`` turns
    them off); ``log_steps`` the log interval; ``collective_timeout`` bounds, in seconds, each
    wait of the trainer's cross-rank stop agreement (:mod:`recis_async.agreement`).

    ``overwrite_output_dir``: a training call that does not resume refuses to start when a
    checkpoint directory of its savers already holds checkpoints (an earlier run's: continuing
    beside them would mix two runs and write their traces twice); with ``True`` it removes
    those checkpoints and starts again.  ``ignore_data_skip``: on resume, read the data of the
    restored pass from its start instead of skipping the batches the restored steps trained
    on (HF's option of the same name: for data that resumes by itself).
    """

    output_dir: str = "output_dir"
    log_steps: int = 100
    train_steps: int | None = None
    train_epoch: int = 1
    eval_steps: int | None = None
    save_steps: int | None = 1000
    max_to_keep: int = 5
    gradient_accumulation_steps: int = 1
    collective_timeout: float = 300.0
    overwrite_output_dir: bool = False
    ignore_data_skip: bool = False

    def __post_init__(self) -> None:
        owner = "TrainingArguments"
        nonempty_str(owner, "output_dir", self.output_dir)
        boolean(owner, "overwrite_output_dir", self.overwrite_output_dir)
        boolean(owner, "ignore_data_skip", self.ignore_data_skip)
        for field in ("log_steps", "train_epoch", "max_to_keep", "gradient_accumulation_steps"):
            positive_int(owner, field, getattr(self, field))
        for field in ("train_steps", "eval_steps", "save_steps"):  # None: no limit / no saves
            if getattr(self, field) is not None:
                positive_int(owner, field, getattr(self, field))
        positive_number(owner, "collective_timeout", self.collective_timeout)


class WindowedDataset(Protocol):
    """A dataset read window by window (RecIS window IO): ``windows()`` yields iterables."""

    def windows(self) -> Iterable[Iterable[Any]]: ...


class Trainer:
    """Runs ``model`` over ``train_dataset`` publishing the reference events on a bus.

    ``model(batch)`` returns the scalar loss tensor, or a dict with ``"loss"`` whose other
    one-element entries become metrics (HF's convention; larger ones such as logits are not
    metrics and are left out), or a tuple/list whose first item is the loss.
    ``dense_optimizers`` is ``(optimizer, lr_scheduler)``; either may be ``None`` (no
    optimizer: evaluation only).  Without ``bus`` each of :meth:`train`, :meth:`evaluate`,
    :meth:`train_and_evaluate` opens and closes its own :class:`HookBus` with ``hooks`` added.

    Unless ``hooks`` hold their own, the trainer adds a :class:`LoggerHook` logging every
    ``args.log_steps`` steps (``logger_hook``; set it to ``None`` for no log lines) and, when
    ``args.save_steps`` is set, a :class:`CheckpointSaverHook` (``checkpoint_hook``) saving its
    model, optimizer and LR scheduler into ``args.output_dir`` every ``save_steps`` steps and
    at the end, keeping ``max_to_keep``.
    A :class:`ProgressBarHook` without a ``total`` gets the planned number of steps.

    The device: batches (tensors in nested dicts, lists, tuples) are moved to ``device`` with
    non-blocking copies from pinned memory (:func:`recis_async.batches.to_device`), except the
    dict entries named in ``keep_on_host`` (ids for a :class:`~recis_async.nn.HashTable`'s
    host-side id map).  ``device=None`` means the model's device (its first parameter's), read
    when each loop starts; a ``device`` given moves the model there now (``model.to(device)``:
    parameters keep their identity, so an optimizer built on them stays valid).  The loop
    reads no tensor value on an ordinary step: the loss goes to ``add_metric`` as a detached
    tensor, and in distributed runs the stop agreement is read one step after it started
    (every rank still stops at the same step; a stop requested in step ``k`` takes effect
    after step ``k + 1``).

    When the application configured no logging (no handler on the root or ``recis_async``
    logger), a run shows the library's INFO lines on stderr, as
    :func:`recis_async.enable_logging` would; configured logging is left alone.

    Args:
        model: the module; ``model(batch)`` returns the loss as above.
        args: what to run (:class:`TrainingArguments`); defaults if ``None``.
        train_dataset: an iterable of batches, or a windowed dataset.
        eval_dataset: an iterable of batches for :meth:`evaluate`.
        hooks: hooks added to every bus the trainer opens (or to ``bus``).
        dense_optimizers: ``(optimizer, lr_scheduler)``.
        bus: an open bus to publish on instead of opening one per call.
        device: where batches go (and the model, when given); ``None``: the model's device.
        keep_on_host: keys of dict batches whose values stay where the loader made them.

    Raises:
        TypeError: an argument of the wrong type, naming it (``hooks[2]``, say).
        ValueError: a ``device`` torch does not know.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        args: TrainingArguments | None = None,
        train_dataset: Iterable[Any] | WindowedDataset | None = None,
        eval_dataset: Iterable[Any] | None = None,
        hooks: Sequence[Hook] | None = None,
        dense_optimizers: tuple[Any, Any] = (None, None),
        bus: HookBus | None = None,
        device: str | torch.device | None = None,
        keep_on_host: Collection[str] = (),
    ) -> None:
        if not callable(model):
            raise TypeError(f"Trainer(model=...): expected a callable module, got {model!r}")
        args = TrainingArguments() if args is None else args
        if not isinstance(args, TrainingArguments):
            raise TypeError(f"Trainer(args=...): expected TrainingArguments, got {args!r}")
        for field, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            if dataset is not None and not (
                hasattr(dataset, "windows") or isinstance(dataset, Iterable)
            ):
                raise TypeError(
                    f"Trainer({field}=...): expected an iterable of batches or an object with "
                    f"windows(), got {type(dataset).__name__}"
                )
        if isinstance(hooks, Hook) or not isinstance(hooks, Iterable | None):
            raise TypeError(f"Trainer(hooks=...): expected a list of Hooks, got {hooks!r:.80}")
        hooks = list(hooks or ())
        for i, hook in enumerate(hooks):
            if not isinstance(hook, Hook):
                raise TypeError(f"Trainer(hooks[{i}]): expected a Hook, got {hook!r}")
        if not (isinstance(dense_optimizers, tuple | list) and len(dense_optimizers) == 2):
            raise TypeError(
                "Trainer(dense_optimizers=...): expected (optimizer, lr_scheduler), "
                f"got {type(dense_optimizers).__name__}"
            )
        for i, (what, methods) in enumerate(
            (("optimizer", ("step", "zero_grad")), ("lr_scheduler", ("step",)))
        ):
            given = dense_optimizers[i]
            if given is not None and not all(callable(getattr(given, m, None)) for m in methods):
                raise TypeError(
                    f"Trainer(dense_optimizers[{i}]=...): expected the {what} (an object with "
                    f"{'() and '.join(methods)}()) or None, got {type(given).__name__}"
                )
        if bus is not None and not isinstance(bus, HookBus):
            raise TypeError(f"Trainer(bus=...): expected a HookBus, got {bus!r}")
        if isinstance(keep_on_host, str) or not (
            isinstance(keep_on_host, Collection) and all(isinstance(k, str) for k in keep_on_host)
        ):
            raise TypeError(
                f"Trainer(keep_on_host=...): expected a collection of dict keys (str), "
                f"got {keep_on_host!r:.80}"
            )
        self._device = None if device is None else _checked_device(device)
        if self._device is not None:
            if not callable(getattr(model, "to", None)):
                raise TypeError(
                    f"Trainer(device={device!r}): expected a model with .to() to move there, "
                    f"got {type(model).__name__}"
                )
            model.to(self._device)
        self.keep_on_host = frozenset(keep_on_host)
        self.model = model
        self.args = args
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.hooks = hooks
        self.optimizer, self.lr_scheduler = dense_optimizers
        self.bus = bus
        self.global_step = 0
        self.epoch = 0
        self._last_eval: dict[str, Any] = {}
        self._last_local = 0  # the last training step's local_step: a leftover update's
        self._agreement: Agreement | None = None  # while a distributed training loop runs
        self.logger_hook: LoggerHook | None = LoggerHook(log_step=args.log_steps)
        self.data_position = DataPosition()  # saved in checkpoints under "Trainer"
        self.checkpoint_hook: CheckpointSaverHook | None = None
        if args.save_steps is not None and not any(
            isinstance(h, CheckpointSaverHook) for h in hooks
        ):
            self.checkpoint_hook = CheckpointSaverHook(
                args.output_dir,
                save_steps=args.save_steps,
                max_to_keep=args.max_to_keep,
                model=model,
                optimizer=self.optimizer,
                lr_scheduler=self.lr_scheduler,
                barrier_timeout=args.collective_timeout,
            )

    # ------------------------------------------------------------------ public entry points
    async def train(self, resume_from_checkpoint: bool | str | os.PathLike[str] = False) -> None:
        """Train for ``train_epoch`` passes or ``train_steps`` steps, whichever ends first.

        ``resume_from_checkpoint``: ``True`` restores the newest checkpoint of
        ``args.output_dir`` (a path: of that directory) after ``Start``: model, optimizer,
        LR scheduler and hook states, then ``global_step`` continues from it (``train_steps``
        counts the steps done before).  Without a checkpoint the run starts from scratch, so
        ``True`` suits a job a scheduler may restart.  The data continues where the
        checkpoint was taken: the epoch and pass it was in, the batches its steps trained on
        skipped (read and dropped, in a worker thread), under the random state the pass's
        iterator was created with, so a shuffling ``DataLoader`` repeats its order
        (``args.ignore_data_skip``: no skipping).

        Without ``resume_from_checkpoint`` (or with a path other than a saver's directory),
        a saver's directory that holds checkpoints is refused before anything starts, unless
        ``args.overwrite_output_dir`` (which removes them); a trainer that already trained in
        this process continues its own run.

        Raises:
            ValueError: an output directory holding an earlier run's checkpoints, as above;
                ``overwrite_output_dir`` together with ``resume_from_checkpoint=True``.
        """
        self._require_training()
        _check_resume("train", resume_from_checkpoint)
        self._prepare_output_dirs("train", resume_from_checkpoint)
        async with self._session(training=True) as bus:
            await bus.publish(Start(is_train=True))
            await self._restore(bus, resume_from_checkpoint)
            await self._train_loop(bus, evaluate=False)

    async def evaluate(self) -> dict[str, Any]:
        """Run ``eval_dataset`` once (at most ``eval_steps`` steps); returns the eval metrics.

        Every metric the eval steps added (``add_metric``, the model's dict entries, the
        ``loss``) is aggregated over the pass -- by default the mean weighted by the batches'
        sizes, else as ``add_metric(..., reduce=...)`` asked -- and over every rank in a
        distributed run; the result is also published as ``AfterEval.metrics``.
        """
        if self.eval_dataset is None:
            raise ValueError("Trainer.evaluate(): eval_dataset is None")
        async with self._session(training=False) as bus:
            await bus.publish(Start(is_train=False))
            return await self._evaluate(bus)

    async def train_and_evaluate(
        self, resume_from_checkpoint: bool | str | os.PathLike[str] = False
    ) -> dict[str, Any]:
        """Train, evaluating after every epoch (after every window for windowed data);
        ``resume_from_checkpoint`` as in :meth:`train`.  Returns the last evaluation's metrics
        as :meth:`evaluate` does (empty when a stop came before any evaluation)."""
        self._require_training()
        if self.eval_dataset is None:
            raise ValueError("Trainer.train_and_evaluate(): eval_dataset is None")
        _check_resume("train_and_evaluate", resume_from_checkpoint)
        self._prepare_output_dirs("train_and_evaluate", resume_from_checkpoint)
        async with self._session(training=True) as bus:
            await bus.publish(Start(is_train=True))
            await self._restore(bus, resume_from_checkpoint)
            self._last_eval = {}
            await self._train_loop(bus, evaluate=True)
        return self._last_eval

    # ------------------------------------------------------------------ the loops
    def _require_training(self) -> None:
        if self.train_dataset is None:
            raise ValueError("Trainer: train_dataset is None")
        if self.optimizer is None:
            raise ValueError("Trainer: dense_optimizers[0] (the optimizer) is None; cannot train")

    def _session_hooks(self, *, training: bool) -> list[Hook]:
        hooks = list(self.hooks)
        for default in (self.logger_hook, self.checkpoint_hook):
            if default is not None and not any(isinstance(h, type(default)) for h in hooks):
                hooks.append(default)  # unless the user brought their own of that kind
        taken = self.bus is not None and any(
            h.state_key == self.data_position.state_key and h is not self.data_position
            for h in self.bus.hooks
        )
        if training and not taken:  # (another trainer's on a shared bus: it keeps the key)
            hooks.append(self.data_position)
        return hooks

    def _prepare_output_dirs(self, method: str, resume: bool | str | os.PathLike[str]) -> None:
        """Refuse, or with ``overwrite_output_dir`` empty, the checkpoint directories that hold
        an earlier run's checkpoints when this call does not continue that run."""
        overwrite = self.args.overwrite_output_dir
        if resume is True and overwrite:
            raise ValueError(
                f"Trainer.{method}(resume_from_checkpoint=True): expected "
                "TrainingArguments(overwrite_output_dir=False) when resuming (overwriting removes "
                "the checkpoints to resume from), got overwrite_output_dir=True"
            )
        if resume is True or self.global_step > 0:
            return  # continuing the run those checkpoints belong to
        source = None if resume is False else os.path.realpath(resume)
        hooks = self._session_hooks(training=True)
        savers = [h for h in hooks if isinstance(h, CheckpointSaverHook)]
        if self.bus is not None:
            savers += [h for h in self.bus.hooks if isinstance(h, CheckpointSaverHook)]
        directories = dict.fromkeys(os.path.realpath(h.output_dir) for h in savers)
        for directory in directories:
            if directory == source:
                continue  # resuming from this directory: the same run goes on
            found = list_checkpoints(directory)
            if not found:
                continue
            if not overwrite:
                newest = os.path.basename(found[-1][1])
                raise ValueError(
                    f"Trainer.{method}(resume_from_checkpoint={resume!r}): expected an output "
                    f"directory without checkpoints, got {directory} holding {len(found)} "
                    f"checkpoint(s) of an earlier run (the newest {newest}); pass "
                    "resume_from_checkpoint=True to continue that run, or "
                    "TrainingArguments(overwrite_output_dir=True) to start again (its "
                    "checkpoints are removed), or choose another output_dir"
                )
            for _step, path in found:
                with contextlib.suppress(FileNotFoundError):  # another rank removed it
                    os.unlink(path)
            logger.warning(
                "overwrite_output_dir=True: removed %d checkpoint(s) of an earlier run from %s "
                "(the newest %s); its traces and tracked runs stay where they were written",
                len(found),
                directory,
                os.path.basename(found[-1][1]),
            )

    @contextlib.asynccontextmanager
    async def _session(self, *, training: bool) -> AsyncIterator[HookBus]:
        default_logging()
        hooks = self._session_hooks(training=training)
        if self.bus is not None:
            for hook in hooks:
                if not any(h is hook for h in self.bus.hooks):
                    self.bus.add_hook(hook)
            yield self.bus
            return
        async with HookBus() as bus:
            for hook in hooks:
                bus.add_hook(hook)
            yield bus

    async def _restore(self, bus: HookBus, resume: bool | str | os.PathLike[str]) -> None:
        if resume is False:
            return
        directory = self.args.output_dir if resume is True else resume
        self.data_position.restored = None
        step = await restore_checkpoint(
            bus, directory, self.model, self.optimizer, self.lr_scheduler
        )
        if step is not None:
            self.global_step = step
            if self.data_position.restored is None:
                logger.warning(
                    "the checkpoint of step %d holds no data position (an older format): the "
                    "data is read from its beginning",
                    step,
                )

    def _planned_steps(self) -> int | None:
        """Steps this training call will run to, when known (for progress bars)."""
        planned = self.args.train_steps
        data = self.train_dataset
        if isinstance(data, Sized) and not hasattr(data, "windows"):
            by_data = self.global_step + len(data) * self.args.train_epoch
            at = self.data_position.restored
            if at is not None:  # the restored epochs are done, the pass's batches skipped
                skipped = 0 if self.args.ignore_data_skip else at.batches
                by_data -= len(data) * at.epoch + skipped
            planned = by_data if planned is None else min(planned, by_data)
        return planned

    def _steps_left(self) -> bool:
        return self.args.train_steps is None or self.global_step < self.args.train_steps

    @property
    def device(self) -> torch.device:
        """Where batches go: the ``device`` given, else the model's (see the class docstring)."""
        return self._device if self._device is not None else model_device(self.model)

    def _mover(self) -> Callable[[Any], Any]:
        """Moves one batch to :attr:`device` (read now, once per loop)."""
        return mover(self.device, self.keep_on_host)

    async def _train_loop(self, bus: HookBus, *, evaluate: bool) -> None:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            await self._train_passes(bus, evaluate=evaluate)
            return
        # the agreement's own group, made (collectively) for this loop and gone after it, so
        # that destroy_process_group() at the end of the job leaves none of its threads behind
        group = dist.control_group()
        self._agreement = Agreement(group, self.args.collective_timeout)
        try:
            await self._train_passes(bus, evaluate=evaluate)
        finally:
            self._agreement = None
            dist.release_group(group)

    async def _train_passes(self, bus: HookBus, *, evaluate: bool) -> None:
        for hook in bus.hooks:
            if isinstance(hook, ProgressBarHook) and hook.total is None:
                hook.total = self._planned_steps()
        data: Any = self.train_dataset
        windowed = hasattr(data, "windows")
        if windowed:
            await bus.publish(WindowMode(is_train=True))
        self.model.train()
        position = self.data_position
        resume = position.take_restored()
        first_epoch = 0 if resume is None else resume.epoch
        if resume is None:
            position.epoch = position.window = position.batches = 0
        for epoch in range(first_epoch, self.args.train_epoch):
            if not self._steps_left() or await self._stop_agreed(bus):
                break
            self.epoch = epoch
            await bus.publish(BeforeEpoch(is_train=True, epoch=epoch))
            exhausted = True
            for window_index, window in enumerate(data.windows() if windowed else [data]):
                if not self._steps_left() or await self._stop_agreed(bus):
                    exhausted = False
                    break
                here = resume if resume and (epoch, window_index) == resume[:2] else None
                if resume and epoch == resume.epoch and window_index < resume.window:
                    continue  # a window the restored steps finished
                if windowed:
                    await bus.publish(BeforeWindow(is_train=True, epoch=epoch, window=window_index))
                exhausted = await self._train_steps(bus, window, epoch, window_index, here)
                if exhausted:
                    position.end_pass()
                await self._flush_accumulated(bus)
                await bus.publish(
                    AfterTrain(is_train=True, global_step=self.global_step, epoch=epoch)
                )
                if evaluate and not await self._stop_agreed(bus):
                    await self._evaluate(bus)
                if windowed:
                    await bus.publish(AfterWindow(is_train=True, epoch=epoch, window=window_index))
            if exhausted:
                position.end_epoch()
            await bus.publish(AfterEpoch(is_train=True, epoch=epoch, global_step=self.global_step))

    async def _train_steps(
        self, bus: HookBus, data: Iterable[Any], epoch: int, window: int, resume: Restored | None
    ) -> bool:
        """One pass over ``data`` (resuming it at ``resume``); true when it ran out of data.

        Alone, a rank reads each batch after ``BeforeStep`` and honours ``bus.should_stop``
        after each step.  In a distributed run the ranks agree (:mod:`recis_async.agreement`):
        whether each holds the pass's first batch and none stops, before it; then after step
        ``k`` each offers whether it holds the batch of step ``k + 2`` (it reads two ahead)
        and whether it stops, and reads what all offered after step ``k - 1``.  A rank that
        offers to stop waits for the outcome at once: when every rank offered it, all stop
        after step ``k``.
        """
        if resume is not None and self.args.ignore_data_skip:
            resume = None
        self.data_position.begin_pass(epoch, window, data, resume)
        it = iter(data)
        local = 0
        agreement = self._agreement
        if resume is not None:
            if resume.batches:
                local = await self._skip(bus, it, resume)
                if bus.should_stop and agreement is None:
                    return False
            self.data_position.skipped(local, resume)
        batches = Lookahead(it, self._mover())
        accumulate = self.args.gradient_accumulation_steps
        if agreement is not None:
            offer = await self._offer_or_fail(bus, batches, 1)
            first = await agreement.now(offer, self.global_step)
            if first.value != CONTINUE:
                return await self._end_pass(bus, first.value, batches, local, epoch)
            agreement.start(await self._offer_or_fail(bus, batches, 2), self.global_step)
        # The step's own code runs right after the model's compute, with Python's code out of
        # cache: kept to few calls (events built directly, a publish only where one listens).
        # Whether anyone receives the optional step events, asked again only when the bus's
        # subscriptions changed (a hook added during the run receives them from the next step).
        generation = -1
        before = after_data = backward = optimizer = False
        while self._steps_left():
            step = self.global_step
            try:
                if bus._generation != generation:
                    generation = bus._generation
                    before = bus.has_subscribers(BeforeStep)
                    after_data = bus.has_subscribers(AfterData)
                    backward = bus.has_subscribers(AfterBackward)
                    optimizer = (
                        backward
                        or bus.has_subscribers(BeforeOptimizerStep)
                        or bus.has_subscribers(AfterOptimizerStep)
                    )
                if before or not bus._begin_step(True):  # (a failure or signal: published)
                    await bus.publish(
                        BeforeStep(is_train=True, global_step=step, local_step=local, epoch=epoch)
                    )
                try:
                    batch = batches.take()
                except StopIteration:
                    await bus.publish(_At(True, step, local, epoch)(OutOfData))
                    return True
                self.data_position.batches += 1
                if after_data:  # (an event nobody receives is not built)
                    await bus.publish(_At(True, step, local, epoch)(AfterData))
                loss = _trainable(_loss_of(self.model(batch)))
                (loss / accumulate if accumulate > 1 else loss).backward()
                if (step + 1) % accumulate == 0:
                    if optimizer:
                        at = _At(True, step, local, epoch)
                        if backward:
                            await bus.publish(at(AfterBackward, sync=True))
                        await self._optimizer_step(bus, at)
                    else:
                        self._step_optimizer()
                elif backward:
                    await bus.publish(_At(True, step, local, epoch)(AfterBackward, sync=False))
                add_metric("loss", loss)  # a device's tensor is read at the log window
                self.global_step = step + 1
                self._last_local = local
                local += 1
                await bus.publish(
                    AfterStep(
                        is_train=True,
                        global_step=step,
                        local_step=local - 1,
                        epoch=epoch,
                        samples=batch_size(batch),
                    )
                )
                offer = (
                    self._offer(bus, batches, 2)
                    if agreement is not None and self._steps_left()
                    else CONTINUE
                )
            except Exception:
                await self._announce_failure(bus)
                raise
            if agreement is None:
                if bus.should_stop:
                    return False
                continue
            decision = await agreement.result()  # what every rank offered after the last step
            if decision.value != CONTINUE:
                return await self._end_pass(bus, decision.value, batches, local, epoch)
            if self._steps_left():  # the same on every rank: global_step moves in lockstep
                agreement.start(offer, step)
                if offer == STOP and (await agreement.peek()).low == STOP:
                    await agreement.result()  # every rank stops here: none needs the lag
                    return False
        return False

    @staticmethod
    def _offer(bus: HookBus, batches: Lookahead, ahead: int) -> int:
        """This rank's offer: stop, or whether it holds the ``ahead``-th batch from here."""
        if bus.should_stop:
            return STOP
        return CONTINUE if batches.has(ahead) else END_PASS

    async def _offer_or_fail(self, bus: HookBus, batches: Lookahead, ahead: int) -> int:
        """:meth:`_offer`, announcing this rank's failure when reading ahead raised."""
        try:
            return self._offer(bus, batches, ahead)
        except Exception:
            await self._announce_failure(bus)
            raise

    async def _end_pass(
        self, bus: HookBus, decision: int, batches: Lookahead, local: int, epoch: int
    ) -> bool:
        """Act on an agreed ``STOP`` or ``END_PASS`` (true: the pass ended for lack of data).

        The ranks that lack the next batch publish ``BeforeStep``/``OutOfData`` for it, as a
        rank alone does; the others end the pass where they are."""
        if decision == STOP:
            if not bus.should_stop:
                bus.request_stop("another rank requested a stop")
            return False
        if not batches.has(1):
            at = _At(True, self.global_step, local, epoch)
            await bus.publish(at(BeforeStep))
            await bus.publish(at(OutOfData))
        return True

    async def _skip(self, bus: HookBus, it: Iterator[Any], resume: Restored) -> int:
        """Read and drop the batches of this pass the restored steps trained on (in a worker
        thread, a chunk at a time so a stop signal is honoured); returns how many."""
        logger.info(
            "resuming epoch %d%s after %d batches: skipping what the restored steps trained on "
            "(TrainingArguments.ignore_data_skip=True reads the data from its start)",
            resume.epoch,
            f" window {resume.window}" if resume.window else "",
            resume.batches,
        )
        started = time.monotonic()
        skipped = 0
        while skipped < resume.batches and not bus.should_stop:
            chunk = min(_SKIP_CHUNK, resume.batches - skipped)
            got = await anyio.to_thread.run_sync(_advance, it, chunk)
            skipped += got
            if got < chunk:
                logger.warning(
                    "the data ended after %d batches; the restored checkpoint had trained on %d "
                    "of this pass (the data changed?)",
                    skipped,
                    resume.batches,
                )
                break
        logger.info("skipped %d batches in %.3g s", skipped, time.monotonic() - started)
        return skipped

    async def _stop_agreed(self, bus: HookBus) -> bool:
        """``bus.should_stop``, agreed by every rank at once in a distributed run (between
        passes, where a stop that came after a pass's last agreement must reach every rank
        before they choose to run another pass or an evaluation)."""
        if self._agreement is not None:
            decision = await self._agreement.now(
                STOP if bus.should_stop else CONTINUE, self.global_step
            )
            if decision.value == STOP and not bus.should_stop:
                bus.request_stop("another rank requested a stop")
        return bus.should_stop

    async def _announce_failure(self, bus: HookBus) -> None:
        """Tell the other ranks, at their next agreement, that this rank failed."""
        if self._agreement is None:
            return
        try:
            await self._agreement.announce_failure(
                bus.rank, min(self.args.collective_timeout, 30.0)
            )
        except Exception as exc:  # the original error matters more
            logger.warning("rank %s could not announce its failure: %s", bus.rank, exc)

    async def _optimizer_step(self, bus: HookBus, at: _At) -> None:
        """``BeforeOptimizerStep`` (final gradients: clipping hooks act here), the step and
        the LR scheduler's, ``AfterOptimizerStep``."""
        optimizers = (self.optimizer,)
        if bus.has_subscribers(BeforeOptimizerStep):
            await bus.publish(at(BeforeOptimizerStep, optimizers=optimizers))
        self._step_optimizer()
        if bus.has_subscribers(AfterOptimizerStep):
            await bus.publish(at(AfterOptimizerStep, optimizers=optimizers))

    def _step_optimizer(self) -> None:
        """The optimizer's step, its gradients cleared, the LR scheduler's step."""
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    async def _flush_accumulated(self, bus: HookBus) -> None:
        """Apply gradients left over when the data ended mid-accumulation."""
        if self.global_step % self.args.gradient_accumulation_steps:
            at = _At(True, self.global_step - 1, self._last_local, self.epoch)
            await self._optimizer_step(bus, at)

    async def _evaluate(self, bus: HookBus) -> dict[str, Any]:
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        batches = Lookahead(iter(self.eval_dataset or ()), self._mover())
        local = 0
        aggregator = MetricAggregator()
        try:
            with bus.subscribe(
                AfterStep, aggregator.update, priority=Priority.HIGHEST, when=_is_eval
            ):
                while self.args.eval_steps is None or local < self.args.eval_steps:
                    at = _At(False, self.global_step, local, self.epoch)
                    await bus.publish(at(BeforeStep))
                    try:
                        batch = batches.take()
                    except StopIteration:
                        await bus.publish(at(OutOfData))
                        break
                    if bus.has_subscribers(AfterData):
                        await bus.publish(at(AfterData))
                    # no_grad is never held across an await: other tasks share the thread
                    with torch.no_grad():
                        loss = _loss_of(self.model(batch))
                    local += 1
                    add_metric("loss", loss.detach())  # summed on its device over the pass
                    await bus.publish(at(AfterStep, samples=batch_size(batch)))
        finally:
            if was_training:
                self.model.train()
        metrics = await aggregator.compute_all_ranks(timeout=self.args.collective_timeout)
        await bus.publish(AfterEval(global_step=self.global_step, steps=local, metrics=metrics))
        self._last_eval = metrics
        return metrics


_SKIP_CHUNK = 256  # batches skipped per worker-thread call on resume


def _advance(it: Iterator[Any], n: int) -> int:
    """Take up to ``n`` items of ``it``; returns how many there were."""
    for i in range(n):
        try:
            next(it)
        except StopIteration:
            return i
    return n


def _is_eval(event: AfterStep) -> bool:
    return not event.is_train


S = TypeVar("S", bound=StepEvent)


class _At(NamedTuple):
    """Where a step is: builds that step's events."""

    is_train: bool
    global_step: int
    local_step: int
    epoch: int

    def __call__(self, cls: type[S], **extra: Any) -> S:
        return cls(
            is_train=self.is_train,
            global_step=self.global_step,
            local_step=self.local_step,
            epoch=self.epoch,
            **extra,
        )


def _checked_device(device: object) -> torch.device:
    if not isinstance(device, str | torch.device):
        raise TypeError(
            f"Trainer(device=...): expected a torch.device, a str such as 'cuda' or None, "
            f"got {type(device).__name__}"
        )
    try:
        return resolve_device(device)
    except (RuntimeError, AssertionError) as exc:
        raise ValueError(
            f"Trainer(device=...): expected a usable device, got {device!r}: {exc}"
        ) from None


def _check_resume(method: str, resume: object) -> None:
    if not isinstance(resume, bool | str | os.PathLike) or resume == "":
        raise TypeError(
            f"Trainer.{method}(resume_from_checkpoint=...): expected a bool or a checkpoint "
            f"directory, got {resume!r}"
        )


def _loss_of(output: Any) -> torch.Tensor:
    """The loss in what ``model(batch)`` returned: the scalar loss tensor; a mapping with
    ``"loss"`` whose other scalar entries become metrics (HF's convention); or a tuple/list
    whose first item is the loss."""
    if type(output) is dict or isinstance(output, Mapping):  # (a dict skips the ABC check)
        if "loss" not in output:
            raise TypeError(
                "model(batch): expected the scalar loss tensor, a dict with 'loss' or a tuple "
                f"whose first item is the loss, got a {type(output).__name__} without 'loss' "
                f"(keys: {sorted(map(str, output))})"
            )
        loss = _check_loss(output["loss"], "model(batch)['loss']")
        for name, value in output.items():
            if name != "loss" and isinstance(name, str) and _is_scalar(value):
                add_metric(name, value)
        return loss
    if isinstance(output, tuple | list):
        if not output:
            raise TypeError(
                "model(batch): expected the scalar loss tensor, a dict with 'loss' or a tuple "
                f"whose first item is the loss, got an empty {type(output).__name__}"
            )
        return _check_loss(output[0], "model(batch)[0]")
    return _check_loss(output, "model(batch)")


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Real)


def _check_loss(loss: Any, where: str) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        expected = (
            "the scalar loss tensor, a dict with 'loss' or a tuple whose first item is the loss"
            if where == "model(batch)"
            else "the scalar loss tensor"
        )
        raise TypeError(f"{where}: expected {expected}, got {what}")
    return loss


def _trainable(loss: torch.Tensor) -> torch.Tensor:
    """A training loss backward() can run through, or an error saying why not."""
    if not loss.requires_grad:
        raise ValueError(
            "model(batch) in training: expected a loss that requires grad (computed from "
            "parameters with requires_grad=True, outside torch.no_grad()), got a tensor "
            f"without grad_fn ({loss.detach().reshape(()).item():.6g})"
        )
    return loss
