"""SyncHookBus in a notebook, as its user runs it: a plain (not async) cell in a Jupyter kernel
(driven by nbclient), whose thread already runs the kernel's asyncio loop.  No event-loop
juggling: the cell is ordinary synchronous code.  A kernel interrupt (SIGINT, the toolbar's stop
button) stops the loop at the next step boundary; the rows are delivered, the cell ends with
``KeyboardInterrupt`` and the kernel, its loop untouched, runs the next cell."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

SETUP = """
import asyncio, itertools, time
import numpy as np
from recis_async import SyncHookBus, add_metric, add_to_trace
from recis_async.events import AfterStep, BeforeStep
from recis_async.hooks import TraceHook
from recis_async.sinks import ParquetSink

kernel_loop = asyncio.get_running_loop()
published = []

def train(steps=None):
    with SyncHookBus(flush_timeout=30) as bus:
        bus.add_hook(TraceHook(ParquetSink(OUT, "t", rank=0), ["id"], ["bigint"]))
        seen = []
        bus.subscribe(AfterStep, lambda ev: seen.append(ev.metrics["loss"]))
        for step in itertools.count(len(published)):
            bus.publish(BeforeStep(global_step=step))
            add_to_trace("id", np.arange(step * 8, step * 8 + 8))
            add_metric("loss", float(step))
            bus.publish(AfterStep(global_step=step, samples=8))
            published.append(step)
            assert asyncio.get_running_loop() is kernel_loop
            if step == 10 and steps is None:
                open(OUT + "/ready", "w").close()
            if bus.should_stop or step + 1 == steps:
                break
            time.sleep(0.002)
    return seen
"""

RUN = "print(len(train(steps=5)))"

INTERRUPTED = "train()"

CHECK = """
import pyarrow.dataset as ds
ids = ds.dataset(OUT + "/t", format="parquet").to_table()["id"].to_pylist()
print(len(published), sorted(ids) == list(range(len(published) * 8)),
      asyncio.get_running_loop() is kernel_loop)
"""


def test_a_plain_cell_runs_the_sync_bus_and_an_interrupt_stops_it(tmp_path: Path) -> None:
    cells = [f"OUT = {str(tmp_path)!r}", SETUP, RUN, INTERRUPTED, CHECK]
    nb = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells]
    )
    client = nbclient.NotebookClient(nb, timeout=120, allow_errors=True, kernel_name="python3")
    ready = tmp_path / "ready"

    def interrupt_when_ready() -> None:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(client.km.provisioner.process.pid, signal.SIGINT)  # the stop button

    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # this checkout's package in the kernel
    with client.setup_kernel(cwd=str(tmp_path), env=env):
        for i in range(3):
            client.execute_cell(nb.cells[i], i)
        pressing = threading.Thread(target=interrupt_when_ready, daemon=True)
        pressing.start()
        client.execute_cell(nb.cells[3], 3)
        pressing.join()
        client.execute_cell(nb.cells[4], 4)

    def text(i: int, name: str = "stdout") -> str:
        outputs = nb.cells[i].outputs
        return "".join(o["text"] for o in outputs if o.output_type == "stream" and o.name == name)

    for i in (1, 2, 4):
        assert not [o for o in nb.cells[i].outputs if o.output_type == "error"], nb.cells[i]
    assert text(2).strip() == "5", nb.cells[2].outputs
    errors = [o for o in nb.cells[3].outputs if o.output_type == "error"]
    assert [e.ename for e in errors] == ["KeyboardInterrupt"], nb.cells[3].outputs
    assert text(3, "stderr").count("SIGINT received: stopping at the next step") == 1, text(3, "stderr")
    steps, complete, same_loop = text(4).split()
    assert int(steps) >= 11 and complete == "True" and same_loop == "True", nb.cells[4].outputs
