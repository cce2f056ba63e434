"""One small job per framework, with this library's hooks on it through its adapter, and the
read-back of what the hooks delivered (shared by the adapter tests and the Ctrl-C script).

Every batch holds ``ROWS`` rows whose ids are numbered from 0 in the data's order (no
shuffling), and the model's code traces them (``add_to_trace("id", ids)``) and tracks the
batch's first id (``add_to_ml_tracker``), so the Parquet rows and the tracker's records say
which steps the hooks received.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import torch

from recis_async import add_to_ml_tracker, add_to_trace
from recis_async.hook import Hook
from recis_async.hooks import LoggerHook, MLTrackerHook, NanTensorHook, TraceHook
from recis_async.priority import Priority
from recis_async.sinks import ParquetSink
from recis_async.trace.base import Attempt
from recis_async.trace.buffer import Batch
from recis_async.trackers import JsonlTracker, read_records

ROWS = 8
FEATURES = 4

# no downloads, no telemetry, no progress bars in the frameworks
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("DISABLE_MLFLOW_INTEGRATION", "TRUE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class Rows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` rows: ``id`` (0..n-1), features ``x`` and a target ``y``."""

    def __init__(self, n: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, FEATURES, generator=g)
        self.y = self.x.sum(1, keepdim=True) + 0.1 * torch.randn(n, 1, generator=g)
        self.ids = torch.arange(n)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i], "ids": self.ids[i]}


class Net(torch.nn.Module):
    """A linear regression whose forward records the batch for the hooks and returns
    ``{"loss": ...}`` (Hugging Face's convention)."""

    fail_at: int | None = None  # raise RuntimeError("boom") at the batch holding id fail_at * ROWS

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        if self.training and Net.fail_at is not None and int(ids[0]) == Net.fail_at * ROWS:
            raise RuntimeError("boom")
        if self.training:
            add_to_trace("id", ids)
            add_to_ml_tracker("first_id", ids[:1])
        return {"loss": torch.nn.functional.mse_loss(self.fc(x), y)}


class Published(Hook):
    """Appends each training ``AfterStep``'s step to ``path`` once every other subscriber ran
    (so the test knows which steps the hooks were handed)."""

    priority = Priority.LOWEST

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self.steps: list[int] = []

    def after_step(self, event: Any) -> None:
        if event.is_train:
            self.steps.append(event.global_step)
            os.write(self.fd, b"%d\n" % event.global_step)

    def end(self, event: Any) -> None:
        os.close(self.fd)


class SlowDisk(ParquetSink):
    """A ParquetSink whose every write first takes ``delay`` seconds: a disk slower than the
    steps (a loaded machine's), so that sealed batches queue behind the write under way."""

    def __init__(self, root: Path, table: str, delay: float) -> None:
        super().__init__(root, table, rank=0)
        self.delay = delay

    def write(self, batch: Batch, attempt: Attempt) -> None:
        time.sleep(self.delay)
        super().write(batch, attempt)


class StopAt(Hook):
    """Requests a stop at the training step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.bus: Any = None

    def attach(self, bus: Any) -> None:
        self.bus = bus

    def after_step(self, event: Any) -> None:
        if event.is_train and event.global_step == self.step:
            self.bus.request_stop(f"StopAt({self.step})")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def job_hooks(
    out: Path, *extra: Hook, write_delay: float = 0.0
) -> tuple[list[Hook], Lines, Published]:
    """The hooks every adapter test runs: trace to Parquet (each write taking ``write_delay``
    seconds more: :class:`SlowDisk`), tracker to JSONL, logger, NaN check, and the
    ``Published`` recorder."""
    log = logging.getLogger(f"adapters-test-{out.name}")
    log.propagate = False
    log.setLevel(logging.INFO)
    lines = Lines()
    log.addHandler(lines)
    published = Published(out / "published.txt")
    hooks: list[Hook] = [
        TraceHook(
            SlowDisk(out, "t", write_delay) if write_delay else ParquetSink(out, "t", rank=0),
            ["id"],
            ["bigint"],
            size_threshold=4 * ROWS * 8,  # a batch every few steps: some delivered mid-run
            spill_dir=out / "spill",
        ),
        MLTrackerHook("adapters", "job", tracker=JsonlTracker(out / "ml"), spill_dir=out / "ml_spill"),
        LoggerHook(log_step=2, logger=log),
        NanTensorHook(),
        *extra,
        published,
    ]
    return hooks, lines, published


def traced_ids(out: Path) -> list[int]:
    files = [str(p) for p in (out / "t").rglob("*.parquet")]
    if not files:
        return []
    return ds.dataset(files, format="parquet").to_table(columns=["id"])["id"].to_pylist()


def tracked_steps(out: Path) -> list[int]:
    return [r.step for path in (out / "ml").rglob("metrics.jsonl") for r in read_records(path)]


def check_delivered(out: Path, steps: Sequence[int], rows_per_epoch: int | None = None) -> None:
    """Every row of the published steps is in the Parquet files once, every step's tracker
    record once, nothing spilled."""
    steps = list(steps)
    assert steps == list(range(len(steps))), steps
    published = [int(s) for s in (out / "published.txt").read_text().split()]
    assert published == steps
    ids = traced_ids(out)
    want: list[int] = []
    for step in steps:
        first = step * ROWS
        if rows_per_epoch:
            first %= rows_per_epoch
        want.extend(range(first, first + ROWS))
    spilled = sorted(p.name for p in (out / "spill").iterdir()) if (out / "spill").exists() else []
    # the spill files are named here: a row missing from Parquet may be in one of them
    assert Counter(ids) == Counter(want), (len(ids), len(want), spilled)
    assert sorted(tracked_steps(out)) == steps
    assert not spilled, spilled
    assert not (out / "ml_spill").exists() or not list((out / "ml_spill").iterdir())


# --------------------------------------------------------------------------- the jobs
def lightning_job(
    out: Path, callback: Any, *, rows: int, epochs: int = 1, max_steps: int = -1, **kw: Any
) -> Any:
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net()

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            loss = self.net(**batch)["loss"]
            self.log("double_loss", 2 * loss.detach(), on_step=True)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    trainer = pl.Trainer(
        max_epochs=epochs,
        max_steps=max_steps,
        callbacks=[callback],
        default_root_dir=str(out / "pl"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
        **kw,
    )
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=ROWS, shuffle=False)
    trainer.fit(Module(), loader)
    return trainer


def hf_job(out: Path, callback: Any, *, rows: int, epochs: int = 1, **kw: Any) -> Any:
    trainer = hf_trainer(out, callback, rows=rows, num_train_epochs=epochs, **kw)
    trainer.train()
    return trainer


def hf_trainer(
    out: Path, callback: Any, *, rows: int, model: torch.nn.Module | None = None, **kw: Any
) -> Any:
    """A Hugging Face ``Trainer`` of ``model`` (a :class:`Net` by default) over ``rows`` rows
    in order, ``ROWS`` a step, with ``callback``; ``kw``: ``TrainingArguments`` over these
    defaults (no checkpoints, a log every 3 steps)."""
    import transformers

    settings: dict[str, Any] = {
        "output_dir": str(out / "hf"),
        "per_device_train_batch_size": ROWS,
        "learning_rate": 0.01,
        "logging_steps": 3,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "remove_unused_columns": False,
        "train_sampling_strategy": "sequential",
    }
    args = transformers.TrainingArguments(**{**settings, **kw})
    return transformers.Trainer(
        model=Net() if model is None else model,
        args=args,
        train_dataset=Rows(rows),
        callbacks=[callback],
    )


def ignite_job(
    out: Path, attach_: Callable[[Any], Any], *, rows: int, epochs: int = 1
) -> Any:
    engine, _ = ignite_engine(Net())
    attach_(engine)
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=ROWS, shuffle=False)
    engine.run(loader, max_epochs=epochs)
    return engine


def ignite_engine(net: torch.nn.Module) -> tuple[Any, torch.optim.Optimizer]:
    """An Ignite engine training ``net`` with SGD (its process function returns the loss
    tensor), and the optimizer."""
    from ignite.engine import Engine

    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def update(engine: Engine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(**batch)["loss"]
        loss.backward()
        optimizer.step()
        return loss.detach()

    return Engine(update), optimizer


def ids_array(step: int) -> np.ndarray:
    return np.arange(step * ROWS, (step + 1) * ROWS)


# --------------------------------------------------------------------------- per framework
FRAMEWORKS = ("lightning", "transformers", "ignite")


def run_job(framework: str, out: Path, hooks: Sequence[Hook], *, rows: int, epochs: int = 1,
            bus: Any = None, fail_at: int | None = None) -> int:
    """Run ``framework``'s job with ``hooks`` through its adapter; returns the framework's own
    count of the steps it ran.  ``fail_at``: the model raises ``RuntimeError("boom")`` at that
    training step (the adapter then opened around the run with ``with``)."""
    if fail_at is not None:
        Net.fail_at = fail_at
    try:
        if framework == "lightning":
            from recis_async.adapters.lightning import RecisCallback

            cb = RecisCallback(hooks, bus=bus)
            return int(lightning_job(out, cb, rows=rows, epochs=epochs).global_step)
        if framework == "transformers":
            from recis_async.adapters.transformers import RecisTrainerCallback

            hf = RecisTrainerCallback(hooks, bus=bus)
            if fail_at is None:
                return int(hf_job(out, hf, rows=rows, epochs=epochs).state.global_step)
            with hf:  # the Trainer tells no callback that it failed
                return int(hf_job(out, hf, rows=rows, epochs=epochs).state.global_step)
        from recis_async.adapters.ignite import attach

        engine = ignite_job(out, lambda e: attach(e, hooks, bus=bus), rows=rows, epochs=epochs)
        return int(engine.state.iteration)
    finally:
        Net.fail_at = None


def checkpoint_and_resume(framework: str, out: Path, first: Hook, second: Hook, *, steps: int) -> None:
    """Train one epoch of ``steps`` steps with ``first`` on the bus, saving a checkpoint at its
    end with the framework's own checkpointing; then resume from it for a second epoch with
    ``second``."""
    rows = ROWS * steps
    if framework == "lightning":
        import lightning.pytorch as pl
        from lightning.pytorch.callbacks import ModelCheckpoint

        from recis_async.adapters.lightning import RecisCallback

        def fit(hook: Hook, epochs: int, ckpt: str | None) -> None:
            trainer = pl.Trainer(
                max_epochs=epochs,
                callbacks=[RecisCallback([hook]), ModelCheckpoint(dirpath=out / "ckpt", filename="c")],
                default_root_dir=str(out / "pl"),
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                accelerator="cpu",
                devices=1,
            )
            loader = torch.utils.data.DataLoader(Rows(rows), batch_size=ROWS, shuffle=False)
            trainer.fit(lightning_module(), loader, ckpt_path=ckpt)

        fit(first, 1, None)
        fit(second, 2, str(out / "ckpt" / "c.ckpt"))
    elif framework == "transformers":
        import transformers

        from recis_async.adapters.transformers import RecisTrainerCallback

        def train(hook: Hook, epochs: int, resume: bool) -> None:
            args = transformers.TrainingArguments(
                output_dir=str(out / "hf"),
                per_device_train_batch_size=ROWS,
                num_train_epochs=epochs,
                save_strategy="epoch",
                report_to=[],
                use_cpu=True,
                disable_tqdm=True,
                remove_unused_columns=False,
                train_sampling_strategy="sequential",
            )
            trainer = transformers.Trainer(
                model=Net(), args=args, train_dataset=Rows(rows),
                callbacks=[RecisTrainerCallback([hook])],
            )
            trainer.train(resume_from_checkpoint=resume or None)

        train(first, 1, False)
        train(second, 2, True)
    else:
        from ignite.engine import Events
        from ignite.handlers import Checkpoint, DiskSaver

        from recis_async.adapters.ignite import attach

        def run(hook: Hook, epochs: int, resume: bool) -> None:
            net = Net()
            engine, optimizer = ignite_engine(net)
            adapter = attach(engine, [hook])
            objects = {"model": net, "optimizer": optimizer, "trainer": engine, "hooks": adapter}
            saver = Checkpoint(objects, DiskSaver(str(out / "ckpt"), require_empty=False), n_saved=1)
            engine.add_event_handler(Events.EPOCH_COMPLETED, saver)
            if resume:
                (path,) = (out / "ckpt").glob("*.pt")
                Checkpoint.load_objects(objects, str(path))
            loader = torch.utils.data.DataLoader(Rows(rows), batch_size=ROWS, shuffle=False)
            engine.run(loader, max_epochs=epochs)

        run(first, 1, False)
        run(second, 2, True)


def lightning_module(net: torch.nn.Module | None = None) -> Any:
    """A LightningModule training ``net`` (a :class:`Net` by default) with SGD."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Net() if net is None else net

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return Module()
