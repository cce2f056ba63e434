"""A framework's distributed job (2 ranks, gloo, CPU) with this library's hooks through its
adapter, where a hook on rank 0 alone requests a stop after step 5.

    python dist_job.py lightning OUT_DIR                  # Lightning starts the second rank
    torchrun --nproc_per_node=2 dist_job.py transformers|ignite OUT_DIR

Each rank traces its batches' ids to Parquet (``OUT_DIR/t``, a file set per rank) and
appends the training steps its hooks were handed to ``OUT_DIR/published<rank>.txt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import peers_support as ps  # noqa: E402

from recis_async.hook import Hook  # noqa: E402
from recis_async.hooks import TraceHook  # noqa: E402
from recis_async.sinks import ParquetSink  # noqa: E402

STEPS = 30
STOP_AT = 5


class StopOnRankZero(Hook):
    """Requests a stop at training step ``STOP_AT``, on rank 0 only (a NaN seen by one
    rank, a hook reading a file only one rank has)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.bus: Any = None

    def attach(self, bus: Any) -> None:
        self.bus = bus

    def after_step(self, event: Any) -> None:
        if event.is_train and event.global_step == STOP_AT and self.rank == 0:
            self.bus.request_stop("rank 0 alone")


def hooks(out: Path, rank: int) -> list[Hook]:
    return [
        TraceHook(
            ParquetSink(out, "t", rank=rank), ["id"], ["bigint"], spill_dir=out / f"spill{rank}"
        ),
        StopOnRankZero(rank),
        ps.Published(out / f"published{rank}.txt"),
    ]


def lightning(out: Path) -> None:
    import lightning.pytorch as pl

    from recis_async.adapters.lightning import RecisCallback

    rank = int(os.environ.get("LOCAL_RANK", "0"))  # set by Lightning for the rank it starts
    trainer = pl.Trainer(
        max_steps=STEPS,
        strategy="ddp",
        devices=2,
        accelerator="cpu",
        callbacks=[RecisCallback(hooks(out, rank))],
        default_root_dir=str(out / "pl"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(ps.Rows(ps.ROWS * 2 * STEPS), batch_size=ps.ROWS)
    trainer.fit(ps.lightning_module(), loader)


def transformers(out: Path) -> None:
    import transformers

    from recis_async.adapters.transformers import RecisTrainerCallback

    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"),
        per_device_train_batch_size=ps.ROWS,
        max_steps=STEPS,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
        train_sampling_strategy="sequential",
    )
    rank = int(os.environ["RANK"])
    trainer = transformers.Trainer(
        model=ps.Net(),
        args=args,
        train_dataset=ps.Rows(ps.ROWS * 2 * STEPS),
        callbacks=[RecisTrainerCallback(hooks(out, rank))],
    )
    trainer.train()


def ignite(out: Path) -> None:
    import torch.distributed as tdist

    from recis_async.adapters.ignite import attach

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    engine, _ = ps.ignite_engine(torch.nn.parallel.DistributedDataParallel(ps.Net()))
    attach(engine, hooks(out, rank))
    data = ps.Rows(ps.ROWS * 2 * STEPS)
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    engine.run(torch.utils.data.DataLoader(data, batch_size=ps.ROWS, sampler=sampler))
    tdist.destroy_process_group()


if __name__ == "__main__":
    framework, out = sys.argv[1], Path(sys.argv[2])
    {"lightning": lightning, "transformers": transformers, "ignite": ignite}[framework](out)
