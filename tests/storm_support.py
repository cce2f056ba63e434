"""Counting back what tests/scripts/storm_loop.py owes after it was stopped by signals."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow.dataset as ds

from recis_async.sinks import ParquetSink
from recis_async.spill import read_spill, replay_spill
from recis_async.trackers import read_records

ROWS = 32  # rows per step, as in the script


def ids_in_parquet(out: Path) -> list[int]:
    files = [str(p) for p in (out / "t").rglob("*.parquet")]
    if not files:
        return []
    return ds.dataset(files, format="parquet").to_table(columns=["id"])["id"].to_pylist()


def account_for_every_row(tmp_path: Path, *, single: bool, stderr: str = "") -> list[int]:
    """Every row of every ``AfterStep`` publish that returned is in the Parquet dataset or in a
    spill file, none twice, and replaying the spill files delivers each once; the tracker's
    records are in its store or its spill files, none twice.  ``single``: one stop signal,
    which drains everything (no spill file).  Returns the published steps."""
    published = [int(x) for x in (tmp_path / "published.txt").read_text().split()]
    assert published == list(range(len(published)))
    owed = set(range(len(published) * ROWS))
    # the step cancelled mid-publish (a second signal) may or may not have been kept
    allowed = set(range((len(published) + 1) * ROWS))

    # Parquet + spill: every owed row, none twice
    delivered = ids_in_parquet(tmp_path)
    spills = sorted((tmp_path / "spill").glob("*.arrows")) if (tmp_path / "spill").exists() else []
    spilled = [
        i
        for path in spills
        for entry in read_spill(path).entries
        for i in entry.batch.to_arrow()["id"].to_pylist()
    ]
    counts = Counter(delivered + spilled)
    assert not [i for i, n in counts.items() if n > 1], "rows both delivered and spilled"
    assert owed <= counts.keys() <= allowed, (len(owed), len(counts), stderr)
    if single:
        assert not spills, "a single signal drains everything"

    # replay: the sink then holds each row exactly once, and the spill files are gone
    for path in spills:
        replay_spill(path, ParquetSink(tmp_path, "t", rank=0))
        assert not path.exists()
    final = Counter(ids_in_parquet(tmp_path))
    assert max(final.values()) == 1
    assert owed <= final.keys() <= allowed

    # the tracker: its store plus its spill files hold every published step's value once
    stores = list((tmp_path / "ml").rglob("metrics.jsonl"))
    ml_spills = (
        list((tmp_path / "ml_spill").glob("*.jsonl")) if (tmp_path / "ml_spill").exists() else []
    )
    steps = Counter(r.step for path in stores + ml_spills for r in read_records(path))
    assert not [s for s, n in steps.items() if n > 1], "tracker records duplicated"
    assert set(published) <= steps.keys() <= set(range(len(published) + 1))
    return published
