"""Every built-in hook on one bus, around a real model with a dynamic embedding table: the
loops that the host-read proof (``test_host_reads_all.py``) and the GPU tests
(``test_gpu.py``) run, on the CPU or on a CUDA device.

Two loops drive the same model, data and hooks: the :class:`~recis_async.Trainer`
(``train_and_evaluate``) and a hand-written loop publishing the same events.  Both train
``EPOCHS`` passes of ``BATCHES`` batches and evaluate ``EVAL_BATCHES`` batches after each pass;
every step records tensors with ``add_metric``, ``add_to_trace`` and ``add_to_ml_tracker``.

A :class:`Where` hook runs before every other subscriber and labels what follows, so a reader
(:class:`~host_reads.HostReads`, or the CUDA sync recorder of the GPU tests) can tell the
ordinary steps from the boundaries the hooks' cadences name (:func:`ordinary`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import io
import pkgutil
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import torch

import recis_async.hooks
from recis_async import (
    Hook,
    HookBus,
    MetricAggregator,
    Trainer,
    TrainingArguments,
    add_metric,
    add_to_ml_tracker,
    add_to_trace,
)
from recis_async.events import (
    AfterBackward,
    AfterData,
    AfterEpoch,
    AfterEval,
    AfterOptimizerStep,
    AfterStep,
    AfterTrain,
    BeforeEpoch,
    BeforeOptimizerStep,
    BeforeStep,
    End,
    OutOfData,
    Start,
    StepEvent,
)
from recis_async.hooks import (
    AnomalyProfilerHook,
    CheckpointSaverHook,
    ClipGradNormHook,
    DeviceStatsHook,
    EarlyStoppingHook,
    GlobalStepWaiterHook,
    GradNormHook,
    HashTableFilterHook,
    HistorySaverHook,
    LearningRateHook,
    LoggerHook,
    LoggingTensorHook,
    MetricReportHook,
    MLTrackerHook,
    NanTensorHook,
    NvtxHook,
    OOMObserverHook,
    ProfilerHook,
    ProgressBarHook,
    ReportArguments,
    StepCounterHook,
    StopAtStepHook,
    SummarySaverHook,
    TimerHook,
    TraceHook,
    TraceToOdpsHook,
)
from recis_async.nn import DynamicEmbedding, EmbeddingOption, FilterHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker, MlflowTracker, TensorBoardTracker

EVERY = 5  # the cadence of every periodic hook below (log, save, report, filter, window)
BATCHES = 10  # training batches per pass
EPOCHS = 2
EVAL_BATCHES = 3
ROWS = 16  # rows per batch
STEPS = BATCHES * EPOCHS

# Trace columns: host ids, and device values of float32, bfloat16 and int64 (2-D as arrays).
FIELDS = ["user_id", "pred", "pred_bf16", "label", "emb"]
TYPES = ["bigint", "float", "float", "bigint", "array<float>"]
METRICS = ["loss", "acc"]  # add_metric'd every step (the Trainer: from the model's dict)
TRACKED = ["train_loss", "positives"]  # add_to_ml_tracker'd every training step


def ordinary(where: Any) -> bool:
    """Whether a :class:`Where` label names an ordinary step: one no hook's cadence names.

    With every periodic hook at ``EVERY`` (5) steps, the boundaries are

    * ``global_step % 5 == 4`` -- the steps completing 5, 10, ... steps of the job (counted on
      ``global_step``): ``LoggerHook`` lines, ``HistorySaverHook`` intervals,
      ``SummarySaverHook``, the optimizer hooks' windows (``ClipGradNormHook``,
      ``GradNormHook``, ``LearningRateHook``), ``MetricReportHook``, ``DeviceStatsHook``,
      ``CheckpointSaverHook`` saves;
    * ``global_step % 5 == 0`` -- the steps after them: ``LoggingTensorHook`` (the first step,
      then every 5th), ``StepCounterHook`` (the rates of an interval, measured at the next
      ``BeforeStep``, ride on that step), ``HashTableFilterHook`` (anchored at the first step:
      evictions at 5, 10, ...), ``MetricReportHook``'s FLOP count at step 0;
    * everything that is not a step: ``Start``, the ends of passes (``OutOfData`` through
      ``AfterEval``: the evaluation's aggregate, ``EarlyStoppingHook``, the eval summary
      line), ``AfterEpoch``, ``End`` and the close.

    So the ordinary training steps are those with ``global_step % 5`` in 1, 2, 3 (12 of the
    20), and every evaluation step is ordinary: an evaluation pass is read once, at its end.
    """
    if isinstance(where, tuple) and where[0] == "train":
        return where[1] % EVERY not in (0, EVERY - 1)
    return isinstance(where, tuple) and where[0] == "eval"


class Labelled(Protocol):
    """What :class:`Where` labels: anything with a writable ``where``."""

    where: Any


class Where(Hook):
    """Labels the reads that follow each event: ``("train", global_step)``,
    ``("eval", global_step, local_step)``, or the boundary's name.  Runs before every other
    subscriber (``NvtxHook`` runs at ``HIGHEST - 1``)."""

    priority = -(10**6)

    def __init__(self, *counters: Labelled) -> None:
        self.counters = counters
        self.seen: list[Any] = []

    def _label(self, where: Any) -> None:
        self.seen.append(where)
        for counter in self.counters:
            counter.where = where

    def start(self, event: Start) -> None:
        self._label("start")

    def before_epoch(self, event: BeforeEpoch) -> None:
        self._label(("before_epoch", event.epoch))

    def before_step(self, event: BeforeStep) -> None:
        if event.is_train:
            self._label(("train", event.global_step))
        else:
            self._label(("eval", event.global_step, event.local_step))

    def out_of_data(self, event: OutOfData) -> None:
        self._label(("out_of_data", "train" if event.is_train else "eval", event.global_step))

    def after_train(self, event: AfterTrain) -> None:
        self._label(("after_train", event.global_step))

    def after_epoch(self, event: AfterEpoch) -> None:
        self._label(("after_epoch", event.epoch))

    def end(self, event: End) -> None:
        self._label("end")


# --------------------------------------------------------------------------- model and data


class CtrModel(torch.nn.Module):
    """A dynamic user table (ids on the host, as the loader gives them) and an MLP over the
    user row and the dense features; ``model(batch)`` returns ``{"loss", "acc", "pred",
    "emb"}`` (the Trainer's dict convention: ``acc`` becomes a metric of the step, the
    per-row outputs are left out).  With ``record`` it also traces and tracks the step's
    tensors itself, as a model under the Trainer does."""

    def __init__(self, device: torch.device | str = "cpu", *, record: bool = False) -> None:
        super().__init__()
        self.record = record
        self.user = DynamicEmbedding(
            EmbeddingOption(
                embedding_dim=8,
                shared_name="user",
                combiner="mean",
                filter_hook=FilterHook("GlobalStepFilter", {"filter_step": 3}),
                initializer=functools.partial(torch.nn.init.normal_, std=0.05),
            )
        )
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(8 + 4, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.to(device)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        user = self.user(batch["user_id"].unsqueeze(1))  # one id per bag
        logits = self.mlp(torch.cat([user, batch["x"]], dim=1)).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
        pred = torch.sigmoid(logits.detach())
        acc = ((pred > 0.5).float() == batch["label"]).float().mean()
        if self.record:
            record(batch, pred, user.detach(), loss.detach(), train=self.training)
        return {"loss": loss, "acc": acc, "pred": pred, "emb": user.detach()}


def record(
    batch: dict[str, torch.Tensor],
    pred: torch.Tensor,
    emb: torch.Tensor,
    loss: torch.Tensor,
    *,
    train: bool,
) -> None:
    """What every step records: trace columns (host ids; device float32, bfloat16, int64,
    a 2-D float32) and, in training, tracked device scalars (float32, int64)."""
    add_to_trace("user_id", batch["user_id"])
    add_to_trace("pred", pred)
    add_to_trace("pred_bf16", pred.to(torch.bfloat16))
    add_to_trace("label", batch["label"].long())
    add_to_trace("emb", emb)
    if train:
        add_to_ml_tracker("train_loss", loss)
        add_to_ml_tracker("positives", batch["label"].long().sum())


def batches(n: int, *, seed: int, device: torch.device | str = "cpu") -> list[dict[str, Any]]:
    """``n`` batches: ids on the host (a loader's), dense features and labels on ``device``
    (already moved: the step itself is what is measured)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 40, (ROWS,), generator=gen) * 1_000_003
        x = torch.randn(ROWS, 4, generator=gen)
        label = (x[:, 0] + 0.3 * torch.randn(ROWS, generator=gen) > 0).float()
        out.append({"user_id": ids, "x": x.to(device), "label": label.to(device)})
    return out


def optimizer(model: CtrModel) -> torch.optim.Optimizer:
    """SGD with momentum: torch's Adam keeps its step count in a host tensor and reads it
    with ``.item()`` in every ``step()`` (no device synchronization, as it is on the host,
    but a read the CPU count cannot tell from one)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.user.attach_optimizer(opt)
    return opt


# --------------------------------------------------------------------------- the hooks


class _NoRanges:
    """NVTX ranges that go nowhere (the CPU has no NVTX); on CUDA the hook's default is used."""

    def range_push(self, msg: str) -> None: ...
    def range_pop(self) -> None: ...


def every_hook(
    tmp: Path, model: CtrModel, opt: torch.optim.Optimizer, odps_config: dict[str, Any]
) -> list[Hook]:
    """One of every built-in hook, each at the cadence ``EVERY`` where it has one (so the
    boundaries are those :func:`ordinary` names), writing under ``tmp``."""
    spill = tmp / "spill"
    ranges = None if torch.cuda.is_available() else _NoRanges()
    return [
        LoggerHook(log_step=EVERY),
        ProgressBarHook(file=io.StringIO()),
        NanTensorHook(),
        StepCounterHook(every_n_steps=EVERY),
        EarlyStoppingHook("loss", patience=100),
        TraceHook(ParquetSink(tmp / "trace", "proof", "dt=1"), FIELDS, TYPES, spill_dir=spill),
        TraceToOdpsHook(odps_config, FIELDS, TYPES, spill_dir=spill),
        MLTrackerHook("proof", "jsonl", tracker=JsonlTracker(tmp / "jsonl"), spill_dir=spill),
        MLTrackerHook(
            "proof", "tensorboard", tracker=TensorBoardTracker(tmp / "tb"), spill_dir=spill
        ),
        *(
            # an optional extra: CI's test extra installs it; a GPU image may not have it
            [
                MLTrackerHook(
                    "proof",
                    "mlflow",
                    tracker=MlflowTracker(f"sqlite:///{tmp / 'mlflow.db'}"),
                    spill_dir=spill,
                )
            ]
            if importlib.util.find_spec("mlflow")
            else []
        ),
        CheckpointSaverHook(tmp / "ckpt", save_steps=EVERY, model=model, optimizer=opt),
        HashTableFilterHook(EVERY, model=model),
        MetricReportHook(model, ReportArguments(interval_step=EVERY)),
        ClipGradNormHook(max_norm=1.0, log_steps=EVERY),
        GradNormHook(per_layer=True, log_steps=EVERY),
        LearningRateHook(log_steps=EVERY, momentum=True),
        SummarySaverHook(EVERY, tmp / "summary", model=model),
        HistorySaverHook(EVERY, tmp / "history"),
        LoggingTensorHook([*METRICS, "train_loss"], every_n_iter=EVERY),
        DeviceStatsHook(every_n_steps=EVERY),
        OOMObserverHook(tmp / "oom"),
        NvtxHook(ranges),
        # the step-time trigger off (a loaded machine would profile at random); the loss
        # trigger, which looks at the loss every step, on
        AnomalyProfilerHook(slowdown=None, output_dir=tmp / "anomaly"),
        ProfilerHook(wait=1, warmup=1, active=1, repeat=1, output_dir=tmp / "profile"),
        TimerHook(3600),
        StopAtStepHook(last_step=10_000),
        GlobalStepWaiterHook(0, lambda: 0, poll_interval=0.01),
    ]


# Built-in hooks deliberately not on the bus, each with the reason.  A hook added to the
# package later is neither here nor in every_hook(), and test_every_built_in_hook_is_counted
# fails until it is put in one of the two.
EXCLUDED: dict[str, str] = {}


def built_in_hooks() -> set[str]:
    """The names of every public Hook class defined in the ``recis_async.hooks`` package:
    its exports, and any module in it (a hook not exported yet counts too)."""
    names = {
        name
        for name in recis_async.hooks.__all__
        if inspect.isclass(obj := getattr(recis_async.hooks, name)) and issubclass(obj, Hook)
    }
    for info in pkgutil.iter_modules(recis_async.hooks.__path__):
        module = importlib.import_module(f"recis_async.hooks.{info.name}")
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, Hook)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                names.add(name)
    return names


# --------------------------------------------------------------------------- the loops


def trainer(
    model: CtrModel,
    opt: torch.optim.Optimizer,
    hooks: list[Hook],
    tmp: Path,
    device: torch.device | str = "cpu",
) -> Trainer:
    """The Trainer over ``EPOCHS`` passes, evaluating after each (the model records)."""
    return Trainer(
        model,
        TrainingArguments(
            output_dir=str(tmp / "out"), log_steps=EVERY, train_epoch=EPOCHS, save_steps=None
        ),
        train_dataset=batches(BATCHES, seed=0, device=device),
        eval_dataset=batches(EVAL_BATCHES, seed=1, device=device),
        hooks=hooks,
        dense_optimizers=(opt, None),
        keep_on_host=["user_id"],  # the table's id map is on the host
    )


async def own_loop(
    bus: HookBus,
    model: CtrModel,
    opt: torch.optim.Optimizer,
    device: torch.device | str = "cpu",
) -> None:
    """A hand-written loop publishing what the Trainer publishes, recording in the loop:
    ``EPOCHS`` passes, each followed by an evaluation aggregated with ``MetricAggregator``."""
    train = batches(BATCHES, seed=0, device=device)
    evaluation = batches(EVAL_BATCHES, seed=1, device=device)
    await bus.publish(Start(is_train=True))
    g = 0
    for epoch in range(EPOCHS):
        await bus.publish(BeforeEpoch(epoch=epoch))
        model.train()
        for local, batch in enumerate(train):
            at = _At(True, g, local, epoch)
            await bus.publish(at(BeforeStep))
            await bus.publish(at(AfterData))
            out = model(batch)
            loss = out["loss"]
            loss.backward()
            await bus.publish(at(AfterBackward, sync=True))
            await bus.publish(at(BeforeOptimizerStep, optimizers=(opt,)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            await bus.publish(at(AfterOptimizerStep, optimizers=(opt,)))
            add_metric("loss", loss.detach())
            add_metric("acc", out["acc"])
            record(batch, out["pred"], out["emb"], loss.detach(), train=True)
            await bus.publish(at(AfterStep, samples=ROWS))
            g += 1
        await bus.publish(AfterTrain(global_step=g, epoch=epoch))
        await _evaluate(bus, model, evaluation, g, epoch)
        await bus.publish(AfterEpoch(epoch=epoch, global_step=g))


E = TypeVar("E", bound=StepEvent)


class _At(NamedTuple):
    """Where a step is: builds that step's events."""

    is_train: bool
    global_step: int
    local_step: int
    epoch: int

    def __call__(self, cls: type[E], **extra: Any) -> E:
        return cls(
            is_train=self.is_train,
            global_step=self.global_step,
            local_step=self.local_step,
            epoch=self.epoch,
            **extra,
        )


async def _evaluate(
    bus: HookBus, model: CtrModel, data: list[dict[str, Any]], g: int, epoch: int
) -> None:
    model.eval()
    aggregator = MetricAggregator()
    with bus.subscribe(AfterStep, aggregator.update, when=lambda e: not e.is_train):
        for local, batch in enumerate(data):
            at = _At(False, g, local, epoch)
            await bus.publish(at(BeforeStep))
            await bus.publish(at(AfterData))
            with torch.no_grad():
                out = model(batch)
            add_metric("loss", out["loss"])
            add_metric("acc", out["acc"])
            record(batch, out["pred"], out["emb"], out["loss"], train=False)
            await bus.publish(at(AfterStep, samples=ROWS))
        at = _At(False, g, len(data), epoch)
        await bus.publish(at(BeforeStep))
        await bus.publish(at(OutOfData))  # the data ran out, as the Trainer publishes
    metrics = await aggregator.compute_all_ranks()
    await bus.publish(AfterEval(global_step=g, steps=aggregator.steps, metrics=metrics))
    model.train()
