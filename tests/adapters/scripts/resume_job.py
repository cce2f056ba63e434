"""A framework's job that checkpoints with the framework's own checkpointing, killed and resumed.

    python resume_job.py lightning|transformers|ignite OUT_DIR [--kill-after STEP] [--resume]

``STEPS`` training steps of ``peers_support.ROWS`` rows, a checkpoint every ``EVERY`` steps,
the trace hook writing each step's ids and step number to Parquet (a batch every two steps,
so rows reach the disk during the run).  ``--kill-after STEP``: at that step the job waits
until the rows of the steps before the last one are on disk, prints ``ready`` and waits to be
killed (the test sends SIGKILL: a preemption with no grace).  ``--resume``: resume from the
newest checkpoint in ``OUT_DIR``, as the framework resumes, and run to the end.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers_support as ps  # noqa: E402

from recis_async import add_to_trace  # noqa: E402
from recis_async.hook import Hook  # noqa: E402
from recis_async.hooks import TraceHook  # noqa: E402
from recis_async.sinks import ParquetSink  # noqa: E402

STEPS = 48
EVERY = 8


class Net(ps.Net):
    """Traces the batch's ids and the framework's own number for the step under way."""

    step: Callable[[], int] = staticmethod(lambda: 0)  # set by the job once its loop exists

    def forward(self, x: torch.Tensor, y: torch.Tensor, ids: torch.Tensor) -> dict[str, Any]:
        if self.training:
            add_to_trace("id", ids)
            add_to_trace("step", torch.full_like(ids, Net.step()))
        return {"loss": torch.nn.functional.mse_loss(self.fc(x), y)}


class KillPoint(Hook):
    """At training step ``step``: wait (on the bus: the writer keeps going) until the Parquet
    files hold every step before it, print ``ready``, then wait to be killed."""

    def __init__(self, out: Path, step: int) -> None:
        self.out, self.step = out, step

    async def after_step(self, event: Any) -> None:
        if not event.is_train or event.global_step != self.step:
            return
        with anyio.fail_after(60):
            while not written_steps(self.out) >= set(range(self.step)):
                await anyio.sleep(0.02)
        print("ready", flush=True)
        await anyio.sleep(3600)


def written_steps(out: Path) -> set[int]:
    import pyarrow.dataset as ds

    files = [str(p) for p in (out / "t").rglob("*.parquet")]
    if not files:
        return set()
    return set(ds.dataset(files, format="parquet").to_table(columns=["step"])["step"].to_pylist())


def hooks(out: Path, kill_after: int | None) -> list[Hook]:
    trace = TraceHook(
        ParquetSink(out, "t", rank=0),
        ["id", "step"],
        ["bigint", "bigint"],
        size_threshold=2 * ps.ROWS * 16,  # a batch every two steps
        max_age=0.05,
        spill_dir=out / "spill",
    )
    return [trace] if kill_after is None else [trace, KillPoint(out, kill_after)]


def lightning(out: Path, hooks: list[Hook], resume: bool) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from recis_async.adapters.lightning import RecisCallback

    saver = ModelCheckpoint(
        dirpath=out / "ckpt", filename="{step}", every_n_train_steps=EVERY, save_top_k=-1
    )
    trainer = pl.Trainer(
        max_steps=STEPS,
        callbacks=[RecisCallback(hooks), saver],
        default_root_dir=str(out / "pl"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    Net.step = staticmethod(lambda: trainer.global_step)
    ckpt = None
    if resume:
        ckpt = str(max((out / "ckpt").glob("*.ckpt"), key=lambda p: int(p.stem.split("=")[1])))
    loader = torch.utils.data.DataLoader(ps.Rows(ps.ROWS * STEPS), batch_size=ps.ROWS)
    trainer.fit(ps.lightning_module(Net()), loader, ckpt_path=ckpt)


def transformers(out: Path, hooks: list[Hook], resume: bool) -> None:
    from recis_async.adapters.transformers import RecisTrainerCallback

    callback = RecisTrainerCallback(hooks)
    trainer = ps.hf_trainer(
        out,
        callback,
        rows=ps.ROWS * STEPS,
        model=Net(),
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=EVERY,
    )
    Net.step = staticmethod(lambda: trainer.state.global_step)
    trainer.train(resume_from_checkpoint=resume or None)


def ignite(out: Path, hooks: list[Hook], resume: bool) -> None:
    from ignite.engine import Events
    from ignite.handlers import Checkpoint, DiskSaver

    from recis_async.adapters.ignite import attach

    net = Net()
    engine, optimizer = ps.ignite_engine(net)
    adapter = attach(engine, hooks)
    objects = {"model": net, "optimizer": optimizer, "trainer": engine, "hooks": adapter}
    saver = Checkpoint(objects, DiskSaver(str(out / "ckpt"), require_empty=False), n_saved=None)
    engine.add_event_handler(Events.ITERATION_COMPLETED(every=EVERY), saver)
    Net.step = staticmethod(lambda: engine.state.iteration - 1)
    if resume:
        newest = max((out / "ckpt").glob("*.pt"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
        Checkpoint.load_objects(objects, str(newest))
    loader = torch.utils.data.DataLoader(ps.Rows(ps.ROWS * STEPS), batch_size=ps.ROWS)
    engine.run(loader, max_epochs=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=("lightning", "transformers", "ignite"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-after", type=int)
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    run = {"lightning": lightning, "transformers": transformers, "ignite": ignite}
    run[args.framework](args.out, hooks(args.out, args.kill_after), args.resume)
    print("done", flush=True)


if __name__ == "__main__":
    main()
