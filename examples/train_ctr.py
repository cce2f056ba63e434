"""The main job: a CTR model with dynamic embedding tables, trained by the Trainer on the bus.

Synthetic click data is made from a seed: users and items are int64 ids from a 2**40 space
(no vocabulary), each with a hidden taste vector; a click depends on how well user and item
match plus dense features, so there is something real to learn.  The model is an MLP over
``DynamicEmbedding`` user and item vectors (``GlobalStepFilter`` evicts ids not seen for a
while) and the dense features.

Every hook of the catalogue that a RecIS job uses is on the bus: logging, experiment tracking
(JSONL), sample traces (Parquet by default, ODPS when ``ODPS_PROJECT`` and the other settings
below are in the environment), metric reports, hash-table filtering, checkpoints, a profiler
window and a progress bar.  The library logs where each output goes as the run starts and
sums them up at the end (stderr); the script then prints the held-out AUC.

    python examples/train_ctr.py [--steps 2000] [--output-dir output/ctr] [--seed 7] [--device cuda]

``--device cuda`` trains on a GPU: the Trainer moves the model and each batch there (pinned,
non-blocking copies), except the user and item ids, which the embedding tables' id maps read
on the host; the tables' rows, gradients and Adam state live on the GPU.

Stopped (Ctrl-C, SIGTERM) and run again with the same ``--output-dir``, it continues from its
last checkpoint: the step, the data and the tracked run go on where they stopped.

ODPS (MaxCompute) instead of Parquet: set ``ODPS_PROJECT``, ``ODPS_ENDPOINT`` (and optionally
``ODPS_TABLE``, ``ODPS_PARTITION``, ``ODPS_TUNNEL_ENDPOINT``) plus ``ALIBABA_CLOUD_ACCESS_KEY_ID``
and ``ALIBABA_CLOUD_ACCESS_KEY_SECRET``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import numpy as np
import torch

from recis_async import Hook, Trainer, TrainingArguments, add_to_ml_tracker, add_to_trace
from recis_async.batches import to_device
from recis_async.hooks import (
    HashTableFilterHook,
    LoggerHook,
    MetricReportHook,
    MLTrackerHook,
    ProfilerHook,
    ProgressBarHook,
    ReportArguments,
    TraceHook,
    TraceToOdpsHook,
)
from recis_async.nn import DynamicEmbedding, EmbeddingOption, FilterHook
from recis_async.sinks import ParquetSink
from recis_async.trackers import JsonlTracker

BATCH = 512
DENSE = 8
TASTE = 4
TRACE_FIELDS = ["user_id", "item_id", "label", "score"]
TRACE_TYPES = ["bigint", "bigint", "bigint", "double"]
HOST_KEYS = ("user_id", "item_id", "true_logit")  # ids for the tables' id maps; not model input


class ClickData:
    """Users, items and their hidden tastes, made from ``seed``; batches on demand."""

    def __init__(self, seed: int, users: int = 5_000, items: int = 1_000) -> None:
        self.rng = np.random.default_rng(seed)
        self.user_ids = self.rng.integers(0, 2**40, size=users, dtype=np.int64)
        self.item_ids = self.rng.integers(0, 2**40, size=items, dtype=np.int64)
        self.user_taste = self.rng.normal(size=(users, TASTE))
        self.item_taste = self.rng.normal(size=(items, TASTE))
        self.dense_w = self.rng.normal(size=DENSE) * 0.5
        popularity = 1.0 / np.arange(1, users + 1) ** 0.6  # a few heavy users, a long tail
        self.user_p = popularity / popularity.sum()

    def batch(self, rng: np.random.Generator) -> dict[str, torch.Tensor]:
        u = rng.choice(len(self.user_ids), size=BATCH, p=self.user_p)
        i = rng.integers(0, len(self.item_ids), size=BATCH)
        dense = rng.normal(size=(BATCH, DENSE))
        logit = 1.5 * (self.user_taste[u] * self.item_taste[i]).sum(1) / np.sqrt(TASTE)
        logit += dense @ self.dense_w - 0.5
        label = rng.random(BATCH) < 1.0 / (1.0 + np.exp(-logit))
        return {
            "true_logit": torch.from_numpy(logit),  # not for the model: the AUC ceiling
            "user_id": torch.from_numpy(self.user_ids[u]),
            "item_id": torch.from_numpy(self.item_ids[i]),
            "dense": torch.from_numpy(dense.astype(np.float32)),
            "label": torch.from_numpy(label.astype(np.float32)),
        }

    def batches(self, n: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
        rng = np.random.default_rng(seed)
        return (self.batch(rng) for _ in range(n))


class CTRModel(torch.nn.Module):
    """Dynamic user/item embeddings + dense features -> MLP -> click logit; returns the loss."""

    def __init__(self, dim: int = 16, filter_step: int = 600) -> None:
        super().__init__()
        init = functools.partial(torch.nn.init.normal_, std=0.05)

        def table(name: str) -> DynamicEmbedding:
            return DynamicEmbedding(
                EmbeddingOption(
                    embedding_dim=dim,
                    shared_name=name,
                    combiner="sum",
                    filter_hook=FilterHook("GlobalStepFilter", {"filter_step": filter_step}),
                    initializer=init,
                )
            )

        self.user = table("user")
        self.item = table("item")
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(3 * dim + DENSE, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 1),
        )

    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        u = self.user(batch["user_id"].unsqueeze(1))  # one id per bag
        i = self.item(batch["item_id"].unsqueeze(1))
        return self.mlp(torch.cat([u, i, u * i, batch["dense"]], dim=1)).squeeze(1)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = self.logits(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch["label"])
        if self.training:
            add_to_trace("user_id", batch["user_id"])
            add_to_trace("item_id", batch["item_id"])
            add_to_trace("label", batch["label"].long())
            add_to_trace("score", torch.sigmoid(logits.detach()).double())
            add_to_ml_tracker("loss", loss)
        return loss


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve by the rank statistic (ties averaged)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels.astype(bool)
    n_pos, n_neg = pos.sum(), (~pos).sum()
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def trace_hook(out: Path) -> Hook:
    """TraceToOdpsHook when ODPS settings are in the environment, else Parquet files."""
    env = os.environ
    if env.get("ODPS_PROJECT") and env.get("ODPS_ENDPOINT"):
        config = {
            "project": env["ODPS_PROJECT"],
            "end_point": env["ODPS_ENDPOINT"],
            "table_name": env.get("ODPS_TABLE", "recis_async_ctr_trace"),
            "partition": env.get("ODPS_PARTITION", f"dt={datetime.date.today():%Y%m%d}"),
        }
        if env.get("ODPS_TUNNEL_ENDPOINT"):
            config["tunnel_endpoint"] = env["ODPS_TUNNEL_ENDPOINT"]
        return TraceToOdpsHook(config, TRACE_FIELDS, TRACE_TYPES, size_threshold=4 << 20)
    sink = ParquetSink(out / "trace", "ctr_samples", f"dt={datetime.date.today():%Y%m%d}")
    return TraceHook(sink, TRACE_FIELDS, TRACE_TYPES, size_threshold=4 << 20)


async def main(steps: int, out: Path, seed: int, device: str = "cpu") -> float:
    torch.manual_seed(seed)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    out.mkdir(parents=True, exist_ok=True)
    data = ClickData(seed)
    model = CTRModel()
    tables = [*model.user.parameters(), *model.item.parameters()]
    dense = [p for p in model.parameters() if all(p is not t for t in tables)]
    # embedding rows only move when their id is in the batch: give them a larger step
    optimizer = torch.optim.Adam([{"params": dense}, {"params": tables, "lr": 3e-2}], lr=3e-3)
    model.user.attach_optimizer(optimizer)
    model.item.attach_optimizer(optimizer)
    hparams = {
        "steps": steps,
        "batch": BATCH,
        "dim": 16,
        "lr": 3e-3,
        "table_lr": 3e-2,
        "seed": seed,
    }

    hooks: list[Hook] = [
        LoggerHook(log_step=100),
        MLTrackerHook("ctr", f"seed-{seed}", hparams, tracker=JsonlTracker(out / "runs")),
        trace_hook(out),
        MetricReportHook(model, ReportArguments(interval_step=200)),
        HashTableFilterHook(100, model=model),
        ProfilerHook(wait=20, warmup=5, active=2, repeat=1, output_dir=out / "timeline"),
        ProgressBarHook(),
    ]
    args = TrainingArguments(
        output_dir=str(out / "checkpoints"),
        train_steps=steps,
        log_steps=100,
        save_steps=max(steps // 4, 1),
        max_to_keep=2,
        eval_steps=20,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=data.batches(steps, seed=seed + 1),
        eval_dataset=list(data.batches(20, seed=seed + 2)),
        hooks=hooks,
        dense_optimizers=(optimizer, None),
        device=device,  # moves the model (tables included) there; batches follow
        keep_on_host=HOST_KEYS,
    )
    started = time.monotonic()
    # a job a scheduler restarts: continue from the newest checkpoint (from scratch if none)
    await trainer.train_and_evaluate(resume_from_checkpoint=True)
    seconds = time.monotonic() - started

    model.eval()
    labels, scores, truth = [], [], []
    with torch.no_grad():
        for batch in data.batches(40, seed=seed + 3):  # held out: never trained on
            labels.append(batch["label"].numpy())
            logits = model.logits(to_device(batch, trainer.device, HOST_KEYS))
            scores.append(torch.sigmoid(logits).cpu().numpy())
            truth.append(batch["true_logit"].numpy())
    held_out_auc = auc(np.concatenate(labels), np.concatenate(scores))
    ceiling = auc(np.concatenate(labels), np.concatenate(truth))

    print(f"\ntrained {trainer.global_step} steps in {seconds:.1f} s")
    print(
        f"held-out AUC: {held_out_auc:.3f}  (0.5 is chance; the true click probabilities "
        f"score {ceiling:.3f})"
    )
    users, items = model.user.table.ids_count(), model.item.table.ids_count()
    print(f"ids in the tables: {users} users, {items} items")
    return held_out_auc


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--output-dir", type=Path, default=Path("output/ctr"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--device", default="cpu", help="where to train: cpu, cuda, cuda:1...")
    opts = parser.parse_args()
    result = anyio.run(main, opts.steps, opts.output_dir, opts.seed, opts.device)
    sys.exit(0 if result > 0.5 else 1)
