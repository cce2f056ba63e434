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

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(FEATURES, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
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


def job_hooks(out: Path, *extra: Hook) -> tuple[list[Hook], Lines, Published]:
    """The hooks every adapter test runs: trace to Parquet, tracker to JSONL, logger, NaN
    check, and the ``Published`` recorder."""
    log = logging.getLogger(f"adapters-test-{out.name}")
    log.propagate = False
    log.setLevel(logging.INFO)
    lines = Lines()
    log.addHandler(lines)
    published = Published(out / "published.txt")
    hooks: list[Hook] = [
        TraceHook(
            ParquetSink(out, "t", rank=0),
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
    assert Counter(ids) == Counter(want), (len(ids), len(want))
    assert sorted(tracked_steps(out)) == steps
    assert not (out / "spill").exists() or not list((out / "spill").iterdir())
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
    import transformers

    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=ROWS,
        num_train_epochs=epochs,
        learning_rate=0.01,
        logging_steps=3,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        **kw,
    )
    trainer = transformers.Trainer(
        model=Net(), args=args, train_dataset=Rows(rows), callbacks=[callback]
    )
    trainer.train()
    return trainer


def ignite_job(
    out: Path, attach_: Callable[[Any], Any], *, rows: int, epochs: int = 1
) -> Any:
    from ignite.engine import Engine

    net = Net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

    def update(engine: Engine, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        optimizer.zero_grad()
        loss = net(**batch)["loss"]
        loss.backward()
        optimizer.step()
        return loss.detach()

    engine = Engine(update)
    attach_(engine)
    loader = torch.utils.data.DataLoader(Rows(rows), batch_size=ROWS, shuffle=False)
    engine.run(loader, max_epochs=epochs)
    return engine


def ids_array(step: int) -> np.ndarray:
    return np.arange(step * ROWS, (step + 1) * ROWS)
