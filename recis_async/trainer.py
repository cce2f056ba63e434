"""Trainer: drives a PyTorch model through the reference event order of a RecIS run.

::

    Start -> [WindowMode] -> per epoch: BeforeEpoch -> per window: [BeforeWindow] ->
      per step: BeforeStep -> AfterData -> AfterBackward -> AfterStep  (or BeforeStep -> OutOfData)
      -> AfterTrain -> [eval steps -> AfterEval] -> [AfterWindow] -> AfterEpoch ... -> End

The trainer owns ``global_step`` (0-based index of a step; after ``AfterStep`` ``global_step + 1``
steps are done) and ``epoch``; hooks never advance them.  ``bus.should_stop`` is honoured at the
step boundary.  ``End`` comes from the bus when it closes, once.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import numbers
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence, Sized
from typing import Any, NamedTuple, Protocol, TypeVar

import anyio
import msgspec
import torch

from . import dist
from ._checks import nonempty_str, positive_int, positive_number
from .aggregate import MetricAggregator
from .bus import HookBus
from .checkpoint import restore_checkpoint
from .collect import add_metric
from .console import default_logging
from .events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterStep,
    AfterTrain,
    AfterWindow,
    BeforeEpoch,
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

# What a rank offers at the step boundary; the maximum over ranks wins.
_CONTINUE, _END_EPOCH, _STOP = 0, 1, 2


class TrainingArguments(msgspec.Struct, kw_only=True, frozen=True):
    """What the trainer runs; names follow RecIS's ``TrainingArguments``.

    ``train_steps`` caps the total number of steps (exactly that many run when the data lasts);
    ``train_epoch`` is the number of passes over the data; ``eval_steps`` caps each evaluation;
    ``save_steps`` / ``max_to_keep`` configure checkpoints into ``output_dir`` (``None`` turns
    them off); ``log_steps`` the log interval; ``collective_timeout`` bounds, in seconds, the
    trainer's cross-rank stop agreement.
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

    def __post_init__(self) -> None:
        owner = "TrainingArguments"
        nonempty_str(owner, "output_dir", self.output_dir)
        for field in ("log_steps", "train_epoch", "max_to_keep", "gradient_accumulation_steps"):
            positive_int(owner, field, getattr(self, field))
        for field in ("train_steps", "eval_steps", "save_steps"):  # None: no limit / no saves
            if getattr(self, field) is not None:
                positive_int(owner, field, getattr(self, field))
        positive_number(owner, "collective_timeout", self.collective_timeout)


class WindowedDataset(Protocol):
    """A dataset read window by window (RecIS window IO): ``windows()`` yields iterables."""

    def windows(self) -> Iterable[Iterable[Any]]: ...


def batch_size(batch: Any) -> int:
    """Rows in a batch: the first dimension of its first tensor/array (dicts, lists, tuples)."""
    if isinstance(batch, torch.Tensor) or hasattr(batch, "shape"):
        shape = batch.shape
        return int(shape[0]) if len(shape) else 1
    if isinstance(batch, dict):
        for value in batch.values():
            return batch_size(value)
        return 0
    if isinstance(batch, list | tuple):
        if batch and (isinstance(batch[0], torch.Tensor) or hasattr(batch[0], "shape")):
            return batch_size(batch[0])
        return len(batch)
    return 1


class Trainer:
    """Runs ``model`` over ``train_dataset`` publishing the reference events on a bus.

    ``model(batch)`` returns the scalar loss tensor, or a dict with ``"loss"`` whose other
    one-element entries become metrics (HF's convention; larger ones such as logits are not
    metrics and are left out), or a tuple/list whose first item is the loss.
    ``dense_optimizers`` is ``(optimizer, lr_scheduler)``; either may be ``None`` (no
    optimizer: evaluation only).  Without ``bus`` each of :meth:`train`, :meth:`evaluate`,
    :meth:`train_and_evaluate` opens and closes its own :class:`HookBus` with ``hooks`` added.

    Unless ``hooks`` hold their own, the trainer adds a :class:`LoggerHook` logging every
    ``args.log_steps`` steps (``logger_hook``) and, when ``args.save_steps`` is set, a
    :class:`CheckpointSaverHook` (``checkpoint_hook``) saving its model, optimizer and LR
    scheduler into ``args.output_dir`` every ``save_steps`` steps and at the end, keeping
    ``max_to_keep``.
    A :class:`ProgressBarHook` without a ``total`` gets the planned number of steps.

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

    Raises:
        TypeError: an argument of the wrong type, naming it (``hooks[2]``, say).
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
        self._distributed = False  # set when a loop starts: the process group may come later
        self.logger_hook = LoggerHook(log_step=args.log_steps)
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
        counts the steps done before).  Without a checkpoint the run starts from scratch.  The
        data is read from its beginning again: where a stream resumes is the dataset's job.
        """
        self._require_training()
        _check_resume("train", resume_from_checkpoint)
        async with self._session() as bus:
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
        async with self._session() as bus:
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
        async with self._session() as bus:
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

    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[HookBus]:
        default_logging()
        hooks = list(self.hooks)
        for default in (self.logger_hook, self.checkpoint_hook):
            if default is not None and not any(isinstance(h, type(default)) for h in hooks):
                hooks.append(default)  # unless the user brought their own of that kind
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
        step = await restore_checkpoint(
            bus, directory, self.model, self.optimizer, self.lr_scheduler
        )
        if step is not None:
            self.global_step = step

    def _planned_steps(self) -> int | None:
        """Steps this training call will run to, when known (for progress bars)."""
        planned = self.args.train_steps
        data = self.train_dataset
        if isinstance(data, Sized) and not hasattr(data, "windows"):
            by_data = self.global_step + len(data) * self.args.train_epoch
            planned = by_data if planned is None else min(planned, by_data)
        return planned

    def _steps_left(self) -> bool:
        return self.args.train_steps is None or self.global_step < self.args.train_steps

    async def _train_loop(self, bus: HookBus, *, evaluate: bool) -> None:
        self._distributed = dist.is_initialized() and dist.get_world_size() > 1
        for hook in bus.hooks:
            if isinstance(hook, ProgressBarHook) and hook.total is None:
                hook.total = self._planned_steps()
        data: Any = self.train_dataset
        windowed = hasattr(data, "windows")
        if windowed:
            await bus.publish(WindowMode(is_train=True))
        self.model.train()
        for epoch in range(self.args.train_epoch):
            if not self._steps_left() or bus.should_stop:
                break
            self.epoch = epoch
            await bus.publish(BeforeEpoch(is_train=True, epoch=epoch))
            for window_index, window in enumerate(data.windows() if windowed else [data]):
                if not self._steps_left() or bus.should_stop:
                    break
                if windowed:
                    await bus.publish(BeforeWindow(is_train=True, epoch=epoch, window=window_index))
                await self._train_steps(bus, window, epoch)
                self._flush_accumulated()
                await bus.publish(
                    AfterTrain(is_train=True, global_step=self.global_step, epoch=epoch)
                )
                if evaluate and not bus.should_stop:
                    await self._evaluate(bus)
                if windowed:
                    await bus.publish(AfterWindow(is_train=True, epoch=epoch, window=window_index))
            await bus.publish(AfterEpoch(is_train=True, epoch=epoch, global_step=self.global_step))

    async def _train_steps(self, bus: HookBus, data: Iterable[Any], epoch: int) -> None:
        it = iter(data)
        accumulate = self.args.gradient_accumulation_steps
        local = 0
        while self._steps_left():
            at = _At(True, self.global_step, local, epoch)
            try:
                await bus.publish(at(BeforeStep))
                try:
                    batch = next(it)
                except StopIteration:
                    await bus.publish(at(OutOfData))
                    await self._agree(bus, _END_EPOCH, at.global_step)
                    return
                await bus.publish(at(AfterData))
                loss = _trainable(_loss_of(self.model(batch)))
                (loss / accumulate if accumulate > 1 else loss).backward()
                await bus.publish(at(AfterBackward))
                if (self.global_step + 1) % accumulate == 0:
                    self._optimizer_step()
                add_metric("loss", loss)
                self.global_step += 1
                local += 1
                await bus.publish(at(AfterStep, samples=batch_size(batch)))
            except Exception:
                await self._agree_failed(bus)
                raise
            if await self._agree(bus, _CONTINUE, at.global_step) != _CONTINUE or bus.should_stop:
                return

    async def _agree(self, bus: HookBus, mine: int, step: int) -> int:
        """Agree with every rank at the step boundary (distributed runs only).

        Each rank offers ``_CONTINUE``, ``_END_EPOCH`` (out of data) or ``_STOP`` (its bus
        should stop); the maximum wins everywhere, so all ranks stop or end the epoch at the
        same step and none is left waiting in a collective.  A rank that failed is named.
        """
        if not self._distributed:
            return mine
        if bus.should_stop:
            mine = _STOP
        decision, failed = await anyio.to_thread.run_sync(
            functools.partial(
                dist.all_reduce_max,
                [mine, 0],
                timeout=self.args.collective_timeout,
                what=f"the stop agreement at global_step {step}",
            )
        )
        if failed:
            raise RuntimeError(
                f"rank {failed - 1} failed in the step at global_step {step}; "
                f"rank {bus.rank} stops with it"
            )
        if decision == _STOP and not bus.should_stop:
            bus.request_stop("another rank requested a stop")
        return decision

    async def _agree_failed(self, bus: HookBus) -> None:
        """Tell the other ranks, waiting at the step boundary, that this rank failed."""
        if not self._distributed:
            return
        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(
                    functools.partial(
                        dist.all_reduce_max,
                        [_STOP, bus.rank + 1],
                        timeout=min(self.args.collective_timeout, 30.0),
                        what="announcing this rank's failure",
                    )
                )
            except Exception as exc:  # the original error matters more
                logger.warning("rank %s could not announce its failure: %s", bus.rank, exc)

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def _flush_accumulated(self) -> None:
        """Apply gradients left over when the data ended mid-accumulation."""
        if self.global_step % self.args.gradient_accumulation_steps:
            self._optimizer_step()

    async def _evaluate(self, bus: HookBus) -> dict[str, Any]:
        was_training = getattr(self.model, "training", False)
        self.model.eval()
        it = iter(self.eval_dataset or ())
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
                        batch = next(it)
                    except StopIteration:
                        await bus.publish(at(OutOfData))
                        break
                    await bus.publish(at(AfterData))
                    # no_grad is never held across an await: other tasks share the thread
                    with torch.no_grad():
                        loss = _loss_of(self.model(batch))
                    local += 1
                    add_metric("loss", float(loss))
                    await bus.publish(at(AfterStep, samples=batch_size(batch)))
        finally:
            if was_training:
                self.model.train()
        metrics = await aggregator.compute_all_ranks(timeout=self.args.collective_timeout)
        await bus.publish(AfterEval(global_step=self.global_step, steps=local, metrics=metrics))
        self._last_eval = metrics
        return metrics


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
    if isinstance(output, Mapping):
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
